"""DP-BLT: the BLT matrix, its sensitivity, optimiser and noise; the schedule; the ledger; the audit.

Layers: the BLT against dense linear algebra and a brute-force search of the participation
patterns; against jax_privacy 2.0.0 (``tests/data/blt_jax_privacy.json``, written by
``benchmarks/blt_jax_privacy.py reference``: optimised loss and max error, sensitivity, streaming noise,
epsilon); the strategy on constructed replies (no Ray): the noise it adds is ``C^{-1} z`` at the
calibrated scale (recovered from the released models), the schedule keeps a client's participations
``b`` rounds apart, each client's epsilon rebuilt from its own rounds and the dense matrix; bad settings
are one-line errors. Its end-to-end audit (``PRIVACY_AUDIT``, run by ``tests/test_privacy_end_to_end.py``)
and the halved-noise mutant it catches are at the end, with what its quick example must show.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
from pathlib import Path
from typing import Any

import dp_accounting as dpa
import numpy as np
import pytest
from conftest import build_run_context, dense_lower_toeplitz, reply_to
from flwr.app import Array, ArrayRecord, ConfigRecord

from fl_app import keys
from fl_app.config.compose import compose_config
from fl_app.config.validation import ConfigError, validate_config
from fl_app.data.federated import ClientDataset
from fl_app.privacy.composition import compose_epsilon
from strategies.dp_blt import strategy as blt_strategy
from strategies.dp_blt.buffered_toeplitz import (
    BLTNoise,
    BufferedToeplitz,
    ParticipationSchema,
    blt_pair,
    error,
    loss,
    optimal_blt,
    optimise_buffers,
    per_round_error,
    rational_approximation,
    sensitivity_increments,
    sensitivity_squared,
)
from strategies.dp_blt.privacy import participation_schema, worst_history
from strategies.dp_blt.strategy import DPBLTStrategy

DIGITS = ["dataset=digits", "partition=iid", "num_clients=12", "clients_per_round=3", "strategy=dp_blt"]
#: A BLT with three buffers, inside the well-behaved class (interlaced decays, positive scales).
THREE = BufferedToeplitz((0.99, 0.9, 0.5), (0.1, 0.15, 0.2))


def patterns(schema: ParticipationSchema) -> list[np.ndarray]:
    """Every 0/1 vector of at most k participations at least b apart in n rounds (brute force)."""
    n, b, k = schema.rounds, schema.min_separation, schema.max_participations
    found = []
    for count in range(1, k + 1):
        for rounds in itertools.combinations(range(n), count):
            if all(later - earlier >= b for earlier, later in itertools.pairwise(rounds)):
                u = np.zeros(n)
                u[list(rounds)] = 1.0
                found.append(u)
    return found


# ----------------------------------------------------------------------------- the BLT


def test_the_inverse_and_the_error_agree_with_dense_linear_algebra():
    n = 30
    c = dense_lower_toeplitz(THREE.coefficients(n), n)
    inverse = THREE.inverse()
    assert np.allclose(dense_lower_toeplitz(inverse.coefficients(n), n), np.linalg.inv(c), atol=1e-12)
    assert min(inverse.output_scale) < 0 < min(inverse.buf_decay)  # the well-behaved class
    again, _ = blt_pair(np.array(THREE.buf_decay), np.array(inverse.buf_decay))
    assert np.allclose(again.output_scale, THREE.output_scale, atol=1e-12)  # Lemma 5.2 from both decays
    # the noise in the prefix sums: B = A C^{-1}, A the lower-triangular ones; row t's squared norm
    b = np.tril(np.ones((n, n))) @ np.linalg.inv(c)
    assert np.allclose(per_round_error(inverse, n), np.sum(b**2, axis=1))
    assert error(inverse, n) == pytest.approx(np.max(np.sum(b**2, axis=1)))
    assert error(inverse, n, kind="mean") == pytest.approx(np.mean(np.sum(b**2, axis=1)))


@pytest.mark.parametrize(("n", "b", "k"), [(9, 1, 1), (12, 3, 4), (13, 4, 3), (11, 5, 2), (10, 2, 3)])
def test_the_sensitivity_is_the_worst_of_every_participation_pattern(n, b, k):
    """``sens^2`` = max over all patterns of ``||C u||^2`` (C >= 0: aligned contributions are the worst)."""
    schema = ParticipationSchema(n, b, k)
    c = dense_lower_toeplitz(THREE.coefficients(n), n)
    worst = max(float(np.sum((c @ u) ** 2)) for u in patterns(schema))
    assert sensitivity_squared(THREE, schema) == pytest.approx(worst, rel=1e-12)
    increments = sensitivity_increments(THREE, schema)
    assert sum(increments) == pytest.approx(worst, rel=1e-12) and len(increments) == k
    # a pattern starting later, its j-th participation b (j - 1) after its first, adds at most increment j
    for start in range(n):
        rounds = list(range(start, n, b))[:k]
        totals = [float(np.sum((c @ np.isin(np.arange(n), rounds[:j])) ** 2)) for j in range(len(rounds) + 1)]
        assert all(np.diff(totals) <= np.asarray(increments[: len(rounds)]) + 1e-12)


def test_a_matrix_with_increasing_coefficients_is_refused():
    with pytest.raises(ValueError, match="non-increasing"):
        sensitivity_squared(BufferedToeplitz((0.9,), (1.5,)), ParticipationSchema(10, 2, 3))


def test_the_streaming_noise_is_c_inverse_of_independent_gaussians_in_d_buffers():
    """``C y = z`` exactly, with ``z`` the same generator's normals scaled by sigma; the state is d arrays."""
    noise = BLTNoise(THREE, sigma=2.5)
    draws = np.array([noise.draw([np.zeros(7)], np.random.default_rng(t))[0] for t in range(30)])
    z = np.array([np.random.default_rng(t).normal(0.0, 2.5, size=7) for t in range(30)])
    assert np.allclose(dense_lower_toeplitz(THREE.coefficients(30), 30) @ draws, z, atol=1e-10)
    assert noise.buffers is not None and [[s.shape for s in b] for b in noise.buffers] == [[(7,)]] * 3


@pytest.mark.parametrize(("n", "b", "k"), [(40, 1, 1), (60, 6, 10), (50, 20, 3)])
def test_the_optimiser_beats_its_start_and_more_buffers_do_not_lose(n, b, k):
    schema = ParticipationSchema(n, b, k)
    identity = loss(BufferedToeplitz((), ()), schema)
    assert identity == pytest.approx(k * n)  # independent noise: sens^2 = k, max error n
    one, two = optimise_buffers(schema, buffers=1), optimise_buffers(schema, buffers=2)
    assert loss(two, schema) <= loss(one, schema) * (1 + 1e-6) < identity
    assert loss(one, schema) < loss(rational_approximation(1), schema)
    auto = optimal_blt(schema)
    assert loss(auto, schema) <= loss(one, schema) * (1 + 1e-6)


# ----------------------------------------------------------------------------- against jax_privacy

#: Numbers (no code) from jax_privacy 2.0.0 with CPU jax; the calls are in the file's "source" block.
REFERENCE = json.loads((Path(__file__).parent / "data" / "blt_jax_privacy.json").read_text())


def schema_of(case: dict[str, Any]) -> ParticipationSchema:
    return ParticipationSchema(case["rounds"], case["min_separation"], case["max_participations"])


@pytest.mark.parametrize("key", sorted(REFERENCE["cases"]))
def test_the_optimised_blt_reaches_jax_privacys_loss_and_max_error(key):
    """Single participation and min-separation, max and mean error, 1-4 buffers and auto: within 1 %."""
    case = REFERENCE["cases"][key]
    schema = schema_of(case)
    ours = optimal_blt(schema, buffers=case["buffers"], kind=case["error"])
    assert loss(ours, schema, kind=case["error"]) <= 1.01 * case["loss"], key
    max_error = sensitivity_squared(ours, schema) * error(ours.inverse(), schema.rounds)
    assert max_error <= 1.01 * case["max_error"], key


@pytest.mark.parametrize("key", sorted(REFERENCE["cases"]))
def test_the_sensitivity_and_noise_of_jax_privacys_blt_are_jax_privacys(key):
    """For jax_privacy's BLT parameters: the same sensitivity (1e-6), inverse and streaming noise."""
    case = REFERENCE["cases"][key]
    schema = schema_of(case)
    theirs = BufferedToeplitz(tuple(case["buf_decay"]), tuple(case["output_scale"]))
    assert sensitivity_squared(theirs, schema) == pytest.approx(case["sensitivity_squared"], abs=1e-6)
    if case["closed_form_sensitivity_squared"] is not None:
        assert sensitivity_squared(theirs, schema) == pytest.approx(
            case["closed_form_sensitivity_squared"], abs=1e-6
        )
    assert loss(theirs, schema, kind=case["error"]) == pytest.approx(case["loss"], rel=1e-6)
    assert np.allclose(theirs.inverse().buf_decay, case["inverse_buf_decay"], atol=1e-9)
    assert np.allclose(theirs.inverse().output_scale, case["inverse_output_scale"], atol=1e-9)
    noise = BLTNoise(theirs, sigma=1.0)
    normals = np.asarray(REFERENCE["source"]["normals"])
    streamed = [noise.draw([np.zeros(row.size)], Fixed(row))[0] for row in normals]
    assert np.allclose(streamed, case["streaming_noise"], atol=1e-10)


@pytest.mark.parametrize("key", sorted(REFERENCE["epsilons"]))
def test_the_epsilon_is_jax_privacys_single_release_for_the_same_noise_multiplier(key):
    """The worst client's charges (k Gaussians) compose to jax_privacy's one ``GaussianDpEvent(z)``."""
    z, delta = (float(part.split("=")[1]) for part in key.split(","))
    expected = REFERENCE["epsilons"][key]
    for case_key in ("n=5,b=5,k=1,buffers=auto,error=max", "n=2052,b=342,k=6,buffers=auto,error=max"):
        case = REFERENCE["cases"][case_key]
        blt = BufferedToeplitz(tuple(case["buf_decay"]), tuple(case["output_scale"]))
        history = worst_history(blt, schema_of(case), noise_multiplier=z)
        assert len(history) == case["max_participations"]
        pld = compose_epsilon(history, delta=delta, method="pld").epsilon
        assert pld == pytest.approx(expected["pld"], rel=1e-4), case_key  # discretisations 1e-3 and 1e-4
        # RDP composes Gaussians exactly; the two convert on other grids of orders (165 and 116)
        rdp = compose_epsilon(history, delta=delta, method="rdp").epsilon
        assert rdp == pytest.approx(expected["rdp"], rel=2e-3), case_key


class Fixed:
    """A stand-in generator whose ``normal`` returns given standard normals times the scale."""

    def __init__(self, values: np.ndarray) -> None:
        self.values = values

    def normal(self, loc: float, scale: float, size: Any = None) -> np.ndarray:
        return loc + scale * np.reshape(self.values, size)


# ----------------------------------------------------------------------------- the strategy


def zero_round(strategy: DPBLTStrategy, server_round: int, size: int) -> np.ndarray:
    """A round in which every selected client returns the global model (zero updates): the model."""
    zeros = ArrayRecord({"w": Array(np.zeros(size, dtype=np.float64))})
    current = strategy._round_global if strategy._round_global is not None else zeros
    messages = list(strategy.configure_train(server_round, current, ConfigRecord(), grid=None))
    arrays, _ = strategy.aggregate_train(server_round, [reply_to(m, arrays=current) for m in messages])
    strategy._round_global = arrays
    return arrays["w"].numpy().astype(np.float64)


def test_the_released_noise_is_the_blts_at_the_calibrated_scale(tmp_path):
    """Zero updates, lr 1: ``m (w_{t+1} - w_t) = y_t`` and ``C y`` must be N(0, (z C sens)^2) i.i.d.:
    a wrong matrix, a wrong sensitivity or a noise off by 2x shows in the variances."""
    rounds, size = 8, 40_000
    run = build_run_context([*DIGITS, f"num_rounds={rounds}", "strategy.clip=0.5"], tmp_path)
    strategy = DPBLTStrategy(run)
    models = [np.zeros(size)] + [zero_round(strategy, t, size) for t in range(1, rounds + 1)]
    sums = np.diff(np.array(models), axis=0) * 3  # m = 3
    c = dense_lower_toeplitz(strategy.blt.coefficients(rounds), rounds)
    worst = np.isin(np.arange(rounds), np.arange(0, rounds, 4)).astype(float)  # 4 groups: rounds 1 and 5
    sigma = strategy.noise_multiplier * 0.5 * float(np.linalg.norm(c @ worst))
    whitened = c @ sums
    assert np.allclose(np.std(whitened, axis=1), sigma, rtol=0.02)
    assert np.abs(np.corrcoef(whitened)[np.triu_indices(rounds, 1)]).max() < 0.03
    inverse = np.linalg.inv(c)
    assert np.allclose(np.cov(sums), sigma**2 * inverse @ inverse.T, atol=0.03 * sigma**2)
    assert strategy.blt.buffers >= 1 and len(strategy.noise.buffers) == strategy.blt.buffers


def test_a_resumed_run_releases_what_an_uninterrupted_one_does_from_d_buffers(tmp_path):
    """The checkpoint keeps the noise state (d arrays of the model's size) and continues it exactly."""
    from fl_app.run.checkpoint import Checkpoint, load_checkpoint, save_checkpoint

    overrides, size = [*DIGITS, "num_rounds=8"], 50
    whole = DPBLTStrategy(build_run_context(overrides, tmp_path / "whole"))
    uninterrupted = [zero_round(whole, t, size) for t in range(1, 7)]
    run = build_run_context(overrides, tmp_path / "cut")
    first = DPBLTStrategy(run)
    before = [zero_round(first, t, size) for t in range(1, 4)]
    assert first.noise.buffers is not None and len(first.noise.buffers) == first.blt.buffers >= 1
    assert all(s.shape == (size,) for buffer in first.noise.buffers for s in buffer)
    checkpoint = Checkpoint(3, 8, "incomplete", overrides, "f", first.round_global, first, {}, 1.0)
    (tmp_path / "cut").mkdir(exist_ok=True)
    save_checkpoint(tmp_path / "cut", checkpoint, run)
    restored = load_checkpoint(tmp_path / "cut", build_run_context(overrides, tmp_path / "cut")).strategy
    restored._round_global = first.round_global
    after = [zero_round(restored, t, size) for t in range(4, 7)]
    assert np.allclose(before + after, uninterrupted, atol=1e-12)
    assert restored.accountant.epsilon(delta=1e-5).epsilon == pytest.approx(whole.epsilon().epsilon)


def test_the_schedule_is_public_cyclic_groups_b_rounds_apart(tmp_path):
    overrides = [*DIGITS, "num_rounds=10"]
    strategy = DPBLTStrategy(build_run_context(overrides, tmp_path))
    other_noise = DPBLTStrategy(build_run_context([*overrides, "privacy.noise_seed=7"], tmp_path))
    assert strategy.num_groups == 4 and not strategy.secret_cohort
    assert sorted(c.client_id for g in strategy.groups for c in g) == list(range(12))
    rounds_of: dict[int, list[int]] = {}
    for t in range(1, 11):
        cohort = [c.client_id for c in strategy.select_clients(t)]
        assert cohort == [c.client_id for c in other_noise.select_clients(t)]  # no secret coins
        assert len(cohort) == 3
        for client in cohort:
            rounds_of.setdefault(client, []).append(t)
    assert all(set(np.diff(r)) <= {4} for r in rounds_of.values())
    assert max(len(r) for r in rounds_of.values()) == 3 == strategy.schema.max_participations
    assert strategy.schema == ParticipationSchema(10, 4, 3)
    assert participation_schema(num_clients=12, clients_per_round=3, rounds=3).max_participations == 1


@pytest.mark.parametrize("rounds", [3, 10])
def test_each_clients_epsilon_rebuilt_from_its_rounds_and_the_dense_matrix(tmp_path, rounds):
    """Every client's epsilon: dp_accounting's PLD of the Gaussian with its own sensitivity ``||C u||``
    over the whole run (u: its group's rounds; the dense matrix, not the strategy's increments) is at
    most what the ledger charges, with equality for the first group, whose epsilon is the budget."""
    run = build_run_context([*DIGITS, f"num_rounds={rounds}", "privacy.epsilon=3"], tmp_path)
    strategy = DPBLTStrategy(run)
    for t in range(1, rounds + 1):
        strategy.configure_train(t, ArrayRecord({"w": Array(np.zeros(3))}), ConfigRecord(), grid=None)
        strategy.aggregate_train(t, [])  # nobody answers: the group is still charged
    c = dense_lower_toeplitz(strategy.blt.coefficients(rounds), rounds)
    sigma = strategy.noise_multiplier * strategy.sensitivity  # in units of the clip
    for group, members in enumerate(strategy.groups):
        u = np.isin(np.arange(1, rounds + 1), np.arange(group + 1, rounds + 1, 4)).astype(float)
        charged = strategy.accountant.epsilon(delta=1e-5, client=members[0].client_id).epsilon
        if not u.any():  # a group the rounds never reach
            assert charged == 0
            continue
        accountant = dpa.pld.PLDAccountant()
        accountant.compose(dpa.GaussianDpEvent(sigma / float(np.linalg.norm(c @ u))))
        rebuilt = accountant.get_epsilon(1e-5)
        assert rebuilt <= charged * (1 + 2e-3)
        if group == 0:
            assert charged == pytest.approx(rebuilt, rel=2e-3)
    gaussian = dpa.pld.PLDAccountant()
    gaussian.compose(dpa.GaussianDpEvent(strategy.noise_multiplier))
    assert strategy.epsilon().epsilon == pytest.approx(gaussian.get_epsilon(1e-5), rel=2e-3)
    assert 2.99 < strategy.epsilon().epsilon <= 3.0


def test_the_epsilon_after_each_round_covers_the_release_so_far(tmp_path):
    """After round t the release is the first t rows of ``C x + z``: the first group's epsilon is at least
    the Gaussian's with sensitivity ``||(C u)[:t]||`` (rebuilt from the dense matrix)."""
    rounds = 9
    strategy = DPBLTStrategy(build_run_context([*DIGITS, f"num_rounds={rounds}"], tmp_path))
    c = dense_lower_toeplitz(strategy.blt.coefficients(rounds), rounds)
    u = np.isin(np.arange(rounds), [0, 4, 8]).astype(float)
    first = strategy.groups[0][0].client_id
    for t in range(1, rounds + 1):
        strategy.configure_train(t, ArrayRecord({"w": Array(np.zeros(3))}), ConfigRecord(), grid=None)
        strategy.aggregate_train(t, [])
        accountant = dpa.pld.PLDAccountant()
        sensitivity = float(np.linalg.norm((c @ u)[:t]))
        accountant.compose(
            dpa.GaussianDpEvent(strategy.noise_multiplier * strategy.sensitivity / sensitivity)
        )
        assert strategy.accountant.epsilon(delta=1e-5, client=first).epsilon >= accountant.get_epsilon(
            1e-5
        ) * (1 - 2e-3)


def test_the_summary_names_the_blt_and_the_schema(tmp_path):
    strategy = DPBLTStrategy(build_run_context([*DIGITS, "num_rounds=6", "strategy.buffers=2"], tmp_path))
    summary = strategy.privacy_summary()
    assert summary["participation_schema"]["kind"] == "min-separation"
    assert summary["participation_schema"]["min_separation"] == 4
    matrix = summary["strategy_matrix"]
    assert matrix["buffers"] == strategy.blt.buffers <= 2 and matrix["buffers_chosen"] == "strategy.buffers"
    assert summary["sensitivity"] ** 2 == pytest.approx(sensitivity_squared(strategy.blt, strategy.schema))
    assert matrix["loss_relative_to_independent_noise"] < 1


# ----------------------------------------------------------------------------- bad settings


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["strategy.buffers=11"], "strategy.buffers"),
        (["strategy.buffers=-1"], "strategy.buffers"),
        (["strategy.buffers=many"], "strategy.buffers"),
        (["strategy.error=rmse"], "strategy.error"),
        (["strategy.server_momentum=1.0"], "strategy.server_momentum"),
        (["strategy.clip=0"], "strategy.clip"),
        (["privacy.budget_scope=per_round"], "privacy.budget_scope"),
    ],
)
def test_bad_settings_are_one_line_config_errors(overrides, key):
    cfg = compose_config([*DIGITS, "num_rounds=2", *overrides])
    with pytest.raises(ConfigError) as error_info:
        validate_config(cfg, check_data=False)
    assert error_info.value.key == key
    assert "\n" not in str(error_info.value)


# ------------------------------------------------------------ its end-to-end audit (test_privacy_end_to_end)


def dp_blt_audit(tmp_path: Path, held: dict[int, ClientDataset], trials: int) -> Any:
    """DP-BLT over three rounds, two groups: a client takes part in rounds 1 and 3 (its group's) or not.

    Two clients in two public groups; the first group's client's update is its real local training
    from the zero model (ZEROS), replayed against each round's model (a fixed update is one an
    adversary may choose); the other's is zero. Each repetition runs the strategy's three rounds with
    fresh privacy randomness. The statistic is the likelihood ratio of the whole release: the noisy
    sums ``s = m (w_{t+1} - w_t)`` along the update, whitened by the public BLT (``C s = C x + z``),
    projected on ``C u`` (``u``: the client's rounds). It sees the noise each contribution meets (the
    BLT's correlation, its sensitivity for two participations, the calibration) at once.
    """
    from test_privacy_end_to_end import (
        GAUSSIAN_DELTA,
        UNIFORM,
        ZEROS,
        audit_run,
        correlated_audit,
        run_client,
        zero_model,
    )

    from strategies.arrays import flat_vector

    overrides = [
        "strategy=dp_blt",
        "num_rounds=3",
        "clients_per_round=1",
        "strategy.clip=0.1",
        "privacy.epsilon=2",
    ]
    run = audit_run(overrides, tmp_path, [9, 10], GAUSSIAN_DELTA)
    start = zero_model(run)
    strategy = DPBLTStrategy(run)
    first = strategy.groups[0][0].client_id
    held.update({first: ZEROS, 1 - first: UNIFORM})
    message = next(m for m in strategy.configure_train(1, start, ConfigRecord(), grid=None))
    update = flat_vector(run_client(message, first, 2).content.array_records[keys.ARRAYS]) - flat_vector(
        start
    )
    assert strategy.schema == ParticipationSchema(3, 2, 2)
    matrix = dense_lower_toeplitz(strategy.blt.coefficients(3), 3)
    signature = matrix @ np.array([1.0, 0.0, 1.0])

    return correlated_audit(
        lambda: DPBLTStrategy(run),
        run=run,
        start=start,
        first=first,
        update=update,
        matrix=matrix,
        signature=signature,
        trials=trials,
    )


#: (its one-round audit, rounds per input, the least fraction of the reported epsilon it must find)
PRIVACY_AUDIT = (dp_blt_audit, 1500, 0.3)


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> dict[int, ClientDataset]:
    """What each client holds (by client id), as ``tests/test_privacy_end_to_end.py``'s fixture."""
    from clients.base import FederatedClient

    data: dict[int, ClientDataset] = {}
    monkeypatch.setattr(FederatedClient, "local_data", lambda self: data[self.client_id])
    return data


@pytest.fixture
def audit_model(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The audits' one-layer model, quiet logs, clean privacy caches (as test_privacy_end_to_end's)."""
    from test_privacy_end_to_end import AUDIT_MODEL, AuditLinear, clear_privacy_caches

    from fl_app.learning.models import MODELS

    monkeypatch.setitem(MODELS, AUDIT_MODEL, AuditLinear)
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.ERROR)  # thousands of rounds, each with its absent client's warning
    clear_privacy_caches()
    yield
    clear_privacy_caches()
    logger.setLevel(level)


@pytest.mark.audit
def test_audit_catches_blt_noise_off_by_2x(tmp_path, held, audit_model, monkeypatch):
    """Mutant: the BLT's uncorrelated noise z_t has half the standard deviation the calibration says."""
    real = blt_strategy.BLTNoise
    monkeypatch.setattr(blt_strategy, "BLTNoise", lambda blt, *, sigma: real(blt, sigma=sigma / 2))
    audited = dp_blt_audit(tmp_path, held, 1500)
    assert not audited.holds, f"the audit missed BLT noise off by 2x: {audited}"


# ------------------------------------------------------------------ its quick example (test_simulations)


def check_quick_example(results: dict[str, Any], example: Any) -> None:
    """What its quick example's run must show beyond the common checks (tests/test_simulations.py)."""
    privacy = results["privacy"]
    rounds, groups = len(results["rounds"]), example.num_clients // example.clients_per_round
    assert privacy["groups"] == groups and privacy["randomness"]["source"] == "seeded"
    assert [r["group"] for r in results["rounds"]] == [(t - 1) % groups + 1 for t in range(1, rounds + 1)]
    schema = privacy["participation_schema"]
    assert (schema["min_separation"], schema["max_participations"]) == (groups, math.ceil(rounds / groups))
    matrix = privacy["strategy_matrix"]
    blt = BufferedToeplitz(tuple(matrix["buf_decay"]), tuple(matrix["output_scale"]))
    assert matrix["buffers"] == blt.buffers >= 1 and matrix["loss_relative_to_independent_noise"] < 0.5
    # the sensitivity from the parameters and the dense matrix: the first group's rounds
    c = dense_lower_toeplitz(blt.coefficients(rounds), rounds)
    u = np.isin(np.arange(rounds), np.arange(0, rounds, groups)).astype(float)
    assert privacy["sensitivity"] == pytest.approx(float(np.linalg.norm(c @ u)), rel=1e-9)
    # the whole release is the Gaussian with z (dp_accounting's PLD directly)
    accountant = dpa.pld.PLDAccountant()
    accountant.compose(dpa.GaussianDpEvent(privacy["noise_multiplier"]))
    assert results["final"]["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=2e-3)
