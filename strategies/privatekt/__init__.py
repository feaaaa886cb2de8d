"""PrivateKT (Qi, Wu et al., Nature Communications 2023): knowledge transfer through K noisy labels.

The algorithm's home (with ``clients/privatekt.py`` and ``conf/strategy/privatekt.yaml``):

* :mod:`~strategies.privatekt.strategy`: the server (KT sampling, Eq. 3 aggregation, knowledge
  buffer, self-training);
* :mod:`~strategies.privatekt.knowledge`: the knowledge buffer and the public-split training;
* :mod:`~strategies.privatekt.privacy`: the keep probability of Lemma 1 and the per-label budget.
"""

from fl_app.config.registry import lazy_exports

__all__ = ["PrivateKTSettings", "PrivateKTStrategy"]
#: The settings and the server, imported on first use (the registry imports the modules itself).
__getattr__ = lazy_exports(__name__, "strategy", __all__)
