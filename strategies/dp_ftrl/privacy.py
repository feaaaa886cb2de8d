"""DP-FTRL's tree sensitivity for a public schedule (Kairouz et al., ICML 2021).

The strategy calibrates its noise from these increments with the accountant's composition
(:func:`fl_app.privacy.calibration.noise_multiplier_for_histories`).
"""

from __future__ import annotations

from collections.abc import Sequence

from fl_app.privacy.checks import require_positive_int

# --------------------------------------------------------------------------------------
# Tree aggregation (DP-FTRL, Kairouz, McMahan, Song, Thakkar, Thakurta, Xu, ICML 2021)
# --------------------------------------------------------------------------------------


def tree_sensitivity_increments(*, leaves: Sequence[int], steps: int) -> list[int]:
    """Growth of one participant's squared tree sensitivity at each of its leaves (no restart).

    The online tree aggregation over ``steps`` leaves draws, at each step u,
    one noisy node spanning leaves ``[u - lowbit(u) + 1, u]``
    (:func:`fl_app.privacy.mechanisms.tree_node`); leaf l lies in the nodes
    u = l, l + lowbit(l), ... (up to ``steps``). A participant whose clipped
    contributions (norm <= C each) sit at ``leaves`` changes node u by at most
    ``n_u C``, where ``n_u`` counts its leaves in u, so the released nodes form
    the Gaussian mechanism with L2 sensitivity ``C sqrt(S)``,
    ``S = sum_u n_u^2`` (Kairouz et al. 2021, Appendix D, for multiple
    participations; with a public schedule the participant's actual leaves
    give S exactly). Returns, for each leaf in increasing order, the increase
    of S it causes: ``sum over its nodes of (2 n_u + 1)`` with ``n_u`` counting
    the earlier leaves. The increments sum to S; a single leaf gives at most
    ``ceil(log2(steps + 1))`` (the single-participation tree bound).
    """
    require_positive_int("steps", steps)
    ordered = sorted(int(leaf) for leaf in leaves)
    if len(set(ordered)) != len(ordered):
        raise ValueError("a leaf is listed twice")
    if ordered and (ordered[0] < 1 or ordered[-1] > steps):
        raise ValueError(f"leaves must lie in [1, {steps}], got {ordered[0]}..{ordered[-1]}")
    counts: dict[int, int] = {}
    increments = []
    for leaf in ordered:
        increment = 0
        node = leaf
        while node <= steps:
            seen = counts.get(node, 0)
            increment += 2 * seen + 1
            counts[node] = seen + 1
            node += node & -node
        increments.append(increment)
    return increments
