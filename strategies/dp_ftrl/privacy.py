"""DP-FTRL's tree sensitivity for a public schedule (Kairouz et al., ICML 2021).

The strategy calibrates its noise from these increments with the accountant's composition
(:func:`fl_app.privacy.calibration.noise_multiplier_for_histories`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

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


TREES = ("online", "complete")


def worst_tree_sensitivity(
    *, steps: int, max_participations: int, separation: int, tree: str = "online"
) -> int:
    """The largest squared tree sensitivity ``S`` of a participant with participation limits (no restart).

    The worst case, over every set of at most ``max_participations`` leaves of a ``steps``-leaf
    tree whose consecutive leaves are at least ``separation`` apart, of ``S = sum_u n_u^2``: the
    bound Kairouz et al. 2021 (Appendix D, Theorem D.3) give for a deployment that knows each
    device's limits (at most ``max_participations`` rounds, at least ``separation`` rounds from one
    to the next: their ``min_separation`` is ``separation - 1``), not its schedule. Everything the
    tree releases is then the Gaussian mechanism with sensitivity ``C sqrt(S)``.

    ``tree``: which nodes are noised and released. ``online`` (this strategy's): one node per step,
    ``[i - lowbit(i) + 1, i]`` (:func:`tree_sensitivity_increments`); ``complete``: every node of the
    complete binary forest over the steps (each aligned block of ``2^k`` leaves within them), as
    the paper's Appendix D and TensorFlow Privacy's ``tree_aggregation_accountant`` count, which
    Honaker's efficient estimator needs (it reads every node).

    Exact, by dynamic programming over the leaves: a node of ``2^k <= separation`` leaves holds at
    most one participation (it adds 1 to ``S`` for each participation in it), so the state is the
    participations used, the rounds since the last one (capped at ``separation``) and, for each
    level of larger nodes, the participations already in its current node.
    """
    require_positive_int("steps", steps)
    require_positive_int("max_participations", max_participations)
    require_positive_int("separation", separation)
    if tree not in TREES:
        raise ValueError(f"tree must be one of {TREES}, got {tree!r}")
    levels = [k for k in range(steps.bit_length()) if 2**k <= steps]
    small = [k for k in levels if 2**k <= separation]
    big = [k for k in levels if 2**k > separation]
    caps = [min(max_participations, -(-(2**k) // separation)) for k in big]
    # value[j, e, c_1 .. c_K]: the largest S so far with j participations used, e rounds since the
    # last one (capped at separation, which also stands for "none yet") and c_k participations in
    # the current node of the k-th larger level
    value = np.full((max_participations + 1, separation + 1, *(cap + 1 for cap in caps)), -np.inf)
    value[(0, separation, *([0] * len(big)))] = 0.0
    for leaf in range(1, steps + 1):
        for axis, k in enumerate(big, start=2):
            if (leaf - 1) % 2**k == 0:  # a node of this level starts: its count begins at 0
                merged = value.max(axis=axis, keepdims=True)
                value = np.full_like(value, -np.inf)
                index: list[Any] = [slice(None)] * value.ndim
                index[axis] = slice(0, 1)
                value[tuple(index)] = merged
        nodes = {k: _is_node(leaf, k, steps, online=tree == "online") for k in levels}
        value = _tree_leaf(value, nodes=nodes, small=small, big=big, separation=separation)
    return round(float(value.max()))


def _is_node(leaf: int, level: int, steps: int, *, online: bool) -> bool:
    """Whether the aligned block of ``2^level`` leaves that holds ``leaf`` is a released node.

    It must end within the tree's ``steps``; in the online tree it must also end at a step ``u`` with
    ``lowbit(u) = 2^level`` (an odd block number).
    """
    block = -(-leaf // 2**level)
    return block * 2**level <= steps and (not online or block % 2 == 1)


def _tree_leaf(
    value: np.ndarray, *, nodes: dict[int, bool], small: list[int], big: list[int], separation: int
) -> np.ndarray:
    """One leaf of :func:`worst_tree_sensitivity`'s dynamic programme: skip it, or take part in it."""
    following = np.full_like(value, -np.inf)
    following[:, 1:separation] = value[:, : separation - 1]  # skipped: one round more since the last
    following[:, separation] = np.maximum(value[:, separation - 1], value[:, separation])
    gain = sum(nodes[k] for k in small)
    ready = value[:-1, separation]  # taking part needs separation rounds since the last time
    for counts in np.ndindex(*ready.shape[1:]):
        before = ready[(slice(None), *counts)]
        if not np.isfinite(before).any():
            continue
        increment = gain + sum(2 * c + 1 for c, k in zip(counts, big, strict=True) if nodes[k])
        after = tuple(min(c + 1, value.shape[2 + i] - 1) for i, c in enumerate(counts))
        target = (slice(1, None), 1, *after)
        following[target] = np.maximum(following[target], before + increment)
    return following
