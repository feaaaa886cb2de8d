"""KD-DP: DP-SGD and budget arithmetic of the privacy core, grouping, the teacher/special/general stages.

Oracles: per-example gradients against a plain autograd loop; DP-SGD noise
against its stated standard deviation; the DP-SGD calibration against Opacus'
RDP accountant (a second implementation); the budget split and parallel
composition against hand arithmetic and direct ``compose_epsilon`` calls.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import (
    build_run_context,
    client_for,
    error_reply,
    make_context,
    make_message,
    reply_to,
)
from flwr.app import ArrayRecord, ConfigRecord, Message
from torch import nn
from torch.nn import functional as F  # noqa: N812

from clients.kd_dp import KDDP_CLIP, KDDP_NOISE_MULTIPLIER, KDDP_SAMPLING_RATE, KDDP_STEPS
from fl_app import keys
from fl_app.config.validation import ConfigError, validate_config
from fl_app.learning.model_spec import ModelSpec
from fl_app.learning.training import load_arrays, model_to_arrays
from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.budget import charged_report, grouped_epsilon, parallel_epsilon, sequential_epsilon
from fl_app.privacy.calibration import dp_sgd_epsilon, dp_sgd_noise_multiplier
from fl_app.privacy.composition import compose_epsilon
from fl_app.privacy.dp_sgd import (
    clipped_gradient_sum,
    dp_sgd_mechanism,
    dp_sgd_train,
    per_example_gradients,
)
from fl_app.privacy.events import Gaussian, PrivacyEvent, RandomizedResponse, SampledGaussian
from strategies.kd_dp.privacy import GENERAL, LARGE, SPECIAL_CLIENT_ID, group_by_size, split_kd_dp_budget
from strategies.kd_dp.strategy import KDDPStrategy

# digits, linear sizes 51, 102, 154, 205, 256, 310: large-data clients 4 and 5 (top 25%).
KD = [
    "strategy=kd_dp",
    "dataset=digits",
    "partition=linear",
    "num_clients=6",
    "clients_per_round=2",
    "num_rounds=4",
    "strategy.teacher_rounds=2",
    "batch_size=16",
    "local_epochs=1",
    "privacy.epsilon=4",
]


def _tiny_mlp(seed: int = 0) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Flatten(), nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    return model


# ----------------------------------------------------------------------------- DP-SGD mechanism


@pytest.mark.parametrize("chunk", [3, 7, 256])  # three chunks; one chunk (its tensors returned as they are)
def test_per_example_gradients_match_an_autograd_loop(chunk):
    model = _tiny_mlp()
    x = torch.randn(7, 1, 2, 3, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0])
    grads, losses = per_example_gradients(model, x, y, chunk=chunk)
    assert [tuple(g.shape) for g in grads] == [(7, *p.shape) for p in model.parameters()]
    for i in range(7):
        model.zero_grad()
        loss = F.cross_entropy(model(x[i : i + 1]), y[i : i + 1])
        loss.backward()
        assert losses[i].item() == pytest.approx(loss.item(), rel=1e-5)
        for g, p in zip(grads, model.parameters(), strict=True):
            assert torch.allclose(g[i], p.grad, atol=1e-6)


def test_clipping_bounds_every_example_and_sums():
    per_example = [torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0]]), torch.tensor([[0.0], [0.0], [2.0]])]
    summed, norms = clipped_gradient_sum(per_example, clip=1.0)
    assert norms.tolist() == pytest.approx([5.0, 0.5, 2.0])
    # example 0 scaled to norm 1, example 1 unchanged, example 2 scaled to norm 1 (within the 1e-4 margin)
    assert summed[0].tolist() == pytest.approx([0.6 + 0.3, 0.8 + 0.4], rel=2e-4)
    assert summed[1].tolist() == pytest.approx([1.0], rel=2e-4)
    # every single clipped contribution stays within C, also for huge float32 gradients
    big = [torch.full((1, 100_000), 3.3e3), torch.full((1, 7), -1.1e4)]
    one, _ = clipped_gradient_sum(big, clip=0.7)
    assert math.sqrt(sum(float(t.square().sum()) for t in one)) <= 0.7


def test_dp_sgd_noise_has_the_calibrated_std_and_sampling_the_rate():
    torch_model = nn.Sequential(nn.Flatten(), nn.Linear(64, 100), nn.ReLU(), nn.Linear(100, 10))
    start = model_to_arrays(torch_model)
    x = np.random.default_rng(0).integers(0, 255, size=(40, 1, 8, 8)).astype(np.uint8)
    y = np.arange(40) % 10
    # Clean mean of clipped gradients (q = 1: every example in the single batch).
    grads, _ = per_example_gradients(torch_model, torch.from_numpy(x).float() / 255, torch.from_numpy(y))
    clean = [s / 40 for s in clipped_gradient_sum(grads, clip=0.5)[0]]
    dp_sgd_train(
        torch_model,
        x,
        y,
        noise_multiplier=2.0,
        clip=0.5,
        sampling_rate=1.0,
        steps=1,
        lr=1.0,
        rng=np.random.default_rng(3),
    )
    residual = np.concatenate(
        [
            ((start[name].numpy() - p.detach().numpy()) - c.numpy()).ravel()
            for (name, p), c in zip(torch_model.named_parameters(), clean, strict=True)
        ]
    )
    # noise std on the sum is z * C = 1.0; divided by the denominator q n = 40
    assert residual.std() * 40 == pytest.approx(1.0, rel=0.05)
    assert abs(residual.mean() * 40) < 0.05
    tiny_x = np.zeros((40, 1, 2, 3), dtype=np.float32)
    stats = dp_sgd_train(
        _tiny_mlp(), tiny_x, y % 3, noise_multiplier=1.0, clip=1.0, sampling_rate=0.25, steps=300, lr=1e-9,
        rng=np.random.default_rng(4),
    )  # fmt: skip
    assert stats.mean_batch == pytest.approx(10.0, abs=0.6)  # q n = 10, std of the mean ~0.16


def test_dp_sgd_refuses_batch_norm_and_bad_parameters():
    x, y = np.zeros((4, 1, 2, 3), dtype=np.float32), np.zeros(4, dtype=np.int64)
    with pytest.raises(ValueError, match="BatchNorm"):
        dp_sgd_train(
            nn.Sequential(nn.Flatten(), nn.Linear(6, 3), nn.BatchNorm1d(3)), x, y,
            noise_multiplier=1.0, clip=1.0, sampling_rate=0.5, steps=1, lr=0.1, rng=np.random.default_rng(0),
        )  # fmt: skip
    for bad in ({"noise_multiplier": 0.0}, {"sampling_rate": 0.0}, {"steps": 0}, {"clip": -1.0}):
        arguments = {"noise_multiplier": 1.0, "clip": 1.0, "sampling_rate": 0.5, "steps": 1, **bad}
        with pytest.raises(ValueError, match="must be"):
            dp_sgd_train(_tiny_mlp(), x, y, lr=0.1, rng=np.random.default_rng(0), **arguments)
    with pytest.raises(TypeError):
        dp_sgd_train(
            _tiny_mlp(), x, y, noise_multiplier=1.0, clip=1.0, sampling_rate=0.5, steps=1, lr=0.1, rng=0
        )


@pytest.mark.parametrize(("epsilon", "rate", "steps"), [(0.5, 0.01, 600), (3.0, 0.3, 8), (2.0, 1.0, 5)])
def test_dp_sgd_calibration_agrees_with_opacus(epsilon, rate, steps):
    from opacus.accountants import RDPAccountant

    z = dp_sgd_noise_multiplier(epsilon=epsilon, delta=1e-5, sampling_rate=rate, steps=steps)
    assert dp_sgd_epsilon(noise_multiplier=z, sampling_rate=rate, steps=steps, delta=1e-5) <= epsilon
    oracle = RDPAccountant()
    oracle.history = [(z, rate, steps)]
    assert oracle.get_epsilon(1e-5) == pytest.approx(epsilon, rel=0.02)
    smaller = RDPAccountant()
    smaller.history = [(0.99 * z, rate, steps)]
    assert smaller.get_epsilon(1e-5) > epsilon  # z is (nearly) the smallest that meets the target
    assert dp_sgd_mechanism(noise_multiplier=z, sampling_rate=rate) == (
        Gaussian(z) if rate == 1.0 else SampledGaussian(z, rate)
    )


@pytest.mark.parametrize(
    ("epsilon", "steps"),
    [(0.5, 3), (2.0, 1), (8.0, 1), (50.0, 1)],  # z > 1 (doubling) and z < 1 (halving), q = 1
)
def test_dp_sgd_noise_multiplier_is_the_smallest_within_tolerance(epsilon, steps, monkeypatch):
    from fl_app.privacy import calibration
    from fl_app.privacy.calibration_cache import CACHE_ENV

    monkeypatch.setattr(calibration, "_DP_SGD_CACHE", {})
    monkeypatch.setenv(CACHE_ENV, "off")  # the search itself is counted, not an answer read from disk
    calls = []
    exact = calibration.dp_sgd_epsilon

    def counted(**kwargs):
        calls.append(kwargs["noise_multiplier"])
        return exact(**kwargs)

    monkeypatch.setattr(calibration, "dp_sgd_epsilon", counted)
    tolerance = 1e-3
    z = calibration.dp_sgd_noise_multiplier(
        epsilon=epsilon, delta=1e-5, sampling_rate=1.0, steps=steps, tolerance=tolerance
    )
    spent = exact(noise_multiplier=z, sampling_rate=1.0, steps=steps, delta=1e-5)
    assert spent <= epsilon  # never optimistic
    # smallest to relative tolerance: a relatively smaller z (by the tolerance) misses the target
    assert exact(noise_multiplier=z * (1 - tolerance), sampling_rate=1.0, steps=steps, delta=1e-5) > epsilon
    # the bracket (doubling or halving from 1: a few evaluations), then bisection to the tolerance:
    # ceil(log2(1 / tolerance)) = 10 more
    assert len(calls) <= 4 + math.ceil(math.log2(1 / tolerance)) + 2
    # cached: the same answer without evaluating again
    count = len(calls)
    assert (
        calibration.dp_sgd_noise_multiplier(
            epsilon=epsilon, delta=1e-5, sampling_rate=1.0, steps=steps, tolerance=tolerance
        )
        == z
    )
    assert len(calls) == count


def test_dp_sgd_noise_multiplier_limits():
    # (at delta = 1e-5 a Gaussian with z ~ 7e4 is already (0, delta)-DP; at 1e-10, z = 1e6 spends 7.5e-4)
    with pytest.raises(ValueError, match="no noise multiplier"):
        dp_sgd_noise_multiplier(epsilon=1e-7, delta=1e-10, sampling_rate=1.0, steps=1)
    z = dp_sgd_noise_multiplier(epsilon=1e9, delta=1e-5, sampling_rate=1.0, steps=1)  # deep halving
    assert 0 < z < 1e-4
    assert dp_sgd_epsilon(noise_multiplier=z, sampling_rate=1.0, steps=1, delta=1e-5) <= 1e9
    for bad in ({"epsilon": 0.0}, {"sampling_rate": 1.5}, {"steps": 0}, {"tolerance": 1.0}):
        arguments = {"epsilon": 1.0, "delta": 1e-5, "sampling_rate": 0.5, "steps": 1, **bad}
        with pytest.raises(ValueError):
            dp_sgd_noise_multiplier(**arguments)


# ----------------------------------------------------------------------------- budget arithmetic


def test_budget_split_and_composition_arithmetic():
    budget = split_kd_dp_budget(total=4.0, epsilon_special=1.0, epsilon_general=None)
    assert (budget.teacher, budget.special, budget.general) == (3.0, 1.0, 4.0)
    assert budget.large_client_total == 4.0
    assert budget.overall == 4.0
    budget = split_kd_dp_budget(total=8.0, epsilon_special=None, epsilon_general=2.0)
    assert (budget.teacher, budget.special, budget.general, budget.overall) == (8.0, None, 2.0, 8.0)
    budget = split_kd_dp_budget(total=2.0, epsilon_special=0.5, epsilon_general=1.0)
    assert budget.large_client_total == 2.0
    assert budget.overall == 2.0  # max(1.5 + 0.5, 1.0), not the sum 3.0
    for special, general in ((4.0, None), (5.0, None), (0.0, None), (1.0, 4.5), (1.0, 0.0)):
        with pytest.raises(ValueError, match="must be"):
            split_kd_dp_budget(total=4.0, epsilon_special=special, epsilon_general=general)
    assert sequential_epsilon(epsilons=[0.5, 1.25]) == 1.75
    assert parallel_epsilon(epsilons=[0.5, 1.25, 1.0]) == 1.25
    with pytest.raises(ValueError, match=">= 0"):
        parallel_epsilon(epsilons=[1.0, -0.1])


def test_grouped_epsilon_is_parallel_over_groups_and_charges_only_its_group():
    accountant = PrivacyAccountant(population=[0, 1, 2, 3], unit="one example")
    teacher, general = SampledGaussian(1.2, 0.05), SampledGaussian(1.5, 0.2)
    accountant.record(PrivacyEvent(1, teacher, count=50, participants=(2, 3)))
    accountant.record(PrivacyEvent(2, general, count=8, participants=(0,)))
    accountant.record(PrivacyEvent(3, general, count=8, participants=(0, 1)))
    result = grouped_epsilon(
        accountant=accountant, groups={"large": [2, 3], "general": [0, 1]}, delta=1e-5, charges={"large": 0.7}
    )
    large = compose_epsilon({teacher: 50}, delta=1e-5).epsilon + 0.7
    worst_general = compose_epsilon({general: 16}, delta=1e-5).epsilon
    assert result.groups["large"].epsilon == pytest.approx(large)
    assert result.groups["general"].epsilon == pytest.approx(worst_general)
    assert result.overall.epsilon == pytest.approx(max(large, worst_general))
    assert result.groups["large"].method.endswith("+basic")
    with pytest.raises(ValueError, match="overlaps"):
        grouped_epsilon(accountant=accountant, groups={"a": [0, 1], "b": [1, 2]}, delta=1e-5)
    report = compose_epsilon({teacher: 50}, delta=1e-5)
    assert charged_report(report, extra_epsilon=0.0) is report


# ----------------------------------------------------------------------------- grouping and config


def test_grouping_by_threshold_and_fraction():
    roster = dict(enumerate([50, 400, 120, 400, 90, 300]))
    assert group_by_size(roster, threshold=300, fraction=None) == ([1, 3, 5], [0, 2, 4])
    assert group_by_size(roster, threshold=None, fraction=0.25) == ([1, 3], [0, 2, 4, 5])
    assert group_by_size(roster, threshold=None, fraction=0.2) == ([1, 3], [0, 2, 4, 5])  # ceil(1.2)=2
    assert group_by_size(roster, threshold=None, fraction=0.1) == ([1], [0, 2, 3, 4, 5])  # tie: lower id
    thirty = {i: 10 + i for i in range(30)}
    assert group_by_size(thirty, threshold=None, fraction=0.1)[0] == [
        27,
        28,
        29,
    ]  # not ceil(3.0000000000000004)
    with pytest.raises(ValueError, match="no client"):
        group_by_size(roster, threshold=401, fraction=None)
    with pytest.raises(ValueError, match="no general"):
        group_by_size(roster, threshold=50, fraction=None)
    with pytest.raises(ValueError, match="exactly one"):
        group_by_size(roster, threshold=100, fraction=0.5)


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["strategy.epsilon_special=4"], "strategy.epsilon_special"),
        (["strategy.epsilon_special=6"], "strategy.epsilon_special"),
        (["strategy.epsilon_general=4.5"], "strategy.epsilon_general"),
        (["strategy.teacher_rounds=4"], "strategy.teacher_rounds"),
        (["strategy.large_threshold=100"], "strategy.large_threshold"),
        (["evaluation.federated_fraction=0.5"], "evaluation.federated_fraction"),
        (["dataset.public_fraction=0.0"], "dataset.public_fraction"),
        (["privacy.budget_scope=per_round"], "privacy.budget_scope"),
        (["strategy.teacher_rounds=0"], "strategy.epsilon_special"),
    ],
)
def test_validation_refuses_bad_splits_naming_the_key(overrides, key):
    from fl_app.config.compose import compose_config
    from fl_app.config.validation import validate_config

    cfg = compose_config([*KD, *overrides])
    with pytest.raises(ConfigError) as error:
        validate_config(cfg, check_data=False)
    assert error.value.key == key


def test_experiment_preset_is_the_benchmark_setting():
    from fl_app.config.compose import compose_config

    preset = compose_config(["+experiment=kd_dp"])
    setting = (
        "strategy=kd_dp dataset=mnist partition=linear model=mlp num_clients=20 clients_per_round=5 "
        "num_rounds=15 local_epochs=1 batch_size=64 lr=0.4 momentum=0.0 strategy.large_fraction=0.25 "
        "strategy.teacher_rounds=5 strategy.epsilon_special=2 privacy.epsilon=4"
    )
    explicit = compose_config(setting.split(" "))
    assert preset == explicit
    validate_config(preset, check_data=False)


def test_regime_preset_groups_exactly_the_large_tier_and_its_arms_differ_only_in_the_budget_use():
    """+experiment=kd_dp_regime: the document's population (two tiers), KD-DP's grouping picks the
    large tier and nothing else, and the three arms share every setting but the teacher and labels."""
    from omegaconf import OmegaConf

    from fl_app.__main__ import expand_jobs
    from fl_app.config.compose import compose_config
    from fl_app.data.partition import two_tier_sizes
    from strategies.kd_dp.privacy import group_by_size

    jobs = expand_jobs(["+experiment=kd_dp_regime"], multirun=True)
    grid = {tuple(sorted(o for o in job if not o.startswith("+experiment="))) for job in jobs}
    assert grid == {
        tuple(sorted((f"kd_dp_arm={arm}", f"privacy.epsilon={e}", f"seed={s}")))
        for arm in ("kd_dp", "kd_dp_label_free", "fed_dp_sgd")
        for e in (1, 4)
        for s in (1, 2, 3)
    }
    arms = {
        arm: compose_config(["+experiment=kd_dp_regime", f"kd_dp_arm={arm}", "privacy.epsilon=4"])
        for arm in ("kd_dp", "kd_dp_label_free", "fed_dp_sgd")
    }
    for cfg in arms.values():
        validate_config(cfg, check_data=False)
    assert (arms["kd_dp"].strategy.epsilon_special, arms["kd_dp"].strategy.teacher_rounds) == (2, 5)
    assert (
        arms["kd_dp_label_free"].strategy.epsilon_special,
        arms["kd_dp_label_free"].strategy.teacher_rounds,
    ) == (None, 5)
    assert (arms["fed_dp_sgd"].strategy.epsilon_special, arms["fed_dp_sgd"].strategy.teacher_rounds) == (
        None,
        0,
    )

    def shared(cfg):
        plain = OmegaConf.to_container(cfg, resolve=True)
        del plain["strategy"]["epsilon_special"], plain["strategy"]["teacher_rounds"]
        return plain

    assert shared(arms["kd_dp"]) == shared(arms["kd_dp_label_free"]) == shared(arms["fed_dp_sgd"])
    cfg = arms["kd_dp"]
    assert (cfg.dataset.name, cfg.partition.name, cfg.num_clients) == ("mnist", "two_tier", 100)
    sizes = two_tier_sizes(
        48_000,
        num_partitions=cfg.num_clients,
        large_clients=cfg.partition.large_clients,
        large_share=cfg.partition.large_share,
    )
    large, general = group_by_size(
        dict(enumerate(sizes)), threshold=None, fraction=cfg.strategy.large_fraction
    )
    assert large == list(range(95, 100)) and len(general) == 95
    assert min(sizes[c] for c in large) > 10 * max(sizes[c] for c in general)


def test_empty_group_is_a_config_error(tmp_path):
    run = build_run_context([*KD, "strategy.large_fraction=null", "strategy.large_threshold=400"], tmp_path)
    with pytest.raises(ConfigError, match=r"strategy\.large_threshold"):
        KDDPStrategy(run)


# ----------------------------------------------------------------------------- the strategy


def _echo(message: Message) -> dict[str, float]:
    config = message.content.config_records[keys.CONFIG]
    return {key: config[key] for key in (KDDP_NOISE_MULTIPLIER, KDDP_SAMPLING_RATE, KDDP_STEPS, KDDP_CLIP)}


def _constant_model(spec: ModelSpec, label: int) -> ArrayRecord:
    """A model that predicts ``label`` for every input."""
    model = spec.build()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        last = [m for m in model.modules() if isinstance(m, nn.Linear)][-1]
        last.bias[label] = 10.0
    return model_to_arrays(model)


class PublicImagesOnly:
    """The server's data without any labels of the public split (reading them would fail)."""

    def __init__(self, data) -> None:
        self._public_x = data.public_x()
        self._test = data.test()

    def public_x(self) -> np.ndarray:
        return self._public_x

    def test(self):
        return self._test


def _teacher_stage(
    strategy: KDDPStrategy, spec: ModelSpec, label: int, *, rogue: bool = False
) -> ArrayRecord:
    arrays = model_to_arrays(spec.build())
    for server_round in range(1, strategy.teacher_rounds + 1):
        messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid=None))
        replies = []
        for i, message in enumerate(messages):
            metrics = {keys.NUM_EXAMPLES: 10, **_echo(message)}
            if rogue and i == 0:  # claims a different mechanism: must not reach the teacher
                metrics[KDDP_NOISE_MULTIPLIER] = 1e-3
                replies.append(
                    reply_to(message, arrays=_constant_model(spec, (label + 1) % 10), metrics=metrics)
                )
            else:
                replies.append(reply_to(message, arrays=_constant_model(spec, label), metrics=metrics))
        new, _ = strategy.aggregate_train(server_round, replies)
        arrays = new if new is not None else arrays
    return arrays


def test_schedule_groups_and_calibration(tmp_path):
    strategy = KDDPStrategy(build_run_context(KD, tmp_path))
    assert strategy.plans[LARGE].ids == [4, 5]
    assert strategy.plans[GENERAL].ids == [0, 1, 2, 3]
    for server_round in (1, 2):
        assert [c.client_id for c in strategy.select_clients(server_round)] == [4, 5]
    for server_round in (3, 4):
        chosen = [c.client_id for c in strategy.select_clients(server_round)]
        assert len(chosen) == 2
        assert set(chosen) <= {0, 1, 2, 3}
    for plan, target in ((strategy.plans[LARGE], 3.0), (strategy.plans[GENERAL], 4.0)):
        for client in plan.ids:
            size = strategy.run.info(client).num_examples
            assert plan.sampling_rates[client] == pytest.approx(min(1.0, 16 / size))
            assert plan.steps_per_round[client] == math.ceil(size / 16)  # local_epochs = 1
        for client, count in plan.participations.items():
            spent = dp_sgd_epsilon(
                noise_multiplier=plan.noise_multipliers[client],
                sampling_rate=plan.sampling_rates[client],
                steps=plan.steps_per_round[client] * count,
                delta=1e-5,
            )
            assert target * 0.99 < spent <= target


def test_pseudo_labels_come_only_from_the_dp_teacher(tmp_path):
    run = build_run_context([*KD, "strategy.epsilon_special=null"], tmp_path)
    run.data = PublicImagesOnly(run.data)  # no public labels anywhere in reach
    strategy = KDDPStrategy(run)
    spec = run.model_spec
    teacher = _teacher_stage(strategy, spec, label=7, rogue=True)
    # the rogue reply (different mechanism) was rejected: the teacher predicts 7 everywhere
    assert all(count == 1 for count in [len(strategy._rejected[1]), len(strategy._rejected[2])])
    assert strategy.special is None  # nothing is labelled during the teacher stage
    list(strategy.configure_train(3, teacher, ConfigRecord(), grid=None))
    assert strategy.special is not None
    assert len(strategy.special) == len(run.data.public_x())
    assert np.all(strategy.special.labels == 7)
    assert strategy.ledger.label_accountant.events == []  # no label noise configured: nothing charged


def test_special_client_carries_its_own_budget(tmp_path, monkeypatch):
    run = build_run_context([*KD, "strategy.epsilon_special=1.0"], tmp_path)
    strategy = KDDPStrategy(run)
    spec = run.model_spec
    teacher = _teacher_stage(strategy, spec, label=3)
    assert strategy.epsilon().epsilon == pytest.approx(strategy.ledger.teacher_epsilon())
    teacher_only = strategy.ledger.teacher_epsilon()
    assert 2.95 < teacher_only <= 3.0  # epsilon_teacher = 4 - 1
    messages = list(strategy.configure_train(3, teacher, ConfigRecord(), grid=None))
    special = strategy.special
    assert special is not None
    # randomized response at epsilon_special: kept w.p. beta, else uniform over 10 classes
    beta = RandomizedResponse(1.0, 10).keep_probability
    expected = beta + (1 - beta) / 10
    assert np.mean(special.labels == 3) == pytest.approx(expected, abs=4 * math.sqrt(expected / len(special)))
    # one randomized-response event, on the special client only, in its own accountant
    [event] = strategy.ledger.label_accountant.events
    assert event.mechanism == RandomizedResponse(1.0, 10)
    assert event.participants == (SPECIAL_CLIENT_ID,)
    assert strategy.ledger.special_epsilon() == pytest.approx(1.0, rel=1e-3)
    assert strategy.ledger.special_epsilon() <= 1.0
    assert all(not isinstance(e.mechanism, RandomizedResponse) for e in strategy.accountant.events)
    # the special client's model joins the average with its public size as weight
    special_model = _constant_model(spec, 9)

    def fake_train(model, **_):
        load_arrays(model, special_model)
        return 0.0

    monkeypatch.setattr(special, "train", fake_train)
    general_model = _constant_model(spec, 1)
    replies = [
        reply_to(m, arrays=general_model, metrics={keys.NUM_EXAMPLES: 5, **_echo(m)}) for m in messages[:1]
    ] + [error_reply(messages[1])]
    arrays, metrics = strategy.aggregate_train(3, replies)
    weight = run.info(strategy.replies.selected(3)[0].client_id).num_examples
    name = [k for k in arrays if k.endswith("bias")][-1]
    mixed = arrays[name].numpy()
    assert mixed[9] == pytest.approx(10.0 * len(special) / (len(special) + weight), rel=1e-5)
    assert mixed[1] == pytest.approx(10.0 * weight / (len(special) + weight), rel=1e-5)
    assert metrics["kd-dp-special-train-loss"] == 0.0
    # charges: large = teacher + special; general = its own DP-SGD only; the failed client is charged too
    grouped = strategy.ledger.grouped()
    assert grouped.groups[LARGE].epsilon == pytest.approx(teacher_only + strategy.ledger.special_epsilon())
    failed = strategy.replies.selected(3)[1].client_id
    assert strategy.accountant.rounds_participated(failed) == 1
    general_eps = max(
        strategy.accountant.epsilon(delta=1e-5, client=c).epsilon for c in strategy.plans[GENERAL].ids
    )
    assert grouped.groups[GENERAL].epsilon == pytest.approx(general_eps)
    assert strategy.epsilon().epsilon == pytest.approx(max(grouped.groups[LARGE].epsilon, general_eps))
    extras = strategy.round_extras(3)
    assert extras["stage"] == "student"
    assert extras["epsilon_special"] == pytest.approx(strategy.ledger.special_epsilon())
    summary = strategy.privacy_summary()
    assert summary["epsilon_by_group"]["special"] == pytest.approx(strategy.ledger.special_epsilon())
    budget = {"total": 4.0, "teacher": 3.0, "special": 1.0, "general": 4.0}
    assert summary["budget"] == {**budget, "large_client_total": 4.0, "overall": 4.0}


def test_full_schedule_stays_within_the_total(tmp_path):
    strategy = KDDPStrategy(build_run_context(KD, tmp_path))
    spec = strategy.run.model_spec
    arrays = _teacher_stage(strategy, spec, label=2)
    for server_round in (3, 4):
        messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid=None))
        replies = [reply_to(m, arrays=arrays, metrics={keys.NUM_EXAMPLES: 5, **_echo(m)}) for m in messages]
        arrays, _ = strategy.aggregate_train(server_round, replies)
    report = strategy.epsilon()
    assert 3.9 < report.epsilon <= 4.0
    assert strategy.ledger.grouped().groups[GENERAL].epsilon <= 4.0


def test_special_client_loss_is_the_randomized_response_likelihood():
    from clients.kd_dp import SpecialPseudoClient

    x = np.random.default_rng(0).normal(size=(8, 1, 2, 3)).astype(np.float32)
    labels = np.arange(8) % 3
    special = SpecialPseudoClient(x, labels, epsilon=1.0, num_classes=3, agreement=1.0)
    beta = RandomizedResponse(1.0, 3).keep_probability
    assert special.keep_probability == pytest.approx(beta)
    model = _tiny_mlp()
    with torch.no_grad():
        logits = model(torch.from_numpy(x))
    p = F.softmax(logits, dim=1)[torch.arange(8), torch.from_numpy(labels)]
    forward = -torch.log(beta * p + (1 - beta) / 3).mean().item()
    plain = F.cross_entropy(logits, torch.from_numpy(labels)).item()
    kwargs = {"epochs": 1, "batch_size": 8, "lr": 1e-12, "momentum": 0.0, "rng": np.random.default_rng(0)}
    assert special.train(model, **kwargs) == pytest.approx(forward, rel=1e-5)
    assert special.train(model, correction=False, **kwargs) == pytest.approx(plain, rel=1e-5)


def test_without_a_teacher_every_client_is_general(tmp_path):
    run = build_run_context([*KD, "strategy.teacher_rounds=0", "strategy.epsilon_special=null"], tmp_path)
    strategy = KDDPStrategy(run)
    assert strategy.plans[LARGE].ids == []
    assert strategy.plans[GENERAL].ids == run.client_ids
    arrays = model_to_arrays(run.model_spec.build())
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid=None))
    assert strategy.special is None
    assert all(m.content.config_records[keys.CONFIG][keys.ALGORITHM] == "kd_dp_general" for m in messages)
    replies = [reply_to(m, arrays=arrays, metrics={keys.NUM_EXAMPLES: 5, **_echo(m)}) for m in messages]
    new, metrics = strategy.aggregate_train(1, replies)
    assert new is not None
    assert "kd-dp-special-train-loss" not in metrics
    assert strategy.epsilon().epsilon == pytest.approx(strategy.ledger.grouped().groups[GENERAL].epsilon)


# ----------------------------------------------------------------------------- clients


def test_clients_run_dp_sgd_and_reply_with_public_numbers_only(tmp_path):
    strategy = KDDPStrategy(build_run_context(KD, tmp_path))
    spec = strategy.run.model_spec
    start = model_to_arrays(spec.build())
    message = next(iter(strategy.configure_train(1, start, ConfigRecord(), grid=None)))
    config = message.content.config_records[keys.CONFIG]
    assert config[keys.ALGORITHM] == "kd_dp_teacher"
    client = client_for(make_message(dict(config.items()), start), make_context(partition_id=4))
    reply = client.train()
    metrics = reply.content.metric_records[keys.METRICS]
    echoed = (KDDP_NOISE_MULTIPLIER, KDDP_SAMPLING_RATE, KDDP_STEPS, KDDP_CLIP)
    assert set(metrics.keys()) == {keys.NUM_EXAMPLES, *echoed}
    assert metrics[KDDP_NOISE_MULTIPLIER] == config[KDDP_NOISE_MULTIPLIER]
    trained = reply.content.array_records[keys.ARRAYS]
    assert not np.allclose(trained[next(iter(trained))].numpy(), start[next(iter(start))].numpy())
    # a general client refuses a teacher-stage message
    wrong = {**dict(config.items()), keys.ALGORITHM: "kd_dp_general"}
    with pytest.raises(ValueError, match="student"):
        client_for(make_message(wrong, start), make_context(partition_id=0)).train()


def test_svhn_fails_clearly_offline_and_loads_mat_files(tmp_path: Path):
    from scipy.io import savemat

    from fl_app.data.sources import DataNotFoundError, load_dataset

    with pytest.raises(DataNotFoundError, match=r"dataset\.data_dir"):
        load_dataset({"name": "svhn", "data_dir": str(tmp_path), "download": False}, seed=0)
    rng = np.random.default_rng(0)
    for name, count in (("train_32x32.mat", 5), ("test_32x32.mat", 3)):
        images = rng.integers(0, 255, size=(32, 32, 3, count)).astype(np.uint8)
        savemat(tmp_path / name, {"X": images, "y": np.array([[10], [1], [2], [3], [4]][:count])})
    arrays = load_dataset({"name": "svhn", "data_dir": str(tmp_path), "download": False}, seed=0)
    assert arrays.x_train.shape == (5, 3, 32, 32)
    assert arrays.y_train.tolist() == [0, 1, 2, 3, 4]
    assert arrays.x_test.shape == (3, 3, 32, 32)
    raw = images  # the test file: channel c of image 0 is X[:, :, c, 0]
    assert np.array_equal(arrays.x_test[0, 1], raw[:, :, 1, 0])


# ------------------------------------------------------------------ its quick example (test_simulations)


def check_quick_example(results: dict[str, Any], example: Any) -> None:
    """What its quick example's run must show beyond the common checks (tests/test_simulations.py)."""
    privacy = results["privacy"]
    stages = privacy["stages"]
    assert stages["teacher_rounds"] >= 1 and stages["student_rounds"] >= 1
    assert [r["stage"] for r in results["rounds"]] == ["teacher"] * stages["teacher_rounds"] + [
        "student"
    ] * stages["student_rounds"]
    assert 0.975 * example.privacy.epsilon < results["final"]["epsilon"] <= example.privacy.epsilon
    groups = privacy["epsilon_by_group"]
    assert groups["large"] == pytest.approx(groups["large_teacher_only"] + groups["special"])
    assert privacy["epsilon_overall"] == pytest.approx(max(groups["large"], groups["general"]))
    assert results["final"]["epsilon"] == pytest.approx(privacy["epsilon_overall"])
    large, general = privacy["groups"]["large"], privacy["groups"]["general"]
    assert len(large["ids"]) == math.ceil(example.strategy.large_fraction * example.num_clients)
    assert sorted(large["ids"] + general["ids"]) == list(range(example.num_clients))
    assert min(large["sizes"]) >= max(general["sizes"])  # the largest clients train the teacher
    assert all(r["rejected"] == 0 for r in results["rounds"])
