"""DP-BandMF: the banded Toeplitz factorization, its streaming noise, the schedule and the accounting.

Layers: the factorization against dense linear algebra and an independent optimiser (scipy); the
strategy on constructed replies (no Ray): the noise it adds is ``C^{-1} z`` with the calibrated
``z`` (recovered from the released models), the schedule keeps a client's participations ``b``
rounds apart, the ledger equals dp_accounting's DP-SGD composition (the paper's Theorem 4); bad
settings are one-line errors. The end-to-end audit is in ``tests/test_privacy_end_to_end.py``,
the short real simulation in ``tests/test_simulations.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import dp_accounting as dpa
import numpy as np
import pytest
import scipy.linalg
import scipy.optimize
from conftest import build_run_context, dense_lower_toeplitz, reply_to
from flwr.app import Array, ArrayRecord, ConfigRecord

from fl_app import keys
from fl_app.config.compose import compose_config
from fl_app.config.validation import ConfigError, validate_config
from fl_app.privacy.calibration import dp_fedavg_noise_multiplier
from strategies.dp_bandmf.factorization import (
    CorrelatedNoise,
    factorization_loss,
    inverse_coefficients,
    optimal_banded_toeplitz,
    square_root_coefficients,
    workload_coefficients,
)
from strategies.dp_bandmf.strategy import DPBandMFStrategy, choose_bands, expected_error

DIGITS = ["dataset=digits", "partition=iid", "num_clients=12", "clients_per_round=3"]


# ----------------------------------------------------------------------------- the factorization


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_loss_and_inverse_agree_with_dense_linear_algebra(momentum):
    rng = np.random.default_rng(3)
    n, c = 23, np.concatenate([[1.3], rng.uniform(-0.4, 0.6, size=4)])
    dense_c = dense_lower_toeplitz(c, n)
    assert np.allclose(
        dense_lower_toeplitz(inverse_coefficients(c, length=n), n), np.linalg.inv(dense_c), atol=1e-12
    )
    a = dense_lower_toeplitz(workload_coefficients(rounds=n, momentum=momentum), n)
    # the workload is what server SGD with heavy-ball momentum does to the noisy sums
    velocity, model, expected = np.zeros(n), np.zeros(n), np.zeros((n, n))
    for t in range(n):
        velocity = momentum * velocity + np.eye(n)[t]
        model = model + velocity
        expected[t] = model
    assert np.allclose(a, expected)
    assert factorization_loss(coefficients=c, rounds=n, momentum=momentum) == pytest.approx(
        np.sum((a @ np.linalg.inv(dense_c)) ** 2), rel=1e-12
    )
    root = square_root_coefficients(workload_coefficients(rounds=n, momentum=momentum))
    assert np.allclose(dense_lower_toeplitz(root, n) @ dense_lower_toeplitz(root, n), a)


def test_one_band_is_independent_noise_and_prefix_sums_cost_n_n_plus_1_over_2():
    one = optimal_banded_toeplitz(rounds=50, bands=1)
    assert one.coefficients == (1.0,) and one.loss == one.identity_loss == 50 * 51 / 2


@pytest.mark.parametrize(("rounds", "bands", "momentum"), [(40, 3, 0.0), (60, 6, 0.9), (100, 10, 0.0)])
def test_the_optimum_is_one_an_independent_optimiser_finds(rounds, bands, momentum):
    """scipy's Nelder-Mead from another start reaches no lower loss; the loss falls with bands."""
    found = optimal_banded_toeplitz(rounds=rounds, bands=bands, momentum=momentum)
    c = np.asarray(found.coefficients)
    assert np.linalg.norm(c) == pytest.approx(1.0) and c[0] > 0
    assert np.max(np.linalg.norm(dense_lower_toeplitz(c, rounds), axis=0)) == pytest.approx(
        1.0
    )  # unit column norm

    def loss(theta: np.ndarray) -> float:
        return factorization_loss(
            coefficients=theta / np.linalg.norm(theta), rounds=rounds, momentum=momentum
        )

    other = scipy.optimize.minimize(
        loss, np.ones(bands), method="Nelder-Mead", options={"maxiter": 40_000, "xatol": 1e-9, "fatol": 1e-9}
    )
    assert found.loss <= other.fun * (1 + 1e-7)
    fewer = optimal_banded_toeplitz(rounds=rounds, bands=bands - 1, momentum=momentum)
    assert found.loss < fewer.loss < found.identity_loss


def test_the_optimiser_warns_about_nothing():
    """The run log shows no torch or scipy warning from the optimisation (a fresh, uncached setting)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimal_banded_toeplitz(rounds=37, bands=4, momentum=0.5)


def test_more_bands_than_rounds_are_the_rounds():
    assert optimal_banded_toeplitz(rounds=3, bands=8).bands == 3


def test_streaming_noise_is_c_inverse_of_independent_gaussians():
    """``C y = z`` exactly, with ``z`` the same generator's normals scaled by sigma."""
    c = optimal_banded_toeplitz(rounds=30, bands=4).coefficients
    noise = CorrelatedNoise(c, sigma=2.5)
    draws = np.array([noise.draw([np.zeros(7)], np.random.default_rng(t))[0] for t in range(30)])
    z = np.array([np.random.default_rng(t).normal(0.0, 2.5, size=7) for t in range(30)])
    assert np.allclose(dense_lower_toeplitz(c, 30) @ draws, z, atol=1e-12)


# ----------------------------------------------------------------------------- against jax_privacy

#: Numbers (no code) from google-deepmind/jax_privacy at commit 8967688c (toeplitz.optimize_banded_toeplitz,
#: per_query_error with a momentum workload, accounting.amplified_bandmf_event, BandMFConfig
#: calibration) and pfl-research 0.6.0; the calls are in the file's "source" block.
REFERENCE = json.loads((Path(__file__).parent / "data" / "bandmf_reference.json").read_text())
TOEPLITZ_CASES = [
    (workload, case)
    for workload in ("prefix_sum", "momentum_0.9")
    for case in REFERENCE["jax_privacy_banded_toeplitz"][workload]
]


@pytest.mark.parametrize(("workload", "case"), TOEPLITZ_CASES)
def test_the_optimised_matrix_is_jax_privacys(workload, case):
    """24 settings (n 20-200, 1-10 bands, prefix sums and momentum 0.9): the same coefficients and loss."""
    expected = REFERENCE["jax_privacy_banded_toeplitz"][workload][case]
    n, b = (int(part.split("=")[1]) for part in case.split(","))
    found = optimal_banded_toeplitz(rounds=n, bands=b, momentum=0.9 if workload == "momentum_0.9" else 0.0)
    assert found.loss == pytest.approx(expected["fro2_total"], rel=1e-7)
    assert np.allclose(found.coefficients, expected["coef"], atol=2e-5)


def test_banded_toeplitz_is_within_seven_percent_of_the_general_banded_optimum():
    """McKenna 2024's point, on jax_privacy's general banded optimiser (banded.optimize): 0.01 to 6 %
    more loss (the most at n = 20 with 10 bands, a short run with many bands)."""
    cases = {k: v for k, v in REFERENCE["jax_privacy_general_banded"].items() if ":" in k}
    assert len(cases) >= 10
    for key, runs in cases.items():
        workload, case = key.split(":")
        toeplitz_loss = REFERENCE["jax_privacy_banded_toeplitz"][workload][case]["fro2_total"]
        general = runs["steps=1000"]["fro2_total"]
        assert general <= toeplitz_loss <= 1.07 * general, key


@pytest.mark.parametrize("case", sorted(REFERENCE["privacy"]["table"]))
def test_calibration_is_jax_privacys_amplified_bandmf(case):
    """The noise multiplier for ceil(n / b) Poisson-sampled Gaussian steps (Theorem 4), PLD and RDP,
    against jax_privacy's BandMFConfig calibration (12 settings, 1-10 bands, q 0.1 and 1, epsilon 1 and 8)."""
    expected = REFERENCE["privacy"]["table"][case]
    settings = dict(part.split("=") for part in case.split(","))
    for method, key in (("pld", "jax_PLD"), ("rdp", "jax_RDP")):
        z = dp_fedavg_noise_multiplier(
            epsilon=float(settings["eps"]),
            delta=float(settings["delta"]),
            sampling_rate=float(settings["q"]),
            rounds=math.ceil(int(settings["n"]) / int(settings["b"])),
            method=method,
        )
        assert z == pytest.approx(expected[key], rel=2e-4), (case, method)


# ----------------------------------------------------------------------------- the strategy


def _zero_round(strategy: DPBandMFStrategy, server_round: int, size: int) -> np.ndarray:
    """A round in which every selected client returns the global model (zero updates): the model."""
    zeros = ArrayRecord({"w": Array(np.zeros(size, dtype=np.float64))})
    current = strategy._round_global if strategy._round_global is not None else zeros
    messages = list(strategy.configure_train(server_round, current, ConfigRecord(), grid=None))
    arrays, _ = strategy.aggregate_train(
        server_round, [reply_to(m, arrays=current, metrics={keys.TRAIN_LOSS: 0.0}) for m in messages]
    )
    strategy._round_global = arrays
    return arrays["w"].numpy().astype(np.float64)


def test_the_released_noise_is_the_matrix_correlated_noise_at_the_calibrated_scale(tmp_path):
    """Zero updates, lr 1, no momentum: ``m (w_{t+1} - w_t) = y_t`` and ``C y`` must be N(0, (zC)^2):
    a wrong matrix, a noise off by 2x or an uncorrelated draw shows in the variances."""
    rounds, size = 8, 40_000
    run = build_run_context(
        [*DIGITS, f"num_rounds={rounds}", "strategy=dp_bandmf", "strategy.bands=4", "strategy.clip=0.5"],
        tmp_path,
    )
    strategy = DPBandMFStrategy(run)
    models = [np.zeros(size)] + [_zero_round(strategy, t, size) for t in range(1, rounds + 1)]
    sums = np.diff(np.array(models), axis=0) * 3  # m = 3
    sigma = strategy.noise_multiplier * 0.5
    c = np.asarray(strategy.matrix.coefficients)
    whitened = dense_lower_toeplitz(c, rounds) @ sums
    assert np.allclose(np.std(whitened, axis=1), sigma, rtol=0.02)
    assert np.abs(np.corrcoef(whitened)[np.triu_indices(rounds, 1)]).max() < 0.03
    # the raw per-round noise is correlated as C^{-1} C^{-T} says
    inverse = np.linalg.inv(dense_lower_toeplitz(c, rounds))
    assert np.allclose(np.cov(sums), sigma**2 * inverse @ inverse.T, atol=0.03 * sigma**2)


def test_one_band_without_noise_is_dp_fedavg_and_calibrates_as_dp_fedavg(tmp_path):
    run = build_run_context(
        [*DIGITS, "num_rounds=5", "strategy=dp_bandmf", "strategy.bands=1", "privacy.epsilon=2"], tmp_path
    )
    strategy = DPBandMFStrategy(run)
    assert strategy.rate == pytest.approx(3 / 12) and strategy.steps == 5 and strategy.secret_cohort
    assert strategy.noise_multiplier == dp_fedavg_noise_multiplier(
        epsilon=2, delta=1e-5, sampling_rate=0.25, rounds=5, method=run.settings.privacy.accountant
    )
    quiet = DPBandMFStrategy(
        build_run_context(
            [
                *DIGITS,
                "num_rounds=5",
                "strategy=dp_bandmf",
                "strategy.bands=1",
                "strategy.noise_multiplier=1e-12",
                "strategy.clip=1e6",
            ],
            tmp_path,
        )
    )
    start = ArrayRecord({"w": Array(np.zeros(4))})
    messages = list(quiet.configure_train(1, start, ConfigRecord(), grid=None))
    updates = {m.metadata.dst_node_id: np.arange(4.0) * (i + 1) for i, m in enumerate(messages)}
    replies = [
        reply_to(m, arrays=ArrayRecord({"w": Array(updates[m.metadata.dst_node_id])})) for m in messages
    ]
    arrays, _ = quiet.aggregate_train(1, replies)
    # w + sum / m with the fixed denominator m = clients_per_round (DP-FedAvg's W = qN)
    assert np.allclose(arrays["w"].numpy(), sum(updates.values()) / 3, atol=1e-5), arrays["w"].numpy()


def test_the_schedule_keeps_participations_bands_apart_and_groups_public(tmp_path):
    overrides = [*DIGITS, "num_rounds=12", "strategy=dp_bandmf", "strategy.bands=2"]
    strategy = DPBandMFStrategy(build_run_context(overrides, tmp_path))
    other_noise = DPBandMFStrategy(build_run_context([*overrides, "privacy.noise_seed=7"], tmp_path))
    assert [[c.client_id for c in g] for g in strategy.groups] == [
        [c.client_id for c in g] for g in other_noise.groups
    ]
    assert sorted(c.client_id for g in strategy.groups for c in g) == list(range(12))
    rounds_of: dict[int, list[int]] = {}
    cohorts = []
    for t in range(1, 13):
        cohort = strategy.select_clients(t)
        cohorts.append({c.client_id for c in cohort})
        assert {c.client_id for c in cohort} <= {c.client_id for c in strategy.group_of_round(t)}
        for info in cohort:
            rounds_of.setdefault(info.client_id, []).append(t)
    assert all(min(np.diff(r), default=2) >= 2 for r in rounds_of.values())
    # q = 3 * 2 / 12 = 1/2 < 1: Poisson within the group, from the privacy randomness (secret)
    assert strategy.rate == 0.5 and strategy.secret_cohort
    assert cohorts != [{c.client_id for c in other_noise.select_clients(t)} for t in range(1, 13)]
    whole = DPBandMFStrategy(
        build_run_context([*DIGITS, "num_rounds=12", "strategy=dp_bandmf", "strategy.bands=4"], tmp_path)
    )
    assert whole.rate == 1.0 and not whole.secret_cohort
    assert [len(whole.select_clients(t)) for t in range(1, 13)] == [3] * 12


@pytest.mark.parametrize(("bands", "rounds"), [(2, 7), (4, 9), (1, 3)])
def test_the_ledger_is_dp_sgd_over_ceil_rounds_over_bands_steps(tmp_path, bands, rounds):
    """Theorem 4 (Choquette-Choo et al. 2023): each client's epsilon is DP-SGD's with q and the
    rounds of its group, computed here by dp_accounting's PLD directly; the busiest group's is the
    run's, at most the budget."""
    run = build_run_context(
        [
            *DIGITS,
            f"num_rounds={rounds}",
            "strategy=dp_bandmf",
            f"strategy.bands={bands}",
            "privacy.epsilon=3",
        ],
        tmp_path,
    )
    strategy = DPBandMFStrategy(run)
    for t in range(1, rounds + 1):
        strategy.configure_train(t, ArrayRecord({"w": Array(np.zeros(3))}), ConfigRecord(), grid=None)
        strategy.aggregate_train(t, [])  # nobody answers: the group is still charged
    z, q = strategy.noise_multiplier, 3 * bands / 12
    for group, members in enumerate(strategy.groups):
        steps = len(range(group + 1, rounds + 1, bands))
        event = dpa.GaussianDpEvent(z) if q == 1 else dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(z))
        accountant = dpa.pld.PLDAccountant()
        accountant.compose(event, steps)
        for info in members:
            assert strategy.accountant.rounds_participated(info.client_id) == steps
            report = strategy.accountant.epsilon(delta=1e-5, client=info.client_id)
            assert report.epsilon == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-3)
    assert strategy.steps == math.ceil(rounds / bands)
    assert 2.99 < strategy.epsilon().epsilon <= 3.0


def test_auto_bands_trade_correlation_against_amplification(tmp_path):
    """``bands=auto`` takes the least total noise variance of the models over 1..N/m bands: one band
    (DP-FedAvg's amplified noise) at a small budget, many at a large one (the paper's finding)."""
    shape = {"num_clients": 1000, "clients_per_round": 100, "rounds": 100, "momentum": 0.0, "delta": 1e-5}
    small, large = choose_bands(epsilon=1.0, **shape), choose_bands(epsilon=8.0, **shape)
    assert small == 1 and large >= 5
    errors = [expected_error(bands=b, epsilon=8.0, **shape) for b in range(1, 11)]
    assert errors[large - 1] == min(errors) < errors[0]
    run = build_run_context([*DIGITS, "num_rounds=6", "strategy=dp_bandmf", "privacy.epsilon=8"], tmp_path)
    strategy = DPBandMFStrategy(run)  # the default is auto; N / m = 4 groups at most
    assert run.settings.strategy_settings.bands == "auto" and 1 <= strategy.num_groups <= 4
    assert strategy.num_groups == choose_bands(
        epsilon=8.0, delta=1e-5, num_clients=12, clients_per_round=3, rounds=6, momentum=0.0
    )


# ----------------------------------------------------------------------------- bad settings


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["strategy.bands=5"], "strategy.bands"),  # 3 x 5 > 12: a group could not hold a cohort
        (["strategy.bands=0"], "strategy.bands"),
        (["strategy.bands=many"], "strategy.bands"),
        (["strategy.server_momentum=1.0"], "strategy.server_momentum"),
        (["strategy.clip=0"], "strategy.clip"),
        (["privacy.budget_scope=per_round"], "privacy.budget_scope"),
    ],
)
def test_bad_settings_are_one_line_config_errors(overrides, key):
    cfg = compose_config([*DIGITS, "num_rounds=2", "strategy=dp_bandmf", *overrides])
    with pytest.raises(ConfigError) as error:
        validate_config(cfg, check_data=False)
    assert error.value.key == key
    assert "\n" not in str(error.value)


# ------------------------------------------------------------------ its quick example (test_simulations)


def check_quick_example(results: dict[str, Any], example: Any) -> None:
    """What its quick example's run must show beyond the common checks (tests/test_simulations.py)."""
    import dp_accounting as dpa

    privacy = results["privacy"]
    bands, rounds = privacy["groups"], len(results["rounds"])  # strategy.bands=auto chose it
    rate = example.clients_per_round * bands / example.num_clients
    assert privacy["sampling_rate"] == pytest.approx(rate) and privacy["randomness"]["source"] == "seeded"
    assert privacy["bands_chosen"].startswith("strategy.bands=auto")
    assert privacy["max_participations"] == math.ceil(rounds / bands)
    assert [r["group"] for r in results["rounds"]] == [(t - 1) % bands + 1 for t in range(1, rounds + 1)]
    matrix = privacy["strategy_matrix"]
    assert len(matrix["coefficients"]) == bands and matrix["loss_relative_to_independent_noise"] < 0.5
    # the paper's Theorem 4: DP-SGD with q and ceil(T / b) steps, by dp_accounting's PLD directly
    accountant = dpa.pld.PLDAccountant()
    sampled = dpa.PoissonSampledDpEvent(rate, dpa.GaussianDpEvent(privacy["noise_multiplier"]))
    accountant.compose(sampled, math.ceil(rounds / bands))
    assert results["final"]["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-3)
