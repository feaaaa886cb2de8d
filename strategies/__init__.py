"""Strategy classes, one module per algorithm, registered by name.

``STRATEGIES.get(name)`` returns the strategy class for ``strategy.name``; every
module of this package is imported on first use, so adding a module (plus its
``conf/strategy/<name>.yaml`` and client) is all it takes to add an algorithm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fl_app.config.registry import Registry

if TYPE_CHECKING:
    from strategies.base import FederatedStrategy

STRATEGIES: Registry[type[FederatedStrategy]] = Registry("strategy", __name__)
register_strategy = STRATEGIES.register

#: Evaluation stages: classes in this package decorated ``@register_evaluation_stage(name)`` that wrap
#: the built strategy when ``evaluation.stage`` names them (absent or null: no stage). A stage has a
#: ``settings_type`` (its typed keys, read by validation) and is built as ``Stage(strategy)``.
EVALUATION_STAGES: Registry[Any] = Registry("evaluation stage", __name__)
register_evaluation_stage = EVALUATION_STAGES.register


def store_strategy_config(name: str, **defaults: Any) -> None:
    """Make ``strategy=<name>`` compose without a ``conf/strategy/<name>.yaml`` (defaults in Hydra's store).

    An algorithm defined outside this package (a user's module, a test module) declares its settings'
    defaults here, as FLSim puts each algorithm's typed config in Hydra's ConfigStore; the run's
    composition finds the option beside the files of ``conf/strategy/``.
    """
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="strategy", name=name, node={"name": name, **defaults})


__all__ = [
    "EVALUATION_STAGES",
    "STRATEGIES",
    "register_evaluation_stage",
    "register_strategy",
    "store_strategy_config",
]
