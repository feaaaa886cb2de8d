"""Distributed DP-FedAvg (strategy=dp_fedavg_secagg): the mechanism, its accounting, SecAgg+ rounds.

Golden values: ``tests/data/distributed_dp_reference.json`` holds numbers produced by the papers'
own accounting code (google-research/federated ``distributed_dp/accounting_utils.py``, run
unmodified with tensorflow_privacy 0.8.0; see the file's ``meta``). Strategy tests run whole
SecAgg+ rounds in process: the real strategy, the real ClientApp (Flower's ``secaggplus_mod`` and
the client class) on every node, an :class:`InProcessGrid` in between.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import InProcessGrid, build_run_context, make_context, make_message
from flwr.app import ConfigRecord
from flwr.common import bytes_to_ndarray

import clients.dp_fedavg_secagg as ddp_client
from fl_app.client_app import train
from fl_app.engine.secagg import RECORD_KEY_CONFIGS, Key
from fl_app.privacy.composition import compose_epsilon
from fl_app.privacy.distributed import (
    bits_needed,
    centered,
    conditional_randomized_rounding,
    decode_modular_sum,
    hadamard,
    plan_skellam,
    rotate,
    rotation_signs,
    rounded_l1_norm_bound,
    rounded_l2_norm_bound,
    skellam_noise,
    unrotate,
)
from fl_app.privacy.events import Gaussian, Skellam
from fl_app.privacy.rdp import skellam_rdp
from strategies import STRATEGIES
from strategies.arrays import flat_vector
from strategies.dp_fedavg_secagg.secagg import SecAggRound

REFERENCE = json.loads((Path(__file__).parent / "data" / "distributed_dp_reference.json").read_text())[
    "records"
]


def records(function: str) -> list[dict]:
    return [r for r in REFERENCE if r["function"] == function]


# ---------------------------------------------------------------------- accounting vs the papers' code


def test_rounding_bounds_equal_the_papers_code():
    for record in records("rounded_l2_norm_bound"):
        args = record["args"]
        mine = rounded_l2_norm_bound(l2_norm=args["l2_norm_bound"], beta=args["beta"], dim=args["dim"])
        assert mine == pytest.approx(record["result"], rel=1e-12)


@pytest.mark.parametrize(
    "record",
    records("skellam_epsilon"),
    ids=lambda r: "s{scale}-sd{central_stddev}-T{steps}".format(**r["args"]),
)
def test_skellam_rdp_and_epsilon_equal_the_papers_code(record):
    """Every point of the reference: the same sensitivities, the same RDP curve, the same epsilon (q = 1)."""
    args = record["args"]
    scale = args["scale"]
    l2 = rounded_l2_norm_bound(l2_norm=args["l2_sens"] * scale, beta=args["beta"], dim=args["dim"])
    l1 = rounded_l1_norm_bound(l2_bound=l2, dim=args["dim"])
    assert l2 == pytest.approx(record["effective_l2_sens"] * scale, rel=1e-12)
    assert l1 == pytest.approx(record["effective_l1_sens"] * scale, rel=1e-12)
    mechanism = Skellam(variance=(args["central_stddev"] * scale) ** 2, l1_sensitivity=l1, l2_sensitivity=l2)
    if "rdp_by_order" in record:
        orders = np.array([float(k) for k in record["rdp_by_order"]])
        theirs = np.array(list(record["rdp_by_order"].values()))
        mine = args["steps"] * skellam_rdp(
            orders=orders, variance=mechanism.variance, l1_sensitivity=l1, l2_sensitivity=l2
        )
        np.testing.assert_allclose(mine, theirs, rtol=1e-12)
    epsilon = compose_epsilon({mechanism: args["steps"]}, delta=args["delta"], method="pld").epsilon
    # the project's orders include the papers' (2..128, 256) and more: never looser, here equal
    assert epsilon == pytest.approx(record["epsilon"], rel=1e-3)
    assert epsilon <= record["epsilon"] * (1 + 1e-12)


@pytest.mark.parametrize(
    "record", records("skellam_params"), ids=lambda r: "eps{epsilon}-b{bits}".format(**r["args"])
)
def test_calibration_matches_the_papers_parameter_choice(record):
    """Scale and local noise within 1 % of the papers' optimiser (num_clients = survivors = cohort)."""
    args = record["args"]
    kwargs = dict(
        epsilon=args["epsilon"],
        delta=args["delta"],
        clip=args["l2_clip"],
        bits=args["bits"],
        dim=args["dim"],
        survivors=args["num_clients"],
        cohort=args["num_clients"],
        participations=args["steps"],
        k=args["k"],
        beta=args["beta"],
    )
    theirs_scale, theirs_stddev = record["scale"], record["local_stddev"]
    theirs_bits = bits_needed(
        clip=args["l2_clip"],
        scale=theirs_scale,
        local_variance=(theirs_stddev * theirs_scale) ** 2,
        cohort=args["num_clients"],
        dim=args["dim"],
        k=args["k"],
    )
    if theirs_bits > args["bits"] + 0.01:
        # their optimiser minimises (2^b - 2 k sd / gamma)^2 and can return a point that does not fit
        # (epsilon 2 at 12 bits: it needs ~13 bits); the project refuses such a plan
        with pytest.raises(ValueError, match="cannot hold"):
            plan_skellam(**kwargs)
        return
    plan = plan_skellam(**kwargs)
    assert plan.scale == pytest.approx(theirs_scale, rel=0.01)
    assert math.sqrt(plan.local_variance) / plan.scale == pytest.approx(theirs_stddev, rel=0.01)
    assert plan.epsilon <= args["epsilon"]


def test_the_plan_spends_the_budget_on_the_survivors_noise():
    plan = plan_skellam(
        epsilon=4.0, delta=1e-5, clip=1.0, bits=16, dim=1024, survivors=8, cohort=10, participations=3
    )
    spent = compose_epsilon({plan.mechanism: 3}, delta=1e-5, method="rdp").epsilon
    assert spent == pytest.approx(4.0, rel=1e-3) and spent <= 4.0
    assert plan.mechanism.variance == pytest.approx(8 * plan.local_variance)
    assert (
        bits_needed(
            clip=1.0, scale=plan.scale, local_variance=plan.local_variance, cohort=10, dim=1024, k=3.0
        )
        <= 16
    )
    more = plan_skellam(
        epsilon=4.0, delta=1e-5, clip=1.0, bits=16, dim=1024, survivors=8, cohort=10, participations=6
    )
    assert more.mechanism.variance > plan.mechanism.variance  # more rounds, more noise


# ------------------------------------------------------------------------------ the encoding


def test_randomized_hadamard_is_orthonormal_and_inverted_exactly():
    rng = np.random.default_rng(0)
    for size in (1, 5, 100, 1000):
        x = rng.normal(size=size)
        signs = rotation_signs(seed=7, dim=1 << (size - 1).bit_length())
        y = rotate(x, signs=signs)
        assert np.linalg.norm(y) == pytest.approx(np.linalg.norm(x), rel=1e-12)
        np.testing.assert_allclose(unrotate(y, signs=signs, size=size), x, atol=1e-12)
    h = np.stack([hadamard(e) for e in np.eye(8)])
    np.testing.assert_allclose(h @ h.T, np.eye(8), atol=1e-12)  # against the explicit matrix
    with pytest.raises(ValueError):
        hadamard(np.ones(6))


def test_conditional_rounding_stays_within_its_bound_and_is_nearly_unbiased():
    rng = np.random.default_rng(1)
    x = rng.normal(size=4096) * 3.0
    bound = rounded_l2_norm_bound(l2_norm=float(np.linalg.norm(x)), beta=math.exp(-0.5), dim=4096)
    draws = np.stack([conditional_randomized_rounding(x, norm_bound=bound, rng=rng) for _ in range(200)])
    assert np.all(np.linalg.norm(draws, axis=1) <= bound)
    assert np.all(np.abs(draws - x) < 1.0)
    assert abs(float(np.mean(draws - x))) < 0.01
    with pytest.raises(RuntimeError):
        conditional_randomized_rounding(x + 0.5, norm_bound=1.0, rng=rng, max_tries=3)


def test_skellam_noise_has_the_asked_variance_and_integer_values():
    rng = np.random.default_rng(2)
    noise = skellam_noise(shape=(200_000,), variance=50.0, rng=rng)
    assert noise.dtype == np.int64
    assert float(np.var(noise)) == pytest.approx(50.0, rel=0.02)
    assert abs(float(np.mean(noise))) < 0.05


def test_centered_maps_residues_to_the_symmetric_range():
    values = np.array([0, 1, 2**15 - 1, 2**15, 2**16 - 1])
    np.testing.assert_array_equal(centered(values, bits=16), [0, 1, 2**15 - 1, -(2**15), -1])


# ------------------------------------------------------------------------------ SecAgg+ rounds in process

BASE = ["dataset=digits", "model=mlp", "local_epochs=1", "num_rounds=2", "privacy.epsilon=8"]


def secagg_strategy(tmp_path, clients: int, *extra: str):
    run = build_run_context(
        [
            *BASE,
            "strategy=dp_fedavg_secagg",
            f"num_clients={clients}",
            f"clients_per_round={clients}",
            *extra,
        ],
        tmp_path,
    )
    return STRATEGIES.get("dp_fedavg_secagg")(run)


def recorded_encodings(monkeypatch) -> dict[int, np.ndarray]:
    """Each client's encoded vector (before the masks), by partition id, as the client computes it."""
    seen: dict[int, np.ndarray] = {}
    real = ddp_client.encode_update

    def spy(update, *, plan, signs, rng):
        encoded = real(update, plan=plan, signs=signs, rng=rng)
        seen[len(seen)] = encoded.copy()
        return encoded

    monkeypatch.setattr(ddp_client, "encode_update", spy)
    return seen


def run_round(strategy, grid, server_round: int = 1):
    arrays = strategy.initial_arrays()
    messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
    replies = grid.send_and_receive(messages)
    new, _ = strategy.aggregate_train(server_round, replies)
    return arrays, messages, replies, new


def test_a_round_decodes_exactly_the_sum_of_the_clients_noisy_vectors(tmp_path, monkeypatch):
    strategy = secagg_strategy(tmp_path, 6, "strategy.shares=5")
    seen = recorded_encodings(monkeypatch)
    grid = InProcessGrid(6)
    unmasked: list[list[np.ndarray]] = []
    real_unmask = SecAggRound.unmask

    def spy(self, total, survivors, **kwargs):
        unmasked.append(real_unmask(self, total, survivors, **kwargs))
        return unmasked[-1]

    monkeypatch.setattr(SecAggRound, "unmask", spy)
    arrays, _, _, new = run_round(strategy, grid)
    assert new is not None and len(seen) == 6
    modulus = 1 << strategy.plan.bits
    expected = np.mod(sum(v.astype(np.int64) for v in seen.values()), modulus)
    np.testing.assert_array_equal(unmasked[0][-1], expected)  # exact: integers mod 2^b
    # and the released model is the decoded sum over the planned cohort
    signs = rotation_signs(seed=strategy._rotation_seed(1), dim=strategy.plan.dim)
    step = decode_modular_sum(expected, plan=strategy.plan, signs=signs, size=strategy.size) / 6
    np.testing.assert_allclose(flat_vector(new) - flat_vector(arrays), step, atol=1e-6)
    assert strategy.report_round(1).extras["secure_aggregation"] == "released: sum of 6 clients"
    one_round = compose_epsilon(
        {strategy.plan.mechanism: 1}, delta=strategy.run.settings.privacy.delta, method="rdp"
    ).epsilon
    assert strategy.epsilon().epsilon == pytest.approx(one_round)  # 1 of the 2 planned participations
    assert one_round < 8.0


def test_the_server_never_holds_a_clients_vector_unmasked(tmp_path, monkeypatch):
    """What the server receives from each client is uniform mod 2^b; the client's own vector is not."""
    strategy = secagg_strategy(tmp_path, 6, "strategy.shares=5", "strategy.bits=12")
    seen = recorded_encodings(monkeypatch)
    grid = InProcessGrid(6)
    _, _, replies, _ = run_round(strategy, grid)
    modulus = 1 << 12

    def spread(values: np.ndarray) -> float:
        """Largest relative deviation of 16 equal bins of [0, 2^b) from their expected count."""
        counts = np.bincount((values * 16 // modulus).astype(np.int64), minlength=16)
        return float(np.max(np.abs(counts / (len(values) / 16) - 1)))

    for reply in replies:
        masked = bytes_to_ndarray(reply.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS][-1])
        assert spread(masked) < 0.15, "a masked upload is not uniform"
        assert not reply.content.array_records or all(
            len(r) == 0 for r in reply.content.array_records.values()
        )
    for encoded in seen.values():
        assert (
            spread(encoded) > 0.5
        )  # the unmasked vector is concentrated near 0 mod 2^b: the check could fail
    # nothing else the server received carries data: no loss, no example count beyond the constant 1
    for reply in replies:
        assert set(reply.content.metric_records) <= {"fitres.num_examples"}
        assert reply.content.metric_records["fitres.num_examples"]["num_examples"] == 1


def test_a_client_that_drops_after_sharing_keys_is_unmasked_out(tmp_path, monkeypatch):
    strategy = secagg_strategy(tmp_path, 6, "strategy.shares=5", "strategy.min_survivors=0.8")
    seen = recorded_encodings(monkeypatch)
    grid = InProcessGrid(6, fails_at={1003: "collect_masked_vectors"})
    _, _, _, new = run_round(strategy, grid)
    assert new is not None and len(seen) == 5
    report = strategy.report_round(1)
    assert report.failures == (3,) and report.extras["secure_aggregation"] == "released: sum of 5 clients"
    assert strategy.accountant.events[0].participants == (
        0,
        1,
        2,
        3,
        4,
        5,
    )  # every scheduled client is charged


def test_too_few_survivors_discard_the_round_and_release_nothing(tmp_path, monkeypatch):
    strategy = secagg_strategy(tmp_path, 6, "strategy.shares=5", "strategy.min_survivors=1.0")
    grid = InProcessGrid(6, fails_at={1003: "collect_masked_vectors"})
    _, _, _, new = run_round(strategy, grid)
    assert new is None
    report = strategy.report_round(1)
    assert report.extras["secure_aggregation"].startswith("discarded: 5 of 6 clients")
    assert strategy.accountant.events == []  # nothing unmasked, nothing released
    # no unmask stage was sent
    assert not any(
        m.content.config_records.get(RECORD_KEY_CONFIGS, {}).get(Key.STAGE) == "unmask" for m, _ in grid.sent
    )


def test_a_client_offline_from_the_start_is_a_failure_not_a_lost_run(tmp_path):
    strategy = secagg_strategy(tmp_path, 6, "strategy.shares=5", "strategy.min_survivors=0.8")
    _, _, _, new = run_round(strategy, InProcessGrid(6, offline=[1004]))
    assert new is not None
    assert strategy.report_round(1).failures == (4,)


def test_the_client_refuses_to_upload_outside_secure_aggregation(tmp_path):
    strategy = secagg_strategy(tmp_path, 6)
    config = strategy.train_config(1, ConfigRecord())
    message = make_message(dict(config), strategy.initial_arrays(), node_id=1000)
    with pytest.raises(RuntimeError, match="only inside the SecAgg"):
        train(message, make_context(partition_id=0, num_partitions=6, node_id=1000))


def test_a_budget_the_bits_cannot_hold_is_refused_before_the_run(tmp_path):
    from fl_app.config.compose import compose_config
    from fl_app.config.validation import ConfigError, validate_config

    cfg = compose_config(
        [
            *BASE,
            "strategy=dp_fedavg_secagg",
            "num_clients=100",
            "clients_per_round=50",
            "privacy.epsilon=0.5",
            "strategy.bits=8",
            f"output_dir={tmp_path / 'x'}",
        ]
    )
    with pytest.raises(
        ConfigError,
        match=r"strategy.bits=8: too small: 8 bits cannot hold the sum of 50 vectors .* at least 1[0-9] bits",
    ):
        validate_config(cfg, check_data=False)


def test_central_dp_fedavg_on_the_same_balanced_schedule(tmp_path):
    """``dp_fedavg strategy.sampling=balanced``: the distributed strategy's schedule, central noise.

    Same cohorts round by round; Gaussian noise calibrated (PLD) for the busiest client's
    participations, so the whole budget is spent by the last round.
    """
    common = [
        "dataset=digits",
        "model=mlp",
        "num_clients=20",
        "clients_per_round=5",
        "num_rounds=8",
        "privacy.epsilon=4",
    ]
    central = STRATEGIES.get("dp_fedavg")(
        build_run_context([*common, "strategy=dp_fedavg", "strategy.sampling=balanced"], tmp_path)
    )
    distributed = STRATEGIES.get("dp_fedavg_secagg")(
        build_run_context([*common, "strategy=dp_fedavg_secagg"], tmp_path)
    )
    assert central.cohorts.planned == distributed.cohorts.planned
    assert not central.secret_cohort and "public" in central.cohort_randomness()
    participations = distributed.max_participations
    assert participations == 2  # 8 rounds, 4 per pass
    spent = compose_epsilon(
        {Gaussian(central.noise_multiplier): participations}, delta=1e-5, method="pld"
    ).epsilon
    assert spent == pytest.approx(4.0, rel=1e-3) and spent <= 4.0


def test_a_fraction_of_the_clients_per_round_is_a_cohort_of_that_size(tmp_path):
    """``clients_per_round=0.3`` of 20 clients: cohorts of 6, and the plan is sized for them."""
    from fl_app.config.compose import compose_config
    from fl_app.config.validation import validate_config

    overrides = ["dataset=digits", "model=mlp", "num_clients=20", "clients_per_round=0.3"]
    validate_config(compose_config([*overrides, "strategy=dp_fedavg_secagg", f"output_dir={tmp_path / 'x'}"]))
    strategy = STRATEGIES.get("dp_fedavg_secagg")(
        build_run_context([*overrides, "strategy=dp_fedavg_secagg"], tmp_path)
    )
    assert strategy.plan.cohort == 6 and strategy.plan.survivors == math.ceil(0.9 * 6)
    assert all(len(cohort) == 6 for cohort in strategy.cohorts.planned.values())


# ------------------------------------------------------------------ what a curious server can open


def folded_twin(secret: bytes) -> bytes:
    """Another secret that Flower's generator folds to the same 32 bits (XOR of its 4-byte words)."""
    words = bytearray(secret)
    for position in (0, 4):  # flip the same bits in two words: their XOR, and so the fold, is unchanged
        words[position] ^= 0x5A
    return bytes(words)


@pytest.mark.parametrize("length", [32, 44])  # a self-mask seed; a pairwise key as Flower derives it
def test_masks_come_from_the_whole_secret_not_32_bits(length):
    from fl_app.engine.secagg import flower_mask_arrays
    from fl_app.privacy.masks import mask_arrays

    secret = bytes(np.random.default_rng(length).integers(0, 256, size=length, dtype=np.uint8))
    twin = folded_twin(secret)
    assert twin != secret
    shapes = [(3, 4), (1000,)]
    # Flower's generator cannot tell them apart: its masks are equal (the check can fail)
    for ours, theirs in zip(
        flower_mask_arrays(secret, 1 << 16, shapes), flower_mask_arrays(twin, 1 << 16, shapes), strict=True
    ):
        np.testing.assert_array_equal(ours, theirs)
    first, second = mask_arrays(secret, 1 << 16, shapes), mask_arrays(twin, 1 << 16, shapes)
    assert [a.shape for a in first] == shapes
    assert not np.array_equal(first[1], second[1]) and np.mean(first[1] == second[1]) < 0.01
    again = mask_arrays(secret, 1 << 16, shapes)  # deterministic: device and server agree
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))


def test_masks_are_uniform_on_the_whole_modulus():
    from fl_app.privacy.masks import mask_arrays

    (mask,) = mask_arrays(bytes(range(32)), 16, [(160_000,)])
    counts = np.bincount(mask, minlength=16)
    assert counts.min() > 0.97 * 10_000 and counts.max() < 1.03 * 10_000  # every residue, 15 included
    (wide,) = mask_arrays(bytes(range(32)), 1 << 40, [(10_000,)])  # 8-byte words above 2^32
    assert wide.min() >= 0 and wide.max() < 1 << 40 and wide.max() > 1 << 39
    with pytest.raises(ValueError, match="power of two"):
        mask_arrays(bytes(32), 1000, [(4,)])
    with pytest.raises(ValueError, match="at least 32 bytes"):
        mask_arrays(bytes(4), 16, [(4,)])


def test_a_device_with_flowers_own_mod_is_refused_in_the_setup_stage(tmp_path):
    """Plain Flower devices (32-bit masks) cannot take part: refused at setup, one clear reason."""
    strategy = secagg_strategy(tmp_path, 4, "strategy.min_survivors=0.75")
    grid = InProcessGrid(4, flower_mod=[1000, 1001, 1002, 1003])
    _, messages, _, new = run_round(strategy, grid)
    assert new is None and messages == []  # no train message went out
    report = strategy.report_round(1)
    outcome = report.extras["secure_aggregation"]
    assert outcome.startswith("discarded: before training") and "4 of 4 refused" in outcome, outcome
    assert "did not confirm the mask generator 'dpfl-chacha20-hkdf-sha256-v1'" in outcome
    assert (
        sorted(report.failures) == [0, 1, 2, 3] and "Flower's own secaggplus_mod" in report.failure_reasons[0]
    )
    assert strategy.accountant.events == []
    # one such device among dpfl devices: refused, the others go on without it
    strategy = secagg_strategy(tmp_path, 6, "strategy.shares=5", "strategy.min_survivors=0.8")
    _, _, _, new = run_round(strategy, InProcessGrid(6, flower_mod=[1002]))
    report = strategy.report_round(1)
    assert new is not None and report.extras["secure_aggregation"] == "released: sum of 5 clients"
    assert report.failures == (2,) and "did not confirm the mask generator" in " ".join(
        report.failure_reasons
    )


def test_a_dpfl_device_refuses_a_server_that_asks_for_other_masks(tmp_path):
    from fl_app.engine.secagg import (
        MASK_GENERATOR_KEY,
        MaskGeneratorMismatchError,
        Stage,
        secure_aggregation_mod,
    )

    setup = {
        Key.STAGE: Stage.SETUP,
        Key.SAMPLE_NUMBER: 3,
        Key.SHARE_NUMBER: 3,
        Key.THRESHOLD: 2,
        Key.CLIPPING_RANGE: 8.0,
        Key.TARGET_RANGE: 16,
        Key.MOD_RANGE: 16,
        Key.MAX_WEIGHT: 1.0,
    }
    context = make_context(partition_id=0, num_partitions=3, node_id=1000)
    for asked in ({}, {MASK_GENERATOR_KEY: "flower-pseudo-rand-gen"}):  # Flower's workflow sends no name
        message = make_message({}, None, node_id=1000)
        message.content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord({**setup, **asked})
        with pytest.raises(MaskGeneratorMismatchError, match="this device draws them from 'dpfl-chacha20"):
            secure_aggregation_mod(message, context, lambda *_: pytest.fail("the client must not be called"))


def ring_round(tmp_path, dropped_positions: list[int]):
    """20 clients, shares 9, min_survivors 0.6: the clients at ``dropped_positions`` of the neighbour
    ring drop out after sharing their keys (before uploading)."""
    strategy = secagg_strategy(tmp_path, 20, "strategy.shares=9", "strategy.min_survivors=0.6")
    grid = InProcessGrid(20)
    arrays = strategy.initial_arrays()
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    ring = strategy._secagg.ring
    grid.fails_at = {ring[p]: "collect_masked_vectors" for p in dropped_positions}
    new, _ = strategy.aggregate_train(1, grid.send_and_receive(messages))
    return strategy, grid, new


def test_survivors_in_parts_smaller_than_the_calibration_discard_the_round(tmp_path, monkeypatch):
    """The audit's scenario: two runs of 4 neighbouring dropouts cut the ring into arcs of 5 and 7.

    Every per-client check passes (each survivor keeps 5 active neighbours, the threshold; 12
    uploads, the floor), but the server could unmask the 5-client arc's sum alone. Discarded before
    the unmask stage: nothing unmasked, no ledger event.
    """
    unmasked = []
    monkeypatch.setattr(
        SecAggRound, "unmask", lambda self, *a, **k: unmasked.append(a) or pytest.fail("unmasked")
    )
    strategy, grid, new = ring_round(tmp_path, [0, 1, 2, 3, 9, 10, 11, 12])
    assert strategy.survivors == 12 and strategy._secagg is None
    assert new is None and unmasked == []
    outcome = strategy.report_round(1).extras["secure_aggregation"]
    assert "falls into 2 parts (7 + 5 clients)" in outcome and "sum of 5, fewer than the 12" in outcome, (
        outcome
    )
    assert strategy.accountant.events == []
    assert not any(
        m.content.config_records.get(RECORD_KEY_CONFIGS, {}).get(Key.STAGE) == "unmask" for m, _ in grid.sent
    )


def test_the_same_number_of_dropouts_spread_over_the_ring_still_releases(tmp_path):
    strategy, _, new = ring_round(tmp_path, [0, 2, 5, 7, 10, 12, 15, 17])
    assert new is not None
    assert strategy.report_round(1).extras["secure_aggregation"] == "released: sum of 12 clients"
    assert len(strategy.accountant.events) == 1


def opened_part_sum(grid: InProcessGrid, secagg: SecAggRound, part: set[int]) -> np.ndarray:
    """The sum of ``part``'s vectors mod 2^b, computed as a curious server can from the replies it got.

    Apart from the strategy's unmasking: the replies read off the grid, the shares recombined
    (Shamir, Flower's format), the key agreement, and the devices' mask generator.
    """
    from fl_app.engine.secagg import (
        bytes_to_private_key,
        bytes_to_public_key,
        combine_shares,
        generate_shared_key,
        mask_arrays,
    )

    modulus = secagg.modulus
    masked, shares = {}, {}
    for message, reply in grid.sent:
        if reply is None or reply.has_error():
            continue
        configs = reply.content.config_records[RECORD_KEY_CONFIGS]
        if Key.MASKED_PARAMETERS in configs:  # a collect-stage reply
            masked[int(message.metadata.dst_node_id)] = bytes_to_ndarray(configs[Key.MASKED_PARAMETERS][-1])
        elif Key.SHARE_LIST in configs and Key.NODE_ID_LIST in configs:  # an unmask-stage reply
            for owner, share in zip(configs[Key.NODE_ID_LIST], configs[Key.SHARE_LIST], strict=True):
                shares.setdefault(int(owner), []).append(share)
    total = np.mod(sum(masked[n].astype(np.int64) for n in part), modulus)
    shape = [total.shape]
    for nid in part:  # the part's private masks
        (mask,) = mask_arrays(combine_shares(shares[nid]), modulus, shape)
        total = total - mask
    for dead in secagg.keyed - set(masked):  # the dropped clients' pairwise masks with the part
        secret = bytes_to_private_key(combine_shares(shares[dead]))
        for other in secagg.neighbours[dead] & part:
            key = generate_shared_key(secret, bytes_to_public_key(secagg.public_keys[other][0]))
            (mask,) = mask_arrays(key, modulus, shape)
            total = total + (mask if dead > other else -mask)
    return np.mod(total, modulus)


def test_a_round_whose_unmasking_started_is_charged_even_if_no_sum_comes_out(tmp_path, monkeypatch):
    """20 clients, shares 5, floor 6: ring positions 0, 1, 8, 9 drop after key sharing (parts of 6
    and 10, both accepted), then 14-16 do not answer the unmask stage.

    The round fails (too few shares to rebuild position 15's mask seed) and the model stays, but
    the server holds every share the 6-client part needs and computes its sum exactly: the round
    must be charged, once, for every scheduled client.
    """
    strategy = secagg_strategy(tmp_path, 20, "strategy.shares=5", "strategy.min_survivors=0.3")
    seen = recorded_encodings(monkeypatch)
    grid = InProcessGrid(20)
    messages = list(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid))
    secagg = strategy._secagg
    ring = secagg.ring
    grid.fails_at = {ring[p]: "collect_masked_vectors" for p in (0, 1, 8, 9)}
    grid.fails_at |= {ring[p]: "unmask" for p in (14, 15, 16)}
    new, _ = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert strategy.survivors == 6 and secagg.threshold == 3
    assert [len(p) for p in secagg.parts(secagg.keyed - {ring[p] for p in (0, 1, 8, 9)})] == [10, 6]
    assert new is None
    assert [e.participants for e in strategy.accountant.events] == [tuple(range(20))]
    outcome = strategy.report_round(1).extras["secure_aggregation"]
    assert outcome.startswith("discarded: unmasking failed: too few shares (2 < 3)"), outcome
    assert outcome.endswith(": charged"), outcome
    one_round = compose_epsilon(
        {strategy.plan.mechanism: 1}, delta=strategy.run.settings.privacy.delta, method="rdp"
    ).epsilon
    assert strategy.epsilon().epsilon == pytest.approx(one_round)
    # why: the 6-client part's sum is open to the server, exactly
    uploaded = sorted(secagg.keyed - {ring[p] for p in (0, 1, 8, 9)})  # the collect stage's order
    encoded = dict(zip(uploaded, seen.values(), strict=True))
    part = {ring[p] for p in range(2, 8)}
    expected = np.mod(sum(encoded[n].astype(np.int64) for n in part), secagg.modulus)
    np.testing.assert_array_equal(opened_part_sum(grid, secagg, part), expected)


def test_parts_of_the_survivors_graph():
    """:meth:`SecAggRound.parts` on a ring of 8 with shares 3 (each node: itself and one on either side)."""
    secagg = SecAggRound(
        nodes=list(range(8)),
        bits=8,
        shares=3,
        threshold=2,
        send=lambda m: [],
        graph_rng=np.random.default_rng(0),
    )
    secagg.neighbours = {n: {(n - 1) % 8, n, (n + 1) % 8} for n in range(8)}
    assert secagg.parts(set(range(8)) - {3}) == [{4, 5, 6, 7, 0, 1, 2}]  # one gap: a path, still one part
    assert secagg.parts({0, 1, 2, 4, 5, 6, 7} - {6}) == [{7, 0, 1, 2}, {4, 5}]
    secagg.min_sum = 3
    with pytest.raises(Exception, match=r"2 parts \(4 \+ 2 clients\)"):
        secagg.check_parts({0, 1, 2, 4, 5, 7})


def test_a_sum_of_two_is_refused_before_the_run(tmp_path):
    """A released sum of 2 tells each of the two the other's vector: cohorts below 3 are refused."""
    from fl_app.config.compose import compose_config
    from fl_app.config.validation import ConfigError, validate_config

    cfg = compose_config(
        [
            *BASE,
            "strategy=dp_fedavg_secagg",
            "num_clients=2",
            "clients_per_round=2",
            f"output_dir={tmp_path / 'x'}",
        ]
    )
    with pytest.raises(ConfigError, match=r"clients_per_round=2: must be at least 3 clients"):
        validate_config(cfg, check_data=False)
    # and a cohort of 3 may lose nobody: its floor is 3 survivors whatever min_survivors says
    strategy = secagg_strategy(tmp_path, 3, "strategy.min_survivors=0.6")
    assert strategy.survivors == 3


# ------------------------------------------------------------------ its quick example (test_simulations)


def check_quick_example(results: dict[str, Any], example: Any) -> None:
    """What its quick example's run must show beyond the common checks (tests/test_simulations.py)."""
    from dp_accounting.rdp import rdp_privacy_accountant

    from fl_app.privacy.rdp import skellam_rdp

    privacy = results["privacy"]
    plan = privacy["plan"]
    cohort = example.clients_per_round
    assert plan["bits"] == example.strategy.bits and plan["survivors"] == math.ceil(0.9 * cohort)
    for r in results["rounds"]:  # every scheduled client completed SecAgg+, the sum was released
        assert r["clients"] == cohort and r["failures"] == 0
        assert r["secure_aggregation"] == f"released: sum of {cohort} clients"
        # the masked vector: 8 bytes per coordinate of the padded dimension (Flower's int64), and more
        assert r["upload_bytes"] >= 8 * plan["dim"] * cohort
    # the epsilon, recomputed from the plan with dp-accounting's conversion on the papers' orders
    participations = math.ceil(len(results["rounds"]) / (example.num_clients // cohort))
    assert privacy["planned_max_participations"] == participations == plan["participations"]
    orders = np.arange(2, 257, dtype=float)
    rdp = participations * skellam_rdp(
        orders=orders,
        variance=plan["survivors"] * plan["local_variance"],
        l1_sensitivity=plan["l1_sensitivity"],
        l2_sensitivity=plan["l2_sensitivity"],
    )
    independent, _ = rdp_privacy_accountant.compute_epsilon(orders, rdp, example.privacy.delta)
    assert results["final"]["epsilon"] == pytest.approx(independent, rel=1e-3)
    assert "adversary" in privacy and "the server" in privacy["unit"] + privacy["adversary"]
