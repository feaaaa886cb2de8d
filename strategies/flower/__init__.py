"""Flower's own strategies in dpfl: ``strategy=flower strategy.flower=FedAdam`` (or FedProx, FedYogi, ...).

The algorithm's home (with ``clients/flower.py`` and ``conf/strategy/flower.yaml``):

* :mod:`~strategies.flower.adapter`: a Flower strategy object's configure/aggregate on dpfl's
  cohorts, clients and reports (the class list, the adapter's defaults and refusals, the header);
* :mod:`~strategies.flower.dp`: Flower's differential-privacy wrappers, with Flower's epsilon and
  dpfl's accounting of the same releases;
* :mod:`~strategies.flower.strategy`: the settings and the registered strategy.
"""

from strategies.flower.adapter import (
    CohortGrid,
    FlowerRounds,
    build_flower_strategy,
    flower_class,
    flower_logs_quiet,
    runnable_classes,
)
from strategies.flower.strategy import FlowerSettings, FlowerStrategy, check_flower, check_kwargs

__all__ = [
    "CohortGrid",
    "FlowerRounds",
    "FlowerSettings",
    "FlowerStrategy",
    "build_flower_strategy",
    "check_flower",
    "check_kwargs",
    "flower_class",
    "flower_logs_quiet",
    "runnable_classes",
]
