"""Mechanisms and calibrations: closed forms, properties (hypothesis), argument validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import norm

from fl_app.privacy import calibration as cal
from fl_app.privacy.composition import compose_epsilon
from fl_app.privacy.events import BinaryRandomizedResponse, RandomizedResponse
from fl_app.privacy.mechanisms import (
    binary_randomized_response,
    clip_l2,
    debias_label_average,
    gaussian_mechanism,
    global_l2_norm,
    laplace_mechanism,
    randomized_response_labels,
)
from strategies.dpfl_bnn import privacy as bnn_cal
from strategies.laplace_eval import privacy as laplace_cal
from strategies.nbafl import privacy as nbafl_cal
from strategies.privatekt import privacy as kt_cal

DELTA = 1e-5


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


# ----------------------------------------------------------------------------- mechanisms


def test_randomized_response_keeps_with_beta_else_uniform():
    beta, classes, n = 0.6, 5, 200_000
    out = randomized_response_labels(
        labels=np.full(n, 3), keep_probability=beta, num_classes=classes, rng=rng()
    )
    frequencies = np.bincount(out, minlength=classes) / n
    assert frequencies[3] == pytest.approx(beta + (1 - beta) / classes, abs=0.005)
    assert np.allclose(np.delete(frequencies, 3), (1 - beta) / classes, atol=0.005)


def test_debiased_average_is_unbiased():
    """Eq. 3: the mean of many debiased estimates equals the true average one-hot."""
    classes, clients, samples = 4, 30, 3
    true_labels = rng(1).integers(0, classes, size=(clients, samples))
    truth = np.eye(classes)[true_labels].mean(axis=0)
    beta = kt_cal.privatekt_keep_probability(epsilon=2.0, k=samples, num_classes=classes)
    generator = rng(2)
    estimates = [
        debias_label_average(
            perturbed_labels=randomized_response_labels(
                labels=true_labels, keep_probability=beta, num_classes=classes, rng=generator
            ),
            keep_probability=beta,
            num_classes=classes,
        )
        for _ in range(3000)
    ]
    assert np.allclose(np.mean(estimates, axis=0), truth, atol=0.02)


def test_binary_rr_flips_each_coordinate_independently():
    gamma, n = 0.15, 400_000
    signs = np.where(rng(3).random(n) < 0.5, -1.0, 1.0)
    out = binary_randomized_response(signs=signs, gamma=gamma, rng=rng(4))
    flipped = out != signs
    assert flipped.mean() == pytest.approx(0.5 - gamma, abs=0.003)
    # per coordinate, not per block: flips in neighbouring coordinates are uncorrelated
    assert abs(np.corrcoef(flipped[:-1], flipped[1:])[0, 1]) < 0.01
    assert set(np.unique(out)) <= {-1.0, 1.0}


def test_laplace_and_gaussian_noise_scales():
    values = np.zeros(200_000)
    lap = laplace_mechanism(values=values, sensitivity=2.0, epsilon=4.0, rng=rng(5))
    assert np.mean(np.abs(lap)) == pytest.approx(0.5, rel=0.01)  # E|Lap(b)| = b = 2/4
    gauss = gaussian_mechanism(values=values, sigma=3.0, rng=rng(6))
    assert np.std(gauss) == pytest.approx(3.0, rel=0.01)
    assert np.array_equal(gaussian_mechanism(values=np.ones(3), sigma=0.0, rng=rng()), np.ones(3))


def test_mechanisms_do_not_touch_global_random_state():
    np.random.seed(123)
    expected = np.random.random()
    np.random.seed(123)
    laplace_mechanism(values=np.zeros(10), sensitivity=1.0, epsilon=1.0, rng=rng())
    randomized_response_labels(labels=np.zeros(10, int), keep_probability=0.5, num_classes=3, rng=rng())
    assert np.random.random() == expected


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: laplace_mechanism(values=[1.0], sensitivity=0, epsilon=1, rng=rng()), "sensitivity"),
        (lambda: laplace_mechanism(values=[1.0], sensitivity=1, epsilon=-1, rng=rng()), "epsilon"),
        (lambda: gaussian_mechanism(values=[1.0], sigma=-1, rng=rng()), "sigma"),
        (lambda: binary_randomized_response(signs=[1, -1], gamma=0.5, rng=rng()), "gamma"),
        (lambda: binary_randomized_response(signs=[1, 0], gamma=0.1, rng=rng()), "-1 and"),
        (
            lambda: randomized_response_labels(labels=[5], keep_probability=0.5, num_classes=3, rng=rng()),
            "labels",
        ),
        (
            lambda: randomized_response_labels(labels=[0], keep_probability=1.5, num_classes=3, rng=rng()),
            "keep_probability",
        ),
        (lambda: clip_l2(arrays=[np.ones(2)], max_norm=0), "max_norm"),
        (lambda: laplace_mechanism(values=[1.0], sensitivity=1, epsilon=1, rng=np.random), "Generator"),
    ],
)
def test_mechanisms_validate_arguments(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-100, 100), min_size=1, max_size=20), st.floats(0.01, 50))
def test_clipping_never_increases_a_norm_and_bounds_it(values, max_norm):
    arrays = [np.asarray(values[: len(values) // 2 + 1]), np.asarray(values[len(values) // 2 + 1 :])]
    clipped, original = clip_l2(arrays=arrays, max_norm=max_norm)
    after = global_l2_norm(clipped)
    assert original == pytest.approx(global_l2_norm(arrays))
    assert after <= min(original, max_norm) * (1 + 1e-9) + 1e-12
    if original <= max_norm:
        assert all(np.array_equal(a, c) for a, c in zip(arrays, clipped, strict=True))


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 20), st.floats(0, 1), st.lists(st.integers(0, 19), min_size=1, max_size=50))
def test_randomized_response_outputs_stay_in_range(classes, beta, labels):
    labels = np.asarray(labels) % classes
    out = randomized_response_labels(labels=labels, keep_probability=beta, num_classes=classes, rng=rng())
    assert out.shape == labels.shape
    assert out.min() >= 0
    assert out.max() < classes


# ----------------------------------------------------------------------------- calibration


def test_privatekt_beta_lemma1_and_epsilon_of_the_report():
    beta = kt_cal.privatekt_keep_probability(epsilon=5.0, k=2, num_classes=10)
    assert beta == pytest.approx((math.exp(2.5) - 1) / (math.exp(2.5) - 1 + 10))
    # Each label is eps/K-LDP: its likelihood ratio is exactly e^(eps/K).
    ratio = (beta + (1 - beta) / 10) / ((1 - beta) / 10)
    assert math.log(ratio) == pytest.approx(2.5)
    assert RandomizedResponse(2.5, 10).keep_probability == pytest.approx(beta)


@settings(max_examples=40, deadline=None)
@given(st.floats(0.01, 20), st.floats(0.01, 20), st.integers(1, 10), st.integers(2, 100))
def test_beta_is_monotone_in_epsilon(e1, e2, k, classes):
    low, high = sorted((e1, e2))
    assert kt_cal.privatekt_keep_probability(
        epsilon=low, k=k, num_classes=classes
    ) <= kt_cal.privatekt_keep_probability(epsilon=high, k=k, num_classes=classes)


def test_classic_gaussian_constant_and_range():
    assert cal.classic_gaussian_constant(delta=1e-5) == pytest.approx(math.sqrt(2 * math.log(1.25e5)))
    sigma = cal.classic_gaussian_sigma(sensitivity=2.0, epsilon=0.5, delta=1e-5)
    assert sigma == pytest.approx(math.sqrt(2 * math.log(1.25e5)) * 2.0 / 0.5)
    with pytest.raises(ValueError, match="epsilon < 1"):
        cal.classic_gaussian_sigma(sensitivity=1.0, epsilon=2.0, delta=1e-5)
    with pytest.warns(cal.ClassicGaussianRangeWarning):
        cal.classic_gaussian_sigma(sensitivity=1.0, epsilon=2.0, delta=1e-5, strict=False)


def analytic_delta(sigma: float, epsilon: float) -> float:
    """Balle & Wang 2018, Theorem 8: the exact delta of the Gaussian mechanism (sensitivity 1)."""
    mu = 1.0 / sigma
    return norm.cdf(mu / 2 - epsilon / mu) - math.exp(epsilon) * norm.cdf(-mu / 2 - epsilon / mu)


@pytest.mark.parametrize(("epsilon", "delta"), [(0.1, 1e-5), (1.0, 1e-5), (3.0, 1e-6), (8.0, 1e-3)])
def test_analytic_gaussian_is_exact(epsilon, delta):
    sigma = cal.analytic_gaussian_sigma(sensitivity=1.0, epsilon=epsilon, delta=delta)
    assert analytic_delta(sigma, epsilon) <= delta * (1 + 1e-6)
    assert analytic_delta(sigma * 0.99, epsilon) > delta
    if epsilon < 1:
        assert sigma < cal.classic_gaussian_sigma(sensitivity=1.0, epsilon=epsilon, delta=delta)


@settings(max_examples=25, deadline=None)
@given(st.floats(0.05, 20), st.sampled_from([1e-3, 1e-5, 1e-7]))
def test_analytic_calibration_never_overshoots(epsilon, delta):
    sigma = cal.analytic_gaussian_sigma(sensitivity=1.0, epsilon=epsilon, delta=delta)
    assert analytic_delta(sigma, epsilon) <= delta * (1 + 1e-6)


def test_nbafl_formulas_by_hand():
    c = math.sqrt(2 * math.log(1.25 / 0.01))
    up = nbafl_cal.nbafl_uplink_sigma(epsilon=0.5, delta=0.01, clip=2.0, min_dataset_size=100, exposures=1)
    assert up == pytest.approx(c * 1 * (2 * 2.0 / 100) / 0.5)
    down = nbafl_cal.nbafl_downlink_sigma(
        epsilon=50, delta=0.01, clip=2.0, min_dataset_size=100, exposures=2, num_rounds=30, num_clients=50
    )
    assert down == pytest.approx(2 * c * 2.0 * math.sqrt(30**2 - 4 * 50) / (100 * 50 * 50))
    assert (
        nbafl_cal.nbafl_downlink_sigma(
            epsilon=50, delta=0.01, clip=2.0, min_dataset_size=100, exposures=2, num_rounds=14, num_clients=50
        )
        == 0.0
    )  # 14 <= 2 sqrt(50)


def test_bnn_gamma_meets_epsilon_and_beats_theorem1_order():
    for epsilon, rounds in [(1.0, 100), (4.0, 100), (10.0, 10)]:
        gamma = bnn_cal.bnn_gamma(epsilon=epsilon, delta=DELTA, rounds=rounds)
        spent = compose_epsilon({BinaryRandomizedResponse(gamma): rounds}, delta=DELTA).epsilon
        assert spent <= epsilon * (1 + 1e-9)
        assert spent > epsilon * 0.99  # the largest such gamma
        assert gamma >= bnn_cal.bnn_gamma_theorem1(epsilon=epsilon, delta=DELTA, rounds=rounds)


def test_bnn_theorem1_gamma_is_sound_by_its_own_conversion():
    """With alpha = 1 + 2 log(1/delta)/eps: T rho(alpha) + log(1/delta)/(alpha - 1) <= eps."""
    epsilon, rounds = 2.0, 50
    gamma = bnn_cal.bnn_gamma_theorem1(epsilon=epsilon, delta=DELTA, rounds=rounds)
    order = 1 + 2 * math.log(1 / DELTA) / epsilon
    total = rounds * bnn_cal.bnn_rdp_closed_form(gamma=gamma, order=order) + math.log(1 / DELTA) / (order - 1)
    assert total <= epsilon * (1 + 1e-9)


@settings(max_examples=6, deadline=None)
@given(st.floats(0.2, 20), st.floats(0.2, 20), st.integers(1, 200))
def test_gamma_is_monotone_in_epsilon(e1, e2, rounds):
    low, high = sorted((e1, e2))
    assert (
        bnn_cal.bnn_gamma(epsilon=low, delta=DELTA, rounds=rounds)
        <= bnn_cal.bnn_gamma(epsilon=high, delta=DELTA, rounds=rounds) + 1e-12
    )


def test_laplace_tail_rule_of_the_mindspore_document():
    # tau = 1e-5, p = 0.9, sensitivity 1 (the document): ln(10) / 1e-5
    assert laplace_cal.laplace_epsilon_for_tail(tau=1e-5, probability=0.9, sensitivity=1.0) == pytest.approx(
        math.log(10) / 1e-5
    )
    # with the correct sensitivity 2 the same noise level costs twice the epsilon
    assert laplace_cal.laplace_epsilon_for_tail(tau=1e-5, probability=0.9, sensitivity=2.0) == pytest.approx(
        2 * math.log(10) / 1e-5
    )
    assert laplace_cal.laplace_scale(sensitivity=2.0, epsilon=4.0) == 0.5


@settings(max_examples=4, deadline=None)
@given(st.floats(0.5, 10), st.sampled_from([0.05, 0.2, 1.0]), st.integers(1, 60))
def test_dp_fedavg_calibration_never_overshoots(epsilon, rate, rounds):
    z = cal.dp_fedavg_noise_multiplier(epsilon=epsilon, delta=DELTA, sampling_rate=rate, rounds=rounds)
    spent = cal.gaussian_epsilon(noise_multiplier=z, sampling_rate=rate, rounds=rounds, delta=DELTA)
    assert spent <= epsilon
    assert spent > 0.98 * epsilon


@settings(max_examples=6, deadline=None)
@given(st.floats(0.5, 50), st.integers(1, 300), st.sampled_from([2, 10]))
def test_rr_total_budget_calibration_never_overshoots(total, labels, classes):
    per_label = cal.randomized_response_epsilon_per_label(
        total_epsilon=total, delta=DELTA, labels=labels, num_classes=classes
    )
    spent = compose_epsilon({RandomizedResponse(per_label, classes): labels}, delta=DELTA).epsilon
    assert spent <= total * (1 + 1e-9)


@pytest.mark.parametrize(
    "call",
    [
        lambda: kt_cal.privatekt_keep_probability(epsilon=0, k=2, num_classes=10),
        lambda: kt_cal.privatekt_keep_probability(epsilon=1, k=0, num_classes=10),
        lambda: nbafl_cal.nbafl_uplink_sigma(
            epsilon=1, delta=0.01, clip=-1, min_dataset_size=10, exposures=1
        ),
        lambda: nbafl_cal.nbafl_uplink_sigma(epsilon=1, delta=1.5, clip=1, min_dataset_size=10, exposures=1),
        lambda: bnn_cal.bnn_gamma(epsilon=1, delta=0, rounds=10),
        lambda: laplace_cal.laplace_epsilon_for_tail(tau=1e-5, probability=1.0, sensitivity=1),
        lambda: cal.dp_fedavg_noise_multiplier(epsilon=1, delta=1e-5, sampling_rate=0, rounds=10),
    ],
)
def test_calibrations_validate_arguments(call):
    with pytest.raises(ValueError):
        call()
