"""Bit packing of sign vectors: 8 binary weights per byte (DPFL-BNN's upload format).

Liu, Zhang, Song, Letaief, "Binary Federated Learning with Client-Level
Differential Privacy", 2023, Algorithm 1 steps 2-3: each client uploads its
noised binary weights ``RR_gamma(W^{b,i}_t)`` in ``{-1, +1}^d``. A coordinate
carries one bit, so the upload is packed as ``ceil(d / 8)`` bytes
(``+1 -> 1``, ``-1 -> 0``, first coordinate in the most significant bit of the
first byte, as :func:`numpy.packbits` with ``bitorder="big"``). The padding bits
of the last byte are zero; :func:`unpack_signs` refuses anything else, so a
malformed upload is detected instead of silently decoded.

Also here: flattening a model's arrays into one vector in a fixed order and
back (:func:`flatten_arrays`, :func:`split_vector`), so the server can unpack
an upload into the model's shapes without receiving them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

BITORDER = "big"


def packed_length(count: int) -> int:
    """Number of bytes that hold ``count`` packed bits: ``ceil(count / 8)``."""
    if isinstance(count, bool) or int(count) != count or count < 0:
        raise ValueError(f"count must be an integer >= 0, got {count!r}")
    return (int(count) + 7) // 8


def pack_signs(signs: np.ndarray) -> np.ndarray:
    """Pack a vector of ``-1``/``+1`` values into bytes (``+1 -> 1``, ``-1 -> 0``).

    Parameters
    ----------
    signs : np.ndarray
        Values in ``{-1, +1}`` (any numeric dtype, any shape; flattened in C order).

    Returns
    -------
    np.ndarray
        ``uint8`` array of length ``ceil(signs.size / 8)``; unused bits of the last byte are 0.

    Raises
    ------
    ValueError
        If ``signs`` holds a value other than -1 and +1.

    """
    flat = np.asarray(signs).ravel()
    if flat.size and not np.all((flat == 1) | (flat == -1)):
        raise ValueError("signs must contain only -1 and +1")
    return np.packbits(flat > 0, bitorder=BITORDER)


def unpack_signs(packed: np.ndarray, count: int, *, dtype: np.dtype | type = np.float32) -> np.ndarray:
    """Inverse of :func:`pack_signs`: ``count`` values in ``{-1, +1}``.

    Parameters
    ----------
    packed : np.ndarray
        ``uint8`` array of exactly ``ceil(count / 8)`` bytes.
    count : int
        Number of signs packed.
    dtype : numpy dtype
        Dtype of the result.

    Raises
    ------
    ValueError
        If the dtype, the length or the padding bits do not match ``count``.

    """
    data = np.asarray(packed)
    if data.dtype != np.uint8:
        raise ValueError(f"packed signs must be uint8, got {data.dtype}")
    if data.ndim != 1 or data.size != packed_length(count):
        raise ValueError(
            f"packed signs must be a 1-D array of {packed_length(count)} bytes for {count} signs, "
            f"got shape {data.shape}"
        )
    bits = np.unpackbits(data, bitorder=BITORDER)
    if np.any(bits[count:]):
        raise ValueError("padding bits of the packed signs must be zero")
    return np.where(bits[:count] == 1, 1, -1).astype(dtype)


def signs_of(values: np.ndarray) -> np.ndarray:
    """``Sign`` with ties to +1 as ``int8`` (the binarization of :class:`fl_app.models.SignSTE`)."""
    return np.where(np.asarray(values) >= 0, 1, -1).astype(np.int8)


def flatten_arrays(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Concatenate arrays (each flattened in C order) into one vector."""
    if not arrays:
        return np.zeros(0)
    return np.concatenate([np.asarray(a).ravel() for a in arrays])


def split_vector(vector: np.ndarray, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """Inverse of :func:`flatten_arrays`: cut ``vector`` into arrays of ``shapes``."""
    flat = np.asarray(vector).ravel()
    sizes = [int(np.prod(shape, dtype=np.int64)) for shape in shapes]
    if sum(sizes) != flat.size:
        raise ValueError(f"vector has {flat.size} entries, the shapes need {sum(sizes)}")
    out, start = [], 0
    for shape, size in zip(shapes, sizes, strict=True):
        out.append(flat[start : start + size].reshape(shape))
        start += size
    return out
