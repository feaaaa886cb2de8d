"""Empirical privacy estimation with canary clients (fl_app/privacy/canaries.py).

Layers: the estimator against closed forms and an independent oracle (dp-accounting's PLD of
the Gaussian mechanism); the exact hockey-stick divergence against numerical integration;
then end to end through the strategies on constructed replies: a correct mechanism gives an
estimate whose interval starts at or below the accountant's epsilon, and the mutants a
reviewer fears (no noise; a clip twice what the accountant assumes) give one whose whole
interval lies above it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import build_run_context, reply_to
from flwr.app import Array, ArrayRecord, ConfigRecord

from fl_app.config import compose_config
from fl_app.privacy.canaries import (
    CanaryPopulation,
    estimate_epsilon,
    gaussian_pair_epsilon,
    gdp_epsilon,
    hockey_stick_gaussians,
)
from fl_app.privacy.rng import RandomSource
from fl_app.validation import ConfigError, validate_config
from strategies import STRATEGIES
from strategies.arrays import flat_vector, split_vector

# --------------------------------------------------------------------------- the estimator


@pytest.mark.parametrize("mu", [0.3, 1.0, 2.0, 4.0])
@pytest.mark.parametrize("delta", [1e-5, 1e-3])
def test_equal_variance_gaussians_give_the_gaussian_mechanism_epsilon(mu, delta):
    # Oracle: dp-accounting's privacy loss distribution of the Gaussian mechanism with sensitivity 1
    # and standard deviation 1/mu (mu-GDP), an independent implementation.
    from dp_accounting.pld import privacy_loss_distribution

    pld = privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=1.0 / mu, sensitivity=1.0, value_discretization_interval=1e-4
    )
    oracle = pld.get_epsilon_for_delta(delta)
    for scale in (1.0, 0.01):  # cosines live at the scale 1/sqrt(d)
        got = gaussian_pair_epsilon(mu0=0.0, s0=scale, mu1=mu * scale, s1=scale, delta=delta)
        assert got == pytest.approx(oracle, rel=2e-3, abs=2e-3)
    assert gdp_epsilon(mu=mu, delta=delta) == pytest.approx(oracle, rel=2e-3, abs=2e-3)


@pytest.mark.parametrize(
    ("mu_p", "s_p", "mu_q", "s_q", "epsilon"),
    [
        (1.0, 1.0, 0.0, 1.0, 0.5),
        (0.5, 1.5, 0.0, 1.0, 1.0),
        (0.2, 0.7, 0.0, 1.0, 0.3),
        (3.0, 2.0, 1.0, 1.0, 2.0),
    ],
)
def test_hockey_stick_matches_numerical_integration(mu_p, s_p, mu_q, s_q, epsilon):
    x = np.linspace(-40, 40, 800_001)
    p = np.exp(-((x - mu_p) ** 2) / (2 * s_p**2)) / (s_p * math.sqrt(2 * math.pi))
    q = np.exp(-((x - mu_q) ** 2) / (2 * s_q**2)) / (s_q * math.sqrt(2 * math.pi))
    numeric = float(np.sum(np.maximum(p - math.exp(epsilon) * q, 0.0)) * (x[1] - x[0]))
    exact = hockey_stick_gaussians(mu_p=mu_p, s_p=s_p, mu_q=mu_q, s_q=s_q, epsilon=epsilon)
    assert exact == pytest.approx(numeric, abs=1e-6)


def test_estimate_recovers_the_gdp_epsilon_of_synthetic_cosines():
    rng = np.random.default_rng(3)
    d, mu, delta = 50_000, 1.5, 1e-5
    null = rng.normal(0.0, 1 / math.sqrt(d), size=2000)
    inserted = rng.normal(mu / math.sqrt(d), 1 / math.sqrt(d), size=2000)
    estimate = estimate_epsilon(inserted=inserted, null=null, delta=delta, rng=rng)
    truth = gdp_epsilon(mu=mu, delta=delta)
    assert estimate.low <= truth <= estimate.high
    assert estimate.epsilon == pytest.approx(truth, rel=0.35)
    # No signal: the estimate is small (unequal sample variances alone cost a little).
    quiet = estimate_epsilon(
        inserted=rng.normal(0, 1, 2000), null=rng.normal(0, 1, 2000), delta=delta, rng=rng
    )
    assert quiet.low < 0.5


def test_canaries_are_sampled_at_the_rate_and_never_beyond_the_cap():
    canaries = CanaryPopulation(
        count=400, rate=0.25, dimension=10, randomness=RandomSource(seed=1), max_participations=2
    )
    counts = [len(canaries.sampled(t)) for t in range(1, 9)]
    assert 60 < counts[0] < 140
    assert canaries.participations.max() == 2
    assert np.array_equal(canaries.direction(7), canaries.direction(7))
    assert np.linalg.norm(canaries.direction(7)) == pytest.approx(1.0)
    assert abs(canaries.direction(7) @ canaries.direction(8)) < 1


def test_canaries_are_refused_where_the_method_does_not_apply():
    for name in ("fedavg", "privatekt", "dpfl_bnn"):
        with pytest.raises(ConfigError, match=r"privacy.canaries=10: must be 0: strategy="):
            validate_config(
                compose_config(["dataset=digits", f"strategy={name}", "privacy.canaries=10"]),
                check_data=False,
            )
    with pytest.raises(ConfigError, match=r"privacy.canaries=1: must be 0 \(off\) or >= 2"):
        validate_config(
            compose_config(["dataset=digits", "strategy=dp_fedavg", "privacy.canaries=1"]), check_data=False
        )


# --------------------------------------------------------------------------- through the strategies

SHAPE = ["dataset=digits", "num_clients=20", "clients_per_round=10", "num_rounds=5", "privacy.epsilon=2"]
SETTINGS = {"dp_fedavg_adaptive": ["strategy.bit_noise=3.0"]}


def canary_run(name: str, tmp_path: Path, *, mutate: Any = None, canaries: int = 200) -> tuple[dict, float]:
    """Five rounds of ``name`` on constructed replies (each real update: norm 2, random direction)."""
    overrides = [*SHAPE, f"strategy={name}", f"privacy.canaries={canaries}", *SETTINGS.get(name, [])]
    run = build_run_context(overrides, tmp_path)
    strategy = STRATEGIES.get(name)(run)
    if mutate is not None:
        mutate(strategy)
    arrays = strategy.initial_arrays()
    rng = np.random.default_rng(0)
    for server_round in range(1, 6):
        base = flat_vector(arrays)
        like = [arrays[n].numpy() for n in arrays]
        replies = []
        for message in strategy.configure_train(server_round, arrays, ConfigRecord(), grid=None):
            step = rng.standard_normal(base.size)
            parts = split_vector(base + 2.0 * step / np.linalg.norm(step), like)
            record = ArrayRecord(
                {n: Array(p.astype(np.float32)) for n, p in zip(arrays.keys(), parts, strict=True)}
            )
            replies.append(reply_to(message, arrays=record))
        arrays, _ = strategy.aggregate_train(server_round, replies)
    empirical = strategy.empirical_privacy(arrays)
    assert empirical is not None
    return empirical, float(strategy.epsilon().epsilon)


@pytest.mark.audit
@pytest.mark.parametrize("name", ["dp_fedavg", "dp_fedavg_adaptive", "dp_ftrl", "fedavg_ldp"])
def test_a_correct_mechanism_is_not_caught(name, tmp_path):
    empirical, claimed = canary_run(name, tmp_path)
    assert claimed <= 2.0 + 1e-6
    assert empirical["inserted"] >= 150 and empirical["null_canaries"] == 200
    assert 0.8 < empirical["std_ratio"] < 1.25
    assert empirical["low"] <= claimed, empirical  # not significantly above the claim


@pytest.mark.audit
def test_noise_switched_off_is_caught_far_above_the_claim(tmp_path, monkeypatch):
    import strategies.dp_fedavg as module

    monkeypatch.setattr(module, "gaussian_mechanism", lambda *, values, sigma, rng: values)
    empirical, claimed = canary_run("dp_fedavg", tmp_path)
    assert empirical["low"] > 5 * claimed, empirical  # measured: 19.3 (17.4..21.5) at a claim of 2


@pytest.mark.audit
def test_a_clip_twice_the_accounted_one_is_caught(tmp_path):
    def double_the_clip(strategy: Any) -> None:
        clipped_sum = strategy.clipped_update_sum
        strategy.clipped_update_sum = lambda valid, *, max_norm, server_round=None: clipped_sum(
            valid, max_norm=2 * max_norm, server_round=server_round
        )

    # A subtler bug than no noise at all: 800 canaries narrow the interval enough to see it.
    empirical, claimed = canary_run("dp_fedavg", tmp_path, mutate=double_the_clip, canaries=800)
    assert empirical["low"] > claimed, empirical


@pytest.mark.simulation
def test_a_simulation_reports_the_estimate_apart_from_the_real_clients(simulate):
    from conftest import FAST

    results = simulate([*FAST, "strategy=dp_fedavg", "privacy.canaries=20", "simulation.num_cpus=2"])
    empirical = results["privacy"]["empirical_epsilon"]
    assert empirical["canaries"] == 20 and empirical["null_canaries"] == 20 and empirical["inserted"] >= 2
    assert empirical["low"] <= empirical["epsilon"] <= empirical["high"]
    # Canaries are not clients: no messages, no bytes, not in the cohort counts or the ledger.
    assert all(r["clients"] <= 6 for r in results["rounds"])
    ledger = json.loads((Path(results["_output_dir"]) / "privacy_ledger.json").read_text())
    assert ledger["population"] == list(range(6))
    assert "empirical epsilon" in (Path(results["_output_dir"]) / "run.log").read_text()
