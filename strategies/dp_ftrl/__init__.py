"""DP-FTRL (Kairouz et al., ICML 2021): tree-aggregated noise on prefix sums, no sampling.

The algorithm's home (with ``conf/strategy/dp_ftrl.yaml``; its clients are FedAvg's, ``clients/fedavg.py``):

* :mod:`~strategies.dp_ftrl.strategy`: the server (the public schedule, the tree, FTRL with momentum);
* :mod:`~strategies.dp_ftrl.privacy`: the tree sensitivity of the schedule.
"""

from fl_app.config.registry import lazy_exports

__all__ = ["DPFTRLSettings", "DPFTRLStrategy"]
#: The settings and the server, imported on first use (the registry imports the modules itself).
__getattr__ = lazy_exports(__name__, "strategy", __all__)
