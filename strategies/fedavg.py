"""FedAvg: the non-private baseline.

McMahan, Moore, Ramage, Hampson, Agüera y Arcas, "Communication-Efficient
Learning of Deep Networks from Decentralized Data", AISTATS 2017, Algorithm 1:
each round a fraction of clients trains the global model locally and the server
sets ``w_{t+1} = sum_k (n_k / n) w^k_{t+1}`` (``strategy.weighting=num_examples``;
``uniform`` averages with equal weights). No privacy: the results report
``epsilon`` as ``null`` (no finite guarantee).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord
from omegaconf import DictConfig

from fl_app import keys
from fl_app.validation import require_choice
from strategies import register_strategy
from strategies.base import FederatedStrategy, mean_arrays

WEIGHTINGS = ("num_examples", "uniform")


@register_strategy("fedavg")
class FedAvgStrategy(FederatedStrategy):
    """Federated averaging of the clients' locally trained models."""

    client_name = "fedavg"

    @classmethod
    def validate_config(cls, cfg: DictConfig) -> None:
        """``strategy.weighting`` must be known."""
        require_choice("strategy.weighting", cfg.strategy.get("weighting", "num_examples"), WEIGHTINGS)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Average the returned models (by examples or uniformly)."""
        valid, _ = self.split_replies(server_round, replies)
        if not valid:
            return None, None
        examples = [float(m.content.metric_records[keys.METRICS][keys.NUM_EXAMPLES]) for _, m in valid]
        uniform = self.cfg.strategy.get("weighting", "num_examples") == "uniform"
        arrays = mean_arrays(
            [m.content.array_records[keys.ARRAYS] for _, m in valid], None if uniform else examples
        )
        losses = [float(m.content.metric_records[keys.METRICS][keys.TRAIN_LOSS]) for _, m in valid]
        return arrays, MetricRecord({keys.TRAIN_LOSS: float(np.average(losses, weights=examples))})
