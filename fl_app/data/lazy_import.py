"""Submodules of a package loaded on first use instead of when the package is imported.

``import flwr_datasets.partitioner`` runs ``flwr_datasets/__init__.py``, which imports the package's
plotting (``visualization``: seaborn, scipy.stats, matplotlib) and ``metrics`` modules: most of the
CPU the import takes, in every process that partitions a data set (each ``python -m fl_app`` command
and sweep job), for modules dpfl never calls. A deferred submodule stays importable: it is a
placeholder in ``sys.modules`` until an attribute of it is read (``from flwr_datasets.visualization
import plot_label_distributions``, ``flwr_datasets.metrics.compute_counts``); that read imports the
real module, which then replaces the placeholder everywhere, as a plain import would have left it.

(The standard library's ``importlib.util.LazyLoader`` does not do here: the import system reads
``module.__spec__`` of a module already in ``sys.modules``, which makes it load at once.)
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import threading
import types
from collections.abc import Iterable

_LOADING = threading.RLock()


class DeferredModule(types.ModuleType):
    """A submodule not imported yet; reading any attribute it lacks imports it (:func:`load`)."""

    def __getattr__(self, attribute: str) -> object:
        return getattr(load(self.__name__), attribute)


def load(name: str) -> types.ModuleType:
    """The real module ``name``, imported now if only its :class:`DeferredModule` is there."""
    with _LOADING:
        current = sys.modules.get(name)
        if current is not None and not isinstance(current, DeferredModule):
            return current
        sys.modules.pop(name, None)
        return importlib.import_module(name)


def defer_submodules(package: str, names: Iterable[str]) -> list[str]:
    """Register ``package.<name>`` for each name as a :class:`DeferredModule`, before ``package`` is imported.

    Nothing is done when ``package`` is already imported; a submodule that is already imported or
    cannot be found is left alone (the import then behaves as without this call).

    Parameters
    ----------
    package : str
        A top-level package (its ``__init__`` is not run here).
    names : Iterable[str]
        Its submodules to import on first use.

    Returns
    -------
    list[str]
        The submodules deferred.

    """
    if package in sys.modules:
        return []
    spec = importlib.util.find_spec(package)
    if spec is None or spec.submodule_search_locations is None:
        return []
    deferred = []
    for name in names:
        full = f"{package}.{name}"
        found = importlib.machinery.PathFinder.find_spec(full, list(spec.submodule_search_locations))
        if full in sys.modules or found is None:
            continue
        placeholder = DeferredModule(full)
        placeholder.__file__ = found.origin  # read by inspect.getmodule for every module: no import
        sys.modules[full] = placeholder
        deferred.append(full)
    return deferred
