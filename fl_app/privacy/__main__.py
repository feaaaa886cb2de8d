"""``python -m fl_app.privacy``: the privacy budget calculator (:mod:`fl_app.report.calculator`)."""

import sys

from fl_app.report.calculator import main

sys.exit(main())
