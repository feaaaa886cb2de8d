"""The Python API: ``from fl_app import run_experiment`` runs the real simulation and returns its results."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import ray_process_ids

from fl_app.config.validation import ConfigError

TINY = ["dataset=digits", "num_clients=4", "clients_per_round=2", "num_rounds=2", "model=mlp"]


@pytest.mark.simulation
def test_run_experiment_returns_the_results_it_wrote(tmp_path: Path) -> None:
    from fl_app import run_experiment

    before = ray_process_ids()
    results = run_experiment(*TINY, "strategy=dp_fedavg", "privacy.epsilon=4", output_dir=tmp_path / "run")
    assert ray_process_ids() <= before
    written = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["output_dir"] == str((tmp_path / "run").resolve())
    assert {k: v for k, v in results.items() if k != "output_dir"} == written
    assert results["status"] == "completed" and len(results["rounds"]) == 2
    assert results["final"]["epsilon"] == pytest.approx(4.0, abs=0.05)
    assert results["config"]["strategy"]["name"] == "dp_fedavg"
    from fl_app.run.code_version import code_version

    assert results["code"] == code_version() and results["code"]["package"]  # which code ran


def test_a_bad_value_raises_before_anything_is_written(tmp_path: Path) -> None:
    from fl_app import run_experiment

    with pytest.raises(ConfigError) as error:
        run_experiment(*TINY, "privacy.epsilon=-1", output_dir=tmp_path / "bad")
    assert error.value.key == "privacy.epsilon"
    assert not (tmp_path / "bad").exists()


def test_unknown_attribute_of_the_package_is_an_attribute_error() -> None:
    import fl_app

    with pytest.raises(AttributeError, match="run_experimnt"):
        fl_app.run_experimnt  # noqa: B018 - the access is the test


def test_config_error_is_importable_from_the_package_as_the_readme_shows():
    """``from fl_app import ConfigError`` works, as the README shows."""
    from fl_app import ConfigError, run_experiment
    from fl_app.config.checks import ConfigError as DefinedError

    assert ConfigError is DefinedError and callable(run_experiment)
