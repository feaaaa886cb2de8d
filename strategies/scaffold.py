"""SCAFFOLD: stochastic controlled averaging, the stateful baseline against client drift (not private).

Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, "SCAFFOLD: Stochastic Controlled Averaging for
Federated Learning", ICML 2020, Algorithm 1. The server keeps the global model ``x`` and a control
variate ``c`` (zero at first) and sends both to the round's cohort ``S``; each client corrects its
local SGD by ``c - c_i`` with its own control variate ``c_i``, which it keeps between rounds
(``clients/scaffold.py``). From the uploads the server takes (lines 16-17)

    ``x <- x + eta_g * mean_{i in S} (y_i - x)``,  ``c <- c + (|S| / N) * mean_{i in S} Delta c_i``,

both means uniform over the clients that replied. With ``eta_g = 1`` the model step is FedAvg's
uniform average; a network's buffers (running statistics) take the average. Not private: its
``epsilon`` is null.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from flwr.app import ArrayRecord, MetricRecord

from clients.scaffold import CONTROL
from fl_app import keys
from fl_app.learning.sums import WeightedModel
from fl_app.learning.training import array_values, state_to_arrays
from fl_app.run.context import RunContext
from strategies import register_strategy
from strategies.arrays import arrays_like
from strategies.base import FederatedStrategy, Replies
from strategies.contract import Declaration, QuickExample
from strategies.settings import StrategySettings, positive


@dataclass(frozen=True)
class ScaffoldSettings(StrategySettings):
    """``cfg.strategy`` of ``scaffold`` (``conf/strategy/scaffold.yaml`` explains each key)."""

    server_lr: float = positive(default=1.0)


@register_strategy("scaffold")
class ScaffoldStrategy(FederatedStrategy):
    """The global model and the server control variate; clients keep theirs."""

    declaration = Declaration(
        name="scaffold",
        paper="Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, ICML 2020 (SCAFFOLD, Algorithm 1)",
        unit="none",
        mechanism="none",
        client="scaffold",
        settings=ScaffoldSettings,
        canaries="is not private: there is no claim to check (the estimate would be large, as it should)",
        quick=QuickExample(
            overrides=(
                "num_clients=100",
                "clients_per_round=10",
                "num_rounds=20",
                "partition.alpha=0.1",
                "local_epochs=2",
            ),
            suite_rounds=4,
            about="SCAFFOLD (not private), 100 clients split by Dirichlet(0.1), 10 per round, 20 rounds",
        ),
        deploy=("num_rounds=2",),  # the devices keep c_i from the first round to the second
    )
    settings: ScaffoldSettings

    def __init__(self, run: RunContext, settings: ScaffoldSettings | None = None) -> None:
        super().__init__(run, settings)
        names = [name for name, p in run.model_spec.build().named_parameters() if p.requires_grad]
        shapes = {name: p.shape for name, p in run.model_spec.build().named_parameters()}
        #: The server control variate ``c``, one float32 array per trainable parameter.
        self.control = {name: np.zeros(tuple(shapes[name]), dtype=np.float32) for name in names}

    def records_for_clients(self, server_round: int, arrays: ArrayRecord) -> dict[str, ArrayRecord]:
        """The global model ``x`` and the server control variate ``c``."""
        return {keys.ARRAYS: arrays, CONTROL: state_to_arrays(self.control)}

    def summand(self, server_round: int) -> WeightedModel:
        """Every client weighs 1: the sums of ``y_i`` and of ``Delta c_i`` over the clients that replied."""
        return WeightedModel(weighting="uniform")

    def aggregate(
        self, server_round: int, replies: Replies
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """``x + eta_g (mean y_i - x)`` and ``c + sum Delta c_i / N`` (lines 16-17)."""
        if not replies:
            return None, None
        total = replies.sum(self.summand(server_round))
        count = total.scalars["weight"]
        current = self.round_global
        step = self.settings.server_lr
        model = []
        for name in current:  # buffers (running statistics) take the average; parameters the step
            mean, start = total.arrays[name] / count, array_values(current[name])
            model.append(start + step * (mean - start) if name in self.control else mean)
        deltas = total.extra.get(CONTROL, {})
        for name, values in self.control.items():
            self.control[name] = (values + deltas.get(name, 0.0) / self.run.num_clients).astype(np.float32)
        loss = total.scalars["example_loss"] / total.scalars["examples"]
        return arrays_like(model, current), MetricRecord({keys.TRAIN_LOSS: float(loss)})
