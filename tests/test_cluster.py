"""Sweeps through Hydra's submitit launchers: checked before anything starts, a killed job resumed.

``hydra/launcher=submitit_local`` runs the code path of ``submitit_slurm`` (submitit's executor, one
process per job, the results pickled back) without a cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

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


@pytest.mark.subprocess
def test_ctrl_c_on_a_submitit_sweep_ends_each_job_interrupted_with_its_results_and_no_traceback(tmp_path):
    """Ctrl-C (SIGINT to the command's process group, as a terminal sends it) once both jobs are past
    round 2: each job writes its results as ``interrupted``, the command says so for each and how to
    continue the sweep; submitit's controllers print no traceback and kill no job while it writes."""
    import glob
    import signal
    import time

    import psutil

    sweep = tmp_path / "sweep"
    command = [sys.executable, "-m", "fl_app", "-m", *FAST, INLINE, "num_rounds=1000", "seed=1,2"]
    command += ["hydra/launcher=submitit_local", f"hydra.sweep.dir={sweep}"]
    env = {**os.environ, "DPFL_INJECT_DELAY": "0.05"}  # rounds of about 0.2 s: many before the stop
    process = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip

    def past_round_two() -> int:
        logs = [Path(name).read_text() for name in glob.glob(str(sweep / ".submitit" / "*" / "*_log.err"))]
        return sum("dpfl round 2/1000" in log for log in logs)

    started: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        while past_round_two() < 2 and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.2)
        assert past_round_two() == 2, "the jobs did not reach round 2 in 300 s"
        started = psutil.Process(process.pid).children(recursive=True)
        os.killpg(process.pid, signal.SIGINT)
        output, _ = process.communicate(timeout=180)
        _, left = psutil.wait_procs(started, timeout=30)  # the jobs and their controllers have ended
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        for child in started:  # the jobs' sessions are their own: nothing of theirs may be left
            with contextlib.suppress(psutil.NoSuchProcess):
                if child.is_running():
                    child.kill()
    assert process.returncode == 128 + signal.SIGINT, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    assert "out of memory" not in output and "error:" not in output, output[-3000:]
    assert left == [], [child.cmdline()[:4] for child in left]
    for number, job in enumerate(("0-fedavg", "1-fedavg")):
        results = json.loads((sweep / job / "results.json").read_text())
        after = results["stopped"]["after_round"]
        assert results["status"] == "interrupted" and after >= 2 and len(results["rounds"]) == after
        assert (sweep / job / "private_server_state.pkl").exists()  # resume= continues it
        (line,) = [line for line in output.splitlines() if line.startswith(f"dpfl sweep: job {number} ")]
        assert f"interrupted after round {after}: results in {sweep / job} (its log: " in line
    lines = output.strip().splitlines()
    assert lines[-2] == "dpfl: sweep stopped by SIGINT"
    assert lines[-1].startswith("dpfl sweep: stopped with 0 of 2 jobs done; continue it")
    assert lines[-1].endswith(f"seed=1,2 hydra/launcher=submitit_local hydra.sweep.dir={sweep}")
