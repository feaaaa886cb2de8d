"""DP-BandMF (Choquette-Choo et al., NeurIPS 2023): banded matrix-factorization noise over the rounds.

The algorithm's home (with ``conf/strategy/dp_bandmf.yaml``; its clients run ``clients/fedavg.py``):

* :mod:`~strategies.dp_bandmf.strategy`: the server (public groups, cyclic Poisson cohorts, clipping,
  the correlated noise, the momentum step, the accounting);
* :mod:`~strategies.dp_bandmf.factorization`: the banded Toeplitz strategy matrix, its optimisation
  and the streaming noise it correlates.
"""

from fl_app.config.registry import lazy_exports

__all__ = ["DPBandMFSettings", "DPBandMFStrategy"]
#: The settings and the server, imported on first use (the registry imports the modules itself).
__getattr__ = lazy_exports(__name__, "strategy", __all__)
