"""The base of an evaluation stage: a training strategy wrapped, every platform hook forwarded by name.

An evaluation stage (``evaluation.stage=<name>``, registered with
:func:`strategies.register_evaluation_stage`) adds releases of its own to any training strategy:
the platform builds the strategy, wraps it (``stage(strategy)``) and then talks only to the
wrapper. :class:`EvaluationStage` forwards each hook the platform calls (the round hooks of
Flower's ``Strategy`` and the reporting hooks of :class:`~strategies.base.FederatedStrategy`) to
the wrapped strategy, explicitly, so a stage overrides exactly the hooks it changes and nothing
reaches the strategy by accident. A stage that releases something must also override
:meth:`epsilon` (the total per client), :meth:`stage_epsilons`, :meth:`released_stages` and
:meth:`extra_ledgers`, so that its cost is in the run's one epsilon and its events in the run's ledgers.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from omegaconf import DictConfig

from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.composition import EpsilonReport
from fl_app.roster import ClientInfo
from fl_app.run_context import RunContext
from strategies.base import FederatedStrategy


class EvaluationStage(Strategy):
    """Forwards every platform hook to :attr:`inner` (see the module docstring).

    Parameters
    ----------
    strategy : FederatedStrategy
        The training strategy.

    """

    def __init__(self, strategy: FederatedStrategy) -> None:
        self.inner = strategy

    @classmethod
    def training_config(cls, cfg: DictConfig) -> DictConfig:
        """The configuration the training strategy is built with (override to take a share of the budget)."""
        return cfg

    @property
    def run(self) -> RunContext:
        """The run (the training strategy's)."""
        return self.inner.run

    @property
    def cfg(self) -> DictConfig:
        """The run configuration the training strategy was built with."""
        return self.inner.cfg

    @property
    def accountant(self) -> PrivacyAccountant | None:
        """The training accountant (``privacy_ledger.json``)."""
        return self.inner.accountant

    @property
    def privacy_unit(self) -> str:
        """The training strategy's unit: the run's epsilon is stated in it."""
        return self.inner.privacy_unit

    @property
    def secret_cohort(self) -> bool:
        """Whether the training strategy's cohorts are secret (forwarded)."""
        return self.inner.secret_cohort

    def is_private(self, cfg: DictConfig) -> bool:
        """Forwarded."""
        return self.inner.is_private(cfg)

    def initial_arrays(self) -> ArrayRecord:
        """Forwarded."""
        return self.inner.initial_arrays()

    def summary(self) -> None:
        """Forwarded."""
        self.inner.summary()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Forwarded."""
        return self.inner.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Forwarded."""
        return self.inner.aggregate_train(server_round, replies)

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Forwarded."""
        return self.inner.configure_evaluate(server_round, arrays, config, grid)

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Forwarded."""
        return self.inner.aggregate_evaluate(server_round, replies)

    def evaluate_global(self, arrays: ArrayRecord, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """Forwarded."""
        return self.inner.evaluate_global(arrays, x, y)

    def epsilon(self) -> EpsilonReport | None:
        """Forwarded (a stage that releases anything composes its cost into it)."""
        return self.inner.epsilon()

    def training_epsilon(self) -> EpsilonReport | None:
        """The training stage's epsilon alone."""
        return self.inner.epsilon()

    def stage_epsilons(self) -> dict[str, float | None]:
        """Forwarded."""
        return self.inner.stage_epsilons()

    def released_stages(self) -> list[str]:
        """Forwarded."""
        return self.inner.released_stages()

    def extra_ledgers(self) -> dict[str, dict[str, Any]]:
        """Forwarded."""
        return self.inner.extra_ledgers()

    def for_checkpoint(self) -> EvaluationStage:
        """A shallow copy whose training strategy drops its round state (see :mod:`fl_app.checkpoint`)."""
        kept = copy.copy(self)
        kept.inner = self.inner.for_checkpoint()
        return kept

    def private_state(self) -> str | None:
        """Forwarded."""
        return self.inner.private_state()

    def cohort_randomness(self) -> str:
        """Forwarded."""
        return self.inner.cohort_randomness()

    def selected(self, server_round: int) -> list[ClientInfo]:
        """Forwarded (the clients of the train round)."""
        return self.inner.selected(server_round)

    def round_failures(self, server_round: int) -> list[int]:
        """Forwarded (the failures of the train round)."""
        return self.inner.round_failures(server_round)

    def round_failure_reasons(self, server_round: int) -> list[str]:
        """Forwarded."""
        return self.inner.round_failure_reasons(server_round)

    def round_extras(self, server_round: int) -> dict[str, Any]:
        """Forwarded."""
        return self.inner.round_extras(server_round)

    def diagnostics(self, server_round: int) -> dict[str, Any]:
        """Forwarded."""
        return self.inner.diagnostics(server_round)

    def privacy_summary(self) -> dict[str, Any]:
        """Forwarded."""
        return self.inner.privacy_summary()

    def final_extras(self) -> dict[str, Any]:
        """Forwarded."""
        return self.inner.final_extras()

    def empirical_privacy(self, final: ArrayRecord) -> dict[str, Any] | None:
        """Forwarded."""
        return self.inner.empirical_privacy(final)
