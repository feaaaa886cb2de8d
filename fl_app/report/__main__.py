"""``python -m fl_app.report <runs or sweeps> --out <folder>``: one table and the plots for many runs."""

import sys

from fl_app.report.sweep import main

sys.exit(main())
