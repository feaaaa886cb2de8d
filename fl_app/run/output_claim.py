"""A run's exclusive claim on its output directory.

Without a claim, two runs started into one directory could both pass the "holds an earlier run"
check before either had written a file, then write into it together. A run therefore takes an exclusive
``flock`` on ``<output_dir>/.dpfl.lock`` before it checks the directory, and holds it to its end;
the kernel releases it when the process ends however it ends (kill -9 too), so a stale lock file
never blocks a later run. The lock file stays (removing it would let a third run lock a new file
while the second still holds the old one).

The claim is re-entrant within a process: ``python -m fl_app`` claims before Ray starts, and the
ServerApp, run by the simulation in the same process, claims again when it starts writing.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fl_app.config.checks import ConfigError

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


#: The files of a run that completed a round (a run without any of them has nothing to continue).
ROUND_FILES = ("private_server_state.pkl", "checkpoint.pkl", "rounds.jsonl", "metrics.csv")


def earlier_run_files(directory: Path) -> list[str]:
    """The names of :data:`RUN_FILES` present in ``directory``."""
    return [name for name in RUN_FILES if (directory / name).exists()]


def read_results(directory: Path) -> dict[str, Any] | None:
    """``directory``'s ``results.json``, or None when it is missing or unreadable."""
    try:
        results = json.loads((directory / "results.json").read_text())
    except (OSError, ValueError):
        return None
    return results if isinstance(results, dict) else None


def ended_before_first_round(directory: Path) -> bool:
    """Whether ``directory`` holds only what a run that ended before its first round leaves.

    Its ``run.log`` (a failed ``flwr run``, a refused roster, a stop before round 1), perhaps a
    ``results.json`` of no round: nothing to continue, nothing worth keeping. A new run reuses it.
    """
    earlier = set(earlier_run_files(directory))
    if not earlier or earlier & set(ROUND_FILES):
        return False
    if "results.json" not in earlier:
        return True
    results = read_results(directory)
    return (
        results is not None
        and results.get("status") in ("failed", "interrupted")
        and not results.get("rounds")
    )


def lock_holder(directory: Path) -> str | None:
    """`` (process N)`` when another process holds ``directory``'s lock (a run writes there), else None."""
    path = directory / LOCK_FILE
    if directory in _held or not path.is_file():
        return None
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)  # a probe: released when closed
    except BlockingIOError:
        return _read_holder(descriptor) or " (process unknown)"
    finally:
        os.close(descriptor)
    return None


def in_use(directory: Path, holder: str) -> ConfigError:
    """The error for a directory another run holds."""
    return ConfigError(
        "output_dir",
        str(directory),
        f"is in use by another run{holder}: choose another directory or wait for that run to end",
    )


def refuse_earlier_run(directory: Path, *, probe_lock: bool = True) -> None:
    """Raise a one-line :class:`ConfigError` naming what ``directory`` holds, unless a new run may use it.

    Another run writing there (its process); a run that can continue (its checkpoint: ``resume=``);
    a finished run (its files). A run that ended before its first round does not stop a new one
    (:func:`ended_before_first_round`). ``probe_lock=False``: the caller holds the lock.
    """
    holder = lock_holder(directory) if probe_lock else None
    if holder is not None:
        raise in_use(directory, holder)
    earlier = earlier_run_files(directory)
    if not earlier or ended_before_first_round(directory):
        return
    files = ", ".join(earlier)
    if {"private_server_state.pkl", "checkpoint.pkl"} & set(earlier):
        how = f"choose a new directory, remove those files, or continue that run with resume={directory}"
        raise ConfigError("output_dir", str(directory), f"holds an earlier run ({files}): {how}")
    status = (read_results(directory) or {}).get("status", "ended")
    raise ConfigError(
        "output_dir",
        str(directory),
        f"holds an earlier run that {status} ({files}; nothing to continue): choose a new directory or "
        "remove those files",
    )


def reuse_after_first_round_failure(directory: Path) -> None:
    """Remove the files of a run that ended before its first round, saying so (the new run replaces them)."""
    if not ended_before_first_round(directory):
        return
    earlier = earlier_run_files(directory)
    for name in earlier:
        (directory / name).unlink(missing_ok=True)
    print(
        f"dpfl: {directory} held a run that ended before its first round ({', '.join(earlier)}): reused",
        file=sys.stderr,
        flush=True,
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
                raise in_use(directory, holder) from None
            try:
                if not resume:
                    refuse_earlier_run(directory, probe_lock=False)
                    reuse_after_first_round_failure(directory)
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
