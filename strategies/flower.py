"""Flower's own strategies in dpfl: ``strategy=flower strategy.flower=FedAdam`` (or FedProx, FedYogi, ...).

A Flower user's strategy (any class of :mod:`flwr.serverapp.strategy`, or a subclass of one in the
user's own module) runs as a non-private algorithm with dpfl's clients, reports, checkpoints and
sweeps. The adapter keeps what dpfl owns and hands the rest to the Flower object unchanged:

* dpfl draws the cohort (``clients_per_round``, seeded: Flower's ``sample_nodes`` uses the global
  ``random``) and builds the train config its clients read (local epochs, learning rate, the data
  and model specs);
* the Flower strategy's own ``configure_train`` then builds the messages over exactly that cohort
  (a grid that lists only its nodes, with the strategy's sampling set to take all of them), adding
  what it adds to the config: FedProx's ``proximal-mu``, which dpfl's ``flower`` client applies;
* the Flower strategy's own ``aggregate_train`` aggregates the valid replies (sorted by client id,
  so a seeded run sums them in the same order every time); FedAdam, FedYogi, FedAdagrad (Reddi et
  al., "Adaptive Federated Optimization", ICLR 2021) keep their optimiser state in the object, which
  the checkpoint carries;
* dpfl evaluates the global model centrally every round; Flower's federated evaluation is off
  (``evaluation.federated_fraction`` is dpfl's).

The replies of dpfl's clients are what Flower's strategies expect: one ``ArrayRecord`` under
``arrays`` and one ``MetricRecord`` with ``num-examples`` (and ``train-loss``). Flower's
differential-privacy wrappers are refused: dpfl's own central DP wraps a Flower aggregator instead,
with its accountant (``strategy=dp_flower``, :mod:`strategies.dp_flower`).
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp import strategy as flower_strategies

from fl_app import keys
from fl_app.config_checks import ConfigError
from fl_app.run_context import RunContext
from fl_app.training import array_values
from strategies import register_strategy
from strategies.base import FederatedStrategy
from strategies.contract import Declaration, QuickExample
from strategies.settings import CHECK, StrategySettings, setting

#: What dpfl sets on every Flower strategy it builds: it samples the cohort (all of it goes to Flower's
#: ``configure_train``), never waits for nodes, and evaluates centrally.
SAMPLING: dict[str, Any] = {
    "fraction_train": 1.0,
    "fraction_evaluate": 0.0,
    "min_train_nodes": 0,
    "min_evaluate_nodes": 0,
    "min_available_nodes": 0,
}


def flower_class(name: str) -> type[flower_strategies.Strategy]:
    """The Flower strategy class ``name`` names.

    ``FedAdam`` is :mod:`flwr.serverapp.strategy`'s; ``package.module:Class`` (or
    ``package.module.Class``) is a class of the user's own, importable where the server runs.

    Raises
    ------
    ValueError
        The name names no class, or one that is not a Flower strategy.

    """
    if ":" in name or "." in name:
        module, _, attribute = name.rpartition(":") if ":" in name else name.rpartition(".")
        try:
            found = getattr(importlib.import_module(module), attribute)
        except (ImportError, AttributeError) as error:
            raise ValueError(f"cannot import {name}: {error}") from None
    else:
        found = getattr(flower_strategies, name, None)
    if not (inspect.isclass(found) and issubclass(found, flower_strategies.Strategy)):
        known = ", ".join(sorted(n for n in flower_strategies.__all__ if n[0].isupper() and n != "Result"))
        raise ValueError(
            f"must name a Flower strategy class: one of flwr.serverapp.strategy ({known}) or "
            "package.module:Class of your own"
        )
    if found.__name__.startswith("DifferentialPrivacy"):
        raise ValueError(
            "Flower's DP wrappers are not accounted by dpfl: use strategy=dp_flower (dpfl's central DP "
            "around a Flower aggregator) or dp_fedavg"
        )
    return found


@contextmanager
def flower_logs_quiet(level: int = logging.WARNING) -> Iterator[None]:
    """Flower's lines below ``level`` off while a Flower strategy works (dpfl reports the cohorts)."""
    logger = logging.getLogger("flwr")
    before = logger.level
    if before >= level:  # already quiet: setLevel would clear every logger's cache (0.1-0.2 ms a call)
        yield
        return
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(before)


def build_flower_strategy(name: str, kwargs: Mapping[str, Any]) -> flower_strategies.Strategy:
    """An instance of ``name`` with ``kwargs`` and dpfl's sampling (:data:`SAMPLING`).

    Raises
    ------
    ValueError
        An unknown class, a keyword it does not take, or a sampling keyword (dpfl samples).

    """
    cls = flower_class(name)
    taken = sorted(set(kwargs) & set(SAMPLING))
    if taken:
        raise ValueError(f"{', '.join(taken)}: dpfl draws the cohort; set clients_per_round instead")
    parameters = inspect.signature(cls.__init__).parameters
    sampling = {key: value for key, value in SAMPLING.items() if key in parameters}
    try:
        with flower_logs_quiet(logging.ERROR):  # its warning that federated evaluation is off: dpfl's choice
            return cls(**sampling, **dict(kwargs))
    except TypeError as error:
        raise ValueError(f"{cls.__name__}: {error}") from None


class CohortGrid:
    """What a Flower strategy's ``configure_train`` sees of the grid: the round's cohort, nothing else."""

    def __init__(self, node_ids: Iterable[int]) -> None:
        self.node_ids = [int(n) for n in node_ids]

    def get_node_ids(self) -> list[int]:
        """The cohort's node ids (dpfl drew them)."""
        return list(self.node_ids)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"a Flower strategy run by dpfl may only list the cohort's nodes (it called grid.{name})"
        )


class FlowerRounds:
    """A Flower strategy's ``configure_train``/``aggregate_train`` on dpfl's cohort and replies."""

    def __init__(self, strategy: flower_strategies.Strategy) -> None:
        self.strategy = strategy

    def configure(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, node_ids: list[int]
    ) -> list[Message]:
        """The Flower strategy's train messages to exactly ``node_ids`` (its keys added to ``config``)."""
        with flower_logs_quiet():
            messages = self.strategy.configure_train(server_round, arrays, config, CohortGrid(node_ids))
        messages = sorted(messages, key=lambda m: int(m.metadata.dst_node_id))
        if {int(m.metadata.dst_node_id) for m in messages} != set(node_ids):
            raise RuntimeError(f"{type(self.strategy).__name__} did not address exactly the cohort dpfl drew")
        return messages

    def aggregate(
        self, server_round: int, replies: list[Message], *, like: ArrayRecord
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The Flower strategy's aggregate of ``replies`` (sorted by client id), in ``like``'s dtypes.

        (Flower's server optimisers compute in float64; the global model keeps its own dtypes.)
        """
        with flower_logs_quiet():
            arrays, metrics = self.strategy.aggregate_train(server_round, replies)
        if arrays is None:
            return None, metrics
        dtypes = {name: array_values(like[name]).dtype for name in like}  # read in place, not decoded
        cast = {name: Array(array_values(arrays[name]).astype(dtypes[name])) for name in like}
        return ArrayRecord(cast), metrics

    def summary(self) -> None:
        """Flower's own summary of the strategy (its settings), in the run's header."""
        self.strategy.summary()


def check_flower(key: str, value: Any) -> str:
    """A Flower strategy class name (``strategy.flower``)."""
    if not isinstance(value, str) or not value:
        raise ConfigError(key, value, "must name a Flower strategy class, e.g. FedAdam")
    try:
        flower_class(value)
    except ValueError as error:
        raise ConfigError(key, value, str(error)) from None
    return value


def check_kwargs(key: str, value: Any) -> dict[str, Any]:
    """Keyword arguments of the Flower strategy's constructor (``strategy.kwargs``)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(key, value, "must be a mapping of keyword arguments, e.g. {eta: 0.01}")
    return dict(value)


@dataclass(frozen=True)
class FlowerSettings(StrategySettings):
    """``cfg.strategy`` of ``flower`` (``conf/strategy/flower.yaml``)."""

    flower: str = setting(check_flower)
    kwargs: dict[str, Any] = field(default_factory=dict, metadata={CHECK: check_kwargs})

    def check(self, run: Any) -> None:
        """The class must take the keyword arguments (built once here, one line if not)."""
        try:
            build_flower_strategy(self.flower, self.kwargs)
        except ValueError as error:
            raise ConfigError("strategy.kwargs", self.kwargs, str(error)) from None


@register_strategy("flower")
class FlowerStrategy(FederatedStrategy):
    """A Flower strategy's configure/aggregate on dpfl's cohorts, clients and reports."""

    declaration = Declaration(
        name="flower",
        paper=(
            "Flower's strategies (flwr.serverapp.strategy): e.g. FedProx (Li et al., MLSys 2020), "
            "FedAdam/FedYogi/FedAdagrad (Reddi et al., ICLR 2021), FedAvgM (Hsu et al., 2019)"
        ),
        unit="none",
        mechanism="none",
        client="flower",
        settings=FlowerSettings,
        canaries="is not private: there is no claim to check",
        quick=QuickExample(
            overrides=(
                "num_clients=100",
                "clients_per_round=10",
                "num_rounds=20",
                "strategy.flower=FedAdam",
                "++strategy.kwargs={eta: 0.01, beta_1: 0.9, beta_2: 0.99, tau: 0.001}",
            ),
            suite_rounds=4,
            about="Flower's FedAdam (not private), 100 clients, 10 per round, 20 rounds",
        ),
    )
    settings: FlowerSettings

    def __init__(self, run: RunContext, settings: FlowerSettings | None = None) -> None:
        super().__init__(run, settings)
        self.flower = FlowerRounds(build_flower_strategy(self.settings.flower, self.settings.kwargs))

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The cohort and train config dpfl draws; the Flower strategy's messages."""
        self._round_global = arrays
        clients = self.select_clients(server_round)
        self.replies.record_selected(server_round, clients)
        return self.flower.configure(
            server_round,
            self.records_for_clients(server_round, arrays)[keys.ARRAYS],
            self.train_config(server_round, config),
            [c.node_id for c in clients],
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The Flower strategy's aggregate of the valid replies."""
        valid, _ = self.replies.split(server_round, replies)
        if not valid:
            return None, None
        return self.flower.aggregate(server_round, [message for _, message in valid], like=self.round_global)

    def describe(self) -> None:
        """The run's header, then Flower's summary of the strategy."""
        super().describe()
        self.flower.summary()


__all__ = ["CohortGrid", "FlowerRounds", "FlowerSettings", "FlowerStrategy", "build_flower_strategy"]
