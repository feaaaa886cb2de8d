"""The text networks, their loss and metrics, and who trains them (the loop, the cohort trainer, DP-SGD).

Parameter counts against the papers' (the word LSTM: 4,050,748, Reddi et al. 2021) and against Keras's
layer formulas; the LSTM layer against ``torch.nn.LSTM``; the metric against a hand-computed example.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from fl_app.learning.model_spec import ModelSpec
from fl_app.learning.models import build_model, resolve_model_name
from fl_app.learning.sequence import NextToken, mark_next_token
from fl_app.learning.text_models import LSTMLayer, check_text_model_fits
from fl_app.learning.training import evaluate, train_local
from fl_app.privacy.dp_sgd import per_example_gradients


def keras_lstm(inputs: int, units: int) -> int:
    """Keras's LSTM: 4 gates of input and recurrent kernels and one bias."""
    return 4 * (units * (inputs + units) + units)


@pytest.mark.parametrize(
    ("name", "vocabulary", "length", "expected"),
    [
        # Reddi et al. 2021 (Adaptive Federated Optimization), Stack Overflow NWP: 4,050,748 parameters
        ("word_lstm", 10004, 20, 4_050_748),
        # TFF's Shakespeare model (utils/models/shakespeare_models.py) on its 90 tokens, by Keras's formulas
        ("char_lstm", 90, 80, 90 * 8 + keras_lstm(8, 256) + keras_lstm(256, 256) + 256 * 90 + 90),
    ],
)
def test_paper_networks_shapes_and_sizes(name: str, vocabulary: int, length: int, expected: int) -> None:
    network = build_model(name, (length,), vocabulary)
    assert sum(p.numel() for p in network.parameters()) == expected
    shapes = {k: tuple(v.shape) for k, v in network.state_dict().items()}
    if name == "word_lstm":
        assert shapes["embedding.weight"] == (10004, 96)
        assert shapes["lstm.weight_ih"] == (4 * 670, 96) and shapes["lstm.weight_hh"] == (4 * 670, 670)
        assert shapes["projection.weight"] == (96, 670) and shapes["output_layer.weight"] == (10004, 96)
    else:
        assert shapes["embedding.weight"] == (90, 8)
        assert shapes["lstm1.weight_hh"] == (1024, 256) and shapes["lstm2.weight_ih"] == (1024, 256)
    tokens = torch.randint(0, vocabulary, (3, length))
    assert tuple(network(tokens).shape) == (3, length, vocabulary)
    assert not list(network.buffers())  # nothing a private run could not clip and noise


def test_auto_picks_the_papers_network() -> None:
    assert resolve_model_name("auto", (80,), 90) == "char_lstm"
    assert resolve_model_name("auto", (20,), 10004) == "word_lstm"
    assert resolve_model_name("auto", (1, 28, 28), 10) == "cnn"


def test_lstm_layer_is_torch_lstm_with_one_bias_fused_and_unrolled() -> None:
    torch.manual_seed(0)
    layer = LSTMLayer(5, 7)
    reference = nn.LSTM(5, 7, batch_first=True)
    with torch.no_grad():
        reference.weight_ih_l0.copy_(layer.weight_ih)
        reference.weight_hh_l0.copy_(layer.weight_hh)
        reference.bias_ih_l0.copy_(layer.bias)
        reference.bias_hh_l0.zero_()
    x = torch.randn(3, 6, 5)
    expected = reference(x)[0]
    torch.testing.assert_close(layer(x), expected)
    torch.testing.assert_close(layer.unrolled(x), expected, rtol=1e-5, atol=1e-6)
    assert torch.all(layer.bias[7:14] == 1.0)  # Keras's unit forget bias


def test_transformer_is_causal() -> None:
    torch.manual_seed(1)
    network = build_model("causal_transformer", (10,), 30).eval()
    tokens = torch.randint(1, 30, (2, 10))
    changed = tokens.clone()
    changed[:, 6] = (changed[:, 6] + 1) % 30
    with torch.no_grad():
        a, b = network(tokens), network(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])
    with pytest.raises(ValueError, match="at most 10 tokens"):
        network(torch.zeros(1, 11, dtype=torch.long))


def test_metric_by_hand() -> None:
    """Two sequences of 3 positions, vocabulary of 6 (pad 0, words 1-2, oov 3, bos 4, eos 5)."""
    logits = torch.full((2, 3, 6), -2.0)
    targets = torch.tensor([[1, 3, 5], [2, 0, 0]])  # word, oov, eos; word, pad, pad
    logits[0, 0, 1] = 3.0  # right
    logits[0, 1, 3] = 3.0  # right, but oov is not counted for Stack Overflow
    logits[0, 2, 5] = 3.0  # right, but eos is never counted
    logits[1, 0, 1] = 3.0  # wrong (target 2)
    logits[1, 1, 4] = 3.0  # a pad target: not counted, not in the loss
    task = NextToken((0, 3, 5))
    loss_sum, valid, correct, counted = task.sums(logits, targets)
    # log-softmax of a row with one 3.0 and five -2.0: at the 3.0, -log(1 + 5e-5); elsewhere -5 - log(...)
    top = math.log(math.exp(3.0) + 5 * math.exp(-2.0))
    right, wrong = top - 3.0, top + 2.0
    assert valid == 4 and counted == 2 and correct == 1
    assert loss_sum == pytest.approx(3 * right + wrong, rel=1e-6)
    assert float(task.loss(logits, targets)) == pytest.approx((3 * right + wrong) / 4, rel=1e-6)
    with_oov = NextToken((0, 5)).sums(logits, targets)
    assert (with_oov[2], with_oov[3]) == (2, 3)
    assert task.baseline_accuracy(np.array([[1, 1, 2, 3, 3, 3, 5, 0]])) == pytest.approx(2 / 3)


class Fixed(nn.Module):
    """Scores that ignore the input: a row of logits per position (what evaluate must count)."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = nn.Parameter(logits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.logits[: x.shape[1]].expand(x.shape[0], -1, -1)


def test_evaluate_and_train_local_use_the_task() -> None:
    logits = torch.zeros(3, 6)
    logits[:, 1] = 2.0  # always predicts token 1
    network = mark_next_token(Fixed(logits), (0, 3, 5))
    x = np.array([[4, 1, 2], [4, 3, 5]], dtype=np.uint16)
    y = np.array([[1, 2, 5], [3, 5, 0]], dtype=np.uint16)
    loss, accuracy = evaluate(network, x, y)
    assert accuracy == pytest.approx(1 / 2)  # counted: 1 (right), 2 (wrong)
    per = torch.log_softmax(logits[0], dim=0)
    assert loss == pytest.approx(float(-(per[1] + per[2] + per[5] + per[3] + per[5]) / 5), rel=1e-6)
    trained = train_local(network, x, y, epochs=1, batch_size=2, lr=0.1, rng=np.random.default_rng(0))
    assert trained == pytest.approx(loss, rel=1e-6)  # one batch: the loss before its step


def test_model_spec_carries_the_task() -> None:
    spec = ModelSpec("char_lstm", (12,), 90, (0, 89))
    again = ModelSpec.from_json(spec.to_json())
    assert again == spec
    task = getattr(again.build(), "next_token_task", None)
    assert task == NextToken((0, 89))
    assert ModelSpec("mlp", (1, 8, 8), 10).to_json() == (
        '{"name": "mlp", "input_shape": [1, 8, 8], "num_classes": 10}'
    )  # a classifier's spec is what it always was


def test_fit_check_names_vocabulary_and_length() -> None:
    network = build_model("causal_transformer", (16,), 50)
    check_text_model_fits(network, "causal_transformer", np.zeros((1, 16), dtype=np.uint16), 50)
    with pytest.raises(ValueError, match="does not take this data's token sequences of length 20"):
        check_text_model_fits(network, "causal_transformer", np.zeros((1, 20), dtype=np.uint16), 50)
    with pytest.raises(ValueError, match=r"must give next-token scores of shape \(1, 16, 60\)"):
        check_text_model_fits(network, "causal_transformer", np.zeros((1, 16), dtype=np.uint16), 60)


def text_cohort(vocabulary: int, length: int, sizes: list[int]) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(0)
    rows = [rng.integers(1, vocabulary, size=(n, length + 1)).astype(np.uint16) for n in sizes]
    for r in rows:
        if len(r):
            r[0, length // 2 :] = 0  # a short sentence, padded
    return [r[:, :-1] for r in rows], [r[:, 1:] for r in rows]


@pytest.mark.parametrize(
    "name", ["char_lstm", "word_lstm", "causal_transformer", "pfl_transformer", "pfl_lstm"]
)
def test_cohort_trainer_equals_the_loop(name: str) -> None:
    """torch.func batches the unrolled LSTM and the attention: the cohort's result is the loop's."""
    from tests.test_vectorised_training import run_both

    torch.manual_seed(0)
    network = mark_next_token(build_model(name, (8,), 30), (0, 29))
    xs, ys = text_cohort(30, 8, [3, 6, 0, 4])
    result = run_both(network, xs, ys, epochs=2, batch_size=4, lr=0.5, momentum=0.5)
    assert np.isnan(result.losses[2]) and np.isfinite(result.losses[[0, 1, 3]]).all()


def test_dp_sgd_per_example_gradients_on_the_lstm() -> None:
    """One example is one sequence: its gradient is the gradient of its own mean non-pad loss."""
    torch.manual_seed(0)
    network = mark_next_token(build_model("char_lstm", (6,), 20), (0, 19))
    xs, ys = text_cohort(20, 6, [3])
    x, y = torch.from_numpy(xs[0].astype(np.int64)), torch.from_numpy(ys[0].astype(np.int64))
    grads, losses = per_example_gradients(network, x, y)
    for i in range(3):
        network.zero_grad()
        loss = NextToken((0, 19)).loss(network(x[i : i + 1]), y[i : i + 1])
        loss.backward()
        assert float(losses[i]) == pytest.approx(float(loss.detach()), rel=1e-5)
        for got, parameter in zip(grads, network.parameters(), strict=True):
            torch.testing.assert_close(got[i], parameter.grad, rtol=1e-4, atol=1e-6)
