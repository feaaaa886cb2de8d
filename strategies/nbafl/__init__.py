"""NbAFL (Wei et al., IEEE TIFS 2020): Gaussian noise on the clipped parameters before aggregation.

The algorithm's home (with ``clients/nbafl.py`` and ``conf/strategy/nbafl.yaml``):

* :mod:`~strategies.nbafl.strategy`: the server (K-random scheduling, uniform averaging, downlink
  noise, both accountants);
* :mod:`~strategies.nbafl.privacy`: the uplink and downlink calibration and the units.
"""

from typing import Any

__all__ = ["NbAFLSettings", "NbAFLStrategy"]


def __getattr__(name: str) -> Any:
    """``NbAFLSettings`` and ``NbAFLStrategy``, imported on first use.

    The registry imports the package's modules itself (:meth:`fl_app.registry.Registry.discover`),
    and a process that needs only the privacy arithmetic (``dpfl privacy``) does not import the
    server and what it needs (torch).
    """
    if name in __all__:
        import strategies.nbafl.strategy as module

        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
