"""dpfl's central DP around a Flower aggregator: DP-FedAdam, DP-FedYogi, DP-FedAvgM, DP-FedProx, ...

DP-FedAvg (:mod:`strategies.dp_fedavg`: clip each client's update to C, Gaussian noise on the sum,
the fixed denominator, the accountant, Poisson cohorts from secret coins) computes the round's noised
average model; a Flower strategy (``strategy.flower``, as in :mod:`strategies.flower`) then takes
that one model as its only reply and turns it into the next global model with its own server
optimiser. This is the adaptive-optimisation recipe of DP federated learning (McMahan, Ramage,
Talwar, Zhang, ICLR 2018, Sec. 2: the noised average update as a pseudo-gradient for any server
optimiser; Reddi et al., "Adaptive Federated Optimization", ICLR 2021, Algorithm 2 with FedAdam,
FedYogi, FedAdagrad). The Flower strategy's ``configure_train`` still builds the train messages
(FedProx's ``proximal-mu`` reaches the clients), over the cohort dpfl drew.

Privacy: exactly DP-FedAvg's (same unit, events, calibration and accountant): what the Flower
aggregator computes from the noised average is post-processing. Its epsilon is DP-FedAvg's at the
same settings, which ``tests/test_dp_flower.py`` checks against dp_accounting's PLD. Robust
aggregators (FedMedian, FedTrimmedAvg, Krum, MultiKrum, Bulyan) and QFedAvg are refused: they would
see one vector, the noised average, and do nothing of what they are for.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp import strategy as flower_strategies

from fl_app import keys
from fl_app.config.checks import ConfigError
from fl_app.learning.sums import ClippedUpdate
from fl_app.run.context import RunContext
from strategies import register_strategy
from strategies.base import Replies
from strategies.contract import Declaration, QuickExample
from strategies.dp_fedavg import DPFedAvgSettings, DPFedAvgStrategy
from strategies.flower import FlowerRounds, build_flower_strategy, check_flower, check_kwargs, flower_class
from strategies.settings import CHECK, setting

#: Flower strategies that need many replies to do what they are for: one noised average is not that.
NEEDS_EVERY_REPLY = ("FedMedian", "FedTrimmedAvg", "Krum", "MultiKrum", "Bulyan", "QFedAvg")


def check_aggregator(key: str, value: Any) -> str:
    """A Flower strategy that can take the noised average as its one reply (``strategy.flower``)."""
    name = check_flower(key, value)
    cls = flower_class(name)
    refused = [n for n in NEEDS_EVERY_REPLY if issubclass(cls, getattr(flower_strategies, n))]
    if refused or not issubclass(cls, flower_strategies.FedAvg):
        raise ConfigError(
            key,
            value,
            "must be FedAvg or a server optimiser built on it (FedAvgM, FedProx, FedAdam, FedYogi, "
            "FedAdagrad, or a subclass): it gets one reply, the noised average, so robust and "
            f"per-client aggregators ({', '.join(NEEDS_EVERY_REPLY)}) have nothing to work on",
        )
    return name


@dataclass(frozen=True)
class DPFlowerSettings(DPFedAvgSettings):
    """``cfg.strategy`` of ``dp_flower``: DP-FedAvg's keys and the Flower aggregator's."""

    flower: str = setting(check_aggregator)
    kwargs: dict[str, Any] = field(default_factory=dict, metadata={CHECK: check_kwargs})

    def check(self, run: Any) -> None:
        """The Flower class must take the keyword arguments (built once here, one line if not)."""
        super().check(run)
        try:
            build_flower_strategy(self.flower, self.kwargs, lr=run.lr)
        except ValueError as error:
            raise ConfigError("strategy.kwargs", self.kwargs, str(error)) from None


def one_reply(arrays: ArrayRecord) -> Message:
    """The noised average as the single reply a Flower aggregator averages (weight 1: itself)."""
    content = RecordDict({keys.ARRAYS: arrays, keys.METRICS: MetricRecord({keys.NUM_EXAMPLES: 1})})
    return Message(content=content, dst_node_id=0, message_type=MessageType.TRAIN)


@register_strategy("dp_flower")
class DPFlowerStrategy(DPFedAvgStrategy):
    """DP-FedAvg's noised average, then a Flower strategy's server step on it."""

    declaration = Declaration(
        name="dp_flower",
        paper=(
            "McMahan, Ramage, Talwar, Zhang, ICLR 2018 (DP-FedAvg) with a Flower server optimiser "
            "(e.g. FedAdam/FedYogi/FedAdagrad: Reddi et al., ICLR 2021)"
        ),
        unit=DPFedAvgStrategy.declaration.unit,
        mechanism=(
            "Gaussian noise on the sum of clipped model updates; the Flower strategy post-processes "
            "the noised average"
        ),
        client="flower",
        settings=DPFlowerSettings,
        canaries=None,
        quick=QuickExample(
            overrides=(
                "num_clients=1000",
                "clients_per_round=100",
                "num_rounds=100",
                "privacy.epsilon=8.0",
                "++strategy.kwargs={eta: 0.01, beta_1: 0.9, beta_2: 0.99, tau: 0.001}",
            ),
            suite_rounds=15,
            about=(
                "DP-FedAdam (dpfl's DP-FedAvg release, Flower's FedAdam server step) at epsilon 8 per "
                "client, cross-device: 1000 clients, Poisson cohorts of expected size 100, 100 rounds"
            ),
        ),
    )
    settings: DPFlowerSettings

    def __init__(self, run: RunContext, settings: DPFlowerSettings | None = None) -> None:
        super().__init__(run, settings)
        self.flower = FlowerRounds(
            build_flower_strategy(self.settings.flower, self.settings.kwargs, lr=run.settings.lr)
        )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """DP-FedAvg's cohort (secret with Poisson sampling); the Flower strategy's messages to it."""
        cohort = super().configure_train(server_round, arrays, config, grid)
        first = next(iter(cohort), None)
        if first is None:  # an empty Poisson cohort: the Flower strategy still sees the round's model
            self.flower.configure(server_round, arrays, ConfigRecord(), [])
            return []
        node_ids = [int(m.metadata.dst_node_id) for m in cohort]
        return self.flower.configure(
            server_round, first.content[keys.ARRAYS], first.content[keys.CONFIG], node_ids
        )

    def summand(self, server_round: int) -> ClippedUpdate:
        """DP-FedAvg's clipped update: the Flower step reads nothing of the round but its noised sum."""
        return super().summand(server_round)

    def aggregate(
        self, server_round: int, replies: Replies
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """DP-FedAvg's release, handed to the Flower strategy as its one reply."""
        noised, _ = super().aggregate(server_round, replies)
        assert noised is not None  # DP-FedAvg releases every round (noise alone without replies)
        stepped, _ = self.flower.aggregate(server_round, [one_reply(noised)], like=self.round_global)
        return stepped, MetricRecord()

    def describe(self) -> None:
        """The run's header, then what the Flower aggregator runs with (its one reply has weight 1)."""
        super().describe()
        line = self.flower.settings_line(skip=("weighted_by_key",))
        log(INFO, "\t└──> server step on the noised average: %s", line)

    def privacy_summary(self) -> dict[str, Any]:
        """DP-FedAvg's, and the Flower aggregator that post-processes its release."""
        return {**super().privacy_summary(), "server_optimizer": f"Flower {self.settings.flower}"}


__all__ = ["DPFlowerSettings", "DPFlowerStrategy"]
