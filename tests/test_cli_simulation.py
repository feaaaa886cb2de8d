"""`python -m fl_app` end to end: multirun, client failures, nothing left running."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FAST, INLINE

pytestmark = pytest.mark.simulation
ROOT = Path(__file__).resolve().parent.parent


def ray_processes_of(driver_pid: int) -> list[str]:
    """Ray processes of the session a driver process started (Ray names it after the driver's pid)."""
    out = subprocess.run(
        ["pgrep", "-af", "raylet|gcs_server|ray::|dashboard"], capture_output=True, text=True
    ).stdout
    pattern = re.compile(rf"session_[0-9_-]+_{driver_pid}\b")
    return [line for line in out.splitlines() if pattern.search(line)]


def tensorboard_scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    """Every scalar TensorBoard reads from ``log_dir``: tag -> step -> value."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_multirun_two_jobs_and_nothing_left_running(tmp_path):
    sweep = tmp_path / "sweep"
    timeline = tmp_path / "sweep.timeline"  # fl_app/run/timeline.py: the phases the command went through
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fl_app",
            "-m",
            *FAST,
            "strategy=fedavg,dp_fedavg",
            "tracking=tensorboard",
            f"hydra.sweep.dir={sweep}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "DPFL_TIMELINE": str(timeline)},
    )
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-3000:]
    results = sorted(sweep.glob("*/results.json"))
    assert len(results) == 2
    loaded = [json.loads(p.read_text()) for p in results]
    assert {r["strategy"] for r in loaded} == {"fedavg", "dp_fedavg"}
    assert all(r["status"] == "completed" and len(r["rounds"]) == 2 for r in loaded)
    for path in results:
        for name in ("metrics.csv", "accuracy_loss.png", "epsilon.png", "final_model.npz", "run.log"):
            assert (path.parent / name).exists(), name
    # one progress line per round and job; Flower's own lines are not duplicated
    log = stderr + stdout
    assert log.count("dpfl round 1/2") == 2
    assert "[ROUND" not in log  # dpfl's round loop prints its own line per round, not Flower's header
    assert ray_processes_of(process.pid) == []
    # no idle Python worker was started ahead of the actors (dpfl_env.py: an idle worker killed at
    # the end of a run could abort and print "Fatal Python error" on the console)
    from ray._common.utils import get_default_ray_temp_dir

    sessions = list(Path(get_default_ray_temp_dir()).glob(f"session_*_{process.pid}"))
    assert sessions, "Ray's session directory of the run was not found"
    assert not [p.name for s in sessions for p in (s / "logs").glob("worker-*-ffffffff-*")]
    # tracking=tensorboard: TensorBoard holds exactly metrics.csv's numbers, round 0 too
    for path, result in zip(results, loaded, strict=True):
        tracked = tensorboard_scalars(path.parent / "tensorboard")
        assert tracked["accuracy"][0] == pytest.approx(result["initial"]["accuracy"])
        for row in result["rounds"]:
            for key in ("accuracy", "loss", "epsilon", "upload_bytes", "round_s"):
                if row.get(key) is not None:
                    assert tracked[key][row["round"]] == pytest.approx(row[key], rel=1e-6), key
        assert ("epsilon" in tracked) == (result["final"]["epsilon"] is not None)
    # The two jobs shared one Ray instance (fl_app.engine.ray_session) but not their client actors: the
    # second job's results equal those of the same job run on its own, round by round.
    phases = [json.loads(line)["phase"] for line in timeline.read_text().splitlines()]
    assert phases.count("ray_init") == 1 and phases.count("server_app") == 2
    assert phases.count("actors_prestarted") == 1  # the first job's, started with Ray
    solo = ["strategy=dp_fedavg", "tracking=tensorboard", f"output_dir={tmp_path / 'alone'}"]
    alone = subprocess.run(
        [sys.executable, "-m", "fl_app", *FAST, *solo],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
    )
    assert alone.returncode == 0, alone.stderr[-3000:]
    on_its_own = json.loads((tmp_path / "alone" / "results.json").read_text())
    (in_sweep,) = [r for r in loaded if r["strategy"] == "dp_fedavg"]
    for key in ("accuracy", "loss", "epsilon"):
        assert [r[key] for r in in_sweep["rounds"]] == [r[key] for r in on_its_own["rounds"]], key
    assert in_sweep["privacy"] == on_its_own["privacy"]
    # ... and the report summarises the two jobs with the numbers of their files.
    from fl_app.report.sweep import main as report

    assert report([str(sweep)]) == 0
    table = {row["algorithm"]: row for row in csv.DictReader((sweep / "report.csv").open())}
    for result in loaded:
        row = table[result["strategy"]]
        assert float(row["accuracy_mean"]) == pytest.approx(result["final"]["accuracy"])
        if result["final"]["epsilon"] is not None:
            assert float(row["epsilon"]) == pytest.approx(result["final"]["epsilon"])


@pytest.mark.parametrize("backend", ["ray", "inline"])
def test_failing_client_does_not_end_the_run(simulate, monkeypatch, backend):
    # Client 1 raises in every round, client 4 in round 2 only; the run completes. (A private Ray:
    # its actors inherit the injection from this process's environment; inline: the clients run in
    # this process, and their errors are reported as an actor's are.)
    monkeypatch.setenv("DPFL_INJECT_FAILURES", "1,4@2")
    results = simulate(
        [
            *FAST,
            "strategy=dp_fedavg",
            "strategy.sampling=fixed",
            "clients_per_round=6",
            "num_rounds=2",
            f"simulation.backend={backend}",
        ],
        private_ray=True,
    )
    assert [r["failures"] for r in results["rounds"]] == [1, 2]
    assert results["status"] == "completed_with_failures" and results["final"]["failures"] == 3
    assert all(r["clients"] == 6 for r in results["rounds"])
    assert results["final"]["accuracy"] is not None
    # Accounting counts the failed clients too: all six were charged in both rounds.
    ledger = json.loads((Path(results["_output_dir"]) / "privacy_ledger.json").read_text())
    assert [len(event["participants"]) for event in ledger["events"]] == [6, 6]
    assert results["rounds"][-1]["epsilon"] > results["rounds"][0]["epsilon"] > 0


#: Hydra's basic launcher (jobs one after another, in this process) and the joblib launcher (jobs in
#: parallel worker processes: the sweep's count and failures must cross processes).
LAUNCHERS = {
    "sequential": [INLINE],
    "parallel": ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2", INLINE],
}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_failed_job_is_reported_and_the_others_run(tmp_path, launcher):
    sweep = tmp_path / "sweep"
    # Job 0: its deadline is 1 ms and no reply can come before 1 s (each client is made to take
    # 1 s more, DPFL_INJECT_DELAY), so its first round fails at run time whatever the machine's
    # speed (it passes validation): none replied; job 1 waits for its clients and runs normally.
    process = subprocess.run(
        [
            sys.executable,
            "-m",
            "fl_app",
            "-m",
            *FAST,
            *LAUNCHERS[launcher],
            "num_rounds=1",
            "strategy=fedavg",
            "simulation.timeout=0.001,600",
            f"hydra.sweep.dir={sweep}",
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=600,
        env={**os.environ, "DPFL_INJECT_DELAY": "1"},
    )
    assert process.returncode == 1, process.stderr[-2000:]
    assert "job failed" in process.stderr
    assert "round 1: none of the 3 clients replied" in process.stderr
    assert json.loads((sweep / "0-fedavg" / "results.json").read_text())["status"] == "failed"
    assert (sweep / "1-fedavg" / "results.json").exists()
    assert "dpfl sweep: 2/2 jobs done (1 failed), elapsed" in process.stderr
    assert process.stderr.count("dpfl sweep: ") == 2 and "1 job(s) failed:" in process.stderr
    if launcher == "sequential":
        assert "dpfl sweep: 1/2 jobs done (1 failed), elapsed" in process.stderr
    # the report reads the tree either launcher wrote: the completed job, not the failed one
    from fl_app.report.sweep import main as report

    assert report([str(sweep)]) == 0
    rows = list(csv.DictReader((sweep / "report.csv").open()))
    assert [row["algorithm"] for row in rows] == ["fedavg"], rows
    assert rows[0]["runs"] == str(sweep / "1-fedavg"), rows


def test_partition_that_leaves_clients_empty_is_bad_input():
    from fl_app.__main__ import preflight

    errors = preflight(
        [
            "dataset=synthetic",
            "dataset.num_train=20",
            "num_clients=19",
            "clients_per_round=2",
            "partition.min_partition_size=0",
        ]
    )
    assert len(errors) == 1
    assert errors[0].startswith("num_clients=19")
