"""Writing a run's files so that a full disk (or a vanished directory) is one clear failure.

Every file a run rewrites (the checkpoint, the ledgers, results.json) is written to a temporary
file and renamed over the old one: the old file stays whole whatever happens. When the write
fails (ENOSPC, EDQUOT, EIO, ...) the temporary file is removed and :class:`WriteFailed` (a
:class:`~fl_app.run.lifecycle.RunFailed`) ends the run with one line naming the file and the reason.

A run whose cohorts are secret must not date its rounds by its files' creation (birth) times, which
no later step can change: a file created when round 1 ends tells round 1's duration.
:class:`UndatedFiles` therefore creates, before the first round, every file the rounds will write
(and a hidden spare for each rewritten one); a rewrite then goes into the spare, in place, and the
spare is exchanged with the file in one atomic step (Linux's ``renameat2(RENAME_EXCHANGE)``), so the
file stays whole whatever happens and no file is born while the rounds run. The spares are removed
when the run ends (:func:`remove_spares`).
"""

from __future__ import annotations

import ctypes
import errno
import os
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from logging import WARNING
from pathlib import Path

from flwr.common import log

from fl_app.run.lifecycle import RunFailed

#: ``renameat2``'s flag that swaps two paths atomically, and ``AT_FDCWD`` (linux/fcntl.h).
RENAME_EXCHANGE, AT_FDCWD = 2, -100
#: The errors of a file system (or kernel, or C library) that cannot exchange two paths.
NO_EXCHANGE = (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV)
#: A spare's name: ``.<file name>.spare<k>``, hidden beside the file.
SPARE = ".{name}.spare{k}"


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


def exchange(first: Path, second: Path) -> None:
    """Swap the two paths atomically (both must exist): neither name is ever missing or half-written.

    Raises
    ------
    OSError
        ``errno`` in :data:`NO_EXCHANGE` when the file system (kernel, C library) cannot.

    """
    libc = ctypes.CDLL(None, use_errno=True)
    rename = getattr(libc, "renameat2", None)
    if rename is None:  # a C library before glibc 2.28
        raise OSError(errno.ENOSYS, "renameat2 is not available")
    rename.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if rename(AT_FDCWD, os.fsencode(first), AT_FDCWD, os.fsencode(second), RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(first))


def write_in_place(path: Path, data: bytes, *, mode: int = 0o644, sync: bool = False) -> None:
    """Write ``data`` over ``path``'s content (created when missing; its inode, and birth time, kept)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(descriptor, view) :]
        os.ftruncate(descriptor, len(data))
        if sync:
            os.fsync(descriptor)
    finally:
        os.close(descriptor)


def spare_paths(path: Path, count: int) -> list[Path]:
    """The names of ``path``'s first ``count`` spares (:data:`SPARE`)."""
    return [path.with_name(SPARE.format(name=path.name, k=k)) for k in range(count)]


def remove_spares(directory: Path) -> None:
    """Remove every spare :class:`UndatedFiles` made in ``directory`` (a run's end; a killed run's too)."""
    for path in directory.glob(".*.spare[0-9]"):
        path.unlink(missing_ok=True)


class UndatedFiles:
    """A run's files that its rounds write, all created before the first round (module docstring).

    Inactive (``active`` false: a run whose cohorts are public), :meth:`rewrite` is
    :func:`write_atomically` and :meth:`appendable` does nothing. Active, :meth:`prepare` is called for
    every file before round 1; then :meth:`rewrite` writes a spare in place and exchanges it with the
    file (or renames it into place: the file's first version), and :meth:`appendable` renames an empty
    spare into place before the first append. Safe to use from the checkpoint's writer thread.
    """

    def __init__(self, *, active: bool = False) -> None:
        self.active = active
        self._spares: dict[Path, list[Path]] = {}
        self._lock = threading.Lock()
        #: Set once the file system refused an exchange (then rewrites go in place: see :meth:`rewrite`).
        self.no_exchange: str | None = None

    def prepare(self, path: Path, *, rewritten: bool = True, mode: int = 0o644) -> None:
        """Create ``path``'s spares now: one for its first version when it is missing, one per rewrite.

        Raises
        ------
        WriteFailed
            A spare could not be created (a full disk).

        """
        if not self.active:
            return
        count = int(rewritten) + int(not path.exists())
        spares = spare_paths(path, count)
        for spare in spares:
            with writing(spare):
                os.close(os.open(spare, os.O_WRONLY | os.O_CREAT, mode))
        with self._lock:
            self._spares[path] = spares

    def appendable(self, path: Path) -> None:
        """Before an append to ``path``: its prepared spare renamed into place when it does not exist."""
        if not self.active or path.exists():
            return
        with self._lock:
            spares = self._spares.get(path) or []
        if spares:
            with writing(path):
                os.replace(spares.pop(0), path)

    def cut_back(self, path: Path, data: bytes) -> None:
        """Make ``path`` hold ``data``: cut at its length when the file begins with it, else rewrite it.

        For a journal that may hold records past a checkpoint's (a resumed run): the usual case is a
        truncation, which keeps the file (and its birth time) and is one step a crash cannot split.
        """
        try:
            with path.open("rb") as handle:
                whole = handle.read(len(data) + 1)
        except FileNotFoundError:
            whole = None
        if whole is not None and whole.startswith(data):
            if len(whole) > len(data):
                with writing(path):
                    os.truncate(path, len(data))
            return
        self.rewrite(path, data)

    def rewrite(self, path: Path, data: bytes, *, mode: int = 0o644, sync: bool = False) -> None:
        """Replace ``path``'s content with ``data``; the earlier version stays whole if the write fails.

        Active and prepared: ``data`` goes into a spare created before round 1, which is then exchanged
        with ``path`` (renamed into place the first time). A file system without the atomic exchange
        gets ``data`` written in place instead (a process killed during that write leaves the file
        torn; :attr:`no_exchange` says so). Otherwise :func:`write_atomically`.

        Raises
        ------
        WriteFailed
            The write failed (a full disk); ``path`` is unchanged.

        """
        with self._lock:  # one thread writes a given file (the checkpoint: the writer's)
            spares = self._spares.get(path) if self.active else None
        if not spares:
            write_atomically(path, data, mode=mode, sync=sync)
            return
        spare = spares[0]
        try:
            write_in_place(spare, data, mode=mode, sync=sync)
            if not path.exists():
                os.replace(spares.pop(0), path)
                return
            self._exchange(spare, path, data, mode=mode, sync=sync)
        except OSError as error:
            raise write_failed(path, error) from None

    def _exchange(self, spare: Path, path: Path, data: bytes, *, mode: int, sync: bool) -> None:
        if self.no_exchange is None:
            try:
                exchange(spare, path)
                return
            except OSError as error:
                if error.errno not in NO_EXCHANGE:
                    raise
                self.no_exchange = f"{path.parent} cannot exchange two files atomically ({error.strerror})"
                log(
                    WARNING,
                    "dpfl: %s: the files the rounds rewrite are written in place (a process killed during "
                    "a write leaves that file torn; none is created while the rounds run)",
                    self.no_exchange,
                )
        write_in_place(path, data, mode=mode, sync=sync)
