"""Empirical privacy audit: a high-confidence lower bound on a mechanism's epsilon.

Run a mechanism many times on two neighbouring inputs, reduce each output to a
scalar, and look at candidate output sets S (each value for discrete outputs,
and every one-sided threshold set ``{y >= t}``/``{y <= t}``). For an
(epsilon, delta)-DP mechanism every S satisfies
``P_a(S) <= e^eps P_b(S) + delta``, so

    eps >= ln((P_a(S) - delta) / P_b(S)).

Using a Clopper-Pearson lower bound for ``P_a(S)`` and upper bound for
``P_b(S)`` (Bonferroni-corrected over all sets and both directions) turns the
best set into a lower bound on the true epsilon that holds with the stated
confidence. An audit *fails* a claim when that lower bound exceeds the claimed
epsilon: the mechanism leaks more than it says.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import beta as beta_distribution


@dataclass(frozen=True)
class AuditResult:
    """Outcome of :func:`audit_epsilon`.

    Attributes
    ----------
    epsilon_lower_bound : float
        Epsilon the mechanism has at least, with the requested confidence.
    epsilon_point : float
        The same statistic from raw frequencies (no confidence margin).
    best_set : str
        The output set that gave the bound.
    sets_tested : int
        Number of (set, direction) pairs, used for the Bonferroni correction.

    """

    epsilon_lower_bound: float
    epsilon_point: float
    best_set: str
    sets_tested: int

    def passes(self, claimed_epsilon: float) -> bool:
        """True when the samples do not contradict ``claimed_epsilon``."""
        return self.epsilon_lower_bound <= claimed_epsilon


def _clopper_pearson(successes: np.ndarray, trials: int, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """One-sided (1 - alpha) lower and upper Clopper-Pearson bounds."""
    lower = np.where(successes > 0, beta_distribution.ppf(alpha, successes, trials - successes + 1), 0.0)
    upper = np.where(
        successes < trials, beta_distribution.ppf(1 - alpha, successes + 1, trials - successes), 1.0
    )
    return lower, upper


def _set_counts(
    a: np.ndarray, b: np.ndarray, *, discrete: bool, thresholds: int
) -> tuple[list[str], np.ndarray, np.ndarray]:
    names: list[str] = []
    counts_a: list[int] = []
    counts_b: list[int] = []
    if discrete:
        for value in np.union1d(a, b):
            names.append(f"y == {value}")
            counts_a.append(int(np.sum(a == value)))
            counts_b.append(int(np.sum(b == value)))
    else:
        pooled = np.concatenate([a, b])
        cuts = np.unique(np.quantile(pooled, np.linspace(0.0005, 0.9995, thresholds)))
        a_sorted, b_sorted = np.sort(a), np.sort(b)
        for cut in cuts:
            below_a = int(np.searchsorted(a_sorted, cut, side="right"))
            below_b = int(np.searchsorted(b_sorted, cut, side="right"))
            names += [f"y <= {cut:.4g}", f"y > {cut:.4g}"]
            counts_a += [below_a, len(a) - below_a]
            counts_b += [below_b, len(b) - below_b]
    return names, np.asarray(counts_a), np.asarray(counts_b)


def audit_epsilon(
    *,
    outputs_a: np.ndarray,
    outputs_b: np.ndarray,
    delta: float = 0.0,
    discrete: bool,
    confidence: float = 0.99,
    thresholds: int = 60,
) -> AuditResult:
    """Lower-bound the epsilon of a mechanism from samples on two neighbouring inputs.

    Parameters
    ----------
    outputs_a, outputs_b : np.ndarray
        Scalar outputs (1-D) of many independent runs on input a and on input b.
    delta : float
        The delta of the claim being audited (0 for pure DP).
    discrete : bool
        Treat outputs as categories (randomized response) instead of reals.
    confidence : float
        Probability that the returned lower bound is valid.
    thresholds : int
        Number of quantile thresholds for continuous outputs.

    """
    a = np.asarray(outputs_a).ravel()
    b = np.asarray(outputs_b).ravel()
    if a.size == 0 or b.size == 0:
        raise ValueError("need samples on both inputs")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    names, counts_a, counts_b = _set_counts(a, b, discrete=discrete, thresholds=thresholds)
    tests = 2 * len(names)
    alpha = (1 - confidence) / tests
    best = (-math.inf, -math.inf, "")
    for first, second, n_first, n_second, direction in (
        (counts_a, counts_b, a.size, b.size, "a/b"),
        (counts_b, counts_a, b.size, a.size, "b/a"),
    ):
        low_first, _ = _clopper_pearson(first, n_first, alpha)
        _, high_second = _clopper_pearson(second, n_second, alpha)
        with np.errstate(divide="ignore", invalid="ignore"):
            bound = np.log(np.maximum(low_first - delta, 0.0) / high_second)
            point = np.log(np.maximum(first / n_first - delta, 0.0) / (second / n_second))
        bound = np.where(np.isnan(bound), -np.inf, bound)
        point = np.where(np.isfinite(point), point, -np.inf)
        index = int(np.argmax(bound))
        if bound[index] > best[0]:
            best = (float(bound[index]), float(np.max(point)), f"{names[index]} ({direction})")
    return AuditResult(max(best[0], 0.0), max(best[1], 0.0), best[2], tests)
