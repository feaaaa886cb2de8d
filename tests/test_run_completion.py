"""Runs that always finish: signals as schedulers send them, completion, checked data.

The simulations run ``python -m fl_app`` as a user or a batch system does (``test_reliability.Run``:
a subprocess in its own process group), here also under GNU ``timeout``, which signals the command and
then its whole process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.conftest import FAST, INLINE, wait_until
from tests.test_reliability import GONE_WITHIN_S, RUN, Run, alive, group_processes

# --------------------------------------------------------------------------- 1. signals

#: Seconds after a first stop signal within which a repeat is the same request (fl_app.run.lifecycle).
GRACE = "DPFL_SIGNAL_GRACE_S"


def stop_under_timeout(run: Run) -> tuple[int, list[psutil.Process]]:
    """SIGTERM to GNU ``timeout``, which passes it to the command and then to its process group.

    What ``timeout`` does when its time is up (and ``scancel``, ``docker stop``, a container runtime:
    the command's processes get it, the command itself twice within microseconds). Returns the exit
    status and the processes that were running when the signal was sent.
    """
    processes = [psutil.Process(run.process.pid), *run.descendants()]
    run.process.send_signal(signal.SIGTERM)
    code = run.finish(timeout=180)
    wait_until(lambda: not alive(processes) and not group_processes(run.process.pid), timeout=GONE_WITHIN_S)
    return code, processes


@pytest.mark.simulation
def test_sigterm_from_timeout_to_the_process_group_writes_the_results_and_leaves_nothing(tmp_path):
    """The group's copy of the signal is not a second one that exits at once (which would leave no
    results.json, no last line and Ray's processes orphaned)."""
    out = tmp_path / "run"
    run = Run(
        [*RUN, "num_rounds=50", "strategy=fedavg", f"output_dir={out}"], tmp_path, prefix=("timeout", "600")
    )
    run.wait_for("dpfl round 1/")
    code, processes = stop_under_timeout(run)
    assert alive(processes) == [] and group_processes(run.process.pid) == [], run.output[-3000:]
    assert code == 128 + signal.SIGTERM, run.output[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "interrupted" and results["stopped"]["reason"] == "stopped by SIGTERM"
    assert "Traceback" not in run.output
    assert f"continue with: python -m fl_app resume={out}" in run.output.splitlines()[-1]


@pytest.mark.simulation
def test_sigterm_to_the_command_then_to_its_group_is_one_stop_request(tmp_path, monkeypatch):
    """A scheduler's pattern (the command, then every process of the job): the group's copy, which
    comes after the first message, is no "exit at once". The grace period is set far above the time
    this test takes to react to the message, so the test does not depend on it. The clients run
    inline (the subject is the command's count of signals; Ray's processes under the group's signal
    are the test above's)."""
    monkeypatch.setenv(GRACE, "600")
    out = tmp_path / "run"
    run = Run([*RUN, INLINE, "num_rounds=50", "strategy=dp_fedavg", f"output_dir={out}"], tmp_path)
    run.wait_for("dpfl round 1/")
    processes = [psutil.Process(run.process.pid), *run.descendants()]
    run.process.send_signal(signal.SIGTERM)
    run.wait_for("SIGTERM received")
    os.killpg(run.process.pid, signal.SIGTERM)
    code = run.finish(timeout=180)
    wait_until(lambda: not alive(processes), timeout=GONE_WITHIN_S)
    assert alive(processes) == [], run.output[-3000:]
    assert code == 128 + signal.SIGTERM, run.output[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "interrupted" and results["stopped"]["after_round"] >= 1
    assert "again 600 s or more after this to exit at once" in run.output


def repeat_without_exit(signum: int) -> None:
    """Send ``signum`` to this process again; fail (not abort the session) if it exits at once."""
    try:
        signal.raise_signal(signum)
    except KeyboardInterrupt:
        pytest.fail("a repeat within the grace period exited at once")


def test_a_repeat_within_the_grace_period_is_the_same_request_and_a_later_one_exits_at_once(monkeypatch):
    """The rule of every stop handler: a repeat within the grace period (DPFL_SIGNAL_GRACE_S, default
    2 s) is the first request again; one after it is the user's clear repeat. (SIGINT here: today's
    second SIGTERM would end the test process.)"""
    from fl_app.run import lifecycle

    monkeypatch.setenv(GRACE, "1000")
    try:
        with lifecycle.stop_on_signals():
            signal.raise_signal(signal.SIGINT)
            repeat_without_exit(signal.SIGINT)
            assert lifecycle.stop_requested() == signal.SIGINT
            monkeypatch.setenv(GRACE, "0")
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
    finally:
        lifecycle.STOP.clear()


def test_a_sweeps_command_takes_a_repeat_within_the_grace_period_as_the_same_request(tmp_path, monkeypatch):
    from fl_app.run import lifecycle

    monkeypatch.setenv(GRACE, "1000")
    stop_file = tmp_path / "stop"
    with lifecycle.stop_workers_on_signals(stop_file) as received:
        signal.raise_signal(signal.SIGINT)
        repeat_without_exit(signal.SIGINT)  # the group's copy
        monkeypatch.setenv(GRACE, "0")
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert received == [signal.SIGINT] and stop_file.read_text() == str(int(signal.SIGINT))


@pytest.mark.subprocess
def test_sigterm_twice_between_two_runs_is_one_stop_of_the_command():
    """Between two jobs of a sweep SIGTERM stops the command as Ctrl-C does; the group's copy of it
    ended the process at once (no line saying how to continue the sweep)."""
    script = (
        "import signal, sys\n"
        "from fl_app.run import lifecycle\n"
        "try:\n"
        "    with lifecycle.sigterm_like_ctrl_c():\n"
        "        signal.raise_signal(signal.SIGTERM)\n"
        "except lifecycle.Terminated:\n"
        "    pass\n"
        "with lifecycle.sigterm_like_ctrl_c():\n"
        "    try:\n"
        "        signal.raise_signal(signal.SIGTERM)\n"
        "    except lifecycle.Terminated:\n"
        "        signal.raise_signal(signal.SIGTERM)  # the group's copy\n"
        "print('stopped once')\n"
    )
    env = {**os.environ, GRACE: "1000"}
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0 and result.stdout == "stopped once\n", result


@pytest.mark.simulation
def test_a_parallel_sweep_under_timeout_stops_its_jobs_and_leaves_nothing(tmp_path):
    """``timeout 75`` on a joblib sweep ends without ``TerminatedWorkerError``: a worker that is setting
    a job up must not die of the group's SIGTERM, nor the launcher kill the others. Signalled when the
    first job is done: its worker is then setting its next job up. The jobs run their clients inline
    (the subject is the launcher's workers; six Ray sessions cost a minute of CPU): a run's Ray
    processes under ``timeout`` are checked by the single-run test above."""
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        *FAST,
        INLINE,
        "strategy=fedavg",
        "seed=1,2,3,4,5,6",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        f"hydra.sweep.dir={sweep}",
    ]
    run = Run(args, tmp_path, delay=0.0, prefix=("timeout", "600"))
    try:
        run.wait_for("1/6 jobs done", timeout=300)
        code, processes = stop_under_timeout(run)
        assert alive(processes) == [] and group_processes(run.process.pid) == [], run.output[-3000:]
    finally:
        for process in group_processes(run.process.pid):
            process.kill()
    assert code == 128 + signal.SIGTERM, run.output[-3000:]
    assert "Traceback" not in run.output and "TerminatedWorkerError" not in run.output, run.output[-3000:]
    lines = [line for line in run.output.splitlines() if line.startswith("dpfl sweep: stopped with")]
    assert len(lines) == 1, run.output[-3000:]
    done = [p for p in sweep.glob("*/results.json") if json.loads(p.read_text())["status"] == "completed"]
    assert f"stopped with {len(done)} of 6 jobs done" in lines[0]


# --------------------------------------------------------------------------- 2. a run can always be completed


def test_resume_of_a_run_whose_rounds_are_all_done_is_accepted(tmp_path):
    """``resume=`` of a run stopped after its last round's checkpoint is accepted, not refused with
    ``num_rounds=2: must be > 2`` (a number the user never gave), so its spent budget is not lost."""
    from fl_app.config.compose import compose_config
    from fl_app.config.validation import ConfigError, validate_config
    from fl_app.run.checkpoint import Checkpoint, save_checkpoint
    from strategies import STRATEGIES
    from tests.conftest import build_run_context

    overrides = [*FAST, "strategy=dp_fedavg"]
    run = build_run_context(overrides, tmp_path)
    strategy = STRATEGIES.get("dp_fedavg")(run)
    save_checkpoint(
        tmp_path,
        Checkpoint(
            completed_round=2,
            num_rounds=2,
            status="completed",
            overrides=overrides,
            fingerprint=run.settings.fingerprint(ignore=("num_rounds",)),
            arrays=strategy.initial_arrays(),
            strategy=strategy,
            recorder={"rounds_recorded": 0, "initial": {}, "outside": []},
            elapsed_s=1.0,
        ),
        run,
    )
    validate_config(compose_config([f"resume={tmp_path}"]), check_data=False)
    with pytest.raises(ConfigError, match=r"num_rounds=1: must be >= 2"):
        validate_config(compose_config([f"resume={tmp_path}", "num_rounds=1"]), check_data=False)


@pytest.mark.simulation
def test_a_private_run_killed_before_its_results_is_finished_by_resume(tmp_path, simulate, monkeypatch):
    """The state kill -9 (or a second signal) leaves between the last round's checkpoint and
    results.json: ``resume=`` writes the results, equal to the uninterrupted run's."""
    from fl_app.run import server as run_module
    from fl_app.run.checkpoint import CHECKPOINT_FILE

    monkeypatch.setattr(run_module, "remove_checkpoint", lambda output_dir: None)
    reference = simulate([*FAST, "strategy=dp_fedavg", INLINE], name="run")
    monkeypatch.undo()
    out = tmp_path / "run"
    for name in ("results.json", "final_model.npz", "accuracy_loss.png", "epsilon.png"):
        (out / name).unlink()
    finished = simulate([f"resume={out}"], name="run")
    assert finished["status"] == "completed"
    assert [r["accuracy"] for r in finished["rounds"]] == [r["accuracy"] for r in reference["rounds"]]
    assert finished["final"]["epsilon"] == reference["final"]["epsilon"]
    assert (out / "final_model.npz").exists() and not (out / CHECKPOINT_FILE).exists()
    assert "finishing the run" in (out / "run.log").read_text()


@pytest.mark.simulation
def test_a_sweep_finishes_a_job_stopped_before_its_results_and_counts_only_written_results(tmp_path):
    """Re-running the sweep finishes the job (no ``num_rounds=2: must be > 2``), counts only jobs with
    results (no ``2/2 jobs done`` before they exist), and the report includes the job."""
    sweep = tmp_path / "sweep"
    args = ["-m", *FAST, INLINE, "strategy=fedavg", "seed=1,2", f"hydra.sweep.dir={sweep}"]
    first = Run(args, tmp_path, delay=0.0)
    assert first.finish(timeout=300) == 0, first.output[-3000:]
    (sweep / "1-fedavg" / "results.json").unlink()  # killed after its last checkpoint
    again = Run(args, tmp_path, delay=0.0)
    assert again.finish(timeout=300) == 0, again.output[-3000:]
    assert "job 1: all 2 rounds done" in again.output and "2/2 jobs done" in again.output
    results = json.loads((sweep / "1-fedavg" / "results.json").read_text())
    assert results["status"] == "completed" and len(results["rounds"]) == 2
    results["config"]["seed"] = 9  # the directory now holds another configuration: the job is refused
    (sweep / "1-fedavg" / "results.json").write_text(json.dumps(results))
    refused = Run(args, tmp_path, delay=0.0)
    assert refused.finish(timeout=300) == 2, refused.output[-3000:]
    assert "holds a run of another configuration" in refused.output
    assert "1/2 jobs done" in refused.output and "2/2 jobs done" not in refused.output


# --------------------------------------------------------------------------- 3. data checked at the door


def corrupted_fashion_mnist(tmp_path: Path, row: int, label: int) -> Path:
    """A copy of Fashion-MNIST whose training label ``row`` is ``label`` (the other files linked)."""
    import gzip

    from fl_app.data.sources import DataNotFoundError, find_idx_files, resolve_idx_folder

    try:
        files = find_idx_files(resolve_idx_folder("fashion_mnist", data_dir=None, download=False))
    except DataNotFoundError as missing:
        pytest.skip(str(missing))
    assert files is not None
    folder = tmp_path / "fashion"
    folder.mkdir()
    for stem, path in files.items():
        if stem != "train-labels-idx1-ubyte":
            (folder / path.name).symlink_to(path)
    opener = gzip.open if files["train-labels-idx1-ubyte"].suffix == ".gz" else open
    with opener(files["train-labels-idx1-ubyte"], "rb") as handle:
        raw = bytearray(handle.read())
    raw[8 + row] = label  # an IDX label file: an 8-byte header, then one byte per row
    (folder / "train-labels-idx1-ubyte").write_bytes(bytes(raw))
    return folder


def test_a_label_out_of_range_is_one_line_naming_the_file_and_row_before_anything_starts(tmp_path):
    """One label byte set to 200 is refused in one line before the run starts, not found as an
    ``IndexError: Target 200 is out of bounds`` in every round of its client with exit status 0."""
    from fl_app.config.compose import compose_config
    from fl_app.config.validation import ConfigError, validate_config
    from tests.test_reliability import assert_one_line, preflight_cli

    folder = corrupted_fashion_mnist(tmp_path, row=1234, label=200)
    data = ("dataset=fashion_mnist", f"dataset.data_dir={folder}", "dataset.download=false")
    with pytest.raises(ConfigError, match=r"train-labels-idx1-ubyte: row 1234 .* label 200, outside 0..9"):
        validate_config(compose_config(list(data)))
    result = preflight_cli(*data, "num_clients=2", "clients_per_round=2", cwd=tmp_path)
    assert_one_line(result, "dataset.data_dir=", "train-labels-idx1-ubyte: row 1234", "label 200")
    assert not (tmp_path / "outputs").exists()


def test_device_data_with_nan_is_one_line():
    import numpy as np

    from fl_app.data.federated import ClientDataset
    from fl_app.data.local import check_local_dataset

    x = np.zeros((5, 1, 8, 8), dtype=np.float32)
    x[3, 0, 2, 2] = np.nan
    data = ClientDataset(x, np.zeros(5, dtype=np.int64))
    with pytest.raises(ValueError, match=r"data-path='d.npz': row 3 \(counting from 0\) holds NaN"):
        check_local_dataset(data, "d.npz", input_shape=(1, 8, 8), num_classes=10)


@pytest.mark.simulation
def test_a_client_that_fails_every_round_is_named_on_the_last_line_and_the_exit_status_is_1(
    tmp_path, monkeypatch
):
    """A client failing in every round ends ``completed_with_failures`` with exit status 1 and a last
    line that names it, not ``finished 2 rounds ... final accuracy 0.7311`` alone. With
    DP-FedAvg's secret cohort, run.log (published) still says nothing of them."""
    monkeypatch.setenv("DPFL_INJECT_FAILURES", "1")
    out = tmp_path / "run"
    args = [
        "dataset=digits",
        "num_clients=2",
        "clients_per_round=2",
        "strategy=dp_fedavg",
        f"output_dir={out}",
    ]
    run = Run([*args, INLINE], tmp_path, delay=0.0)
    assert run.finish(timeout=300) == 1, run.output[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "completed_with_failures" and len(results["rounds"]) == 30
    finished = [line for line in run.output.splitlines() if "dpfl: finished 30 rounds" in line]
    assert len(finished) == 1 and "client 1 (30 of 30) failed in every round" in finished[0], run.output[
        -3000:
    ]
    last = run.output.strip().splitlines()[-1]
    assert last.startswith("error: job failed") and "client 1 (30 of 30) failed in every round" in last
    assert "failed in every round" not in (out / "run.log").read_text()
    assert "Traceback" not in run.output


# --------------------------------------------------------------------------- 4. flwr run


def test_a_simulation_with_fewer_supernodes_than_num_clients_fails_at_once(monkeypatch):
    """``flwr run`` with ``num-supernodes=4`` and ``num_clients=5`` fails at once, not after ``Waiting for
    SuperNodes: 4 of 5 (num_clients) connected; giving up in 3599 s``: a simulation's nodes all
    register at once.
    The clock is simulated: the test measures the time the roster would have waited."""
    import types

    from flwr.app import ConfigRecord

    from fl_app.run import roster

    clock = [0.0]
    fake = types.SimpleNamespace(
        monotonic=lambda: clock[0], sleep=lambda s: clock.__setitem__(0, clock[0] + s)
    )
    monkeypatch.setattr(roster, "time", fake)

    class FourNodes:
        def get_node_ids(self) -> list[int]:
            return [11, 12, 13, 14]

    with pytest.raises(roster.RosterError) as refused:
        roster.discover_roster(
            FourNodes(),  # type: ignore[arg-type]
            expected=5,
            config=ConfigRecord({}),
            timeout=3600,
            simulated=lambda: None,
        )
    assert clock[0] < 60, f"waited {clock[0]:.0f} s for nodes a simulation never adds"
    assert "num_clients=5, but the simulation has 4 SuperNodes" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_serverapp_failure_under_flwr_run_is_one_line_without_flowers_traceback():
    """Under ``flwr run`` ``privacy.delta=2`` is dpfl's one line, without a 20-line traceback and
    Flower's four-line exit message after it. Flower's own calls, as ``flwr-simulation`` makes them."""
    import io
    import logging
    from logging import ERROR

    from flwr.common import log

    import fl_app.server_app  # noqa: F401  (the ServerApp module: what flwr run loads)
    from fl_app.run.lifecycle import RunFailed

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger("flwr").addHandler(handler)
    try:
        log(ERROR, "invalid configuration, nothing was run: privacy.delta=2: must be a number in (0.0, 1.0)")
        try:
            raise RunFailed("invalid configuration, nothing was run: privacy.delta=2: ...")
        except RunFailed as failure:
            log(ERROR, "%s raised an exception", "Simulation", exc_info=failure)
        log(ERROR, "Exit Code: 700\nAn unhandled exception occurred.\n\nFor more information, visit: <x>")
    finally:
        logging.getLogger("flwr").removeHandler(handler)
    lines = stream.getvalue().splitlines()
    assert "Traceback" not in stream.getvalue()
    assert len(lines) == 2 and lines[0].startswith("invalid configuration"), lines
    assert lines[1].startswith("Exit Code: 700 (the ServerApp failed"), lines


# --------------------------------------------------------------------------- 5. messages naming the state


def test_the_folder_of_a_run_that_ended_before_its_first_round_is_reused_and_resume_says_so(tmp_path):
    """A folder holding only the run.log of a failed ``flwr run`` may take a new run; ``resume=`` of it
    says the run ended before its first round (not "holds an earlier run ... continue with resume=",
    then "holds no private_server_state.pkl")."""
    from fl_app.config.compose import compose_config
    from fl_app.config.validation import ConfigError, check_output_dir
    from fl_app.run.output_claim import claim_output_dir

    out = tmp_path / "run"
    out.mkdir()
    (out / "run.log").write_text("ERROR invalid configuration, nothing was run\n")
    with pytest.raises(
        ConfigError, match=r"ended before its first round, nothing to continue; start the run"
    ):
        compose_config([f"resume={out}"])
    check_output_dir(compose_config([*FAST, f"output_dir={out}"]))  # a new run may use it
    with claim_output_dir(out, resume=False):
        assert not (out / "run.log").exists()  # the new run's run.log replaces it


@pytest.mark.subprocess
def test_a_folder_in_use_names_the_process_and_resume_of_a_missing_folder_says_no_such_directory(tmp_path):
    """A folder in use by another run names the process (not "holds an earlier run");
    ``resume=/nonexistent`` says no such directory (not that there is no checkpoint)."""
    from fl_app.config.compose import compose_config
    from fl_app.config.validation import ConfigError, check_output_dir
    from fl_app.run.output_claim import LOCK_FILE

    out = tmp_path / "run"
    out.mkdir()
    (out / "run.log").write_text("a run in round 3\n")
    (out / "rounds.jsonl").write_text("{}\n")
    hold = (
        "import fcntl, os, sys, time\n"
        f"fd = os.open({str(out / LOCK_FILE)!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX); os.pwrite(fd, f'{os.getpid()}\\n'.encode(), 0)\n"
        "print('held', flush=True); time.sleep(600)\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        with pytest.raises(ConfigError, match=rf"is in use by another run \(process {holder.pid}\)"):
            check_output_dir(compose_config([*FAST, f"output_dir={out}"]))
    finally:
        holder.kill()
        holder.wait(timeout=60)
    with pytest.raises(ConfigError, match=r"resume='/nonexistent/run': no such directory$"):
        compose_config(["resume=/nonexistent/run"])


# --------------------------------------------------------------------------- 6. stray files, surprises


@pytest.mark.simulation
def test_a_run_into_output_dir_leaves_no_hydra_folder_and_a_nan_loss_is_said_at_once(tmp_path):
    """A run given ``output_dir=`` leaves no empty ``outputs/<date>/<time>-<strategy>/.hydra`` in the
    current directory; a NaN loss is said at once, not shown as ``loss -`` with no word of why."""
    out = tmp_path / "elsewhere" / "run"
    run = Run(
        [*FAST, INLINE, "strategy=fedavg", "lr=1e6", f"output_dir={out}"],
        tmp_path,
        delay=0.0,
    )
    assert run.finish(timeout=300) == 0, run.output[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere"]  # no ./outputs
    assert not (out / ".hydra").exists()
    assert "dpfl round 1/2: accuracy" in run.output and "loss nan (diverged?)" in run.output, run.output[
        -2000:
    ]
    results = json.loads((out / "results.json").read_text())
    assert results["final"]["loss"] is None and results["final"]["diverged"] is True
    assert "this run diverged" in run.output


def test_the_calculator_says_why_a_positive_request_spends_exactly_zero():
    """``dp-fedavg --epsilon 1e-6`` answers ``"epsilon": 0.0``, which reads as a positive epsilon
    rounded to 0: the accountant proves (0, delta) at that noise, and the answer says so."""
    from tests.test_reliability import cli

    args = ("dp-fedavg", "--epsilon", "1e-6", "--delta", "1e-5", "--rate", "0.1", "--rounds", "10")
    answer = json.loads(cli(*args, module="fl_app.privacy").stdout)
    assert answer["epsilon"] == 0.0 and answer["noise_multiplier"] > 1000
    assert "not a rounding" in answer["epsilon_note"] and "(0, delta)-DP" in answer["epsilon_note"]
    assert "epsilon_note" not in json.loads(cli(*args[:2], "1", *args[3:], module="fl_app.privacy").stdout)


@pytest.mark.parametrize("name", ["dp_fedavg", "dp_fedavg_adaptive", "dp_bandmf"])
def test_the_quick_examples_are_reproducible_from_their_seed(name):
    """Their examples set ``privacy.secure_rng: true``, so the README's "at the default seed" numbers could
    not be reproduced (0.703 against 0.739 for dp_bandmf, 55.6)."""
    from fl_app.config.compose import compose_config

    cfg = compose_config(["+experiment=quick", f"strategy={name}"])
    assert cfg.privacy.secure_rng is False and cfg.privacy.noise_seed is None
