"""Distributed DP-FedAvg: Skellam noise on the devices, SecAgg+, no trusted server.

The algorithm's home (with ``clients/dp_fedavg_secagg.py`` and ``conf/strategy/dp_fedavg_secagg.yaml``):

* :mod:`~strategies.dp_fedavg_secagg.strategy`: the server (public balanced schedule, the Skellam
  plan, decoding, dropouts, accounting);
* :mod:`~strategies.dp_fedavg_secagg.secagg`: the server side of SecAgg+'s four stages over
  Flower's primitives.

The mechanism itself (rotation, rounding, Skellam noise, its RDP and calibration) is
:mod:`fl_app.privacy.distributed`; docs/algorithms/distributed_dp.md has the threat model.
"""

from fl_app.config.registry import lazy_exports

__all__ = ["DPFedAvgSecAggSettings", "DPFedAvgSecAggStrategy"]
#: The settings and the server, imported on first use (the registry imports the modules itself).
__getattr__ = lazy_exports(__name__, "strategy", __all__)
