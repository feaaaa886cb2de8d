"""Banded Toeplitz matrix factorization: the strategy matrix C and the noise it correlates.

A matrix-factorization mechanism (Denisov, McMahan, Rush, Smith, Thakurta, NeurIPS 2022) writes
the workload ``A`` (what the training needs: here the models, i.e. prefix sums of the noisy round
sums, filtered by the server's momentum) as ``A = B C`` and releases ``C x + z`` with
``z ~ N(0, sigma^2 I)``; ``B (C x + z) = A x + B z`` is post-processing. In the round-by-round form
every round's sum gets the correlated noise ``(C^{-1} z)_t``:

    ``x^_t = x_t + y_t``,  ``C y = z``,  i.e.  ``y_t = (z_t - sum_{j=1}^{b-1} c_j y_{t-j}) / c_0``

for a lower-triangular **banded Toeplitz** ``C`` with coefficients ``c_0 .. c_{b-1}`` (``b`` bands:
``C[t, s] = c_{t-s}`` for ``0 <= t - s < b``, else 0). Streaming needs the last ``b - 1`` noise
vectors, or, since ``C^{-1}`` is not banded, every earlier ``z_s`` drawn again from a stream that
can draw any round again (a secret key's counter-based generator, or the noise seed's; see
:class:`CorrelatedNoise` and :mod:`fl_app.privacy.keyed_noise`).

**Why banded Toeplitz.** Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu,
"(Amplified) Banded Matrix Factorization: A unified approach to private training" (NeurIPS 2023):
a ``b``-banded ``C`` whose columns have L2 norm at most 1 has sensitivity ``sqrt(k)`` (times the
clip) for a participant whose ``k`` participations are at least ``b`` rounds apart (the columns
of its rounds have disjoint supports), and with the clients split into ``b`` groups, round ``t``
Poisson-sampling group ``t mod b``, it is exactly as private as DP-SGD with the same noise
multiplier and sampling rate over ``ceil(n / b)`` steps (their Theorem 4), so the project's
PLD accountant applies unchanged. McKenna, "Scaling up the Banded Matrix Factorization Mechanism
for Differentially Private ML" (2024), shows that the Toeplitz restriction costs little against
the general banded optimum and that its ``b`` coefficients are cheap to optimise for any ``n``.
Buffered-linear-Toeplitz (BLT) noise (Dvijotham, McMahan, Pillutla, Steinke, Thakurta 2024;
McKenna et al. 2024, deployed for Gboard) is not banded: its multi-participation sensitivity needs
a separate computation and the amplification theorem above does not cover it.

**The optimisation** (:func:`optimal_banded_toeplitz`): minimise the total squared error of the
released models, ``L(c) = ||A C^{-1}||_F^2`` with ``c`` normalised to unit norm (the largest column
norm of a banded Toeplitz ``C`` is ``||c||``). ``A`` is lower-triangular Toeplitz too, with
coefficients ``a_k = sum_{i<=k} beta^i`` (prefix sums under heavy-ball momentum ``beta``), so
``A C^{-1}`` is the Toeplitz matrix of ``a * r`` (``r``: the coefficients of ``C^{-1}``) and
``L = sum_{k<n} (n - k) (a * r)_k^2``. Started from the band-truncated square root of ``a`` (the
optimal unbanded Toeplitz factor for prefix sums, Fichtenberger, Henzinger, Upadhyay 2023), the
``b`` coefficients are found by L-BFGS-B in float64 (gradients from torch).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fl_app.privacy.checks import require_positive_int

if TYPE_CHECKING:
    from fl_app.privacy.keyed_noise import NoiseStream


def workload_coefficients(*, rounds: int, momentum: float = 0.0) -> np.ndarray:
    """``a_k = sum_{i<=k} beta^i`` for ``k < rounds``: prefix sums under heavy-ball momentum ``beta``.

    With ``v_t = beta v_{t-1} + x^_t`` and ``w_{t+1} = w_t + eta v_t / m``, the model after round t is
    ``w_1 + (eta / m) sum_{s<=t} a_{t-s} x^_s``. ``beta = 0``: all ones (prefix sums).
    """
    require_positive_int("rounds", rounds)
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
    return np.cumsum(momentum ** np.arange(rounds, dtype=np.float64))


def inverse_coefficients(coefficients: np.ndarray, *, length: int) -> np.ndarray:
    """The first ``length`` coefficients ``r`` of ``C^{-1}`` for the lower-triangular Toeplitz ``C(c)``.

    ``(c * r)_k = [k = 0]``: ``r_0 = 1 / c_0``, ``r_k = -sum_{j=1}^{min(k, b-1)} c_j r_{k-j} / c_0``.
    """
    c = np.asarray(coefficients, dtype=np.float64)
    if c.ndim != 1 or c.size == 0 or not c[0] > 0:
        raise ValueError("coefficients must be a non-empty vector with c_0 > 0")
    r = np.zeros(length)
    for k in range(length):
        acc = 1.0 if k == 0 else 0.0
        for j in range(1, min(k, c.size - 1) + 1):
            acc -= c[j] * r[k - j]
        r[k] = acc / c[0]
    return r


def factorization_loss(*, coefficients: np.ndarray, rounds: int, momentum: float = 0.0) -> float:
    """``||A C^{-1}||_F^2`` for the ``rounds x rounds`` workload and the banded Toeplitz ``C(c)``.

    ``c`` as given (not normalised): multiply by ``||c||^2`` for the loss at unit sensitivity.
    """
    a = workload_coefficients(rounds=rounds, momentum=momentum)
    r = inverse_coefficients(coefficients, length=rounds)
    effect = np.convolve(a, r)[:rounds]
    return float(np.sum((rounds - np.arange(rounds)) * effect**2))


def square_root_coefficients(series: np.ndarray) -> np.ndarray:
    """Coefficients ``s`` with ``s * s = series`` (``s_0 = sqrt(series_0)``): the Toeplitz square root."""
    a = np.asarray(series, dtype=np.float64)
    s = np.zeros_like(a)
    s[0] = np.sqrt(a[0])
    for k in range(1, a.size):
        s[k] = (a[k] - np.dot(s[1:k], s[k - 1 : 0 : -1])) / (2 * s[0])
    return s


@dataclass(frozen=True)
class BandedToeplitz:
    """An optimised strategy matrix: its coefficients (unit norm) and its loss against the identity.

    Attributes
    ----------
    coefficients : tuple[float, ...]
        ``c_0 .. c_{b-1}``, ``||c|| = 1`` (the largest column norm of ``C``).
    rounds, bands : int
        The size ``n`` of the workload and ``b = len(coefficients)`` (at most ``n``).
    momentum : float
        The server momentum ``beta`` of the workload.
    loss : float
        ``||A C^{-1}||_F^2`` at unit column norm.
    identity_loss : float
        The same for ``C = I`` (one band: independent noise each round, DP-SGD / DP-FedAvg).

    """

    coefficients: tuple[float, ...]
    rounds: int
    bands: int
    momentum: float
    loss: float
    identity_loss: float


@functools.lru_cache(maxsize=64)
def optimal_banded_toeplitz(*, rounds: int, bands: int, momentum: float = 0.0) -> BandedToeplitz:
    """The unit-norm ``min(bands, rounds)``-banded Toeplitz ``C`` minimising ``||A C^{-1}||_F^2``.

    See the module docstring. Deterministic (no randomness: the matrix is public and depends on
    nothing but the schedule), memoised per ``(rounds, bands, momentum)``.
    """
    require_positive_int("rounds", rounds)
    require_positive_int("bands", bands)
    bands = min(bands, rounds)
    a = workload_coefficients(rounds=rounds, momentum=momentum)
    identity = factorization_loss(coefficients=np.ones(1), rounds=rounds, momentum=momentum)
    if bands == 1:
        return BandedToeplitz((1.0,), rounds, 1, float(momentum), identity, identity)
    start = square_root_coefficients(a)[:bands]
    import scipy.optimize  # here: 0.14 s of every start-up that imports the registry

    found = scipy.optimize.minimize(
        banded_loss_and_gradient(a, bands=bands),
        start,
        jac=True,
        method="L-BFGS-B",
        options={"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-12},
    )
    c = np.asarray(found.x, dtype=np.float64)
    c = c / np.linalg.norm(c)
    if c[0] < 0:
        c = -c
    loss = factorization_loss(coefficients=c, rounds=rounds, momentum=momentum)
    initial = factorization_loss(coefficients=start / np.linalg.norm(start), rounds=rounds, momentum=momentum)
    if not loss <= min(initial, identity) * (1 + 1e-9):
        raise RuntimeError(f"banded Toeplitz optimisation diverged: loss {loss} > start {initial}")
    return BandedToeplitz(tuple(float(v) for v in c), rounds, bands, float(momentum), loss, identity)


def banded_loss_and_gradient(
    workload: np.ndarray, *, bands: int
) -> Callable[[np.ndarray], tuple[float, np.ndarray]]:
    """The objective of :func:`optimal_banded_toeplitz` and its gradient, for ``scipy.optimize.minimize``.

    Parameters
    ----------
    workload : np.ndarray
        ``a``, the first column of the lower-triangular Toeplitz workload ``A`` (one entry per round).
    bands : int
        ``b``: the candidate ``theta`` holds the ``b`` coefficients of ``C`` before normalisation.

    Returns
    -------
    Callable[[np.ndarray], tuple[float, np.ndarray]]
        ``theta -> (loss, gradient)``: ``||A C^{-1}||_F^2 = sum_k (n - k) (a * r)_k^2`` for the ``C``
        of ``theta / ||theta||``, in float64 by torch's autograd; ``(1e300, 0)`` where ``C^{-1}``
        overflows.

    """
    import torch  # the server has torch for the model anyway; imported on first use

    rounds = len(workload)
    weights = torch.as_tensor(rounds - np.arange(rounds), dtype=torch.float64)
    a = torch.as_tensor(workload, dtype=torch.float64)
    index = torch.arange(rounds)
    lag = index[:, None] - index[None, :]
    inside = (lag >= 0) & (lag < bands)
    unit = torch.zeros(rounds, 1, dtype=torch.float64)
    unit[0, 0] = 1.0

    def loss_of(theta: torch.Tensor) -> torch.Tensor:
        c = theta / torch.linalg.vector_norm(theta)
        matrix = torch.where(inside, c[lag.clamp(0, bands - 1)], torch.zeros((), dtype=torch.float64))
        r = torch.linalg.solve_triangular(matrix, unit, upper=False)[:, 0]
        # (a * r)_k for k < n: the first column of A C^{-1}
        effect = torch.nn.functional.conv1d(
            torch.nn.functional.pad(r, (rounds - 1, 0))[None, None, :], a.flip(0)[None, None, :]
        )[0, 0]
        return torch.sum(weights * effect**2)

    def value_and_gradient(values: np.ndarray) -> tuple[float, np.ndarray]:
        theta = torch.tensor(values, dtype=torch.float64, requires_grad=True)
        value = loss_of(theta)
        if not torch.isfinite(value):  # C^{-1} overflows (|c_j / c_0| too large): a wall, not a step
            return 1e300, np.zeros_like(values)
        value.backward()
        assert theta.grad is not None
        return float(value.detach()), theta.grad.numpy().copy()

    return value_and_gradient


class CorrelatedNoise:
    """The streaming noise ``y = C^{-1} z`` of a banded Toeplitz ``C`` (``z ~ N(0, sigma^2 I)``).

    Round t's noise is ``y_t = (z_t - sum_{j=1}^{b-1} c_j y_{t-j}) / c_0``, drawn one of two ways:

    * :meth:`draw`: ``z_t`` from the caller's generator; the last ``b - 1`` outputs are kept
      (:attr:`history`, pickled with the object) because ``z`` cannot be drawn again;
    * :meth:`at_round`: ``z_t`` from a :class:`~fl_app.privacy.keyed_noise.NoiseStream`, a pure
      function of the run's noise source (a secret key, or the noise seed) and the round, so no
      vector needs keeping. While the last
      ``b - 1`` outputs fit ``keep_bytes`` they are kept in memory (never pickled: after a resume
      the recursion is replayed from round 1, giving the same vectors bit for bit); beyond it each
      round's ``y_t = sum_{s<=t} r_{t-s} z_s`` (``r``: the coefficients of ``C^{-1}``, not banded)
      is formed from ``t`` draws again, with no vector kept (``t`` draws a round against ``b - 1``
      stored vectors: time for memory).

    The outputs and the stream's key are the run's secret: with the models they reveal the
    un-noised sums, so they live only in the server's private state.
    """

    def __init__(self, coefficients: tuple[float, ...], *, sigma: float) -> None:
        self.coefficients = tuple(float(c) for c in coefficients)
        self.sigma = float(sigma)
        self.history: deque[list[np.ndarray]] = deque(maxlen=max(len(self.coefficients) - 1, 1))
        self._kept: deque[np.ndarray] = deque(maxlen=max(len(self.coefficients) - 1, 1))
        self._kept_round = 0
        self._inverse = np.zeros(0)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without :meth:`at_round`'s kept outputs (replayed from the stream when needed)."""
        state = dict(self.__dict__)
        state["_kept"] = deque(maxlen=self._kept.maxlen)
        state["_kept_round"] = 0
        return state

    def draw(self, like: list[np.ndarray], rng: np.random.Generator) -> list[np.ndarray]:
        """The next round's noise (float64 arrays shaped like ``like``)."""
        c = self.coefficients
        noise = [
            rng.normal(0.0, self.sigma, size=np.shape(x)) if self.sigma > 0 else np.zeros(np.shape(x))
            for x in like
        ]
        for j, past in enumerate(reversed(self.history), start=1):
            if j >= len(c):
                break
            noise = [n - c[j] * p for n, p in zip(noise, past, strict=True)]
        noise = [n / c[0] for n in noise]
        if len(c) > 1:
            self.history.append(noise)
        return noise

    def at_round(
        self, like: list[np.ndarray], stream: NoiseStream, server_round: int, *, keep_bytes: float
    ) -> list[np.ndarray]:
        """Round ``server_round``'s noise ``y_t`` (float64 arrays shaped like ``like``) from ``stream``.

        ``z_t = sigma * stream.normals(t)``; the same as :meth:`draw` fed those ``z_t`` round after
        round: bit for bit while the last ``b - 1`` outputs fit ``keep_bytes`` (bytes of float64), to
        float rounding when they are drawn again instead.
        """
        size = sum(int(np.prod(np.shape(x))) for x in like)
        if self.sigma <= 0:
            flat = np.zeros(size)
        elif (len(self.coefficients) - 1) * size * 8 <= keep_bytes:
            flat = self._recursive(stream, server_round, size)
        else:
            flat = self._regenerated(stream, server_round, size)
        return split_like(flat, like)

    def _recursive(self, stream: NoiseStream, server_round: int, size: int) -> np.ndarray:
        """``y_t`` by the recursion on the kept outputs, replayed from round 1 when they are missing."""
        stale = self._kept_round != server_round - 1 or (self._kept and self._kept[-1].size != size)
        if stale and len(self.coefficients) > 1:  # one band: y_t = z_t / c_0 needs no earlier output
            self._kept.clear()
            self._kept_round = 0
            for earlier in range(1, server_round):
                self._step(stream, earlier, size)
        return self._step(stream, server_round, size)

    def _step(self, stream: NoiseStream, server_round: int, size: int) -> np.ndarray:
        """One round of the recursion on the kept outputs (the operations of :meth:`draw`)."""
        c = self.coefficients
        noise = self.sigma * stream.normals(server_round, size)
        for j, past in enumerate(reversed(self._kept), start=1):
            if j >= len(c):
                break
            noise = noise - c[j] * past
        noise = noise / c[0]
        if len(c) > 1:
            self._kept.append(noise)
        self._kept_round = server_round
        return noise

    def _regenerated(self, stream: NoiseStream, server_round: int, size: int) -> np.ndarray:
        """``y_t = sum_{s<=t} sigma r_{t-s} z_s``, every ``z_s`` drawn again (nothing kept)."""
        if self._inverse.size < server_round:
            self._inverse = inverse_coefficients(
                self.coefficients, length=max(server_round, 2 * self._inverse.size)
            )
        r = self._inverse
        terms = [(s, self.sigma * float(r[server_round - s])) for s in range(1, server_round + 1)]
        return stream.weighted_sum(terms, size)


def split_like(flat: np.ndarray, like: list[np.ndarray]) -> list[np.ndarray]:
    """``flat`` cut into arrays shaped like ``like`` (views, in order)."""
    parts, start = [], 0
    for x in like:
        shape = np.shape(x)
        count = int(np.prod(shape))
        parts.append(flat[start : start + count].reshape(shape))
        start += count
    return parts
