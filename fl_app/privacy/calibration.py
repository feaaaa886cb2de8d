"""Calibration: from a privacy target to a mechanism's noise parameter.

Closed forms from the source documents (each names its equation), and
calibrations that search a noise parameter against the accountant's own
composition (:func:`~fl_app.privacy.composition.compose_epsilon`), so that a
calibrated run reports at most the requested epsilon by construction.

All functions are keyword-only and validate their arguments.
"""

from __future__ import annotations

import functools
import hashlib
import math
import warnings
from collections.abc import Callable, Iterable

from fl_app.privacy.calibration_cache import checked_calibration, passes
from fl_app.privacy.checks import require_positive, require_positive_int, require_probability
from fl_app.privacy.composition import History, compose_epsilon, dpa
from fl_app.privacy.events import (
    Gaussian,
    RandomizedResponse,
    SampledGaussian,
)

CLASSIC_GAUSSIAN_MAX_EPSILON = 1.0
#: The searches for a noise multiplier stop narrowing below this z (the returned z still meets the
#: budget): only an absurd budget gets there, and a search towards 0 never reached its relative width
#: (privacy.epsilon=1e300 took 1,000 halvings and 6 s).
SMALLEST_SEARCHED_NOISE = 1e-6


class ClassicGaussianRangeWarning(UserWarning):
    """The classic Gaussian bound is used outside the range where it is proven."""


# --------------------------------------------------------------------------------------
# Gaussian mechanism
# --------------------------------------------------------------------------------------


def classic_gaussian_constant(*, delta: float) -> float:
    """``c = sqrt(2 ln(1.25 / delta))`` (Dwork & Roth 2014, Theorem A.1)."""
    require_probability("delta", delta)
    return math.sqrt(2.0 * math.log(1.25 / delta))


def classic_gaussian_sigma(*, sensitivity: float, epsilon: float, delta: float, strict: bool = True) -> float:
    """Classic calibration ``sigma = c * sensitivity / epsilon``.

    The proof (Dwork & Roth, Theorem A.1) needs ``epsilon < 1``. Outside that
    range ``strict=True`` refuses and ``strict=False`` warns
    (:class:`ClassicGaussianRangeWarning`) and returns the formula's value, which
    is then *not* a proven (epsilon, delta) guarantee; use
    :func:`analytic_gaussian_sigma` instead.
    """
    require_positive("sensitivity", sensitivity)
    require_positive("epsilon", epsilon)
    c = classic_gaussian_constant(delta=delta)
    if epsilon >= CLASSIC_GAUSSIAN_MAX_EPSILON:
        message = (
            f"classic Gaussian calibration needs epsilon < 1 (got {epsilon}); its sigma does not "
            "guarantee (epsilon, delta) here; use the analytic calibration"
        )
        if strict:
            raise ValueError(message)
        warnings.warn(message, ClassicGaussianRangeWarning, stacklevel=2)
    return c * sensitivity / epsilon


def analytic_gaussian_sigma(*, sensitivity: float, epsilon: float, delta: float) -> float:
    """Smallest sigma for which the Gaussian mechanism is (epsilon, delta)-DP.

    Analytic Gaussian mechanism (Balle & Wang, ICML 2018), exact for any
    ``epsilon > 0``; computed by dp-accounting's ``get_sigma_gaussian``.
    """
    require_positive("sensitivity", sensitivity)
    require_positive("epsilon", epsilon)
    require_probability("delta", delta)
    return float(dpa.get_sigma_gaussian(epsilon, delta)) * sensitivity


# --------------------------------------------------------------------------------------
# Local DP on a client's clipped model update (FedAvg+LDP baseline)
# --------------------------------------------------------------------------------------


def local_update_sensitivity(*, clip: float) -> float:
    """L2 sensitivity ``2C`` of one client's update clipped to norm ``C``.

    Local DP protects the client's whole data set against the server: any two
    data sets of one client may give any two clipped updates, which are at most
    ``2C`` apart in L2 (replacement relation; not ``C``, which is the
    add-or-remove sensitivity of a *sum* over clients).
    """
    require_positive("clip", clip)
    return 2.0 * clip


def local_gaussian_noise_multiplier(
    *, epsilon: float, delta: float, participations: int, method: str = "rdp"
) -> float:
    """Smallest ``z = sigma / (2C)`` whose ``participations`` uploads meet ``(epsilon, delta)``.

    Each upload is one ``Gaussian(z)`` release of the client's clipped update
    (no amplification by sampling: the client knows it was selected, and the
    server sees its upload). The search runs on the accountant's own
    composition, so the reported epsilon never exceeds the target.
    """
    require_positive_int("participations", participations)
    return dp_fedavg_noise_multiplier(
        epsilon=epsilon, delta=delta, sampling_rate=1.0, rounds=participations, method=method
    )


def local_gaussian_sigma(*, clip: float, noise_multiplier: float) -> float:
    """Per-coordinate noise std ``z * 2C`` for a client's update clipped to ``C``."""
    require_positive("noise_multiplier", noise_multiplier)
    return noise_multiplier * local_update_sensitivity(clip=clip)


# --------------------------------------------------------------------------------------
# DP-FedAvg and searches against the accountant
# --------------------------------------------------------------------------------------


def gaussian_epsilon(
    *, noise_multiplier: float, sampling_rate: float, rounds: int, delta: float, method: str = "rdp"
) -> float:
    """Epsilon of ``rounds`` Gaussian releases, Poisson-sampled when ``sampling_rate < 1``."""
    require_positive("noise_multiplier", noise_multiplier)
    require_positive_int("rounds", rounds)
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate!r}")
    mechanism = (
        Gaussian(noise_multiplier) if sampling_rate == 1 else SampledGaussian(noise_multiplier, sampling_rate)
    )
    return compose_epsilon({mechanism: rounds}, delta=delta, method=method).epsilon


def bisect(
    meets: Callable[[float], bool], *, bad: float, good: float, done: Callable[[float, float], bool]
) -> float:
    """The one root finder of every calibration: bisection on a monotone condition.

    ``meets(good)`` holds and ``meets(bad)`` does not (``bad`` may lie on either side of
    ``good``); the bracket is halved until ``done(bad, good)`` and the last parameter that meets
    the condition is returned, so the calibrated value is always on the safe side.
    """
    while not done(bad, good):
        middle = 0.5 * (bad + good)
        if meets(middle):
            good = middle
        else:
            bad = middle
    return good


def smallest_noise_multiplier(
    eps_of: Callable[[float], float],
    *,
    epsilon: float,
    relative_width: float = 1e-4,
    start: float | None = None,
) -> float:
    """Smallest noise multiplier z with ``eps_of(z) <= epsilon`` (``eps_of`` decreasing in z).

    Doubling from 1, then :func:`bisect` to a relative width of ``relative_width``; returns the
    upper end of the final bracket, so the epsilon it reaches never exceeds the target. Raises
    ``ValueError`` when no z <= 1e6 reaches it. ``start``: a z known to be close above the answer
    (e.g. the RDP calibration when ``eps_of`` is PLD's, which needs less noise): the search then
    only narrows below it (:func:`_narrow_below`), with far fewer evaluations of ``eps_of``.
    """
    if start is not None and eps_of(start) <= epsilon:
        return _narrow_below(lambda z: eps_of(z) <= epsilon, good=start, tolerance=relative_width)
    high = 1.0
    while eps_of(high) > epsilon:
        high *= 2.0
        if high > 1e6:
            raise ValueError(f"no noise multiplier <= 1e6 reaches epsilon={epsilon}")
    return bisect(
        lambda z: eps_of(z) <= epsilon,
        bad=0.0,
        good=high,
        done=lambda bad, good: good - bad <= relative_width * good or good < SMALLEST_SEARCHED_NOISE,
    )


@functools.lru_cache(maxsize=64)
def dp_fedavg_noise_multiplier(
    *, epsilon: float, delta: float, sampling_rate: float, rounds: int, method: str = "rdp"
) -> float:
    """Smallest noise multiplier z whose run of ``rounds`` releases meets (epsilon, delta).

    The search evaluates the accountant's own composition and returns the upper
    end of the final bracket, so the reported epsilon never exceeds the target. A pure function of
    its arguments, kept for the process (a strategy built again for the same run, as an audit's
    thousands of trials do, does not search again: 1.2 s with PLD) and on disk for other processes
    (a sweep's jobs, a resume: :mod:`~fl_app.privacy.calibration_cache`, which checks a stored
    answer against the target before using it).
    """
    require_positive("epsilon", epsilon)
    require_probability("delta", delta)

    def eps_of_method(chosen: str) -> Callable[[float], float]:
        def eps_of(z: float) -> float:
            return gaussian_epsilon(
                noise_multiplier=z, sampling_rate=sampling_rate, rounds=rounds, delta=delta, method=chosen
            )

        return eps_of

    def search() -> float:
        rdp = smallest_noise_multiplier(eps_of_method("rdp"), epsilon=epsilon)
        if method == "rdp":
            return rdp
        return smallest_noise_multiplier(eps_of_method(method), epsilon=epsilon, start=rdp)

    arguments = {
        "epsilon": float(epsilon),
        "delta": float(delta),
        "sampling_rate": float(sampling_rate),
        "rounds": int(rounds),
        "method": method,
    }
    return checked_calibration(
        "dp_fedavg_noise_multiplier",
        arguments,
        compute=search,
        meets=lambda z: eps_of_method(method)(z) <= epsilon,
    )


def large_cohort_noise_multiplier(*, noise_multiplier: float, cohort: int, noise_cohort_size: int) -> float:
    """The noise multiplier on the sum of a simulated cohort of ``m`` that stands for cohorts of ``M``.

    ``z m / M``: the simulation adds noise of std ``z C m / M`` to the sum of its ``m`` clipped
    updates, so that their average carries the noise ``z C / M`` of a deployment that sums ``M``
    (pfl-research's ``noise_cohort_size``: its accountant's ``noise_scale = cohort / noise_cohort``).
    The epsilon of ``z`` describes that deployment; the simulated model carries ``M / m`` times
    less noise than its own cohort would need.
    """
    require_positive("noise_multiplier", noise_multiplier)
    require_positive_int("cohort", cohort)
    require_positive_int("noise_cohort_size", noise_cohort_size)
    if noise_cohort_size <= cohort:
        raise ValueError(f"noise_cohort_size must exceed the cohort ({cohort}), got {noise_cohort_size}")
    return noise_multiplier * cohort / noise_cohort_size


def randomized_response_epsilon_per_label(
    *, total_epsilon: float, delta: float, labels: int, num_classes: int, method: str = "rdp"
) -> float:
    """Largest per-label epsilon whose ``labels`` randomized-response reports meet the total.

    Used to calibrate a run so that the worst client's cumulative epsilon, from
    the accountant, is at most ``total_epsilon``. Kept on disk for other processes
    (:mod:`~fl_app.privacy.calibration_cache`).
    """
    require_positive("total_epsilon", total_epsilon)
    require_positive_int("labels", labels)

    def spent(e: float) -> float:
        return compose_epsilon(
            {RandomizedResponse(e, num_classes): labels}, delta=delta, method=method
        ).epsilon

    def search() -> float:
        high = max(total_epsilon, 1.0) * 2.0
        return largest_meeting(spent, target=total_epsilon, low=0.0, high=high, floor=1e-9)

    arguments = {
        "total_epsilon": float(total_epsilon),
        "delta": float(delta),
        "labels": int(labels),
        "num_classes": int(num_classes),
        "method": method,
    }
    return checked_calibration(
        "randomized_response_epsilon_per_label",
        arguments,
        compute=search,
        meets=lambda e: spent(e) <= total_epsilon,
    )


def largest_meeting(
    function: Callable[[float], float],
    *,
    target: float,
    low: float,
    high: float,
    floor: float = 0.0,
    tolerance: float = 1e-9,
) -> float:
    """Largest x in [low, high] with ``function(x) <= target``, for increasing ``function``.

    :func:`bisect` until the bracket is narrower than ``tolerance * max(1, high)``; returns its
    lower end (the safe side).
    """
    low_x = max(low, floor)
    if function(low_x) > target:
        raise ValueError(f"even the smallest parameter {low_x} exceeds the target {target}")
    if function(high) <= target:
        return high
    return bisect(
        lambda x: function(x) <= target,
        bad=high,
        good=low_x,
        done=lambda bad, good: bad - good <= tolerance * max(1.0, bad),
    )


# --------------------------------------------------------------------------------------
# DP-SGD (Abadi et al. 2016; KD-DP's teacher and general clients)
# --------------------------------------------------------------------------------------

_DP_SGD_CACHE: dict[tuple[float, float, float, int, float, str], float] = {}


def dp_sgd_epsilon(
    *, noise_multiplier: float, sampling_rate: float, steps: int, delta: float, method: str = "rdp"
) -> float:
    """Epsilon of ``steps`` DP-SGD steps: :func:`gaussian_epsilon` with ``rounds = steps``."""
    require_probability("delta", delta)
    return gaussian_epsilon(
        noise_multiplier=noise_multiplier,
        sampling_rate=sampling_rate,
        rounds=int(steps),
        delta=delta,
        method=method,
    )


def dp_sgd_noise_multiplier(
    *,
    epsilon: float,
    delta: float,
    sampling_rate: float,
    steps: int,
    tolerance: float = 1e-3,
    method: str = "rdp",
) -> float:
    """Smallest noise multiplier (to relative ``tolerance``) whose ``steps`` DP-SGD steps meet the target.

    Searches ``z`` against the accountant's own composition (:func:`dp_sgd_epsilon` with
    ``method``): the RDP answer is found first (cheap: a bracket ``[low, high]`` with
    ``epsilon(low) > target >= epsilon(high)`` by doubling or halving from 1, then :func:`bisect`);
    with ``method="pld"`` it meets the target under PLD too (the accountant reports the smaller
    bound), so the PLD search only narrows below it. The upper end is returned, so
    ``dp_sgd_epsilon(z, method=method) <= epsilon`` always holds. Results are cached per argument tuple,
    in the process and on disk (:mod:`~fl_app.privacy.calibration_cache`).
    """
    require_positive("epsilon", epsilon)
    require_probability("delta", delta)
    require_positive_int("steps", steps)
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate!r}")
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be in (0, 1), got {tolerance!r}")
    key = (float(epsilon), float(delta), float(sampling_rate), int(steps), float(tolerance), method)
    if key not in _DP_SGD_CACHE:
        names = ("epsilon", "delta", "sampling_rate", "steps", "tolerance", "method")
        _DP_SGD_CACHE[key] = checked_calibration(
            "dp_sgd_noise_multiplier",
            dict(zip(names, key, strict=True)),
            compute=lambda: _dp_sgd_search(*key),
            meets=_dp_sgd_meets(*key[:4], method=method),
        )
    return _DP_SGD_CACHE[key]


def _dp_sgd_meets(
    epsilon: float, delta: float, sampling_rate: float, steps: int, *, method: str
) -> Callable[[float], bool]:
    """Whether a noise multiplier's ``steps`` DP-SGD steps meet ``epsilon`` under ``method``."""

    def meets(z: float) -> bool:
        spent = dp_sgd_epsilon(
            noise_multiplier=z, sampling_rate=sampling_rate, steps=steps, delta=delta, method=method
        )
        return spent <= epsilon

    return meets


def _dp_sgd_search(
    epsilon: float, delta: float, sampling_rate: float, steps: int, tolerance: float, method: str
) -> float:
    """:func:`dp_sgd_noise_multiplier`'s search: the RDP bracket and bisection, then PLD below it."""
    meets = _dp_sgd_meets(epsilon, delta, sampling_rate, steps, method="rdp")
    if meets(1.0):  # the bracket: halve from 1 while the target is still met
        good = 1.0
        while meets(good / 2.0):
            good /= 2.0
            if good < SMALLEST_SEARCHED_NOISE:
                return good
        bad = good / 2.0
    else:  # or double from 1 until it is met
        bad = 1.0
        while not meets(2.0 * bad):
            bad *= 2.0
            if bad > 1e6:
                raise ValueError(f"no noise multiplier <= 1e6 reaches epsilon={epsilon}")
        good = 2.0 * bad
    result = bisect(meets, bad=bad, good=good, done=lambda bad, good: good - bad <= tolerance * good)
    if method != "rdp":
        result = _narrow_below(
            _dp_sgd_meets(epsilon, delta, sampling_rate, steps, method=method),
            good=result,
            tolerance=tolerance,
        )
    return result


def _narrow_below(meets: Callable[[float], bool], *, good: float, tolerance: float) -> float:
    """The smallest z <= ``good`` that meets (``meets(good)`` holds), to relative ``tolerance``.

    Tighter bounds than the one ``good`` was found with need less noise, rarely less than 20 %
    less: the bracket starts at ``0.8 good`` and steps down by that factor while it still meets.
    """
    bad = 0.8 * good
    while meets(bad):
        good, bad = bad, 0.8 * bad
        if bad < SMALLEST_SEARCHED_NOISE:
            return good
    return bisect(meets, bad=bad, good=good, done=lambda bad, good: good - bad <= tolerance * good)


# --------------------------------------------------------------------------------------
# Searches over whole histories (the worst participant of a public schedule)
# --------------------------------------------------------------------------------------


#: Answers of :func:`noise_multiplier_for_histories` in this process, by (target, method, the
#: histories at the reference noise multipliers); checked against the target before each use.
_HISTORIES_CACHE: dict[tuple[object, ...], float] = {}
#: The noise multipliers at which a schedule's histories name it (each mechanism is z times a constant).
HISTORY_REFERENCE_NOISE = (1.0, 2.0)
_HISTORIES_CACHE_SIZE = 256


def noise_multiplier_for_histories(
    *,
    epsilon: float,
    delta: float,
    histories_of: Callable[[float], Iterable[History]],
    method: str = "rdp",
) -> float:
    """Smallest noise multiplier z for which every history ``histories_of(z)`` meets (epsilon, delta).

    ``histories_of(z)`` lists the per-participant histories (mechanism -> uses)
    a run with noise multiplier ``z`` would record; the search (doubling, then
    bisection to a relative width of 1e-4, as :func:`dp_fedavg_noise_multiplier`)
    runs on the accountant's own :func:`~fl_app.privacy.composition.compose_epsilon`
    and returns the upper end of the final bracket, so no listed participant's
    reported epsilon exceeds the target.

    Kept for the process and on disk (:mod:`~fl_app.privacy.calibration_cache`), named by the target
    and by the histories at :data:`HISTORY_REFERENCE_NOISE` (a DP-FTRL strategy built again for the
    same schedule, as an audit's thousands of trials do, does not search again); a kept answer is
    used only when ``histories_of`` at that answer meets the target (one evaluation), so two
    schedules that look alike at the reference points can cost tightness, never the budget.
    """
    require_positive("epsilon", epsilon)
    require_probability("delta", delta)

    def search() -> float:
        rdp = smallest_noise_multiplier(_worst_epsilon(histories_of, delta, "rdp"), epsilon=epsilon)
        if method == "rdp":
            return rdp
        return smallest_noise_multiplier(
            _worst_epsilon(histories_of, delta, method), epsilon=epsilon, start=rdp
        )

    def meets(z: float) -> bool:
        return _worst_epsilon(histories_of, delta, method)(z) <= epsilon

    schedule = _history_schedule(histories_of)
    key = (float(epsilon), float(delta), method, schedule)
    stored = _HISTORIES_CACHE.get(key)
    if stored is not None and passes(meets, stored):
        return stored
    arguments = {
        "epsilon": float(epsilon),
        "delta": float(delta),
        "method": method,
        "histories": hashlib.sha256(repr(schedule).encode()).hexdigest(),
    }
    answer = checked_calibration("noise_multiplier_for_histories", arguments, compute=search, meets=meets)
    if len(_HISTORIES_CACHE) >= _HISTORIES_CACHE_SIZE:
        _HISTORIES_CACHE.clear()
    _HISTORIES_CACHE[key] = answer
    return answer


def _worst_epsilon(
    histories_of: Callable[[float], Iterable[History]], delta: float, method: str
) -> Callable[[float], float]:
    """``z ->`` the largest epsilon (at ``delta``, by ``method``) of the histories ``histories_of(z)``."""

    def eps_of(z: float) -> float:
        spent = [compose_epsilon(h, delta=delta, method=method).epsilon for h in histories_of(z)]
        if not spent:
            raise ValueError("histories_of returned no history")
        return max(spent)

    return eps_of


def _history_schedule(histories_of: Callable[[float], Iterable[History]]) -> tuple[tuple[str, ...], ...]:
    """What names a schedule in the caches: its sorted histories at :data:`HISTORY_REFERENCE_NOISE`."""
    return tuple(
        tuple(sorted(repr(sorted(history.items(), key=repr)) for history in histories_of(z)))
        for z in HISTORY_REFERENCE_NOISE
    )
