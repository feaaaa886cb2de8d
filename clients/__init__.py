"""Client classes, one module per algorithm, registered by name.

``CLIENTS.get(name)`` returns the class that handles a train message whose
config names ``algorithm=name``; every module of this package is imported on
first use, so adding a module is all it takes to add a client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fl_app.config.registry import Registry

if TYPE_CHECKING:
    from clients.base import FederatedClient

CLIENTS: Registry[type[FederatedClient]] = Registry("client", __name__)
register_client = CLIENTS.register

__all__ = ["CLIENTS", "register_client"]
