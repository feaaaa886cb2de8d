"""DP-BLT (Dvijotham et al., FOCS 2024; McMahan, Xu, Zhang, EMNLP Industry 2024): BLT-correlated DP-FTRL.

The algorithm's home (with ``conf/strategy/dp_blt.yaml``; its clients run ``clients/fedavg.py``):

* :mod:`~strategies.dp_blt.strategy`: the server (public groups on a cyclic schedule, clipping, the
  BLT noise, the momentum step, the accounting);
* :mod:`~strategies.dp_blt.buffered_toeplitz`: the buffered-linear-Toeplitz matrix, its error and
  min-separation sensitivity, its optimisation and the streaming noise it correlates.
"""

from fl_app.config.registry import lazy_exports

__all__ = ["DPBLTSettings", "DPBLTStrategy"]
#: The settings and the server, imported on first use (the registry imports the modules itself).
__getattr__ = lazy_exports(__name__, "strategy", __all__)
