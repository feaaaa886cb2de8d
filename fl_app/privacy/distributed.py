"""Distributed DP with secure aggregation: the Skellam mechanism on modular integer vectors.

Agarwal, Kairouz, Liu, "The Skellam Mechanism for Differentially Private Federated Learning",
NeurIPS 2021, with the encoding of Kairouz, Liu, Steinke, "The Distributed Discrete Gaussian
Mechanism for Federated Learning with Secure Aggregation", ICML 2021 (their Algorithm 1 and
Section 4; TensorFlow Federated's distributed-DP sum implements the same pipeline). Each client:

1. clips its update ``x`` to L2 norm ``c``;
2. pads it with zeros to ``d = 2^k`` and rotates it with the randomized Hadamard transform
   ``H D x`` (``D`` random signs from a public per-round seed; ``H`` orthonormal, so the norm is
   kept and the coordinates are flattened);
3. scales it by ``s`` and rounds each coordinate randomly to an integer (up with probability the
   fractional part), repeating until the rounded vector's norm is at most
   ``Delta_2 = min(cs + sqrt(d), sqrt((cs)^2 + d/4 + sqrt(2 ln(1/beta)) (cs + sqrt(d)/2)))``
   (conditional randomized rounding, DDG paper Theorem 1 / Proposition 22);
4. adds Skellam noise ``Poisson(v/2) - Poisson(v/2)`` per coordinate (local variance ``v``);
5. reduces mod ``2^b``.

Secure aggregation reveals only the modular sum of the cohort's vectors. The sum of ``n``
survivors' noise is Skellam of variance ``n v`` (Skellam is closed under addition), so the sum is
the Skellam mechanism on an integer query of L2 sensitivity ``Delta_2`` and L1 sensitivity
``Delta_1 = Delta_2 min(sqrt(d), Delta_2)`` (integer coordinates: ``|v_i| <= v_i^2``) under
zero-out neighbours; its Renyi DP is :func:`fl_app.privacy.rdp.skellam_rdp`. The server maps the
modular sum to ``[-2^(b-1), 2^(b-1))``, divides by ``s`` and undoes the rotation (:func:`decode_modular_sum`).
A coordinate of the sum outside that range wraps around: an error in the model, not in privacy
(post-processing). :func:`plan_skellam` chooses ``s`` so that ``k`` standard deviations of a
coordinate of the sum fit in ``b`` bits (the papers' heuristic) and ``v`` so that the worst
client's epsilon meets the budget.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace

import numpy as np

from fl_app.privacy.calibration import bisect, smallest_noise_multiplier
from fl_app.privacy.checks import require_positive, require_probability
from fl_app.privacy.composition import compose_epsilon
from fl_app.privacy.events import Skellam

#: beta of conditional randomized rounding: the papers' and TensorFlow Federated's default e^-0.5.
DEFAULT_ROUNDING_BETA = math.exp(-0.5)


# ----------------------------------------------------------------------------- accounting


def rounded_l2_norm_bound(*, l2_norm: float, beta: float, dim: int) -> float:
    """The L2 bound conditional randomized rounding enforces on a vector of norm ``l2_norm``.

    DDG paper (Kairouz, Liu, Steinke 2021), Theorem 1: randomized rounding of a vector of norm
    ``a`` in ``d`` dimensions has norm at most ``sqrt(a^2 + d/4 + sqrt(2 ln(1/beta)) (a +
    sqrt(d)/2))`` with probability at least ``1 - beta``; it never exceeds ``a + sqrt(d)``.
    ``beta = 0``: only the sure bound.
    """
    require_positive("l2_norm", l2_norm)
    if not 0 <= beta < 1:
        raise ValueError(f"beta must be in [0, 1), got {beta!r}")
    sure = l2_norm + math.sqrt(dim)
    if beta == 0:
        return sure
    likely = (
        l2_norm**2 + 0.25 * dim + math.sqrt(2.0 * math.log(1.0 / beta)) * (l2_norm + 0.5 * math.sqrt(dim))
    )
    return min(sure, math.sqrt(likely))


def rounded_l1_norm_bound(*, l2_bound: float, dim: int) -> float:
    """L1 bound of an integer vector of L2 norm at most ``l2_bound``: ``l2 min(sqrt(d), l2)``."""
    return l2_bound * min(math.sqrt(dim), l2_bound)


@dataclass(frozen=True)
class SkellamPlan:
    """The parameters of one run of the distributed Skellam mechanism (see :func:`plan_skellam`).

    Attributes
    ----------
    clip : float
        ``c``: L2 bound of a client's update.
    bits : int
        ``b``: the modulus is ``2^b``.
    dim : int
        ``d``: the padded dimension (a power of 2).
    scale : float
        ``s``: the update is multiplied by it before rounding.
    l2_sensitivity, l1_sensitivity : float
        ``Delta_2`` (the bound rounding enforces) and ``Delta_1``, in the integer domain.
    local_variance : float
        ``v``: the Skellam variance each client adds per coordinate.
    survivors : int
        The fewest vectors a released sum may hold; the noise is calibrated for them.
    cohort : int
        The most vectors a sum may hold (the bits are sized for them).
    epsilon : float
        The worst client's epsilon over ``participations`` rounds (at most the target).

    """

    clip: float
    bits: int
    dim: int
    scale: float
    l2_sensitivity: float
    l1_sensitivity: float
    local_variance: float
    survivors: int
    cohort: int
    participations: int
    epsilon: float

    @property
    def mechanism(self) -> Skellam:
        """One round's mechanism for the clients of a released sum of at least ``survivors`` vectors."""
        return Skellam(
            variance=self.survivors * self.local_variance,
            l1_sensitivity=self.l1_sensitivity,
            l2_sensitivity=self.l2_sensitivity,
        )

    @property
    def gaussian_noise_multiplier(self) -> float:
        """The noise of the sum of ``survivors`` shares over the L2 bound: compare with DP-FedAvg's z."""
        return math.sqrt(self.survivors * self.local_variance) / self.l2_sensitivity

    def to_json(self) -> dict[str, float | int]:
        """JSON-ready fields (the results' privacy summary, the clients' train config)."""
        return {**asdict(self), "gaussian_noise_multiplier": self.gaussian_noise_multiplier}

    @classmethod
    def from_json(cls, data: dict[str, float | int]) -> SkellamPlan:
        """Inverse of :meth:`to_json` (derived fields are recomputed, not read)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


def bits_needed(
    *, clip: float, scale: float, local_variance: float, cohort: int, dim: int, k: float
) -> float:
    """Bits for ``k`` standard deviations of a coordinate of the sum of ``cohort`` vectors.

    The papers' heuristic (DDG paper Section 4.4; the rotation makes coordinates sub-Gaussian,
    flatness 1): a coordinate's variance is at most ``(c s)^2 n^2 / d`` (all updates aligned) plus
    ``n (1/4 + v)`` (rounding and noise), and ``2 k`` of its standard deviations must fit in ``2^b``.
    """
    variance = (clip * scale) ** 2 * cohort**2 / dim + cohort * (0.25 + local_variance)
    return math.log2(2.0 * k * math.sqrt(variance))


def plan_skellam(
    *,
    epsilon: float,
    delta: float,
    clip: float,
    bits: int,
    dim: int,
    survivors: int,
    cohort: int,
    participations: int,
    k: float = 3.0,
    beta: float = DEFAULT_ROUNDING_BETA,
) -> SkellamPlan:
    """The largest scale whose sum fits in ``bits``, with the smallest noise that meets the budget.

    For a scale ``s`` the rounding bound gives ``Delta_2`` and ``Delta_1``; the aggregate variance
    is the smallest ``(z Delta_2)^2`` for which ``participations`` uses of
    ``Skellam(variance, Delta_1, Delta_2)`` compose (by the project's accountant) to at most
    ``epsilon`` at ``delta``; the local variance is that over ``survivors``. A larger scale makes
    rounding relatively smaller (less noise for the same budget) but needs more bits, so the
    largest ``s`` with :func:`bits_needed` ``<= bits`` is chosen (bisection on ``log s``).
    Raises ``ValueError`` when even the smallest scale does not fit.
    """
    require_positive("epsilon", epsilon)
    require_probability("delta", delta)
    require_positive("clip", clip)
    if not 1 <= survivors <= cohort:
        raise ValueError(f"survivors must be in [1, cohort={cohort}], got {survivors!r}")
    if participations < 1:
        raise ValueError(f"participations must be >= 1, got {participations!r}")

    noise_at = functools.partial(
        skellam_variance_at,
        clip=clip,
        beta=beta,
        dim=dim,
        epsilon=epsilon,
        delta=delta,
        participations=participations,
    )
    scale = largest_skellam_scale(
        noise_at, bits=bits, clip=clip, survivors=survivors, cohort=cohort, dim=dim, k=k, epsilon=epsilon
    )
    aggregate, l1, l2 = noise_at(scale)
    plan = SkellamPlan(
        clip=clip,
        bits=int(bits),
        dim=int(dim),
        scale=scale,
        l2_sensitivity=l2,
        l1_sensitivity=l1,
        local_variance=aggregate / survivors,
        survivors=int(survivors),
        cohort=int(cohort),
        participations=int(participations),
        epsilon=math.nan,  # set below, from the plan's own mechanism
    )
    spent = compose_epsilon({plan.mechanism: participations}, delta=delta, method="rdp").epsilon
    return replace(plan, epsilon=spent)


def largest_skellam_scale(
    noise_at: Callable[[float], tuple[float, float, float]],
    *,
    bits: int,
    clip: float,
    survivors: int,
    cohort: int,
    dim: int,
    k: float,
    epsilon: float,
) -> float:
    """The largest scale ``s`` whose noised sum of ``cohort`` vectors fits in ``bits`` (bisects ``log s``).

    ``noise_at(s)`` is :func:`skellam_variance_at` at ``s`` for the budget (``epsilon`` only names it
    in the error); :func:`bits_needed` of the local variance over ``survivors`` must be ``<= bits``.
    Raises ``ValueError`` when even the smallest scale does not fit.
    """

    def bits_at(scale: float) -> float:
        aggregate, _, _ = noise_at(scale)
        return bits_needed(
            clip=clip, scale=scale, local_variance=aggregate / survivors, cohort=cohort, dim=dim, k=k
        )

    def fits(log_scale: float) -> bool:
        return bits_at(math.exp(log_scale)) <= bits

    low, high = math.log(1e-3 / clip), math.log(2.0**bits / clip)
    if not fits(low):
        least = bits_at(math.exp(low))
        raise ValueError(
            f"{bits} bits cannot hold the sum of {cohort} vectors of dimension {dim} with the noise "
            f"epsilon={epsilon:g} needs: at least {math.ceil(least)} bits (or a smaller cohort)"
        )
    return math.exp(bisect(fits, bad=high, good=low, done=lambda bad, good: abs(bad - good) < 1e-4))


def skellam_variance_at(
    scale: float, *, clip: float, beta: float, dim: int, epsilon: float, delta: float, participations: int
) -> tuple[float, float, float]:
    """The aggregate Skellam variance at scale ``s`` that meets the budget, with ``Delta_1`` and ``Delta_2``.

    Returns
    -------
    tuple[float, float, float]
        ``(z Delta_2)^2`` for the smallest ``z`` whose ``participations`` uses of
        ``Skellam((z Delta_2)^2, Delta_1, Delta_2)`` compose (RDP) to at most ``epsilon`` at
        ``delta``, then ``Delta_1`` and ``Delta_2`` of the rounded, scaled update.

    """
    l2 = rounded_l2_norm_bound(l2_norm=clip * scale, beta=beta, dim=dim)
    l1 = rounded_l1_norm_bound(l2_bound=l2, dim=dim)

    def eps_of(z: float) -> float:
        mechanism = Skellam(variance=(z * l2) ** 2, l1_sensitivity=l1, l2_sensitivity=l2)
        return compose_epsilon({mechanism: participations}, delta=delta, method="rdp").epsilon

    z = smallest_noise_multiplier(eps_of, epsilon=epsilon, relative_width=1e-6)
    return (z * l2) ** 2, l1, l2


# ----------------------------------------------------------------------------- the client's encoding


def padded_dimension(size: int) -> int:
    """The smallest power of 2 at least ``size`` (the Hadamard transform's length)."""
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size!r}")
    return 1 << (int(size) - 1).bit_length()


def rotation_signs(*, seed: int, dim: int) -> np.ndarray:
    """The diagonal ``D`` of the randomized Hadamard transform: ``dim`` signs from a public seed."""
    return np.where(np.random.default_rng(seed).random(dim) < 0.5, -1.0, 1.0)


def hadamard(vector: np.ndarray) -> np.ndarray:
    """The orthonormal Walsh-Hadamard transform ``H x / sqrt(d)`` (``H`` is its own inverse).

    Fast transform, ``d log d`` additions in ``log2 d`` vectorised butterfly passes.
    """
    dim = vector.shape[0]
    if dim & (dim - 1):
        raise ValueError(f"the length must be a power of 2, got {dim}")
    out = np.asarray(vector, dtype=np.float64)
    half = 1
    while half < dim:
        pairs = out.reshape(-1, 2, half)
        out = np.stack((pairs[:, 0] + pairs[:, 1], pairs[:, 0] - pairs[:, 1]), axis=1)
        half *= 2
    return out.reshape(dim) / math.sqrt(dim)


def rotate(vector: np.ndarray, *, signs: np.ndarray) -> np.ndarray:
    """``H D x``: zero-pad ``x`` to ``len(signs)`` and apply the randomized Hadamard transform."""
    padded = np.zeros(signs.shape[0])
    padded[: vector.shape[0]] = vector
    return hadamard(signs * padded)


def unrotate(vector: np.ndarray, *, signs: np.ndarray, size: int) -> np.ndarray:
    """Inverse of :func:`rotate`: ``D H y``, cut to the first ``size`` coordinates."""
    return (signs * hadamard(vector))[:size]


def conditional_randomized_rounding(
    values: np.ndarray, *, norm_bound: float, rng: np.random.Generator, max_tries: int = 1000
) -> np.ndarray:
    """Round each coordinate up with probability its fractional part, until the norm is at most the bound.

    Unbiased given acceptance up to the conditioning (DDG paper, Section 4.1); every accepted vector
    satisfies the bound the accounting assumes. Fails (``RuntimeError``) rather than return a vector
    above it after ``max_tries`` draws (each fails with probability at most beta).
    """
    floor = np.floor(values)
    fraction = values - floor
    for _ in range(max_tries):
        rounded = floor + (rng.random(values.shape) < fraction)
        if float(np.linalg.norm(rounded)) <= norm_bound:
            return rounded.astype(np.int64)
    raise RuntimeError(f"conditional randomized rounding found no vector of norm <= {norm_bound:g}")


def skellam_noise(*, shape: tuple[int, ...], variance: float, rng: np.random.Generator) -> np.ndarray:
    """Symmetric Skellam noise of ``variance`` per coordinate: ``Poisson(v/2) - Poisson(v/2)``."""
    require_positive("variance", variance)
    lam = 0.5 * variance
    return rng.poisson(lam, size=shape).astype(np.int64) - rng.poisson(lam, size=shape).astype(np.int64)


def encode_update(
    update: np.ndarray, *, plan: SkellamPlan, signs: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """One client's contribution: clip, rotate, scale, round, add Skellam noise, reduce mod ``2^b``.

    ``update`` is the flat model update; returns integers in ``[0, 2^b)`` of length ``plan.dim``.
    ``rng`` is the privacy randomness (OS entropy on devices): it draws the rounding and the noise.
    """
    norm = float(np.linalg.norm(update))
    clipped = update * min(1.0, plan.clip / norm) if norm > 0 else update
    scaled = rotate(clipped, signs=signs) * plan.scale
    rounded = conditional_randomized_rounding(scaled, norm_bound=plan.l2_sensitivity, rng=rng)
    noisy = rounded + skellam_noise(shape=rounded.shape, variance=plan.local_variance, rng=rng)
    return np.mod(noisy, 1 << plan.bits)


def centered(values: np.ndarray, *, bits: int) -> np.ndarray:
    """Integers mod ``2^b`` mapped to their representatives in ``[-2^(b-1), 2^(b-1))``."""
    modulus = 1 << bits
    half = modulus >> 1
    return np.mod(np.asarray(values, dtype=np.int64) + half, modulus) - half


def decode_modular_sum(total: np.ndarray, *, plan: SkellamPlan, signs: np.ndarray, size: int) -> np.ndarray:
    """The server's estimate of the sum of the clipped updates from the modular sum of the encodings."""
    return unrotate(centered(total, bits=plan.bits).astype(np.float64) / plan.scale, signs=signs, size=size)
