"""Empirical privacy estimation with canary clients (one-shot, from the final model).

Andrew, Kairouz, Oh, Oprea, McMahan, Suriyakumar, "One-shot Empirical Privacy
Estimation for Federated Learning", ICLR 2024 (arXiv:2302.03098), Algorithm 1
with the final model only:

1. Add ``n`` canary clients to the population. Canary ``k`` has a fixed random
   unit direction ``u_k`` (isotropic in R^d, d = number of model parameters).
   Whenever it is sampled, it uploads ``u_k`` times a norm far above the clip
   norm, through the same clipping and noise as a real client's update, so a
   clip that is larger than the accountant assumes shows up as a larger canary.
2. After training, take the model delta ``Delta = theta_T - theta_0`` and the
   cosines ``<Delta, u_k> / |Delta|`` of the inserted canaries and of ``m``
   canaries that were never inserted (the null distribution; for isotropic
   directions it is about N(0, 1/d)).
3. Fit a Gaussian to each set of cosines, N(mu_0, s^2) for the null and
   N(mu_1, s^2) for the inserted canaries, with one pooled standard deviation s, and
   report the epsilon at which the two are (epsilon, delta)-indistinguishable: the
   mu-GDP curve with ``mu = |mu_1 - mu_0| / s`` (Dong, Roth, Su 2022, Corollary 2.13;
   :func:`gaussian_pair_epsilon` with equal variances). A canary's presence shifts the
   mean of its cosine. With unequal fitted variances the privacy loss of two Gaussians
   is unbounded in the tails, and at delta = 1e-5 a variance ratio of 1.1, which is
   sampling error at a few hundred canaries, alone turns a true epsilon of 1 into an
   estimate of 3 (measured: ``docs/empirical_privacy.md``). The results keep the
   ratio (``std_ratio``).
4. The interval is a percentile bootstrap over the canaries (both sets resampled).

The estimate is a *lower* bound in spirit: a correct mechanism gives an estimate
at or below the accountant's epsilon; a broken one (no noise, a larger clip than
accounted) gives one above it. It is not a proof of privacy.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fl_app.privacy.calibration import smallest_noise_multiplier
from fl_app.privacy.rng import RandomSource

#: Canary uploads have this many clip norms before clipping (clipping sets the scale they keep).
CANARY_NORM_FACTOR = 100.0
#: Resamples of the bootstrap interval.
BOOTSTRAP = 200
#: The run header's line when canaries are on.
HEADER_NOTE = (
    "privacy.canaries={count}: {count} canary clients (and {count} never inserted) estimate an empirical "
    "epsilon beside the accountant's; the canaries' clipped uploads join the aggregate like a client's, so "
    "the released model and its reported accuracy include them (docs/empirical_privacy.md)"
)


@dataclass(frozen=True)
class EmpiricalEpsilon:
    """An empirical epsilon estimate and its bootstrap interval (``privacy.empirical_epsilon``)."""

    epsilon: float
    low: float
    high: float
    confidence: float
    delta: float
    canaries: int
    inserted: int
    null_canaries: int
    mean_inserted_cosine: float
    mean_null_cosine: float
    std_ratio: float
    method: str = (
        "one-shot canary cosines, final model, pooled-variance Gaussian fit (Andrew et al., ICLR 2024)"
    )
    in_released_model: str = (
        "the inserted canaries' clipped uploads joined the aggregate like a client's: the released model "
        "and its reported accuracy include them (run a twin with privacy.canaries=0 for the accuracy)"
    )

    def to_json(self) -> dict[str, Any]:
        """The results file's object."""
        return asdict(self)


def _normal_cdf(x: float, mu: float = 0.0, s: float = 1.0) -> float:
    if math.isinf(x):
        return 1.0 if x > 0 else 0.0
    return 0.5 * math.erfc(-(x - mu) / (s * math.sqrt(2.0)))


def _normal_interval(low: float, high: float, mu: float, s: float) -> float:
    """P(low < X < high) for X ~ N(mu, s^2), from the nearer tail (no cancellation in far tails)."""
    if low >= mu:  # both in the upper tail: survival functions
        return (
            _normal_cdf(-high, -mu, s) - _normal_cdf(-low, -mu, s)
            if high < math.inf
            else _normal_cdf(-low, -mu, s)
        )
    return _normal_cdf(high, mu, s) - _normal_cdf(low, mu, s)


def hockey_stick_gaussians(*, mu_p: float, s_p: float, mu_q: float, s_q: float, epsilon: float) -> float:
    """``delta(epsilon) = sup_S P(S) - e^epsilon Q(S)`` for P = N(mu_p, s_p^2), Q = N(mu_q, s_q^2).

    Exact: the set where the privacy loss ``log p/q`` exceeds epsilon is where a
    quadratic in x is positive; its probabilities come from normal CDFs.
    """
    a = 1.0 / (2 * s_q**2) - 1.0 / (2 * s_p**2)
    b = mu_p / s_p**2 - mu_q / s_q**2
    c = mu_q**2 / (2 * s_q**2) - mu_p**2 / (2 * s_p**2) + math.log(s_q / s_p) - epsilon
    scale = math.exp(min(epsilon, 700.0))  # beyond, e^eps Q(S) dominates wherever Q(S) > 0

    def mass(low: float, high: float) -> float:  # P((low, high)) - e^eps Q((low, high))
        return _normal_interval(low, high, mu_p, s_p) - scale * _normal_interval(low, high, mu_q, s_q)

    if abs(a) < 1e-12 * max(abs(b), 1e-300):
        if b == 0:
            return max(0.0, 1.0 - scale) if c > 0 else 0.0
        edge = -c / b
        return max(0.0, mass(edge, math.inf) if b > 0 else mass(-math.inf, edge))
    disc = b * b - 4 * a * c
    if disc <= 0:
        return max(0.0, 1.0 - scale) if a > 0 else 0.0
    root = math.sqrt(disc)
    r1, r2 = sorted(((-b - root) / (2 * a), (-b + root) / (2 * a)))
    if a > 0:
        return max(0.0, mass(-math.inf, r1) + mass(r2, math.inf))
    return max(0.0, mass(r1, r2))


def gaussian_pair_epsilon(*, mu0: float, s0: float, mu1: float, s1: float, delta: float) -> float:
    """Smallest epsilon at which N(mu0, s0^2) and N(mu1, s1^2) are (epsilon, delta)-indistinguishable.

    Both directions of the hockey-stick divergence (:func:`hockey_stick_gaussians`).
    """
    if not (s0 > 0 and s1 > 0):
        raise ValueError(f"standard deviations must be > 0, got {s0}, {s1}")

    def delta_of(epsilon: float) -> float:
        return max(
            hockey_stick_gaussians(mu_p=mu1, s_p=s1, mu_q=mu0, s_q=s0, epsilon=epsilon),
            hockey_stick_gaussians(mu_p=mu0, s_p=s0, mu_q=mu1, s_q=s1, epsilon=epsilon),
        )

    if delta_of(0.0) <= delta:
        return 0.0
    return smallest_noise_multiplier(delta_of, epsilon=delta)


def gdp_epsilon(*, mu: float, delta: float) -> float:
    """Epsilon of mu-GDP at delta (Dong, Roth, Su 2022, Corollary 2.13), for tests and docs."""

    def delta_of(epsilon: float) -> float:
        return _normal_cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * _normal_cdf(-epsilon / mu - mu / 2)

    if delta_of(0.0) <= delta:
        return 0.0
    return smallest_noise_multiplier(delta_of, epsilon=delta)


def estimate_epsilon(
    *,
    inserted: np.ndarray,
    null: np.ndarray,
    delta: float,
    rng: np.random.Generator,
    confidence: float = 0.95,
    canaries: int | None = None,
) -> EmpiricalEpsilon:
    """The one-shot estimate from the cosines of inserted and never-inserted canaries.

    Parameters
    ----------
    inserted, null : np.ndarray
        Cosines of the canaries that were inserted (at least once) and of those never inserted.
    delta : float
        The run's delta.
    rng : np.random.Generator
        For the bootstrap.
    confidence : float
        Of the percentile interval.
    canaries : int, optional
        How many canaries the run had (for the record; default: ``len(inserted)``).

    """
    if len(inserted) < 2 or len(null) < 2:
        raise ValueError("the estimate needs at least two inserted and two null canaries")

    def point(a: np.ndarray, b: np.ndarray) -> float:
        pooled = max(math.sqrt((float(np.var(a, ddof=1)) + float(np.var(b, ddof=1))) / 2), 1e-300)
        return gaussian_pair_epsilon(
            mu0=float(np.mean(b)), s0=pooled, mu1=float(np.mean(a)), s1=pooled, delta=delta
        )

    estimate = point(inserted, null)
    samples = [
        point(rng.choice(inserted, size=len(inserted)), rng.choice(null, size=len(null)))
        for _ in range(BOOTSTRAP)
    ]
    tail = (1 - confidence) / 2
    low, high = np.quantile(samples, [tail, 1 - tail])
    return EmpiricalEpsilon(
        epsilon=estimate,
        low=float(low),
        high=float(high),
        confidence=confidence,
        delta=delta,
        canaries=int(canaries if canaries is not None else len(inserted)),
        inserted=len(inserted),
        null_canaries=len(null),
        mean_inserted_cosine=float(np.mean(inserted)),
        mean_null_cosine=float(np.mean(null)),
        std_ratio=float(np.std(inserted, ddof=1) / max(float(np.std(null, ddof=1)), 1e-300)),
    )


class CanaryPopulation:
    """The canary clients of one run: who is sampled when, what each uploads, and the estimate.

    Canaries ``0..count-1`` join the population and take part as the client the epsilon is
    about would: with sampled cohorts (no ``patterns``), each is sampled in a round with
    probability ``rate`` (the real clients' cohort fraction) from its own generator, so
    the real clients' cohorts are unchanged; under a planned schedule, canary ``k`` takes part
    in exactly the rounds ``patterns[k]``, a copy of the schedule of a client the accountant
    reports (the worst one: the same number of participations in the same trees, for DP-FTRL).
    Canaries ``count..2 count - 1`` are never inserted (the null set). Directions come from the
    run's non-privacy randomness (``canary-direction``, one generator per canary).
    Canaries are not in the roster: they send no messages and count in no byte total,
    accuracy or accountant.
    """

    def __init__(
        self,
        *,
        count: int,
        rate: float,
        dimension: int,
        randomness: RandomSource,
        patterns: Sequence[Collection[int]] | None = None,
    ) -> None:
        if count < 2:
            raise ValueError(f"privacy.canaries must be >= 2 for an estimate, got {count}")
        if not 0 < rate <= 1:
            raise ValueError(f"canary sampling rate must be in (0, 1], got {rate}")
        if patterns is not None and len(patterns) != count:
            raise ValueError(f"need one participation pattern per canary ({count}), got {len(patterns)}")
        self.count, self.rate, self.dimension = count, rate, dimension
        self.patterns = None if patterns is None else [frozenset(int(t) for t in p) for p in patterns]
        self.randomness = randomness
        self.participations = np.zeros(count, dtype=np.int64)

    def sampled(self, server_round: int) -> list[int]:
        """The canaries inserted in ``server_round`` (recorded as participations)."""
        if self.patterns is not None:
            chosen = np.array(
                [k for k, rounds in enumerate(self.patterns) if server_round in rounds], dtype=int
            )
        else:
            rng = self.randomness.generator("canary-sampling", server_round=server_round)
            chosen = np.flatnonzero(rng.random(self.count) < self.rate)
        self.participations[chosen] += 1
        return [int(k) for k in chosen]

    def direction(self, canary: int) -> np.ndarray:
        """Canary ``canary``'s unit direction (float64; the same every call)."""
        rng = self.randomness.generator("canary-direction", client=canary)
        vector = rng.standard_normal(self.dimension)
        return vector / np.linalg.norm(vector)

    def upload(self, canary: int, *, clip: float) -> np.ndarray:
        """What the canary uploads before clipping: its direction at CANARY_NORM_FACTOR clip norms."""
        return self.direction(canary) * (CANARY_NORM_FACTOR * clip)

    def estimate(
        self, delta_vector: np.ndarray, *, delta: float, rng: np.random.Generator
    ) -> EmpiricalEpsilon:
        """The one-shot estimate from the final model delta (see the module docstring)."""
        inserted = [k for k in range(self.count) if self.participations[k] > 0]
        nulls = range(self.count, 2 * self.count)
        size = float(np.linalg.norm(delta_vector))
        observed = np.array([self.direction(k) @ delta_vector for k in inserted]) / max(size, 1e-300)
        null = np.array([self.direction(k) @ delta_vector for k in nulls]) / max(size, 1e-300)
        return estimate_epsilon(inserted=observed, null=null, delta=delta, rng=rng, canaries=self.count)


def worst_client_patterns(
    rounds_of: Mapping[int, Collection[int]], *, worst: Sequence[int], count: int, rng: np.random.Generator
) -> list[frozenset[int]]:
    """``count`` participation patterns, each the schedule of a client drawn from ``worst``.

    ``rounds_of`` maps a client id to the rounds a planned schedule gives it; ``worst`` are the
    clients whose accounted epsilon is the run's (the largest): a canary that copies one of them
    takes part exactly as often, and in the same trees, as the client the claim is about.
    """
    if not worst:
        raise ValueError("no worst client to copy a participation pattern from")
    picks = rng.integers(len(worst), size=count)
    return [frozenset(rounds_of[worst[int(i)]]) for i in picks]
