"""Clustering evaluation on Laplace-protected inference results (MindSpore Federated), around any strategy.

The algorithm's home (with ``clients/laplace_eval.py`` and ``conf/evaluation/laplace_eval.yaml``):

* :mod:`~strategies.laplace_eval.stage`: the evaluation stage (sampling, messages, scores, reports);
* :mod:`~strategies.laplace_eval.privacy`: the noise plan and the two ledgers;
* :mod:`~strategies.laplace_eval.clustering`: the scores (silhouette, Calinski-Harabasz).
"""

from fl_app.config.registry import lazy_exports

__all__ = ["LaplaceEvalSettings", "LaplaceEvalStage"]
#: The settings and the stage, imported on first use (the registry imports the modules itself).
__getattr__ = lazy_exports(__name__, "stage", __all__)
