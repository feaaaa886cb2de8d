"""The ``dpfl`` console command: help from conf/, dispatch to the four programs, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fl_app.cli import config_groups, main_keys, overview

pytestmark = pytest.mark.subprocess  # runs the command in subprocesses: not in the fast tier


ROOT = Path(__file__).resolve().parent.parent


def dpfl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fl_app.cli", *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def test_the_console_script_is_declared():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["dpfl"] == "fl_app.cli:main"
    assert any(dependency.startswith("psutil==") for dependency in project["dependencies"])


def test_help_lists_every_group_option_and_main_key():
    from strategies import STRATEGIES

    text = overview()
    groups = config_groups()
    assert set(STRATEGIES.names()) == set(groups["strategy"])
    for group, options in groups.items():
        assert f"{group}:" in text
        assert all(option in text for option in options)
    keys = {key for key, _, _ in main_keys()}
    assert {"num_clients", "clients_per_round", "num_rounds", "lr", "batch_size", "seed"} <= keys
    assert ":mod:" not in text and "powered by Hydra" not in text


def test_run_help_is_dpfls_not_hydras():
    for args in (("--help",), ("run", "--help"), ()):
        process = dpfl(*args)
        assert process.returncode == 0
        assert process.stdout.startswith("dpfl: differentially private federated learning")


def test_dispatch_and_errors():
    answer = dpfl("privacy", "rr", "--epsilon", "5", "--k", "2", "--classes", "10")
    assert answer.returncode == 0 and json.loads(answer.stdout)["epsilon_per_label"] == 2.5
    unknown = dpfl("nope")
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert len(unknown.stderr.strip().splitlines()) == 1 and "unknown command 'nope'" in unknown.stderr
    typo = dpfl("run", "num_round=3")
    assert typo.returncode == 2 and "did you mean num_rounds" in typo.stderr
    assert "Traceback" not in typo.stderr
    empty = dpfl("report", str(ROOT / "conf"))
    assert empty.returncode == 2 and "no usable results.json" in empty.stderr
    deploy = dpfl("deploy", "status", "--dir", str(ROOT / "conf" / "no-such-deployment"))
    assert deploy.returncode in (0, 1) and "Traceback" not in deploy.stderr


def test_progress_bars_only_for_a_person_at_a_terminal(monkeypatch):
    import fl_app.run.text as run_module
    from fl_app.__main__ import SWEEP_STATE_ENV, SweepState
    from fl_app.run.text import progress_bar

    assert progress_bar(0, 30) == "[" + "-" * 20 + "]"
    assert progress_bar(15, 30) == "[" + "#" * 10 + "-" * 10 + "]"
    assert progress_bar(30, 30) == "[" + "#" * 20 + "]"
    assert progress_bar(7, 0) == "[" + "-" * 20 + "]"
    for at_terminal in (True, False):
        monkeypatch.setattr(run_module, "interactive", lambda at_terminal=at_terminal: at_terminal)
        monkeypatch.delenv(SWEEP_STATE_ENV, raising=False)
        progress = SweepState.create(4)
        try:
            line = progress.job_finished()
            assert line is not None and line.startswith("dpfl sweep: 1/4 jobs done, ")
            assert ("[#####---------------] elapsed" in line) == at_terminal
            # a job in another process (a parallel launcher) finds the same state through the environment
            other = SweepState.current()
            assert other is not None and other.directory == progress.directory
            other.record_failure("job failed (seed=2): boom")
            assert other.job_finished().startswith("dpfl sweep: 2/4 jobs done (1 failed), ")
            assert progress.failures() == ["job failed (seed=2): boom"]
        finally:
            progress.remove()


def test_an_accuracy_no_target_counted_is_not_called_divergence_and_no_best_round_is_said_so():
    from fl_app.run.text import accuracy_text, finished_line

    nan = float("nan")
    assert accuracy_text(nan, 0.43) == "- (no target counted)"  # a vocabulary of no words
    assert accuracy_text(nan, nan) == "nan (diverged?)"
    assert accuracy_text(0.25, 1.2) == "0.25" and accuracy_text(None, None) == "-"
    final = {"wall_s": 10, "accuracy": None, "best_accuracy": None, "best_round": None}
    line = finished_line({"final": final, "rounds": [{}]}, "not private", Path("/out"), "")
    assert "final accuracy - (no round gave an accuracy), not private" in line and "None" not in line
    final = {"wall_s": 10, "accuracy": 0.5, "best_accuracy": 0.6, "best_round": 3}
    line = finished_line({"final": final, "rounds": [{}] * 4}, "not private", Path("/out"), "")
    assert "final accuracy 0.5 (best 0.6 in round 3), not private" in line
