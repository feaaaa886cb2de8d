"""DP-FTRL (Kairouz et al., ICML 2021): tree-aggregated noise on prefix sums, no sampling.

The algorithm's home (with ``clients/dp_ftrl.py`` and ``conf/strategy/dp_ftrl.yaml``):

* :mod:`~strategies.dp_ftrl.strategy`: the server (the public schedule, the tree, FTRL with momentum);
* :mod:`~strategies.dp_ftrl.privacy`: the tree calibration for the schedule.
"""

from strategies.dp_ftrl.strategy import DPFTRLSettings, DPFTRLStrategy

__all__ = ["DPFTRLSettings", "DPFTRLStrategy"]
