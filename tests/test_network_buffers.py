"""A user's network with buffers or scalar parameters (``model=module:Class``) under every algorithm.

A private algorithm releases only clipped, noised parameters: a network whose state holds more
(BatchNorm's ``running_mean``, ``running_var`` and ``num_batches_tracked``, computed from the clients'
private data; any other persistent buffer) is refused in one line naming ``model`` before anything
starts, with the alternative (GroupNorm or LayerNorm, BatchNorm with ``track_running_stats=False``).
A non-private algorithm sends the buffers with the parameters and averages them (the integer batch
count included); FedAvg's server optimiser steps the parameters only. A scalar (0-d) parameter trains
under the private algorithms too. The algorithms come from the registry, not from a list kept here.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import FAST, INLINE, build_run_context, count_vectorised_trainings, reply_to
from flwr.app import ArrayRecord, ConfigRecord
from torch import nn

from fl_app import keys
from fl_app.config.checks import ConfigError
from fl_app.config.compose import compose_config
from fl_app.config.settings import RunSettings
from fl_app.config.validation import check_model, typed_settings
from fl_app.learning.models import private_state_refusal, running_statistics, state_buffers
from fl_app.learning.training import model_to_arrays
from strategies import STRATEGIES
from strategies.arrays import mean_arrays
from tests.test_reliability import assert_one_line, preflight_cli

HERE = "tests.test_network_buffers"
BATCH_NORM = f"{HERE}:BatchNormNet"
#: A small digits run that every registered algorithm accepts (DP-FedAvg with adaptive clipping needs
#: a dozen clients per round for its default count noise).
SMALL = [*FAST, "num_clients=12", "clients_per_round=12"]
FEDAVG = STRATEGIES.get("fedavg").declaration


class BatchNormNet(nn.Module):
    """Convolution, BatchNorm (running statistics: three buffers), linear classifier."""

    TRACK = True

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        channels, height, width = input_shape
        self.conv = nn.Conv2d(channels, 4, kernel_size=3, padding=1)
        self.bn = nn.BatchNorm2d(4, track_running_stats=self.TRACK)
        self.fc = nn.Linear(4 * height * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits."""
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


class UntrackedBatchNormNet(BatchNormNet):
    """BatchNorm that normalises by each batch's statistics and keeps none (no buffers)."""

    TRACK = False


class GroupNormNet(BatchNormNet):
    """GroupNorm instead of BatchNorm: per-example statistics, no buffers."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__(input_shape, num_classes)
        self.bn = nn.GroupNorm(2, 4)  # type: ignore[assignment]


class InputAverage(nn.Module):
    """Keeps a running average of its inputs in a non-persistent buffer while training (not sent)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(features), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` itself; the average moves towards the batch's mean."""
        if self.training:
            with torch.no_grad():
                self.seen.mul_(0.9).add_(0.1 * x.mean(dim=0))
        return x


class StatisticNet(nn.Module):
    """A custom layer that updates a buffer from the data (not a normalisation layer)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        features = int(np.prod(input_shape))
        self.center = InputAverage(features)
        self.fc = nn.Linear(features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits."""
        return self.fc(self.center(x.flatten(1)))


class ConstantBufferNet(nn.Module):
    """A persistent constant buffer (an input offset): in the state, never updated."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        features = int(np.prod(input_shape))
        self.register_buffer("offset", torch.full((features,), 0.5))
        self.fc = nn.Linear(features, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits."""
        return self.fc(x.flatten(1) - self.offset)


class ScalarParameterNet(nn.Module):
    """A linear classifier with a learned temperature: a 0-d parameter."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(int(np.prod(input_shape)), num_classes)
        self.temperature = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits."""
        return self.fc(x.flatten(1)) * self.temperature


def settings_for(name: str, model: str, *extra: str) -> RunSettings:
    """The typed settings of a small digits run of ``name`` with the network ``model``."""
    return typed_settings(compose_config([*SMALL, f"strategy={name}", f"model={model}", *extra]))


def is_private(name: str) -> bool:
    """Whether ``name`` with its defaults claims a finite epsilon (its declaration says)."""
    return STRATEGIES.get(name).declaration.is_private(settings_for(name, BATCH_NORM))


def examples(count: int = 2) -> torch.Tensor:
    """``count`` images of shape (1, 8, 8)."""
    return torch.rand(count, 1, 8, 8, generator=torch.Generator().manual_seed(0))


# ------------------------------------------------------------------ what counts as a buffer


def test_running_statistics_are_found_by_layer_and_by_what_training_changes() -> None:
    shape = (1, 8, 8)
    assert running_statistics(BatchNormNet(shape, 10), examples()) == [
        "bn.running_mean",
        "bn.running_var",
        "bn.num_batches_tracked",
    ]
    # found without a forward pass (BatchNorm1d refuses one example per channel in training)
    assert running_statistics(nn.Sequential(nn.Flatten(), nn.BatchNorm1d(64)), examples(1)) == [
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    ]
    assert running_statistics(StatisticNet(shape, 10), examples()) == ["center.seen"]  # not in the state
    assert running_statistics(ConstantBufferNet(shape, 10), examples()) == []
    assert running_statistics(UntrackedBatchNormNet(shape, 10), examples()) == []
    assert state_buffers(ConstantBufferNet(shape, 10)) == ["offset"]
    assert state_buffers(StatisticNet(shape, 10)) == []  # non-persistent: built, never sent
    assert state_buffers(BatchNormNet(shape, 10)) == [
        "bn.running_mean",
        "bn.running_var",
        "bn.num_batches_tracked",
    ]


def test_the_refusal_names_the_buffers_the_reason_and_the_alternative() -> None:
    shape = (1, 8, 8)
    statistics = private_state_refusal(BatchNormNet(shape, 10), examples(), "dp_fedavg")
    assert statistics is not None
    for fragment in (
        "bn.running_mean",
        "bn.num_batches_tracked",
        "computed from private data",
        "not clipped or noised",
        "strategy=dp_fedavg",
        "GroupNorm",
        "track_running_stats=False",
    ):
        assert fragment in statistics, statistics
    custom = private_state_refusal(StatisticNet(shape, 10), examples(), "dp_fedavg")
    assert custom is not None and "center.seen are running statistics" in custom
    constant = private_state_refusal(ConstantBufferNet(shape, 10), examples(), "dp_fedavg")
    assert constant is not None and "offset" in constant and "persistent=False" in constant
    for network in (GroupNormNet, UntrackedBatchNormNet, ScalarParameterNet):
        assert private_state_refusal(network(shape, 10), examples(), "dp_fedavg") is None


# ------------------------------------------------------------------ every registered algorithm


@pytest.mark.parametrize("name", STRATEGIES.names())
def test_a_private_algorithm_refuses_running_statistics_and_a_non_private_one_takes_them(name: str) -> None:
    """Validation's model check for each registered algorithm: a private one (its declaration, with its
    defaults) refuses BatchNorm's running statistics and takes the alternatives; the others take it."""
    declaration = STRATEGIES.get(name).declaration
    settings = settings_for(name, BATCH_NORM)
    if not declaration.is_private(settings):
        check_model(settings, declaration)
        return
    with pytest.raises(ConfigError) as refused:
        check_model(settings, declaration)
    assert (refused.value.key, refused.value.value) == ("model", BATCH_NORM)
    text = str(refused.value)
    assert "\n" not in text and "bn.running_mean, bn.running_var, bn.num_batches_tracked" in text
    assert f"strategy={name} is private" in text and "GroupNorm" in text, text
    for alternative in ("GroupNormNet", "UntrackedBatchNormNet"):
        check_model(settings_for(name, f"{HERE}:{alternative}"), declaration)


def test_dp_fedavg_with_batchnorm_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    """The command as a user runs it: exit 2, one line, no output folder (round 1 used to crash)."""
    output = tmp_path / "run"
    result = preflight_cli(
        *FAST, INLINE, "strategy=dp_fedavg", f"model={BATCH_NORM}", f"output_dir={output}", cwd=tmp_path
    )
    assert_one_line(
        result, f"model='{BATCH_NORM}'", "bn.num_batches_tracked", "private data", "track_running_stats=False"
    )
    assert not output.exists()


@pytest.mark.simulation
def test_every_non_private_algorithm_trains_and_averages_a_networks_buffers(simulate: Any) -> None:
    names = [name for name in STRATEGIES.names() if not is_private(name)]
    assert "fedavg" in names and "flower" in names
    for name in names:
        results = simulate([*FAST, INLINE, "num_rounds=1", f"strategy={name}", f"model={BATCH_NORM}"], name)
        assert results["status"] == "completed", (name, results.get("error"))
        assert np.isfinite(results["final"]["loss"]), name
        with np.load(Path(results["_output_dir"]) / "final_model.npz") as final:
            count = final["bn.num_batches_tracked"]
            assert count.shape == () and count.dtype == np.int64 and count > 0, (name, count)
            assert np.all(final["bn.running_var"] > 0) and np.any(final["bn.running_mean"] != 0), name


def test_fedavg_server_momentum_steps_the_parameters_and_averages_the_buffers(tmp_path: Path) -> None:
    """Two rounds of FedAvgM (eta_s 0.5, beta 0.9) whose clients report a running variance of 0.1:
    the buffers are the clients' average (stepped like a parameter the variance would turn negative),
    the parameters take the momentum step."""
    strategy = STRATEGIES.get("fedavg")(
        build_run_context(
            [*FAST, f"model={BATCH_NORM}", "strategy.server_lr=0.5", "strategy.server_momentum=0.9"], tmp_path
        )
    )
    current = strategy.initial_arrays()
    weight, velocity = current["fc.bias"].numpy().astype(np.float64), 0.0
    for server_round in (1, 2):
        sent = list(strategy.configure_train(server_round, current, ConfigRecord(), grid=None))
        client = {name: array.numpy() for name, array in current.items()}
        client.update({"fc.bias": np.ones(10, np.float32), "bn.running_var": np.full(4, 0.1, np.float32),
                       "bn.num_batches_tracked": np.asarray(3 * server_round, dtype=np.int64)})  # fmt: skip
        replies = [
            reply_to(m, arrays=_record(client), metrics={keys.NUM_EXAMPLES: 5, keys.TRAIN_LOSS: 1.0})
            for m in sent
        ]
        current, _ = strategy.aggregate_train(server_round, replies)
        velocity = 0.9 * velocity + (1.0 - weight)
        weight = weight + 0.5 * velocity
        np.testing.assert_allclose(current["fc.bias"].numpy(), weight, rtol=1e-6)
        np.testing.assert_allclose(current["bn.running_var"].numpy(), 0.1, rtol=1e-6)
        count = current["bn.num_batches_tracked"].numpy()
        assert count.shape == () and count.dtype == np.int64 and int(count) == 3 * server_round


def _record(values: dict[str, np.ndarray]) -> ArrayRecord:
    from fl_app.learning.training import state_to_arrays

    return state_to_arrays(values)


def test_the_vectorised_trainer_asked_for_a_network_with_buffers_is_said_and_clients_train_one_by_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``simulation.vectorise=true`` with a BatchNorm network: validation says in one warning that its
    clients train one by one; FedAvg's messages then train on their own (none from a cohort: the
    vectorised trainer trains parameters only) and reply what the per-message path replies, bit for bit."""
    from test_vectorised import arrays_of, batch_of, replies_of

    with caplog.at_level(logging.WARNING):
        check_model(settings_for("fedavg", f"{HERE}:GroupNormNet", "simulation.vectorise=true"), FEDAVG)
        check_model(settings_for("fedavg", BATCH_NORM, "simulation.vectorise=false"), FEDAVG)
        assert caplog.records == []
        check_model(settings_for("fedavg", BATCH_NORM, "simulation.vectorise=true"), FEDAVG)
    [record] = caplog.records
    assert "simulation.vectorise" in record.getMessage() and "bn.running_mean" in record.getMessage()
    assert "train one by one" in record.getMessage()
    counted = count_vectorised_trainings(monkeypatch)
    jobs = batch_of("fedavg", tmp_path, [f"model={BATCH_NORM}"])
    together = replies_of(jobs, vectorise=True)
    alone = replies_of(jobs, vectorise=False)
    assert counted == []
    for a, b in zip(together, alone, strict=True):
        arrays_a, arrays_b = arrays_of(a), arrays_of(b)
        assert "arrays/bn.num_batches_tracked" in arrays_a
        assert {k: v.tobytes() for k, v in arrays_a.items()} == {k: v.tobytes() for k, v in arrays_b.items()}


# ------------------------------------------------------------------ scalar parameters


def test_the_mean_of_scalar_arrays_keeps_their_shape() -> None:
    records = [model_to_arrays(ScalarParameterNet((1, 8, 8), 10)) for _ in range(3)]
    mean = mean_arrays(records)
    assert mean["temperature"].numpy().shape == ()
    assert float(mean["temperature"].numpy()) == pytest.approx(1.0)


def test_dp_sgd_trains_a_scalar_parameter() -> None:
    """KD-DP's local DP-SGD: the noised gradient of a 0-d parameter is a 0-d tensor."""
    from fl_app.privacy.dp_sgd import dp_sgd_train

    network = ScalarParameterNet((1, 8, 8), 10)
    rng = np.random.default_rng(0)
    x, y = rng.random((20, 1, 8, 8), dtype=np.float32), rng.integers(0, 10, 20)
    dp_sgd_train(network, x, y, noise_multiplier=1.0, clip=1.0, sampling_rate=0.5, steps=2, lr=0.1, rng=rng)
    assert network.temperature.shape == () and bool(torch.isfinite(network.temperature.detach()))


#: The private algorithms whose server adds the noised mean to each array of the global model.
MEAN_UPDATES = ("dp_fedavg", "dp_ftrl", "fedavg_ldp", "dp_fedavg_secagg")


@pytest.mark.simulation
@pytest.mark.parametrize("name", MEAN_UPDATES)
def test_a_private_algorithm_trains_a_network_with_a_scalar_parameter(name: str, simulate: Any) -> None:
    results = simulate(
        [*SMALL, INLINE, "num_rounds=1", f"strategy={name}", f"model={HERE}:ScalarParameterNet"]
    )
    assert results["status"] == "completed", results.get("error")
    with np.load(Path(results["_output_dir"]) / "final_model.npz") as final:
        assert final["temperature"].shape == () and np.isfinite(final["temperature"])
