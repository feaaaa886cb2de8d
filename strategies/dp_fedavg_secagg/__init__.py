"""Distributed DP-FedAvg: Skellam noise on the devices, SecAgg+, no trusted server.

The algorithm's home (with ``clients/dp_fedavg_secagg.py`` and ``conf/strategy/dp_fedavg_secagg.yaml``):

* :mod:`~strategies.dp_fedavg_secagg.strategy`: the server (public balanced schedule, the Skellam
  plan, decoding, dropouts, accounting);
* :mod:`~strategies.dp_fedavg_secagg.secagg`: the server side of SecAgg+'s four stages over
  Flower's primitives.

The mechanism itself (rotation, rounding, Skellam noise, its RDP and calibration) is
:mod:`fl_app.privacy.distributed`; docs/distributed_dp.md has the threat model.
"""

from typing import Any

__all__ = ["DPFedAvgSecAggSettings", "DPFedAvgSecAggStrategy"]


def __getattr__(name: str) -> Any:
    """``DPFedAvgSecAggSettings`` and ``DPFedAvgSecAggStrategy``, imported on first use.

    The registry imports the package's modules itself (:meth:`fl_app.registry.Registry.discover`),
    and a process that needs only the privacy arithmetic (``dpfl privacy``) does not import the
    server and what it needs (torch).
    """
    if name in __all__:
        import strategies.dp_fedavg_secagg.strategy as module

        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
