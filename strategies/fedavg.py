"""FedAvg: the non-private baseline.

McMahan, Moore, Ramage, Hampson, Agüera y Arcas, "Communication-Efficient
Learning of Deep Networks from Decentralized Data", AISTATS 2017, Algorithm 1:
each round a fraction of clients trains the global model locally and the server
sets ``w_{t+1} = sum_k (n_k / n) w^k_{t+1}`` (``strategy.weighting=num_examples``;
``uniform`` averages with equal weights). No privacy: the results report
``epsilon`` as ``null`` (no finite guarantee).

Server optimiser (FedAvgM; Hsu, Qi, Brown, "Measuring the Effects of Non-Identical
Data Distribution for Federated Visual Classification", 2019, and Reddi et al.,
"Adaptive Federated Optimization", ICLR 2021, Algorithm 1 with SGD momentum): the
average update ``Delta_t = avg_k w^k_{t+1} - w_t`` drives
``v_t = beta v_{t-1} + Delta_t`` and ``w_{t+1} = w_t + eta_s v_t``
(``strategy.server_lr`` = eta_s, ``strategy.server_momentum`` = beta). The defaults
(eta_s = 1, beta = 0) are plain FedAvg.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, MetricRecord

from fl_app import keys
from fl_app.learning.sums import WeightedModel
from fl_app.learning.training import array_values
from fl_app.run.context import RunContext
from strategies import register_strategy
from strategies.arrays import ServerMomentum, arrays_like
from strategies.base import FederatedStrategy, Replies
from strategies.contract import Declaration, QuickExample
from strategies.settings import StrategySettings, between, one_of, positive

WEIGHTINGS = ("num_examples", "uniform")


@dataclass(frozen=True)
class FedAvgSettings(StrategySettings):
    """``cfg.strategy`` of ``fedavg`` (``conf/strategy/fedavg.yaml`` explains each key)."""

    weighting: str = one_of(WEIGHTINGS, default="num_examples")
    server_lr: float = positive(default=1.0)
    server_momentum: float = between(0.0, 1.0, high_open=True, default=0.0)


@register_strategy("fedavg")
class FedAvgStrategy(FederatedStrategy):
    """Federated averaging of the clients' locally trained models."""

    declaration = Declaration(
        name="fedavg",
        paper="McMahan, Moore, Ramage, Hampson, Aguera y Arcas, AISTATS 2017 (FedAvg)",
        unit="none",
        mechanism="none",
        client="fedavg",
        settings=FedAvgSettings,
        canaries="is not private: there is no claim to check (the estimate would be large, as it should)",
        quick=QuickExample(
            overrides=("num_clients=100", "clients_per_round=10", "num_rounds=20"),
            suite_rounds=4,
            about="FedAvg (not private), 100 clients, 10 per round, 20 rounds",
        ),
        comparisons=("comparison", "cross_device"),
    )
    settings: FedAvgSettings

    def __init__(self, run: RunContext, settings: FedAvgSettings | None = None) -> None:
        super().__init__(run, settings)
        self.server_optimizer = ServerMomentum(
            lr=self.settings.server_lr, momentum=self.settings.server_momentum
        )

    def server_step(self, average: ArrayRecord) -> ArrayRecord:
        """``w_t + eta_s v_t``, ``v_t = beta v_{t-1} + (average - w_t)``; the average itself by default.

        The step moves the parameters only: the network's buffers (BatchNorm's running statistics and
        batch count) are the clients' average (a running variance stepped past it could turn negative).
        """
        if self.server_optimizer.lr == 1.0 and self.server_optimizer.momentum == 0.0:
            return average
        current = self.round_global
        buffers = self.buffer_names
        names = [n for n in current if n not in buffers]
        start = [array_values(current[n]).astype(np.float64) for n in names]
        updates = [array_values(average[n]) - w for n, w in zip(names, start, strict=True)]
        stepped = dict(zip(names, self.server_optimizer.step(start, updates), strict=True))
        return arrays_like(
            [stepped[n] if n in stepped else array_values(average[n]) for n in current], current
        )

    @functools.cached_property
    def buffer_names(self) -> frozenset[str]:
        """The keys of the network's state that are buffers (:func:`fl_app.learning.models.state_buffers`)."""
        from fl_app.learning.models import state_buffers

        return frozenset(state_buffers(self.run.model_spec.build()))

    def summand(self, server_round: int) -> WeightedModel:
        """Each client's model times its weight: the average is a sum."""
        return WeightedModel(weighting=self.settings.weighting)

    def aggregate(
        self, server_round: int, replies: Replies
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Average the returned models (by examples or uniformly): ``sum_k n_k w_k / sum_k n_k``."""
        if not replies:
            return None, None
        total = replies.sum(self.summand(server_round))
        weight = total.scalars["weight"]
        average = arrays_like([total.arrays[name] / weight for name in total.arrays], self.round_global)
        loss = total.scalars["example_loss"] / total.scalars["examples"]  # per example, as before
        return self.server_step(average), MetricRecord({keys.TRAIN_LOSS: float(loss)})
