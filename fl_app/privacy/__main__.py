"""``python -m fl_app.privacy``: the privacy budget calculator (an entry point: :mod:`fl_app.calculator`)."""

import sys

from fl_app.calculator import main

sys.exit(main())
