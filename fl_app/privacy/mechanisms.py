"""Noise mechanisms: pure functions of their inputs and an explicit generator.

Every function validates its arguments, draws only from the ``rng`` it is
given (never from global ``np.random`` or ``random``) and leaves its inputs
unchanged. What each output guarantees, and under which neighbouring relation,
is stated per function; the accountant (:mod:`fl_app.privacy.accountant`) is
told the same facts through :mod:`fl_app.privacy.events`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from fl_app.privacy.checks import require_positive


def _require_generator(rng: np.random.Generator) -> None:
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")


# --------------------------------------------------------------------------------------
# k-ary randomized response on class labels (PrivateKT, Eq. 2 and Eq. 3)
# --------------------------------------------------------------------------------------


def randomized_response_labels(
    *, labels: np.ndarray, keep_probability: float, num_classes: int, rng: np.random.Generator
) -> np.ndarray:
    """Perturb class labels by k-ary randomized response (PrivateKT Eq. 2).

    Each label is kept with probability ``beta`` (``keep_probability``) and
    otherwise replaced by a class drawn uniformly from all ``num_classes``
    classes (which may be the true one). With
    ``beta = (e^eps - 1) / (e^eps - 1 + C)`` one label is ``eps``-LDP under
    replacement of the input (Lemma 1 with K = 1).

    Parameters
    ----------
    labels : np.ndarray
        Integer labels in ``[0, num_classes)``, any shape.
    keep_probability : float
        ``beta`` in ``[0, 1]``.
    num_classes : int
        ``C >= 2``.
    rng : np.random.Generator
        Source of randomness.

    Returns
    -------
    np.ndarray
        Perturbed labels, same shape, dtype ``int64``.

    """
    _require_generator(rng)
    if not isinstance(num_classes, int | np.integer) or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    if not 0.0 <= keep_probability <= 1.0:
        raise ValueError(f"keep_probability must be in [0, 1], got {keep_probability!r}")
    labels = np.asarray(labels)
    if labels.size and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(f"labels must lie in [0, {num_classes}), got range [{labels.min()}, {labels.max()}]")
    keep = rng.random(labels.shape) < keep_probability
    random_classes = rng.integers(0, num_classes, size=labels.shape)
    return np.where(keep, labels, random_classes).astype(np.int64)


def debias_label_average(
    *, perturbed_labels: np.ndarray, keep_probability: float, num_classes: int
) -> np.ndarray:
    """Unbiased estimate of the clients' average one-hot prediction (PrivateKT Eq. 3).

    ``y_hat = (mean_c onehot(y_hat_c) - (1 - beta) / C) / beta``. Its
    expectation over the randomized response equals the average of the clients'
    true one-hot predictions; entries may be negative or above 1.

    Parameters
    ----------
    perturbed_labels : np.ndarray
        Shape ``(num_clients, K)``: each client's perturbed label for each of the
        K knowledge-transfer samples.
    keep_probability : float
        ``beta`` in ``(0, 1]`` used by the clients.
    num_classes : int
        ``C``.

    Returns
    -------
    np.ndarray
        Shape ``(K, C)``, the debiased average prediction per sample.

    """
    if not 0.0 < keep_probability <= 1.0:
        raise ValueError(f"keep_probability must be in (0, 1] to debias, got {keep_probability!r}")
    perturbed = np.asarray(perturbed_labels)
    if perturbed.ndim != 2 or perturbed.shape[0] == 0:
        raise ValueError(f"perturbed_labels must have shape (clients >= 1, K), got {perturbed.shape}")
    one_hot = np.eye(num_classes)[perturbed]  # (clients, K, C)
    mean = one_hot.mean(axis=0)
    return (mean - (1.0 - keep_probability) / num_classes) / keep_probability


# --------------------------------------------------------------------------------------
# Binary randomized response RR_gamma (DPFL-BNN, Definition 3)
# --------------------------------------------------------------------------------------


def binary_randomized_response(*, signs: np.ndarray, gamma: float, rng: np.random.Generator) -> np.ndarray:
    """Apply RR_gamma to every coordinate of a +-1 vector independently.

    Each coordinate keeps its value with probability ``1/2 + gamma`` and is
    flipped with probability ``1/2 - gamma`` (DPFL-BNN Definition 3). One
    coordinate is then ``ln((1/2 + gamma) / (1/2 - gamma))``-LDP; a vector of d
    coordinates that may all change costs d times that (basic composition).

    Parameters
    ----------
    signs : np.ndarray
        Values in ``{-1, +1}`` (any numeric dtype).
    gamma : float
        In ``[0, 1/2)``; 0 outputs pure coin flips.
    rng : np.random.Generator
        Source of randomness.

    Returns
    -------
    np.ndarray
        The perturbed signs, same shape and dtype.

    """
    _require_generator(rng)
    if not 0.0 <= gamma < 0.5:
        raise ValueError(f"gamma must be in [0, 0.5), got {gamma!r}")
    signs = np.asarray(signs)
    if signs.size and not np.all(np.abs(signs) == 1):
        raise ValueError("signs must contain only -1 and +1")
    flip = rng.random(signs.shape) < (0.5 - gamma)
    return np.where(flip, -signs, signs).astype(signs.dtype, copy=False)


# --------------------------------------------------------------------------------------
# Laplace and Gaussian mechanisms
# --------------------------------------------------------------------------------------


def laplace_mechanism(
    *, values: np.ndarray, sensitivity: float, epsilon: float, rng: np.random.Generator
) -> np.ndarray:
    """Add i.i.d. Laplace(sensitivity / epsilon) noise to every entry.

    ``epsilon``-DP for inputs whose L1 distance is at most ``sensitivity``. For
    probability vectors (softmax outputs) that bound is 2, not 1: two
    distributions can differ by 2 in L1 (e.g. ``(1, 0)`` and ``(0, 1)``).

    Parameters
    ----------
    values : np.ndarray
        The query answer (any shape).
    sensitivity : float
        L1 sensitivity, ``> 0``.
    epsilon : float
        Privacy parameter, ``> 0``.
    rng : np.random.Generator
        Source of randomness.

    """
    _require_generator(rng)
    require_positive("sensitivity", sensitivity)
    require_positive("epsilon", epsilon)
    values = np.asarray(values, dtype=np.float64)
    return values + rng.laplace(0.0, sensitivity / epsilon, size=values.shape)


def probability_rows(*, values: np.ndarray) -> np.ndarray:
    """Rows as exact probability vectors in float64 (non-negative, summing to 1).

    The L1 sensitivity 2 of a probability vector holds only for vectors on the
    simplex; a float32 softmax may sum to ``1 +- 1e-7``. Negative entries are
    set to 0 and each row is divided by its sum, so any two rows of the result
    are at most 2 apart in L1 (up to float64 rounding).

    Parameters
    ----------
    values : np.ndarray
        Shape ``(n, k)``, finite, each row with a positive sum (e.g. softmax outputs).

    Returns
    -------
    np.ndarray
        Shape ``(n, k)``, dtype ``float64``.

    """
    rows = np.asarray(values, dtype=np.float64)
    if rows.ndim != 2:
        raise ValueError(f"values must have shape (n, k), got {rows.shape}")
    if not np.all(np.isfinite(rows)):
        raise ValueError("values must be finite")
    rows = np.clip(rows, 0.0, None)
    sums = rows.sum(axis=1, keepdims=True)
    if rows.shape[0] and not np.all(sums > 0):
        raise ValueError("every row needs a positive sum to be a probability vector")
    return rows / sums if rows.shape[0] else rows


def gaussian_mechanism(*, values: np.ndarray, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """Add i.i.d. N(0, sigma^2) noise to every entry.

    The guarantee depends on ``sigma / L2-sensitivity`` (the noise multiplier);
    see :mod:`fl_app.privacy.calibration` for the calibrations.

    Parameters
    ----------
    values : np.ndarray
        The query answer (any shape).
    sigma : float
        Noise standard deviation, ``>= 0`` (0 returns a float copy).
    rng : np.random.Generator
        Source of randomness.

    """
    _require_generator(rng)
    if not (math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"sigma must be a finite number >= 0, got {sigma!r}")
    values = np.asarray(values)
    out_dtype = values.dtype if np.issubdtype(values.dtype, np.floating) else np.float64
    if sigma == 0:
        return (values + 0.0).astype(out_dtype, copy=False)
    noise = rng.normal(0.0, sigma, size=values.shape)
    if values.ndim == 0 or np.result_type(values.dtype, noise.dtype) != noise.dtype:  # as it always was
        return (values + noise).astype(out_dtype, copy=False)
    # ``values + noise`` in the noise's own buffer (addition commutes exactly, so the same bits): one
    # float64 array less per call; a locally noised MLP upload (109k coordinates) took 2.4-2.8 ms
    # instead of 2.7-3.3 ms (best of 7, three alternations)
    np.add(noise, values, out=noise)
    return noise.astype(out_dtype, copy=False)


# --------------------------------------------------------------------------------------
# L2 clipping of a whole model (all arrays together)
# --------------------------------------------------------------------------------------


def global_l2_norm(arrays: Sequence[np.ndarray]) -> float:
    """L2 norm of the concatenation of all ``arrays``."""
    return float(math.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in arrays)))


def clip_l2(*, arrays: Sequence[np.ndarray], max_norm: float) -> tuple[list[np.ndarray], float]:
    """Scale all arrays together so their joint L2 norm is at most ``max_norm``.

    ``w <- w * min(1, C / ||w||)`` over the concatenation of every array, so any
    two clipped models are at most ``2C`` apart in L2.

    Parameters
    ----------
    arrays : Sequence[np.ndarray]
        The model (or model update) as a list of arrays.
    max_norm : float
        ``C > 0``.

    Returns
    -------
    tuple[list[np.ndarray], float]
        The clipped arrays (new objects) and the norm before clipping.

    """
    require_positive("max_norm", max_norm)
    norm = global_l2_norm(arrays)
    scale = min(1.0, max_norm / norm) if norm > 0 else 1.0
    return [np.asarray(a) * scale for a in arrays], norm


# --------------------------------------------------------------------------------------
# Online tree aggregation (binary-tree mechanism for prefix sums; DP-FTRL)
# --------------------------------------------------------------------------------------


def tree_node(step: int) -> tuple[int, int]:
    """The tree node the online tree aggregation completes at ``step``: leaves ``[start, step]``.

    Leaves are numbered from 1. The node ending at ``step`` spans the lowest set
    bit of ``step`` (``step & -step`` leaves): 1 -> [1, 1], 2 -> [1, 2],
    3 -> [3, 3], 4 -> [1, 4], 6 -> [5, 6]. Exactly one node gets new noise per step.
    """
    if isinstance(step, bool) or int(step) != step or step < 1:
        raise ValueError(f"step must be an integer >= 1, got {step!r}")
    step = int(step)
    return step - (step & -step) + 1, step


def tree_prefix_nodes(step: int) -> list[tuple[int, int]]:
    """The nodes whose sum is the prefix sum of leaves ``1..step`` (one per set bit of ``step``).

    Each is the node :func:`tree_node` completed at its end, so the noisy
    prefix sum at ``step`` is a sum of at most ``ceil(log2(step + 1))`` noisy
    nodes, each drawn once (Kairouz et al. 2021, Algorithm 1; Chan, Shi, Song 2011).
    Example: 6 -> [(1, 4), (5, 6)].
    """
    if isinstance(step, bool) or int(step) != step or step < 1:
        raise ValueError(f"step must be an integer >= 1, got {step!r}")
    nodes: list[tuple[int, int]] = []
    end = int(step)
    while end > 0:
        nodes.append(tree_node(end))
        end -= end & -end
    return nodes[::-1]


def local_gaussian_update(
    *, update: list[np.ndarray], clip: float, noise_multiplier: float, rng: np.random.Generator
) -> list[np.ndarray]:
    """FedAvg+LDP's upload: ``update`` clipped to L2 norm ``clip``, plus ``N(0, (z 2C)^2)`` per coordinate.

    The device's whole step (clients/fedavg_ldp.py) and the canaries' (they must take the same
    path); 2C is the L2 sensitivity of a clipped update when a client's data may change entirely.
    """
    from fl_app.privacy.calibration import local_gaussian_sigma

    sigma = local_gaussian_sigma(clip=clip, noise_multiplier=noise_multiplier)
    clipped, _ = clip_l2(arrays=update, max_norm=clip)
    return [gaussian_mechanism(values=c, sigma=sigma, rng=rng) for c in clipped]
