"""RDP curves computed array-at-a-time: the Poisson-subsampled Gaussian, and the Skellam mechanism.

The same computation as Google's dp-accounting 0.6.0
(``dp_accounting.rdp.rdp_privacy_accountant._compute_rdp_poisson_subsampled_gaussian``),
term for term and in the same order, with numpy arrays instead of one Python call per term:
Mironov, Talwar, Zhang, "Renyi Differential Privacy of the Sampled Gaussian Mechanism",
arXiv:1908.10530, 2019, Section 3.2 (integer orders: the binomial expansion of ``A_alpha``) and
Section 3.3 (fractional orders: the two series ``A_alpha = A_0 + A_1``, summed until both terms
decrease and are 30 nats below the running total, at most 1000 terms). The RDP at order alpha is
``log(A_alpha) / (alpha - 1)``.

Why: dp-accounting spends about 0.24 s on one mechanism's curve over
:data:`~fl_app.privacy.composition.RDP_ORDERS` (orders up to 16384 are loops of up to 16385 scalar
calls), and a calibration evaluates a dozen curves per client. KD-DP calibrates every client's
DP-SGD for its own sampling rate and steps: at N = 1000 that took 306 s before the first round.
``tests/test_privacy_accounting.py`` checks this module against dp-accounting bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy import special

from fl_app.privacy.checks import require_positive

#: dp-accounting's cap on the terms of the fractional-order series.
MAX_TERMS_FRACTIONAL = 1000
#: Terms of the fractional-order series computed per step (the series usually ends within a few dozen).
CHUNK = 256


def _log_comb(n: float, k: np.ndarray) -> np.ndarray:
    """``log C(n, k)`` through log-gamma, as dp-accounting computes it (no sign for fractional n)."""
    return special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1)


def _sequential_log_sum(terms: np.ndarray) -> float:
    """``log(sum(exp(terms)))`` folded left to right, one log-add per term, as dp-accounting adds them.

    ``numpy.logaddexp`` computes ``high + log1p(exp(low - high))``, dp-accounting's ``_log_add``
    ``log1p(exp(low - high)) + high``: the same floating-point operations.
    """
    return float(np.logaddexp.accumulate(np.concatenate(([-np.inf], terms)))[-1])


def log_a_integer(q: float, sigma: float, alpha: int) -> float:
    """``log(A_alpha)`` for an integer order (Mironov et al. 2019, Section 3.2), ``0 < q < 1``."""
    i = np.arange(alpha + 1, dtype=np.float64)
    coefficients = _log_comb(alpha, i) + i * math.log(q) + (alpha - i) * math.log1p(-q)
    return _sequential_log_sum(coefficients + (i * i - i) / (2 * (sigma**2)))


def _log_erfc(x: np.ndarray) -> np.ndarray:
    return math.log(2) + special.log_ndtr(-x * 2**0.5)


def log_a_fractional(q: float, sigma: float, alpha: float) -> float:
    """``log(A_alpha)`` for a fractional order (Mironov et al. 2019, Section 3.3), ``0 < q < 1``.

    Returns ``inf`` when the series has not converged after :data:`MAX_TERMS_FRACTIONAL` terms
    (dp-accounting then excludes the order from the conversion; so does an infinite RDP).
    """
    z0 = sigma**2 * math.log(1 / q - 1) + 0.5
    log1mq = math.log1p(-q)
    log_q = math.log(q)
    log_a0 = log_a1 = -np.inf
    last_s0 = last_s1 = -np.inf
    for start in range(0, MAX_TERMS_FRACTIONAL, CHUNK):
        i = np.arange(start, min(start + CHUNK, MAX_TERMS_FRACTIONAL), dtype=np.float64)
        log_coef = _log_comb(alpha, i)
        j = alpha - i
        log_t0 = log_coef + i * log_q + j * log1mq
        log_t1 = log_coef + j * log_q + i * log1mq
        log_e0 = math.log(0.5) + _log_erfc((i - z0) / (math.sqrt(2) * sigma))
        log_e1 = math.log(0.5) + _log_erfc((z0 - j) / (math.sqrt(2) * sigma))
        log_s0 = log_t0 + (i * i - i) / (2 * (sigma**2)) + log_e0
        log_s1 = log_t1 + (j * j - j) / (2 * (sigma**2)) + log_e1
        # the running sums after each term, folded left to right as dp-accounting adds them
        running_a0 = np.logaddexp.accumulate(np.concatenate(([log_a0], log_s0)))[1:]
        running_a1 = np.logaddexp.accumulate(np.concatenate(([log_a1], log_s1)))[1:]
        totals = np.logaddexp(running_a0, running_a1)
        previous_s0 = np.concatenate(([last_s0], log_s0[:-1]))
        previous_s1 = np.concatenate(([last_s1], log_s1[:-1]))
        done = (log_s0 < previous_s0) & (log_s1 < previous_s1) & (np.maximum(log_s0, log_s1) < totals - 30)
        if done.any():
            return float(totals[int(np.argmax(done))])
        log_a0, log_a1 = float(running_a0[-1]), float(running_a1[-1])
        last_s0, last_s1 = float(log_s0[-1]), float(log_s1[-1])
    return math.inf


def poisson_subsampled_gaussian_rdp(
    *, q: float, noise_multiplier: float, orders: Sequence[float]
) -> np.ndarray:
    """RDP of one use of the Poisson-subsampled Gaussian at each order (add or remove one element).

    Parameters
    ----------
    q : float
        Sampling rate in [0, 1].
    noise_multiplier : float
        Noise standard deviation over the L2 sensitivity (>= 0).
    orders : Sequence[float]
        Renyi orders > 1.

    Returns
    -------
    np.ndarray
        The RDP at each order (``inf`` where it is unbounded or its series did not converge).

    """
    if not 0 <= q <= 1:
        raise ValueError(f"Sampling rate must be in [0, 1]. Found {q}.")
    if noise_multiplier < 0:
        raise ValueError(f"Noise multiplier must be non-negative: {noise_multiplier}")

    def one(alpha: float) -> float:
        if q == 0:
            return 0
        if np.isinf(alpha) or noise_multiplier == 0:
            return np.inf
        if q == 1.0:
            return alpha / (2 * noise_multiplier**2)
        if float(alpha).is_integer():
            log_a = log_a_integer(q, noise_multiplier, int(alpha))
        else:
            log_a = log_a_fractional(q, noise_multiplier, alpha)
        return log_a / (alpha - 1)

    return np.array([one(alpha) for alpha in orders])


def skellam_rdp(
    *, orders: np.ndarray, variance: float, l1_sensitivity: float, l2_sensitivity: float
) -> np.ndarray:
    """Renyi DP of the multi-dimensional Skellam mechanism at each order (integer domain).

    Agarwal, Kairouz, Liu 2021 (the RDP bound of the Skellam mechanism for an integer query of L1
    sensitivity ``Delta_1`` and L2 sensitivity ``Delta_2`` with Skellam noise of variance ``mu``):
    ``alpha Delta_2^2 / (2 mu) + min(((2 alpha - 1) Delta_2^2 + 6 Delta_1) / (4 mu^2),
    3 Delta_1 / (2 mu))``. The bound is stated for integer orders: other orders get ``inf``
    (never chosen by the conversion).
    """
    require_positive("variance", variance)
    alpha = np.asarray(orders, dtype=np.float64)
    mu, l1, l2 = float(variance), float(l1_sensitivity), float(l2_sensitivity)
    correction = np.minimum(((2.0 * alpha - 1.0) * l2**2 + 6.0 * l1) / (4.0 * mu**2), 3.0 * l1 / (2.0 * mu))
    rdp = alpha * l2**2 / (2.0 * mu) + correction
    return np.where((alpha == np.floor(alpha)) & (alpha > 1), rdp, np.inf)
