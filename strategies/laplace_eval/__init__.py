"""Clustering evaluation on Laplace-protected inference results (MindSpore Federated), around any strategy.

The algorithm's home (with ``clients/laplace_eval.py`` and ``conf/evaluation/laplace_eval.yaml``):

* :mod:`~strategies.laplace_eval.stage`: the evaluation stage (sampling, messages, scores, reports);
* :mod:`~strategies.laplace_eval.privacy`: the noise plan and the two ledgers;
* :mod:`~strategies.laplace_eval.clustering`: the scores (silhouette, Calinski-Harabasz).
"""

from typing import Any

__all__ = ["LaplaceEvalSettings", "LaplaceEvalStage"]


def __getattr__(name: str) -> Any:
    """``LaplaceEvalSettings`` and ``LaplaceEvalStage``, imported on first use.

    The registry imports the package's modules itself (:meth:`fl_app.registry.Registry.discover`),
    and a process that needs only the privacy arithmetic (``dpfl privacy``) does not import the
    server and what it needs (torch).
    """
    if name in __all__:
        import strategies.laplace_eval.stage as module

        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
