"""Golden values of the composition and the accountant against independent oracles.

Oracles: closed forms (exact randomized-response privacy-loss sum, Mironov's RDP
of randomized response, the analytic Gaussian), Opacus's RDP analysis and
Flower 1.41's own RdpAccountant. None of them shares code with
``fl_app.privacy.composition`` beyond dp-accounting itself, which Opacus and the
exact sums do not use.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from opacus.accountants.analysis import rdp as opacus_rdp
from scipy.special import logsumexp
from scipy.stats import binom, multinomial

from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.composition import RDP_ORDERS, compose_epsilon, rdp_curve
from fl_app.privacy.events import (
    BinaryRandomizedResponse,
    Gaussian,
    Laplace,
    PrivacyEvent,
    RandomizedResponse,
    SampledGaussian,
)

DELTA = 1e-5


def exact_rr_epsilon(epsilon0: float, classes: int, count: int, delta: float) -> float:
    """Exact epsilon of k-ary RR composed ``count`` times (tight: optimal privacy-loss sum).

    Neighbouring inputs x != x'. Per report the output is x (prob a), x' (prob b) or
    another class (prob (k-2) b), with privacy loss +eps0, -eps0, 0. The composition's
    loss is eps0 (n_x - n_x'); delta(eps) = E[(1 - e^(eps - L))_+] over the trinomial law.
    """
    a = math.exp(epsilon0) / (math.exp(epsilon0) + classes - 1)
    b = 1.0 / (math.exp(epsilon0) + classes - 1)
    other = (classes - 2) * b
    counts = [(i, j) for i in range(count + 1) for j in range(count + 1 - i)]
    pmf = np.array([multinomial.pmf([i, j, count - i - j], count, [a, b, other]) for i, j in counts])
    loss = np.array([epsilon0 * (i - j) for i, j in counts])

    def delta_of(eps: float) -> float:
        return float(np.sum(pmf * np.clip(1 - np.exp(eps - loss), 0, None)))

    low, high = 0.0, epsilon0 * count
    for _ in range(80):
        middle = (low + high) / 2
        low, high = (middle, high) if delta_of(middle) > delta else (low, middle)
    return high


def test_randomized_response_golden_values():
    """A golden example: 10 classes, per-report eps 2.5, 100 reports, delta 1e-5."""
    report = compose_epsilon({RandomizedResponse(2.5, 10): 100}, delta=DELTA, method="pld")
    assert report.basic == pytest.approx(250.0)
    assert report.rdp == pytest.approx(194.7, abs=0.5)
    exact = exact_rr_epsilon(2.5, 10, 100, DELTA)
    assert exact == pytest.approx(189.69, abs=0.05)
    # PLD with pessimistic discretisation: an upper bound, within 0.01 of the exact value.
    assert exact <= report.pld <= exact + 0.01
    assert report.epsilon == report.pld


def test_pld_composes_randomized_response_count():
    """dp-accounting 0.6.0's PLDAccountant drops the count for RR; ours must not."""
    once = compose_epsilon({RandomizedResponse(2.5, 10): 1}, delta=DELTA, method="pld").pld
    many = compose_epsilon({RandomizedResponse(2.5, 10): 100}, delta=DELTA, method="pld").pld
    assert once == pytest.approx(2.5, abs=1e-3)
    assert many > 150


def test_rdp_of_randomized_response_matches_closed_form():
    """Mironov's RDP of k-ary RR under replacement, evaluated in log space."""
    epsilon0, classes = 2.5, 10
    a = math.exp(epsilon0) / (math.exp(epsilon0) + classes - 1)
    b = 1.0 / (math.exp(epsilon0) + classes - 1)
    curve = rdp_curve(RandomizedResponse(epsilon0, classes))
    for order, value in zip(RDP_ORDERS, curve, strict=True):
        if order > 256:
            continue
        terms = [
            order * math.log(a) + (1 - order) * math.log(b),
            order * math.log(b) + (1 - order) * math.log(a),
            math.log((classes - 2) * b),
        ]
        assert value == pytest.approx(logsumexp(terms) / (order - 1), rel=1e-9, abs=1e-12)


def test_binary_rr_is_two_bucket_rr_with_pure_epsilon():
    for gamma in (0.05, 0.2, 0.4):
        mechanism = BinaryRandomizedResponse(gamma)
        assert mechanism.pure_epsilon == pytest.approx(math.log((0.5 + gamma) / (0.5 - gamma)))
        exact_single = compose_epsilon({mechanism: 1}, delta=DELTA)
        assert exact_single.epsilon == pytest.approx(mechanism.pure_epsilon)


def test_binary_rr_many_compositions_against_exact_binomial():
    """T uses of RR_gamma: exact epsilon from the binomial law of the number of kept bits."""
    gamma, uses = 0.1, 400
    p = 0.5 + gamma
    eps0 = math.log(p / (1 - p))
    kept = np.arange(uses + 1)
    pmf = binom.pmf(kept, uses, p)
    loss = eps0 * (2 * kept - uses)

    def delta_of(eps: float) -> float:
        return float(np.sum(pmf * np.clip(1 - np.exp(eps - loss), 0, None)))

    low, high = 0.0, eps0 * uses
    for _ in range(80):
        middle = (low + high) / 2
        low, high = (middle, high) if delta_of(middle) > DELTA else (low, middle)
    report = compose_epsilon({BinaryRandomizedResponse(gamma): uses}, delta=DELTA, method="pld")
    assert high <= report.pld <= high * 1.01  # pessimistic discretisation: sound, within 1%
    assert report.rdp >= high


def test_sampled_gaussian_matches_opacus_and_flower():
    """z = 1, q = 0.1, 30 rounds: Opacus and Flower's accountant give the same RDP epsilon."""
    orders = [o for o in RDP_ORDERS]
    rdp = opacus_rdp.compute_rdp(q=0.1, noise_multiplier=1.0, steps=30, orders=orders)
    opacus_eps, _ = opacus_rdp.get_privacy_spent(orders=orders, rdp=rdp, delta=DELTA)
    from flwr.serverapp import (
        GaussianPrivacyEvent,
        NeighboringRelation,
        PrivacyConfig,
        RdpAccountant,
        SamplingMethod,
    )

    flower = RdpAccountant(
        PrivacyConfig(
            target_delta=DELTA,
            population_size=100,
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.POISSON,
        )
    )
    flower.compose(GaussianPrivacyEvent(noise_multiplier=1.0, sample_size=10, population_size=100), count=30)
    ours = compose_epsilon({SampledGaussian(1.0, 0.1): 30}, delta=DELTA, method="pld")
    assert ours.rdp == pytest.approx(opacus_eps, rel=1e-6)
    assert ours.rdp == pytest.approx(flower.get_epsilon(DELTA), rel=1e-6)
    assert ours.pld < ours.rdp
    assert ours.epsilon == pytest.approx(4.178, abs=0.01)


@pytest.mark.parametrize("seed", range(4))
def test_vectorised_sampled_gaussian_rdp_is_dp_accountings_bit_for_bit(seed: int) -> None:
    """``fl_app.privacy.rdp`` must give exactly dp-accounting's curve: every epsilon depends on it."""
    from dp_accounting.rdp import rdp_privacy_accountant as reference

    from fl_app.privacy.rdp import poisson_subsampled_gaussian_rdp

    rng = np.random.default_rng(seed)
    cases = [(0.0, 1.0), (1.0, 1.3), (0.5, 0.0), (1e-6, 0.7), (0.999, 40.0), (0.02, 0.05)]
    cases += [(float(rng.uniform(1e-4, 0.999)), float(rng.uniform(0.1, 30.0))) for _ in range(6)]
    orders = [*RDP_ORDERS, 1.5001, 7.3, 300.0, float("inf")]
    for q, z in cases:
        want = reference._compute_rdp_poisson_subsampled_gaussian(q, z, orders)
        got = poisson_subsampled_gaussian_rdp(q=q, noise_multiplier=z, orders=orders)
        assert np.array_equal(got, want), (q, z, np.flatnonzero(got != want))
    with pytest.raises(ValueError, match="Sampling rate"):
        poisson_subsampled_gaussian_rdp(q=1.5, noise_multiplier=1.0, orders=[2.0])
    with pytest.raises(ValueError, match="non-negative"):
        poisson_subsampled_gaussian_rdp(q=0.5, noise_multiplier=-1.0, orders=[2.0])


def test_gaussian_composition_matches_exact_gaussian():
    """T Gaussians with multiplier z compose exactly to one Gaussian with z / sqrt(T)."""
    import dp_accounting

    exact = dp_accounting.get_epsilon_gaussian(1.0 / math.sqrt(30), DELTA)
    report = compose_epsilon({Gaussian(1.0): 30}, delta=DELTA, method="pld")
    assert report.pld == pytest.approx(exact, rel=1e-3)
    assert report.pld >= exact - 1e-6
    assert report.rdp >= exact


def test_laplace_basic_and_rdp():
    report = compose_epsilon({Laplace(0.5): 100}, delta=DELTA, method="pld")
    assert report.basic == pytest.approx(50.0)
    assert report.rdp == pytest.approx(29.97, abs=0.05)
    assert report.epsilon == report.pld < report.rdp
    single = compose_epsilon({Laplace(0.5): 1}, delta=DELTA)
    assert single.epsilon == pytest.approx(0.5)


def test_accountant_counts_each_clients_rounds_and_reports_worst():
    accountant = PrivacyAccountant(population=[0, 1, 2, 3], unit="one report")
    rr = RandomizedResponse(1.0, 10)
    for server_round, participants in enumerate([(0, 1), (0, 2), (0, 3)], start=1):
        accountant.record(PrivacyEvent(server_round, rr, count=2, participants=participants))
    assert accountant.rounds_participated(0) == 3
    assert accountant.rounds_participated(1) == 1
    assert accountant.history(0) == {rr: 6}
    assert accountant.epsilon(delta=DELTA).epsilon == pytest.approx(
        compose_epsilon({rr: 6}, delta=DELTA).epsilon
    )
    # Two reports of a 1.0-LDP mechanism: basic gives 2.0; RDP at delta > 0 may be slightly below.
    assert 1.99 < accountant.epsilon(delta=DELTA, client=3).epsilon <= 2.0
    assert accountant.basic_epsilon() == pytest.approx(6.0)


def test_accountant_events_for_everyone_and_mixed_mechanisms():
    accountant = PrivacyAccountant(population=range(5), unit="one client")
    accountant.record(PrivacyEvent(1, SampledGaussian(1.0, 0.2)))
    accountant.record(PrivacyEvent(1, Laplace(1.0), participants=(2,)))
    assert accountant.history(0) == {SampledGaussian(1.0, 0.2): 1}
    mixed = compose_epsilon({SampledGaussian(1.0, 0.2): 1, Laplace(1.0): 1}, delta=DELTA)
    assert accountant.epsilon(delta=DELTA).epsilon == pytest.approx(mixed.epsilon)
    assert accountant.basic_epsilon() is None


def test_accountant_state_round_trip_and_validation():
    accountant = PrivacyAccountant(population=[0, 1, 2], unit="one report", method="pld")
    accountant.record(PrivacyEvent(1, RandomizedResponse(2.0, 10), count=3, participants=(0, 2)))
    accountant.record(PrivacyEvent(2, BinaryRandomizedResponse(0.2), count=5, participants=(1,)))
    restored = PrivacyAccountant.from_state_dict(accountant.state_dict())
    assert restored.epsilon(delta=DELTA) == accountant.epsilon(delta=DELTA)
    assert restored.events == accountant.events
    with pytest.raises(ValueError, match="outside the population"):
        accountant.record(PrivacyEvent(3, Laplace(1.0), participants=(7,)))
    with pytest.raises(ValueError, match="twice"):
        accountant.record(PrivacyEvent(3, Laplace(1.0), participants=(1, 1)))


def test_unpicked_clients_have_zero_epsilon():
    accountant = PrivacyAccountant(population=[0, 1], unit="one report")
    accountant.record(PrivacyEvent(1, Laplace(1.0), participants=(0,)))
    assert accountant.epsilon(delta=DELTA, client=1).epsilon == 0.0
    assert accountant.epsilon(delta=DELTA).epsilon == pytest.approx(1.0)


def test_a_noise_too_small_to_evaluate_has_no_finite_epsilon(tmp_path):
    """A Poisson-subsampled Gaussian of noise 1e-200: its RDP overflows to NaN at some orders, which
    dp-accounting's conversion read as epsilon 0. It is infinite (RDP), and PLD does not crash;
    through DP-FedAvg with that noise set, the run's epsilon is infinite."""
    from conftest import DP_FEDAVG_RUN, build_run_context, reply_to
    from flwr.app import ConfigRecord

    from strategies import STRATEGIES

    for method in ("rdp", "pld"):
        report = compose_epsilon({SampledGaussian(1e-200, 0.05): 40}, delta=1e-5, method=method)
        assert report.epsilon == math.inf, (method, report)
    overrides = [*DP_FEDAVG_RUN, "strategy.noise_multiplier=1e-200", "privacy.accountant=rdp"]
    strategy = STRATEGIES.get("dp_fedavg")(build_run_context(overrides, tmp_path))
    arrays = strategy.initial_arrays()
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid=None))
    strategy.aggregate_train(1, [reply_to(m, arrays=arrays, metrics={"num-examples": 1}) for m in messages])
    assert strategy.accountant.events and strategy.epsilon().epsilon == math.inf
