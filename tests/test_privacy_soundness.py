"""What the printed epsilon rests on: secret randomness, nothing released outside it, defaults.

1. DP-FedAvg's Poisson cohort comes from the privacy randomness (secret under
   ``privacy.secure_rng`` and on devices), and a seeded run says its cohort is public.
2. The default noise seed is not the public ``seed``: it is derived from the whole
   configuration (runs of a sweep never share noise) and the results say it is seeded.
3. Statistics of un-noised client data leave a DP run only in a block marked as
   outside the guarantee (opt-in, simulation only); federated evaluation is refused.
4. Defaults deliver the requested epsilon in the unit the results name (DPFL-BNN,
   the BNN calculator, the Laplace evaluation), and the total covers every stage.

The end-to-end audit of every private strategy is ``tests/test_privacy_end_to_end.py``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import DP_FEDAVG_RUN, build_run_context, error_reply, reply_to, settings_of
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord

from fl_app import keys
from fl_app.config.compose import compose_config
from fl_app.config.validation import ConfigError, validate_config
from fl_app.data.federated import federated_data
from fl_app.learning.model_spec import ModelSpec
from fl_app.privacy.rng import RandomSource
from fl_app.report import calculator as cli
from fl_app.run.context import RunContext
from fl_app.run.results import OUTSIDE_GUARANTEE_NOTE, RunRecorder
from fl_app.run.roster import ClientInfo
from fl_app.run.server import (
    diagnostics_enabled,
    make_run_context,
    noise_source,
)
from strategies import STRATEGIES
from strategies.arrays import flat_vector
from strategies.dp_fedavg import DPFedAvgStrategy
from strategies.dpfl_bnn.privacy import binary_rr_epsilon, bnn_gamma
from strategies.dpfl_bnn.strategy import DPFLBNNStrategy
from strategies.laplace_eval.stage import LaplaceEvalStage

DIGITS = ["dataset=digits", "num_clients=6", "clients_per_round=3", "num_rounds=4"]


def platform_run(overrides: list[str], tmp_path: Path, roster: list[ClientInfo] | None = None) -> RunContext:
    """The RunContext the platform builds (``fl_app.run.server.make_run_context``) for ``overrides``."""
    settings = settings_of(overrides)
    data = federated_data(settings.data)
    if roster is None:
        roster = [ClientInfo(i, 1000 + i, size) for i, size in enumerate(data.client_sizes())]
    model_spec = ModelSpec(
        STRATEGIES.get(settings.strategy).declaration.model_name(settings, data.input_shape),
        data.input_shape,
        data.num_classes,
    )
    return make_run_context(settings, roster=roster, data=data, model_spec=model_spec, output_dir=tmp_path)


def zeros_like(arrays: ArrayRecord) -> ArrayRecord:
    return ArrayRecord({k: Array(np.zeros_like(v.numpy())) for k, v in arrays.items()})


def cohorts(strategy: DPFedAvgStrategy, rounds: int = 12) -> list[list[int]]:
    return [[c.client_id for c in strategy.select_clients(t)] for t in range(1, rounds + 1)]


# ------------------------------------------------------------------ 1. the Poisson cohort is secret


def test_secure_runs_with_one_config_draw_different_poisson_cohorts(tmp_path):
    """Two runs with privacy.secure_rng=true and the same seed: amplification needs different cohorts."""
    overrides = [*DIGITS, "strategy=dp_fedavg", "privacy.secure_rng=true", "num_rounds=12"]
    first = DPFedAvgStrategy(platform_run(overrides, tmp_path))
    second = DPFedAvgStrategy(platform_run(overrides, tmp_path))
    assert first.run.noise.secure and first.run.settings.seed == second.run.settings.seed
    assert cohorts(first) != cohorts(second)
    # ... and the accountant credits amplification (a Poisson-sampled event for every client).
    first.configure_train(1, first.initial_arrays(), ConfigRecord(), grid=None)
    first.aggregate_train(1, [])
    assert first.accountant.events[0].mechanism.kind == "sampled_gaussian"
    assert first.accountant.events[0].participants is None


def test_poisson_cohort_follows_the_noise_seed_not_the_public_seed(tmp_path):
    run = build_run_context([*DIGITS, "strategy=dp_fedavg", "num_rounds=12"], tmp_path)
    base = cohorts(DPFedAvgStrategy(run))
    assert cohorts(DPFedAvgStrategy(dataclasses.replace(run, noise=RandomSource(seed=1)))) != base
    # The public randomness (seed) alone does not decide it.
    assert cohorts(DPFedAvgStrategy(dataclasses.replace(run, randomness=RandomSource(seed=9)))) == base


def test_a_seeded_run_says_its_cohort_and_noise_are_reproducible(tmp_path):
    strategy = DPFedAvgStrategy(platform_run([*DIGITS, "strategy=dp_fedavg"], tmp_path))
    randomness = strategy.randomness().as_dict()
    assert randomness["source"] == "seeded"
    assert randomness["noise_seed"] == strategy.run.noise.seed
    assert "deployment" in randomness["note"] and "reproducible" in randomness["note"]
    assert "secret" in randomness["cohort"] and "run.noise" in randomness["cohort"]
    assert "SEEDED" in strategy.randomness().describe()
    secure = DPFedAvgStrategy(
        platform_run([*DIGITS, "strategy=dp_fedavg", "privacy.secure_rng=true"], tmp_path)
    )
    assert secure.randomness().as_dict()["source"] == "os_entropy"
    assert secure.randomness().as_dict()["noise_seed"] is None
    fixed = DPFedAvgStrategy(
        platform_run([*DIGITS, "strategy=dp_fedavg", "strategy.sampling=fixed"], tmp_path)
    )
    assert "public" in fixed.randomness().cohort


# ------------------------------------------------------------------ 2. the noise is not the public seed's


def test_default_noise_seed_is_derived_from_seed_and_the_whole_configuration():
    settings = settings_of([*DIGITS, "strategy=dp_fedavg"])
    source = noise_source(settings)
    assert not source.secure
    assert source.seed != settings.seed  # not the published `seed`
    assert noise_source(settings_of([*DIGITS, "strategy=dp_fedavg"])).seed == source.seed  # reproducible
    for change in ("privacy.epsilon=2", "seed=43", "strategy.clip=0.5", "num_rounds=5"):
        assert noise_source(settings_of([*DIGITS, "strategy=dp_fedavg", change])).seed != source.seed
    for same in ("output_dir=/tmp/elsewhere", "simulation.client_cpus=0.5", "evaluation.every=2"):
        assert noise_source(settings_of([*DIGITS, "strategy=dp_fedavg", same])).seed == source.seed
    assert noise_source(settings_of([*DIGITS, "privacy.noise_seed=7"])).seed == 7
    assert noise_source(settings_of([*DIGITS, "privacy.secure_rng=true"])).secure


def _central_noise(tmp_path: Path, epsilon: float) -> np.ndarray:
    """DP-FedAvg's central noise of round 1 (every client returns the global model), per unit of sigma."""
    overrides = [*DIGITS, "strategy=dp_fedavg", "strategy.sampling=fixed", f"privacy.epsilon={epsilon}"]
    strategy = DPFedAvgStrategy(platform_run(overrides, tmp_path))
    start = zeros_like(strategy.initial_arrays())
    messages = list(strategy.configure_train(1, start, ConfigRecord(), grid=None))
    arrays, _ = strategy.aggregate_train(1, [reply_to(m, arrays=start) for m in messages])
    return flat_vector(arrays) * strategy.denominator / (strategy.noise_multiplier * strategy.clip)


def test_runs_of_a_sweep_do_not_share_their_central_noise(tmp_path):
    """With one seed, two released models of a sweep must not have noise equal up to scale."""
    one, two = _central_noise(tmp_path, 1.0), _central_noise(tmp_path, 2.0)
    assert np.std(one) == pytest.approx(1.0, rel=0.05)  # it is the noise, in units of sigma
    assert not np.allclose(one, two, rtol=1e-3, atol=1e-3)
    assert abs(np.corrcoef(one, two)[0, 1]) < 0.1  # independent streams
    np.testing.assert_allclose(_central_noise(tmp_path, 1.0), one)  # the same run repeats exactly


# ------------------------------------------------------------------ 3. nothing released outside epsilon


def test_dp_fedavg_releases_no_train_loss_and_no_update_norms(tmp_path):
    run = build_run_context(
        [*DIGITS, "strategy=dp_fedavg", "strategy.sampling=fixed", "strategy.clip=0.5"], tmp_path
    )
    strategy = DPFedAvgStrategy(run)
    start = zeros_like(strategy.initial_arrays())
    messages = list(strategy.configure_train(1, start, ConfigRecord(), grid=None))
    moved = ArrayRecord({k: Array(np.full_like(v.numpy(), 1.0)) for k, v in start.items()})
    replies = [
        reply_to(m, arrays=moved, metrics={keys.NUM_EXAMPLES: 5, keys.TRAIN_LOSS: 1.25}) for m in messages[:2]
    ] + [error_reply(messages[2])]
    _, metrics = strategy.aggregate_train(1, replies)
    assert metrics is not None and keys.TRAIN_LOSS not in metrics  # Flower logs these into run.log
    assert len(metrics) == 0
    extras = strategy.round_extras(1)
    assert "update_norm_median" not in extras and "clipped_fraction" not in extras
    diagnostics = strategy.diagnostics(1)  # only for the marked block
    assert diagnostics["clipped_fraction"] == 1.0
    assert diagnostics["update_norm_median"] > 0.5


@pytest.mark.parametrize("strategy", ["dp_fedavg", "nbafl", "dpfl_bnn", "fedavg_ldp", "privatekt", "kd_dp"])
def test_private_runs_refuse_federated_evaluation(strategy):
    extra = ["strategy.teacher_rounds=1"] if strategy == "kd_dp" else []
    cfg = compose_config([*DIGITS, f"strategy={strategy}", *extra, "evaluation.federated_fraction=0.5"])
    with pytest.raises(ConfigError) as caught:
        validate_config(cfg, check_data=False)
    assert caught.value.key == "evaluation.federated_fraction"
    assert "\n" not in str(caught.value)
    validate_config(
        compose_config([*DIGITS, "evaluation.federated_fraction=0.5"]), check_data=False
    )  # FedAvg


def test_dpfl_bnn_local_model_diagnostic_is_opt_in_outside_the_guarantee():
    cfg = compose_config([*DIGITS, "strategy=dpfl_bnn", "strategy.local_eval_clients=2"])
    with pytest.raises(ConfigError) as caught:
        validate_config(cfg, check_data=False)
    assert caught.value.key == "strategy.local_eval_clients"
    validate_config(
        compose_config(
            [*DIGITS, "strategy=dpfl_bnn", "strategy.local_eval_clients=2", "privacy.diagnostics=true"]
        ),
        check_data=False,
    )


def test_unnoised_statistics_are_written_only_in_the_marked_block(tmp_path):
    settings = settings_of(DIGITS)
    spec = ModelSpec("mlp", (1, 8, 8), 10)
    for enabled in (False, True):
        out = tmp_path / str(enabled)
        recorder = RunRecorder(out, settings, diagnostics=enabled)
        recorder.add_round({"round": 1, "accuracy": 0.5, "loss": 1.0, "epsilon": 1.0})
        recorder.add_diagnostics(1, {"update_norm_median": 3.0, "clipped_fraction": 0.5})
        results = recorder.finalize(
            strategy="dp_fedavg",
            privacy={"unit": "u", "mechanism": "m", "accountant": "a"},
            final_extras={},
            arrays=None,
            model_spec=spec,
            ledger=None,
            wall_s=1.0,
        )
        csv = (out / "metrics.csv").read_text()
        assert "update_norm_median" not in csv and "clipped_fraction" not in csv
        assert "update_norm_median" not in json.dumps(results["rounds"]) + json.dumps(results["final"])
        if enabled:
            assert results["outside_guarantee"]["note"] == OUTSIDE_GUARANTEE_NOTE
            assert results["outside_guarantee"]["rounds"] == [
                {"round": 1, "update_norm_median": 3.0, "clipped_fraction": 0.5}
            ]
        else:
            assert "outside_guarantee" not in results
            assert "update_norm_median" not in (out / "results.json").read_text()


def test_outside_guarantee_block_is_opt_in_and_never_written_on_devices():
    assert not diagnostics_enabled(settings_of(DIGITS), devices=False)
    wanted = settings_of([*DIGITS, "privacy.diagnostics=true"])
    assert diagnostics_enabled(wanted, devices=False)
    assert not diagnostics_enabled(wanted, devices=True)


def test_evaluation_stage_keeps_a_private_strategys_train_loss_to_itself(tmp_path):
    run = build_run_context([*DIGITS, "strategy=dp_fedavg", "evaluation=laplace_eval"], tmp_path)
    stage = LaplaceEvalStage(DPFedAvgStrategy(run))
    stage.inner.aggregate_train = lambda server_round, replies: (None, MetricRecord({keys.TRAIN_LOSS: 0.7}))
    stage.configure_train(1, stage.initial_arrays(), ConfigRecord(), grid=None)
    stage.aggregate_train(1, [])
    assert stage.round_extras(1)["train_loss"] is None  # not logged, not written


# ------------------------------------------------------------------ 4. defaults give what was asked


def test_dpfl_bnn_default_delivers_the_requested_client_level_epsilon(tmp_path):
    """strategy=dpfl_bnn privacy.epsilon=8 used to report a client-level epsilon of ~70,000."""
    run = build_run_context(
        [*DIGITS, "strategy=dpfl_bnn", "privacy.epsilon=8", "clients_per_round=6"], tmp_path
    )
    strategy = DPFLBNNStrategy(run)
    assert strategy.settings.calibration == "client_level"
    assert 7.9 < strategy.ledger.plan.client_level <= 8.0
    for server_round in range(1, 5):  # every client in every round: the planned worst case
        strategy.configure_train(server_round, strategy.initial_arrays(), ConfigRecord(), grid=None)
        strategy.aggregate_train(server_round, [])
    assert strategy.epsilon().epsilon <= 8.0  # the headline epsilon, in the unit the results name
    assert strategy.privacy_summary()["unit"] == strategy.privacy_unit
    # The document's reading stays available by name, with its (huge) client-level epsilon reported.
    document = DPFLBNNStrategy(
        build_run_context([*DIGITS, "strategy=dpfl_bnn", "strategy.calibration=per_coordinate"], tmp_path)
    )
    plan = document.ledger.plan
    assert plan.per_coordinate <= 8.0 < 100 * 8.0 < plan.client_level


def test_bnn_calculator_defaults_to_a_clients_whole_upload(capsys):
    assert cli.main(["bnn", "--epsilon", "8", "--delta", "1e-5", "--rounds", "30"]) == 0
    answer = json.loads(capsys.readouterr().out)
    d = 81_848  # the binary CNN on 28x28 images, 10 classes
    assert answer["bits_per_round"] == d
    assert answer["gamma"] == bnn_gamma(epsilon=8, delta=1e-5, rounds=30, bits_per_round=d)
    assert binary_rr_epsilon(gamma=answer["gamma"], delta=1e-5, rounds=30, bits_per_round=d) <= 8
    assert "client level" in answer["unit"]
    assert cli.main(["bnn", "--epsilon", "8", "--delta", "1e-5", "--rounds", "30", "--per-coordinate"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["bits_per_round"] == 1 and "NOT a guarantee" in document["unit"]


def test_laplace_evaluation_default_fits_in_privacy_epsilon_and_enters_the_total(tmp_path):
    """The evaluation used to default to 230,260 per report and never entered rounds[].epsilon."""
    overrides = [*DIGITS, "strategy=dp_fedavg", "evaluation=laplace_eval", "privacy.epsilon=4"]
    run = platform_run(overrides, tmp_path)
    assert run.settings.privacy.epsilon == pytest.approx(3.6)  # training gets the rest of the budget
    assert run.settings.stage_settings.epsilon_budget == pytest.approx(0.4)
    stage = LaplaceEvalStage(DPFedAvgStrategy(run))
    largest = max(info.num_examples for info in run.roster)
    assert stage.plan.epsilon_per_report == pytest.approx(0.4 / (largest * 4))
    arrays = stage.initial_arrays()
    for server_round in range(1, 5):
        list(stage.configure_train(server_round, arrays, ConfigRecord(), grid=None))
        stage.aggregate_train(server_round, [])
        messages = list(stage.configure_evaluate(server_round, arrays, ConfigRecord(), grid=None))
        stage.aggregate_evaluate(server_round, [error_reply(m) for m in messages])  # failures are charged
    last = stage.report_round(4)
    training = last.training_epsilon.epsilon
    total = last.epsilon.epsilon  # rounds[].epsilon
    evaluation = stage.ledger.client_epsilon()
    assert training <= 3.6
    assert stage.ledger.client_accountant.basic_epsilon() == pytest.approx(0.4, rel=1e-6)  # the calibration
    assert 0 < evaluation <= 0.4  # the accountant's (RDP) bound may be smaller
    assert training < total <= 4.0
    report = stage.report_run(arrays).privacy
    privacy = report.as_dict()  # the results' privacy object
    assert privacy["total"]["epsilon"] == report.total.epsilon == total
    assert privacy["total"]["per_stage"] == {"training": training, "clustering_evaluation": evaluation}
    assert any("clustering" in item for item in privacy["total"]["covers"])
    assert privacy["evaluation"] == stage.evaluation_summary()  # the stage's own account
    assert privacy["randomness"] == stage.randomness().as_dict()
    assert "empirical_epsilon" not in privacy  # not measured for this run
    # The MindSpore document's value stays available by name.
    assert compose_config(["+experiment=laplace_eval"]).evaluation.laplace_eval_eps == 230260


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["evaluation.budget_fraction=0"], "evaluation.budget_fraction"),
        (["evaluation.budget_fraction=1.5"], "evaluation.budget_fraction"),
        (["privacy.budget_scope=per_round"], "evaluation.laplace_eval_eps"),
    ],
)
def test_bad_evaluation_budget_is_one_line(overrides, key):
    with pytest.raises(ConfigError) as caught:
        validate_config(compose_config([*DIGITS, "evaluation=laplace_eval", *overrides]), check_data=False)
    assert caught.value.key == key
    assert "\n" not in str(caught.value)


# ------------------------------------------------------------------ a real run: what it writes


@pytest.mark.simulation
def test_dp_fedavg_run_writes_only_what_its_epsilon_covers(shared_simulation):
    results = shared_simulation(DP_FEDAVG_RUN)
    out = Path(results["_output_dir"])
    randomness = results["privacy"]["randomness"]
    assert randomness["source"] == "seeded" and "deployment" in randomness["note"]
    assert randomness["noise_seed"] != results["config"]["seed"]
    log = (out / "run.log").read_text()
    assert "privacy randomness SEEDED" in log
    for leaked in ("update_norm_median", "clipped_fraction", "train-loss", "train_loss"):
        assert leaked not in log, leaked
        assert leaked not in (out / "metrics.csv").read_text(), leaked
        assert leaked not in json.dumps(results), leaked
    assert "outside_guarantee" not in results
    total = results["privacy"]["total"]
    assert total["epsilon"] == results["final"]["epsilon"] == results["rounds"][-1]["epsilon"]
    assert total["per_stage"]["training"] == results["final"]["epsilon_training"]
    assert results["final"]["epsilon"] <= results["config"]["privacy"]["epsilon"]


# ------------------------------------------------ 1b. nothing published follows the secret cohort

#: Values of a round that are functions of the released model (they differ with the noise anyway).
MODEL_VALUES = ("accuracy", "loss")


def _published(results: dict, output: Path) -> dict:
    """What two runs that differ only in their secret coins (and noise) must publish identically."""
    from fl_app.run.log import NO_CLOCK_TIMES

    rounds = [{k: v for k, v in r.items() if k not in MODEL_VALUES} for r in results["rounds"]]
    final = {
        k: v for k, v in results["final"].items() if k not in (*MODEL_VALUES, "best_accuracy", "best_round")
    }
    assert "wall_s" in final  # the total wall time is published, and named as not covered
    assert any("total wall time" in line for line in results["privacy"]["total"]["not_covered"])
    final.pop("wall_s")
    privacy = json.loads(json.dumps(results["privacy"]))
    privacy["randomness"].pop("noise_seed")
    config = json.loads(json.dumps(results["config"]))
    config["privacy"].pop("noise_seed")
    config.pop("output_dir")
    metrics = (output / "metrics.csv").read_text().splitlines()
    header = metrics[0].split(",")
    keep = [i for i, name in enumerate(header) if name not in MODEL_VALUES]
    columns = [[row.split(",")[i] for i in keep] for row in metrics]
    lines = (output / "run.log").read_text().splitlines(keepends=True)
    # Flower's engine debug lines (backend set-up, actor pool) depend on which run of the process started Ray
    # (and how long the roster waited for the simulated nodes to register: timing, not the cohort)
    log = "".join(
        line
        for line in lines
        if " DEBUG " not in line and not line.startswith("DEBUG ") and "Waiting for SuperNodes" not in line
    ).replace(str(output), "OUT")
    # clock times: only on the lines before the run knew its cohort was secret (before round 1)
    head, switch, tail = log.partition(NO_CLOCK_TIMES)
    assert switch and "round 1" not in head, "run.log never stops stamping its lines"
    stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ", flags=re.MULTILINE)
    assert not stamp.search(tail), stamp.search(tail)
    log = stamp.sub("", head) + switch + tail
    log = re.sub(r"(accuracy|loss|best) [-0-9.e]+", r"\1 #", log)
    log = re.sub(r"noise seed \d+", "noise seed #", log)
    log = re.sub(r"in \d+:\d\d:\d\d", "in #", log)  # the total wall time (not covered, stated)
    log = re.sub(r"in round \d+", "in round #", log)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(output / "tensorboard"))
    events.Reload()
    tags = sorted(events.Tags()["scalars"])
    steps = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in tags if tag not in MODEL_VALUES}
    wall_times = {e.wall_time for tag in tags for e in events.Scalars(tag)}
    assert len(wall_times) == 1, f"TensorBoard's wall times vary: {len(wall_times)} distinct"
    # a link as it is in the folder (W&B links its core service's log, outside the run, into it)
    times = {path: path.lstat().st_mtime_ns for path in [output, *output.rglob("*")]}
    common = max(set(times.values()), key=list(times.values()).count)
    odd = sorted(str(path.relative_to(output.parent)) for path, when in times.items() if when != common)
    assert not odd, f"the run's files carry {len(set(times.values()))} distinct modification times: {odd}"
    published = {
        "status": results["status"],
        "rounds": rounds,
        "final": final,
        "privacy": privacy,
        "engine": results["engine"],
        "config": config,
        "metrics.csv": columns,
        "run.log": log,
        "tensorboard": steps,
    }
    if (output / "mlflow_run.json").exists():
        published["mlflow"] = _mlflow_published(output)
    if (output / "wandb").exists():
        published["wandb"] = _wandb_published(output)
    return published


#: What differs between two runs whatever their cohorts: the model's numbers, the total wall time (stated
#: as not covered), the noise seed and the output folder.
NOT_COMPARED = (
    *MODEL_VALUES,
    "final.accuracy",
    "final.loss",
    "final.best_accuracy",
    "final.best_round",
    "final.wall_s",
    "privacy.noise_seed",
    "output_dir",
    "dpfl.output_dir",
)


def _mlflow_published(output: Path) -> dict:
    """The run's MLflow run without what differs anyway; every metric's timestamp is the run's start."""
    from tracked import mlflow_run

    run = mlflow_run(output)
    stamps = {stamp for history in run["metrics"].values() for _, _, stamp in history}
    assert stamps == {run["info"].start_time}, f"MLflow's metric timestamps vary: {len(stamps)} distinct"
    return {
        "params": {k: v for k, v in run["params"].items() if k not in NOT_COMPARED},
        "metrics": {k: [h[:2] for h in v] for k, v in run["metrics"].items() if k not in NOT_COMPARED},
        "tags": {k: v for k, v in run["tags"].items() if k not in NOT_COMPARED},
        "artifacts": run["artifacts"],
    }


def _wandb_published(output: Path) -> dict:
    """The run's W&B records without what differs anyway; every row carries one ``_timestamp``.

    W&B's own ``_runtime`` stamps follow the moment the run was given to W&B, its end
    (tests/test_tracking.py checks that nothing is written while the rounds run).
    """
    from tracked import wandb_run

    run = wandb_run(output)
    stamps = {row["_timestamp"] for row in run["history"]}
    assert len(stamps) == 1, f"W&B's row timestamps vary: {len(stamps)} distinct"

    def kept(values: dict) -> dict:
        clock = ("_timestamp", "_runtime", "_wandb/runtime")
        left_out = (*NOT_COMPARED, *clock)
        return {k: v for k, v in values.items() if k not in left_out and not k.startswith("plots/")}

    config = json.loads(json.dumps(run["config"]))
    config["privacy"].pop("noise_seed")
    config.pop("output_dir")
    return {
        "config": config,
        "history": [kept(row) for row in run["history"]],
        "summary": kept(run["summary"]),
        "files": [name for name in run["files"] if not name.startswith("media/")],  # images named by content
    }


@pytest.mark.parametrize("backend", ["ray", "processes"])
def test_nothing_published_varies_with_the_secret_cohort(
    simulate, backend, tmp_path, tmp_path_factory, monkeypatch
):
    """Two DP-FedAvg runs whose secret Poisson cohorts differ in size publish the same.

    The cohort size, failures, bytes and durations of a round are functions of the secret coins:
    results.json, metrics.csv, run.log and every tracker (TensorBoard, MLflow, W&B) must not vary with
    them (they go to outside_guarantee only, with privacy.diagnostics=true), and no clock time may tell a
    round's duration (run.log's stamps, TensorBoard's wall times, MLflow's metric timestamps,
    W&B's row timestamps, the files' modification times).
    """
    from conftest import FAST

    from fl_app.run.results import COHORT_FIELDS

    common = [*FAST, "strategy=dp_fedavg", "num_rounds=4", "privacy.diagnostics=true", "tracking=tensorboard"]
    common.append(f"simulation.backend={backend}")
    if backend == "ray":  # every tracker once (what a tracker gets does not depend on where clients run)
        from tracked import mlflow_store, offline_wandb

        offline_wandb(monkeypatch, tmp_path / "wandb_home")
        common[common.index("tracking=tensorboard")] = "tracking=[tensorboard,mlflow,wandb]"
        common.append(f"tracker.mlflow_uri={mlflow_store(tmp_path_factory, tmp_path / 'mlflow')}")
    runs = {seed: simulate([*common, f"privacy.noise_seed={seed}"], name=f"seed{seed}") for seed in (3, 4)}
    sizes = {
        seed: [r["secret_cohort_clients"] for r in results["outside_guarantee"]["rounds"]]
        for seed, results in runs.items()
    }
    assert sizes[3] != sizes[4], sizes  # the cohorts really differ in size
    for results in runs.values():
        assert all(not set(COHORT_FIELDS) & set(r) for r in results["rounds"])
        assert "failures" not in results["final"] and "upload_bytes_per_client" not in results["final"]
        assert results["outside_guarantee"]["final"]["secret_cohort_upload_bytes_per_client"] > 0
    first, second = (_published(results, Path(results["_output_dir"])) for results in runs.values())
    if backend == "ray":  # each tracker wrote (one that failed would be dropped with a warning)
        assert {"mlflow", "wandb"} <= set(first) and {"mlflow", "wandb"} <= set(second)
    for part in first:
        assert first[part] == second[part], part


def failing_clients(monkeypatch) -> dict[tuple[int, int], bool]:
    """Make a client fail in a round when it succeeded in an earlier one and another already did in this one.

    So every round has a reply and no client fails in all its rounds (the run completes). Patches the
    ClientApp's client lookup (an inline run's clients run in this process): a plain message and a
    packed message's member fail alike. Returns, filled as the run goes, whether each ``(node, round)``
    failed.
    """
    from fl_app import client_app
    from fl_app.learning.records import config_record

    real = client_app.client_for
    fails: dict[tuple[int, int], bool] = {}
    succeeded: dict[int, set[int]] = {}  # round -> nodes

    def client_for(message, context):
        node = int(context.node_id)
        server_round = int(config_record(message.content, keys.CONFIG)[keys.SERVER_ROUND])
        if (node, server_round) not in fails:
            earlier = any(node in succeeded.get(r, ()) for r in range(1, server_round))
            fails[node, server_round] = earlier and bool(succeeded.get(server_round, set()) - {node})
            if not fails[node, server_round]:
                succeeded.setdefault(server_round, set()).add(node)
        if fails[node, server_round]:
            raise RuntimeError(f"client on node {node} fails in round {server_round}")
        return real(message, context)

    monkeypatch.setattr(client_app, "client_for", client_for)
    return fails


def test_a_secret_cohort_run_publishes_no_size_that_tells_its_failures(simulate, monkeypatch):
    """DP-FedAvg (Poisson) with about half of the selected clients failing, against the same run without.

    A mean upload per reply counted the failed clients' empty replies, so it told the failure
    fraction; even a mean over the successful replies follows who replied (a reply's metrics take
    more or fewer bytes). ``final`` holds no size; the diagnostics hold the successful replies' mean,
    the same with and without the failures.
    """
    from conftest import FAST, INLINE

    common = [*FAST, INLINE, "strategy=dp_fedavg", "num_rounds=6", "privacy.diagnostics=true"]
    # one message per client, so the patched client lookup fails members (a bulk share builds no
    # client: its failures and their weighing, tests/test_bulk.py)
    common += ["simulation.max_failure_fraction=1.0", "simulation.bulk=false"]
    healthy = simulate(common, name="healthy")
    fails = failing_clients(monkeypatch)
    failing = simulate(common, name="failing")
    outside = failing["outside_guarantee"]["rounds"]
    failures, replies = (sum(r[f"secret_cohort_{k}"] for r in outside) for k in ("failures", "clients"))
    assert sum(fails.values()) == failures and failures >= 0.25 * replies, (fails, outside)
    assert sum(r["secret_cohort_failures"] for r in healthy["outside_guarantee"]["rounds"]) == 0
    sizes = []
    for results in (healthy, failing):
        assert "upload_bytes_per_client" not in results["final"], results["final"]
        assert "download_bytes_per_client" not in results["final"] and "failures" not in results["final"]
        sizes.append(results["outside_guarantee"]["final"]["secret_cohort_upload_bytes_per_client"])
    assert sizes[0] == sizes[1] > 0, sizes


# ------------------------------------------------ 3b. the server's private state on disk


def _rounds_on_constructed_replies(strategy, rounds: int) -> None:
    arrays = strategy.initial_arrays()
    for t in range(1, rounds + 1):
        messages = list(strategy.configure_train(t, arrays, ConfigRecord(), grid=None))
        replies = [reply_to(m, arrays=zeros_like(arrays)) for m in messages]
        arrays = strategy.aggregate_train(t, replies)[0] or arrays


@pytest.mark.parametrize("name", ["dp_fedavg", "dp_ftrl", "dp_bandmf"])
def test_the_private_state_file_keeps_only_what_resuming_needs(tmp_path, name):
    """No cohort, failure or un-noised statistic of a finished round; owner-only; says what it holds."""
    import stat

    from fl_app.run.checkpoint import CHECKPOINT_FILE, Checkpoint, load_checkpoint, save_checkpoint

    bands = ["strategy.bands=2"] if name == "dp_bandmf" else []
    run = build_run_context([*DIGITS, f"strategy={name}", "num_rounds=3", *bands], tmp_path)
    strategy = STRATEGIES.get(name)(run)
    _rounds_on_constructed_replies(strategy, 3)
    assert strategy.replies.selected(3)  # in memory, the last round's cohort and statistics are there
    checkpoint = Checkpoint(3, 3, "completed", [], "", strategy.initial_arrays(), strategy, {}, 0.0)
    path = save_checkpoint(tmp_path, checkpoint, run)
    assert path.name == CHECKPOINT_FILE == "private_server_state.pkl"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = load_checkpoint(tmp_path, run).strategy
    for attribute in loaded.ROUND_STATE:
        assert not getattr(loaded, attribute), attribute
    assert loaded.replies.selected(3) == [] and loaded.replies.failures(3) == []
    if name == "dp_fedavg":  # the un-noised update norms are gone: nothing un-noised is kept
        assert "_norms" in loaded.ROUND_STATE and loaded._norms == {} and strategy._norms
        assert loaded.declaration.checkpoint_holds is None
    elif name == "dp_bandmf":  # what draws its noise again (no vector): with the models it reveals the sums
        assert strategy.noise._kept and not loaded.noise._kept and not loaded.noise.history
        assert loaded.noise_stream.normals(2, 5).tolist() == strategy.noise_stream.normals(2, 5).tolist()
        assert "noise key" in loaded.declaration.checkpoint_holds
    else:  # DP-FTRL must carry its tree's un-noised running sum to continue exactly, and says so
        assert all(
            np.array_equal(a, b) for a, b in zip(loaded._stream_sum, strategy._stream_sum, strict=True)
        )
        assert "un-noised running sum" in loaded.declaration.checkpoint_holds
    assert loaded.accountant.state_dict() == strategy.accountant.state_dict()


@pytest.mark.simulation
@pytest.mark.parametrize("backend", ["ray", "inline", "processes"])
def test_a_secret_cohorts_failing_client_leaves_nothing_in_run_log(simulate, monkeypatch, backend):
    """A client failing in a secret Poisson cohort: its error goes to the console only, never run.log.

    How often it failed follows the secret coins. The engine (fl_app/engine, Flower's seam) logs a
    failing client's error and traceback on Flower's behalf: those records are withheld like Flower's.
    Inline, the clients run (and log) in the process that writes run.log, and forked workers
    (``processes``) hold its handlers: nothing of theirs gets in.
    """
    from conftest import FAST

    monkeypatch.setenv("DPFL_INJECT_FAILURES", "1")  # client 1 fails whenever it is sampled
    # noise seed 1: client 1 is in round 2's secret cohort with three others, and alone in none (a round
    # whose every client failed would stop the run)
    overrides = [
        *FAST, "strategy=dp_fedavg", "num_rounds=3", "privacy.noise_seed=1", f"simulation.backend={backend}"
    ]  # fmt: skip
    results = simulate(overrides, private_ray=True)
    log = (Path(results["_output_dir"]) / "run.log").read_text()
    assert "secret" in results["privacy"]["randomness"]["cohort"]
    for leaked in ("InjectedFailure", "Traceback", "client 1", "failed"):
        assert leaked not in log, leaked
