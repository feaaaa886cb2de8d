"""The base of an evaluation stage: a training strategy wrapped, the strategy contract forwarded.

An evaluation stage (``evaluation.stage=<name>``, registered with
:func:`strategies.register_evaluation_stage`) adds releases of its own to any training strategy:
the platform builds the strategy, wraps it (``stage(strategy)``) and then talks only to the
wrapper, through the contract (:class:`strategies.contract.Strategy`). :class:`EvaluationStage`
forwards each member of the contract to the wrapped strategy, explicitly, so a stage overrides
exactly what it changes and reaches the strategy only through the contract. A stage that releases
something composes its cost into the reports (:meth:`report_round`'s ``epsilon``, the run report's
total and stages) and adds its ledger to :meth:`ledgers`.

Class-level hooks the platform calls before a run: :attr:`settings_type` (the stage's typed keys,
read once by validation into ``RunSettings.stage_settings``) and ``training_settings(settings)`` (the
settings the training strategy is built with, e.g. with a share of the budget taken out).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid

from fl_app.config.settings import RunSettings
from fl_app.run.context import RunContext
from strategies.contract import JSON, Declaration, Strategy
from strategies.reporting import Randomness, RoundReport, RunReport
from strategies.settings import StrategySettings


class EvaluationStage:
    """Forwards the strategy contract to :attr:`inner` (see the module docstring).

    Parameters
    ----------
    strategy : Strategy
        The training strategy.

    """

    def __init__(self, strategy: Strategy) -> None:
        self.inner = strategy

    #: The stage's typed keys (a :class:`~strategies.settings.StrategySettings` of ``section =
    #: "evaluation"``), read and checked by validation; None: the stage has none.
    settings_type: ClassVar[type[StrategySettings] | None] = None

    @classmethod
    def training_settings(cls, settings: RunSettings) -> RunSettings:
        """The settings the training strategy is built with (override to take a share of the budget)."""
        return settings

    @property
    def declaration(self) -> Declaration:  # type: ignore[override]
        """The training algorithm's declaration (the run's epsilon is stated in its unit)."""
        return self.inner.declaration

    @property
    def run(self) -> RunContext:
        """The run (the training strategy's)."""
        return self.inner.run

    def describe(self) -> None:
        """Forwarded."""
        self.inner.describe()

    def initial_arrays(self) -> ArrayRecord:
        """Forwarded."""
        return self.inner.initial_arrays()

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

    def arrays_for_evaluation(self, arrays: ArrayRecord) -> ArrayRecord:
        """Forwarded."""
        return self.inner.arrays_for_evaluation(arrays)

    def evaluate_global(self, arrays: ArrayRecord, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """Forwarded."""
        return self.inner.evaluate_global(arrays, x, y)

    def report_round(self, server_round: int) -> RoundReport:
        """Forwarded (a stage that releases anything composes its cost into the report)."""
        return self.inner.report_round(server_round)

    def report_run(self, final: ArrayRecord) -> RunReport:
        """Forwarded (a stage that releases anything adds its stage, ledger and fields)."""
        return self.inner.report_run(final)

    def randomness(self) -> Randomness:
        """Forwarded."""
        return self.inner.randomness()

    def ledgers(self) -> dict[str, dict[str, JSON]]:
        """Forwarded."""
        return self.inner.ledgers()

    def for_checkpoint(self) -> EvaluationStage:
        """A shallow copy whose training strategy keeps only what a checkpoint may hold."""
        kept = copy.copy(self)
        kept.inner = self.inner.for_checkpoint()
        return kept
