"""Noise fixed by a setting, not calibrated to ``privacy.epsilon``: the header and results say so.

A run with ``strategy.noise_multiplier`` (or NbAFL's ``strategy.sigma_up``, DPFL-BNN's ``strategy.gamma``,
a Flower DP wrapper's ``strategy.dp.noise_multiplier``) ignores ``privacy.epsilon``: its header names
the setting and the epsilon its planned rounds reach, computed before round 1 with the accountant's
composition, and ``results.json`` carries the same (``privacy.fixed_noise``). These tests check that
epsilon against the one the accountant reports after the planned rounds (on constructed replies, and
in a real run).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import FAST, INLINE, build_run_context, reply_to
from flwr.app import Array, ArrayRecord, ConfigRecord

from strategies import STRATEGIES

DIGITS = ["dataset=digits", "num_clients=6", "clients_per_round=3", "num_rounds=4", "privacy.epsilon=8"]

#: Each strategy whose noise a setting can fix: that setting, and what it needs besides.
FIXED = {
    "dp_fedavg": ["strategy.noise_multiplier=0.3"],
    "dp_fedavg_balanced": [
        "strategy=dp_fedavg",
        "strategy.sampling=balanced",
        "strategy.noise_multiplier=0.3",
    ],
    "dp_flower": ["strategy.noise_multiplier=0.3"],
    "dp_fedavg_adaptive": ["strategy.noise_multiplier=0.3", "strategy.bit_noise=1.0"],
    "dp_bandmf": ["strategy.bands=1", "strategy.noise_multiplier=0.067"],
    "dp_ftrl": ["strategy.noise_multiplier=0.3"],
    "fedavg_ldp": ["strategy.noise_multiplier=0.3"],
    "nbafl": ["strategy.sigma_up=0.5"],
}


def zeros_like(arrays: ArrayRecord) -> ArrayRecord:
    return ArrayRecord({k: Array(np.zeros_like(v.numpy())) for k, v in arrays.items()})


def built(name: str, extra: list[str], tmp_path: Path):
    run = build_run_context([*DIGITS, f"strategy={name}", *extra], tmp_path)
    return STRATEGIES.get(run.settings.strategy)(run)


def run_rounds(strategy, rounds: int) -> None:
    """Every planned round on constructed replies (zero updates), every selected client replying."""
    arrays = strategy.initial_arrays()
    for t in range(1, rounds + 1):
        messages = list(strategy.configure_train(t, arrays, ConfigRecord(), grid=None))
        replies = [reply_to(m, arrays=zeros_like(arrays)) for m in messages]
        arrays = strategy.aggregate_train(t, replies)[0] or arrays


@pytest.mark.parametrize("case", sorted(FIXED))
def test_fixed_noise_is_said_with_the_epsilon_its_planned_rounds_reach(case, tmp_path):
    strategy = built(case.removesuffix("_balanced"), FIXED[case], tmp_path)
    fixed = strategy.planned_noise()  # what the header says, before round 1
    assert fixed is not None and fixed.rounds == 4
    text = strategy.budget_text()
    assert text.startswith(f"noise fixed by {fixed.setting}, not calibrated to the training's epsilon=8: ")
    assert f"the 4 planned rounds reach epsilon={fixed.planned_epsilon:.4g} at delta=1e-05" in text
    assert "budget epsilon" not in text
    run_rounds(strategy, 4)
    # every selected client replied in every planned round: the accountant reaches what was said
    assert strategy.epsilon().epsilon == pytest.approx(fixed.planned_epsilon, rel=1e-9)
    summary = strategy.report_run(strategy.initial_arrays()).privacy.summary
    assert summary["fixed_noise"] == {
        "setting": fixed.setting,
        "planned_epsilon": fixed.planned_epsilon,
        "planned_rounds": 4,
        "privacy_epsilon_not_used": 8.0,
    }


def test_calibrated_noise_keeps_the_budget_line_and_no_fixed_noise(tmp_path):
    strategy = STRATEGIES.get("dp_fedavg")(build_run_context([*DIGITS, "strategy=dp_fedavg"], tmp_path))
    assert strategy.planned_noise() is None
    assert strategy.budget_text().startswith("budget epsilon=8 delta=1e-05")
    assert "fixed_noise" not in strategy.report_run(strategy.initial_arrays()).privacy.summary


def test_a_fixed_dpfl_bnn_gamma_is_said_with_its_client_level_epsilon(tmp_path):
    bnn = STRATEGIES.get("dpfl_bnn")(
        build_run_context([*DIGITS, "strategy=dpfl_bnn", "model=auto", "strategy.gamma=0.01"], tmp_path)
    )
    fixed = bnn.planned_noise()
    assert fixed is not None and fixed.setting == "strategy.gamma=0.01"
    assert fixed.planned_epsilon == bnn.ledger.plan.client_level > 8
    assert bnn.budget_text().startswith("noise fixed by strategy.gamma=0.01, not calibrated")


@pytest.mark.simulation
def test_a_preset_with_fixed_noise_says_so_in_its_header_and_results(simulate):
    """so_dp_fedavg's noise (dp_bandmf, one band, z = 0.067) on digits: a real run, one round."""
    results = simulate(
        [
            *FAST,
            INLINE,
            "strategy=dp_bandmf",
            "strategy.bands=1",
            "strategy.noise_multiplier=0.067",
            "num_rounds=1",
        ]
    )
    fixed = results["privacy"]["fixed_noise"]
    assert fixed["setting"] == "strategy.noise_multiplier=0.067" and fixed["planned_rounds"] == 1
    assert fixed["planned_epsilon"] == pytest.approx(results["final"]["epsilon"], rel=1e-9)
    assert fixed["planned_epsilon"] > 8 * 5  # far above the budget privacy.epsilon names
    log = (Path(results["_output_dir"]) / "run.log").read_text()
    (header,) = [line for line in log.splitlines() if "└──> privacy:" in line]
    assert (
        "noise fixed by strategy.noise_multiplier=0.067, not calibrated to the training's epsilon=8: the 1 "
        in header
    )
    assert f"planned rounds reach epsilon={fixed['planned_epsilon']:.4g}" in header
    assert "budget epsilon" not in header
    assert json.loads(json.dumps(fixed)) == fixed


@pytest.mark.parametrize("wrapper", ["ServerSideFixedClipping", "ServerSideAdaptiveClipping"])
def test_a_flower_dp_wrappers_noise_is_said_fixed_with_what_dpfl_proves_for_the_planned_rounds(
    wrapper, tmp_path
):
    """Flower's DP wrappers take their noise from ``strategy.dp``: never calibrated to privacy.epsilon."""
    from conftest import InProcessGrid

    overrides = [*DIGITS, "model=mlp", "num_rounds=3", "strategy=flower"]
    overrides += [f"strategy.flower=DifferentialPrivacy{wrapper}", "strategy.dp.noise_multiplier=1.0"]
    overrides += ["strategy.dp.clipping_norm=0.5"]
    if "Adaptive" in wrapper:
        overrides.append("strategy.dp.clipped_count_stddev=1.0")
    run = build_run_context(overrides, tmp_path)
    strategy = STRATEGIES.get("flower")(run)
    fixed = strategy.planned_noise()
    assert fixed is not None and fixed.setting == "strategy.dp.noise_multiplier=1" and fixed.rounds == 3
    assert strategy.budget_text().startswith("noise fixed by strategy.dp.noise_multiplier=1, not calibrated")
    grid, arrays = InProcessGrid(6), strategy.initial_arrays()
    for t in (1, 2, 3):  # real clients through the ClientApp, every one replying
        messages = list(strategy.configure_train(t, arrays, ConfigRecord(), grid))
        arrays = strategy.aggregate_train(t, grid.send_and_receive(messages))[0] or arrays
    assert strategy.epsilon().epsilon == pytest.approx(fixed.planned_epsilon, rel=1e-9)


def test_a_per_report_epsilon_set_by_hand_is_said_with_what_the_planned_evaluations_reach(tmp_path, caplog):
    """``evaluation.laplace_eval_eps`` fixes the clustering evaluation's noise: the stage's header names it
    with the epsilon the largest client's reports reach over the planned evaluations (basic composition),
    ``privacy.evaluation`` carries it, and the evaluation's ledger never exceeds it."""
    import logging

    from strategies.dp_fedavg import DPFedAvgStrategy
    from strategies.laplace_eval.stage import LaplaceEvalStage

    overrides = [
        *DIGITS,
        "num_rounds=3",
        "evaluation=laplace_eval",
        "strategy=dp_fedavg",
        "strategy.noise_multiplier=1.0",
        "evaluation.cluster_client_num=6",
        "evaluation.laplace_eval_eps=3",
    ]
    stage = LaplaceEvalStage(DPFedAvgStrategy(build_run_context(overrides, tmp_path)))
    largest = max(info.num_examples for info in stage.run.roster)
    planned = 3.0 * largest * stage.evaluation_rounds
    with caplog.at_level(logging.INFO, logger="flwr"):
        stage.describe()
    said = (
        f"noise fixed by evaluation.laplace_eval_eps=3, not calibrated to privacy.epsilon=8: the "
        f"{stage.evaluation_rounds} planned evaluations reach epsilon={planned:.4g}"
    )
    assert said in caplog.text
    assert stage.evaluation_summary()["planned_epsilon_fixed_noise"] == pytest.approx(planned)
    arrays = stage.initial_arrays()
    for server_round in range(1, 4):
        list(stage.configure_train(server_round, arrays, ConfigRecord(), grid=None))
        stage.aggregate_train(server_round, [])
        messages = list(stage.configure_evaluate(server_round, arrays, ConfigRecord(), grid=None))
        stage.aggregate_evaluate(server_round, [reply_to(m) for m in messages])
    assert 0 < stage.ledger.client_epsilon() <= planned + 1e-6


def test_a_calibrated_evaluation_says_no_fixed_noise(tmp_path, caplog):
    import logging

    from strategies.dp_fedavg import DPFedAvgStrategy
    from strategies.laplace_eval.stage import LaplaceEvalStage

    overrides = [*DIGITS, "evaluation=laplace_eval", "strategy=dp_fedavg", "evaluation.cluster_client_num=6"]
    stage = LaplaceEvalStage(DPFedAvgStrategy(build_run_context(overrides, tmp_path)))
    with caplog.at_level(logging.INFO, logger="flwr"):
        stage.describe()
    assert "noise fixed by evaluation.laplace_eval_eps" not in caplog.text
    assert stage.evaluation_summary()["planned_epsilon_fixed_noise"] is None
