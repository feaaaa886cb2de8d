"""DP partition selection: which words (partitions) to release from the users' word sets.

The mechanism is the Gaussian variant of "bounded contributions, noisy counts, a threshold":
Korolova, Kenthapadi, Mishra and Ntoulas, "Releasing search queries and clicks privately" (WWW 2009;
Laplace noise), with Gaussian noise as in Wilson et al., "Differentially private SQL with bounded
user contribution" (PoPETs 2020) and the Gaussian baseline of Gopi, Gulhane, Kulkarni, Shen,
Shokouhi and Yekhanin, "Differentially Private Set Union" (ICML 2020); Desfontaines, Voss, Gipson and
Mandayam, "Differentially private partition selection" (PoPETs 2022) study the threshold rule.

:class:`GaussianPartitionSelection`: each user contributes at most ``k`` distinct words, count 1
each (the caller bounds the contributions); every word some user holds gets Gaussian noise of
standard deviation ``sigma = z * sqrt(k)`` on its count of users; the words whose noisy count exceeds
the threshold ``tau`` are released, the largest noisy counts first, at most ``size`` of them.

Privacy (add or remove one user ``u``; zero-out alike, ``u`` contributing nothing): write ``A`` for
the words another user holds and ``B`` for those only ``u`` holds (count 1 each, at most ``k``).

* On ``A`` the counts change by at most ``k`` ones: the Gaussian mechanism of L2 sensitivity
  ``sqrt(k)``, noise multiplier ``z`` (:attr:`GaussianPartitionSelection.mechanism`, the event the
  accountant composes with everything else the run releases).
* A word of ``B`` is released with probability ``Q((tau - 1) / sigma)`` (``Q`` the standard normal
  tail), any of them with at most ``delta_tau = k Q((tau - 1) / sigma)`` (union bound:
  :meth:`GaussianPartitionSelection.threshold_delta`).

If the Gaussian part composed with the rest of the run is ``(epsilon, delta_A)``-DP, the run is
``(epsilon + ln(1 / (1 - delta_tau)), delta_A + delta_tau)``-DP: with ``u`` present the output is,
with probability at least ``1 - delta_tau``, distributed as the Gaussian part's (adding
``delta_tau``); with ``u`` absent the privacy loss of every output is the Gaussian part's plus
``ln(1 / (1 - P[a word of B is released]))`` (:meth:`GaussianPartitionSelection.epsilon_shift`).
Both terms are charged (:func:`total_with_selection`), never dropped.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from statistics import NormalDist
from typing import Any

import numpy as np

from fl_app.privacy.calibration import analytic_gaussian_sigma, bisect
from fl_app.privacy.checks import require_positive, require_positive_int, require_probability
from fl_app.privacy.composition import EpsilonReport, compose_epsilon
from fl_app.privacy.events import Gaussian

#: The papers the mechanism and its analysis come from (said in the run's results).
REFERENCES = (
    "Korolova, Kenthapadi, Mishra, Ntoulas 2009 (Releasing search queries and clicks privately); "
    "Wilson et al. 2020 (Differentially private SQL with bounded user contribution); Gopi et al. 2020 "
    "(Differentially Private Set Union); Desfontaines, Voss, Gipson, Mandayam 2022 (Differentially "
    "private partition selection)"
)


def normal_tail(x: float) -> float:
    """``P(N(0, 1) > x)``, accurate far into the tail."""
    return 0.5 * math.erfc(x / math.sqrt(2.0))


@dataclass(frozen=True)
class GaussianPartitionSelection:
    """Noisy counts of users per word, a threshold, the largest first (see the module docstring).

    Attributes
    ----------
    words_per_user : int
        ``k``: the most distinct words one user contributes (each counted once).
    noise_multiplier : float
        ``z``: the noise's standard deviation over the L2 sensitivity ``sqrt(k)``.
    threshold : float
        ``tau``: a word is released when its noisy count exceeds it.

    """

    words_per_user: int
    noise_multiplier: float
    threshold: float

    def __post_init__(self) -> None:
        require_positive_int("words_per_user", self.words_per_user)
        require_positive("noise_multiplier", self.noise_multiplier)
        if not math.isfinite(self.threshold) or self.threshold < 1.0:
            raise ValueError(f"threshold must be a finite number >= 1, got {self.threshold!r}")

    @property
    def sensitivity(self) -> float:
        """L2 sensitivity of the vector of counts: ``sqrt(k)``."""
        return math.sqrt(self.words_per_user)

    @property
    def noise_std(self) -> float:
        """``sigma = z * sqrt(k)``."""
        return self.noise_multiplier * self.sensitivity

    @property
    def mechanism(self) -> Gaussian:
        """The Gaussian part, normalised by its sensitivity (the event the accountant composes)."""
        return Gaussian(self.noise_multiplier)

    def threshold_delta(self) -> float:
        """``delta_tau = k Q((tau - 1) / sigma)``: a bound on releasing any word only one user holds."""
        return min(1.0, self.words_per_user * normal_tail((self.threshold - 1.0) / self.noise_std))

    def epsilon_shift(self) -> float:
        """``ln(1 / (1 - delta_tau))``: what the threshold adds to epsilon (the user absent)."""
        return -math.log1p(-self.threshold_delta())

    def noisy_counts(self, counts: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """``counts`` plus independent ``N(0, sigma^2)`` noise each."""
        values = np.asarray(counts, dtype=np.float64)
        return values + rng.normal(0.0, self.noise_std, size=values.shape)

    def select(self, counts: Mapping[str, int], size: int, rng: np.random.Generator) -> tuple[str, ...]:
        """The released words: noisy count above the threshold, the largest first, at most ``size``.

        ``counts``: each word's number of users (at least 1; every user bounded to ``k`` words).
        The noise is drawn in the words' sorted order; ties go to the smaller word.
        """
        require_positive_int("size", size)
        words = sorted(counts)
        if not words:
            return ()
        if min(counts[word] for word in words) < 1:
            raise ValueError("counts must hold the words some user contributed (a count of at least 1)")
        noisy = self.noisy_counts(np.asarray([counts[word] for word in words]), rng)
        kept = np.flatnonzero(noisy > self.threshold)
        order = kept[np.lexsort((kept, -noisy[kept]))]
        return tuple(words[i] for i in order[:size])

    def to_json(self) -> dict[str, Any]:
        """The parameters as plain data."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GaussianPartitionSelection:
        """Inverse of :meth:`to_json`."""
        return cls(int(data["words_per_user"]), float(data["noise_multiplier"]), float(data["threshold"]))


@dataclass(frozen=True)
class SelectionBudget:
    """A selection calibrated to a share of a run's budget, and what it costs.

    Attributes
    ----------
    selection : GaussianPartitionSelection
        The mechanism.
    epsilon : float
        Its share of the run's epsilon: the Gaussian part's epsilon at ``delta_gaussian`` plus
        :meth:`~GaussianPartitionSelection.epsilon_shift` is at most this.
    delta_gaussian : float
        The delta the Gaussian part's epsilon is taken at (alone).
    delta_threshold : float
        The threshold's delta (:meth:`~GaussianPartitionSelection.threshold_delta` is at most this).

    """

    selection: GaussianPartitionSelection
    epsilon: float
    delta_gaussian: float
    delta_threshold: float

    @property
    def delta(self) -> float:
        """The selection's whole share of the run's delta."""
        return self.delta_gaussian + self.delta_threshold

    def gaussian_epsilon(self, method: str) -> float:
        """The Gaussian part's epsilon alone at :attr:`delta_gaussian`, by the accountant's composition."""
        return compose_epsilon(
            {self.selection.mechanism: 1}, delta=self.delta_gaussian, method=method
        ).epsilon

    def own_epsilon(self, method: str) -> float:
        """The selection's epsilon alone at :attr:`delta` (Gaussian part and threshold)."""
        return self.gaussian_epsilon(method) + self.selection.epsilon_shift()

    def to_json(self) -> dict[str, Any]:
        """The budget as plain data (the selection's parameters inline)."""
        return {
            **self.selection.to_json(),
            "epsilon": self.epsilon,
            "delta_gaussian": self.delta_gaussian,
            "delta_threshold": self.delta_threshold,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SelectionBudget:
        """Inverse of :meth:`to_json`."""
        return cls(
            GaussianPartitionSelection.from_json(data),
            float(data["epsilon"]),
            float(data["delta_gaussian"]),
            float(data["delta_threshold"]),
        )


def gaussian_noise_multiplier(*, epsilon: float, delta: float, method: str) -> float:
    """The smallest noise multiplier whose one Gaussian release the accountant charges at most ``epsilon``.

    The analytic Gaussian mechanism's (Balle & Wang 2018) is exact, so no smaller one meets the
    target under any sound accountant; from there the gap above it doubles (from 0.1 %) until the
    accountant's composition (:func:`~fl_app.privacy.composition.compose_epsilon`, an upper bound)
    meets it, and :func:`~fl_app.privacy.calibration.bisect` narrows it to 0.01 %.
    """

    def meets(z: float) -> bool:
        return compose_epsilon({Gaussian(z): 1}, delta=delta, method=method).epsilon <= epsilon

    exact = analytic_gaussian_sigma(sensitivity=1.0, epsilon=epsilon, delta=delta)
    gap = 1e-3 * exact
    while not meets(exact + gap):
        gap *= 2.0
    return bisect(meets, bad=exact, good=exact + gap, done=lambda bad, good: good - bad <= 1e-4 * good)


@functools.lru_cache(maxsize=64)
def calibrate_selection(
    *, epsilon: float, delta: float, words_per_user: int, method: str = "pld"
) -> SelectionBudget:
    """The least noise whose selection costs at most ``(epsilon, delta)`` alone.

    Half of ``delta`` goes to the Gaussian part, half to the threshold: the noise multiplier is
    :func:`gaussian_noise_multiplier` of ``epsilon - ln(1 / (1 - delta / 2))`` at ``delta / 2``, the
    threshold the smallest ``tau`` with ``k Q((tau - 1) / sigma) <= delta / 2``.
    """
    require_positive("epsilon", epsilon)
    require_probability("delta", delta)
    require_positive_int("words_per_user", words_per_user)
    delta_threshold = delta_gaussian = delta / 2.0
    shift = -math.log1p(-delta_threshold)
    if epsilon <= shift:
        raise ValueError(
            f"epsilon={epsilon} leaves nothing for the Gaussian part after the threshold's {shift}"
        )
    z = gaussian_noise_multiplier(epsilon=epsilon - shift, delta=delta_gaussian, method=method)
    sigma = z * math.sqrt(words_per_user)
    tau = 1.0 + sigma * -NormalDist().inv_cdf(delta_threshold / words_per_user)
    selection = GaussianPartitionSelection(words_per_user, z, tau)
    while selection.threshold_delta() > delta_threshold:  # rounding: the threshold only moves up
        tau = math.nextafter(tau, math.inf) + 1e-12 * tau
        selection = GaussianPartitionSelection(words_per_user, z, tau)
    return SelectionBudget(selection, epsilon, delta_gaussian, delta_threshold)


def total_with_selection(
    *,
    training: EpsilonReport,
    budget: SelectionBudget,
    joint: EpsilonReport | None,
    delta: float,
    method: str,
) -> EpsilonReport:
    """The run's epsilon at ``delta``: a selection before a training, the smaller of two sound bounds.

    * Basic composition: the training's epsilon (at ``training.delta``) plus the selection's alone
      (:meth:`SelectionBudget.own_epsilon`), at ``training.delta + budget.delta``, which must not
      exceed ``delta``.
    * ``joint``: the Gaussian part and the training composed by the accountant at
      ``delta - budget.delta_threshold``, plus the threshold's shift, at ``delta``.
    """
    if training.delta + budget.delta > delta * (1 + 1e-12):
        raise ValueError(f"training delta {training.delta} + selection delta {budget.delta} exceed {delta}")
    shift = budget.selection.epsilon_shift()
    summed = training.epsilon + budget.own_epsilon(method)
    if joint is not None and joint.epsilon + shift <= summed:
        return EpsilonReport(
            epsilon=joint.epsilon + shift,
            delta=delta,
            method=f"{joint.method} (joint) + threshold",
            rdp=None if joint.rdp is None else joint.rdp + shift,
            rdp_order=joint.rdp_order,
            pld=None if joint.pld is None else joint.pld + shift,
            basic=None,
        )
    return EpsilonReport(
        epsilon=summed,
        delta=delta,
        method=f"{training.method} + vocabulary (basic)",
        rdp=None,
        rdp_order=None,
        pld=None,
        basic=None,
    )
