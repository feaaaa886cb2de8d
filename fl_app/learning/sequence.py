"""Next-token prediction: the loss and metrics of the text tasks' networks.

A text example is a sequence of token ids: the input ``x[t]`` and the target ``y[t] = x[t + 1]``, the
network's output one score per vocabulary entry at every position, ``(batch, length, vocabulary)``.
The vocabulary has the layout of TFF's text tasks (google-research/federated
``utils/datasets/stackoverflow_word_prediction.py``): ``0`` is the pad, then the words (or
characters), then out-of-vocabulary, beginning and end of sentence (:mod:`fl_app.data.text`).

* **Loss**: the mean cross-entropy over the positions whose target is not the pad (a short sentence
  is padded to the sequence length; its padded positions count for nothing).
* **Accuracy**: the share of counted positions where the highest score is the target; a position is
  counted when its target is none of :attr:`NextToken.uncounted` (the pad, the end of sentence, and
  for Stack Overflow the out-of-vocabulary token: "accuracy without OOV" as the DP-FTRL and
  matrix-factorization papers report it, google-research/federated ``dp_ftrl/run_stackoverflow.py``,
  ``accuracy_no_oov_or_eos``).

Which task a network has travels with its :class:`~fl_app.learning.model_spec.ModelSpec` and is set
on the network it builds (:func:`mark_next_token`); a network without it is a classifier and
:func:`fl_app.learning.training.train_local` and ``evaluate`` treat it exactly as they always did.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812 - the conventional name

from fl_app.data.text_tokens import PAD

#: The attribute of a network that carries its :class:`NextToken` task.
TASK_ATTRIBUTE = "next_token_task"


@dataclass(frozen=True)
class NextToken:
    """The next-token task of a network: which targets its accuracy leaves out.

    Attributes
    ----------
    uncounted : tuple[int, ...]
        Target ids that accuracy does not count (always the pad; the papers' end of sentence and,
        for Stack Overflow, out of vocabulary). The loss leaves out the pad only.

    """

    uncounted: tuple[int, ...] = (PAD,)

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the positions whose target is not the pad (:data:`PAD`)."""
        return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=PAD)

    def sums(self, logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, int, int, int]:
        """Summed loss, non-pad positions, correct counted positions, counted positions of a batch."""
        flat_logits, flat_targets = logits.flatten(0, -2), targets.flatten()
        loss_sum = float(F.cross_entropy(flat_logits, flat_targets, ignore_index=PAD, reduction="sum"))
        valid = int((flat_targets != PAD).sum())
        counted = self.counted(flat_targets)
        correct = int(((flat_logits.argmax(dim=-1) == flat_targets) & counted).sum())
        return loss_sum, valid, correct, int(counted.sum())

    def counted(self, targets: torch.Tensor) -> torch.Tensor:
        """Which targets accuracy counts (a boolean tensor of their shape)."""
        keep = torch.ones_like(targets, dtype=torch.bool)
        for token in self.uncounted:
            keep &= targets != token
        return keep

    def baseline_accuracy(self, targets: np.ndarray) -> float:
        """The unigram baseline: the accuracy of always predicting the most frequent counted target."""
        flat = np.asarray(targets, dtype=np.int64).ravel()
        flat = flat[~np.isin(flat, np.asarray(self.uncounted, dtype=np.int64))]
        if not flat.size:
            return 0.0
        return float(np.bincount(flat).max() / flat.size)


def mark_next_token(model: nn.Module, uncounted: tuple[int, ...]) -> nn.Module:
    """Give ``model`` the next-token task (its loss and metrics); returns ``model``."""
    setattr(model, TASK_ATTRIBUTE, NextToken(tuple(sorted({PAD, *uncounted}))))
    return model


def next_token_task(model: nn.Module) -> NextToken | None:
    """The next-token task of ``model``, or None for a classifier."""
    task = getattr(model, TASK_ATTRIBUTE, None)
    return task if isinstance(task, NextToken) else None


def token_tensor(x: np.ndarray) -> torch.Tensor:
    """Token ids (any integer array, a memory map's view too) as an ``int64`` tensor."""
    return torch.from_numpy(np.asarray(x, dtype=np.int64))


@torch.no_grad()
def evaluate_next_token(
    model: nn.Module, task: NextToken, x: np.ndarray, y: np.ndarray, *, batch_size: int
) -> tuple[float, float]:
    """Mean loss over non-pad targets and accuracy over counted targets of ``model`` on ``(x, y)``."""
    model.eval()
    device = next(model.parameters()).device
    loss_sum, valid, correct, counted = 0.0, 0, 0, 0
    for start in range(0, len(y), batch_size):
        inputs = token_tensor(x[start : start + batch_size]).to(device)
        targets = token_tensor(y[start : start + batch_size]).to(device)
        part = task.sums(model(inputs), targets)
        loss_sum, valid = loss_sum + part[0], valid + part[1]
        correct, counted = correct + part[2], counted + part[3]
    loss = loss_sum / valid if valid else float("nan")
    return loss, correct / counted if counted else float("nan")
