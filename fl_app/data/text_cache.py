"""The text cache's folders: written whole or not at all, checked before they are read.

A conversion (:func:`fl_app.data.text.convert`) writes into a staging folder ``.<key>.<random>/``
beside its final folder ``<key>/`` (:func:`staging_folder`) and renames it into place when it is
whole. The converting process holds an exclusive ``flock`` on the staging folder until it ends, and
removes the folder when it stops for any reason Python sees (an error, Ctrl-C, a SIGTERM turned into
one); the kernel drops the lock when the process dies however it dies (``kill -9`` too). So a later
run removes a staging folder it can lock, a dead process's leftover, and never one that a live
conversion writes (:func:`remove_abandoned`). Creating a staging folder and locking it, and looking
for leftovers, both happen under the cache folder's own lock: a leftover hunt never sees a
staging folder between its creation and its lock.

``meta.json`` records each array file's size and SHA-256 (:func:`file_records`). A folder is read
only after :func:`check_arrays`: each file's size against that record and the token files' against
their offsets, and, the first time and after any change, the files' checksums and every token id
against the vocabulary. A check that
passed is remembered in ``verified.json`` as each file's size, modification and change times, inode
and device; later opens compare those (a ``stat`` per file) instead of reading the files. A change
time that is not older than ``verified.json``'s own is not trusted (a file changed within the clock
tick that wrote the record: the contents are read again), as Git treats a "racily clean" index entry.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

#: The corpus's description (vocabulary, shapes, source, checksums).
META_FILE = "meta.json"
#: The arrays a converted folder holds.
ARRAY_FILES = ("train.tokens", "test.tokens", "train_offsets.npy", "test_offsets.npy")
#: The record of the last check that passed (see the module docstring).
VERIFIED_FILE = "verified.json"
#: A staging folder's name: a dot, the 32 hex digits of its corpus's key, a dot, a random tail.
STAGING_NAME = re.compile(r"^\.[0-9a-f]{32}\.")
#: Bytes read at a time by a check (a multiple of every token dtype's size).
CHUNK_BYTES = 1 << 24


class CacheCheckError(Exception):
    """A converted folder that fails its check: why, in one line (the file and what is wrong)."""


@contextmanager
def cache_lock(cache: Path) -> Iterator[None]:
    """Hold the exclusive ``flock`` of the folder ``cache`` (created if missing) while the block runs."""
    cache.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(cache, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        os.close(descriptor)  # releases the lock


@contextmanager
def staging_folder(folder: Path) -> Iterator[Path]:
    """A new, locked staging folder for ``folder``'s conversion; removed when the block ends.

    Rename it onto ``folder`` inside the block to keep it. The lock is held until the block ends
    (on the folder's inode: a rename keeps it).
    """
    with cache_lock(folder.parent):
        staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))
        descriptor = os.open(staging, os.O_RDONLY)
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new: nobody else can hold it
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # nothing left after a rename into place
        os.close(descriptor)


def held(folder: Path) -> bool:
    """Whether a live process holds ``folder``'s lock (a folder that vanished or cannot be opened: True)."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return True
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(descriptor)
    return False


def remove_abandoned(cache: Path) -> list[Path]:
    """Remove the staging folders in ``cache`` that no live process holds; return the removed ones."""
    try:
        candidates = [entry for entry in cache.iterdir() if STAGING_NAME.match(entry.name)]
    except OSError:
        return []
    if not candidates:
        return []
    removed = []
    with cache_lock(cache):
        for folder in candidates:
            if folder.is_dir() and not held(folder):
                shutil.rmtree(folder, ignore_errors=True)
                removed.append(folder)
    return removed


def file_records(folder: Path) -> dict[str, dict[str, Any]]:
    """Each array file's size and SHA-256, as ``meta.json`` records them (``files``)."""
    records = {}
    for name in ARRAY_FILES:
        digest = hashlib.sha256()
        with (folder / name).open("rb") as handle:
            for block in iter(lambda handle=handle: handle.read(CHUNK_BYTES), b""):
                digest.update(block)
        records[name] = {"bytes": (folder / name).stat().st_size, "sha256": digest.hexdigest()}
    return records


def check_arrays(
    folder: Path,
    meta: Mapping[str, Any],
    rows: Mapping[str, int],
    *,
    require_checksums: bool,
) -> None:
    """Check ``folder``'s arrays against ``meta`` before they are read (:class:`CacheCheckError` if not).

    ``rows``: each split's number of sequences (its offsets' last entry). Always: each file's size is
    the one ``meta.json`` recorded, each token file holds ``rows * (sequence_length + 1)`` ids.
    Unless :data:`VERIFIED_FILE` vouches for the files as they are: each file's SHA-256 is the one
    ``meta.json`` recorded (a folder without them is refused when ``require_checksums``) and every
    token id is below the vocabulary's size.
    """
    dtype = np.dtype(meta["dtype"])
    for name, record in (meta.get("files") or {}).items():
        size = (folder / name).stat().st_size
        if size != record.get("bytes"):
            raise CacheCheckError(
                f"{name} holds {size} bytes, {record.get('bytes')} when it was written: a truncated or "
                "overwritten file"
            )
    stamp = stat_record(folder)
    trusted = stamp == verified_stamp(folder)
    if not trusted:
        check_contents(folder, meta, dtype, require_checksums=require_checksums)
    width = int(meta["sequence_length"]) + 1
    for split, count in rows.items():
        expected = count * width * dtype.itemsize
        size = (folder / f"{split}.tokens").stat().st_size
        if size != expected:
            raise CacheCheckError(
                f"{split}.tokens holds {size} bytes where its offsets say {count} sequences of {width} "
                f"ids ({expected} bytes): a truncated or overwritten file"
            )
    if not trusted:
        record_verified(folder, stamp)


def check_contents(
    folder: Path, meta: Mapping[str, Any], dtype: np.dtype, *, require_checksums: bool
) -> None:
    """Every array file's SHA-256 against ``meta.json``'s ``files``, every token id against the vocabulary."""
    records = meta.get("files")
    if records is None and require_checksums:
        raise CacheCheckError("meta.json records no checksums (converted by an earlier dpfl)")
    vocabulary = len(meta["vocabulary"]) + 4
    for name in ARRAY_FILES:
        recorded = None if records is None else records.get(name, {}).get("sha256")
        if records is not None and recorded is None:
            raise CacheCheckError(f"meta.json records no checksum of {name}")
        digest, largest = read_through(folder / name, dtype if name.endswith(".tokens") else None)
        if recorded is not None and digest != recorded:
            raise CacheCheckError(
                f"{name} does not match the checksum recorded when it was written: a corrupted file"
            )
        if largest is not None and largest >= vocabulary:
            raise CacheCheckError(
                f"{name} holds the token id {largest}, outside the vocabulary's {vocabulary} ids"
            )


def read_through(path: Path, dtype: np.dtype | None) -> tuple[str, int | None]:
    """The SHA-256 of ``path`` and, for a token file (``dtype`` given), its largest id (None: no id)."""
    digest = hashlib.sha256()
    largest: int | None = None
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(CHUNK_BYTES), b""):
            digest.update(block)
            if dtype is not None and len(block) >= dtype.itemsize:
                top = int(np.frombuffer(block, dtype=dtype, count=len(block) // dtype.itemsize).max())
                largest = top if largest is None else max(largest, top)
    return digest.hexdigest(), largest


def stat_record(folder: Path) -> dict[str, list[int]]:
    """Each file's size, modification and change times (ns), inode and device."""
    stamp = {}
    for name in (META_FILE, *ARRAY_FILES):
        stat = (folder / name).stat()
        stamp[name] = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev]
    return stamp


def verified_stamp(folder: Path) -> dict[str, list[int]] | None:
    """The stamp :func:`record_verified` kept, if every file's change time is older than the record's."""
    path = folder / VERIFIED_FILE
    try:
        recorded = json.loads(path.read_text())
        written = path.stat().st_ctime_ns
    except (OSError, ValueError):
        return None
    if not isinstance(recorded, dict) or any(
        not isinstance(entry, list) or len(entry) != 5 or entry[2] >= written for entry in recorded.values()
    ):
        return None
    return recorded


def record_verified(folder: Path, stamp: dict[str, list[int]]) -> None:
    """Keep ``stamp`` as :data:`VERIFIED_FILE` (written whole; a folder that cannot be written: nothing)."""
    try:
        handle, name = tempfile.mkstemp(dir=folder, prefix=f".{VERIFIED_FILE}.")
    except OSError:
        return
    try:
        with os.fdopen(handle, "w") as temporary:
            json.dump(stamp, temporary)
        os.replace(name, folder / VERIFIED_FILE)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(name)
