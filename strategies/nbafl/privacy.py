"""NbAFL's noise: uplink and downlink calibration (Wei et al., IEEE TIFS 2020).

Lemma 1 and Theorem 1, the K-random scheduling theorem, the units a budget can be stated in
(:data:`NBAFL_UNITS`: the proven client level, or the document's record-level reading).
"""

from __future__ import annotations

import math

from fl_app.privacy.calibration import (
    analytic_gaussian_sigma,
    classic_gaussian_constant,
    classic_gaussian_sigma,
    dp_fedavg_noise_multiplier,
)
from fl_app.privacy.checks import require_positive, require_positive_int

# --------------------------------------------------------------------------------------
# NbAFL (Wei et al., IEEE TIFS 2020)
# --------------------------------------------------------------------------------------

NBAFL_CALIBRATIONS: tuple[str, ...] = ("classic", "analytic", "accountant")
NBAFL_AMPLIFICATIONS: tuple[str, ...] = ("two_sided", "document")
#: What ``privacy.epsilon`` is calibrated for: ``client`` (one client's whole data set, sensitivity
#: 2C: proven for the implemented training), or the document's record-level reading
#: (``document_record``, sensitivity 2C/m: holds only if a client's upload is an average of
#: per-record terms of norm <= C, which multi-step SGD does not satisfy).
NBAFL_UNITS: tuple[str, ...] = ("client", "document_record")


def nbafl_unit_sensitivity(*, unit: str, clip: float, min_dataset_size: int) -> float:
    """The L2 sensitivity of one upload for a budget in ``unit`` (:data:`NBAFL_UNITS`)."""
    if unit == "client":
        return nbafl_client_sensitivity(clip=clip)
    if unit == "document_record":
        return nbafl_sensitivity(clip=clip, min_dataset_size=min_dataset_size)
    raise ValueError(f"unit must be one of {NBAFL_UNITS}, got {unit!r}")


def nbafl_sensitivity(*, clip: float, min_dataset_size: int) -> float:
    """NbAFL's uplink sensitivity ``Delta s_U = 2C / m`` (one record of the smallest client)."""
    require_positive("clip", clip)
    require_positive_int("min_dataset_size", min_dataset_size)
    return 2.0 * clip / min_dataset_size


def nbafl_client_sensitivity(*, clip: float) -> float:
    """L2 distance of any two parameter vectors clipped to norm ``C``: ``2C`` (client-level unit)."""
    require_positive("clip", clip)
    return 2.0 * clip


def nbafl_uplink_sigma(
    *,
    epsilon: float,
    delta: float,
    clip: float,
    min_dataset_size: int,
    exposures: int,
    calibration: str = "classic",
    method: str = "rdp",
    unit: str = "document_record",
) -> float:
    """Uplink noise ``sigma_U = c L Delta s_U / epsilon`` for a budget ``epsilon`` in ``unit``.

    ``Delta s_U`` is the unit's sensitivity (:func:`nbafl_unit_sensitivity`): the document's
    ``2C/m`` (``unit="document_record"``) or ``2C`` (``unit="client"``, one client's data set: the
    guarantee that holds for multi-step local SGD). Each of a client's at most ``L`` uploads gets
    budget ``epsilon / L``. With
    ``calibration="classic"`` this is the document's formula (proven only for
    ``epsilon / L < 1``; outside it a :class:`ClassicGaussianRangeWarning` is
    issued); ``"analytic"`` uses the exact analytic Gaussian for
    ``(epsilon / L, delta)`` per exposure instead. Both split the budget by
    basic composition, which strictly gives ``(epsilon, L delta)`` after ``L``
    uploads. ``"accountant"`` returns the smallest sigma whose ``L``-fold
    composition, computed by :func:`~fl_app.privacy.composition.compose_epsilon`
    with ``method``, meets ``(epsilon, delta)`` itself.
    """
    require_positive_int("exposures", exposures)
    require_positive("epsilon", epsilon)
    sensitivity = nbafl_unit_sensitivity(unit=unit, clip=clip, min_dataset_size=min_dataset_size)
    per_exposure = epsilon / exposures
    if calibration == "classic":
        return classic_gaussian_sigma(
            sensitivity=sensitivity, epsilon=per_exposure, delta=delta, strict=False
        )
    if calibration == "analytic":
        return analytic_gaussian_sigma(sensitivity=sensitivity, epsilon=per_exposure, delta=delta)
    if calibration == "accountant":
        multiplier = dp_fedavg_noise_multiplier(
            epsilon=epsilon, delta=delta, sampling_rate=1.0, rounds=exposures, method=method
        )
        return multiplier * sensitivity
    raise ValueError(f"calibration must be one of {NBAFL_CALIBRATIONS}, got {calibration!r}")


def nbafl_round_epsilon(
    *, epsilon: float, num_rounds: int, num_clients: int, clients_per_round: int, amplification: str
) -> float:
    """Per-broadcast budget ``epsilon_K`` of the K scheduled clients' aggregate (K-random scheduling).

    The broadcast budget per round is ``epsilon / T``. A client is in a round's
    sample with probability ``q = K/N``, so a mechanism that is
    ``epsilon_K``-DP on the sample is ``epsilon / T``-DP on the population when

    * ``"two_sided"`` (default): ``epsilon / T = ln(1 + q (e^{epsilon_K} - 1))``,
      the standard amplification-by-subsampling bound, which holds in both
      directions of the neighbouring relation; so
      ``epsilon_K = ln(1 + (e^{epsilon/T} - 1) / q)``;
    * ``"document"``: ``epsilon / T = -ln(1 - q + q e^{-epsilon_K})``, the form
      behind the document's ``b`` (``epsilon_K = b epsilon / T`` with
      ``b = -(T/epsilon) ln(1 - N/K + (N/K) e^{-epsilon/T})``). It bounds only
      one direction of the likelihood ratio and is smaller than the two-sided
      bound, i.e. it allows less noise than a proven guarantee needs. Returns
      ``inf`` when ``e^{-epsilon/T} <= 1 - q`` (any ``epsilon_K`` passes it).

    With ``K = N`` both give ``epsilon / T``.
    """
    require_positive("epsilon", epsilon)
    require_positive_int("num_rounds", num_rounds)
    require_positive_int("num_clients", num_clients)
    require_positive_int("clients_per_round", clients_per_round)
    if clients_per_round > num_clients:
        raise ValueError(f"clients_per_round={clients_per_round} exceeds num_clients={num_clients}")
    per_round = epsilon / num_rounds
    if clients_per_round == num_clients:
        return per_round
    q = clients_per_round / num_clients
    if amplification == "two_sided":
        # ln(1 + (e^y - 1)/q) = y - ln q + ln(q + (1 - q)(1 - e^{-y})), stable for every y > 0.
        return per_round - math.log(q) + math.log(q - (1.0 - q) * math.expm1(-per_round))
    if amplification == "document":
        inner = math.expm1(-per_round) / q  # in (-1/q, 0)
        return math.inf if inner <= -1.0 else -math.log1p(inner)
    raise ValueError(f"amplification must be one of {NBAFL_AMPLIFICATIONS}, got {amplification!r}")


def nbafl_downlink_threshold(
    *, epsilon: float, exposures: int, num_clients: int, clients_per_round: int, amplification: str
) -> float:
    """Number of rounds above which NbAFL adds downlink noise: ``L sqrt(N)``, or ``epsilon / gamma``.

    ``T`` rounds need no downlink noise while the uplink noise, averaged over the
    K uploads, already gives each broadcast its budget: ``T <= L sqrt(N)`` with
    every client in every round (Theorem 1), ``T <= epsilon / gamma`` under
    K-random scheduling, with ``gamma = ln(1 + q (e^{epsilon/(L sqrt K)} - 1))``
    (``"two_sided"``) or the document's
    ``gamma = -ln(1 - K/N + (K/N) e^{-epsilon/(L sqrt K)})`` (``"document"``).
    """
    require_positive("epsilon", epsilon)
    require_positive_int("exposures", exposures)
    require_positive_int("num_clients", num_clients)
    require_positive_int("clients_per_round", clients_per_round)
    if clients_per_round > num_clients:
        raise ValueError(f"clients_per_round={clients_per_round} exceeds num_clients={num_clients}")
    if clients_per_round == num_clients:
        return exposures * math.sqrt(num_clients)
    q = clients_per_round / num_clients
    x = epsilon / (exposures * math.sqrt(clients_per_round))
    if amplification == "two_sided":
        gamma = x + math.log(q) + math.log1p((1.0 - q) * math.exp(-x) / q)  # ln(1 - q + q e^x)
    elif amplification == "document":
        gamma = -math.log1p(q * math.expm1(-x))
    else:
        raise ValueError(f"amplification must be one of {NBAFL_AMPLIFICATIONS}, got {amplification!r}")
    return epsilon / gamma


def nbafl_downlink_sigma(
    *,
    epsilon: float,
    delta: float,
    clip: float,
    min_dataset_size: int,
    exposures: int,
    num_rounds: int,
    num_clients: int,
    clients_per_round: int | None = None,
    amplification: str = "two_sided",
) -> float:
    """Downlink noise ``sigma_D = 2cC sqrt(T^2 - L^2 N) / (m N epsilon)`` if ``T > L sqrt(N)``, else 0.

    NbAFL's Theorem 1 for the broadcast aggregate (uniform weights ``p_i = 1/N``):
    the uplink noise already protects the aggregate when ``T <= L sqrt(N)``.

    With K-random scheduling (``clients_per_round = K < N``) the document's
    theorem for K clients gives
    ``sigma_D = 2cC sqrt(T^2/b^2 - L^2 K) / (m K epsilon)`` if ``T > epsilon / gamma``,
    else 0, where ``T / b = epsilon / epsilon_K`` (:func:`nbafl_round_epsilon`)
    and ``epsilon / gamma`` is :func:`nbafl_downlink_threshold`; ``amplification``
    chooses the document's one-sided ``b, gamma`` or the two-sided bound. With
    ``K = N`` (or ``None``) this is Theorem 1 exactly (integer test ``T^2 > L^2 N``).
    """
    require_positive("epsilon", epsilon)
    require_positive("clip", clip)
    require_positive_int("min_dataset_size", min_dataset_size)
    require_positive_int("exposures", exposures)
    require_positive_int("num_rounds", num_rounds)
    require_positive_int("num_clients", num_clients)
    c = classic_gaussian_constant(delta=delta)
    k = num_clients if clients_per_round is None else clients_per_round
    require_positive_int("clients_per_round", k)
    if k > num_clients:
        raise ValueError(f"clients_per_round={k} exceeds num_clients={num_clients}")
    if k == num_clients:
        excess = num_rounds**2 - exposures**2 * num_clients
        if excess <= 0:
            return 0.0
        return 2.0 * c * clip * math.sqrt(excess) / (min_dataset_size * num_clients * epsilon)
    threshold = nbafl_downlink_threshold(
        epsilon=epsilon,
        exposures=exposures,
        num_clients=num_clients,
        clients_per_round=k,
        amplification=amplification,
    )
    if num_rounds <= threshold:
        return 0.0
    round_epsilon = nbafl_round_epsilon(
        epsilon=epsilon,
        num_rounds=num_rounds,
        num_clients=num_clients,
        clients_per_round=k,
        amplification=amplification,
    )
    effective_rounds = epsilon / round_epsilon  # T / b
    excess = max(effective_rounds**2 - exposures**2 * k, 0.0)
    return 2.0 * c * clip * math.sqrt(excess) / (min_dataset_size * k * epsilon)
