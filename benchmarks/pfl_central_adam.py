r"""pfl-research's central optimiser as a Flower strategy, for ``strategy=dp_flower`` in the cross-check.

pfl-research's LM benchmark (``benchmarks/lm/pytorch/train.py``) steps the global model with
``torch.optim.Adam(lr, eps=adaptivity_degree, betas=(0.9, 0.99))`` on the pseudo-gradient (minus the
round's averaged update), its learning rate under a linear warm-up (``LambdaLR``: step ``s`` at
``lr * s / warmup`` while ``s < warmup``, so the first step is at 0). Flower's ``FedAdam`` differs in
two ways that matter when the averaged update is small, as it is under DP: its bias correction runs
one round ahead (``server_round + 1``) and its ``tau`` is added to the uncorrected ``sqrt(v)``.
:class:`PflCentralAdam` is ``FedAdam`` with PyTorch's Adam step and pfl-research's warm-up::

    strategy=dp_flower strategy.flower=benchmarks.pfl_central_adam:PflCentralAdam \\
        +strategy.kwargs.eta=0.1 +strategy.kwargs.tau=0.01 +strategy.kwargs.warmup=8

``benchmarks/pfl_crosscheck.py`` uses it so that both sides of the learning comparison run the same
server optimiser; ``tests/test_pfl_crosscheck.py`` checks its step against ``torch.optim.Adam``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from flwr.serverapp.strategy import FedAdam, FedAvg


class PflCentralAdam(FedAdam):
    """``FedAdam`` stepping as ``torch.optim.Adam`` does, with pfl-research's linear warm-up.

    Parameters
    ----------
    warmup : int
        Rounds of linear warm-up (pfl-research's ``central_lr_num_warmup_iterations``); 0: none.
    **kwargs
        ``FedAdam``'s (``eta`` is Adam's learning rate, ``tau`` its ``eps``, ``beta_1``, ``beta_2``).

    """

    def __init__(self, *, warmup: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.warmup = int(warmup)
        self.steps = 0

    def learning_rate(self, step: int) -> float:
        """The rate of update number ``step`` (from 0), as pfl-research's ``LambdaLR`` gives it."""
        if self.warmup > 0 and step < self.warmup:
            return self.eta * step / self.warmup
        return self.eta

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The averaged model's update taken as minus the gradient of one ``torch.optim.Adam`` step."""
        averaged, metrics = FedAvg.aggregate_train(self, server_round, replies)
        if averaged is None or self.current_arrays is None:
            return averaged, metrics
        delta, m_t, arrays = self._compute_deltat_and_mt(averaged)
        if not self.v_t:
            self.v_t = {k: np.zeros_like(v) for k, v in arrays.items()}
        self.v_t = {k: self.beta_2 * v + (1 - self.beta_2) * delta[k] ** 2 for k, v in self.v_t.items()}
        rate = self.learning_rate(self.steps)
        self.steps += 1
        first = 1 - self.beta_1**self.steps
        second = 1 - self.beta_2**self.steps
        new = {
            k: x + rate * (m_t[k] / first) / (np.sqrt(self.v_t[k] / second) + self.tau)
            for k, x in self.current_arrays.items()
        }
        return ArrayRecord(
            {
                k: Array(np.asarray(v, dtype=x.dtype))
                for (k, v), x in zip(new.items(), self.current_arrays.values(), strict=True)
            }
        ), metrics
