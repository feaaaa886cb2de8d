"""Wall-clock marks of a run's phases, for the start-up benchmark (opt-in, off by default).

With ``DPFL_TIMELINE=<file>`` in the environment, :func:`mark` appends one JSON line per phase
boundary to that file: ``{"phase": ..., "t": <time.time()>, "pid": ...}``. ``benchmarks/startup.py``
launches ``python -m fl_app`` with it set and turns the marks into the time before round 1 and after
the last round, phase by phase. Without the variable :func:`mark` does nothing. The marks are
process-level timings only (imports, Ray, data loading, plots); none of them depends on a cohort, and
they go to a file the benchmark names, never into a run's published output.
"""

from __future__ import annotations

import json
import os
import time

#: Environment variable naming the file the marks are appended to.
TIMELINE_ENV = "DPFL_TIMELINE"


def mark(phase: str) -> None:
    """Record that ``phase`` was reached now (nothing unless :data:`TIMELINE_ENV` is set)."""
    path = os.environ.get(TIMELINE_ENV)
    if not path:
        return
    line = json.dumps({"phase": phase, "t": time.time(), "pid": os.getpid()})
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(line + "\n")
