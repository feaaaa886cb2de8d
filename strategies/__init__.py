"""Strategy classes, one module per algorithm, registered by name.

``STRATEGIES.get(name)`` returns the strategy class for ``strategy.name``; every
module of this package is imported on first use, so adding a module (plus its
``conf/strategy/<name>.yaml`` and client) is all it takes to add an algorithm.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fl_app.registry import Registry

if TYPE_CHECKING:
    from strategies.base import FederatedStrategy

STRATEGIES: Registry[type[FederatedStrategy]] = Registry("strategy", __name__)
register_strategy = STRATEGIES.register

__all__ = ["STRATEGIES", "register_strategy"]
