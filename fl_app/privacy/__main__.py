"""``python -m fl_app.privacy``: the privacy budget calculator (see :mod:`fl_app.privacy.cli`)."""

import sys

from fl_app.privacy.cli import main

sys.exit(main())
