"""DP-BandMF (Choquette-Choo et al., NeurIPS 2023): banded matrix-factorization noise over the rounds.

The algorithm's home (with ``conf/strategy/dp_bandmf.yaml``; its clients run ``clients/fedavg.py``):

* :mod:`~strategies.dp_bandmf.strategy`: the server (public groups, cyclic Poisson cohorts, clipping,
  the correlated noise, the momentum step, the accounting);
* :mod:`~strategies.dp_bandmf.factorization`: the banded Toeplitz strategy matrix, its optimisation
  and the streaming noise it correlates.
"""

from typing import Any

__all__ = ["DPBandMFSettings", "DPBandMFStrategy"]


def __getattr__(name: str) -> Any:
    """``DPBandMFSettings`` and ``DPBandMFStrategy``, imported on first use.

    The registry imports the package's modules itself (:meth:`fl_app.registry.Registry.discover`),
    and a process that needs only the privacy arithmetic (``dpfl privacy``) does not import the
    server and what it needs (torch).
    """
    if name in __all__:
        import strategies.dp_bandmf.strategy as module

        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
