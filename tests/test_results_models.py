"""Results files (strict JSON, CSV, plots, weights), models and the registries."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch
from conftest import settings_of

from fl_app.config.compose import compose_config
from fl_app.config.registry import Registry
from fl_app.config.settings import RunSettings
from fl_app.learning.model_spec import ModelSpec
from fl_app.learning.models import MODELS, build_model, resolve_model_name
from fl_app.learning.training import evaluate, load_arrays, model_to_arrays, predict_proba, train_local
from fl_app.run.results import RunRecorder, json_safe, load_model_arrays


def test_json_safe_makes_strict_json():
    data = {"a": float("inf"), "b": [np.float32(1.5), float("nan")], "c": np.int64(3), "d": np.arange(2)}
    text = json.dumps(json_safe(data), allow_nan=False)
    assert json.loads(text) == {"a": None, "b": [1.5, None], "c": 3, "d": [0, 1]}


def test_recorder_writes_the_contract(tmp_path):
    settings = settings_of(["dataset=digits", "strategy=fedavg"])
    recorder = RunRecorder(tmp_path, settings)
    recorder.initial = {"accuracy": 0.1, "loss": 2.3}
    for r in (1, 2):
        recorder.add_round(
            {
                "round": r,
                "accuracy": 0.5 + r / 10,
                "loss": 1.0 / r,
                "epsilon": None,
                "upload_bytes": 100 * r,
                "download_bytes": 200,
                "clients": 3,
                "failures": 0,
                "wall_s": float(r),
                "round_s": 1.0,
                "extra": math.inf,
            }
        )
    spec = ModelSpec("mlp", (1, 8, 8), 10)
    model = spec.build()
    results = recorder.finalize(
        strategy="fedavg",
        privacy={"unit": "none", "mechanism": "none", "accountant": "none"},
        final_extras={},
        arrays=model_to_arrays(model),
        model_spec=spec,
        ledger=None,
        wall_s=3.0,
    )
    on_disk = json.loads((tmp_path / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(results))
    assert on_disk["final"] == {
        "accuracy": 0.7,
        "loss": 0.5,
        "evaluated_on": "test",
        "best_accuracy": 0.7,
        "best_round": 2,
        "epsilon": None,
        "delta": 1e-5,
        "wall_s": 3.0,
        "rounds": 2,
        "diverged": False,  # final loss finite and at most 3x the initial one
    }
    assert on_disk["rounds"][1]["extra"] is None
    assert "Infinity" not in (tmp_path / "results.json").read_text()
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header[:4] == ["round", "accuracy", "loss", "epsilon"]
    for name in ("accuracy_loss.png", "epsilon.png", "config.yaml", "final_model.npz"):
        assert (tmp_path / name).stat().st_size > 0
    loaded_spec, arrays = load_model_arrays(tmp_path / "final_model.npz")
    assert loaded_spec == spec
    assert set(arrays) == set(model.state_dict())


def test_tracking_logs_the_finite_numbers_of_each_record_and_refuses_what_it_cannot_do(tmp_path, monkeypatch):
    from fl_app.config.validation import ConfigError, validate_common
    from fl_app.report.tracking import make_tracker, scalars

    assert scalars({"round": 3, "accuracy": 0.5, "epsilon": None, "ok": True, "x": math.nan, "n": 7}) == {
        "accuracy": 0.5,
        "n": 7.0,
    }
    assert make_tracker("none", tmp_path, config_text="") is None
    tracker = make_tracker("tensorboard", tmp_path, config_text="seed: 1")
    recorder = RunRecorder(tmp_path, settings_of(["dataset=digits"]), tracker=tracker)
    recorder.add_initial({"accuracy": 0.1, "loss": 2.3})
    recorder.add_round({"round": 1, "accuracy": 0.4, "loss": 1.5, "epsilon": 0.25})
    tracker.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["accuracy", "epsilon", "loss"]
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("accuracy")] == [(0, 0.1), (1, 0.4)]
    with pytest.raises(ConfigError, match=r"tracking='neptune'.*none, tensorboard, mlflow, wandb"):
        validate_common(compose_config(["dataset=digits", "tracking=neptune"]))
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        validate_common(compose_config(["dataset=digits", "tracking=tensorboard"]))


def test_models_build_and_auto_resolution():
    assert resolve_model_name("auto", (1, 28, 28)) == "cnn"
    assert resolve_model_name("auto", (1, 8, 8)) == "mlp"
    for name, shape in (("cnn", (1, 28, 28)), ("mlp", (1, 8, 8))):
        model = build_model(name, shape, 10)
        assert model(torch.zeros(2, *shape)).shape == (2, 10)
    with pytest.raises(ValueError, match="unknown"):
        build_model("resnet", (1, 28, 28), 10)
    assert {"cnn", "mlp"} <= set(MODELS)


def test_training_lowers_the_loss_and_round_trips_arrays():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 1, 8, 8)).astype(np.float32)
    y = (x.reshape(256, -1)[:, 0] > 0).astype(np.int64)
    torch.manual_seed(0)
    model = build_model("mlp", (1, 8, 8), 2)
    before, _ = evaluate(model, x, y)
    train_local(model, x, y, epochs=15, batch_size=32, lr=0.1, rng=np.random.default_rng(1))
    after, accuracy = evaluate(model, x, y)
    assert after < before
    assert accuracy > 0.9
    copy = build_model("mlp", (1, 8, 8), 2)
    load_arrays(copy, model_to_arrays(model))
    assert np.allclose(predict_proba(copy, x), predict_proba(model, x))
    assert np.allclose(predict_proba(model, x).sum(axis=1), 1.0, atol=1e-5)


def test_registry_discovers_and_names_the_options():
    registry: Registry[type] = Registry("thing", "strategies")
    registry.register("a")(int)
    assert registry.get("a") is int
    with pytest.raises(ValueError, match="twice"):
        registry.register("a")(float)

    from strategies import STRATEGIES

    assert {"fedavg", "dp_fedavg"} <= set(STRATEGIES.names())
    with pytest.raises(KeyError, match="unknown; allowed"):
        STRATEGIES.get("nope")


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_sgd_is_torch_optim_sgd_bit_for_bit(momentum: float) -> None:
    """``fl_app.learning.optim.SGD`` replaces ``torch.optim.SGD``: the same parameters after every step."""
    from fl_app.learning.optim import SGD

    torch.manual_seed(0)
    ours = build_model("mlp", (8, 8), 10)
    theirs = build_model("mlp", (8, 8), 10)
    given = build_model("mlp", (8, 8), 10)  # SGD.apply with the gradients from torch.autograd.grad
    theirs.load_state_dict(ours.state_dict())
    given.load_state_dict(ours.state_dict())
    optimizers = (
        SGD(ours.parameters(), lr=0.3, momentum=momentum),
        torch.optim.SGD(theirs.parameters(), lr=0.3, momentum=momentum),
    )
    applied = SGD(given.parameters(), lr=0.3, momentum=momentum)
    for step in range(6):
        x, y = torch.randn(16, 8, 8), torch.randint(0, 10, (16,))
        for model, optimizer in zip((ours, theirs), optimizers, strict=True):
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if step == 2:  # a parameter without a gradient is left alone (and its momentum kept)
                next(iter(model.parameters())).grad = None
            optimizer.step()
        grads = list(
            torch.autograd.grad(torch.nn.functional.cross_entropy(given(x), y), list(given.parameters()))
        )
        applied.apply([None, *grads[1:]] if step == 2 else grads)
        for mine, reference, other in zip(
            ours.parameters(), theirs.parameters(), given.parameters(), strict=True
        ):
            assert torch.equal(mine, reference), step
            assert torch.equal(other, reference), step
    with pytest.raises(ValueError, match="gradients for"):
        applied.apply(grads[:-1])


def _reference_train_local(
    model, x, y, *, epochs, batch_size, lr, momentum, rng, proximal_mu=0.0, reference=None
):
    """``train_local`` as it was written before its speed work: ``torch.optim.SGD`` after ``backward()``."""
    from fl_app.learning.training import seeded_dropout, to_tensor

    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    inputs, targets = to_tensor(x), torch.from_numpy(np.asarray(y, dtype=np.int64))
    total, batches = 0.0, 0
    with seeded_dropout(model, rng):
        for _ in range(epochs):
            order = torch.from_numpy(rng.permutation(len(y)))
            for start in range(0, len(y), batch_size):
                index = order[start : start + batch_size]
                optimizer.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(model(inputs[index]), targets[index])
                if proximal_mu > 0:
                    prox = sum(
                        torch.sum((p - r) ** 2) for p, r in zip(model.parameters(), reference, strict=True)
                    )
                    loss = loss + 0.5 * proximal_mu * prox
                loss.backward()
                optimizer.step()
                total += float(loss.detach())
                batches += 1
    return total / max(batches, 1)


@pytest.mark.parametrize(
    ("name", "momentum", "proximal_mu", "fixed"),
    [("mlp", 0.0, 0.0, False), ("mlp", 0.0, 0.0, True), ("mlp", 0.9, 0.0, True), ("mlp", 0.0, 0.5, True),
     ("privatekt_cnn", 0.0, 0.0, True), ("privatekt_cnn", 0.5, 0.0, False)],
)  # fmt: skip
def test_train_local_is_sgd_after_backward_bit_for_bit(
    name: str, momentum: float, proximal_mu: float, fixed: bool
):
    """``train_local`` (gradients from ``torch.autograd.grad``, fused steps, a fixed model's modules found
    once) trains as ``torch.optim.SGD`` after ``backward()``: the same parameters and loss, with momentum,
    FedProx, dropout, a model left in eval mode and a frozen parameter."""
    from fl_app.learning.training import fix_state

    shape = (1, 16, 16) if name == "privatekt_cnn" else (1, 8, 8)
    rng = np.random.default_rng(3)
    x = rng.random((45, *shape)).astype(np.float32)
    y = rng.integers(0, 4, 45)
    torch.manual_seed(5)
    ours = build_model(name, shape, 4)
    theirs = build_model(name, shape, 4)
    theirs.load_state_dict(ours.state_dict())
    if fixed:
        fix_state(ours)
    reference = [p.detach().clone() for p in ours.parameters()]
    for model in (ours, theirs):
        model.eval()  # train_local puts it in training mode
        next(iter(model.parameters())).requires_grad_(False)
    settings = dict(
        epochs=2, batch_size=8, lr=0.2, momentum=momentum, proximal_mu=proximal_mu, reference=reference
    )
    for _ in range(2):  # a second call finds the fixed model's modules again
        loss = train_local(ours, x, y, rng=np.random.default_rng(9), **settings)
        expected = _reference_train_local(theirs, x, y, rng=np.random.default_rng(9), **settings)
        assert loss == expected
        for mine, other in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert torch.equal(mine, other)
        assert all(module.training for module in ours.modules())


def test_a_fixed_model_loads_and_reads_as_any_model():
    """``fix_state``: ``load_arrays`` and ``model_state`` give what they give an unfixed model; a record of
    other names or shapes is refused as before; a record whose arrays changed is read again; once
    ``unfix_state`` forgets it, its replaced tensors are found."""
    from flwr.app import Array, ArrayRecord

    from fl_app.learning.training import fix_state, model_state, unfix_state

    torch.manual_seed(0)
    fixed, plain = fix_state(build_model("mlp", (8, 8), 10)), build_model("mlp", (8, 8), 10)
    source = model_to_arrays(build_model("mlp", (8, 8), 10))
    for model in (fixed, plain):
        load_arrays(model, source)
    assert all(torch.equal(a, b) for a, b in zip(fixed.parameters(), plain.parameters(), strict=True))
    state = model_state(fixed)
    assert state.keys() == model_state(plain).keys()
    assert all(np.array_equal(state[k], v) for k, v in model_state(plain).items())
    state.clear()  # the caller's dict, not the cache's
    assert len(model_state(fixed)) == len(model_state(plain)) > 0
    name = next(iter(source.keys()))
    changed = ArrayRecord(
        {k: Array(np.asarray(v.numpy()) + 1.0) if k == name else v for k, v in source.items()}
    )
    load_arrays(fixed, source)
    source[name] = changed[name]  # the same record, an array replaced: read again
    load_arrays(fixed, source)
    assert np.array_equal(model_state(fixed)[name], changed[name].numpy())
    wrong = ArrayRecord({("x" if k == name else k): v for k, v in source.items()})
    with pytest.raises(RuntimeError, match="missing"):
        load_arrays(fixed, wrong)
    bad = ArrayRecord(
        {k: Array(np.zeros(3, dtype=np.float32)) if k == name else v for k, v in source.items()}
    )
    with pytest.raises(RuntimeError, match="has shape"):
        load_arrays(fixed, bad)
    unfix_state(fixed)  # forgotten: its tensors may be replaced, and are found again
    replaced = {k: torch.full_like(v, 2.0) for k, v in fixed.state_dict().items()}
    fixed.load_state_dict(replaced, assign=True)
    assert all(np.array_equal(v, np.full_like(v, 2.0)) for v in model_state(fixed).values())
    load_arrays(fixed, source)
    first = next(iter(source.keys()))
    assert np.array_equal(fixed.state_dict()[first].numpy(), source[first].numpy())


def test_adam_is_torch_optim_adam_bit_for_bit() -> None:
    """``fl_app.learning.optim.Adam`` replaces ``torch.optim.Adam`` (DPFL-BNN's clients): the same parameters,
    moments after every step, also when resumed from saved moments in a new optimizer."""
    from fl_app.learning.optim import Adam, AdamMoments

    torch.manual_seed(0)
    ours = build_model("mlp", (8, 8), 10)
    theirs = build_model("mlp", (8, 8), 10)
    theirs.load_state_dict(ours.state_dict())
    settings = {"lr": 0.01, "betas": (0.8, 0.95)}
    mine, reference = Adam(ours.parameters(), **settings), torch.optim.Adam(theirs.parameters(), **settings)
    for step in range(7):
        if step == 4:  # a new optimizer resumed from the saved moments (a client's next round)
            saved = mine.state
            mine = Adam(ours.parameters(), **settings)
            mine.state = {
                i: AdamMoments(m.step, m.exp_avg.clone(), m.exp_avg_sq.clone()) for i, m in saved.items()
            }
        x, y = torch.randn(16, 8, 8), torch.randint(0, 10, (16,))
        for model, optimizer in ((ours, mine), (theirs, reference)):
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            if step == 2:  # a parameter without a gradient is left alone
                next(iter(model.parameters())).grad = None
            optimizer.step()
        for index, (a, b) in enumerate(zip(ours.parameters(), theirs.parameters(), strict=True)):
            assert torch.equal(a, b), step
            if index in mine.state:
                moments, expected = mine.state[index], reference.state[b]
                assert torch.equal(moments.exp_avg, expected["exp_avg"]), step
                assert torch.equal(moments.exp_avg_sq, expected["exp_avg_sq"]), step
                assert moments.step == float(expected["step"]), step


@pytest.mark.subprocess
def test_local_training_does_not_import_torch_dynamo() -> None:
    """torch.optim's first call imports torch._dynamo (1.6 s of CPU in every actor and ClientApp process);
    dpfl's SGD and Adam do not."""
    import subprocess

    code = (
        "import sys, numpy as np\n"
        "from fl_app.learning.models import build_model\n"
        "from fl_app.learning.training import train_local\n"
        "model = build_model('mlp', (8, 8), 10)\n"
        "x = np.random.default_rng(0).random((20, 8, 8)).astype('float32')\n"
        "train_local(model, x, np.arange(20) % 10, epochs=1, batch_size=8, lr=0.1, momentum=0.5,\n"
        "            rng=np.random.default_rng(1))\n"
        "from fl_app.learning.optim import Adam\n"  # DPFL-BNN's optimizer
        "adam = Adam(model.parameters(), lr=0.1)\n"
        "model(__import__('torch').ones(1, 8, 8)).sum().backward()\n"
        "adam.step(); adam.zero_grad()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert output.stdout.strip() == "False"


def test_a_label_is_a_one_line_name_or_nothing():
    """``label`` names an arm in reports; a number or an empty name is refused with one line."""
    from fl_app.config.validation import ConfigError, validate_common

    assert validate_common(compose_config(["dataset=digits", "label=untuned"])) is None
    assert RunSettings.from_config(compose_config(["dataset=digits", "label=untuned"])).label == "untuned"
    assert RunSettings.from_config(compose_config(["dataset=digits"])).label is None
    for bad in ("label=7", "label=''"):
        with pytest.raises(ConfigError, match=r"label=.*must be null or a one-line name"):
            validate_common(compose_config(["dataset=digits", bad]))
