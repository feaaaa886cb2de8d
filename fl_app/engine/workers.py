"""The client workers a simulation's engine built: its backend, and how many clients run at once.

Each backend records itself when Flower's engine builds it (:func:`record_workers`): Ray's actor
pool (:mod:`fl_app.engine.pool`, the actors Flower's pool holds), the forked worker processes
(:mod:`fl_app.engine.processes`) or the command's own process (:mod:`fl_app.engine.inline`). The
server reads what was built (:func:`built_workers`) to say how the run's rounds run
(:mod:`fl_app.run.round_path`), instead of deriving a count again from the settings. The engine
builds its backend on its own thread while the ServerApp prepares; the read waits for it, bounded.
One simulation at a time per process (a sweep's jobs run one after another):
:func:`forget_workers` drops the previous run's.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

#: What each backend's workers are, in words.
WORKER_WORDS = {
    "ray": "Ray's client actors",
    "processes": "processes forked from the command",
    "inline": "the command's own process",
}


@dataclass(frozen=True)
class Workers:
    """The engine's client workers: its backend (``ray``, ``processes``, ``inline``) and their number."""

    backend: str
    count: int

    def text(self) -> str:
        """The workers in words, e.g. ``2 workers: processes forked from the command``."""
        plural = "s" if self.count != 1 else ""
        return f"{self.count} worker{plural}: {WORKER_WORDS.get(self.backend, self.backend)}"


_built: Workers | None = None
_recorded = threading.Event()


def record_workers(backend: str, count: int) -> None:
    """Record the workers the engine has just built for the run."""
    global _built
    _built = Workers(backend, int(count))
    _recorded.set()


def forget_workers() -> None:
    """Drop the previous run's record (a run's engine records its own)."""
    global _built
    _built = None
    _recorded.clear()


def built_workers(wait_s: float, stop: Callable[[], bool] = lambda: False) -> Workers | None:
    """The workers the engine built, waiting up to ``wait_s`` for it to build them; None if it did not.

    ``stop``: checked between short waits; a true answer ends the wait at once (a stop request).
    """
    deadline = time.monotonic() + wait_s
    while not _recorded.wait(timeout=max(0.0, min(0.2, deadline - time.monotonic()))):
        if stop() or time.monotonic() >= deadline:
            return None
    return _built
