"""Local training, evaluation and conversions between models and Flower records."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from torch import nn
from torch.nn import functional as F  # noqa: N812 - the conventional name

EVAL_BATCH = 1024


def to_tensor(x: np.ndarray) -> torch.Tensor:
    """Turn stored images into float input: ``uint8`` is scaled to [0, 1]."""
    if x.dtype == np.uint8:
        return torch.from_numpy(x).float().div_(255.0)
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


def model_to_arrays(model: nn.Module) -> ArrayRecord:
    """The model's state as an ArrayRecord (keys = state_dict names)."""
    return ArrayRecord({k: Array(v.detach().cpu().numpy()) for k, v in model.state_dict().items()})


def load_arrays(model: nn.Module, arrays: ArrayRecord) -> None:
    """Load an ArrayRecord (as made by :func:`model_to_arrays`) into ``model``."""
    state = {k: torch.from_numpy(np.array(v.numpy(), copy=True)) for k, v in arrays.items()}
    model.load_state_dict(state, strict=True)


def arrays_to_numpy(arrays: ArrayRecord) -> list[np.ndarray]:
    """The arrays of a record, in key order."""
    return [a.numpy() for a in arrays.values()]


def numpy_to_arrays(keys: Sequence[str], values: Sequence[np.ndarray]) -> ArrayRecord:
    """Build an ArrayRecord from keys and numpy arrays."""
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys for {len(values)} arrays")
    return ArrayRecord({k: Array(np.asarray(v)) for k, v in zip(keys, values, strict=True)})


def train_local(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    rng: np.random.Generator,
    momentum: float = 0.0,
    proximal_mu: float = 0.0,
    reference: Sequence[torch.Tensor] | None = None,
) -> float:
    """Train ``model`` in place with mini-batch SGD; return the mean training loss.

    Parameters
    ----------
    model : nn.Module
        The model to train.
    x, y : np.ndarray
        Examples and integer labels.
    epochs, batch_size, lr, momentum : int, int, float, float
        SGD settings; batches follow a fresh permutation per epoch from ``rng``.
    rng : np.random.Generator
        Order of the examples.
    proximal_mu : float
        FedProx term ``mu/2 ||w - reference||^2`` (0 disables it).
    reference : Sequence[torch.Tensor], optional
        The parameters the proximal term pulls towards (required when mu > 0).

    """
    if len(y) == 0:
        return math.nan
    if proximal_mu > 0 and reference is None:
        raise ValueError("proximal_mu > 0 needs the reference parameters")
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    inputs, targets = to_tensor(x), torch.from_numpy(np.asarray(y, dtype=np.int64))
    total, batches = 0.0, 0
    for _ in range(epochs):
        order = torch.from_numpy(rng.permutation(len(y)))
        for start in range(0, len(y), batch_size):
            index = order[start : start + batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(inputs[index]), targets[index])
            if proximal_mu > 0 and reference is not None:
                prox = sum(
                    torch.sum((p - r) ** 2) for p, r in zip(model.parameters(), reference, strict=True)
                )
                loss = loss + 0.5 * proximal_mu * prox
            loss.backward()
            optimizer.step()
            total += float(loss.detach())
            batches += 1
    return total / max(batches, 1)


@torch.no_grad()
def predict_proba(model: nn.Module, x: np.ndarray, *, batch_size: int = EVAL_BATCH) -> np.ndarray:
    """Softmax outputs of ``model`` on ``x``, shape ``(n, classes)``."""
    model.eval()
    inputs = to_tensor(x)
    parts = [F.softmax(model(inputs[i : i + batch_size]), dim=1) for i in range(0, len(x), batch_size)]
    return torch.cat(parts).numpy() if parts else np.zeros((0, 0), dtype=np.float32)


@torch.no_grad()
def evaluate(
    model: nn.Module, x: np.ndarray, y: np.ndarray, *, batch_size: int = EVAL_BATCH
) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy of ``model`` on ``(x, y)``."""
    if len(y) == 0:
        return math.nan, math.nan
    model.eval()
    inputs, targets = to_tensor(x), torch.from_numpy(np.asarray(y, dtype=np.int64))
    loss_sum, correct = 0.0, 0
    for start in range(0, len(y), batch_size):
        logits = model(inputs[start : start + batch_size])
        batch_targets = targets[start : start + batch_size]
        loss_sum += float(F.cross_entropy(logits, batch_targets, reduction="sum"))
        correct += int((logits.argmax(dim=1) == batch_targets).sum())
    return loss_sum / len(y), correct / len(y)


def torch_seed(rng: np.random.Generator) -> int:
    """Draw a seed for torch's generator from a numpy generator."""
    return int(rng.integers(0, 2**63 - 1))
