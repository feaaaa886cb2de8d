"""Arithmetic on the ArrayRecords strategies exchange: means, flat vectors, server momentum.

Everything here is plain numpy on a model's arrays in key order; none of it is privacy math
(clipping and noise live in :mod:`fl_app.privacy.mechanisms`).
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord

from fl_app.learning.training import array_values


class ServerMomentum:
    """Server SGD with heavy-ball momentum (FedAvgM / DP-FedAvgM; Reddi et al., ICLR 2021, Alg. 1).

    ``v_t = beta v_{t-1} + Delta_t`` (``v_1 = Delta_1``) and ``w_{t+1} = w_t + eta_s v_t``, array
    by array. The velocity is part of the strategy's state (checkpointed with it).
    """

    def __init__(self, *, lr: float, momentum: float) -> None:
        self.lr = lr
        self.momentum = momentum
        self.velocity: list[np.ndarray] | None = None

    def step(self, start: list[np.ndarray], update: list[np.ndarray]) -> list[np.ndarray]:
        """``w_t + eta_s v_t`` for the model ``start`` (w_t) and this round's ``update`` (Delta_t)."""
        if self.velocity is None:
            self.velocity = list(update)
        else:
            self.velocity = [self.momentum * v + u for v, u in zip(self.velocity, update, strict=True)]
        return [w + self.lr * v for w, v in zip(start, self.velocity, strict=True)]


def arrays_like(values: list[np.ndarray], like: ArrayRecord) -> ArrayRecord:
    """``values`` (one array per key of ``like``, in key order) as an ArrayRecord with ``like``'s dtypes."""
    return ArrayRecord(
        {
            name: Array(np.asarray(value).astype(array_values(like[name]).dtype))
            for name, value in zip(like.keys(), values, strict=True)
        }
    )


def flat_vector(arrays: ArrayRecord) -> np.ndarray:
    """All arrays of a record as one float64 vector (in key order)."""
    return np.concatenate([array_values(arrays[name]).astype(np.float64).ravel() for name in arrays])


def split_vector(vector: np.ndarray, like: list[np.ndarray]) -> list[np.ndarray]:
    """``vector`` cut into arrays shaped like ``like`` (the inverse of :func:`flat_vector`)."""
    parts, offset = [], 0
    for template in like:
        parts.append(vector[offset : offset + template.size].reshape(template.shape))
        offset += template.size
    return parts


def mean_arrays(records: list[ArrayRecord], weights: list[float] | None = None) -> ArrayRecord:
    """(Weighted) mean of ArrayRecords with identical keys and shapes.

    Accumulates in float64, client by client in the given order, and casts the
    mean back to each array's dtype. All arrays of a record are handled as one
    flat vector (the same arithmetic element by element as array by array).
    """
    if not records:
        raise ValueError("nothing to average")
    factors = (
        np.full(len(records), 1.0 / len(records))
        if weights is None
        else (np.asarray(weights, dtype=np.float64) / float(np.sum(weights)))
    )
    names = list(records[0].keys())
    first = [array_values(records[0][name]) for name in names]
    total = np.zeros(sum(a.size for a in first), dtype=np.float64)
    flat = np.empty_like(total)  # one buffer for every record: no per-client allocations
    for factor, record in zip(factors, records, strict=True):
        np.concatenate([array_values(record[name]).ravel() for name in names], out=flat)
        flat *= factor
        total += flat
    parts = split_vector(total, first)
    return ArrayRecord(
        {
            name: Array(np.asarray(part, dtype=template.dtype, order="C"))
            for name, part, template in zip(names, parts, first, strict=True)
        }
    )
