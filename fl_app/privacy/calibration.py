"""Calibration: from a privacy target to a mechanism's noise parameter.

Closed forms from the source documents (each names its equation), and
calibrations that search a noise parameter against the accountant's own
composition (:func:`~fl_app.privacy.composition.compose_epsilon`), so that a
calibrated run reports at most the requested epsilon by construction.

All functions are keyword-only and validate their arguments.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import dp_accounting as dpa

from fl_app.privacy.composition import compose_epsilon
from fl_app.privacy.events import (
    BinaryRandomizedResponse,
    Gaussian,
    RandomizedResponse,
    SampledGaussian,
)

CLASSIC_GAUSSIAN_MAX_EPSILON = 1.0


class ClassicGaussianRangeWarning(UserWarning):
    """The classic Gaussian bound is used outside the range where it is proven."""


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _probability(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and 0 < value < 1):
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


# --------------------------------------------------------------------------------------
# Gaussian mechanism
# --------------------------------------------------------------------------------------


def classic_gaussian_constant(*, delta: float) -> float:
    """``c = sqrt(2 ln(1.25 / delta))`` (Dwork & Roth 2014, Theorem A.1)."""
    _probability("delta", delta)
    return math.sqrt(2.0 * math.log(1.25 / delta))


def classic_gaussian_sigma(*, sensitivity: float, epsilon: float, delta: float, strict: bool = True) -> float:
    """Classic calibration ``sigma = c * sensitivity / epsilon``.

    The proof (Dwork & Roth, Theorem A.1) needs ``epsilon < 1``. Outside that
    range ``strict=True`` refuses and ``strict=False`` warns
    (:class:`ClassicGaussianRangeWarning`) and returns the formula's value, which
    is then *not* a proven (epsilon, delta) guarantee; use
    :func:`analytic_gaussian_sigma` instead.
    """
    _positive("sensitivity", sensitivity)
    _positive("epsilon", epsilon)
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
    _positive("sensitivity", sensitivity)
    _positive("epsilon", epsilon)
    _probability("delta", delta)
    return float(dpa.get_sigma_gaussian(epsilon, delta)) * sensitivity


# --------------------------------------------------------------------------------------
# PrivateKT (Lemma 1, Eq. 6)
# --------------------------------------------------------------------------------------


def privatekt_keep_probability(*, epsilon: float, k: int, num_classes: int) -> float:
    """``beta = (e^(eps/K) - 1) / (e^(eps/K) - 1 + C)`` (PrivateKT Lemma 1, Eq. 6).

    With this beta, each of the K reported labels is ``eps/K``-LDP and the
    whole report of K labels is ``eps``-LDP (basic composition over K).
    """
    _positive("epsilon", epsilon)
    _positive_int("k", k)
    _positive_int("num_classes", num_classes)
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    expm1 = math.expm1(epsilon / k)
    return expm1 / (expm1 + num_classes)


# --------------------------------------------------------------------------------------
# NbAFL (Wei et al., IEEE TIFS 2020)
# --------------------------------------------------------------------------------------


def nbafl_sensitivity(*, clip: float, min_dataset_size: int) -> float:
    """NbAFL's uplink sensitivity ``Delta s_U = 2C / m`` (one record of the smallest client)."""
    _positive("clip", clip)
    _positive_int("min_dataset_size", min_dataset_size)
    return 2.0 * clip / min_dataset_size


def nbafl_uplink_sigma(
    *,
    epsilon: float,
    delta: float,
    clip: float,
    min_dataset_size: int,
    exposures: int,
    calibration: str = "classic",
) -> float:
    """Uplink noise ``sigma_U = c L Delta s_U / epsilon`` with ``Delta s_U = 2C/m``.

    Each of a client's at most ``L`` uploads gets budget ``epsilon / L``. With
    ``calibration="classic"`` this is the document's formula (proven only for
    ``epsilon / L < 1``; outside it a :class:`ClassicGaussianRangeWarning` is
    issued); ``"analytic"`` uses the exact analytic Gaussian for
    ``(epsilon / L, delta)`` per exposure instead.
    """
    _positive_int("exposures", exposures)
    sensitivity = nbafl_sensitivity(clip=clip, min_dataset_size=min_dataset_size)
    per_exposure = epsilon / exposures
    if calibration == "classic":
        return classic_gaussian_sigma(
            sensitivity=sensitivity, epsilon=per_exposure, delta=delta, strict=False
        )
    if calibration == "analytic":
        return analytic_gaussian_sigma(sensitivity=sensitivity, epsilon=per_exposure, delta=delta)
    raise ValueError(f"calibration must be 'classic' or 'analytic', got {calibration!r}")


def nbafl_downlink_sigma(
    *,
    epsilon: float,
    delta: float,
    clip: float,
    min_dataset_size: int,
    exposures: int,
    num_rounds: int,
    num_clients: int,
) -> float:
    """Downlink noise ``sigma_D = 2cC sqrt(T^2 - L^2 N) / (m N epsilon)`` if ``T > L sqrt(N)``, else 0.

    NbAFL's Theorem for the broadcast aggregate (uniform weights ``p_i = 1/N``):
    the uplink noise already protects the aggregate when ``T <= L sqrt(N)``.
    """
    _positive("epsilon", epsilon)
    _positive("clip", clip)
    _positive_int("min_dataset_size", min_dataset_size)
    _positive_int("exposures", exposures)
    _positive_int("num_rounds", num_rounds)
    _positive_int("num_clients", num_clients)
    c = classic_gaussian_constant(delta=delta)
    excess = num_rounds**2 - exposures**2 * num_clients
    if excess <= 0:
        return 0.0
    return 2.0 * c * clip * math.sqrt(excess) / (min_dataset_size * num_clients * epsilon)


# --------------------------------------------------------------------------------------
# DPFL-BNN (Liu et al. 2023, Theorem 1)
# --------------------------------------------------------------------------------------


def binary_rr_epsilon(
    *, gamma: float, delta: float, rounds: int, bits_per_round: int = 1, method: str = "rdp"
) -> float:
    """Epsilon of ``rounds * bits_per_round`` uses of RR_gamma (accountant composition)."""
    _positive_int("rounds", rounds)
    _positive_int("bits_per_round", bits_per_round)
    history = {BinaryRandomizedResponse(gamma): rounds * bits_per_round}
    return compose_epsilon(history, delta=delta, method=method).epsilon


def bnn_gamma(*, epsilon: float, delta: float, rounds: int, bits_per_round: int = 1) -> float:
    """Largest gamma whose RR_gamma composed ``rounds * bits_per_round`` times meets (epsilon, delta).

    DPFL-BNN Theorem 1 with the Renyi order optimised (over the accountant's
    orders, and with dp-accounting's RDP-to-DP conversion) instead of the
    document's fixed order ``alpha = 1 + 2(1/delta)/epsilon``.
    ``bits_per_round=1`` is the document's per-coordinate accounting; ``d``
    accounts for a client's whole d-bit upload per round.
    """
    _positive("epsilon", epsilon)
    _probability("delta", delta)
    return _largest_meeting(
        lambda g: binary_rr_epsilon(gamma=g, delta=delta, rounds=rounds, bits_per_round=bits_per_round),
        target=epsilon,
        low=0.0,
        high=0.5 - 1e-12,
    )


def bnn_rdp_closed_form(*, gamma: float, order: float) -> float:
    """RDP of RR_gamma at order alpha > 1 (DPFL-BNN Lemma 3, Mironov 2017)."""
    if not 0 <= gamma < 0.5:
        raise ValueError(f"gamma must be in [0, 0.5), got {gamma!r}")
    if order <= 1:
        raise ValueError(f"order must be > 1, got {order!r}")
    p, q = 0.5 + gamma, 0.5 - gamma
    log_terms = (
        order * math.log(p) + (1 - order) * math.log(q),
        order * math.log(q) + (1 - order) * math.log(p),
    )
    top = max(log_terms)
    return (top + math.log(sum(math.exp(t - top) for t in log_terms))) / (order - 1)


def bnn_gamma_theorem1(*, epsilon: float, delta: float, rounds: int) -> float:
    """Gamma from DPFL-BNN Theorem 1 as printed, with its order corrected to log(1/delta).

    Theorem 1 fixes ``alpha = 1 + 2 log(1/delta) / epsilon`` (the document prints
    ``1/delta`` in place of ``log(1/delta)``) and requires
    ``T rho(alpha) + log(1/delta)/(alpha - 1) <= epsilon``, i.e.
    ``rho(alpha) <= epsilon / (2T)``. Kept for comparison: :func:`bnn_gamma`
    optimises the order and gives a gamma at least this large.
    """
    _positive("epsilon", epsilon)
    _probability("delta", delta)
    _positive_int("rounds", rounds)
    order = 1.0 + 2.0 * math.log(1.0 / delta) / epsilon
    budget = epsilon / (2.0 * rounds)
    return _largest_meeting(
        lambda g: bnn_rdp_closed_form(gamma=g, order=order), target=budget, low=0.0, high=0.5 - 1e-12
    )


# --------------------------------------------------------------------------------------
# Laplace (MindSpore Federated inference-result protection)
# --------------------------------------------------------------------------------------


def laplace_scale(*, sensitivity: float, epsilon: float) -> float:
    """Laplace scale ``b = sensitivity / epsilon``."""
    _positive("sensitivity", sensitivity)
    _positive("epsilon", epsilon)
    return sensitivity / epsilon


def laplace_epsilon_for_tail(*, tau: float, probability: float, sensitivity: float) -> float:
    """Epsilon whose Laplace noise stays below ``tau`` in magnitude with ``probability``.

    ``P(|X| <= tau) = 1 - exp(-tau / b) = p`` gives ``b = tau / ln(1 / (1 - p))``
    and ``epsilon = sensitivity / b``. The MindSpore document's example
    (tau = 1e-5, p = 0.9, sensitivity 1) gives ``ln(10) / 1e-5 ~ 2.3e5``; the
    correct sensitivity of probability vectors, 2, doubles it.
    """
    _positive("tau", tau)
    _probability("probability", probability)
    _positive("sensitivity", sensitivity)
    return sensitivity * math.log(1.0 / (1.0 - probability)) / tau


# --------------------------------------------------------------------------------------
# DP-FedAvg and searches against the accountant
# --------------------------------------------------------------------------------------


def gaussian_epsilon(
    *, noise_multiplier: float, sampling_rate: float, rounds: int, delta: float, method: str = "rdp"
) -> float:
    """Epsilon of ``rounds`` Gaussian releases, Poisson-sampled when ``sampling_rate < 1``."""
    _positive("noise_multiplier", noise_multiplier)
    _positive_int("rounds", rounds)
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate!r}")
    mechanism = (
        Gaussian(noise_multiplier) if sampling_rate == 1 else SampledGaussian(noise_multiplier, sampling_rate)
    )
    return compose_epsilon({mechanism: rounds}, delta=delta, method=method).epsilon


def dp_fedavg_noise_multiplier(
    *, epsilon: float, delta: float, sampling_rate: float, rounds: int, method: str = "rdp"
) -> float:
    """Smallest noise multiplier z whose run of ``rounds`` releases meets (epsilon, delta).

    The search evaluates the accountant's own composition and returns the upper
    end of the final bracket, so the reported epsilon never exceeds the target.
    """
    _positive("epsilon", epsilon)
    _probability("delta", delta)

    def eps_of(z: float) -> float:
        return gaussian_epsilon(
            noise_multiplier=z, sampling_rate=sampling_rate, rounds=rounds, delta=delta, method=method
        )

    high = 1.0
    while eps_of(high) > epsilon:
        high *= 2.0
        if high > 1e6:
            raise ValueError(f"no noise multiplier <= 1e6 reaches epsilon={epsilon}")
    low = 0.0
    while high - low > 1e-4 * high:
        middle = 0.5 * (low + high)
        if eps_of(middle) > epsilon:
            low = middle
        else:
            high = middle
    return high


def randomized_response_epsilon_per_label(
    *, total_epsilon: float, delta: float, labels: int, num_classes: int, method: str = "rdp"
) -> float:
    """Largest per-label epsilon whose ``labels`` randomized-response reports meet the total.

    Used to calibrate a run so that the worst client's cumulative epsilon, from
    the accountant, is at most ``total_epsilon``.
    """
    _positive("total_epsilon", total_epsilon)
    _positive_int("labels", labels)
    return _largest_meeting(
        lambda e: (
            compose_epsilon({RandomizedResponse(e, num_classes): labels}, delta=delta, method=method).epsilon
        ),
        target=total_epsilon,
        low=0.0,
        high=max(total_epsilon, 1.0) * 2.0,
        floor=1e-9,
    )


def _largest_meeting(
    function: Callable[[float], float],
    *,
    target: float,
    low: float,
    high: float,
    floor: float = 0.0,
    iterations: int = 60,
) -> float:
    """Largest x in [low, high] with ``function(x) <= target``, for increasing ``function``.

    Returns the lower end of the final bracket (the safe side).
    """
    low_x = max(low, floor)
    if function(low_x) > target:
        raise ValueError(f"even the smallest parameter {low_x} exceeds the target {target}")
    if function(high) <= target:
        return high
    for _ in range(iterations):
        middle = 0.5 * (low_x + high)
        if function(middle) <= target:
            low_x = middle
        else:
            high = middle
    return low_x
