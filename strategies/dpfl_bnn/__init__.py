"""DPFL-BNN (Liu, Zhang, Song, Letaief 2023): binary networks, randomized response on every uploaded bit.

The algorithm's home (with ``clients/dpfl_bnn.py`` and ``conf/strategy/dpfl_bnn.yaml``):

* :mod:`~strategies.dpfl_bnn.strategy`: the server (unpack, average, broadcast the noised bits);
* :mod:`~strategies.dpfl_bnn.privacy`: gamma for a budget (Theorem 1), the client-level and
  per-coordinate ledgers.
"""

from typing import Any

__all__ = ["DPFLBNNSettings", "DPFLBNNStrategy"]


def __getattr__(name: str) -> Any:
    """``DPFLBNNSettings`` and ``DPFLBNNStrategy``, imported on first use.

    The registry imports the package's modules itself (:meth:`fl_app.registry.Registry.discover`),
    and a process that needs only the privacy arithmetic (``dpfl privacy``) does not import the
    server and what it needs (torch).
    """
    if name in __all__:
        import strategies.dpfl_bnn.strategy as module

        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
