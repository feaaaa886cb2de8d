"""FedAvg+LDP: client-side clipping and Gaussian noise, per-client calibration and accounting."""

from __future__ import annotations

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

from clients.fedavg_ldp import LDP_CLIP, LDP_NOISE_MULTIPLIER
from fl_app import keys
from fl_app.config.compose import compose_config
from fl_app.config.validation import ConfigError, typed_settings, validate_config
from fl_app.learning.model_spec import ModelSpec
from fl_app.learning.training import model_to_arrays
from fl_app.privacy.calibration import (
    gaussian_epsilon,
    local_gaussian_noise_multiplier,
    local_gaussian_sigma,
    local_update_sensitivity,
)
from strategies.fedavg_ldp import FedAvgLDPStrategy

DIGITS = ["dataset=digits", "num_clients=6", "clients_per_round=3", "num_rounds=5", "strategy=fedavg_ldp"]


def _flat(arrays: ArrayRecord) -> np.ndarray:
    return np.concatenate([arrays[k].numpy().ravel().astype(np.float64) for k in arrays])


def _client_reply(noise_multiplier: float, clip: float):
    config = {
        **spec_config(DIGITS),
        keys.ALGORITHM: "fedavg_ldp",
        LDP_CLIP: clip,
        LDP_NOISE_MULTIPLIER: noise_multiplier,
    }
    start = model_to_arrays(ModelSpec.from_json(config[keys.MODEL_SPEC]).build())
    reply = client_for(make_message(config, start), make_context(partition_id=1)).train()
    return start, reply


def test_sensitivity_and_sigma():
    assert local_update_sensitivity(clip=0.5) == 1.0
    assert local_gaussian_sigma(clip=0.5, noise_multiplier=3.0) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="clip"):
        local_update_sensitivity(clip=0.0)


def test_client_clips_and_uploads_only_the_update():
    start, reply = _client_reply(noise_multiplier=1e-9, clip=0.05)
    content = reply.content
    assert list(content.keys()) == [keys.ARRAYS]  # no loss, no example count
    update = content.array_records[keys.ARRAYS]
    assert list(update.keys()) == list(start.keys())
    assert np.linalg.norm(_flat(update)) == pytest.approx(0.05, rel=1e-3)  # local SGD moves far more


def test_client_noise_has_the_calibrated_std():
    clip, z = 0.01, 2.0
    _, reply = _client_reply(noise_multiplier=z, clip=clip)
    values = _flat(reply.content.array_records[keys.ARRAYS])
    assert values.std() == pytest.approx(z * 2 * clip, rel=0.02)  # signal norm 0.01 is negligible


def test_total_budget_calibration_and_accounting(tmp_path):
    strategy = FedAvgLDPStrategy(build_run_context([*DIGITS, "privacy.epsilon=3"], tmp_path))
    z = strategy.noise_multiplier
    rounds = strategy.max_participations
    assert z == pytest.approx(
        local_gaussian_noise_multiplier(epsilon=3.0, delta=1e-5, participations=rounds, method="pld"),
        rel=1e-12,
    )
    assert (
        gaussian_epsilon(noise_multiplier=z, sampling_rate=1.0, rounds=rounds, delta=1e-5, method="pld")
        <= 3.0
    )
    arrays = ArrayRecord({"w": Array(np.zeros(4, dtype=np.float32))})
    counts = np.zeros(6, dtype=int)
    for t in range(1, 6):
        messages = list(strategy.configure_train(t, arrays, ConfigRecord(), grid=None))
        for info in strategy.replies.selected(t):  # the strategy remembers the latest rounds' cohorts only
            counts[info.client_id] += 1
        config = messages[0].content.config_records[keys.CONFIG]
        assert config[LDP_NOISE_MULTIPLIER] == pytest.approx(z)
        replies = [
            reply_to(m, arrays=ArrayRecord({"w": Array(np.full(4, float(i), dtype=np.float32))}))
            for i, m in enumerate(messages[:2])
        ] + [error_reply(messages[2])]
        new, metrics = strategy.aggregate_train(t, replies)
        assert metrics["reports"] == 2
        assert np.allclose(new["w"].numpy(), arrays["w"].numpy() + 0.5)  # w + mean(0, 1)
        arrays = new
    assert counts.max() == rounds
    assert all(strategy.accountant.rounds_participated(c) == counts[c] for c in range(6))
    spent = strategy.epsilon().epsilon
    assert 2.95 < spent <= 3.0
    summary = strategy.privacy_summary()
    assert summary["epsilon_cumulative"] == pytest.approx(spent)
    assert summary["epsilon_per_round"] == pytest.approx(
        gaussian_epsilon(noise_multiplier=z, sampling_rate=1.0, rounds=1, delta=1e-5, method="pld"), rel=1e-6
    )
    assert summary["epsilon_per_round"] < spent  # one upload costs less than the whole run
    assert strategy.round_extras(5) == {"reports": 2, "epsilon_per_round": summary["epsilon_per_round"]}


def test_per_round_scope_calibrates_one_upload(tmp_path):
    strategy = FedAvgLDPStrategy(
        build_run_context([*DIGITS, "privacy.epsilon=3", "privacy.budget_scope=per_round"], tmp_path)
    )
    assert strategy.noise_multiplier == pytest.approx(
        local_gaussian_noise_multiplier(epsilon=3.0, delta=1e-5, participations=1, method="pld"), rel=1e-12
    )
    assert strategy.epsilon_per_round == pytest.approx(3.0, rel=1e-3)  # one upload spends the budget


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("strategy.clip=0", "strategy.clip"),
        ("strategy.noise_multiplier=-1", "strategy.noise_multiplier"),
        ("evaluation.federated_fraction=0.5", "evaluation.federated_fraction"),
    ],
)
def test_validation(override, key):

    with pytest.raises(ConfigError) as error:
        validate_config(compose_config([*DIGITS, override]), check_data=False)
    assert error.value.key == key


@pytest.mark.parametrize("strategy_name", ["fedavg_ldp", "privatekt"])
def test_balanced_schedule_gives_every_report_the_whole_budget(tmp_path, strategy_name):
    """N = 6, m = 2: 3 rounds per pass. Over 3 rounds each client reports exactly once, so the
    calibration spends the whole budget on one report; over 5 rounds the busiest reports twice."""
    from strategies import STRATEGIES

    base = [
        "dataset=digits",
        "num_clients=6",
        "clients_per_round=2",
        f"strategy={strategy_name}",
        "strategy.schedule=balanced",
        "privacy.epsilon=3",
    ]
    one_pass = STRATEGIES.get(strategy_name)(build_run_context([*base, "num_rounds=3"], tmp_path / "a"))
    cohorts = [one_pass.select_clients(t) for t in range(1, 4)]
    assert sorted(info.client_id for cohort in cohorts for info in cohort) == list(range(6))
    assert one_pass.max_participations == 1
    with pytest.raises(RuntimeError, match="beyond num_rounds"):
        one_pass.select_clients(4)
    longer = STRATEGIES.get(strategy_name)(build_run_context([*base, "num_rounds=5"], tmp_path / "b"))
    assert longer.max_participations == 2
    assert [longer.select_clients(t) for t in range(1, 4)] == cohorts  # the same seeded first pass
    randomly = STRATEGIES.get(strategy_name)(
        build_run_context([*base, "num_rounds=3", "strategy.schedule=random"], tmp_path / "c")
    )
    assert randomly.max_participations >= 1
    if strategy_name == "fedavg_ldp":
        assert one_pass.noise_multiplier == pytest.approx(
            local_gaussian_noise_multiplier(epsilon=3.0, delta=1e-5, participations=1, method="pld"),
            rel=1e-12,
        )
        assert longer.noise_multiplier > one_pass.noise_multiplier
    else:
        assert one_pass.epsilon_per_label > longer.epsilon_per_label


def test_unknown_schedule_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"strategy\.schedule"):
        typed_settings(compose_config([*DIGITS, "strategy.schedule=round_robin"]))


@pytest.mark.parametrize("project", [True, False])
def test_the_server_projects_the_noisy_mean_onto_the_clip_ball(tmp_path, project):
    strategy = FedAvgLDPStrategy(
        build_run_context([*DIGITS, "strategy.clip=0.5", f"strategy.project={project}"], tmp_path)
    )
    arrays = ArrayRecord({"w": Array(np.zeros(4, dtype=np.float32))})
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid=None))
    # uploads as noisy as small-epsilon local DP makes them: far outside the ball of radius C
    uploads = [np.array([300.0, -400.0, 0.0, 0.0]), np.array([100.0, 0.0, 0.0, 0.0])]
    replies = [
        reply_to(m, arrays=ArrayRecord({"w": Array(u.astype(np.float32))}))
        for m, u in zip(messages, uploads, strict=False)
    ]
    new, _ = strategy.aggregate_train(1, replies)
    mean = np.mean(uploads, axis=0)
    if project:
        assert np.allclose(new["w"].numpy(), mean * 0.5 / np.linalg.norm(mean), atol=1e-6)
    else:
        assert np.allclose(new["w"].numpy(), mean)


def test_projection_never_moves_the_mean_away_from_the_true_mean():
    """True means of clipped updates lie in the ball of radius C: projecting onto it is a contraction."""
    from fl_app.privacy.mechanisms import clip_l2

    rng = np.random.default_rng(3)
    clip = 1.0
    for _ in range(200):
        true = rng.normal(size=50)
        true *= rng.uniform(0, clip) / np.linalg.norm(true)
        noisy = true + rng.normal(scale=rng.choice([0.01, 1.0, 100.0]), size=50)
        (projected,), _ = clip_l2(arrays=[noisy], max_norm=clip)
        assert np.linalg.norm(projected - true) <= np.linalg.norm(noisy - true) + 1e-12


# ------------------------------------------------------------------ its quick example (test_simulations)


def check_quick_example(results: dict[str, Any], example: Any) -> None:
    """What its quick example's run must show beyond the common checks (tests/test_simulations.py)."""
    privacy = results["privacy"]
    assert privacy["budget_scope"] == "total"
    assert privacy["noise_multiplier"] > 0
    assert privacy["noise_std"] == pytest.approx(2 * privacy["clip"] * privacy["noise_multiplier"])
    # calibrated to the most-selected client's uploads: the whole budget, and no more, is spent
    assert 0.975 * example.privacy.epsilon < results["final"]["epsilon"] <= example.privacy.epsilon + 1e-9
    for r in results["rounds"]:  # each client uploads one model-sized update (no metrics)
        assert r["reports"] == r["clients"] == example.clients_per_round
        assert r["upload_array_bytes"] == r["download_array_bytes"] > 0
