"""PrivateKT's calibration: the keep probability of Lemma 1 and the per-label epsilon of a budget.

Qi, Wu et al., Nature Communications 2023 (PrivateKT), Lemma 1, Eq. 6. The randomized response itself
and its accounting are the core's (:mod:`fl_app.privacy.mechanisms`, :mod:`fl_app.privacy.composition`).
"""

from __future__ import annotations

from fl_app.privacy.calibration import randomized_response_epsilon_per_label
from fl_app.privacy.checks import require_positive, require_positive_int, require_probability
from fl_app.privacy.events import keep_probability

# --------------------------------------------------------------------------------------
# PrivateKT (Lemma 1, Eq. 6)
# --------------------------------------------------------------------------------------


def check_report(*, epsilon: float, k: int, num_classes: int) -> None:
    """Refuse a report budget, a number of labels per report or of classes PrivateKT cannot use.

    Raises
    ------
    ValueError
        ``epsilon`` not a finite number > 0, ``k`` not a positive integer, or fewer than 2 classes.

    """
    require_positive("epsilon", epsilon)
    require_positive_int("k", k)
    require_positive_int("num_classes", num_classes)
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")


def privatekt_keep_probability(*, epsilon: float, k: int, num_classes: int) -> float:
    """``beta = (e^(eps/K) - 1) / (e^(eps/K) - 1 + C)`` (PrivateKT Lemma 1, Eq. 6).

    With this beta, each of the K reported labels is ``eps/K``-LDP and the
    whole report of K labels is ``eps``-LDP (basic composition over K).
    """
    check_report(epsilon=epsilon, k=k, num_classes=num_classes)
    return keep_probability(epsilon=epsilon / k, num_classes=num_classes)  # finite for any epsilon


PRIVATEKT_BUDGET_SCOPES: tuple[str, ...] = ("total", "per_round")


def privatekt_epsilon_per_label(
    *,
    epsilon: float,
    k: int,
    num_classes: int,
    budget_scope: str,
    max_participations: int | None = None,
    delta: float | None = None,
    method: str = "rdp",
) -> float:
    """Per-label randomized-response epsilon of PrivateKT for a budget scope.

    ``per_round`` (the document's reading): ``epsilon / K`` per label (Lemma 1,
    Eq. 6; ``RandomizedResponse(epsilon / K, C).keep_probability`` equals
    :func:`privatekt_keep_probability`), so one report of K labels is
    ``epsilon``-LDP. Reports of different rounds still compose: nothing
    shuffles them (the document's model-shuffling argument does not apply).

    ``total``: the largest per-label epsilon for which ``K * max_participations``
    reports, composed by :func:`~fl_app.privacy.composition.compose_epsilon`
    (the accountant's own code path, at ``delta`` with ``method``), stay within
    ``epsilon``: the worst client's cumulative epsilon over the run.

    Parameters
    ----------
    epsilon : float
        Per-round (``per_round``) or cumulative per-client (``total``) budget.
    k : int
        Labels per report (K knowledge-transfer samples).
    num_classes : int
        ``C >= 2``.
    budget_scope : str
        ``"per_round"`` or ``"total"``.
    max_participations : int, optional
        Rounds the most-selected client takes part in (``total`` only).
    delta : float, optional
        Target delta of the cumulative guarantee (``total`` only).
    method : str
        Accountant method, ``"rdp"`` or ``"pld"`` (``total`` only).

    """
    check_report(epsilon=epsilon, k=k, num_classes=num_classes)
    if budget_scope == "per_round":
        return epsilon / k
    if budget_scope != "total":
        raise ValueError(f"budget_scope must be one of {PRIVATEKT_BUDGET_SCOPES}, got {budget_scope!r}")
    if max_participations is None or delta is None:
        raise ValueError("budget_scope='total' needs max_participations and delta")
    require_positive_int("max_participations", max_participations)
    require_probability("delta", delta)
    return randomized_response_epsilon_per_label(
        total_epsilon=epsilon,
        delta=delta,
        labels=k * max_participations,
        num_classes=num_classes,
        method=method,
    )
