"""DPFL-BNN (Liu et al. 2023): binary network, RR_gamma, bit packing, upload size, accounting."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import build_run_context, client_for, error_reply, make_context, make_message, reply_to
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from clients.dpfl_bnn import (
    BNN_PACKED_SIGNS,
    BNN_STATE_ADAM,
    BNN_STATE_LATENT,
    pack_signs,
    packed_length,
    signs_of,
    unpack_signs,
)
from fl_app import keys
from fl_app.config.compose import compose_config
from fl_app.config.validation import ConfigError, validate_config
from fl_app.engine.messages import content_bytes
from fl_app.learning.model_spec import ModelSpec
from fl_app.learning.models import BinaryCNN, BinaryLinear, binarize
from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.events import BinaryRandomizedResponse, PrivacyEvent
from fl_app.privacy.mechanisms import binary_randomized_response
from fl_app.run.results import load_model_arrays
from strategies.dpfl_bnn.privacy import binary_rr_epsilon, bnn_gamma, bnn_gamma_theorem1
from strategies.dpfl_bnn.strategy import DPFLBNNStrategy

DIGITS = [
    "dataset=digits",
    "num_clients=6",
    "clients_per_round=3",
    "num_rounds=4",
    "model=bnn_cnn",
    "strategy=dpfl_bnn",
    "strategy.local_steps=3",
]
DELTA = 1e-5


def _strategy(tmp_path, *extra: str) -> DPFLBNNStrategy:
    return DPFLBNNStrategy(build_run_context([*DIGITS, *extra], tmp_path))


def _train_message(strategy: DPFLBNNStrategy, arrays: ArrayRecord, server_round: int = 1):
    """The real train message the strategy sends to its first selected client."""
    return next(iter(strategy.configure_train(server_round, arrays, ConfigRecord(), grid=None)))


def _packed_reply(message, signs: np.ndarray):
    content = RecordDict({keys.ARRAYS: ArrayRecord({BNN_PACKED_SIGNS: Array(pack_signs(signs))})})
    from flwr.app import Message

    return Message(content=content, reply_to=message)


# ---------------------------------------------------------------------------- model


def test_sign_ties_to_plus_one_and_straight_through_gradient():
    weight = torch.tensor([-1.5, -1.0, -0.3, 0.0, 0.2, 1.0, 2.0], requires_grad=True)
    out = binarize(weight)
    assert out.tolist() == [-1, -1, -1, 1, 1, 1, 1]
    upstream = torch.arange(1.0, 8.0)
    (out * upstream).sum().backward()
    # Straight-through (hard tanh): the incoming gradient where |w| <= 1, zero outside.
    assert weight.grad.tolist() == [0.0, 2.0, 3.0, 4.0, 5.0, 6.0, 0.0]


def test_binary_layer_uses_only_signs_and_passes_the_binary_gradient_to_the_latent_weights():
    generator = torch.Generator().manual_seed(0)
    layer = BinaryLinear(5, 3)
    with torch.no_grad():
        layer.weight.copy_(torch.rand(3, 5, generator=generator) * 2 - 1)
    x = torch.rand(4, 5, generator=generator)
    binary = torch.where(layer.weight >= 0, 1.0, -1.0).detach().requires_grad_(True)
    expected = torch.nn.functional.linear(x, binary) * (2.0 / math.sqrt(5))
    assert torch.allclose(layer(x), expected)
    expected.square().sum().backward()
    layer(x).square().sum().backward()
    assert torch.allclose(layer.weight.grad, binary.grad)


@pytest.mark.parametrize(
    ("shape", "bits"),
    [
        ((1, 8, 8), 144 + 2304 + 64 * 100 + 1000),
        ((1, 28, 28), 144 + 2304 + 784 * 100 + 1000),
        ((3, 12, 12), None),
    ],
)
def test_bnn_cnn_is_binary_for_any_input_size(shape, bits):
    model = BinaryCNN(shape, 10)
    assert all(name.endswith("weight") for name in model.state_dict())
    assert list(dict(model.named_parameters())) == list(model.state_dict())  # no buffers, no biases
    if bits is not None:
        assert sum(p.numel() for p in model.parameters()) == bits
    x = torch.rand(2, *shape)
    logits = model(x)
    assert logits.shape == (2, 10)
    with torch.no_grad():  # the forward pass depends on the signs of the latent weights only
        for parameter in model.parameters():
            parameter.mul_(0.01)
    assert torch.allclose(model(x), logits, atol=1e-6)


# ---------------------------------------------------------------------------- bits


@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 63, 64, 65, 81848])
def test_bit_packing_round_trips_at_8_weights_per_byte(count):
    signs = np.where(np.random.default_rng(count).random(count) < 0.5, -1, 1).astype(np.int8)
    packed = pack_signs(signs)
    assert packed.dtype == np.uint8
    assert packed.size == packed_length(count) == math.ceil(count / 8)
    assert np.array_equal(unpack_signs(packed, count, dtype=np.int8), signs)


def test_bit_packing_layout_and_rejections():
    assert pack_signs(np.array([1, -1, -1, -1, -1, -1, -1, 1, 1])).tolist() == [0b10000001, 0b10000000]
    assert signs_of(np.array([-0.2, 0.0, 0.3])).tolist() == [-1, 1, 1]
    with pytest.raises(ValueError, match="-1 and"):
        pack_signs(np.array([1, 0, -1]))
    with pytest.raises(ValueError, match="bytes"):
        unpack_signs(np.zeros(3, dtype=np.uint8), 8)
    with pytest.raises(ValueError, match="padding"):
        unpack_signs(np.array([0b00000001], dtype=np.uint8), 7)
    with pytest.raises(ValueError, match="uint8"):
        unpack_signs(np.zeros(1, dtype=np.int16), 8)


# ---------------------------------------------------------------------------- RR_gamma


@pytest.mark.parametrize("gamma", [0.0, 0.1, 0.4])
def test_rr_gamma_flips_each_coordinate_independently(gamma):
    rng = np.random.default_rng(11)
    signs = np.where(np.arange(64) % 3 == 0, -1, 1).astype(np.int8)
    trials = 6000
    flips = np.stack(
        [binary_randomized_response(signs=signs, gamma=gamma, rng=rng) != signs for _ in range(trials)]
    )
    rate = flips.mean(axis=0)  # per coordinate
    std = math.sqrt((0.5 - gamma) * (0.5 + gamma) / trials)
    assert np.all(np.abs(rate - (0.5 - gamma)) < 5 * std)
    # independent across coordinates: a per-layer flip would make them perfectly correlated
    if gamma > 0:
        correlation = np.corrcoef(flips[:, :8].T.astype(float))
        assert np.all(np.abs(correlation[np.triu_indices(8, 1)]) < 0.08)


def test_client_upload_is_rr_gamma_of_its_binary_weights_per_coordinate(tmp_path):
    gamma = 0.3
    strategy = _strategy(tmp_path, f"strategy.gamma={gamma}")
    message = _train_message(strategy, strategy.initial_arrays())
    context = make_context(partition_id=strategy.replies.selected(1)[0].client_id)
    reply = client_for(message, context).train()
    uploaded = unpack_signs(
        reply.content.array_records[keys.ARRAYS][BNN_PACKED_SIGNS].numpy(), strategy.num_bits
    )
    latent = context.state.array_records[BNN_STATE_LATENT]
    flipped = uploaded != np.concatenate([signs_of(latent[n].numpy()).ravel() for n in strategy.names])
    d = strategy.num_bits
    assert abs(flipped.mean() - (0.5 - gamma)) < 5 * math.sqrt(0.21 / d)
    start = 0
    for shape in strategy.shapes:  # every layer is partly flipped: per coordinate, not per layer
        size = int(np.prod(shape))
        layer_rate = flipped[start : start + size].mean()
        assert abs(layer_rate - (0.5 - gamma)) < 5 * math.sqrt(0.21 / size) + 1e-9
        start += size


def test_noise_free_bnn_uploads_its_signs_and_is_not_private(tmp_path):
    strategy = _strategy(tmp_path, "strategy.noise=none")
    assert strategy.accountant is None
    assert strategy.epsilon() is None
    message = _train_message(strategy, strategy.initial_arrays())
    context = make_context(partition_id=strategy.replies.selected(1)[0].client_id)
    reply = client_for(message, context).train()
    uploaded = unpack_signs(
        reply.content.array_records[keys.ARRAYS][BNN_PACKED_SIGNS].numpy(), strategy.num_bits
    )
    latent = context.state.array_records[BNN_STATE_LATENT]
    assert np.array_equal(
        uploaded, np.concatenate([signs_of(latent[n].numpy()).ravel() for n in strategy.names])
    )
    strategy.aggregate_train(1, [reply])
    assert strategy.round_extras(1)["epsilon_per_coordinate"] is None
    assert strategy.privacy_summary()["unit"] == "none"


# ---------------------------------------------------------------------------- message size


def test_uploaded_message_is_about_d_over_8_bytes(tmp_path):
    strategy = _strategy(tmp_path, "strategy.gamma=0.2")
    message = _train_message(strategy, strategy.initial_arrays())
    reply = client_for(message, make_context(partition_id=strategy.replies.selected(1)[0].client_id)).train()
    d = strategy.num_bits
    size = content_bytes(reply)  # the serialised content, as the metered grid counts it
    assert list(reply.content.keys()) == [keys.ARRAYS]  # nothing but the bits leaves the client
    assert d / 8 <= size <= d / 8 + 700
    # The same network's float32 weights are 4d bytes: at MNIST size (d = 81,848) the fixed
    # overhead measured here keeps the upload more than 30x smaller.
    overhead = size - packed_length(d)
    mnist_bits = 144 + 2304 + 784 * 100 + 1000
    assert 4 * mnist_bits / (packed_length(mnist_bits) + overhead) > 30


# ---------------------------------------------------------------------------- client state


def test_client_keeps_latent_and_adam_state_and_merges_the_aggregate(tmp_path):
    strategy = _strategy(tmp_path, "strategy.gamma=0.2", "strategy.beta=0.3")
    message = _train_message(strategy, strategy.initial_arrays())
    client_id = strategy.replies.selected(1)[0].client_id
    context = make_context(partition_id=client_id)
    client_for(message, context).train()
    latent = {n: a.numpy().copy() for n, a in context.state.array_records[BNN_STATE_LATENT].items()}
    assert all(np.all(np.abs(v) <= 1) for v in latent.values())
    adam = context.state.array_records[BNN_STATE_ADAM]
    assert float(adam["__step__"].numpy()) == 3
    aggregate = ArrayRecord(
        {
            n: Array(np.full(s, 0.5, dtype=np.float32))
            for n, s in zip(strategy.names, strategy.shapes, strict=True)
        }
    )
    second = make_message(dict(message.content.config_records[keys.CONFIG]), aggregate)
    client = client_for(second, context)
    _model, merged = client._local_model()
    for name in strategy.names:
        assert np.allclose(merged[name], 0.3 * 0.5 + 0.7 * latent[name], atol=1e-6)
    client.train()
    assert float(context.state.array_records[BNN_STATE_ADAM]["__step__"].numpy()) == 6


# ---------------------------------------------------------------------------- server


def test_server_averages_noised_bits_accounts_every_selected_client_and_binarizes(tmp_path):
    strategy = _strategy(tmp_path, "strategy.gamma=0.25")
    messages = list(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid=None))
    d = strategy.num_bits
    rng = np.random.default_rng(3)
    uploads = [np.where(rng.random(d) < 0.5, -1, 1) for _ in range(2)]
    replies = [
        _packed_reply(messages[0], uploads[0]),
        _packed_reply(messages[1], uploads[1]),
        error_reply(messages[2]),
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    flat = np.concatenate([arrays[n].numpy().ravel() for n in strategy.names])
    assert np.allclose(flat, (uploads[0] + uploads[1]) / 2)
    selected = [c.client_id for c in strategy.replies.selected(1)]
    assert strategy.replies.failures(1) == [selected[2]]
    for client in strategy.run.client_ids:  # failures are charged too
        assert strategy.accountant.rounds_participated(client) == (1 if client in selected else 0)
    assert strategy.accountant.history(selected[2]) == {BinaryRandomizedResponse(0.25): d}
    assert strategy.ledger.coordinate_accountant.history(selected[2]) == {BinaryRandomizedResponse(0.25): 1}
    # malformed upload (wrong length) is left out and counted as a failure
    messages = list(strategy.configure_train(2, arrays, ConfigRecord(), grid=None))
    bad = reply_to(messages[0], arrays=ArrayRecord({BNN_PACKED_SIGNS: Array(np.zeros(3, dtype=np.uint8))}))
    good = [_packed_reply(m, uploads[0]) for m in messages[1:]]
    arrays2, _ = strategy.aggregate_train(2, [bad, *good])
    assert np.allclose(np.concatenate([arrays2[n].numpy().ravel() for n in strategy.names]), uploads[0])
    assert strategy.replies.failures(2) == [strategy.replies.selected(2)[0].client_id]
    # evaluation uses Sign(W~)
    data = strategy.run.data.test()
    model = ModelSpec.from_json(strategy.run.model_spec.to_json()).build()
    model.load_state_dict(
        {n: torch.from_numpy(signs_of(arrays[n].numpy()).astype(np.float32)) for n in arrays}
    )
    from fl_app.learning.training import evaluate

    assert strategy.evaluate_global(arrays, data.x, data.y) == pytest.approx(evaluate(model, data.x, data.y))
    initial = strategy.initial_arrays()
    assert all(set(np.unique(initial[n].numpy())) <= {-1.0, 1.0} for n in initial)


# ---------------------------------------------------------------------------- privacy


def _lemma3_rdp(gamma: float, order: float) -> float:
    """Independent oracle: Lemma 3 (Mironov 2017, Prop. 5) with numpy's logaddexp."""
    p, q = 0.5 + gamma, 0.5 - gamma
    return np.logaddexp(
        order * np.log(p) + (1 - order) * np.log(q), order * np.log(q) + (1 - order) * np.log(p)
    ) / (order - 1)


@pytest.mark.parametrize(("epsilon", "rounds"), [(1.0, 100), (4.0, 100), (8.0, 10), (16.0, 300)])
def test_gamma_from_theorem1_meets_epsilon_in_the_accountant(epsilon, rounds):
    gamma = bnn_gamma_theorem1(epsilon=epsilon, delta=DELTA, rounds=rounds)
    assert 0 < gamma < 0.5
    # Theorem 1's own argument (order corrected to log(1/delta)), evaluated independently
    order = 1 + 2 * math.log(1 / DELTA) / epsilon
    assert rounds * _lemma3_rdp(gamma, order) + math.log(1 / DELTA) / (order - 1) <= epsilon + 1e-9
    accountant = PrivacyAccountant(population=[0, 1], unit="coordinate")
    for t in range(1, rounds + 1):
        accountant.record(PrivacyEvent(t, BinaryRandomizedResponse(gamma), participants=(0,)))
    assert accountant.epsilon(delta=DELTA).epsilon <= epsilon
    optimised = bnn_gamma(epsilon=epsilon, delta=DELTA, rounds=rounds)
    assert optimised >= gamma
    assert binary_rr_epsilon(gamma=optimised, delta=DELTA, rounds=rounds) <= epsilon


def test_per_coordinate_epsilon_is_not_a_client_level_guarantee():
    """One d-bit upload of two clients whose binary weights differ everywhere: an audit refutes (a)."""
    from fl_app.privacy.audit import audit_epsilon

    gamma, d, trials = 0.1, 200, 3000
    rng = np.random.default_rng(5)
    ones = np.ones(d, dtype=np.int8)
    # the server's statistic: how many uploaded bits are +1
    a = [int((binary_randomized_response(signs=ones, gamma=gamma, rng=rng) > 0).sum()) for _ in range(trials)]
    b = [
        int((binary_randomized_response(signs=-ones, gamma=gamma, rng=rng) > 0).sum()) for _ in range(trials)
    ]
    audit = audit_epsilon(outputs_a=np.array(a), outputs_b=np.array(b), delta=DELTA, discrete=False)
    per_coordinate = binary_rr_epsilon(gamma=gamma, delta=DELTA, rounds=1)
    client_level = binary_rr_epsilon(gamma=gamma, delta=DELTA, rounds=1, bits_per_round=d)
    assert not audit.passes(per_coordinate)  # the document's number is violated by one upload
    assert audit.epsilon_lower_bound > 5 * per_coordinate
    assert audit.passes(client_level)


@pytest.mark.parametrize("calibration", ["per_coordinate", "client_level"])
def test_calibrated_strategy_meets_epsilon_in_its_accounting_and_reports_both(tmp_path, calibration):
    strategy = _strategy(tmp_path, "privacy.epsilon=4", f"strategy.calibration={calibration}")
    d, rounds = strategy.num_bits, 4
    for t in range(1, rounds + 1):
        messages = list(strategy.configure_train(t, strategy.initial_arrays(), ConfigRecord(), grid=None))
        strategy.aggregate_train(t, [_packed_reply(m, np.ones(d)) for m in messages])
    client_level = strategy.epsilon().epsilon
    per_coordinate = strategy.epsilon_per_coordinate()
    worst = max(strategy.accountant.rounds_participated(c) for c in strategy.run.client_ids)
    assert client_level == pytest.approx(
        binary_rr_epsilon(gamma=strategy.gamma, delta=DELTA, rounds=worst, bits_per_round=d)
    )
    assert per_coordinate == pytest.approx(binary_rr_epsilon(gamma=strategy.gamma, delta=DELTA, rounds=worst))
    assert client_level > 50 * per_coordinate
    if calibration == "per_coordinate":
        assert strategy.gamma == pytest.approx(bnn_gamma(epsilon=4, delta=DELTA, rounds=rounds))
        assert per_coordinate <= 4
    else:
        assert client_level <= 4
        assert strategy.gamma < 0.01
    summary = strategy.privacy_summary()
    assert summary["unit"].startswith("one client's entire data set")
    assert summary["client_level"]["uses_per_round"] == d
    assert summary["per_coordinate"]["uses_per_round"] == 1
    assert "NOT a client-level" in summary["per_coordinate"]["unit"]


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("strategy.gamma=0.5", "strategy.gamma"),
        ("strategy.gamma=-0.1", "strategy.gamma"),
        ("strategy.beta=1.5", "strategy.beta"),
        ("model=cnn", "model"),
        ("strategy.noise=laplace", "strategy.noise"),
        ("strategy.calibration=per_layer", "strategy.calibration"),
        ("evaluation.federated_fraction=0.5", "evaluation.federated_fraction"),
        ("strategy.local_steps=-1", "strategy.local_steps"),
        ("privacy.budget_scope=per_round", "privacy.budget_scope"),
    ],
)
def test_validation_rejects(override, key):
    with pytest.raises(ConfigError) as caught:
        validate_config(compose_config([*DIGITS, override]), check_data=False)
    assert caught.value.key == key


def test_validation_accepts_gamma_zero_noise_free_and_auto_model(tmp_path):
    validate_config(compose_config([*DIGITS, "strategy.gamma=0"]), check_data=False)
    validate_config(compose_config([*DIGITS, "model=auto"]), check_data=False)
    assert build_run_context([*DIGITS, "model=auto"], tmp_path).model_spec.name == "bnn_cnn"
    validate_config(compose_config([*DIGITS, "strategy.noise=none"]), check_data=False)
    with pytest.raises(ConfigError):
        validate_config(
            compose_config([*DIGITS, "strategy.noise=none", "strategy.gamma=0.1"]), check_data=False
        )


# ------------------------------------------------------------------ its quick example (test_simulations)


def check_quick_example(results: dict[str, Any], example: Any) -> None:
    """What its quick example's run must show beyond the common checks (tests/test_simulations.py)."""
    spec, arrays = load_model_arrays(Path(results["_output_dir"]) / "final_model.npz")
    assert spec.name == "bnn_cnn"
    assert all(np.all(np.abs(a) <= 1) for a in arrays.values())  # W~: a mean of +-1 uploads
    privacy = results["privacy"]
    gamma, bits, delta = privacy["gamma"], privacy["bits_per_upload"], example.privacy.delta
    rounds = results["rounds"]
    for t, r in enumerate(rounds, start=1):
        assert r["epsilon"] == pytest.approx(
            binary_rr_epsilon(gamma=gamma, delta=delta, rounds=t, bits_per_round=bits), rel=1e-6
        )
        assert r["epsilon_per_coordinate"] == pytest.approx(
            binary_rr_epsilon(gamma=gamma, delta=delta, rounds=t), rel=1e-6
        )
        assert r["uploads_aggregated"] == r["clients"] == example.clients_per_round
        assert bits / 8 * r["clients"] <= r["upload_bytes"] <= (bits / 8 + 700) * r["clients"]
        assert "local_model_accuracy" not in r  # un-noised local models never in rounds
