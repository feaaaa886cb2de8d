"""Client-level baselines: DP-FedAvgM with adaptive clipping and DP-FTRL with tree aggregation.

Accounting against dp-accounting directly, strategies on constructed replies (no Ray), bad
settings, and one short real simulation each.
"""

from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
import pytest
from conftest import build_run_context, reply_to
from flwr.app import Array, ArrayRecord, ConfigRecord

from fl_app import keys
from fl_app.config.compose import compose_config
from fl_app.config.validation import ConfigError, validate_config
from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.composition import RDP_ORDERS, compose_epsilon
from fl_app.privacy.events import Gaussian, PrivacyEvent, SampledGaussian, TreeAggregation
from fl_app.privacy.mechanisms import tree_node, tree_prefix_nodes
from strategies.dp_fedavg_adaptive import (
    DPFedAvgAdaptiveStrategy,
    adaptive_clipping_effective_noise_multiplier,
    adaptive_clipping_update_noise_multiplier,
)
from strategies.dp_ftrl.privacy import tree_sensitivity_increments
from strategies.dp_ftrl.strategy import DPFTRLStrategy

DIGITS = ["dataset=digits", "partition=iid", "num_clients=6", "clients_per_round=3"]
SHAPES = {"w": (3, 2), "b": (2,)}


def _arrays(vector: np.ndarray) -> ArrayRecord:
    """An ArrayRecord holding ``vector`` (8 values) as the model ``{w: 3x2, b: 2}``."""
    return ArrayRecord(
        {
            "w": Array(np.asarray(vector[:6], dtype=np.float32).reshape(3, 2)),
            "b": Array(np.asarray(vector[6:], dtype=np.float32)),
        }
    )


def _vector(arrays: ArrayRecord) -> np.ndarray:
    return np.concatenate([arrays["w"].numpy().ravel(), arrays["b"].numpy().ravel()]).astype(np.float64)


def _reply(message, vector: np.ndarray):
    return reply_to(message, arrays=_arrays(vector), metrics={keys.NUM_EXAMPLES: 5, keys.TRAIN_LOSS: 1.0})


def _rdp_epsilon(events: list[dpa.DpEvent], relation: dpa.NeighboringRelation, delta: float) -> float:
    accountant = dpa.rdp.RdpAccountant(orders=list(RDP_ORDERS), neighboring_relation=relation)
    for event in events:
        accountant.compose(event)
    return accountant.get_epsilon(delta)


# ----------------------------------------------------------------------------- accounting


def test_tree_aggregation_event_is_dp_accountings_tree_event():
    z, delta = 1.7, 1e-5
    history = {TreeAggregation(z, 7): 3, TreeAggregation(z, 2): 1}
    ours = compose_epsilon(history, delta=delta).rdp
    direct = _rdp_epsilon(
        [
            dpa.SelfComposedDpEvent(dpa.SingleEpochTreeAggregationDpEvent(z, 7), 3),
            dpa.SingleEpochTreeAggregationDpEvent(z, 2),
        ],
        dpa.NeighboringRelation.REPLACE_SPECIAL,
        delta,
    )
    assert ours == pytest.approx(direct, rel=1e-12)
    # depth ceil(log2(steps + 1)): the tree is the Gaussian with z / sqrt(depth), here 3 * 3 + 2 = 11
    assert [TreeAggregation(z, s).depth for s in (1, 2, 3, 4, 7, 8)] == [1, 2, 2, 3, 3, 4]
    gaussian = compose_epsilon({Gaussian(z / math.sqrt(11)): 1}, delta=delta)
    assert ours == pytest.approx(gaussian.rdp, rel=1e-9)
    pld = compose_epsilon(history, delta=delta, method="pld")
    assert pld.pld == pytest.approx(
        compose_epsilon({Gaussian(z / math.sqrt(11)): 1}, delta=delta, method="pld").pld, rel=0.01
    )
    assert pld.epsilon <= ours
    # the ledger replays
    accountant = PrivacyAccountant(population=[0, 1], unit="u")
    accountant.record(PrivacyEvent(1, TreeAggregation(z, 7), participants=(0,)))
    replayed = PrivacyAccountant.from_state_dict(accountant.state_dict())
    assert replayed.events == accountant.events
    assert (
        replayed.epsilon(delta=delta, client=0).epsilon == accountant.epsilon(delta=delta, client=0).epsilon
    )


def test_tree_nodes_and_exact_sensitivity_of_several_participations():
    assert [tree_node(s) for s in (1, 2, 3, 4, 6)] == [(1, 1), (1, 2), (3, 3), (1, 4), (5, 6)]
    assert tree_prefix_nodes(6) == [(1, 4), (5, 6)]
    assert tree_prefix_nodes(7) == [(1, 4), (5, 6), (7, 7)]
    rng = np.random.default_rng(3)
    for _ in range(200):
        steps = int(rng.integers(1, 40))
        leaves = sorted(
            rng.choice(np.arange(1, steps + 1), size=int(rng.integers(1, steps + 1)), replace=False)
        )
        # brute force: S = sum over the drawn nodes of (leaves in the node)^2
        brute = 0
        for end in range(1, steps + 1):
            start, _ = tree_node(end)
            brute += sum(1 for leaf in leaves if start <= leaf <= end) ** 2
        increments = tree_sensitivity_increments(leaves=leaves, steps=steps)
        assert sum(increments) == brute
        assert all(
            i <= TreeAggregation(1.0, steps).depth
            for i in tree_sensitivity_increments(leaves=leaves[:1], steps=steps)
        )
    assert tree_sensitivity_increments(leaves=[1], steps=8) == [4]  # leaf 1 is in [1,1], [1,2], [1,4], [1,8]


def test_adaptive_noise_split_is_theorem_1_and_agrees_with_flower():
    from flwr.supercore.differential_privacy import compute_adaptive_noise_params

    z, bit_noise = 0.9, 0.75
    z_delta = adaptive_clipping_update_noise_multiplier(noise_multiplier=z, bit_noise=bit_noise)
    assert (z_delta**-2 + (2 * bit_noise) ** -2) ** -0.5 == pytest.approx(z, rel=1e-12)
    assert adaptive_clipping_effective_noise_multiplier(
        update_noise_multiplier=z_delta, bit_noise=bit_noise
    ) == pytest.approx(z, rel=1e-12)
    assert compute_adaptive_noise_params(z, 15, bit_noise) == pytest.approx((bit_noise, z_delta), rel=1e-12)
    with pytest.raises(ValueError, match="z < 2 sigma_b"):
        adaptive_clipping_update_noise_multiplier(noise_multiplier=1.5, bit_noise=0.75)
    with pytest.raises(ValueError):
        compute_adaptive_noise_params(1.5, 15, 0.75)


def test_adaptive_records_one_sampled_gaussian_of_the_effective_multiplier_per_round(tmp_path):
    run = build_run_context(
        [
            *DIGITS,
            "num_rounds=3",
            "strategy=dp_fedavg_adaptive",
            "strategy.bit_noise=1.0",
            "privacy.epsilon=4",
        ],
        tmp_path,
    )
    strategy = DPFedAvgAdaptiveStrategy(run)
    plan = strategy.plan
    assert plan.bit_noise == 1.0
    assert (plan.update_noise_multiplier**-2 + (2 * plan.bit_noise) ** -2) ** -0.5 == pytest.approx(
        plan.noise_multiplier, rel=1e-12
    )
    rng = np.random.default_rng(0)
    for server_round in (1, 2, 3):
        messages = list(
            strategy.configure_train(server_round, _arrays(np.zeros(8)), ConfigRecord(), grid=None)
        )
        strategy.aggregate_train(server_round, [_reply(m, rng.normal(size=8)) for m in messages])
    events = strategy.accountant.events
    assert [e.server_round for e in events] == [1, 2, 3]
    assert all(e.mechanism == SampledGaussian(plan.noise_multiplier, 0.5) for e in events)
    assert all(e.participants is None for e in events)
    direct = _rdp_epsilon(
        [
            dpa.SelfComposedDpEvent(
                dpa.PoissonSampledDpEvent(0.5, dpa.GaussianDpEvent(plan.noise_multiplier)), 3
            )
        ],
        dpa.NeighboringRelation.ADD_OR_REMOVE_ONE,
        1e-5,
    )
    assert strategy.epsilon().rdp == pytest.approx(direct, rel=1e-9)
    assert 3.99 < strategy.epsilon().epsilon <= 4.0  # calibrated for the 3 rounds


def test_adaptive_cohort_is_poisson_from_the_privacy_randomness(tmp_path):
    overrides = [*DIGITS, "num_rounds=3", "strategy=dp_fedavg_adaptive", "strategy.bit_noise=1.0"]
    first = DPFedAvgAdaptiveStrategy(build_run_context(overrides, tmp_path))
    other_noise = DPFedAvgAdaptiveStrategy(build_run_context([*overrides, "privacy.noise_seed=7"], tmp_path))
    cohorts = [[c.client_id for c in first.select_clients(t)] for t in range(1, 301)]
    assert np.mean([len(c) for c in cohorts]) == pytest.approx(3.0, abs=0.25)
    assert len({len(c) for c in cohorts}) > 3  # Poisson: the cohort size varies
    assert cohorts != [[c.client_id for c in other_noise.select_clients(t)] for t in range(1, 301)]


@pytest.mark.parametrize(("quantile", "expected"), [(0.5, (10.0, 11.0)), (0.9, (18.0, 19.0))])
def test_adaptive_clip_norm_converges_to_the_target_quantile(tmp_path, quantile, expected):
    """Twenty clients whose update norms are 1, 2, ..., 20 (all sampled: q = 1), negligible noise."""
    run = build_run_context(
        [
            "dataset=digits",
            "partition=iid",
            "num_clients=20",
            "clients_per_round=20",
            "num_rounds=150",
            "strategy=dp_fedavg_adaptive",
            "strategy.noise_multiplier=1e-4",
            "strategy.bit_noise=1e-3",
            "strategy.clip_lr=0.3",
            f"strategy.target_quantile={quantile}",
        ],
        tmp_path,
    )
    strategy = DPFedAvgAdaptiveStrategy(run)
    direction = np.ones(8) / math.sqrt(8)
    norms = np.arange(1, 21, dtype=float)
    fractions = []
    for server_round in range(1, 151):
        messages = list(
            strategy.configure_train(server_round, _arrays(np.zeros(8)), ConfigRecord(), grid=None)
        )
        clip = strategy.clip
        by_node = {c.node_id: c.client_id for c in strategy.replies.selected(server_round)}
        replies = [_reply(m, norms[by_node[m.metadata.dst_node_id]] * direction) for m in messages]
        strategy.aggregate_train(server_round, replies)
        fractions.append(float(np.mean(norms <= clip)))
        assert strategy.round_extras(server_round)["clip_norm"] == clip
    assert strategy.round_extras(1)["clip_norm"] == pytest.approx(0.1)
    final = [strategy.round_extras(t)["clip_norm"] for t in range(131, 151)]
    low, high = expected
    assert low - 0.5 <= float(np.median(final)) <= high + 0.5
    assert np.mean(fractions[-20:]) == pytest.approx(quantile, abs=0.06)


def test_flowers_server_side_adaptive_wrapper_moves_the_clip_norm_the_wrong_way(tmp_path):
    """The claim in strategies/dp_fedavg_adaptive.py: with every update clipped, Flower's
    wrapper shrinks the clip norm (it feeds the clipped fraction to the paper's update)."""
    from flwr.serverapp.strategy import DifferentialPrivacyServerSideAdaptiveClipping, FedAvg

    run = build_run_context(
        [
            *DIGITS,
            "clients_per_round=6",
            "num_rounds=1",
            "strategy=dp_fedavg_adaptive",
            "strategy.noise_multiplier=0.1",
            "strategy.bit_noise=0.1",
        ],
        tmp_path,
    )
    ours = DPFedAvgAdaptiveStrategy(run)
    messages = list(ours.configure_train(1, _arrays(np.zeros(8)), ConfigRecord(), grid=None))
    far = [_reply(m, np.full(8, 10.0)) for m in messages]  # norms ~28, clip 0.1: all clipped
    wrapper = DifferentialPrivacyServerSideAdaptiveClipping(
        FedAvg(), noise_multiplier=0.0, num_sampled_clients=len(messages), initial_clipping_norm=0.1
    )
    wrapper.current_arrays = _arrays(np.zeros(8))
    wrapper.aggregate_train(1, far)
    assert wrapper.clipping_norm < 0.1
    assert len(messages) == 6  # q = 1
    ours.aggregate_train(1, [_reply(m, np.full(8, 10.0)) for m in messages])
    assert ours.clip > 0.1


def test_adaptive_server_momentum_step_without_noise(tmp_path):
    run = build_run_context(
        [
            *DIGITS[:2],
            "num_clients=4",
            "clients_per_round=4",
            "num_rounds=5",
            "strategy=dp_fedavg_adaptive",
            "strategy.noise_multiplier=1e-9",
            "strategy.bit_noise=1e-8",
            "strategy.initial_clip=100",
            "strategy.server_lr=0.7",
            "strategy.server_momentum=0.8",
        ],
        tmp_path,
    )
    strategy = DPFedAvgAdaptiveStrategy(run)
    rng = np.random.default_rng(1)
    weights = rng.normal(size=8)
    expected, velocity = weights.copy(), np.zeros(8)
    for server_round in range(1, 6):
        messages = list(strategy.configure_train(server_round, _arrays(weights), ConfigRecord(), grid=None))
        assert len(messages) == 4  # q = 1
        updates = [rng.normal(size=8) for _ in messages]
        arrays, _ = strategy.aggregate_train(
            server_round, [_reply(m, weights + u) for m, u in zip(messages, updates, strict=True)]
        )
        velocity = 0.8 * velocity + np.mean(
            np.float32(weights + np.array(updates)) - np.float32(weights), axis=0
        )
        expected = np.float32(weights) + 0.7 * velocity
        weights = _vector(arrays)
        assert np.allclose(weights, expected, atol=1e-5)


# ----------------------------------------------------------------------------- DP-FTRL


def _run_ftrl(strategy: DPFTRLStrategy, rounds: int, rng: np.random.Generator, start: np.ndarray):
    """Rounds on random replies; returns the models and each round's mean update (sum / m)."""
    weights, models, steps = start, [], []
    for server_round in range(1, rounds + 1):
        messages = list(strategy.configure_train(server_round, _arrays(weights), ConfigRecord(), grid=None))
        updates = [rng.normal(size=8) for _ in messages]
        arrays, _ = strategy.aggregate_train(
            server_round, [_reply(m, weights + u) for m, u in zip(messages, updates, strict=True)]
        )
        base = np.float32(weights).astype(np.float64)
        steps.append(np.sum([np.float32(weights + u) - base for u in updates], axis=0) / strategy.cohort_size)
        weights = _vector(arrays)
        models.append(weights)
    return models, steps


@pytest.mark.parametrize("restart", ["none", "epoch"])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_dp_ftrl_without_noise_is_server_sgd_with_momentum(tmp_path, restart, momentum):
    """Kairouz et al.: noise-free FTRL is FedAvg with server SGD, FTRL-M is SGD with heavy-ball
    momentum (TreeRestart resets the momentum with each tree, as the reference implementation)."""
    run = build_run_context(
        [
            *DIGITS,
            "num_rounds=7",
            "strategy=dp_ftrl",
            "strategy.noise_multiplier=1e-12",
            "strategy.clip=1e6",
            "strategy.server_lr=0.5",
            f"strategy.server_momentum={momentum}",
            f"strategy.restart={restart}",
        ],
        tmp_path,
    )
    strategy = DPFTRLStrategy(run)
    start = np.random.default_rng(5).normal(size=8)
    models, steps = _run_ftrl(strategy, 7, np.random.default_rng(6), start)
    weights, velocity = np.float32(start).astype(np.float64), np.zeros(8)
    for server_round, (model, step) in enumerate(zip(models, steps, strict=True), start=1):
        if restart == "epoch" and strategy.position(server_round).leaf == 1:
            velocity = np.zeros(8)
        velocity = momentum * velocity + step
        weights = weights + 0.5 * velocity
        assert np.allclose(model, weights, atol=1e-4), server_round
    assert strategy.rounds_per_epoch == 2


def test_dp_ftrl_noise_is_tree_aggregated(tmp_path):
    """Zero updates, z = C = lr = 1, m = 3: the model after leaf i is w_0 + (noise of the nodes
    covering [1, i]) / 3; its variance is popcount(i) / 9 and prefixes share nodes."""
    run = build_run_context(
        [
            *DIGITS,
            "num_rounds=7",
            "strategy=dp_ftrl",
            "strategy.noise_multiplier=1",
            "strategy.clip=1",
            "strategy.server_lr=1",
            "strategy.server_momentum=0",
            "strategy.restart=none",
        ],
        tmp_path,
    )
    strategy = DPFTRLStrategy(run)
    size = 60_000
    zeros = ArrayRecord({"w": Array(np.zeros(size, dtype=np.float32))})
    prefixes = []
    for server_round in range(1, 8):
        messages = list(strategy.configure_train(server_round, zeros, ConfigRecord(), grid=None))
        arrays, _ = strategy.aggregate_train(
            server_round, [reply_to(m, arrays=zeros, metrics={keys.TRAIN_LOSS: 0.0}) for m in messages]
        )
        prefixes.append(arrays["w"].numpy().astype(np.float64) * 3)
    for leaf, prefix in enumerate(prefixes, start=1):
        assert np.var(prefix) == pytest.approx(bin(leaf).count("1"), rel=0.04), leaf
    corr = np.corrcoef(prefixes)
    assert corr[1, 2] == pytest.approx(1 / math.sqrt(2), abs=0.02)  # leaves 2 and 3 share [1, 2]
    assert abs(corr[0, 1]) < 0.02  # [1, 1] and [1, 2] are independent nodes
    assert corr[3, 6] == pytest.approx(1 / math.sqrt(3), abs=0.02)  # 4 = [1,4]; 7 = [1,4]+[5,6]+[7,7]


def test_dp_ftrl_schedule_accounting_and_calibration_treerestart(tmp_path):
    run = build_run_context([*DIGITS, "num_rounds=7", "strategy=dp_ftrl", "privacy.epsilon=3"], tmp_path)
    strategy = DPFTRLStrategy(run)
    # public, seeded schedule: fixed cohorts, each client once per epoch of b = 2 rounds
    again = DPFTRLStrategy(
        build_run_context([*DIGITS, "num_rounds=7", "strategy=dp_ftrl", "privacy.noise_seed=9"], tmp_path)
    )
    assert strategy.schedule == again.schedule
    for epoch in range(4):
        rounds = strategy.schedule[2 * epoch : 2 * epoch + 2]
        assert all(len(c) == 3 for c in rounds)
        members = [c for cohort in rounds for c in cohort]
        assert len(members) == len(set(members))
    for server_round in range(1, 8):
        strategy.configure_train(server_round, _arrays(np.zeros(8)), ConfigRecord(), grid=None)
        strategy.aggregate_train(server_round, [])  # nobody answers: the scheduled cohort is still charged
    z = strategy.noise_multiplier
    assert [strategy.position(t).steps for t in range(1, 8)] == [2, 2, 2, 2, 2, 2, 1]
    for client in run.client_ids:
        trees = [strategy.position(t).steps for t in strategy._leaves.get(client, [])]
        assert strategy.accountant.rounds_participated(client) == len(trees)
        events = [dpa.SingleEpochTreeAggregationDpEvent(z, s) for s in trees]
        direct = _rdp_epsilon(events, dpa.NeighboringRelation.REPLACE_SPECIAL, 1e-5)
        assert strategy.accountant.epsilon(delta=1e-5, client=client).rdp == pytest.approx(direct, rel=1e-9)
    assert 2.99 < strategy.epsilon().epsilon <= 3.0
    assert strategy.max_participations == 4


def test_dp_ftrl_without_restart_charges_the_exact_tree_sensitivity(tmp_path):
    run = build_run_context(
        [*DIGITS, "num_rounds=7", "strategy=dp_ftrl", "strategy.restart=none", "privacy.epsilon=3"], tmp_path
    )
    strategy = DPFTRLStrategy(run)
    for server_round in range(1, 8):
        strategy.configure_train(server_round, _arrays(np.zeros(8)), ConfigRecord(), grid=None)
        strategy.aggregate_train(server_round, [])
    z = strategy.noise_multiplier
    worst = 0.0
    for client in run.client_ids:
        leaves = strategy._leaves.get(client, [])
        squared = sum(sum(1 for leaf in leaves if tree_node(u)[0] <= leaf <= u) ** 2 for u in range(1, 8))
        direct = _rdp_epsilon(
            [dpa.GaussianDpEvent(z / math.sqrt(squared))], dpa.NeighboringRelation.ADD_OR_REMOVE_ONE, 1e-5
        )
        report = strategy.accountant.epsilon(delta=1e-5, client=client)
        assert report.rdp == pytest.approx(direct, rel=1e-9)
        worst = max(worst, report.epsilon)
    assert worst == strategy.epsilon().epsilon
    assert 2.99 < worst <= 3.0


# ----------------------------------------------------------------------------- bad settings


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["strategy=dp_fedavg_adaptive"], "strategy.bit_noise"),  # 3 per round: sigma_b = 0.15 < z/2
        (
            ["strategy=dp_fedavg_adaptive", "strategy.bit_noise=0.2", "strategy.noise_multiplier=0.5"],
            "strategy.bit_noise",
        ),
        (["strategy=dp_fedavg_adaptive", "strategy.target_quantile=1.5"], "strategy.target_quantile"),
        (["strategy=dp_fedavg_adaptive", "strategy.server_momentum=1.0"], "strategy.server_momentum"),
        (["strategy=dp_fedavg_adaptive", "strategy.initial_clip=0"], "strategy.initial_clip"),
        (["strategy=dp_fedavg_adaptive", "privacy.budget_scope=per_round"], "privacy.budget_scope"),
        (["strategy=dp_ftrl", "strategy.restart=sometimes"], "strategy.restart"),
        (["strategy=dp_ftrl", "strategy.clip=-1"], "strategy.clip"),
        (["strategy=dp_ftrl", "strategy.noise_multiplier=0"], "strategy.noise_multiplier"),
        (["strategy=dp_ftrl", "privacy.budget_scope=per_round"], "privacy.budget_scope"),
    ],
)
def test_bad_settings_are_one_line_config_errors(overrides, key):
    cfg = compose_config([*DIGITS, "num_rounds=2", *overrides])
    with pytest.raises(ConfigError) as error:
        validate_config(cfg, check_data=False)
    assert error.value.key == key
    assert "\n" not in str(error.value)


def test_the_defaults_validate():
    for name in ("dp_fedavg_adaptive", "dp_ftrl"):
        validate_config(compose_config([f"strategy={name}"]), check_data=False)
