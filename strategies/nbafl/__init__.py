"""NbAFL (Wei et al., IEEE TIFS 2020): Gaussian noise on the clipped parameters before aggregation.

The algorithm's home (with ``clients/nbafl.py`` and ``conf/strategy/nbafl.yaml``):

* :mod:`~strategies.nbafl.strategy`: the server (K-random scheduling, uniform averaging, downlink
  noise, both accountants);
* :mod:`~strategies.nbafl.privacy`: the uplink and downlink calibration and the units.
"""

from fl_app.config.registry import lazy_exports

__all__ = ["NbAFLSettings", "NbAFLStrategy"]
#: The settings and the server, imported on first use (the registry imports the modules itself).
__getattr__ = lazy_exports(__name__, "strategy", __all__)
