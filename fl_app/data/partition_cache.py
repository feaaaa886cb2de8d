"""A disk cache of client partitions (row indices), shared by every process that needs them.

Computing a partition imports flwr-datasets with Hugging Face ``datasets``, pandas, pyarrow, scipy
and matplotlib, and runs the partitioner over every training row. Every process of a simulation
that builds the federated data did both: the driver, and each Ray worker when its first client
message arrived. The first process to compute a partition stores its rows here; the others read
them with numpy alone.

The key covers everything the rows depend on: the :class:`~fl_app.data.federated.DataSpec` (data
set and partition options, number of clients, seed), the labels of the training split (a hash: a
copy of the data set with other labels or another order gets its own rows; with a natural partition
its users too), and the code that
computes them (the sources of :mod:`fl_app.data.partition` and :mod:`fl_app.data.federated`, the
installed flwr-datasets, datasets and numpy versions). Files are written to a temporary name and
renamed, so a reader never sees half a file; a file that cannot be read is computed again.
Partitions hold no secret: they follow from the published configuration.

Location: ``$DPFL_PARTITION_CACHE`` if set, else ``$DPFL_DATA_HOME/partitions``
(``~/.cache/dpfl/partitions``); ``DPFL_PARTITION_CACHE=off`` turns the cache off. At most
:data:`MAX_FILES` partitions are kept (the least recently written go first).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import importlib.util
import itertools
import os
import tempfile
from pathlib import Path

import numpy as np

from fl_app.data.sources import data_home

#: The environment variable naming the cache folder (or ``off``).
CACHE_ENV = "DPFL_PARTITION_CACHE"
#: Partitions kept; a cross-device split of 60,000 rows takes about 0.5 MB.
MAX_FILES = 64
_CODE_PACKAGES = ("flwr-datasets", "datasets", "numpy")
#: The modules whose source decides the rows (the partitioners, and how the split uses them).
_CODE_MODULES = ("fl_app.data.partition", "fl_app.data.natural", "fl_app.data.federated")

Rows = tuple[np.ndarray, tuple[np.ndarray, ...], np.ndarray]  # public, clients, validation


def cache_dir() -> Path | None:
    """The cache folder, or None when the cache is off."""
    return cache_folder(CACHE_ENV, "partitions")


def cache_folder(variable: str, name: str) -> Path | None:
    """A disk cache's folder: ``$variable``, else ``$DPFL_DATA_HOME/name``; None when ``$variable`` is off."""
    setting = os.environ.get(variable, "")
    if setting.lower() in {"off", "0", "false", "no"}:
        return None
    return Path(setting) if setting else data_home() / name


def _code_version() -> bytes:
    """Bytes that change whenever the code computing partitions may change."""
    return code_version(_CODE_MODULES, _CODE_PACKAGES)


def code_version(modules: tuple[str, ...], packages: tuple[str, ...]) -> bytes:
    """The sources of ``modules`` and the installed versions of ``packages``, as one key part.

    A disk cache (this one, :mod:`fl_app.privacy.calibration_cache`) puts it in its keys, so an
    entry computed by other code is never found.
    """
    sources = []
    for module in modules:
        spec = importlib.util.find_spec(module)
        origin = spec.origin if spec is not None else None
        sources.append(Path(origin).read_bytes() if origin else module.encode())
    versions = []
    for package in packages:
        try:
            versions.append(f"{package}=={importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package} missing")
    return b"\n".join([*sources, "\n".join(versions).encode()])


def partition_key(spec_json: str, labels: np.ndarray, groups: np.ndarray | None = None) -> str:
    """The cache key of the partition of ``labels`` (the training split's) that ``spec_json`` asks for.

    ``groups``: each training row's user, for a natural partition (its rows depend on them too).
    """
    digest = hashlib.sha256()
    digest.update(spec_json.encode())
    for array in (labels,) if groups is None else (labels, groups):
        array = np.ascontiguousarray(array)
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(array.tobytes())
    digest.update(_code_version())
    return digest.hexdigest()[:32]


def load_rows(key: str) -> Rows | None:
    """The cached ``(public, client, validation rows)`` under ``key``; None if absent, off or unreadable."""
    folder = cache_dir()
    if folder is None:
        return None
    path = folder / f"{key}.npz"
    try:
        with np.load(path, allow_pickle=False) as stored:
            public, rows, offsets = stored["public"], stored["rows"], stored["offsets"]
            validation = stored["validation"]
    except (OSError, EOFError, KeyError, ValueError):
        return None
    if len(offsets) < 1 or offsets[0] != 0 or offsets[-1] != len(rows) or np.any(np.diff(offsets) < 0):
        return None
    clients = tuple(rows[start:end] for start, end in itertools.pairwise(offsets))
    return public, clients, validation


def store_rows(
    key: str,
    public_rows: np.ndarray,
    client_rows: tuple[np.ndarray, ...],
    validation_rows: np.ndarray | None = None,
) -> None:
    """Store a computed partition under ``key`` (nothing happens if the folder cannot be written)."""
    folder = cache_dir()
    if folder is None:
        return
    sizes = [len(rows) for rows in client_rows]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    rows = np.concatenate(client_rows) if client_rows else np.zeros(0, dtype=np.int64)
    validation = np.zeros(0, dtype=np.int64) if validation_rows is None else validation_rows
    arrays = {"public": public_rows, "rows": rows, "offsets": offsets, "validation": validation}
    if write_npz(folder / f"{key}.npz", arrays):
        keep_newest(folder, keep=MAX_FILES)


def write_npz(path: Path, arrays: dict[str, np.ndarray]) -> bool:
    """Write ``arrays`` to ``path`` atomically (a temporary name, then renamed); False if unwritable.

    Readers of a cache never see half a file: another process writing the same key only replaces it.
    """
    temporary: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp")
        with os.fdopen(handle, "wb") as out:
            np.savez(out, **arrays)
        os.replace(temporary, path)
    except OSError:
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
        return False
    return True


def keep_newest(folder: Path, *, keep: int) -> None:
    """Delete all but the ``keep`` most recently written ``.npz`` files of ``folder``."""
    try:
        files = sorted(folder.glob("*.npz"), key=lambda path: path.stat().st_mtime, reverse=True)
    except OSError:
        return
    for stale in files[keep:]:
        with contextlib.suppress(OSError):
            stale.unlink()
