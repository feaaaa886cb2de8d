"""Strategy classes, one module per algorithm, registered by name.

``STRATEGIES.get(name)`` returns the strategy class for ``strategy.name``; every
module of this package is imported on first use, so adding a module (plus its
``conf/strategy/<name>.yaml`` and client) is all it takes to add an algorithm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fl_app.registry import Registry

if TYPE_CHECKING:
    from strategies.base import FederatedStrategy

STRATEGIES: Registry[type[FederatedStrategy]] = Registry("strategy", __name__)
register_strategy = STRATEGIES.register

#: Evaluation stages: classes in this package decorated ``@register_evaluation_stage(name)`` that wrap
#: the built strategy when ``evaluation.stage`` names them (absent or null: no stage). A stage has a
#: classmethod ``validate_config(cfg)`` and is built as ``Stage(strategy)``.
EVALUATION_STAGES: Registry[Any] = Registry("evaluation stage", __name__)
register_evaluation_stage = EVALUATION_STAGES.register

__all__ = ["EVALUATION_STAGES", "STRATEGIES", "register_evaluation_stage", "register_strategy"]
