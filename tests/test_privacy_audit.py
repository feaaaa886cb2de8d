"""Empirical privacy audit of every mechanism, and a check that the audit can catch a bug.

For each mechanism: sample many outputs on two neighbouring inputs, lower-bound the
privacy loss with Clopper-Pearson margins (``fl_app.privacy.audit``). The calibrated
mechanism must pass its claimed epsilon; the same mechanism claiming half its true
epsilon (a deliberate mis-calibration) must fail.
"""

from __future__ import annotations

import numpy as np
import pytest

from fl_app.privacy import calibration as cal
from fl_app.privacy.audit import audit_epsilon
from fl_app.privacy.mechanisms import (
    binary_randomized_response,
    gaussian_mechanism,
    laplace_mechanism,
    randomized_response_labels,
)
from strategies.privatekt import privacy as kt_cal

SAMPLES = 300_000


def generator(seed: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(seed))


def rr_outputs(epsilon: float, classes: int = 10) -> tuple[np.ndarray, np.ndarray]:
    beta = kt_cal.privatekt_keep_probability(epsilon=epsilon, k=1, num_classes=classes)
    a = randomized_response_labels(
        labels=np.zeros(SAMPLES, int), keep_probability=beta, num_classes=classes, rng=generator(1)
    )
    b = randomized_response_labels(
        labels=np.ones(SAMPLES, int), keep_probability=beta, num_classes=classes, rng=generator(2)
    )
    return a, b


def binary_rr_outputs(gamma: float) -> tuple[np.ndarray, np.ndarray]:
    a = binary_randomized_response(signs=np.ones(SAMPLES), gamma=gamma, rng=generator(3))
    b = binary_randomized_response(signs=-np.ones(SAMPLES), gamma=gamma, rng=generator(4))
    return a, b


def laplace_outputs(epsilon: float, sensitivity: float = 2.0) -> tuple[np.ndarray, np.ndarray]:
    """Softmax-like inputs that differ by the full L1 sensitivity 2: (1, 0) vs (0, 1)."""
    x = np.tile([1.0, 0.0], (SAMPLES, 1))
    y = np.tile([0.0, 1.0], (SAMPLES, 1))
    a = laplace_mechanism(values=x, sensitivity=sensitivity, epsilon=epsilon, rng=generator(5))
    b = laplace_mechanism(values=y, sensitivity=sensitivity, epsilon=epsilon, rng=generator(6))
    # The optimal statistic for this pair: the difference of the two coordinates.
    return a[:, 0] - a[:, 1], b[:, 0] - b[:, 1]


def gaussian_outputs(epsilon: float, delta: float) -> tuple[np.ndarray, np.ndarray]:
    sigma = cal.analytic_gaussian_sigma(sensitivity=1.0, epsilon=epsilon, delta=delta)
    n = 4 * SAMPLES
    a = gaussian_mechanism(values=np.zeros(n), sigma=sigma, rng=generator(7))
    b = gaussian_mechanism(values=np.ones(n), sigma=sigma, rng=generator(8))
    return a, b


@pytest.mark.parametrize(
    ("name", "outputs", "true_epsilon", "discrete", "delta"),
    [
        ("randomized response", lambda: rr_outputs(1.5), 1.5, True, 0.0),
        ("binary randomized response", lambda: binary_rr_outputs(0.2), float(np.log(0.7 / 0.3)), True, 0.0),
        ("laplace, sensitivity 2", lambda: laplace_outputs(1.0), 1.0, False, 0.0),
        ("gaussian (analytic)", lambda: gaussian_outputs(1.0, 1e-5), 1.0, False, 1e-5),
    ],
)
def test_audit_passes_calibrated_and_catches_half_epsilon(name, outputs, true_epsilon, discrete, delta):
    a, b = outputs()
    result = audit_epsilon(outputs_a=a, outputs_b=b, discrete=discrete, delta=delta)
    assert result.passes(true_epsilon), f"{name}: {result}"
    # A deliberately mis-calibrated claim (half the true epsilon) must be caught.
    assert not result.passes(true_epsilon / 2), f"{name}: {result}"


def test_audit_catches_the_documents_sensitivity_error():
    """Laplace calibrated with sensitivity 1 (the MindSpore document) on probability vectors.

    Claimed epsilon 1 with scale 1/1; the true epsilon for vectors differing by 2 in L1 is 2.
    """
    a, b = laplace_outputs(1.0, sensitivity=1.0)
    result = audit_epsilon(outputs_a=a, outputs_b=b, discrete=False)
    assert not result.passes(1.0), result
    assert result.passes(2.0), result


def test_audit_rejects_bad_arguments():
    with pytest.raises(ValueError):
        audit_epsilon(outputs_a=np.array([]), outputs_b=np.array([1.0]), discrete=True)
    with pytest.raises(ValueError):
        audit_epsilon(outputs_a=np.ones(3), outputs_b=np.ones(3), discrete=True, confidence=1.0)
