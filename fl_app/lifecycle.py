"""How a run ends: stop requests (SIGINT/SIGTERM), run-level failures, and the final status.

``results.json`` ``status`` is one of :data:`STATUSES`:

* ``completed``: every round ran and no client failed;
* ``completed_with_failures``: every round ran; some clients failed, never more than
  ``simulation.max_failure_fraction`` of a round's cohort (counts in ``final.failures``);
* ``failed``: the run stopped early (:class:`RunFailed`: a round without a valid reply, too many
  failures, a dead worker); the command exits with status 1 and one line naming the reason;
* ``interrupted``: SIGINT or SIGTERM (:class:`RunInterrupted`); exit status 130 or 143.

A run that did not complete keeps its checkpoint (``private_server_state.pkl``, the server's
private state: readable by its owner only) and can be continued
with ``python -m fl_app resume=<output dir>``.

The signal handlers only *request* a stop (:data:`STOP`): the server thread sees it between two
pulls of replies (:func:`raise_if_stopped`), abandons the round in flight, writes the results with
the privacy ledger of every completed round, and returns; the simulation engine then stops its
workers and Ray. A second signal gets Python's default behaviour (an immediate exit).
"""

from __future__ import annotations

import math
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType
from typing import Any

STATUSES = ("completed", "completed_with_failures", "failed", "interrupted")
#: The statuses of a run whose every round ran (a report keeps them, a continued sweep skips them).
COMPLETED_STATUSES = STATUSES[:2]
#: A run whose final loss is more than this many times its initial model's has diverged.
DIVERGENCE_FACTOR = 3.0


def diverged(initial_loss: float | None, final_loss: float | None) -> bool:
    """Whether the final loss is not finite or above :data:`DIVERGENCE_FACTOR` x the initial model's."""
    if final_loss is None:
        return False
    if not math.isfinite(final_loss):
        return True
    return initial_loss is not None and final_loss > DIVERGENCE_FACTOR * initial_loss


#: Set by the first SIGINT/SIGTERM of a ``python -m fl_app`` run (or by tests).
STOP = threading.Event()
_signal_received: list[int] = []


class RunStopped(Exception):  # noqa: N818 (control flow, like KeyboardInterrupt)
    """A run ended before its last round; ``status`` and ``exit_code`` say how."""

    status = "failed"
    exit_code = 1


class RunFailed(RunStopped):
    """The run cannot go on (the message is one line naming the reason)."""


class RunInterrupted(RunStopped):
    """SIGINT or SIGTERM asked the run to stop."""

    status = "interrupted"

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self.exit_code = 128 + signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


@dataclass(frozen=True)
class Outcome:
    """How the last run of this process ended (read by the ``python -m fl_app`` driver)."""

    status: str
    exit_code: int
    reason: str
    output_dir: str
    #: What the checkpoint holds, when the run can continue (None: no round completed, nothing to resume).
    private_state: str | None = None

    def resume_hint(self) -> str:
        """Where the results are and how to continue, or that there is nothing to continue."""
        if self.private_state is None:
            return f"results in {self.output_dir}; nothing to resume (no round completed)"
        return (
            f"results in {self.output_dir}; continue with: python -m fl_app resume={self.output_dir} "
            f"({self.private_state})"
        )


_outcome: list[Outcome] = []
#: Set while ``python -m fl_app`` drives the run: it turns the outcome into an exit status.
#: Under ``flwr run`` nobody does, so the ServerApp raises to make Flower record the run as failed.
DRIVER = threading.Event()


def driver_reports_outcome() -> bool:
    """Whether a ``python -m fl_app`` driver reads the outcome (else the ServerApp must raise)."""
    return DRIVER.is_set()


def record_outcome(outcome: Outcome) -> None:
    """Remember how the run ended (the driver turns it into the exit status)."""
    _outcome[:] = [outcome]


def take_outcome() -> Outcome | None:
    """The outcome of the run that just ended, once."""
    return _outcome.pop() if _outcome else None


def stop_requested() -> int | None:
    """The signal number that asked the run to stop, or None."""
    if not STOP.is_set():
        return None
    return _signal_received[0] if _signal_received else int(signal.SIGINT)


def raise_if_stopped() -> None:
    """Raise :class:`RunInterrupted` when a stop was requested."""
    signum = stop_requested()
    if signum is not None:
        raise RunInterrupted(signum)


def request_stop(signum: int) -> None:
    """Ask the running simulation to stop (what the signal handler does)."""
    if not _signal_received:
        _signal_received.append(signum)
    STOP.set()


def _handler(signum: int, frame: FrameType | None) -> None:
    if STOP.is_set():  # second signal: default behaviour, now
        signal.signal(signum, signal.SIG_DFL)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        signal.raise_signal(signum)
        return
    request_stop(signum)
    print(
        f"dpfl: {signal.Signals(signum).name} received: abandoning the current round and stopping "
        "(send it again to exit at once)",
        file=sys.stderr,
        flush=True,
    )


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Drive a run: handle SIGINT and SIGTERM as stop requests while the block runs.

    Signal handlers can only be installed from the main thread; elsewhere the block still
    counts as driven (:func:`driver_reports_outcome`), without handlers.
    """
    on_main = threading.current_thread() is threading.main_thread()
    previous: dict[int, Any] = {}
    if on_main:
        STOP.clear()
        _signal_received.clear()
        previous = {sig: signal.signal(sig, _handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    DRIVER.set()
    try:
        yield
    finally:
        DRIVER.clear()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def reinstall_handlers() -> None:
    """Put the stop handlers back after a library replaced them (Ray's ``init`` sets its own SIGTERM)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _handler)
