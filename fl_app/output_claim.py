"""A run's exclusive claim on its output directory.

Two runs started into one directory both passed the "holds an earlier run" check before either
had written a file, then wrote into it together (issue 42.4). A run therefore takes an exclusive
``flock`` on ``<output_dir>/.dpfl.lock`` before it checks the directory, and holds it to its end;
the kernel releases it when the process ends however it ends (kill -9 too), so a stale lock file
never blocks a later run. The lock file stays (removing it would let a third run lock a new file
while the second still holds the old one).

The claim is re-entrant within a process: ``python -m fl_app`` claims before Ray starts, and the
ServerApp, run by the simulation in the same process, claims again when it starts writing.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fl_app.config_checks import ConfigError

#: The lock file in a run's output directory.
LOCK_FILE = ".dpfl.lock"
#: The files that mark a directory as holding a run (a new run refuses it).
RUN_FILES = (
    "results.json",
    "run.log",
    "metrics.csv",
    "rounds.jsonl",
    "privacy_ledger.json",
    "private_server_state.pkl",
    "checkpoint.pkl",
)

_held: dict[Path, list[int]] = {}  # directory -> [claims this process holds, lock descriptor]
_guard = threading.Lock()


def earlier_run_files(directory: Path) -> list[str]:
    """The names of :data:`RUN_FILES` present in ``directory``."""
    return [name for name in RUN_FILES if (directory / name).exists()]


def refuse_earlier_run(directory: Path) -> None:
    """Raise a one-line :class:`ConfigError` when ``directory`` holds an earlier run's files."""
    earlier = earlier_run_files(directory)
    if earlier:
        raise ConfigError(
            "output_dir",
            str(directory),
            f"holds an earlier run ({', '.join(earlier)}): choose a new directory, remove those "
            f"files, or continue that run with resume={directory}",
        )


@contextmanager
def claim_output_dir(directory: Path, *, resume: bool) -> Iterator[Path]:
    """Hold ``directory`` for this run (created if missing) until the block ends.

    Raises
    ------
    ConfigError
        Another process holds the directory, or (``resume`` false) it holds an earlier run.

    """
    directory = directory.expanduser().resolve()
    with _guard:
        if directory in _held:
            _held[directory][0] += 1
        else:
            directory.mkdir(parents=True, exist_ok=True)
            descriptor = os.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(descriptor)
                os.close(descriptor)
                raise ConfigError(
                    "output_dir",
                    str(directory),
                    f"is in use by another run{holder}: choose another directory or wait for that run to end",
                ) from None
            try:
                if not resume:
                    refuse_earlier_run(directory)
            except ConfigError:
                os.close(descriptor)
                raise
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
            _held[directory] = [1, descriptor]
    try:
        yield directory
    finally:
        with _guard:
            claims = _held[directory]
            claims[0] -= 1
            if not claims[0]:
                del _held[directory]
                os.close(claims[1])  # releases the lock


def _read_holder(descriptor: int) -> str:
    try:
        pid = os.pread(descriptor, 32, 0).decode().strip()
    except OSError:
        return ""
    return f" (process {pid})" if pid.isdigit() else ""
