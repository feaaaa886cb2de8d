"""Writing a run's files so that a full disk (or a vanished directory) is one clear failure.

Every file a run rewrites (the checkpoint, the ledgers, results.json) is written to a temporary
file and renamed over the old one: the old file stays whole whatever happens. When the write
fails (ENOSPC, EDQUOT, EIO, ...) the temporary file is removed and :class:`WriteFailed` (a
:class:`~fl_app.run.lifecycle.RunFailed`) ends the run with one line naming the file and the reason.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fl_app.run.lifecycle import RunFailed


class WriteFailed(RunFailed):
    """A run's file could not be written (the earlier version of the file is intact)."""


def write_failed(path: Path, error: OSError) -> WriteFailed:
    """The one-line :class:`WriteFailed` for ``error`` while writing ``path``."""
    reason = error.strerror or type(error).__name__
    code = f" (errno {error.errno})" if error.errno else ""
    return WriteFailed(f"could not write {path}: {reason}{code}; the earlier version of the file is intact")


def write_atomically(path: Path, data: bytes, *, mode: int = 0o644, sync: bool = False) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename (``mode``: its permissions).

    Raises
    ------
    WriteFailed
        The write failed; no temporary file is left and ``path`` is unchanged.

    """
    temporary: Path | None = None
    try:
        descriptor, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        temporary = Path(name)
        os.fchmod(descriptor, mode)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
            handle.flush()
            if sync:
                os.fsync(handle.fileno())
        os.replace(temporary, path)
    except OSError as error:
        if temporary is not None:
            temporary.unlink(missing_ok=True)
        raise write_failed(path, error) from None


@contextmanager
def writing(path: Path) -> Iterator[None]:
    """Turn an ``OSError`` raised in the block (a write of ``path``) into :class:`WriteFailed`."""
    try:
        yield
    except OSError as error:
        raise write_failed(path, error) from None


def one_modification_time(directory: Path, *, when: float | None = None) -> None:
    """Give every file and folder under ``directory`` (itself included) one modification time.

    For a run whose cohorts are secret: files written round by round (metrics.csv, the ledger,
    TensorBoard's events) would otherwise carry the time of the round that last wrote them. Files
    that vanish meanwhile, or cannot be changed, are left as they are.
    """
    moment = os.path.getmtime(directory) if when is None else when
    for path in [*sorted(directory.rglob("*"), reverse=True), directory]:
        try:
            os.utime(path, (moment, moment), follow_symlinks=False)
        except OSError:
            continue
