"""A device's own data: the file named by ``node_config["data-path"]``.

Accepted: an ``.npz`` file with arrays ``x`` (images, ``(n, H, W)`` or
``(n, C, H, W)``, ``uint8`` or float) and ``y`` (integer labels), or a folder of
MNIST-format IDX files (the training pair ``train-images-idx3-ubyte[.gz]`` and
``train-labels-idx1-ubyte[.gz]`` are used).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from fl_app.data.federated import ClientDataset
from fl_app.data.sources import read_idx


@functools.lru_cache(maxsize=2)
def load_local_dataset(path: str) -> ClientDataset:
    """Load (once per process) the labelled examples stored at ``path``."""
    location = Path(path).expanduser()
    if location.is_dir():
        images = _first_existing(location, "train-images-idx3-ubyte")
        labels = _first_existing(location, "train-labels-idx1-ubyte")
        x, y = read_idx(images), read_idx(labels)
    elif location.suffix == ".npz" and location.is_file():
        with np.load(location) as archive:
            if "x" not in archive or "y" not in archive:
                raise ValueError(f"data-path={path!r}: the .npz must hold arrays 'x' and 'y'")
            x, y = archive["x"], archive["y"]
    else:
        raise FileNotFoundError(f"data-path={path!r}: not an .npz file or an IDX folder")
    if x.ndim == 3:
        x = x[:, None]
    if len(x) != len(y):
        raise ValueError(f"data-path={path!r}: {len(x)} images but {len(y)} labels")
    return ClientDataset(np.ascontiguousarray(x), np.asarray(y, dtype=np.int64))


def check_local_dataset(
    data: ClientDataset, path: str, *, input_shape: tuple[int, ...], num_classes: int
) -> None:
    """Raise a one-line ``ValueError`` when a device's data does not fit the server's model.

    The server's model is built for its own ``dataset`` (e.g. 8x8 images for
    ``digits``); a device file made from another data set would otherwise fail
    deep inside training.
    """
    shape = tuple(int(d) for d in data.x.shape[1:])
    if shape != tuple(input_shape):
        raise ValueError(
            f"data-path={path!r}: examples of shape {shape}, but the server's model takes "
            f"{tuple(input_shape)}; make the device files from the server's dataset"
        )
    if data.x.dtype.kind == "f" and len(data):
        rows = np.flatnonzero(~np.isfinite(data.x.reshape(len(data), -1)).all(axis=1))
        if rows.size:
            raise ValueError(
                f"data-path={path!r}: row {rows[0]} (counting from 0) holds NaN or infinite values"
            )
    if len(data) and (int(data.y.min()) < 0 or int(data.y.max()) >= num_classes):
        raise ValueError(
            f"data-path={path!r}: labels {int(data.y.min())}..{int(data.y.max())}, but the server's "
            f"model has {num_classes} classes (0..{num_classes - 1})"
        )


def _first_existing(folder: Path, stem: str) -> Path:
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"data-path={str(folder)!r}: no {stem}[.gz] in it")
