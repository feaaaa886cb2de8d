"""FedAvg and DP-FedAvg: strategies on constructed replies, clients on real messages."""

from __future__ import annotations

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

from fl_app import keys
from fl_app.privacy.calibration import gaussian_epsilon
from strategies.dp_fedavg import DPFedAvgStrategy
from strategies.fedavg import FedAvgStrategy

DIGITS = ["dataset=digits", "num_clients=6", "clients_per_round=3", "num_rounds=4"]


def _arrays(value: float, shape: tuple[int, ...] = (3, 2)) -> ArrayRecord:
    return ArrayRecord(
        {"w": Array(np.full(shape, value, dtype=np.float32)), "b": Array(np.full(2, value, dtype=np.float32))}
    )


def test_fedavg_weights_by_examples_and_skips_failures(tmp_path):
    strategy = FedAvgStrategy(build_run_context(DIGITS, tmp_path))
    messages = list(strategy.configure_train(1, _arrays(0.0), ConfigRecord(), grid=None))
    assert len(messages) == 3
    replies = [
        reply_to(messages[0], arrays=_arrays(1.0), metrics={keys.NUM_EXAMPLES: 10, keys.TRAIN_LOSS: 1.0}),
        reply_to(messages[1], arrays=_arrays(4.0), metrics={keys.NUM_EXAMPLES: 30, keys.TRAIN_LOSS: 2.0}),
        error_reply(messages[2]),
    ]
    arrays, metrics = strategy.aggregate_train(1, replies)
    assert np.allclose(arrays["w"].numpy(), (10 * 1.0 + 30 * 4.0) / 40)
    assert metrics[keys.TRAIN_LOSS] == pytest.approx(1.75)
    assert strategy.replies.failures(1) == [strategy.replies.selected(1)[2].client_id]


def test_fedavgm_server_momentum_and_learning_rate(tmp_path):
    """Hsu et al. 2019 / Reddi et al. 2021: v = beta v + (avg - w), w += eta_s v; by hand over 2 rounds."""
    strategy = FedAvgStrategy(
        build_run_context([*DIGITS, "strategy.server_lr=0.5", "strategy.server_momentum=0.9"], tmp_path)
    )
    w = 0.0
    velocity = 0.0
    for server_round, client_value in ((1, 2.0), (2, 3.0)):
        messages = list(strategy.configure_train(server_round, _arrays(w), ConfigRecord(), grid=None))
        replies = [
            reply_to(m, arrays=_arrays(client_value), metrics={keys.NUM_EXAMPLES: 5, keys.TRAIN_LOSS: 1.0})
            for m in messages
        ]
        arrays, _ = strategy.aggregate_train(server_round, replies)
        velocity = 0.9 * velocity + (client_value - w)
        w = w + 0.5 * velocity
        assert np.allclose(arrays["w"].numpy(), w) and arrays["w"].numpy().dtype == np.float32
    assert w == pytest.approx(0.5 * 2.0 + 0.5 * (0.9 * 2.0 + 2.0))  # 1.0, then 1.0 + 0.5 * 3.8


def test_plain_fedavg_returns_the_average_itself(tmp_path):
    strategy = FedAvgStrategy(build_run_context(DIGITS, tmp_path))
    messages = list(strategy.configure_train(1, _arrays(7.0), ConfigRecord(), grid=None))
    replies = [
        reply_to(m, arrays=_arrays(1.0), metrics={keys.NUM_EXAMPLES: 5, keys.TRAIN_LOSS: 1.0})
        for m in messages
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert np.allclose(arrays["w"].numpy(), 1.0)


def test_client_lr_decays_per_round(tmp_path):
    strategy = FedAvgStrategy(build_run_context([*DIGITS, "lr=0.2", "lr_decay=0.5"], tmp_path))
    for server_round, expected in ((1, 0.2), (2, 0.1), (4, 0.025)):
        message = next(iter(strategy.configure_train(server_round, _arrays(0.0), ConfigRecord(), grid=None)))
        assert message.content.config_records[keys.CONFIG][keys.LR] == pytest.approx(expected)


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("strategy.server_momentum=1.0", "strategy.server_momentum"),
        ("strategy.server_lr=0", "strategy.server_lr"),
        ("lr_decay=0", "lr_decay"),
        ("lr_decay=1.5", "lr_decay"),
    ],
)
def test_server_optimiser_and_decay_values_are_checked(override, key):
    from fl_app.config.compose import compose_config
    from fl_app.config.validation import ConfigError, validate_config

    with pytest.raises(ConfigError) as error:
        validate_config(compose_config([*DIGITS, override]), check_data=False)
    assert error.value.key == key


def test_client_sampling_is_seeded_and_uniform(tmp_path):
    first = FedAvgStrategy(build_run_context(DIGITS, tmp_path))
    second = FedAvgStrategy(build_run_context(DIGITS, tmp_path))
    assert [c.client_id for c in first.select_clients(3)] == [c.client_id for c in second.select_clients(3)]
    counts = np.zeros(6)
    for server_round in range(1, 601):
        for client in first.select_clients(server_round):
            counts[client.client_id] += 1
    assert np.allclose(counts / 600, 0.5, atol=0.07)


def test_train_config_carries_hyperparameters(tmp_path):
    strategy = FedAvgStrategy(build_run_context([*DIGITS, "lr=0.3", "local_epochs=2"], tmp_path))
    message = next(iter(strategy.configure_train(2, _arrays(0.0), ConfigRecord(), grid=None)))
    config = message.content.config_records[keys.CONFIG]
    assert config[keys.ALGORITHM] == "fedavg"
    assert config[keys.LR] == pytest.approx(0.3)
    assert config[keys.LOCAL_EPOCHS] == 2
    assert config[keys.SERVER_ROUND] == 2


def test_fedavg_client_trains_on_its_partition():
    config = {**spec_config(DIGITS), keys.ALGORITHM: "fedavg"}
    from fl_app.learning.model_spec import ModelSpec
    from fl_app.learning.training import model_to_arrays

    model = ModelSpec.from_json(config[keys.MODEL_SPEC]).build()
    start = model_to_arrays(model)
    message = make_message(config, start)
    reply = client_for(message, make_context(partition_id=2)).train()
    metrics = reply.content.metric_records[keys.METRICS]
    from fl_app.data.federated import DataSpec, federated_data

    partition = federated_data(DataSpec.from_json(config[keys.DATA_SPEC])).client(2)
    assert metrics[keys.NUM_EXAMPLES] == len(partition)
    trained = reply.content.array_records[keys.ARRAYS]
    assert list(trained.keys()) == list(start.keys())
    assert not np.allclose(trained[next(iter(trained))].numpy(), start[next(iter(start))].numpy())


def test_dp_fedavg_clips_noises_and_accounts(tmp_path):
    run = build_run_context(
        [
            *DIGITS,
            "strategy=dp_fedavg",
            "strategy.noise_multiplier=1e-9",
            "strategy.clip=0.5",
            "strategy.sampling=fixed",
        ],
        tmp_path,
    )
    strategy = DPFedAvgStrategy(run)
    global_arrays = _arrays(0.0)
    messages = list(strategy.configure_train(1, global_arrays, ConfigRecord(), grid=None))
    # Two clients move far (norm 100), one fails: the failed one counts as a zero update.
    replies = [
        reply_to(m, arrays=_arrays(10.0 * (i + 1)), metrics={keys.NUM_EXAMPLES: 5, keys.TRAIN_LOSS: 1.0})
        for i, m in enumerate(messages[:2])
    ] + [error_reply(messages[2])]
    arrays, _ = strategy.aggregate_train(1, replies)
    update = np.concatenate([arrays[k].numpy().ravel() for k in arrays])
    # Each clipped update has norm 0.5 and points along the all-ones direction.
    assert np.linalg.norm(update) == pytest.approx(2 * 0.5 / 3, rel=1e-4)
    # Fixed sampling: the 3 selected clients (failure included) were charged one Gaussian release.
    report = strategy.accountant.epsilon(delta=1e-5)
    selected = [c.client_id for c in strategy.replies.selected(1)]
    for client in run.client_ids:
        expected_rounds = 1 if client in selected else 0
        assert strategy.accountant.rounds_participated(client) == expected_rounds
    assert report.epsilon > 0

    # The platform reads the round as one typed report: the failed client named, the accountant's
    # epsilon, no un-noised statistic among the released fields.
    typed = strategy.report_round(1)
    assert typed.clients == 3 and typed.failures == (selected[2],)
    assert typed.failure_reasons == ("client crashed",)
    assert typed.epsilon == report and typed.privacy_fields()["epsilon"] == report.epsilon
    assert typed.privacy_fields()["epsilon_training"] == report.epsilon
    assert not any("norm" in key or "loss" in key for key in typed.extras)
    assert FedAvgStrategy(build_run_context(DIGITS, tmp_path)).report_round(
        1
    ).privacy_fields() == dict.fromkeys(
        ("epsilon", "epsilon_method", "epsilon_rdp", "epsilon_pld", "epsilon_basic", "epsilon_training")
    )


def test_dp_fedavg_calibration_meets_budget(tmp_path):
    run = build_run_context([*DIGITS, "strategy=dp_fedavg", "privacy.epsilon=2"], tmp_path)
    strategy = DPFedAvgStrategy(run)
    assert strategy.run.settings.privacy.accountant == "pld"  # the default: the tight accountant
    spent = gaussian_epsilon(
        noise_multiplier=strategy.noise_multiplier, sampling_rate=0.5, rounds=4, delta=1e-5, method="pld"
    )
    assert spent <= 2.0
    assert spent > 1.99
    for server_round in range(1, 5):
        strategy.configure_train(server_round, _arrays(0.0), ConfigRecord(), grid=None)
        strategy.aggregate_train(server_round, [])
    assert strategy.epsilon().epsilon == pytest.approx(spent, rel=1e-9)


def test_dp_fedavg_fixed_sampling_agrees_with_flowers_wrapper(tmp_path):
    """Same clipping, same noise std on the average and the same epsilon as Flower's
    DifferentialPrivacyServerSideFixedClipping with its no-amplification accountant."""
    from flwr.serverapp import (
        GaussianPrivacyEvent,
        NeighboringRelation,
        PrivacyConfig,
        RdpAccountant,
        SamplingMethod,
    )
    from flwr.supercore.differential_privacy import compute_clip_model_update, compute_stdv

    run = build_run_context(
        [
            *DIGITS,
            "strategy=dp_fedavg",
            "strategy.sampling=fixed",
            "strategy.noise_multiplier=1.3",
            "strategy.clip=0.7",
        ],
        tmp_path,
    )
    strategy = DPFedAvgStrategy(run)
    # noise std on the average of m = 3 clipped updates
    assert strategy.noise_multiplier * strategy.clip / strategy.denominator == pytest.approx(
        compute_stdv(1.3, 0.7, 3)
    )
    # clipping an update: Flower clips (param1 - param2) in place and adds param2 back
    rng = np.random.default_rng(0)
    reference = [rng.normal(size=(3, 2)), rng.normal(size=2)]
    trained = [r + rng.normal(size=r.shape) * 3 for r in reference]
    flower = [t.copy() for t in trained]
    compute_clip_model_update(param1=flower, param2=reference, clipping_norm=0.7)
    from fl_app.privacy.mechanisms import clip_l2

    ours, _ = clip_l2(arrays=[t - r for t, r in zip(trained, reference, strict=True)], max_norm=0.7)
    assert all(np.allclose(f - r, o) for f, r, o in zip(flower, reference, ours, strict=True))
    # epsilon after 4 rounds in which a client was selected every time
    for server_round in range(1, 5):
        strategy.replies.record_selected(server_round, run.roster)  # every client, every round
        strategy._record_release(server_round)
    flower_accountant = RdpAccountant(
        PrivacyConfig(
            target_delta=1e-5,
            population_size=6,
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.NO_AMPLIFICATION,
        )
    )
    flower_accountant.compose(
        GaussianPrivacyEvent(noise_multiplier=1.3, sample_size=3, population_size=6), count=4
    )
    assert strategy.epsilon().rdp == pytest.approx(flower_accountant.get_epsilon(1e-5), rel=1e-9)
