"""Clustering scores of inference results: how well the (noised) softmax vectors separate.

MindSpore Federated documentation, "Horizontal Federated-Local Differential Privacy Inference
Result Protection": the server assigns each reported softmax vector to the cluster of its largest
coordinate (``argmax``, as the document's code) and scores the clustering by the silhouette score
and the Calinski-Harabasz index (scikit-learn). Post-processing of whatever the vectors are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SILHOUETTE = "SILHOUETTE_SCORE"
CALINSKI_HARABASZ = "CALINSKI_HARABASZ"
EVAL_TYPES: tuple[str, ...] = (SILHOUETTE, CALINSKI_HARABASZ)


@dataclass(frozen=True)
class ClusteringScores:
    """The server's clustering evaluation of one round.

    Attributes
    ----------
    silhouette : float or None
        Silhouette score (None: not requested, or undefined with fewer than 2 clusters).
    calinski_harabasz : float or None
        Calinski-Harabasz index (None: not requested or undefined).
    reports : int
        Number of vectors clustered.
    clusters : int
        Number of distinct argmax clusters.

    """

    silhouette: float | None
    calinski_harabasz: float | None
    reports: int
    clusters: int


def clustering_scores(
    reports: np.ndarray,
    *,
    eval_types: Sequence[str] = EVAL_TYPES,
    silhouette_sample_size: int | None = None,
    seed: int = 0,
) -> ClusteringScores:
    """Cluster vectors by their largest coordinate and score the clustering (scikit-learn).

    Parameters
    ----------
    reports : np.ndarray
        Shape ``(n, classes)``: the (noised) softmax vectors.
    eval_types : Sequence[str]
        Which of ``SILHOUETTE_SCORE`` and ``CALINSKI_HARABASZ`` to compute.
    silhouette_sample_size : int, optional
        Compute the silhouette on this many vectors drawn without replacement
        (scikit-learn's ``sample_size``); None or ``>= n``: on all.
    seed : int
        ``random_state`` of that subsample.

    Returns
    -------
    ClusteringScores
        Both scores are None when the clustering has fewer than 2 or more than
        ``n - 1`` clusters (where scikit-learn does not define them).

    """
    reports = np.asarray(reports, dtype=np.float64)
    if reports.ndim != 2:
        raise ValueError(f"reports must have shape (n, classes), got {reports.shape}")
    n = reports.shape[0]
    labels = np.argmax(reports, axis=1) if n else np.zeros(0, dtype=np.int64)
    clusters = len(np.unique(labels))
    silhouette = calinski = None
    if 2 <= clusters <= n - 1:
        # imported here: scikit-learn (and the pandas it loads) took 0.5 s of every run's start-up
        from sklearn.metrics import calinski_harabasz_score, silhouette_score

        if SILHOUETTE in eval_types:
            sample = silhouette_sample_size if silhouette_sample_size and silhouette_sample_size < n else None
            try:
                silhouette = float(silhouette_score(reports, labels, sample_size=sample, random_state=seed))
            except ValueError:  # the subsample holds a single cluster
                silhouette = None
        if CALINSKI_HARABASZ in eval_types:
            calinski = float(calinski_harabasz_score(reports, labels))
    return ClusteringScores(silhouette, calinski, n, clusters)
