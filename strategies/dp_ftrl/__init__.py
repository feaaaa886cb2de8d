"""DP-FTRL (Kairouz et al., ICML 2021): tree-aggregated noise on prefix sums, no sampling.

The algorithm's home (with ``clients/dp_ftrl.py`` and ``conf/strategy/dp_ftrl.yaml``):

* :mod:`~strategies.dp_ftrl.strategy`: the server (the public schedule, the tree, FTRL with momentum);
* :mod:`~strategies.dp_ftrl.privacy`: the tree calibration for the schedule.
"""

from typing import Any

__all__ = ["DPFTRLSettings", "DPFTRLStrategy"]


def __getattr__(name: str) -> Any:
    """``DPFTRLSettings`` and ``DPFTRLStrategy``, imported on first use.

    The registry imports the package's modules itself (:meth:`fl_app.registry.Registry.discover`),
    and a process that needs only the privacy arithmetic (``dpfl privacy``) does not import the
    server and what it needs (torch).
    """
    if name in __all__:
        import strategies.dp_ftrl.strategy as module

        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
