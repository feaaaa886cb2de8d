"""Buffered-linear-Toeplitz (BLT) strategy matrices: their error, sensitivity, optimisation and noise.

DP-FTRL as a matrix-factorization mechanism (Denisov, McMahan, Rush, Smith, Thakurta, NeurIPS 2022):
the models are prefix sums ``A x`` of the rounds' sums ``x``; with ``A = B C`` the server releases
``C x + z``, ``z ~ N(0, sigma^2 I)``, which is every round's sum plus the correlated noise
``(C^{-1} z)_t``. A **BLT** (Dvijotham, McMahan, Pillutla, Steinke, Thakurta, "Efficient and
near-optimal noise generation for streaming differential privacy", FOCS 2024, arXiv 2404.16706:
[DMPST]) is the lower-triangular Toeplitz ``C`` with coefficients

    ``c_0 = 1``,  ``c_k = sum_i omega_i theta_i^(k-1)``  (``k >= 1``)

for ``d`` buffers with decays ``theta_i`` (``buf_decay``) and scales ``omega_i`` (``output_scale``).
``C^{-1}`` is a BLT too, with decays ``theta^`` ([DMPST] Lemma 5.2):

    ``omega_i = prod_j (theta_i - theta^_j) / prod_{j != i} (theta_i - theta_j)``,

and ``omega^`` the same with ``theta`` and ``theta^`` swapped. The noise streams with ``d`` buffers
of the model's size whatever the number of rounds (McMahan, Xu, Zhang, "A Hassle-free Algorithm for
Private Learning in Practice: Don't Use Tree Aggregation, Use BLTs", EMNLP Industry 2024, arXiv
2408.08868: [MXZ], Algorithm 3): ``y_t = z_t - sum_i omega_i s_i``, ``s_i <- theta_i s_i + y_t``
(:class:`BLTNoise`).

**Sensitivity** (:func:`sensitivity_squared`). With ``theta`` in (0, 1), ``omega > 0`` and
``sum(omega) <= 1`` the coefficients are positive and non-increasing; a participant whose ``k``
participations are at least ``b`` rounds apart then changes ``C x`` most when they are exactly
``b`` apart from the first round: ``sens^2 = ||C u||^2``, ``u = e_0 + e_b + ... + e_{(k-1)b}``
(arXiv 2405.13763, Theorem 2, as jax_privacy's ``toeplitz.minsep_sensitivity_squared`` cites it;
[MXZ] Section 3). One participation: the largest column norm.

**Loss** (:func:`loss`): ``sens^2`` times the max (or mean) over rounds of the squared error of the
released prefix sums per unit noise, ``err_t = sum_{s<=t} (sum_{u<=s} r_u)^2`` with ``r`` the
coefficients of ``C^{-1}`` ([MXZ] Section 3; [DMPST] Lemma 5.4 in closed form). For Toeplitz
matrices the max is the last round's.

**Optimisation** (:func:`optimal_blt`): over the pair ``(theta, theta^)`` ([MXZ] Algorithm 5),
kept interlaced in (0, 1) (:func:`interlaced_decays`), which puts every candidate in the
well-behaved class of "An Inversion Theorem for Buffered Linear Toeplitz (BLT) Matrices and
Applications to Streaming Differential Privacy" (arXiv 2504.21413, Theorem 1: ``omega > 0``,
``omega^ < 0``, ``sum(omega / theta) < 1``; jax_privacy keeps its optimiser there with log
barriers); L-BFGS-B on the loss, restarted where it stalls, from the rational approximation of
``1 / sqrt(1 - x)`` ([DMPST] Proposition 4.5). The number of buffers may be chosen as jax_privacy
2.0.0's ``buffered_toeplitz.optimize`` chooses it: add buffers while the loss falls by more than 1 %.
The loss is computed from the materialised coefficients (``O(n d)``), in float64, gradients from
torch; ``benchmarks/blt_jax_privacy.py`` checks all of it against jax_privacy.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fl_app.privacy.checks import require_positive_int

#: The errors a BLT can be optimised for: the largest or the mean squared error of the prefix sums.
ERRORS = ("max", "mean")
#: Buffers tried by ``buffers="auto"`` (jax_privacy's ``optimize`` default range).
MAX_AUTO_BUFFERS = 10
#: ``buffers="auto"`` adds a buffer while it lowers the loss by more than this factor.
AUTO_IMPROVEMENT = 1.01
#: Fresh L-BFGS-B starts from where the last stopped, while they lower the loss (at most this many).
RESTARTS = 8


@dataclass(frozen=True)
class ParticipationSchema:
    """Who may take part when: ``max_participations`` rounds at least ``min_separation`` apart.

    ``max_participations = 1`` is single participation. ``rounds`` is the matrix's size ``n``.
    """

    rounds: int
    min_separation: int
    max_participations: int

    def __post_init__(self) -> None:
        require_positive_int("rounds", self.rounds)
        require_positive_int("min_separation", self.min_separation)
        require_positive_int("max_participations", self.max_participations)
        possible = -(-self.rounds // self.min_separation)
        if self.max_participations > possible:
            raise ValueError(
                f"{self.max_participations} participations at least {self.min_separation} rounds apart do "
                f"not fit in {self.rounds} rounds (at most {possible})"
            )

    def describe(self) -> str:
        """One line for the run's header and results."""
        if self.max_participations == 1:
            return f"single participation (each client in at most one of the {self.rounds} rounds)"
        return (
            f"min-separation: at most {self.max_participations} participations per client, at least "
            f"{self.min_separation} rounds apart, in {self.rounds} rounds"
        )


@dataclass(frozen=True)
class BufferedToeplitz:
    """A BLT ``C`` (module docstring): decays ``theta`` (decreasing) and scales ``omega``.

    No buffers is the identity (independent noise each round).
    """

    buf_decay: tuple[float, ...]
    output_scale: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.buf_decay) != len(self.output_scale):
            raise ValueError("buf_decay and output_scale must have the same length")

    @property
    def buffers(self) -> int:
        """``d``: the number of buffers (vectors of the model's size the noise keeps)."""
        return len(self.buf_decay)

    def coefficients(self, n: int) -> np.ndarray:
        """``c_0 .. c_{n-1}``: the first column of ``C`` (``c_0 = 1``)."""
        theta, omega = np.asarray(self.buf_decay), np.asarray(self.output_scale)
        powers = theta[None, :] ** np.arange(max(n - 1, 0))[:, None]
        return np.concatenate([[1.0], powers @ omega])[:n]

    def inverse(self) -> BufferedToeplitz:
        """The BLT of ``C^{-1}``: decays the eigenvalues of ``diag(theta) - omega 1^T``, Lemma 5.2 scales."""
        if not self.buffers:
            return self
        theta = np.asarray(self.buf_decay)
        hat = np.sort(
            np.linalg.eigvals(np.diag(theta) - np.outer(self.output_scale, np.ones_like(theta))).real
        )
        return _blt(hat[::-1], _scales(hat[::-1], theta))

    def pillutla_score(self) -> float:
        """``sum(omega / theta)``: below 1 keeps the decays of ``C^{-1}`` positive (arXiv 2504.21413)."""
        return float(np.sum(np.asarray(self.output_scale) / np.asarray(self.buf_decay)))


def _scales(theta: np.ndarray, other: np.ndarray) -> np.ndarray:
    """[DMPST] Lemma 5.2: the scales of the BLT with decays ``theta`` whose inverse has decays ``other``."""
    gaps = theta[:, None] - theta[None, :]
    np.fill_diagonal(gaps, 1.0)
    return np.prod(theta[:, None] - other[None, :], axis=1) / np.prod(gaps, axis=1)


def _blt(theta: np.ndarray, omega: np.ndarray) -> BufferedToeplitz:
    order = np.argsort(-np.asarray(theta))
    return BufferedToeplitz(
        tuple(float(v) for v in np.asarray(theta)[order]), tuple(float(v) for v in np.asarray(omega)[order])
    )


def blt_pair(theta: np.ndarray, theta_inverse: np.ndarray) -> tuple[BufferedToeplitz, BufferedToeplitz]:
    """``(C, C^{-1})`` from the decays of both ([DMPST] Lemma 5.2; [MXZ] Algorithm 5)."""
    theta, theta_inverse = np.asarray(theta, dtype=np.float64), np.asarray(theta_inverse, dtype=np.float64)
    return _blt(theta, _scales(theta, theta_inverse)), _blt(theta_inverse, _scales(theta_inverse, theta))


# ----------------------------------------------------------------------------- error and sensitivity


def minsep_vector(coefficients: np.ndarray, schema: ParticipationSchema) -> np.ndarray:
    """``C u`` for the worst pattern ``u = e_0 + e_b + ... + e_{(k-1)b}`` (the module docstring)."""
    c = np.asarray(coefficients, dtype=np.float64)[: schema.rounds]
    c = np.pad(c, (0, schema.rounds - c.size))
    u = np.zeros(schema.rounds)
    u[: schema.min_separation * schema.max_participations : schema.min_separation] = 1.0
    return np.convolve(c, u)[: schema.rounds]


@functools.lru_cache(maxsize=256)
def sensitivity_squared(blt: BufferedToeplitz, schema: ParticipationSchema) -> float:
    """``sens^2`` of ``C`` under ``schema``, in units of the clip norm (the module docstring).

    Raises :class:`ValueError` when the coefficients are not non-negative and non-increasing: the
    worst pattern is then not the one computed.
    """
    c = blt.coefficients(schema.rounds)
    if np.any(c < 0) or np.any(np.diff(c) > 1e-15):
        raise ValueError(
            f"the min-separation sensitivity needs non-negative, non-increasing coefficients: {blt}"
        )
    vector = minsep_vector(c, schema)
    return float(vector @ vector)


def per_round_error(inverse: BufferedToeplitz, n: int) -> np.ndarray:
    """``err_t = sum_{s<=t} (sum_{u<=s} r_u)^2`` for ``t < n``: each prefix sum's noise variance per unit."""
    return np.cumsum(np.cumsum(inverse.coefficients(n)) ** 2)


def error(inverse: BufferedToeplitz, n: int, *, kind: str = "max") -> float:
    """The max (the last round's) or mean of :func:`per_round_error`."""
    errors = per_round_error(inverse, n)
    return float(errors[-1] if kind == "max" else errors.mean())


def loss(blt: BufferedToeplitz, schema: ParticipationSchema, *, kind: str = "max") -> float:
    """``sens^2 x error``: the noise variance of the prefix sums at noise multiplier 1 (module docstring)."""
    return sensitivity_squared(blt, schema) * error(blt.inverse(), schema.rounds, kind=kind)


@functools.lru_cache(maxsize=256)
def sensitivity_increments(blt: BufferedToeplitz, schema: ParticipationSchema) -> tuple[float, ...]:
    """How ``||C u_j||^2`` grows with the worst pattern's ``j``-th participation (``u_j``: the first ``j``).

    They sum to :func:`sensitivity_squared`. Any participant whose ``j``-th participation comes at
    least ``b (j - 1)`` rounds after the first round adds at most the ``j``-th increment: ``C`` is
    non-negative, so a later start only cuts rows off (the strategy charges participants by them).
    Memoised per BLT and schema, as :func:`sensitivity_squared`.
    """
    c = blt.coefficients(schema.rounds)
    totals = [
        float(v @ v)
        for v in (
            minsep_vector(c, ParticipationSchema(schema.rounds, schema.min_separation, j))
            for j in range(1, schema.max_participations + 1)
        )
    ]
    return (totals[0], *(later - earlier for earlier, later in itertools.pairwise(totals)))


# ----------------------------------------------------------------------------- optimisation


def rational_approximation(buffers: int) -> BufferedToeplitz:
    """The BLT of [DMPST] Proposition 4.5 (``1 / sqrt(1 - x)``), inside the barriers: the optimiser's start.

    As jax_privacy's ``BufferedToeplitz.from_rational_approx_to_sqrt_x`` with its optimiser's settings
    (largest decay ``1 - 1e-6``, Pillutla score ``1 - 1e-6``).
    """
    require_positive_int("buffers", buffers)
    half = (buffers + 1) // 2
    step = 1.6 * math.pi / math.sqrt(2 * (half + 1))
    ks = np.arange(-half + 1, buffers - half + 1) - 1
    decay = 1 / (1 + np.exp(2 * step * ks))
    scale = -(decay**2) * np.exp(3 * step * ks) / np.sum(np.exp(step * ks) * decay)
    blt = _blt(decay, scale).inverse()  # the approximation is of C^{-1}
    theta = np.asarray(blt.buf_decay) * min(1.0, (1 - 1e-6) / blt.buf_decay[0])
    omega = np.asarray(blt.output_scale)
    score = float(np.sum(omega / theta))
    return _blt(theta, omega * min(1.0, (1 - 1e-6) / score))


def interlaced_decays(logits: np.ndarray) -> np.ndarray:
    """``1 > theta_1 > theta^_1 > theta_2 > ... > theta_d > theta^_d > 0`` from ``2d + 1`` free logits.

    The gaps between 1, the ``2d`` decays and 0 are the softmax of the logits. Interlaced decays in
    (0, 1) make every BLT of the well-behaved class ([DMPST] Lemma 5.2 gives ``omega > 0`` and
    ``omega^ < 0``; the Pillutla score is ``1 - prod(theta^) / prod(theta)``, in (0, 1)), so the
    optimiser needs no constraints.
    """
    gaps = np.exp(logits - np.max(logits))
    return 1 - np.cumsum(gaps / gaps.sum())[:-1]


def decay_logits(blt: BufferedToeplitz) -> np.ndarray:
    """The logits of :func:`interlaced_decays` for ``blt`` and its inverse (which must interlace)."""
    decays = np.ravel(np.column_stack([blt.buf_decay, blt.inverse().buf_decay]))
    gaps = -np.diff(np.concatenate([[1.0], decays, [0.0]]))
    if np.any(gaps <= 0):
        raise ValueError(f"the decays of the BLT and its inverse do not interlace: {decays}")
    return np.log(gaps)


def _objective(schema: ParticipationSchema, kind: str) -> Callable[[np.ndarray], tuple[float, np.ndarray]]:
    """``logits -> (loss / normaliser, gradient)`` for the BLT of :func:`interlaced_decays`.

    In float64, gradients by torch's autograd; the normaliser ``k + (1 + ln(n) / pi)^2`` (the
    optimum's rough size, jax_privacy's) keeps the values near 1 for every ``n`` and ``k``.
    ``(1e300, 0)`` where the arithmetic overflows (decays too close to tell apart).
    """
    import torch  # the server has torch for the model anyway; imported on first use

    n, b, k = schema.rounds, schema.min_separation, schema.max_participations
    exponents = torch.arange(n - 1, dtype=torch.float64)[:, None]
    normaliser = k + (1 + math.log(n) / math.pi) ** 2
    padded = b * (-(-n // b))

    def scales(theta: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        gaps = theta[:, None] - theta[None, :] + torch.eye(theta.numel(), dtype=torch.float64)
        return torch.prod(theta[:, None] - other[None, :], dim=1) / torch.prod(gaps, dim=1)

    def coefficients(theta: torch.Tensor, omega: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.ones(1, dtype=torch.float64), (theta[None, :] ** exponents) @ omega])

    def sensitivity(c: torch.Tensor) -> torch.Tensor:
        # C u for u = e_0 + e_b + ... + e_{(k-1)b}: cumulative sums of c in steps of b, cut after k
        rows = torch.nn.functional.pad(c, (0, padded - n)).reshape(-1, b).cumsum(0).reshape(-1)
        cut = torch.cat([rows[: b * k], rows[b * k :] - rows[: padded - b * k]])[:n]
        return cut @ cut

    def objective(logits: torch.Tensor) -> torch.Tensor:
        decays = 1 - torch.cumsum(torch.softmax(logits, 0), 0)[:-1]
        theta, hat = decays[0::2], decays[1::2]
        errors = torch.cumsum(torch.cumsum(coefficients(hat, scales(hat, theta)), 0) ** 2, 0)
        err = errors[-1] if kind == "max" else errors.mean()
        return err * sensitivity(coefficients(theta, scales(theta, hat))) / normaliser

    def value_and_gradient(values: np.ndarray) -> tuple[float, np.ndarray]:
        x = torch.tensor(values, dtype=torch.float64, requires_grad=True)
        value = objective(x)
        if not torch.isfinite(value):
            return 1e300, np.zeros_like(values)
        value.backward()
        assert x.grad is not None
        if not torch.all(torch.isfinite(x.grad)):
            return 1e300, np.zeros_like(values)
        return float(value.detach()), x.grad.numpy().copy()

    return value_and_gradient


def optimise_buffers(schema: ParticipationSchema, *, buffers: int, kind: str = "max") -> BufferedToeplitz:
    """The BLT with ``buffers`` buffers of least :func:`loss` under ``schema`` (module docstring).

    Raises :class:`RuntimeError` when the optimum found is not a valid BLT for the schema.
    """
    if kind not in ERRORS:
        raise ValueError(f"kind must be one of {ERRORS}, got {kind!r}")
    if buffers == 0:
        return BufferedToeplitz((), ())
    import scipy.optimize  # here: 0.14 s of every start-up that imports the registry

    objective, logits, value = (
        _objective(schema, kind),
        decay_logits(rational_approximation(buffers)),
        math.inf,
    )
    for _ in range(RESTARTS):  # L-BFGS-B stalls at times; a fresh start from where it stopped moves on
        found = scipy.optimize.minimize(
            objective,
            logits,
            jac=True,
            method="L-BFGS-B",
            options={"maxiter": 3000, "maxcor": 15, "ftol": 1e-15, "gtol": 1e-12},
        )
        if not found.fun < value * (1 - 1e-12):
            break
        logits, value = found.x, found.fun
    decays = interlaced_decays(logits)
    blt = idle_buffers_dropped(blt_pair(decays[0::2], decays[1::2])[0])
    try:
        value = loss(blt, schema, kind=kind)
    except ValueError as error:
        raise RuntimeError(f"BLT optimisation with {buffers} buffers left the valid BLTs: {error}") from None
    if not math.isfinite(value):
        raise RuntimeError(f"BLT optimisation with {buffers} buffers gave a non-finite loss: {blt}")
    return blt


def idle_buffers_dropped(blt: BufferedToeplitz, *, below: float = 1e-12) -> BufferedToeplitz:
    """``blt`` without the buffers whose scale is below ``below`` in magnitude (they change nothing).

    The optimiser may merge a decay with its inverse's (both near 1), which zeroes that buffer's
    scale: such a BLT has fewer buffers than were asked for.
    """
    keep = [i for i, omega in enumerate(blt.output_scale) if abs(omega) >= below]
    return BufferedToeplitz(tuple(blt.buf_decay[i] for i in keep), tuple(blt.output_scale[i] for i in keep))


@functools.lru_cache(maxsize=64)
def optimal_blt(
    schema: ParticipationSchema, *, buffers: int | str = "auto", kind: str = "max"
) -> BufferedToeplitz:
    """The optimal BLT with ``buffers`` buffers (:func:`optimise_buffers`), or ``"auto"`` many.

    ``"auto"``: from 0 buffers up, one more while the loss falls by more than
    :data:`AUTO_IMPROVEMENT` (at most :data:`MAX_AUTO_BUFFERS`; a failed optimisation ends the
    search), as jax_privacy's ``buffered_toeplitz.optimize``.

    Deterministic (public: it depends on the schedule only), memoised per ``(schema, buffers, kind)``.
    """
    if buffers != "auto":
        return optimise_buffers(schema, buffers=int(buffers), kind=kind)
    best = optimise_buffers(schema, buffers=0, kind=kind)
    best_loss = loss(best, schema, kind=kind)
    for count in range(1, MAX_AUTO_BUFFERS + 1):
        try:
            candidate = optimise_buffers(schema, buffers=count, kind=kind)
        except RuntimeError:
            break
        candidate_loss = loss(candidate, schema, kind=kind)
        if not AUTO_IMPROVEMENT * candidate_loss < best_loss:
            break
        best, best_loss = candidate, candidate_loss
    return best


# ----------------------------------------------------------------------------- streaming noise


class BLTNoise:
    """The streaming noise ``y = C^{-1} z`` of a BLT ``C`` ([MXZ] Algorithm 3), ``z ~ N(0, sigma^2 I)``.

    ``draw(like, rng)`` returns round t's ``y_t = z_t - sum_i omega_i s_i`` shaped like ``like`` and
    updates the buffers ``s_i <- theta_i s_i + y_t``: ``d`` float64 arrays per model array, the run's
    secret (with the models they reveal the un-noised sums), kept in the server's private state only.
    """

    def __init__(self, blt: BufferedToeplitz, *, sigma: float) -> None:
        self.blt = blt
        self.sigma = float(sigma)
        self.buffers: list[list[np.ndarray]] | None = None

    def draw(self, like: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
        """The next round's noise (float64 arrays shaped like ``like``)."""
        noise = [
            rng.normal(0.0, self.sigma, size=np.shape(x)) if self.sigma > 0 else np.zeros(np.shape(x))
            for x in like
        ]
        if self.buffers is None:
            self.buffers = [[np.zeros(np.shape(x)) for x in like] for _ in range(self.blt.buffers)]
        for omega, buffer in zip(self.blt.output_scale, self.buffers, strict=True):
            for y, s in zip(noise, buffer, strict=True):
                y -= omega * s
        for theta, buffer in zip(self.blt.buf_decay, self.buffers, strict=True):
            for y, s in zip(noise, buffer, strict=True):
                s *= theta
                s += y
        return noise
