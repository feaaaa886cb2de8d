"""The adapter: a Flower strategy object's configure/aggregate on dpfl's cohorts, clients and reports.

A Flower user's strategy (any runnable class of :mod:`flwr.serverapp.strategy`, or a subclass of one
in the user's own module) runs with dpfl's clients, reports, checkpoints and sweeps. The adapter
keeps what dpfl owns and hands the rest to the Flower object unchanged:

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

Only the server changes: the clients are dpfl's ``flower`` client (FedAvg's local SGD, plus FedProx's
proximal term when the strategy sends ``proximal-mu``). Where Flower's defaults would run something
else than the class's name says, the adapter sets its own (FedAvgM's server momentum) or refuses
(FedProx without a proximal term; FedOpt's ``eta_l``, which no client reads). Flower's
differential-privacy wrappers run through :mod:`strategies.flower.dp`.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import strategy as flower_strategies

from fl_app import keys
from fl_app.learning.training import array_values

#: What dpfl sets on every Flower strategy it builds: it samples the cohort (all of it goes to Flower's
#: ``configure_train``), never waits for nodes, and evaluates centrally.
SAMPLING: dict[str, Any] = {
    "fraction_train": 1.0,
    "fraction_evaluate": 0.0,
    "min_train_nodes": 0,
    "min_evaluate_nodes": 0,
    "min_available_nodes": 0,
}

#: Classes of :mod:`flwr.serverapp.strategy` dpfl does not run (refused with the reason, as are their
#: subclasses).
NOT_RUNNABLE: dict[str, str] = {
    "Strategy": "is Flower's abstract base class, not a strategy",
    "FedXgbBagging": "aggregates serialised XGBoost models; dpfl's clients train torch networks",
    "FedXgbCyclic": "aggregates serialised XGBoost models; dpfl's clients train torch networks",
}

#: Constructor keywords whose value no part of a dpfl run reads: refused (they would be ignored).
UNUSED_KEYWORDS: dict[str, str] = {
    "eta_l": "Flower's FedOpt strategies keep eta_l but never send it; dpfl's clients train with lr",
}

#: Constructor keywords that name record keys or aggregation callbacks: left out of the header.
RECORD_KEYWORDS = ("arrayrecord_key", "configrecord_key", "train_metrics_aggr_fn", "evaluate_metrics_aggr_fn")

#: FedAvgM's server momentum where none is given (Hsu, Qi, Brown 2019 use 0.9; Flower's default,
#: 0.0, is FedAvg with a server learning rate, so a sweep over FedAvg and FedAvgM had two equal arms).
FEDAVGM_MOMENTUM = 0.9


def runnable_classes() -> list[str]:
    """The classes of :mod:`flwr.serverapp.strategy` dpfl runs (the unknown-class error lists them)."""
    return sorted(
        name
        for name in flower_strategies.__all__
        if name[0].isupper() and name != "Result" and name not in NOT_RUNNABLE
    )


def flower_class(name: str) -> type[flower_strategies.Strategy]:
    """The Flower strategy class ``name`` names.

    ``FedAdam`` is :mod:`flwr.serverapp.strategy`'s; ``package.module:Class`` (or
    ``package.module.Class``) is a class of the user's own, importable where the server runs.

    Raises
    ------
    ValueError
        The name names no class, one that is not a Flower strategy, or one dpfl cannot run.

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
        raise ValueError(
            f"must name a Flower strategy class: one of flwr.serverapp.strategy "
            f"({', '.join(runnable_classes())}) or package.module:Class of your own"
        )
    for refused, why in NOT_RUNNABLE.items():
        base = getattr(flower_strategies, refused)
        if found is base or (refused != "Strategy" and issubclass(found, base)):
            raise ValueError(f"{found.__name__} {why}; dpfl runs {', '.join(runnable_classes())}")
    if inspect.isabstract(found):
        raise ValueError(f"{found.__name__} is abstract (it does not implement every Strategy method)")
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


def adapter_defaults(cls: type, lr: float | None) -> dict[str, Any]:
    """What the adapter gives ``cls`` where Flower's default would not run what its name says.

    FedAvgM: server momentum :data:`FEDAVGM_MOMENTUM`. QFedAvg: dpfl's train-loss key, and the
    clients' learning rate ``lr`` as its ``client_learning_rate`` (its Lipschitz estimate is 1/lr).
    """
    defaults: dict[str, Any] = {}
    if issubclass(cls, flower_strategies.FedAvgM):
        defaults["server_momentum"] = FEDAVGM_MOMENTUM
    if issubclass(cls, flower_strategies.QFedAvg):
        defaults["train_loss_key"] = keys.TRAIN_LOSS
        if lr is not None:
            defaults["client_learning_rate"] = lr
    return defaults


def refused_keywords(cls: type, kwargs: Mapping[str, Any]) -> str | None:
    """Why ``kwargs`` would run ``cls`` as something else than its name says (None: they do not)."""
    taken = sorted(set(kwargs) & set(SAMPLING))
    if taken:
        return f"{', '.join(taken)}: dpfl draws the cohort; set clients_per_round instead"
    unused = sorted(set(kwargs) & set(UNUSED_KEYWORDS))
    if unused:
        return f"{unused[0]}: {UNUSED_KEYWORDS[unused[0]]}"
    if issubclass(cls, flower_strategies.FedProx):
        mu = kwargs.get("proximal_mu", 0.0)
        if isinstance(mu, bool) or not isinstance(mu, int | float) or not mu > 0:
            return (
                f"{cls.__name__} needs proximal_mu > 0 (without it, it runs FedAvg): add "
                "+strategy.kwargs.proximal_mu=0.01, for example"
            )
    return None


def build_flower_strategy(
    name: str, kwargs: Mapping[str, Any], *, lr: float | None = None
) -> flower_strategies.Strategy:
    """An instance of ``name`` with ``kwargs``, the adapter's defaults and dpfl's sampling.

    Raises
    ------
    ValueError
        An unknown or refused class, a keyword it does not take, a sampling keyword (dpfl samples),
        or keywords that would run it as another algorithm (:func:`refused_keywords`).

    """
    cls = flower_class(name)
    refusal = refused_keywords(cls, kwargs)
    if refusal is not None:
        raise ValueError(refusal)
    parameters = inspect.signature(cls.__init__).parameters
    fixed = {**SAMPLING, **adapter_defaults(cls, lr)}
    arguments = {**{key: value for key, value in fixed.items() if key in parameters}, **dict(kwargs)}
    try:
        with flower_logs_quiet(logging.ERROR):  # its warning that federated evaluation is off: dpfl's choice
            return cls(**arguments)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{cls.__name__}: {error}") from None


def settings_text(strategy: flower_strategies.Strategy, *, skip: Iterable[str] = ()) -> str:
    """The Flower object's settings that shape the server's step, as ``name=value, ...``.

    Its constructor's keywords as the object holds them, without dpfl's sampling (dpfl draws the
    cohort), the record keys and callbacks, the keywords no part of a run reads
    (:data:`UNUSED_KEYWORDS`) and ``skip``: what Flower's own ``summary()`` prints that a dpfl run
    contradicts is not said.
    """
    left_out = {"self", *SAMPLING, *RECORD_KEYWORDS, *UNUSED_KEYWORDS, *skip}
    items = []
    for name, parameter in inspect.signature(type(strategy).__init__).parameters.items():
        if name in left_out or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if not hasattr(strategy, name) or isinstance(getattr(strategy, name), flower_strategies.Strategy):
            continue
        value = getattr(strategy, name)
        items.append(f"{name}={value!r}" if isinstance(value, str) else f"{name}={value}")
    return ", ".join(items) if items else "no settings of its own"


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

    def settings_line(self, *, skip: Iterable[str] = ()) -> str:
        """``Flower <Class>: name=value, ...`` for the run's header (:func:`settings_text`)."""
        return f"Flower {type(self.strategy).__name__}: {settings_text(self.strategy, skip=skip)}"


__all__ = [
    "FEDAVGM_MOMENTUM",
    "CohortGrid",
    "FlowerRounds",
    "build_flower_strategy",
    "flower_class",
    "flower_logs_quiet",
    "runnable_classes",
    "settings_text",
]
