"""Sweeps through Hydra's submitit launchers: checked before anything starts, a killed job resumed.

``hydra/launcher=submitit_local`` runs the code path of ``submitit_slurm`` (submitit's executor, one
process per job, the results pickled back) without a cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import FAST, INLINE

from fl_app.__main__ import preflight

#: Loaded at start-up by every Python process of the command (PYTHONPATH): the job whose directory is
#: DPFL_KILL_JOB kills itself with SIGKILL right after its round-1 checkpoint, once (a marker file), as
#: a scheduler's kill, the out-of-memory killer or ``kill -9`` would end it.
KILL_HOOK = """
import importlib.abc, importlib.util, os, signal, sys
from pathlib import Path


class KillAfterRoundOne(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "fl_app.run.reporter":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            save = module.save_checkpoint

            def save_then_die(output_dir, checkpoint, run, writer=None):
                saved = save(output_dir, checkpoint, run)  # written before it returns: then the kill
                marker = Path(os.environ["DPFL_KILL_MARKER"])
                mine = Path(output_dir).name == os.environ["DPFL_KILL_JOB"]
                if mine and checkpoint.completed_round == 1 and not marker.exists():
                    marker.write_text(str(os.getpid()))
                    os.kill(os.getpid(), signal.SIGKILL)
                return saved

            module.save_checkpoint = save_then_die

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("DPFL_KILL_JOB"):
    sys.meta_path.insert(0, KillAfterRoundOne())
"""


def test_a_launcher_this_machine_cannot_run_is_one_line_before_anything_starts(tmp_path, monkeypatch):
    sweep = [*FAST, "seed=1,2"]
    (error,) = preflight(["-m", *sweep, "hydra/launcher=slurm"])
    launchers = "basic, joblib, submitit_local, submitit_slurm"
    assert error == f"hydra/launcher='slurm': must be one of {launchers} (docs/cluster.md)"
    (error,) = preflight([*FAST, "hydra/launcher=submitit_local"])
    assert (
        error
        == "hydra/launcher='submitit_local': launches the jobs of a sweep: add -m (python -m fl_app -m ...)"
    )
    monkeypatch.setenv("PATH", str(tmp_path))  # no Slurm here
    (error,) = preflight(["-m", *sweep, "hydra/launcher=submitit_slurm"])
    assert error.startswith(
        "hydra/launcher='submitit_slurm': needs Slurm's sbatch and srun on PATH, not found"
    )
    for command in ("sbatch", "srun"):  # a login node: Slurm's commands are there
        (tmp_path / command).write_text("#!/bin/sh\nexit 0\n")
        (tmp_path / command).chmod(0o755)
    assert preflight(["-m", *sweep, "hydra/launcher=submitit_slurm"]) == []
    assert preflight(["-m", *sweep, "hydra/launcher=submitit_local"]) == []


@pytest.mark.subprocess
def test_a_submitit_sweep_writes_each_jobs_results_and_its_killed_job_resumes_when_run_again(tmp_path):
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(textwrap.dedent(KILL_HOOK))
    sweep = tmp_path / "sweep"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "hook"), os.environ.get("PYTHONPATH")])),
        "DPFL_KILL_JOB": "1-fedavg",
        "DPFL_KILL_MARKER": str(tmp_path / "killed"),
    }
    command = [sys.executable, "-m", "fl_app", "-m", *FAST, INLINE, "num_rounds=3", "seed=1,2"]
    command += ["hydra/launcher=submitit_local", f"hydra.sweep.dir={sweep}"]
    first = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert first.returncode == 1, first.stderr[-3000:]
    assert (tmp_path / "killed").exists() and "Traceback" not in first.stderr
    lines = first.stderr.splitlines()
    (killed,) = [line for line in lines if line.startswith("error: job 1 ")]
    assert "ended without a result" in killed and str(sweep / ".submitit") in killed
    assert "1 job(s) failed:" in lines
    assert lines[-1].startswith("dpfl sweep: stopped with 1 of 2 jobs done; continue it")
    assert lines[-1].endswith(f"hydra/launcher=submitit_local hydra.sweep.dir={sweep}")
    assert json.loads((sweep / "0-fedavg" / "results.json").read_text())["status"] == "completed"
    assert not (sweep / "1-fedavg" / "results.json").exists()
    assert (sweep / "1-fedavg" / "private_server_state.pkl").exists()  # its round-1 checkpoint

    again = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "error" not in again.stderr and "Traceback" not in again.stderr
    logs = {path.read_text() for path in sweep.glob(".submitit/*/*_log.err")}
    assert any(f"job 0: already completed in {sweep / '0-fedavg'}" in log for log in logs)
    assert any(f"job 1: resuming after round 1 in {sweep / '1-fedavg'}" in log for log in logs)
    for job in ("0-fedavg", "1-fedavg"):
        results = json.loads((sweep / job / "results.json").read_text())
        assert results["status"] == "completed" and [r["round"] for r in results["rounds"]] == [1, 2, 3]
