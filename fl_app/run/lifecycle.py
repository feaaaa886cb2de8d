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
workers and Ray. A signal repeated within :func:`signal_grace_s` (2 s) of the first is the same
request: GNU ``timeout``, ``scancel`` and container runtimes signal the command and then its whole
process group, so the command gets it twice within microseconds. A signal after that grace period
gets Python's default behaviour (an immediate exit): the user clearly repeated it.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
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
#: When the handler took the current run's first signal (:func:`time.monotonic`; a signal after the
#: grace period exits at once). Not :data:`STOP`: a run asked to stop by the command's stop file must
#: still take its own first signal.
_signals_handled: list[float] = []

#: Environment variable: seconds after a first stop signal within which a repeat is the same request.
SIGNAL_GRACE_ENV = "DPFL_SIGNAL_GRACE_S"
#: Its default: far above the microseconds between ``timeout``'s two copies, below a person's second Ctrl-C.
SIGNAL_GRACE_S = 2.0


def signal_grace_s() -> float:
    """Seconds after the first SIGINT/SIGTERM within which a repeat is the same stop request.

    :data:`SIGNAL_GRACE_S`, or ``$DPFL_SIGNAL_GRACE_S`` when it holds a number >= 0.
    """
    try:
        value = float(os.environ.get(SIGNAL_GRACE_ENV, ""))
    except ValueError:
        return SIGNAL_GRACE_S
    return value if math.isfinite(value) and value >= 0 else SIGNAL_GRACE_S


def repeated_at_once(first: list[float]) -> bool:
    """Whether a signal now repeats, within the grace period, the first one (taken at ``first[0]``).

    ``first`` empty (no signal yet): records now as the first signal's time, returns False.
    """
    if not first:
        first.append(time.monotonic())
        return False
    return time.monotonic() - first[0] <= signal_grace_s()


def grace_text(signum: int) -> str:
    """What the first signal's message says about a second one."""
    name = signal.Signals(signum).name
    return f"send {name} again {signal_grace_s():g} s or more after this to exit at once"


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
    #: Why the run can never be continued (no checkpoint was written), or None.
    not_resumable: str | None = None


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


def as_requested_stop(stop: RunStopped) -> RunStopped:
    """A run failure while a stop was requested is that stop (:class:`RunInterrupted`).

    A signal to the command's process group (``timeout``, a scheduler, ``docker stop``) also reaches
    the simulation's workers: their deaths fail the round the stop abandons anyway.
    """
    signum = stop_requested()
    return RunInterrupted(signum) if isinstance(stop, RunFailed) and signum is not None else stop


def clear_stop() -> None:
    """Forget any stop request and the signals taken (a new run in this process starts clean)."""
    STOP.clear()
    _signal_received.clear()
    _signals_handled.clear()


def request_stop(signum: int) -> None:
    """Ask the running simulation to stop (what the signal handler does)."""
    if not _signal_received:
        _signal_received.append(signum)
    STOP.set()


def _exit_at_once(signum: int) -> None:
    """A second signal: Python's default behaviour for it, now."""
    signal.signal(signum, signal.SIG_DFL)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    signal.raise_signal(signum)


def _handler(signum: int, frame: FrameType | None) -> None:
    first = not _signals_handled
    if repeated_at_once(_signals_handled):
        return  # the same request (timeout, a scheduler: the command, then its process group)
    if not first:
        _exit_at_once(signum)
        return
    request_stop(signum)
    print(
        f"dpfl: {signal.Signals(signum).name} received: abandoning the current round, writing the results "
        f"and stopping ({grace_text(signum)})",
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
        clear_stop()
        previous = {sig: signal.signal(sig, _handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    DRIVER.set()
    done = threading.Event()
    if os.environ.get(STOP_FILE_ENV):
        threading.Thread(target=_watch_command_stop, args=(done,), name="dpfl-stop-file", daemon=True).start()
    try:
        yield
    finally:
        done.set()
        DRIVER.clear()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


#: Names a file whose presence asks every run of the command to stop. A sweep's own process sets it
#: and writes the file when it gets SIGINT or SIGTERM while a parallel launcher's worker processes
#: run the jobs (:func:`stop_workers_on_signals`); their runs poll it (:func:`stop_on_signals`), and
#: a job that starts after it was written does not run.
STOP_FILE_ENV = "DPFL_STOP_FILE"
#: Seconds between two looks at the stop file during a run.
STOP_FILE_POLL_S = 0.2


def command_stop_requested() -> int | None:
    """The signal number written to the command's stop file (:data:`STOP_FILE_ENV`), or None."""
    name = os.environ.get(STOP_FILE_ENV)
    if not name:
        return None
    try:
        text = Path(name).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else int(signal.SIGTERM)


def _watch_command_stop(done: threading.Event) -> None:
    while not done.wait(STOP_FILE_POLL_S):
        signum = command_stop_requested()
        if signum is not None:
            request_stop(signum)
            return


@contextmanager
def stop_workers_on_signals(stop_file: Path) -> Iterator[list[int]]:
    """While a parallel launcher's workers run the jobs: stop them all on SIGINT or SIGTERM.

    For the command's own process. The first signal writes ``stop_file`` (named in the workers'
    environment by :data:`STOP_FILE_ENV`): each running job abandons its round in flight and
    writes its results, and no queued job starts; the launcher then returns as after its last job.
    Yields the list the signal's number is appended to. A second signal stops at once, unless it
    repeats the first within :func:`signal_grace_s` (``timeout``: the command, then its group).

    (Python's default ended this process at once on SIGTERM, before the launcher stopped its
    workers: orphaned, they went on with the queued jobs, each with its own Ray. A
    ``KeyboardInterrupt`` here makes the launcher kill its workers while they write their results.)
    """
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return

    first_at: list[float] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        first = not first_at
        if repeated_at_once(first_at):
            return  # the same request (timeout, a scheduler: the command, then its process group)
        if not first:
            _exit_at_once(signum)
            return
        received.append(signum)
        stop_file.write_text(str(signum))
        print(
            f"dpfl: {signal.Signals(signum).name} received: stopping every running job (each abandons its "
            f"round in flight and writes its results) and starting no other ({grace_text(signum)})",
            file=sys.stderr,
            flush=True,
        )

    signals = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, handler) for sig in signals}
    try:
        yield received
    finally:
        for sig, handler_before in previous.items():
            signal.signal(sig, handler_before)


#: Set by ``python -m fl_app`` to its own process id while a parallel launcher's workers run the jobs.
SWEEP_COMMAND_ENV = "DPFL_SWEEP_COMMAND"
#: The module a joblib (loky) worker process runs (``python -m <it>``).
LOKY_WORKER_MAIN = "joblib.externals.loky.backend.popen_loky_posix"


def _left_to_the_command(signum: int, frame: FrameType | None) -> None:
    """Outside a run, a parallel sweep's worker leaves SIGINT and SIGTERM to the command (its stop file)."""


def leave_stops_to_the_sweep_command() -> None:
    """In a parallel sweep's worker process: stops are the command's (its stop file), not the worker's.

    A worker that died of a SIGTERM meant for the command (Python's default action) while it set a
    job up, or while Ray shut down (``ray.shutdown`` resets SIGTERM's action), made the launcher raise
    ``TerminatedWorkerError`` and kill the other workers while they wrote their results. So the
    worker moves to a process group of its own (with the Ray it starts): Ctrl-C, ``timeout`` and
    ``kill -- -PGID`` signal the command only, which stops every job through its stop file
    (:func:`stop_workers_on_signals`). A signal sent to every process (``scancel``) is ignored
    outside a run, and is the run's stop request inside one (:func:`stop_on_signals`). Called when a
    process imports ``fl_app``, a worker's first dpfl code (Python handlers: the processes the worker
    starts get the default ones).
    """
    command = os.environ.get(SWEEP_COMMAND_ENV)
    worker = LOKY_WORKER_MAIN in getattr(sys, "orig_argv", ())
    if not command or command == str(os.getpid()) or not worker:
        return
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _left_to_the_command)


class Terminated(KeyboardInterrupt):
    """SIGTERM to the command's own process outside a run: it stops the command as Ctrl-C does."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


_terminated_at: list[float] = []


def _terminate_like_ctrl_c(signum: int, frame: FrameType | None) -> None:
    first = not _terminated_at
    if repeated_at_once(_terminated_at):
        return  # the same request (timeout, a scheduler: the command, then its process group)
    if not first:
        _exit_at_once(signum)  # a SIGTERM repeated after the grace period: an immediate exit
    raise Terminated(signum)


@contextmanager
def sigterm_like_ctrl_c() -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`Terminated` (a ``KeyboardInterrupt``).

    For the command's own process: between the runs of a sweep, and for the whole sweep when a
    parallel launcher (``hydra/launcher=joblib``) runs the jobs in worker processes. Python's
    default for SIGTERM ended that process at once, so the launcher never stopped its workers:
    orphaned, they went on with the queued jobs, each with its own Ray. Raised as Ctrl-C is, it
    makes the launcher stop them. During a run in this process :func:`stop_on_signals` handles
    SIGTERM itself (a stop request) and puts this handler back after.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _terminated_at.clear()
    previous = signal.signal(signal.SIGTERM, _terminate_like_ctrl_c)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def restore_signal_dispositions() -> None:
    """Install again, in the kernel, the SIGINT and SIGTERM handlers Python lists (main thread only).

    ``ray.shutdown()`` (Ray 2.55, its core worker's teardown) sets SIGTERM back to the default action
    in the kernel while :func:`signal.getsignal` still names the Python handler: a SIGTERM after it
    ended the process at once (a parallel sweep's worker between two jobs: ``TerminatedWorkerError``).
    """
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            handler = signal.getsignal(sig)
            if handler is not None:
                signal.signal(sig, handler)


def reinstall_handlers() -> None:
    """Put the stop handlers back after a library replaced them (Ray's ``init`` sets its own SIGTERM)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _handler)
