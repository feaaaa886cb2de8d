"""Experiment trackers: MLflow's and W&B's records of a run, read back through their own API and schema.

The run end to end with a secret cohort (nothing tracked varies with it) is in
tests/test_privacy_soundness.py; here a run's recorder feeds the trackers directly.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
from conftest import settings_of
from tracked import mlflow_run, mlflow_store, offline_wandb, wandb_run

from fl_app.config.compose import compose_config
from fl_app.learning.model_spec import ModelSpec
from fl_app.report.tracking import TrackedRun, Trackers, make_tracker
from fl_app.run.results import RunRecorder

ROUNDS = [
    {"round": 1, "accuracy": 0.4, "loss": 1.5, "epsilon": 0.5, "upload_bytes": 700},
    {"round": 2, "accuracy": 0.6, "loss": 1.1, "epsilon": 0.75, "upload_bytes": 700},
]
PRIVACY = {
    "unit": "one client's entire data set",
    "mechanism": "Gaussian noise on the sum of clipped model updates",
    "accountant": "rdp",
    "total": {"epsilon": 0.75},
}
RUN_FILES = ["accuracy_loss.png", "config.yaml", "epsilon.png", "metrics.csv", "results.json"]


def record_run(out: Path, tracking: list[str], *, secret: bool = False, resumed: bool = False, **keys: str):
    """A two-round dp_fedavg run's records, through a RunRecorder with the trackers ``tracking`` names."""
    overrides = [
        "dataset=digits",
        "strategy=dp_fedavg",
        *(f"{k.replace('__', '.')}={v}" for k, v in keys.items()),
    ]
    settings = settings_of(overrides)
    tracked = TrackedRun("dp_fedavg seed 42", dict(settings.config), settings.tracker, resumed=resumed)
    tracker = make_tracker(tracking, out, config_text=settings.to_yaml(), secret_cohort=secret, run=tracked)
    recorder = RunRecorder(out, settings, tracker=tracker)
    recorder.add_initial({"accuracy": 0.1, "loss": 2.3})
    for row in ROUNDS:
        recorder.add_round(dict(row))
    results = recorder.finalize(
        strategy="dp_fedavg",
        privacy=PRIVACY,
        final_extras={},
        arrays=None,
        model_spec=ModelSpec("mlp", (1, 8, 8), 10),
        ledger=None,
        wall_s=3.0,
    )
    return results, tracker


def test_mlflow_keeps_the_parameters_rounds_final_results_and_files_of_a_run(tmp_path, tmp_path_factory):
    out = tmp_path / "run"
    uri = mlflow_store(tmp_path_factory, tmp_path / "store")
    results, _ = record_run(out, ["mlflow"], tracker__mlflow_uri=uri)
    tracked = mlflow_run(out)
    assert tracked["info"].status == "FINISHED" and tracked["info"].run_name == "dp_fedavg seed 42"
    assert tracked["params"]["strategy.name"] == "dp_fedavg"
    assert tracked["params"]["privacy.epsilon"] == str(results["config"]["privacy"]["epsilon"])
    assert tracked["params"]["dataset.name"] == "digits" and tracked["params"]["output_dir"] == "null"
    assert [(s, v) for s, v, _ in tracked["metrics"]["accuracy"]] == [(0, 0.1), (1, 0.4), (2, 0.6)]
    assert [(s, v) for s, v, _ in tracked["metrics"]["epsilon"]] == [(1, 0.5), (2, 0.75)]
    assert tracked["metrics"]["final.accuracy"][0][:2] == (2, 0.6)
    assert tracked["metrics"]["privacy.total.epsilon"][0][:2] == (2, 0.75)
    assert (
        tracked["tags"]["dpfl.status"] == "completed"
        and tracked["tags"]["dpfl.privacy.unit"] == PRIVACY["unit"]
    )
    assert tracked["artifacts"] == RUN_FILES
    kept = sorted(p.name for p in (tmp_path / "store" / "mlartifacts").rglob("*") if p.is_file())
    assert kept == RUN_FILES  # beside the SQLite file
    assert (tmp_path / "store" / "mlartifacts").rglob("results.json").__next__().read_text() == (
        out / "results.json"
    ).read_text()
    stamps = {stamp for history in tracked["metrics"].values() for _, _, stamp in history}
    assert len(stamps) > 1  # a run whose cohort is public: each metric when it was logged


def test_mlflow_puts_the_jobs_of_a_sweep_in_one_store_and_continues_a_resumed_run(
    tmp_path, tmp_path_factory, monkeypatch
):
    from fl_app.report.tracking_mlflow import store_of

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert store_of(None)[0] == f"sqlite:///{tmp_path / 'mlflow.db'}"  # MLflow's default, made absolute
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    assert store_of(None) == ("http://127.0.0.1:5000", None, None)
    uri = mlflow_store(tmp_path_factory, tmp_path / "sweep")
    record_run(tmp_path / "sweep" / "0-dp_fedavg", ["mlflow"], seed="1", tracker__mlflow_uri=uri)
    record_run(tmp_path / "sweep" / "1-dp_fedavg", ["mlflow"], seed="2", tracker__mlflow_uri=uri)
    first, second = (mlflow_run(tmp_path / "sweep" / name) for name in ("0-dp_fedavg", "1-dp_fedavg"))
    assert first["info"].experiment_id == second["info"].experiment_id
    assert first["info"].run_id != second["info"].run_id
    assert first["params"]["seed"] == "1" and second["params"]["seed"] == "2"
    resumed = ["mlflow"]  # resume=: the same MLflow run goes on
    record_run(tmp_path / "sweep" / "1-dp_fedavg", resumed, seed="2", tracker__mlflow_uri=uri, resumed=True)
    assert mlflow_run(tmp_path / "sweep" / "1-dp_fedavg")["info"].run_id == second["info"].run_id


def test_a_secret_cohorts_metrics_all_carry_the_moment_the_tracker_was_made(tmp_path, tmp_path_factory):
    out = tmp_path / "run"
    uri = mlflow_store(tmp_path_factory, tmp_path / "store")
    record_run(out, ["mlflow"], secret=True, tracker__mlflow_uri=uri)
    tracked = mlflow_run(out)
    stamps = {stamp for history in tracked["metrics"].values() for _, _, stamp in history}
    assert stamps == {tracked["info"].start_time}


@pytest.mark.subprocess  # W&B's core runs as a service process
def test_wandb_offline_writes_its_run_files_and_a_secret_cohorts_run_only_at_its_end(tmp_path, monkeypatch):
    offline_wandb(monkeypatch, tmp_path / "wandb_home")
    out = tmp_path / "public"
    record_run(out, ["wandb"])
    run = wandb_run(out)
    assert run["config"]["strategy"]["name"] == "dp_fedavg"
    rows = [row for row in run["history"] if "accuracy" in row]
    assert [(row["_step"], row["accuracy"]) for row in rows] == [(0, 0.1), (1, 0.4), (2, 0.6)]
    assert [row.get("epsilon") for row in rows] == [None, 0.5, 0.75]
    assert run["summary"]["final.accuracy"] == 0.6 and run["summary"]["status"] == "completed"
    assert run["summary"]["privacy.total.epsilon"] == 0.75
    assert set(RUN_FILES) <= set(run["files"])
    assert any(name.startswith("media/images/plots/accuracy_loss") for name in run["files"])

    secret = tmp_path / "secret"
    settings = settings_of(["dataset=digits", "strategy=dp_fedavg"])
    tracker = make_tracker(
        ["wandb"],
        secret,
        config_text="",
        secret_cohort=True,
        run=TrackedRun("x", dict(settings.config), settings.tracker),
    )
    tracker.log_round({"round": 1, "accuracy": 0.4})
    assert not (secret / "wandb").exists()  # nothing is written while the rounds run
    tracker.close()
    record_run(secret, ["wandb"], secret=True)
    rows = [row for row in wandb_run(secret)["history"] if "accuracy" in row]
    assert len(rows) == 3 and len({row["_timestamp"] for row in rows}) == 1


def test_tracking_takes_several_trackers_and_refuses_what_it_cannot_do(monkeypatch):
    from fl_app.config.validation import ConfigError, typed_settings, validate_common

    settings = typed_settings(compose_config(["dataset=digits", "tracking=[tensorboard,mlflow,mlflow]"]))
    assert settings.tracking == ("tensorboard", "mlflow")
    assert typed_settings(compose_config(["dataset=digits"])).tracking == ()
    bad = {
        "tracking=neptune": r"tracking='neptune': must be one of none, tensorboard, mlflow, wandb$",
        "tracking=[]": r"tracking=.*must be one of none, tensorboard, mlflow, wandb, or a list of them",
        "tracker.wandb_mode=cloud": r"tracker.wandb_mode='cloud': must be one of offline, online",
        "tracker.experiment=''": r"tracker.experiment='': must be a one-line name",
    }
    for override, message in bad.items():
        with pytest.raises(ConfigError, match=message):
            validate_common(compose_config(["dataset=digits", override]))
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"tracking='mlflow': needs the mlflow package.*mlflow-skinny"):
        validate_common(compose_config(["dataset=digits", "tracking=[tensorboard,mlflow]"]))


def test_a_failing_tracker_is_dropped_with_one_warning_and_the_others_go_on(caplog):
    class Broken:
        def log_round(self, record):
            raise OSError("disk full")

    class Kept:
        def __init__(self):
            self.rounds = []

        def log_round(self, record):
            self.rounds.append(record["round"])

    kept = Kept()
    trackers = Trackers({"mlflow": Broken(), "tensorboard": kept})
    logging.getLogger("flwr").addHandler(caplog.handler)
    try:
        trackers.log_round({"round": 1})
        trackers.log_round({"round": 2})
    finally:
        logging.getLogger("flwr").removeHandler(caplog.handler)
    assert kept.rounds == [1, 2] and list(trackers.trackers) == ["tensorboard"]
    warnings = {r.getMessage() for r in caplog.records if r.levelno == logging.WARNING}
    assert warnings == {"dpfl: tracking=mlflow stopped (OSError: disk full); the run goes on"}
