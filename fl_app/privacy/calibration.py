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
from collections.abc import Callable, Iterable, Sequence

import dp_accounting as dpa

from fl_app.privacy.checks import require_positive, require_positive_int, require_probability
from fl_app.privacy.composition import History, compose_epsilon
from fl_app.privacy.events import (
    BinaryRandomizedResponse,
    Gaussian,
    RandomizedResponse,
    SampledGaussian,
    TreeAggregation,
)

CLASSIC_GAUSSIAN_MAX_EPSILON = 1.0


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
# PrivateKT (Lemma 1, Eq. 6)
# --------------------------------------------------------------------------------------


def privatekt_keep_probability(*, epsilon: float, k: int, num_classes: int) -> float:
    """``beta = (e^(eps/K) - 1) / (e^(eps/K) - 1 + C)`` (PrivateKT Lemma 1, Eq. 6).

    With this beta, each of the K reported labels is ``eps/K``-LDP and the
    whole report of K labels is ``eps``-LDP (basic composition over K).
    """
    require_positive("epsilon", epsilon)
    require_positive_int("k", k)
    require_positive_int("num_classes", num_classes)
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    expm1 = math.expm1(epsilon / k)
    return expm1 / (expm1 + num_classes)


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
    require_positive("epsilon", epsilon)
    require_positive_int("k", k)
    require_positive_int("num_classes", num_classes)
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
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


# --------------------------------------------------------------------------------------
# DPFL-BNN (Liu et al. 2023, Theorem 1)
# --------------------------------------------------------------------------------------


def binary_rr_epsilon(
    *, gamma: float, delta: float, rounds: int, bits_per_round: int = 1, method: str = "rdp"
) -> float:
    """Epsilon of ``rounds * bits_per_round`` uses of RR_gamma (accountant composition)."""
    require_positive_int("rounds", rounds)
    require_positive_int("bits_per_round", bits_per_round)
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
    require_positive("epsilon", epsilon)
    require_probability("delta", delta)
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
    require_positive("epsilon", epsilon)
    require_probability("delta", delta)
    require_positive_int("rounds", rounds)
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
    require_positive("sensitivity", sensitivity)
    require_positive("epsilon", epsilon)
    return sensitivity / epsilon


def laplace_epsilon_for_tail(*, tau: float, probability: float, sensitivity: float) -> float:
    """Epsilon whose Laplace noise stays below ``tau`` in magnitude with ``probability``.

    ``P(|X| <= tau) = 1 - exp(-tau / b) = p`` gives ``b = tau / ln(1 / (1 - p))``
    and ``epsilon = sensitivity / b``. The MindSpore document's example
    (tau = 1e-5, p = 0.9, sensitivity 1) gives ``ln(10) / 1e-5 ~ 2.3e5``; the
    correct sensitivity of probability vectors, 2, doubles it.
    """
    require_positive("tau", tau)
    require_probability("probability", probability)
    require_positive("sensitivity", sensitivity)
    return sensitivity * math.log(1.0 / (1.0 - probability)) / tau


#: L1 sensitivity of a probability vector (e.g. one softmax output) when its input is replaced:
#: ``||p - q||_1 <= ||p||_1 + ||q||_1 = 2``, attained by ``(1, 0, ...)`` and ``(0, 1, ...)``.
#: The MindSpore document states 1.
PROBABILITY_VECTOR_L1_SENSITIVITY = 2.0


def laplace_epsilon_for_scale(*, scale: float, sensitivity: float) -> float:
    """Epsilon that Laplace noise of scale ``b`` gives a query of L1 ``sensitivity``: ``sensitivity / b``.

    Used to report the guarantee noise actually delivers when it was calibrated
    with another sensitivity: noise calibrated as ``Laplace(1 / epsilon)`` (the
    document's sensitivity 1) on probability vectors (true sensitivity 2) gives
    ``2 * epsilon``, not ``epsilon``.
    """
    require_positive("scale", scale)
    require_positive("sensitivity", sensitivity)
    return sensitivity / scale


def laplace_epsilon_per_report(*, budget: float, reports: int) -> float:
    """Per-report Laplace epsilon whose ``reports`` uses by one client stay within ``budget``.

    Basic (sequential) composition of pure Laplace releases (Dwork & Roth 2014,
    Theorem 3.16): ``reports * epsilon <= budget``, an (epsilon, 0) bound, so
    adding it to any (epsilon_train, delta) training guarantee keeps delta.
    For the clustering evaluation (MindSpore's inference-result protection)
    ``reports`` is the largest number of softmax vectors one client may upload
    over the run: its number of examples times the evaluation rounds, because
    one client's data set determines all of its vectors (client-level unit).

    Parameters
    ----------
    budget : float
        The evaluation's share of the per-client epsilon (> 0).
    reports : int
        Laplace releases charged to the worst client (>= 1).

    Returns
    -------
    float
        ``budget / reports``.

    """
    require_positive("budget", budget)
    require_positive_int("reports", reports)
    return budget / reports


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
        done=lambda bad, good: good - bad <= relative_width * good,
    )


def dp_fedavg_noise_multiplier(
    *, epsilon: float, delta: float, sampling_rate: float, rounds: int, method: str = "rdp"
) -> float:
    """Smallest noise multiplier z whose run of ``rounds`` releases meets (epsilon, delta).

    The search evaluates the accountant's own composition and returns the upper
    end of the final bracket, so the reported epsilon never exceeds the target.
    """
    require_positive("epsilon", epsilon)
    require_probability("delta", delta)

    def eps_of_method(chosen: str) -> Callable[[float], float]:
        def eps_of(z: float) -> float:
            return gaussian_epsilon(
                noise_multiplier=z, sampling_rate=sampling_rate, rounds=rounds, delta=delta, method=chosen
            )

        return eps_of

    rdp = smallest_noise_multiplier(eps_of_method("rdp"), epsilon=epsilon)
    if method == "rdp":
        return rdp
    return smallest_noise_multiplier(eps_of_method(method), epsilon=epsilon, start=rdp)


def randomized_response_epsilon_per_label(
    *, total_epsilon: float, delta: float, labels: int, num_classes: int, method: str = "rdp"
) -> float:
    """Largest per-label epsilon whose ``labels`` randomized-response reports meet the total.

    Used to calibrate a run so that the worst client's cumulative epsilon, from
    the accountant, is at most ``total_epsilon``.
    """
    require_positive("total_epsilon", total_epsilon)
    require_positive_int("labels", labels)
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
    ``dp_sgd_epsilon(z, method=method) <= epsilon`` always holds. Results are cached per argument tuple.
    """
    require_positive("epsilon", epsilon)
    require_probability("delta", delta)
    require_positive_int("steps", steps)
    if not 0 < sampling_rate <= 1:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate!r}")
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be in (0, 1), got {tolerance!r}")
    key = (float(epsilon), float(delta), float(sampling_rate), int(steps), float(tolerance), method)
    if key in _DP_SGD_CACHE:
        return _DP_SGD_CACHE[key]

    def meets_under(chosen: str) -> Callable[[float], bool]:
        def meets(z: float) -> bool:
            spent = dp_sgd_epsilon(
                noise_multiplier=z, sampling_rate=sampling_rate, steps=int(steps), delta=delta, method=chosen
            )
            return spent <= epsilon

        return meets

    meets = meets_under("rdp")
    if meets(1.0):  # the bracket: halve from 1 while the target is still met
        good = 1.0
        while meets(good / 2.0):
            good /= 2.0
            if good < 1e-6:
                _DP_SGD_CACHE[key] = good
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
        result = _narrow_below(meets_under(method), good=result, tolerance=tolerance)
    _DP_SGD_CACHE[key] = result
    return result


def _narrow_below(meets: Callable[[float], bool], *, good: float, tolerance: float) -> float:
    """The smallest z <= ``good`` that meets (``meets(good)`` holds), to relative ``tolerance``.

    Tighter bounds than the one ``good`` was found with need less noise, rarely less than 20 %
    less: the bracket starts at ``0.8 good`` and steps down by that factor while it still meets.
    """
    bad = 0.8 * good
    while meets(bad):
        good, bad = bad, 0.8 * bad
        if bad < 1e-6:
            return good
    return bisect(meets, bad=bad, good=good, done=lambda bad, good: good - bad <= tolerance * good)


# --------------------------------------------------------------------------------------
# Searches over whole histories (the worst participant of a public schedule)
# --------------------------------------------------------------------------------------


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
    """
    require_positive("epsilon", epsilon)
    require_probability("delta", delta)

    def eps_of_method(chosen: str) -> Callable[[float], float]:
        def eps_of(z: float) -> float:
            spent = [compose_epsilon(h, delta=delta, method=chosen).epsilon for h in histories_of(z)]
            if not spent:
                raise ValueError("histories_of returned no history")
            return max(spent)

        return eps_of

    rdp = smallest_noise_multiplier(eps_of_method("rdp"), epsilon=epsilon)
    if method == "rdp":
        return rdp
    return smallest_noise_multiplier(eps_of_method(method), epsilon=epsilon, start=rdp)


# --------------------------------------------------------------------------------------
# Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021)
# --------------------------------------------------------------------------------------


def adaptive_clipping_default_bit_noise(*, expected_clients: float) -> float:
    """The paper's default std of the noise on the clipped-count sum: ``sigma_b = m / 20``.

    ``m`` is the expected number of clients per round; the noisy fraction then
    has std 0.05 (Andrew et al. 2021, Section 3).
    """
    require_positive("expected_clients", expected_clients)
    return expected_clients / 20.0


def adaptive_clipping_effective_noise_multiplier(
    *, update_noise_multiplier: float, bit_noise: float
) -> float:
    """``z = (z_Delta^-2 + (2 sigma_b)^-2)^(-1/2)`` (Andrew et al. 2021, Theorem 1).

    One round releases the noised sum of updates clipped to C (noise std
    ``z_Delta C``, sensitivity C) and the noised sum of the centred bits
    ``b_k - 1/2`` (noise std ``sigma_b``, sensitivity 1/2): jointly the Gaussian
    mechanism with noise multiplier ``z`` (add or remove one client).
    """
    require_positive("update_noise_multiplier", update_noise_multiplier)
    require_positive("bit_noise", bit_noise)
    return (update_noise_multiplier**-2 + (2.0 * bit_noise) ** -2) ** -0.5


def adaptive_clipping_update_noise_multiplier(*, noise_multiplier: float, bit_noise: float) -> float:
    """``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)``: the update noise that makes the round's release ``z``.

    Inverse of :func:`adaptive_clipping_effective_noise_multiplier`. Possible
    only when ``z < 2 sigma_b`` (the bit release alone must already be at least
    as private as the whole round); raises ``ValueError`` otherwise.
    """
    require_positive("noise_multiplier", noise_multiplier)
    require_positive("bit_noise", bit_noise)
    if noise_multiplier >= 2.0 * bit_noise:
        raise ValueError(
            f"noise_multiplier={noise_multiplier} needs bit_noise > {noise_multiplier / 2} "
            f"(z < 2 sigma_b), got {bit_noise}"
        )
    return (noise_multiplier**-2 - (2.0 * bit_noise) ** -2) ** -0.5


# --------------------------------------------------------------------------------------
# Tree aggregation (DP-FTRL, Kairouz, McMahan, Song, Thakkar, Thakurta, Xu, ICML 2021)
# --------------------------------------------------------------------------------------


def tree_aggregation_epsilon(
    *, noise_multiplier: float, tree_steps: Sequence[int], delta: float, method: str = "rdp"
) -> float:
    """Epsilon of one participation in each tree of ``tree_steps`` leaves (TreeRestart composition)."""
    require_positive("noise_multiplier", noise_multiplier)
    if not tree_steps:
        raise ValueError("tree_steps must name at least one tree")
    history: dict[TreeAggregation, int] = {}
    for steps in tree_steps:
        require_positive_int("tree_steps", steps)
        mechanism = TreeAggregation(noise_multiplier, int(steps))
        history[mechanism] = history.get(mechanism, 0) + 1
    return compose_epsilon(history, delta=delta, method=method).epsilon


def tree_aggregation_noise_multiplier(
    *, epsilon: float, delta: float, tree_steps: Sequence[int], method: str = "rdp"
) -> float:
    """Smallest per-node noise multiplier whose trees (one participation each) meet (epsilon, delta).

    DP-FTRL (Kairouz et al. 2021): a participant contributing to at most one
    leaf of each tree of ``tree_steps`` leaves. Searched against the
    accountant's composition (:func:`noise_multiplier_for_histories`).
    """
    if not tree_steps:
        raise ValueError("tree_steps must name at least one tree")
    for steps in tree_steps:
        require_positive_int("tree_steps", steps)

    def histories_of(z: float) -> list[History]:
        history: dict[TreeAggregation, int] = {}
        for steps in tree_steps:
            mechanism = TreeAggregation(z, int(steps))
            history[mechanism] = history.get(mechanism, 0) + 1
        return [history]

    return noise_multiplier_for_histories(
        epsilon=epsilon, delta=delta, histories_of=histories_of, method=method
    )


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
