"""Knowledge transfer on an unlabeled public split: the server-side building blocks of PrivateKT.

Qi, Wu et al., "Differentially private knowledge transfer for federated learning", Nature
Communications 2023, Eq. 3-5 and Algorithm 1; the authors' public Keras code (taoqi98/PrivateKT)
for the details the text leaves open. Everything here is post-processing: it reads the public
split's images (never its labels), the model, and label estimates already debiased from
locally private reports (:func:`fl_app.privacy.mechanisms.debias_label_average`).

* :func:`prediction_entropy`, :func:`sampling_weights`, :func:`draw_weighted`: active sampling
  of public rows by the model's uncertainty (Eq. 4: uncertain rows for knowledge transfer; Eq. 5:
  confident rows for self-training);
* :func:`knowledge_targets`: training targets from the Eq. 3 estimate;
* :class:`KnowledgeBuffer`: the FIFO of the last B rounds' knowledge (Algorithm 1, line 16);
* :func:`fit_targets`: SGD on soft targets (buffer fine-tuning and self-training).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 - the conventional name

from fl_app.learning.optim import SGD
from fl_app.learning.training import seeded_dropout, to_tensor

#: Ways of turning the Eq. 3 estimate into targets (``strategy.knowledge``).
KNOWLEDGE_MODES = ("argmax", "soft")


def prediction_entropy(probabilities: np.ndarray) -> np.ndarray:
    """Uncertainty ``u_i = -sum_j p_ij log p_ij`` of each row (Eq. 4 and Eq. 5)."""
    p = np.asarray(probabilities, dtype=np.float64)
    return -np.sum(p * np.log(np.clip(p, 1e-12, None)), axis=1)


def sampling_weights(uncertainty: np.ndarray, *, sign: float) -> np.ndarray:
    """``w_i = exp(sign u_i) / sum_j exp(sign u_j)``: Eq. 4 with ``sign=+1``, Eq. 5 with ``-1``."""
    if sign not in (1.0, -1.0):
        raise ValueError(f"sign must be +1 or -1, got {sign!r}")
    scores = sign * np.asarray(uncertainty, dtype=np.float64)
    weights = np.exp(scores - scores.max())
    return weights / weights.sum()


def draw_weighted(weights: np.ndarray, size: int, *, rng: np.random.Generator) -> np.ndarray:
    """Draw ``size`` distinct row indices with probabilities ``weights`` (as the authors' code)."""
    weights = np.asarray(weights, dtype=np.float64)
    if not 0 <= size <= len(weights):
        raise ValueError(f"cannot draw {size} distinct rows out of {len(weights)}")
    return np.sort(rng.choice(len(weights), size=size, replace=False, p=weights))


def fit_targets(
    model: nn.Module,
    x: np.ndarray,
    targets: np.ndarray,
    *,
    steps: int,
    batch_size: int | None,
    lr: float,
    rng: np.random.Generator,
    input_dropout: float = 0.0,
) -> float:
    """``steps`` SGD steps of soft-target cross-entropy on ``(x, targets)``; returns the mean loss.

    ``batch_size=None`` uses the whole set in every step (the authors'
    ``train_on_batch`` on the buffer); otherwise mini-batches follow seeded
    permutations (one epoch = ``ceil(n / batch_size)`` steps).
    ``input_dropout`` zeroes each input value with that probability (inverted
    dropout, seeded masks from ``rng``).
    """
    if steps <= 0 or len(x) == 0:
        return math.nan
    model.train()
    optimizer = SGD(model.parameters(), lr=lr)
    inputs = to_tensor(x)
    soft = torch.from_numpy(np.asarray(targets, dtype=np.float32))
    size = len(x) if batch_size is None else min(batch_size, len(x))
    order = rng.permutation(len(x))
    position, total = 0, 0.0
    with seeded_dropout(model, rng):  # the authors' CNN has dropout: seeded masks
        for _ in range(steps):
            if position + size > len(order):
                order, position = rng.permutation(len(x)), 0
            index = torch.from_numpy(order[position : position + size])
            position += size
            batch = inputs[index]
            if input_dropout > 0:
                keep = torch.from_numpy(rng.random(tuple(batch.shape)) >= input_dropout)
                batch = batch * keep / (1.0 - input_dropout)
            optimizer.zero_grad(set_to_none=True)
            loss = -(soft[index] * F.log_softmax(model(batch), dim=1)).sum(dim=1).mean()
            loss.backward()
            optimizer.step()
            total += float(loss.detach())
    return total / steps


def knowledge_targets(estimate: np.ndarray, *, mode: str, rng: np.random.Generator) -> np.ndarray:
    """Training targets from the Eq. 3 estimate (shape ``(K, C)``).

    ``argmax``: one-hot of the largest entry (the authors' code; ties broken
    at random with ``rng``). ``soft``: negative entries set to 0, then
    normalised (uniform when nothing is left).
    """
    estimate = np.asarray(estimate, dtype=np.float64)
    num_classes = estimate.shape[1]
    if mode == "argmax":
        targets = np.zeros_like(estimate)
        for row, values in enumerate(estimate):
            best = np.flatnonzero(values == values.max())
            targets[row, rng.choice(best)] = 1.0
        return targets
    if mode == "soft":
        clipped = np.clip(estimate, 0.0, None)
        totals = clipped.sum(axis=1, keepdims=True)
        uniform = np.full_like(clipped, 1.0 / num_classes)
        return np.where(totals > 0, clipped / np.where(totals > 0, totals, 1.0), uniform)
    raise ValueError(f"mode must be one of {KNOWLEDGE_MODES}, got {mode!r}")


class KnowledgeBuffer:
    """FIFO of the aggregated knowledge of the last B rounds (Algorithm 1, line 16).

    Parameters
    ----------
    size : int
        B, the number of rounds kept.

    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self._entries: deque[tuple[np.ndarray, np.ndarray]] = deque(maxlen=size)

    def __len__(self) -> int:
        """Number of rounds stored."""
        return len(self._entries)

    def push(self, indices: np.ndarray, targets: np.ndarray) -> None:
        """Store one round's KT rows and their targets; the oldest round leaves when full."""
        indices = np.asarray(indices, dtype=np.int64)
        targets = np.asarray(targets, dtype=np.float64)
        if targets.ndim != 2 or len(indices) != len(targets):
            raise ValueError(f"{len(indices)} indices for targets of shape {targets.shape}")
        self._entries.append((indices.copy(), targets.copy()))

    def fetch(self) -> tuple[np.ndarray, np.ndarray]:
        """All stored rows and targets, oldest first."""
        if not self._entries:
            raise ValueError("the knowledge buffer is empty")
        return (
            np.concatenate([indices for indices, _ in self._entries]),
            np.concatenate([targets for _, targets in self._entries]),
        )
