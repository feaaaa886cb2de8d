"""DPFL-BNN (Liu, Zhang, Song, Letaief 2023): binary networks, randomized response on every uploaded bit.

The algorithm's home (with ``clients/dpfl_bnn.py`` and ``conf/strategy/dpfl_bnn.yaml``):

* :mod:`~strategies.dpfl_bnn.strategy`: the server (unpack, average, broadcast the noised bits);
* :mod:`~strategies.dpfl_bnn.privacy`: gamma for a budget (Theorem 1), the client-level and
  per-coordinate ledgers.
"""

from fl_app.config.registry import lazy_exports

__all__ = ["DPFLBNNSettings", "DPFLBNNStrategy"]
#: The settings and the server, imported on first use (the registry imports the modules itself).
__getattr__ = lazy_exports(__name__, "strategy", __all__)
