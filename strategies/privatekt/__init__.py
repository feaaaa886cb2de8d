"""PrivateKT (Qi, Wu et al., Nature Communications 2023): knowledge transfer through K noisy labels.

The algorithm's home (with ``clients/privatekt.py`` and ``conf/strategy/privatekt.yaml``):

* :mod:`~strategies.privatekt.strategy`: the server (KT sampling, Eq. 3 aggregation, knowledge
  buffer, self-training);
* :mod:`~strategies.privatekt.knowledge`: the knowledge buffer and the public-split training;
* :mod:`~strategies.privatekt.privacy`: the keep probability of Lemma 1 and the per-label budget.
"""

from typing import Any

__all__ = ["PrivateKTSettings", "PrivateKTStrategy"]


def __getattr__(name: str) -> Any:
    """``PrivateKTSettings`` and ``PrivateKTStrategy``, imported on first use.

    The registry imports the package's modules itself (:meth:`fl_app.registry.Registry.discover`),
    and a process that needs only the privacy arithmetic (``dpfl privacy``) does not import the
    server and what it needs (torch).
    """
    if name in __all__:
        import strategies.privatekt.strategy as module

        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
