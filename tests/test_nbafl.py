"""NbAFL (Wei et al., IEEE TIFS 2020): client clip and noise, server averaging, noise formulas, accounting."""

from __future__ import annotations

import json
import math
from collections import Counter
from typing import Any

import numpy as np
import pytest
from conftest import (
    build_run_context,
    client_for,
    error_reply,
    make_context,
    make_message,
    reply_to,
    spec_config,
)
from flwr.app import Array, ArrayRecord, ConfigRecord

from clients.nbafl import NBAFL_CLIP, NBAFL_MU, NBAFL_SIGMA_UP
from fl_app import keys
from fl_app.config.compose import compose_config
from fl_app.config.validation import ConfigError, validate_config
from fl_app.learning.model_spec import ModelSpec
from fl_app.learning.training import model_to_arrays
from fl_app.privacy.composition import compose_epsilon
from fl_app.privacy.events import Gaussian
from fl_app.privacy.mechanisms import global_l2_norm
from strategies.fedavg import FedAvgStrategy
from strategies.nbafl import privacy as nbafl_cal
from strategies.nbafl.strategy import NbAFLStrategy

DIGITS = ["dataset=digits", "num_clients=6", "clients_per_round=3", "num_rounds=4"]
NBAFL = [*DIGITS, "strategy=nbafl", "privacy.epsilon=10", "privacy.delta=0.01"]
C_DELTA = math.sqrt(2 * math.log(1.25 / 0.01))  # c for delta = 0.01, by hand


def _arrays(value: float) -> ArrayRecord:
    weights = np.full((3, 2), value, dtype=np.float32)
    return ArrayRecord({"w": Array(weights), "b": Array(np.full(2, value, dtype=np.float32))})


def _flat(arrays: ArrayRecord) -> np.ndarray:
    return np.concatenate([arrays[k].numpy().ravel().astype(np.float64) for k in arrays])


_START: dict[str, ArrayRecord] = {}


def _client_reply(*, algorithm: str, clip: float = 1e6, sigma: float = 0.0, mu: float = 0.0):
    """Train partition 1 from one fixed initial model (built once per test session)."""
    config = {
        **spec_config(DIGITS),
        keys.ALGORITHM: algorithm,
        NBAFL_CLIP: clip,
        NBAFL_SIGMA_UP: sigma,
        NBAFL_MU: mu,
    }
    if "start" not in _START:
        _START["start"] = model_to_arrays(ModelSpec.from_json(config[keys.MODEL_SPEC]).build())
    start = _START["start"]
    reply = client_for(make_message(config, start), make_context(partition_id=1)).train()
    return start, reply.content.array_records[keys.ARRAYS], reply.content.metric_records[keys.METRICS]


# ---------------------------------------------------------------------------------- client


def test_client_clip_bounds_the_whole_model_norm():
    start, uploaded, metrics = _client_reply(algorithm="nbafl", clip=0.5)
    assert global_l2_norm([uploaded[k].numpy() for k in uploaded]) == pytest.approx(0.5, rel=1e-5)
    assert global_l2_norm([start[k].numpy() for k in start]) > 0.5  # the clip was active
    assert set(metrics.keys()) == {keys.NUM_EXAMPLES}  # no un-noised loss or norm leaves the client


def test_client_without_noise_and_clip_equals_fedavg_client():
    _, nbafl, _ = _client_reply(algorithm="nbafl")
    _, fedavg, _ = _client_reply(algorithm="fedavg")
    assert list(nbafl.keys()) == list(fedavg.keys())
    assert all(np.array_equal(nbafl[k].numpy(), fedavg[k].numpy()) for k in nbafl)
    _, proximal, _ = _client_reply(algorithm="nbafl", mu=5.0)
    assert not np.allclose(_flat(proximal), _flat(nbafl))  # mu reaches local training


def test_client_adds_gaussian_noise_of_sigma_u():
    _, clean, _ = _client_reply(algorithm="nbafl")
    _, noised, _ = _client_reply(algorithm="nbafl", sigma=0.1)
    difference = _flat(noised) - _flat(clean)
    assert difference.size > 10_000
    assert difference.std() == pytest.approx(0.1, rel=0.03)
    assert abs(difference.mean()) < 0.005


# ---------------------------------------------------------------------------------- server


def test_zero_noise_huge_clip_round_equals_uniform_fedavg(tmp_path):
    run = build_run_context(
        [*NBAFL, "strategy.sigma_up=0", "strategy.sigma_down=0", "strategy.clip=1e6"], tmp_path
    )
    nbafl = NbAFLStrategy(run)
    fedavg = FedAvgStrategy(build_run_context([*DIGITS, "strategy.weighting=uniform"], tmp_path))
    rng = np.random.default_rng(0)
    uploads = [
        ArrayRecord({"w": Array(rng.normal(size=(3, 2)).astype(np.float32)), "b": Array(np.ones(2, "f4"))})
        for _ in range(3)
    ]
    results = []
    for strategy in (nbafl, fedavg):
        messages = list(strategy.configure_train(1, _arrays(0.0), ConfigRecord(), grid=None))
        replies = [
            reply_to(m, arrays=a, metrics={keys.NUM_EXAMPLES: 10 * (i + 1), keys.TRAIN_LOSS: 1.0})
            for i, (m, a) in enumerate(zip(messages, uploads, strict=True))
        ]
        results.append(strategy.aggregate_train(1, replies)[0])
    assert [c.client_id for c in nbafl.replies.selected(1)] == [
        c.client_id for c in fedavg.replies.selected(1)
    ]
    assert np.allclose(_flat(results[0]), _flat(results[1]), atol=1e-7)
    assert nbafl.epsilon() is None  # no uplink noise: no finite guarantee


def test_downlink_noise_is_added_to_the_average(tmp_path):
    run = build_run_context([*NBAFL, "strategy.sigma_down=0.5"], tmp_path)
    strategy = NbAFLStrategy(run)
    messages = list(strategy.configure_train(1, _arrays(0.0), ConfigRecord(), grid=None))
    replies = [reply_to(m, arrays=_arrays(1.0), metrics={keys.NUM_EXAMPLES: 5}) for m in messages]
    noised = _flat(strategy.aggregate_train(1, replies)[0])
    assert not np.allclose(noised, 1.0)
    assert np.all(np.abs(noised - 1.0) < 5 * 0.5)


def test_train_config_carries_clip_sigma_and_mu(tmp_path):
    strategy = NbAFLStrategy(build_run_context([*NBAFL, "strategy.clip=2.5", "strategy.mu=0.1"], tmp_path))
    message = next(iter(strategy.configure_train(1, _arrays(0.0), ConfigRecord(), grid=None)))
    config = message.content.config_records[keys.CONFIG]
    assert config[keys.ALGORITHM] == "nbafl"
    assert config[NBAFL_CLIP] == pytest.approx(2.5)
    assert config[NBAFL_SIGMA_UP] == pytest.approx(strategy.sigma_up)
    assert config[NBAFL_MU] == pytest.approx(0.1)


def test_schedule_is_seeded_and_gives_l(tmp_path):
    first = NbAFLStrategy(build_run_context([*NBAFL, "strategy.k=2", "num_rounds=12"], tmp_path))
    second = NbAFLStrategy(build_run_context([*NBAFL, "strategy.k=2", "num_rounds=12"], tmp_path))
    ids = {t: [c.client_id for c in first.select_clients(t)] for t in range(1, 13)}
    assert ids == {t: [c.client_id for c in second.select_clients(t)] for t in range(1, 13)}
    assert all(len(v) == 2 for v in ids.values())
    assert first.exposures == max(Counter(c for v in ids.values() for c in v).values())
    everyone = NbAFLStrategy(build_run_context([*NBAFL, "strategy.k=6", "num_rounds=7"], tmp_path))
    assert everyone.exposures == 7  # K = N: L = T
    assert everyone.sigma_down == 0.0  # T <= T sqrt(N)
    defaulted = NbAFLStrategy(build_run_context(NBAFL, tmp_path))
    assert defaulted.k == 3  # strategy.k = null: clients_per_round


# ---------------------------------------------------------------------------------- formulas


def test_sigma_up_and_down_match_hand_computation(tmp_path):
    document = [*NBAFL, "strategy.clip=3", "strategy.calibration=classic"]
    strategy = NbAFLStrategy(build_run_context([*document, "strategy.unit=document_record"], tmp_path))
    m = min(info.num_examples for info in strategy.run.roster)
    assert strategy.min_dataset_size == m
    assert strategy.sigma_up == pytest.approx(C_DELTA * strategy.exposures * (2 * 3.0 / m) / 10.0)
    # the client unit: the same formula with the client's sensitivity 2C
    client = NbAFLStrategy(build_run_context([*document, "strategy.unit=client"], tmp_path))
    assert client.sigma_up == pytest.approx(C_DELTA * client.exposures * (2 * 3.0) / 10.0)
    # Theorem 1 (K = N): 2cC sqrt(T^2 - L^2 N) / (m N eps) for T = 40, L = 3, N = 50, C = 2, m = 100, eps = 5.
    down = nbafl_cal.nbafl_downlink_sigma(
        epsilon=5, delta=0.01, clip=2.0, min_dataset_size=100, exposures=3, num_rounds=40, num_clients=50
    )
    assert down == pytest.approx(2 * C_DELTA * 2.0 * math.sqrt(40**2 - 9 * 50) / (100 * 50 * 5))
    # K-random scheduling with the document's b and gamma, printed form (N = 50, K = 10, T = 400, L = 5).
    eps, t, big_l, n, k = 5.0, 400, 5, 50, 10
    b = -(t / eps) * math.log(1 - n / k + (n / k) * math.exp(-eps / t))
    gamma = -math.log(1 - k / n + (k / n) * math.exp(-eps / (big_l * math.sqrt(k))))
    assert t > eps / gamma
    expected = 2 * C_DELTA * 1.0 * math.sqrt(t**2 / b**2 - big_l**2 * k) / (100 * k * eps)
    kwargs = dict(epsilon=eps, delta=0.01, clip=1.0, min_dataset_size=100, exposures=big_l, num_rounds=t)
    kwargs.update(num_clients=n, clients_per_round=k)
    document = nbafl_cal.nbafl_downlink_sigma(**kwargs, amplification="document")
    assert document == pytest.approx(expected, rel=1e-9)
    # The two-sided subsampling bound, by hand: eps_K = ln(1 + (e^{eps/T} - 1) N/K), T/b = eps / eps_K.
    eps_k = math.log(1 + (math.exp(eps / t) - 1) * n / k)
    two_sided = 2 * C_DELTA * math.sqrt((eps / eps_k) ** 2 - big_l**2 * k) / (100 * k * eps)
    assert nbafl_cal.nbafl_downlink_sigma(**kwargs) == pytest.approx(two_sided)
    assert two_sided > document  # the one-sided form under-noises


def test_downlink_noise_is_zero_exactly_when_t_at_most_l_sqrt_n():
    for n in (4, 9, 10, 50):
        for exposures in (1, 2, 5):
            for t in range(1, 60):
                sigma = nbafl_cal.nbafl_downlink_sigma(
                    epsilon=10, delta=0.01, clip=1.0, min_dataset_size=50, exposures=exposures,
                    num_rounds=t, num_clients=n,
                )  # fmt: skip
                assert (sigma == 0.0) == (t <= exposures * math.sqrt(n)), (n, exposures, t)
    # K-random: zero exactly up to the threshold epsilon / gamma, for both amplification bounds.
    for amplification in nbafl_cal.NBAFL_AMPLIFICATIONS:
        limit = nbafl_cal.nbafl_downlink_threshold(
            epsilon=5, exposures=5, num_clients=50, clients_per_round=10, amplification=amplification
        )
        for t in range(int(limit) - 3, int(limit) + 4):
            sigma = nbafl_cal.nbafl_downlink_sigma(
                epsilon=5, delta=0.01, clip=1.0, min_dataset_size=100, exposures=5, num_rounds=t,
                num_clients=50, clients_per_round=10, amplification=amplification,
            )  # fmt: skip
            assert (sigma == 0.0) == (t <= limit)


def test_calculator_uses_k_random_formula(capsys):
    from fl_app.report.calculator import main

    args = ["--epsilon", "5", "--delta", "0.01", "--clip", "1", "--m", "100", "--l", "5", "--t", "400"]
    args += ["--unit", "document_record", "--calibration", "classic", "--accountant", "rdp"]
    assert main(["nbafl", *args, "--n", "50", "--k", "10", "--amplification", "document"]) == 0
    answer = json.loads(capsys.readouterr().out)
    kwargs = dict(epsilon=5, delta=0.01, clip=1.0, min_dataset_size=100, exposures=5, num_rounds=400)
    assert answer["sigma_down"] == nbafl_cal.nbafl_downlink_sigma(
        **kwargs, num_clients=50, clients_per_round=10, amplification="document"
    )
    # not the N -> K substitution into Theorem 1
    assert answer["sigma_down"] != pytest.approx(nbafl_cal.nbafl_downlink_sigma(**kwargs, num_clients=10))
    z = answer["sigma_up"] / nbafl_cal.nbafl_sensitivity(clip=1.0, min_dataset_size=100)
    assert answer["epsilon_record"] == compose_epsilon({Gaussian(z): 5}, delta=0.01).epsilon


# ---------------------------------------------------------------------------------- accounting


def _run_rounds(strategy: NbAFLStrategy, rounds: int, *, fail_first: bool = False) -> None:
    for server_round in range(1, rounds + 1):
        messages = list(strategy.configure_train(server_round, _arrays(0.0), ConfigRecord(), grid=None))
        replies = [reply_to(m, arrays=_arrays(1.0), metrics={keys.NUM_EXAMPLES: 5}) for m in messages]
        if fail_first:
            replies[0] = error_reply(messages[0])
        strategy.aggregate_train(server_round, replies)


@pytest.mark.parametrize("unit", ["client", "document_record"])
def test_the_run_epsilon_is_client_level_and_the_record_reading_is_beside_it(tmp_path, unit):
    """The headline is the client-level epsilon (sensitivity 2C, proven for multi-step SGD).

    The document's record-level reading (2C/m) is composed beside it by name, whichever unit
    privacy.epsilon was calibrated for.
    """
    document = [*NBAFL, "strategy.calibration=classic", f"strategy.unit={unit}"]
    strategy = NbAFLStrategy(build_run_context(document, tmp_path))
    _run_rounds(strategy, 4, fail_first=True)
    uploads = strategy.uploads_per_client()
    for client in strategy.run.client_ids:  # failures are charged too
        assert strategy.accountant.rounds_participated(client) == uploads[client]
    client_z = strategy.sigma_up / (2 * strategy.clip)
    client_level = compose_epsilon({Gaussian(client_z): strategy.exposures}, delta=0.01, method="pld")
    assert strategy.epsilon().epsilon == pytest.approx(client_level.epsilon, rel=1e-9)
    m = min(info.num_examples for info in strategy.run.roster)
    record_z = strategy.sigma_up / (2 * strategy.clip / m)
    record = compose_epsilon({Gaussian(record_z): strategy.exposures}, delta=0.01, method="pld").epsilon
    assert strategy.document_record_epsilon() == pytest.approx(record, rel=1e-9)
    assert client_level.epsilon > record
    assert strategy.privacy_unit.startswith("one client's entire data set")
    summary = strategy.privacy_summary()
    assert summary["unit"] == strategy.privacy_unit
    assert summary["document_reading"]["epsilon"] == pytest.approx(record, rel=1e-9)
    assert "not a guarantee" in summary["document_reading"]["unit"]
    assert summary["budget"]["epsilon"] == 10.0 and summary["budget"]["unit"] == unit
    assert summary["budget"]["classic_bound_holds"] == (10.0 / strategy.exposures < 1)
    assert summary["budget"]["warning"] is not None  # 10 / L >= 1 here
    assert summary["L"] == strategy.exposures
    assert summary["K"] == 3
    assert strategy.final_extras()["epsilon_document_record"] == pytest.approx(record, rel=1e-9)


@pytest.mark.parametrize("unit", ["client", "document_record"])
@pytest.mark.parametrize("calibration", ["analytic", "accountant"])
def test_sound_calibrations_meet_the_budget_in_their_unit(tmp_path, calibration, unit):
    run = build_run_context(
        [*NBAFL, f"strategy.calibration={calibration}", f"strategy.unit={unit}"], tmp_path
    )
    strategy = NbAFLStrategy(run)
    assert strategy.range_warning is None
    _run_rounds(strategy, 4)
    spent = strategy.epsilon().epsilon if unit == "client" else strategy.document_record_epsilon()
    assert spent <= 10.0 * (1 + 1e-9)
    if calibration == "accountant":
        assert spent > 9.9
    if unit == "document_record":  # the run's (client-level) epsilon of that noise is far larger
        assert strategy.epsilon().epsilon > 10 * spent


def test_validation_rejects_bad_settings():
    def check(*overrides: str) -> None:
        cfg = compose_config([*DIGITS, "strategy=nbafl", *overrides])
        validate_config(cfg, check_data=False)

    check()  # the defaults pass
    for bad, key in [
        ("strategy.clip=0", "strategy.clip"),
        ("strategy.k=7", "strategy.k"),
        ("strategy.k=0", "strategy.k"),
        ("strategy.mu=-1", "strategy.mu"),
        ("strategy.calibration=magic", "strategy.calibration"),
        ("strategy.unit=record", "strategy.unit"),
        ("strategy.amplification=none", "strategy.amplification"),
        ("strategy.sigma_up=-1", "strategy.sigma_up"),
        ("privacy.delta=1.5", "privacy.delta"),
        ("privacy.epsilon=0", "privacy.epsilon"),
    ]:
        with pytest.raises(ConfigError) as error:
            check(bad)
        assert error.value.key == key


# ------------------------------------------------------------------ its quick example (test_simulations)


def check_quick_example(results: dict[str, Any], example: Any) -> None:
    """What its quick example's run must show beyond the common checks (tests/test_simulations.py)."""
    privacy = results["privacy"]
    z, uploads = privacy["noise_multiplier"], privacy["L"]
    assert all(r["clients"] == r["uploads"] == example.clients_per_round for r in results["rounds"])
    delta = example.privacy.delta
    # the run's epsilon is client level (sensitivity 2C), proven for the multi-step SGD that runs
    assert privacy["unit"].startswith("one client's entire data set")
    assert z == pytest.approx(privacy["sigma_up"] / (2 * example.strategy.clip))
    assert results["final"]["epsilon"] == pytest.approx(
        compose_epsilon({Gaussian(z): uploads}, delta=delta, method="pld").epsilon, rel=1e-9
    )
    # the example calibrates the document's record-level reading, reported beside it by name
    assert example.strategy.unit == "document_record"
    reading = results["final"]["epsilon_document_record"]
    assert 0.975 * example.privacy.epsilon < reading <= example.privacy.epsilon
    assert results["final"]["epsilon"] > 10 * reading
    assert privacy["budget"]["epsilon"] == example.privacy.epsilon
