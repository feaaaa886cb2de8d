"""KD-DP (Tan, Xu, Wang, Luo 2024): a DP teacher, a label-DP special client and DP-SGD clients.

The algorithm's home (with ``clients/kd_dp.py`` and ``conf/strategy/kd_dp.yaml``):

* :mod:`~strategies.kd_dp.strategy`: the server (grouping, teacher and student stages, the special client);
* :mod:`~strategies.kd_dp.privacy`: the budget split, the DP-SGD groups and the ledger.
"""

from fl_app.config.registry import lazy_exports

__all__ = ["KDDPSettings", "KDDPStrategy"]
#: The settings and the server, imported on first use (the registry imports the modules itself).
__getattr__ = lazy_exports(__name__, "strategy", __all__)
