"""PrivateKT: Lemma 1, Eq. 3, buffer, Eq. 4/5 sampling, the client's reply, accounting."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from conftest import (
    build_run_context,
    client_for,
    error_reply,
    make_context,
    reply_to,
    settings_of,
)
from flwr.app import Array, ArrayRecord, ConfigRecord

from clients.privatekt import (
    KT_INDICES,
    KT_LABELS,
    KT_LABELS_ARRAY,
    KT_SAMPLES,
    KT_SAMPLES_ARRAY,
    decode_labels,
    encode_labels,
)
from fl_app import keys
from fl_app.config.compose import compose_config
from fl_app.config.validation import ConfigError
from fl_app.engine.message_sizes import array_payload_bytes
from fl_app.privacy.composition import compose_epsilon
from fl_app.privacy.events import RandomizedResponse
from fl_app.privacy.mechanisms import debias_label_average, randomized_response_labels
from strategies.privatekt import knowledge
from strategies.privatekt import strategy as pkt
from strategies.privatekt.privacy import privatekt_epsilon_per_label, privatekt_keep_probability
from strategies.privatekt.strategy import PrivateKTStrategy

DIGITS = [
    "dataset=digits",
    "num_clients=6",
    "clients_per_round=3",
    "num_rounds=4",
    "strategy=privatekt",
    "strategy.self_train=20",
]


def _strategy(tmp_path, *extra: str) -> PrivateKTStrategy:
    return PrivateKTStrategy(build_run_context([*DIGITS, *extra], tmp_path))


def _labels_reply(message, labels, *, raw=True):
    array = encode_labels(np.asarray(labels)) if raw else Array(np.asarray(labels, dtype=np.float32))
    return reply_to(message, extra={KT_LABELS: ArrayRecord({KT_LABELS_ARRAY: array})})


def _round(strategy, server_round, arrays, *, fail_last=False):
    messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid=None))
    replies = [_labels_reply(m, [1] * strategy.k) for m in messages]
    if fail_last:
        replies[-1] = error_reply(messages[-1])
    return messages, strategy.aggregate_train(server_round, replies)


# ----------------------------------------------------------------------------- Lemma 1 and Eq. 3


@pytest.mark.parametrize(("epsilon", "k", "classes"), [(5.0, 2, 10), (1.0, 1, 2), (8.0, 4, 100)])
def test_beta_matches_lemma1(epsilon, k, classes):
    lemma1 = (math.exp(epsilon / k) - 1) / (math.exp(epsilon / k) - 1 + classes)
    per_label = privatekt_epsilon_per_label(
        epsilon=epsilon, k=k, num_classes=classes, budget_scope="per_round"
    )
    assert RandomizedResponse(per_label, classes).keep_probability == pytest.approx(lemma1, rel=1e-12)
    assert privatekt_keep_probability(epsilon=epsilon, k=k, num_classes=classes) == pytest.approx(lemma1)
    # One report of K labels costs epsilon (basic composition over the K labels).
    report = compose_epsilon({RandomizedResponse(per_label, classes): k}, delta=1e-5)
    assert report.basic == pytest.approx(epsilon)
    assert report.epsilon <= epsilon + 1e-12


def test_strategy_uses_lemma1_beta_in_per_round_mode(tmp_path):
    strategy = _strategy(tmp_path, "privacy.budget_scope=per_round", "privacy.epsilon=5", "strategy.k=2")
    assert strategy.beta == pytest.approx((math.exp(2.5) - 1) / (math.exp(2.5) - 1 + 10))
    assert strategy.epsilon_per_round == pytest.approx(5.0, rel=1e-4)


def test_eq3_estimator_is_unbiased():
    rng = np.random.default_rng(3)
    classes, beta, trials = 4, 0.3, 20_000
    truth = np.array([[0, 1], [0, 3], [2, 3], [0, 0], [1, 3]])  # 5 clients x K=2 predictions
    expected = np.eye(classes)[truth].mean(axis=0)  # (K, C): the clients' average one-hot prediction
    estimates = np.empty((trials, *expected.shape))
    naive = np.empty_like(estimates)
    for trial in range(trials):
        perturbed = randomized_response_labels(
            labels=truth, keep_probability=beta, num_classes=classes, rng=rng
        )
        estimates[trial] = debias_label_average(
            perturbed_labels=perturbed, keep_probability=beta, num_classes=classes
        )
        naive[trial] = np.eye(classes)[perturbed].mean(axis=0)
    standard_error = estimates.std(axis=0) / math.sqrt(trials)
    assert np.all(np.abs(estimates.mean(axis=0) - expected) < 4 * standard_error + 1e-9)
    # Without Eq. 3 the plain average is biased towards uniform (the test can fail).
    assert np.max(np.abs(naive.mean(axis=0) - expected)) > 0.2


# ----------------------------------------------------------------------------- buffer and sampling


def test_buffer_is_fifo_of_size_b():
    buffer = knowledge.KnowledgeBuffer(3)
    for round_id in range(5):
        buffer.push(np.array([10 * round_id, 10 * round_id + 1]), np.full((2, 4), round_id, dtype=float))
        assert len(buffer) == min(round_id + 1, 3)
    rows, targets = buffer.fetch()
    assert rows.tolist() == [20, 21, 30, 31, 40, 41]
    assert targets[:, 0].tolist() == [2, 2, 3, 3, 4, 4]
    with pytest.raises(ValueError, match="size"):
        knowledge.KnowledgeBuffer(0)


def _confident_and_uncertain(n: int = 200, classes: int = 10) -> np.ndarray:
    probabilities = np.full((n, classes), 1.0 / classes)  # rows >= n/2: maximal entropy
    probabilities[: n // 2] = 0.001
    probabilities[: n // 2, 0] = 1 - 0.001 * (classes - 1)  # rows < n/2: confident
    return probabilities


def test_importance_sampling_draws_high_entropy_samples_more_often():
    probabilities = _confident_and_uncertain()
    uncertainty = knowledge.prediction_entropy(probabilities)
    rng = np.random.default_rng(0)
    counts = {1.0: np.zeros(200), -1.0: np.zeros(200)}
    for sign in counts:
        weights = knowledge.sampling_weights(uncertainty, sign=sign)
        for _ in range(2000):
            counts[sign][knowledge.draw_weighted(weights, 2, rng=rng)] += 1
    gap = math.exp(uncertainty[150] - uncertainty[0])
    high, low = counts[1.0][100:].sum(), counts[1.0][:100].sum()
    assert high / low == pytest.approx(gap, rel=0.15)  # Eq. 4: weight exp(+u)
    assert counts[-1.0][:100].sum() / counts[-1.0][100:].sum() == pytest.approx(gap, rel=0.15)  # Eq. 5


def test_strategy_draws_kt_samples_by_eq4(tmp_path, monkeypatch):
    strategy = _strategy(tmp_path, "strategy.k=3")
    probabilities = _confident_and_uncertain(strategy.num_public)
    monkeypatch.setattr(pkt, "predict_proba", lambda model, x: probabilities[: len(x)])
    arrays = strategy.initial_arrays()
    uncertain = np.zeros(strategy.num_public, dtype=bool)
    uncertain[strategy.num_public // 2 :] = True
    hits = [uncertain[strategy.draw_kt_samples(t, arrays)].mean() for t in range(2, 200)]
    assert np.mean(hits) > 0.8  # uniform drawing would give 0.5
    first = strategy.draw_kt_samples(1, arrays)  # round 1: uniform (Algorithm 1, line 3)
    assert len(set(first.tolist())) == 3


def test_fit_targets_learns_soft_targets():
    import torch

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    with torch.no_grad():  # deterministic start without touching torch's global generator
        for parameter in model.parameters():
            parameter.zero_()
    x = np.eye(4, dtype=np.float32).reshape(4, 1, 2, 2)
    targets = np.eye(3)[[0, 1, 2, 0]]
    rng = np.random.default_rng(0)
    first = knowledge.fit_targets(model, x, targets, steps=1, batch_size=None, lr=0.5, rng=rng)
    later = knowledge.fit_targets(model, x, targets, steps=50, batch_size=2, lr=0.5, rng=rng)
    assert later < first / 2
    assert math.isnan(knowledge.fit_targets(model, x, targets, steps=0, batch_size=None, lr=0.5, rng=rng))


def test_knowledge_targets():
    rng = np.random.default_rng(0)
    estimate = np.array([[0.1, 0.7, 0.2], [-0.2, 0.5, 0.7]])
    assert knowledge.knowledge_targets(estimate, mode="argmax", rng=rng).tolist() == [[0, 1, 0], [0, 0, 1]]
    soft = knowledge.knowledge_targets(estimate, mode="soft", rng=rng)
    assert np.allclose(soft.sum(axis=1), 1)
    assert soft.min() >= 0
    assert soft[1].tolist() == pytest.approx([0, 0.5 / 1.2, 0.7 / 1.2])


# ----------------------------------------------------------------------------- client


def test_client_reply_holds_only_k_perturbed_labels(tmp_path):
    strategy = _strategy(tmp_path, "strategy.k=5", "privacy.epsilon=100", "privacy.budget_scope=per_round")
    message = next(iter(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid=None)))
    config = message.content.config_records[keys.CONFIG]
    assert KT_SAMPLES not in message.content.array_records  # simulation: indices only
    assert list(config[KT_INDICES]) == strategy._kt[1].tolist()
    client = client_for(message, make_context(partition_id=strategy.replies.selected(1)[0].client_id))
    reply = client.train()
    content = reply.content
    assert list(content.keys()) == [KT_LABELS]
    assert not content.metric_records
    assert not content.config_records
    record = content.array_records[KT_LABELS]
    assert list(record.keys()) == [KT_LABELS_ARRAY]
    array = record[KT_LABELS_ARRAY]
    assert array.dtype == "uint8"
    assert tuple(array.shape) == (5,)
    assert array_payload_bytes(reply) == 5  # K bytes, nothing else
    labels = decode_labels(array, k=5, num_classes=10)
    # epsilon 20 per label: the labels are the model's predictions (the client did not send them blindly).
    from fl_app.data.federated import federated_data
    from fl_app.learning.training import predict_proba

    data = federated_data(strategy.run.settings.data)
    model = client.train_locally().model()
    predicted = predict_proba(model, data.public_x()[strategy._kt[1]]).argmax(axis=1)
    assert labels.tolist() == predicted.tolist()


def test_client_reply_labels_are_randomized_at_low_epsilon(tmp_path):
    """At epsilon 1e-4 per label (beta ~ 1e-5) the K replied labels are uniform, not the predictions."""
    strategy = _strategy(tmp_path, "strategy.k=100", "privacy.epsilon=0.01", "privacy.budget_scope=per_round")
    assert strategy.beta < 1e-4
    message = next(iter(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid=None)))
    client = client_for(message, make_context(partition_id=strategy.replies.selected(1)[0].client_id))
    reply = client.train()
    assert list(reply.content.keys()) == [KT_LABELS]
    assert array_payload_bytes(reply) == 100
    labels = decode_labels(reply.content.array_records[KT_LABELS][KT_LABELS_ARRAY], k=100, num_classes=10)
    from fl_app.learning.training import predict_proba

    model = client.train_locally().model()
    predicted = predict_proba(model, strategy.public_x[strategy._kt[1]]).argmax(axis=1)
    assert np.mean(labels == predicted) < 0.35  # ~1/C when randomized; 1.0 if sent unperturbed
    assert np.bincount(labels, minlength=10).max() < 30  # close to uniform over the 10 classes
    assert len(set(labels.tolist())) == 10


def test_device_receiving_only_indices_fails_clearly(tmp_path):
    strategy = _strategy(tmp_path, "strategy.send_kt_data=false")
    message = next(iter(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid=None)))
    device = make_context(partition_id=None, node_config={keys.NODE_DATA_PATH: str(tmp_path / "none.npz")})
    with pytest.raises(ValueError, match="send_kt_data=true"):
        client_for(message, device).train()


def test_send_kt_data_works_end_to_end_on_a_device(tmp_path):
    strategy = _strategy(tmp_path, "strategy.send_kt_data=true", "num_rounds=2")
    arrays = strategy.initial_arrays()
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid=None))
    content = messages[0].content
    assert KT_INDICES not in content.config_records[keys.CONFIG]
    sent = content.array_records[KT_SAMPLES][KT_SAMPLES_ARRAY].numpy()
    assert sent.dtype == np.uint8
    assert np.array_equal(sent, strategy.public_x[strategy._kt[1]])
    replies = []
    for index, message in enumerate(messages):
        part = strategy.run.data.client(strategy.replies.selected(1)[index].client_id)
        path = tmp_path / f"device{index}.npz"
        np.savez(path, x=part.x, y=part.y)
        device = make_context(
            partition_id=None, node_id=5000 + index, node_config={keys.NODE_DATA_PATH: str(path)}
        )
        replies.append(client_for(message, device).train())
    new, metrics = strategy.aggregate_train(1, replies)
    assert metrics["reports"] == 3
    assert not all(np.allclose(new[k].numpy(), arrays[k].numpy()) for k in arrays)
    assert len(strategy.buffer) == 1


# ----------------------------------------------------------------------------- server and accounting


def test_total_budget_is_met_by_the_worst_client(tmp_path):
    strategy = _strategy(tmp_path, "privacy.epsilon=2", "num_rounds=6")
    counts = np.zeros(6, dtype=int)
    arrays = strategy.initial_arrays()
    for t in range(1, 7):
        _, (new, _) = _round(strategy, t, arrays, fail_last=(t == 3))
        arrays = new if new is not None else arrays
        for info in strategy.replies.selected(t):
            counts[info.client_id] += 1
    assert strategy.max_participations == counts.max()
    for client in range(6):
        assert strategy.accountant.rounds_participated(client) == counts[client]  # failures are charged
    spent = strategy.epsilon().epsilon
    assert spent <= 2.0 + 1e-9
    assert spent > 1.95  # calibrated to the budget, not far below it
    extras = strategy.round_extras(6)
    assert extras["max_participation"] == counts.max()
    assert strategy.accountant.basic_epsilon() == pytest.approx(2 * counts.max() * strategy.epsilon_per_label)
    summary = strategy.privacy_summary()
    assert summary["epsilon_cumulative"] == pytest.approx(spent)
    assert summary["budget_scope"] == "total"


def test_per_round_budget_accumulates(tmp_path):
    strategy = _strategy(
        tmp_path,
        "privacy.epsilon=3",
        "privacy.budget_scope=per_round",
        "num_rounds=3",
        "strategy.self_train_targets=hard",
        "strategy.self_train_dropout=0.2",
    )
    arrays = strategy.initial_arrays()
    for t in range(1, 4):
        _, (new, _) = _round(strategy, t, arrays)
        arrays = new
    rounds = max(strategy.accountant.rounds_participated(c) for c in range(6))
    assert strategy.accountant.basic_epsilon() == pytest.approx(3.0 * rounds)
    assert strategy.epsilon().epsilon > 3.0 if rounds > 1 else True
    assert strategy.round_extras(3)["epsilon_per_round"] == pytest.approx(3.0, rel=1e-4)


def test_aggregation_fine_tunes_and_rejects_malformed_reports(tmp_path):
    strategy = _strategy(tmp_path)
    arrays = strategy.initial_arrays()
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid=None))
    replies = [
        _labels_reply(messages[0], [3, 4]),
        _labels_reply(messages[1], [3, 4, 5]),  # wrong length
        _labels_reply(messages[2], [3, 4], raw=False),  # floats, not raw class indices
    ]
    new, metrics = strategy.aggregate_train(1, replies)
    assert metrics["reports"] == 1
    assert not all(np.allclose(new[k].numpy(), arrays[k].numpy()) for k in arrays)
    rows, targets = strategy.buffer.fetch()
    assert rows.tolist() == strategy._kt[1].tolist()
    assert targets.argmax(axis=1).tolist() == [3, 4]
    messages = list(strategy.configure_train(2, new, ConfigRecord(), grid=None))
    assert strategy.aggregate_train(2, [error_reply(m) for m in messages])[0] is None
    assert strategy.accountant.rounds_participated(strategy.replies.selected(2)[0].client_id) >= 1


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("strategy.k=0", "strategy.k"),
        ("strategy.k=100000", "strategy.k"),
        ("strategy.buffer_size=0", "strategy.buffer_size"),
        ("strategy.self_train=-1", "strategy.self_train"),
        ("strategy.self_train=100000", "strategy.self_train"),
        ("strategy.server_steps=-1", "strategy.server_steps"),
        ("strategy.knowledge=vote", "strategy.knowledge"),
        ("strategy.self_train_targets=argmax", "strategy.self_train_targets"),
        ("strategy.self_train_dropout=1.0", "strategy.self_train_dropout"),
        ("dataset.public_fraction=0.0", "dataset.public_fraction"),
        ("evaluation.federated_fraction=0.5", "evaluation.federated_fraction"),
    ],
)
def test_validation(override, key):
    from fl_app.config.validation import validate_config

    with pytest.raises(ConfigError) as error:
        validate_config(compose_config([*DIGITS, override]), check_data=False)
    assert error.value.key == key
    validate_config(compose_config(DIGITS), check_data=False)


def test_demo_preset_composes():
    cfg = compose_config(["+experiment=privatekt_demo"])
    assert cfg.strategy.name == "privatekt"
    assert (cfg.strategy.k, cfg.strategy.buffer_size, cfg.strategy.self_train) == (2, 25, 1200)
    assert (cfg.num_clients, cfg.clients_per_round, cfg.local_epochs, cfg.lr) == (80, 40, 5, 0.05)
    assert cfg.privacy.epsilon == 5
    assert cfg.privacy.budget_scope == "per_round"
    assert cfg.dataset.name == "mnist"
    assert cfg.partition.alpha == 0.5
    # the authors' partition and network; self-training through the CNN's own dropout only
    assert (cfg.partition.name, cfg.model, cfg.strategy.self_train_dropout) == (
        "equal_size_dirichlet",
        "auto",
        None,
    )


def _flat_record(arrays) -> np.ndarray:
    return np.concatenate([arrays[k].numpy().ravel().astype(np.float64) for k in arrays])


def test_self_training_moves_the_model_by_default_and_is_a_no_op_without_dropout(tmp_path):
    """Training on the model's own soft predictions has zero gradient unless something (dropout)
    makes the training-time prediction differ from the target: the default must move the weights."""
    import copy

    strategy = _strategy(tmp_path)
    assert (
        strategy.self_train > 0 and strategy.self_train_dropout == 0.2
    )  # null -> 0.2: the MLP has no dropout
    arrays = strategy.initial_arrays()
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid=None))
    replies = [_labels_reply(m, [1] * strategy.k) for m in messages]
    models = {}
    for name, changes in {
        "default": {},
        "no self-training": {"self_train": 0},
        "no dropout": {"self_train_dropout": 0.0},
    }.items():
        variant = copy.deepcopy(strategy)
        for attribute, value in changes.items():
            setattr(variant, attribute, value)
        new, _ = variant.aggregate_train(1, replies)
        models[name] = _flat_record(new)
    fine_tuned_only = models["no self-training"]
    assert np.abs(models["default"] - fine_tuned_only).max() > 1e-4
    assert np.abs(models["no dropout"] - fine_tuned_only).max() < 1e-6


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ([], 0.2),  # the MLP on digits: no dropout of its own, input dropout makes self-training move
        (["model=privatekt_cnn", "dataset=fashion_mnist"], 0.0),  # the authors' CNN: its own dropout only
        (["model=privatekt_cnn", "dataset=fashion_mnist", "strategy.self_train_dropout=0.1"], 0.1),
        (["strategy.self_train_dropout=0.0"], 0.0),
    ],
)
def test_self_training_input_dropout_is_the_authors_for_their_cnn(tmp_path, overrides, expected):
    strategy = _strategy(tmp_path, *overrides)
    assert strategy.self_train_dropout == expected


@pytest.mark.parametrize("first_draw", ["entropy", "uniform"])
def test_first_round_transfer_samples_follow_first_draw(tmp_path, first_draw):
    strategy = _strategy(tmp_path, f"strategy.first_draw={first_draw}")
    arrays = strategy.initial_arrays()
    drawn = strategy.draw_kt_samples(1, arrays)
    rng = strategy.run.randomness.generator("privatekt-kt-sampling", server_round=1)
    uniform = np.sort(rng.choice(strategy.num_public, size=strategy.k, replace=False))
    assert len(set(drawn.tolist())) == strategy.k
    assert (drawn.tolist() == uniform.tolist()) == (first_draw == "uniform")


def test_model_auto_is_the_authors_cnn_on_28x28_images():
    from fl_app.learning.models import build_model

    settings = settings_of(["strategy=privatekt", "dataset=fashion_mnist"])
    assert PrivateKTStrategy.declaration.model_name(settings, (1, 28, 28)) == "privatekt_cnn"
    assert PrivateKTStrategy.declaration.model_name(settings, (1, 8, 8)) == "mlp"  # digits: too small
    model = build_model("privatekt_cnn", (1, 28, 28), 10)
    assert sum(p.numel() for p in model.parameters()) == 1_682_890  # the authors' ~1.68 M
    assert sum(isinstance(m, torch.nn.Dropout) for m in model.modules()) == 5
    first = model.features[0]
    bound = math.sqrt(6.0 / (first.in_channels * 25 + first.out_channels * 25))  # Glorot uniform
    largest = float(first.weight.detach().abs().max())
    assert 0.9 * bound < largest <= bound
    biases = [m.bias for m in model.modules() if isinstance(m, torch.nn.Conv2d | torch.nn.Linear)]
    assert len(biases) == 6 and all(float(b.detach().abs().max()) == 0.0 for b in biases)


def test_server_training_with_dropout_is_seeded_and_moves_the_weights():
    """With the authors' CNN, self-training on the model's own predictions moves the weights (dropout),
    and the same generator gives the same model (seeded masks)."""
    from fl_app.learning.models import build_model
    from fl_app.learning.training import model_to_arrays, predict_proba

    x = np.random.default_rng(0).random((40, 1, 28, 28), dtype=np.float32)
    results = []
    for _ in range(2):
        torch.manual_seed(1)
        model = build_model("privatekt_cnn", (1, 28, 28), 10)
        before = _flat_record(model_to_arrays(model))
        own = predict_proba(model, x)
        knowledge.fit_targets(model, x, own, steps=2, batch_size=20, lr=0.05, rng=np.random.default_rng(7))
        results.append(_flat_record(model_to_arrays(model)))
    assert np.abs(results[0] - before).max() > 1e-5
    assert np.array_equal(results[0], results[1])


# ------------------------------------------------------------------ its quick example (test_simulations)


def check_quick_example(results: dict[str, Any], example: Any) -> None:
    """What its quick example's run must show beyond the common checks (tests/test_simulations.py)."""
    privacy = results["privacy"]
    k = privacy["k"]
    for r in results["rounds"]:  # K one-byte labels per report, nothing else
        assert r["reports"] == r["clients"] == example.clients_per_round
        assert r["upload_array_bytes"] == example.clients_per_round * k
    assert privacy["epsilon_cumulative"] == pytest.approx(results["final"]["epsilon"])
    assert privacy["epsilon_per_round"] == pytest.approx(k * privacy["epsilon_per_label"])
    assert privacy["kt_data_sent_as"] == "indices"
