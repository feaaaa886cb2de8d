"""KD-DP (Tan, Xu, Wang, Luo 2024): a DP teacher, a label-DP special client and DP-SGD clients.

The algorithm's home (with ``clients/kd_dp.py`` and ``conf/strategy/kd_dp.yaml``):

* :mod:`~strategies.kd_dp.strategy`: the server (grouping, teacher and student stages, the special client);
* :mod:`~strategies.kd_dp.privacy`: the budget split, the DP-SGD groups and the ledger.
"""

from typing import Any

__all__ = ["KDDPSettings", "KDDPStrategy"]


def __getattr__(name: str) -> Any:
    """``KDDPSettings`` and ``KDDPStrategy``, imported on first use.

    The registry imports the package's modules itself (:meth:`fl_app.registry.Registry.discover`),
    and a process that needs only the privacy arithmetic (``dpfl privacy``) does not import the
    server and what it needs (torch).
    """
    if name in __all__:
        import strategies.kd_dp.strategy as module

        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
