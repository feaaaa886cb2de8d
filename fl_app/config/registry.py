"""Name -> class registries with automatic discovery of a package's modules, and users' plug-ins.

Adding an algorithm is one file in ``strategies/`` (decorated with
``@register_strategy("name")``), one in ``clients/`` (``@register_client("name")``)
and one ``conf/strategy/name.yaml``. The app files look classes up by the
configured name; they hold no per-algorithm branches.

An algorithm in a user's own module (outside this repository's packages) is named in the
environment: ``DPFL_PLUGINS=my_lab.fedprox python -m fl_app strategy=my_fedprox``. Every process
that looks a name up (the server, a simulation's actors, which inherit the environment, and a
device's SuperNode, whose operator sets it) imports those modules first (:func:`load_plugins`), so
their decorators and ``store_strategy_config`` run; a ``module:Class`` reference in a message may
name a class of theirs too, and of no other module.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from collections.abc import Callable
from types import ModuleType
from typing import Any, Generic, TypeVar

T = TypeVar("T")

#: The top-level packages whose modules a ``module:attribute`` reference may name (the app's own).
PLUGIN_PACKAGES = ("strategies", "clients", "tests")
#: Environment variable: comma-separated modules of a user's algorithms, imported before any lookup.
PLUGINS_ENV = "DPFL_PLUGINS"


def plugin_modules() -> list[str]:
    """The modules :data:`PLUGINS_ENV` names (none when unset)."""
    return [name.strip() for name in os.environ.get(PLUGINS_ENV, "").split(",") if name.strip()]


def load_plugins() -> None:
    """Import every module :data:`PLUGINS_ENV` names (once each; Python caches imports).

    Raises
    ------
    ConfigError
        One line naming the variable, the module and why, when it cannot be imported.

    """
    from fl_app.config.checks import ConfigError

    for name in plugin_modules():
        try:
            importlib.import_module(name)
        except ImportError as error:
            raise ConfigError(
                PLUGINS_ENV,
                os.environ[PLUGINS_ENV],
                f"cannot import {name} ({error}): it must be importable from the working directory "
                "or PYTHONPATH",
            ) from None


def referable_packages() -> tuple[str, ...]:
    """Top-level packages a ``module:attribute`` reference may name: the app's own and the plug-ins'."""
    return PLUGIN_PACKAGES + tuple(name.split(".")[0] for name in plugin_modules())


def lazy_exports(package: str, module: str, names: list[str]) -> Callable[[str], Any]:
    """An algorithm package's ``__getattr__`` (PEP 562): ``names`` from ``package.module``, on first use.

    The registry imports a package's modules itself (:meth:`Registry.discover`), so the package's
    ``__init__`` need not import its server; a process that needs only the privacy arithmetic
    (``dpfl privacy``) then does not import the server and what it needs (torch). Use::

        __all__ = ["MySettings", "MyStrategy"]
        __getattr__ = lazy_exports(__name__, "strategy", __all__)
    """

    def exported(name: str) -> Any:
        if name in names:
            return getattr(importlib.import_module(f"{package}.{module}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return exported


class Registry(Generic[T]):
    """Classes registered by name, discovered by importing every module of a package."""

    def __init__(self, kind: str, package: str) -> None:
        self.kind = kind
        self.package = package
        self._entries: dict[str, T] = {}
        self._discovered = False

    def register(self, name: str) -> Callable[[T], T]:
        """Class decorator: register the decorated class under ``name``."""

        def decorator(entry: T) -> T:
            if name in self._entries and self._entries[name] is not entry:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = entry
            return entry

        return decorator

    def unregister(self, name: str) -> None:
        """Forget the entry ``name`` (an algorithm a test registered for itself)."""
        self._entries.pop(name, None)

    def discover(self) -> None:
        """Import every module of the package once, so their decorators run.

        An algorithm that is a package (``strategies/<name>/``) registers in one of its modules: the
        package's own modules are imported too (its ``__init__`` need not import them).
        """
        if self._discovered:
            return
        load_plugins()
        package: ModuleType = importlib.import_module(self.package)
        for module in pkgutil.iter_modules(package.__path__):
            if module.name.startswith("_"):
                continue
            found = importlib.import_module(f"{self.package}.{module.name}")
            if module.ispkg:
                for inner in pkgutil.iter_modules(found.__path__):
                    if not inner.name.startswith("_"):
                        importlib.import_module(f"{found.__name__}.{inner.name}")
        self._discovered = True

    def get(self, name: str) -> T:
        """Return the entry registered as ``name``, or the one a ``module:attribute`` reference names.

        A reference (``tests.test_plugin:ShrinkClient``) lets an algorithm defined outside the
        package, a user's module or a test module, be found in a process that has not imported it
        (a simulation's actor): its module is imported, whose decorator registers it. Only modules
        of the app's own packages (:data:`PLUGIN_PACKAGES`) and of the plug-ins the process was started
        with (:data:`PLUGINS_ENV`) may be named, so a message cannot make a device import anything
        else that happens to be installed.
        """
        self.discover()
        if name not in self._entries and ":" in name:
            module, _, attribute = name.partition(":")
            allowed = referable_packages()
            if module.split(".")[0] not in allowed:
                raise KeyError(f"{self.kind} {name!r}: only modules of {', '.join(allowed)} may be named")
            entry = getattr(importlib.import_module(module), attribute)
            self._entries.setdefault(name, entry)
        if name not in self._entries:
            raise KeyError(f"{self.kind} {name!r} is unknown; allowed: {', '.join(self.names())}")
        return self._entries[name]

    def names(self) -> list[str]:
        """All registered names, sorted."""
        self.discover()
        return sorted(self._entries)
