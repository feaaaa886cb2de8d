"""A sweep's runs have names unique within the sweep in MLflow and W&B: the job's number, its swept values."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
from conftest import FAST, INLINE, settings_of


def test_the_swept_keys_are_those_whose_values_differ_between_jobs():
    from fl_app.run.sweep_names import swept_keys

    jobs = [
        ["strategy=dp_fedavg", "privacy.epsilon=1", "seed=1", "num_rounds=2"],
        ["strategy=dp_fedavg", "privacy.epsilon=4", "seed=1", "num_rounds=2"],
        ["strategy=dp_fedavg", "privacy.epsilon=1", "seed=2", "num_rounds=2", "+strategy.kwargs.eta=0.1"],
    ]
    assert swept_keys(jobs) == ["privacy.epsilon", "seed", "strategy.kwargs.eta"]
    assert swept_keys([jobs[0]]) == []


def test_a_sweeps_job_is_named_by_its_number_and_swept_values():
    from fl_app.run.sweep_names import named_in_sweep, run_name

    settings = settings_of(["dataset=digits", "strategy=dp_fedavg", "label=wide"])
    assert run_name(settings) == "dp_fedavg (wide) seed 42"
    named = named_in_sweep(
        settings, ["strategy=dp_fedavg", "privacy.epsilon=4", "seed=42"], ["privacy.epsilon", "seed"], 3
    )
    assert named.tracker.run_name == "dp_fedavg (wide) seed 42 [job 3: privacy.epsilon=4]"
    assert named.config == settings.config and named.fingerprint() == settings.fingerprint()  # the run's own
    assert named_in_sweep(settings, [], [], 0).tracker.run_name == "dp_fedavg (wide) seed 42 [job 0]"


@pytest.mark.subprocess
def test_the_mlflow_runs_of_an_epsilon_sweep_have_distinct_names(tmp_path):
    """``privacy.epsilon=4,8``: two MLflow runs named by their epsilons (not both ``dp_fedavg seed 42``)."""
    store = tmp_path / "mlruns"
    command = [sys.executable, "-m", "fl_app", "-m", *FAST, INLINE, "strategy=dp_fedavg", "num_rounds=1"]
    command += ["privacy.epsilon=4,8", "tracking=mlflow", f"tracker.mlflow_uri={store.as_uri()}"]
    command.append(f"hydra.sweep.dir={tmp_path / 'sweep'}")
    done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        client = MlflowClient(tracking_uri=store.as_uri())
        (experiment,) = [e for e in client.search_experiments() if e.name == "dpfl"]
        names = sorted(run.info.run_name for run in client.search_runs([experiment.experiment_id]))
    assert names == [
        "dp_fedavg seed 42 [job 0: privacy.epsilon=4]",
        "dp_fedavg seed 42 [job 1: privacy.epsilon=8]",
    ], names
