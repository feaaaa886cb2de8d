"""Flower's DP wrappers run by dpfl (``strategy=flower strategy.flower=DifferentialPrivacy...``).

Oracles: the release written out from Flower's documented arithmetic (clip each update to C, average,
Gaussian noise of std z C / m) with the noise drawn from the same privacy randomness; dp_accounting's
PLD and RDP accountants for dpfl's and Flower's epsilons, composed here from the events each should
hold. The end-to-end audits (``@pytest.mark.audit``) run each wrapper's real round thousands of times
on two neighbouring inputs, as ``tests/test_privacy_end_to_end.py`` does for dpfl's own strategies:
client 0 holds ZEROS (its update is clipped to C) or UNIFORM (its update is zero: the unit's
neighbour); the released model is projected on the output bias; the lower bound must stay below the
epsilon dpfl reports and below Flower's where Flower reports one. Two more audits find what the
wrappers' stated noise does not hold: Flower's adaptive-clipping noise sized with the next round's
clipping norm, and dpfl's accountant if it took Flower's noise at its word.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from statistics import NormalDist
from typing import Any

import dp_accounting as dpa
import numpy as np
import pytest
from conftest import INLINE, InProcessGrid, count_vectorised_trainings, make_context, reply_to
from flwr.app import ArrayRecord, ConfigRecord
from test_flower import SHAPE, one_round, strategy_of, validated
from test_privacy_end_to_end import (  # noqa: F401 (audit_setup: the audits' autouse fixture)
    GAUSSIAN_DELTA,
    UNIFORM,
    ZEROS,
    AuditResult,
    audit,
    audit_run,
    audit_setup,
    bias_direction,
    run_client,
    zero_model,
)

from clients.base import FederatedClient
from clients.flower import CLIPPING_MOD, UNIFORM_WEIGHT
from fl_app import keys
from fl_app.config.validation import ConfigError
from fl_app.data.federated import ClientDataset
from fl_app.privacy.events import Gaussian
from fl_app.privacy.rng import RandomSource
from fl_app.run.context import RunContext
from fl_app.run.lifecycle import RunFailed
from strategies import STRATEGIES
from strategies.arrays import flat_vector
from strategies.flower import dp as flower_dp

SERVER_FIXED = "DifferentialPrivacyServerSideFixedClipping"
CLIENT_FIXED = "DifferentialPrivacyClientSideFixedClipping"
SERVER_ADAPTIVE = "DifferentialPrivacyServerSideAdaptiveClipping"
CLIENT_ADAPTIVE = "DifferentialPrivacyClientSideAdaptiveClipping"
FIXED = ["strategy.dp.noise_multiplier=1.0", "strategy.dp.clipping_norm=0.5"]
ADAPTIVE = [*FIXED, "strategy.dp.clipped_count_stddev=1.0"]


def wrapper_of(tmp_path: Path, wrapper: str, *overrides: str) -> Any:
    """``strategy=flower`` with ``wrapper`` and ``overrides``, in the strategy tests' shape."""
    arguments = ADAPTIVE if "Adaptive" in wrapper else FIXED
    return strategy_of(tmp_path, "strategy=flower", f"strategy.flower={wrapper}", *arguments, *overrides)


# ------------------------------------------------------------------ the release and both epsilons


def test_server_side_fixed_clipping_releases_the_clipped_uniform_average_plus_noise_of_std_zc_over_m(
    tmp_path,
):
    strategy = wrapper_of(tmp_path, SERVER_FIXED)
    start, messages, released = one_round(strategy, InProcessGrid(6))
    # the oracle: the clients' real replies (the same messages), clipped and averaged uniformly here
    grid = InProcessGrid(6)
    answers = grid.send_and_receive(messages)
    base = flat_vector(start).astype(np.float64)
    updates = [flat_vector(a.content.array_records[keys.ARRAYS]) - base for a in answers]
    clipped = [u * min(1.0, 0.5 / np.linalg.norm(u)) for u in updates]
    sizes = {int(a.content.metric_records[keys.METRICS][keys.NUM_EXAMPLES]) for a in answers}
    assert len(sizes) > 1  # the clients hold different numbers of examples: the average is unweighted
    expected = base + np.mean(clipped, axis=0)
    noise = flat_vector(released) - expected
    # Flower's noise: the same generator dpfl hands it, std z C / m = 1.0 * 0.5 / 3 on every coordinate
    with flower_dp.global_numpy_from(strategy.run.noise.generator(flower_dp.NOISE_PURPOSE, server_round=1)):
        drawn = np.concatenate(
            [np.random.normal(0, 0.5 / 3, a.numpy().shape).ravel() for a in start.values()]
        )
    np.testing.assert_allclose(noise, drawn.astype(np.float32), atol=2e-5)


def test_the_noise_comes_from_the_privacy_randomness_and_leaves_numpys_global_state_alone(tmp_path):
    first = wrapper_of(tmp_path, SERVER_FIXED, "privacy.noise_seed=5")
    again = wrapper_of(tmp_path, SERVER_FIXED, "privacy.noise_seed=5")
    other = wrapper_of(tmp_path, SERVER_FIXED, "privacy.noise_seed=6")
    np.random.seed(123)
    state = np.random.get_state()[1].copy()
    _, _, ours = one_round(first, InProcessGrid(6))
    assert np.array_equal(np.random.get_state()[1], state)  # restored after the release
    np.random.seed(99)  # a process that seeds numpy's global generator does not set Flower's noise
    _, _, same = one_round(again, InProcessGrid(6))
    _, _, different = one_round(other, InProcessGrid(6))
    assert np.array_equal(flat_vector(ours), flat_vector(same))
    assert not np.allclose(flat_vector(ours), flat_vector(different))


def gaussian_epsilon(noise_multipliers: list[float], delta: float, *, pld: bool) -> float:
    """dp_accounting's epsilon of the Gaussian mechanisms composed."""
    accountant = dpa.pld.PLDAccountant() if pld else dpa.rdp.RdpAccountant()
    for z in noise_multipliers:
        accountant.compose(dpa.GaussianDpEvent(z))
    return float(accountant.get_epsilon(delta))


def test_fixed_clipping_epsilons_are_flowers_rdp_of_every_release_and_dpfls_pld_of_each_clients(tmp_path):
    strategy = wrapper_of(tmp_path, CLIENT_FIXED)
    arrays, grid, taking = None, InProcessGrid(6), {}
    for t in range(1, 4):
        _, messages, arrays = one_round(strategy, grid, t, arrays)
        for m in messages:
            taking[int(m.metadata.dst_node_id)] = taking.get(int(m.metadata.dst_node_id), 0) + 1
        assert all(m.content[keys.CONFIG][CLIPPING_MOD] == "fixedclipping_mod" for m in messages)
    delta = strategy.run.settings.privacy.delta
    assert strategy.dp.flower_epsilon() == pytest.approx(
        gaussian_epsilon([1.0] * 3, delta, pld=False), rel=1e-6
    )
    busiest = max(taking.values())
    assert strategy.epsilon().epsilon == pytest.approx(
        gaussian_epsilon([1.0] * busiest, delta, pld=True), rel=1e-3
    )
    summary = strategy.report_run(arrays).privacy.summary["flower_dp"]
    assert summary["flower"]["epsilon"] == strategy.dp.flower_epsilon()
    assert summary["flower"]["releases"] == 3 and summary["weighted_by"] == UNIFORM_WEIGHT
    assert summary["dpfl"]["epsilon"] == strategy.epsilon().epsilon


def test_adaptive_clipping_is_accounted_with_the_count_and_the_least_norm_ratio(tmp_path):
    strategy = wrapper_of(tmp_path, SERVER_ADAPTIVE)
    one_round(strategy, InProcessGrid(6))
    w = strategy.dp.wrapper
    assert strategy.dp.flower_epsilon() is None  # Flower's adaptive wrappers have no accountant
    z_model = (1.0**-2 - (2 * 1.0) ** -2) ** -0.5  # Andrew et al.'s split, as Flower computes it
    assert w.noise_multiplier == pytest.approx(z_model)
    delta = strategy.run.settings.privacy.delta
    k = NormalDist().inv_cdf(1 - delta / 2 / strategy.run.settings.num_rounds)
    floor = math.exp(-0.2 * (1 + k * 1.0 / 3 - 0.5))  # Flower's default lr 0.2 and quantile 0.5, 3 replies
    expected = gaussian_epsilon([1.0, z_model * floor], delta / 2, pld=True)
    assert strategy.epsilon().epsilon == pytest.approx(expected, rel=1e-3)
    assert strategy.epsilon().delta == delta


def test_a_client_side_reply_that_is_not_clipped_leaves_no_dpfl_epsilon_while_flower_prints_its_own(tmp_path):
    strategy = wrapper_of(tmp_path, CLIENT_FIXED)
    start = strategy.initial_arrays()
    messages = list(strategy.configure_train(1, start, ConfigRecord(), InProcessGrid(6)))
    far = ArrayRecord({name: type(a)(a.numpy() + 1.0) for name, a in start.items()})  # not clipped to 0.5
    replies = [reply_to(m, arrays=far, metrics={keys.NUM_EXAMPLES: 5, UNIFORM_WEIGHT: 1}) for m in messages]
    new, _ = strategy.aggregate_train(1, replies)
    assert new is not None and strategy.dp.flower_epsilon() > 0  # Flower composed its event regardless
    assert strategy.epsilon() is None
    assert (
        "exceeded the clipping norm"
        in strategy.report_run(new).privacy.summary["flower_dp"]["dpfl"]["why_null"]
    )


def test_client_side_clipping_runs_where_an_actor_trains_its_batch_as_one_cohort(tmp_path, monkeypatch):
    """With ``simulation.vectorise``, the batch trains as one computation; each reply still goes through
    Flower's mod (clipped to the norm sent, with its norm bit)."""
    from fl_app.client_app import app
    from fl_app.engine.batching import run_jobs

    taken = count_vectorised_trainings(monkeypatch)
    strategy = wrapper_of(tmp_path, CLIENT_ADAPTIVE, "simulation.vectorise=true")
    start = strategy.initial_arrays()
    messages = list(strategy.configure_train(1, start, ConfigRecord(), grid=None))
    jobs = [
        (
            m,
            make_context(
                partition_id=m.metadata.dst_node_id - 1000, num_partitions=6, node_id=m.metadata.dst_node_id
            ),
        )
        for m in messages
    ]
    outcomes = run_jobs(lambda: app, jobs)
    assert [o[0] for o in outcomes] == ["reply"] * 3 and len(taken) == 3
    for _, reply, *_ in outcomes:
        update = flat_vector(reply.content.array_records[keys.ARRAYS]) - flat_vector(start)
        assert np.linalg.norm(update) <= 0.5 * (1 + 1e-5)
        assert reply.content.metric_records[keys.METRICS]["norm_bit"] == 1


def test_noise_after_a_server_optimiser_step_has_no_dpfl_epsilon(tmp_path):
    strategy = wrapper_of(tmp_path, SERVER_FIXED, "strategy.dp.accountant=none", "strategy.wrapped=FedAvgM")
    assert not strategy.declaration.is_private(strategy.run.settings)
    _, _, new = one_round(strategy, InProcessGrid(6))
    assert strategy.epsilon() is None and strategy.dp.flower_epsilon() is None
    why = strategy.report_run(new).privacy.summary["flower_dp"]["dpfl"]["why_null"]
    assert "after FedAvgM's own aggregate_train" in why


def test_a_checkpoint_carries_flowers_accountant(tmp_path):
    import pickle

    strategy = wrapper_of(tmp_path, SERVER_FIXED)
    one_round(strategy, InProcessGrid(6))
    kept = pickle.loads(pickle.dumps(strategy.for_checkpoint()))
    assert kept.dp.flower_epsilon() == strategy.dp.flower_epsilon() and kept.dp.flower_releases() == 1


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([f"strategy.flower={SERVER_FIXED}"], r"strategy.dp.noise_multiplier=None: .* needs one"),
        (
            [f"strategy.flower={SERVER_FIXED}", *FIXED, "strategy.dp.accountant=poisson"],
            r"strategy.dp=.*requires sampling_method='no-amplification'",
        ),
        (
            [f"strategy.flower={SERVER_ADAPTIVE}", *FIXED, "strategy.dp.max_epsilon=3"],
            r"strategy.dp.max_epsilon=3.0: Flower's adaptive-clipping wrappers do not take it",
        ),
        (
            [f"strategy.flower={SERVER_FIXED}", *FIXED, "+strategy.kwargs.weighted_by_key=num-examples"],
            r"strategy.kwargs.weighted_by_key='num-examples': Flower's accountant refuses unequal client",
        ),
        (
            [f"strategy.flower={SERVER_FIXED}", *FIXED, "strategy.dp.max_epsilon=5"],
            r"strategy.dp.max_epsilon=5.0: Flower's accountant would refuse round 2 of num_rounds=3 .*=1",
        ),
        (
            ["strategy.dp.noise_multiplier=1"],
            r"strategy.dp.noise_multiplier=1.0: only with a Flower DP wrapper",
        ),
        (
            [f"strategy.flower={SERVER_FIXED}", *FIXED, "strategy.dp.clip=1"],
            r"strategy.dp.clip='1': unknown key \(did you mean .*strategy.dp.clipping_norm",
        ),
        (
            [f"strategy.flower={SERVER_FIXED}", *FIXED, "strategy.wrapped=FedAdam"],
            r"strategy.wrapped='FedAdam': Flower's accountant takes only FedAvg's aggregate_train",
        ),
        (
            [f"strategy.flower={SERVER_ADAPTIVE}", "strategy.dp.noise_multiplier=1"],
            r"strategy.dp=.*clipped_count_stddev",
        ),
    ],
)
def test_a_bad_dp_wrapper_setting_is_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message) as caught:
        validated(tmp_path, "strategy=flower", *overrides)
    assert "\n" not in str(caught.value)


# ------------------------------------------------------------------ end-to-end audits


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> dict[int, ClientDataset]:
    """What each client holds (by client id); the audit swaps client 0's entry between inputs."""
    data: dict[int, ClientDataset] = {}
    monkeypatch.setattr(FederatedClient, "local_data", lambda self: data[self.client_id])
    return data


def fresh(run: RunContext, seed: int) -> Any:
    """The run's strategy built with privacy randomness of seed ``seed`` (one independent repetition)."""
    return STRATEGIES.get("flower")(dataclasses.replace(run, noise=RandomSource(seed=seed)))


@dataclasses.dataclass(frozen=True)
class FlowerAudited:
    """A wrapper's audit: the lower bound from its outputs, dpfl's epsilon and Flower's (None: none)."""

    result: AuditResult
    dpfl: float
    flower: float | None

    def __str__(self) -> str:
        return (
            f"outputs show epsilon >= {self.result.epsilon_lower_bound:.3f} ({self.result.best_set}); "
            f"dpfl reported {self.dpfl:.3f}, Flower {self.flower}"
        )


def wrapper_audit(tmp_path: Path, held: dict, trials: int, wrapper: str, dp: list[str]) -> FlowerAudited:
    """One round of ``wrapper`` around FedAvg, one client (m = 1): it holds ZEROS or UNIFORM.

    Each world's reply is the real client's (through Flower's mod for a client-side wrapper),
    computed once (training has no noise); every trial builds the strategy with fresh privacy
    randomness and runs its ``configure_train`` and ``aggregate_train`` (Flower's clipping, count,
    norm update, average and noise). The statistic: the released model on the output bias.
    """
    overrides = ["strategy=flower", f"strategy.flower={wrapper}", "clients_per_round=1", *dp]
    run = audit_run(overrides, tmp_path, [9], GAUSSIAN_DELTA)
    start = zero_model(run)
    direction = bias_direction(start)
    outputs = []
    for world, data in enumerate((ZEROS, UNIFORM)):
        held[0] = data
        (message,) = fresh(run, 0).configure_train(1, start, ConfigRecord(), grid=None)
        answer = run_client(message, 0, 1)
        arrays = answer.content.array_records[keys.ARRAYS]
        metrics = dict(answer.content.metric_records[keys.METRICS])
        values = []
        for trial in range(trials):
            strategy = fresh(run, 2 * trial + world)
            (sent,) = strategy.configure_train(1, start, ConfigRecord(), grid=None)
            released, _ = strategy.aggregate_train(1, [reply_to(sent, arrays=arrays, metrics=metrics)])
            values.append(float(flat_vector(released) @ direction))
        outputs.append(np.asarray(values))
    held[0] = ZEROS
    reporter = fresh(run, 99_999)
    (sent,) = reporter.configure_train(1, start, ConfigRecord(), grid=None)
    reporter.aggregate_train(1, [run_client(sent, 0, 1)])
    dpfl = reporter.epsilon()
    assert dpfl is not None
    return FlowerAudited(
        audit(*outputs, delta=run.settings.privacy.delta), dpfl.epsilon, reporter.dp.flower_epsilon()
    )


#: Fixed clipping: z = 0.7 (dpfl's PLD epsilon 2.16 at delta 0.1, Flower's RDP 2.90), C = 0.1.
FIXED_AUDIT = ["strategy.dp.noise_multiplier=0.7", "strategy.dp.clipping_norm=0.1"]
#: Adaptive clipping with Flower's lr and quantile, C = 0.1 at first, a count noise of std 1.
ADAPTIVE_AUDIT = [*FIXED_AUDIT, "strategy.dp.clipped_count_stddev=1.0"]


@pytest.mark.audit
@pytest.mark.parametrize(
    ("wrapper", "dp", "trials", "power"),
    [
        (SERVER_FIXED, FIXED_AUDIT, 1500, 0.3),
        (CLIENT_FIXED, FIXED_AUDIT, 1500, 0.3),
        (SERVER_ADAPTIVE, ADAPTIVE_AUDIT, 2000, 0.1),
        (CLIENT_ADAPTIVE, ADAPTIVE_AUDIT, 2000, 0.1),
    ],
)
def test_each_flower_dp_wrapper_meets_the_epsilons_reported(tmp_path, held, wrapper, dp, trials, power):
    audited = wrapper_audit(tmp_path, held, trials, wrapper, dp)
    assert audited.result.passes(audited.dpfl), f"{wrapper}: {audited}"
    if audited.flower is not None:
        assert audited.result.passes(audited.flower), f"{wrapper}: {audited}"
    assert audited.result.epsilon_lower_bound >= power * audited.dpfl, f"{wrapper}: {audited}"


#: Settings Flower accepts (a clip-norm learning rate of 3, a target quantile of 0) under which its
#: adaptive noise, sized with the norm the count has just moved, falls far below what z = 1 says.
STEEP = [
    "strategy.dp.noise_multiplier=1.0",
    "strategy.dp.clipping_norm=0.1",
    "strategy.dp.clipped_count_stddev=0.6",
    "strategy.dp.clip_norm_lr=3",
    "strategy.dp.target_clipped_quantile=0",
]


@pytest.mark.audit
def test_flowers_adaptive_release_leaks_more_than_its_noise_multiplier_allows(tmp_path, held):
    """Flower states z = 1 for the round (Andrew et al.'s split of the count and the model); the
    release shows more than Gaussian(1) allows. dpfl's epsilon, which bounds the norm's move, holds."""
    audited = wrapper_audit(tmp_path, held, 2000, SERVER_ADAPTIVE, STEEP)
    stated = gaussian_epsilon([1.0], GAUSSIAN_DELTA, pld=True)  # 1.16
    assert audited.result.epsilon_lower_bound > 1.5 * stated, f"{audited}; z = 1 allows {stated:.3f}"
    assert audited.result.passes(audited.dpfl), str(audited)


@pytest.mark.audit
def test_audit_catches_dpfl_accounting_flowers_fixed_noise_as_twice_what_it_is(tmp_path, held, monkeypatch):
    """A mutant of dpfl's accounting (Gaussian(2 z) for Flower's noise of z): the audit fails it."""
    monkeypatch.setattr(flower_dp, "Gaussian", lambda z: Gaussian(2 * z))
    audited = wrapper_audit(tmp_path, held, 1500, SERVER_FIXED, FIXED_AUDIT)
    assert not audited.result.passes(audited.dpfl), f"the audit missed noise accounted at 2x: {audited}"


def test_a_zero_update_stops_the_run_in_one_line(tmp_path):
    """Flower's clipping divides by the update's norm (ZeroDivisionError): the run stops with the reason."""
    strategy = wrapper_of(tmp_path, SERVER_FIXED)
    start = strategy.initial_arrays()
    messages = list(strategy.configure_train(1, start, ConfigRecord(), InProcessGrid(6)))
    replies = [reply_to(m, arrays=start, metrics={keys.NUM_EXAMPLES: 5, UNIFORM_WEIGHT: 1}) for m in messages]
    with pytest.raises(RunFailed, match=r"round 1: a client's update is exactly zero, and Flower's clipping"):
        strategy.aggregate_train(1, replies)


@pytest.mark.simulation
@pytest.mark.parametrize("wrapper", [SERVER_FIXED, CLIENT_FIXED, SERVER_ADAPTIVE, CLIENT_ADAPTIVE])
def test_a_run_of_each_wrapper_writes_both_epsilons(simulate, wrapper):
    """A real (inline) run: results.json has dpfl's epsilon, Flower's beside it, and why either is null."""
    arguments = ADAPTIVE if "Adaptive" in wrapper else FIXED
    results = simulate([*SHAPE, INLINE, "strategy=flower", f"strategy.flower={wrapper}", *arguments], wrapper)
    final, summary = results["final"], results["privacy"]["flower_dp"]
    assert final["epsilon"] == summary["dpfl"]["epsilon"] == results["privacy"]["total"]["epsilon"] > 0
    assert results["rounds"][-1]["flower_epsilon"] == final["flower_epsilon"]
    if "Fixed" in wrapper:  # Flower's RDP of a Gaussian(z = 1) per release, every client in each
        expected = gaussian_epsilon([1.0] * 3, results["privacy"]["total"]["delta"], pld=False)
        assert final["flower_epsilon"] == pytest.approx(expected, rel=1e-6)
        assert final["epsilon"] <= final["flower_epsilon"]
    else:
        assert final["flower_epsilon"] is None and "no accountant" in summary["flower"]["why_null"]
    mod = flower_dp.WRAPPERS[wrapper][1]
    assert summary["clipping"] == "server" if mod is None else mod in summary["clipping"]
