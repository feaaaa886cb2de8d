"""How runs end: interrupts, lost workers, failures, checkpoints and resume, and bad input.

The simulations here run ``python -m fl_app`` as a user does (a subprocess in its own
process group, so a signal reaches it as a Ctrl-C in a terminal would) with
``DPFL_INJECT_DELAY`` making every client take half a second, so a signal lands mid-run.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import settings_of
from omegaconf import OmegaConf

from fl_app.config.compose import compose_config
from fl_app.config.validation import ConfigError, check_output_dir, validate_config
from fl_app.engine.batching import BatchingActor
from fl_app.run.checkpoint import CHECKPOINT_FILE, load_checkpoint, read_header
from fl_app.run.lifecycle import RunFailed
from fl_app.run.log import one_line_console
from fl_app.run.round_loop import check_round
from strategies import STRATEGIES
from tests.conftest import FAST, INLINE, TWO_ACTORS, build_run_context, wait_until

RUN = [*FAST, "num_rounds=4", "simulation.num_cpus=2"]
ROUND_KEYS = ("round", "accuracy", "loss", "epsilon", "upload_bytes", "download_bytes", "clients", "failures")


class Run:
    """A ``python -m fl_app`` subprocess whose output is read as it comes."""

    def __init__(
        self, args: list[str], cwd: Path, *, delay: float = 0.5, prefix: tuple[str, ...] = ()
    ) -> None:
        env = {**os.environ, "DPFL_INJECT_DELAY": str(delay)}
        self.process = subprocess.Popen(
            [*prefix, sys.executable, "-m", "fl_app", *args],  # prefix: a wrapper such as GNU timeout
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its own process group, like a job in a terminal
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return
            if self.process.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{text!r} did not appear:\n{''.join(self.lines[-30:])}")

    def descendants(self) -> list[psutil.Process]:
        return psutil.Process(self.process.pid).children(recursive=True)

    def finish(self, timeout: float) -> int:
        code = self.process.wait(timeout=timeout)
        self.reader.join(timeout=5)
        return code

    @property
    def output(self) -> str:
        return "".join(self.lines)


def alive(processes: list[psutil.Process]) -> list[str]:
    """Those of ``processes`` still running (not zombies)."""
    left = []
    for process in processes:
        try:
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{process.pid} {process.name()}")
        except psutil.NoSuchProcess:
            pass
    return left


def rounds_of(results: dict) -> list[tuple]:
    """The rounds' published fields (a secret Poisson cohort publishes no counts or bytes: None)."""
    return [tuple(r.get(k) for k in ROUND_KEYS) for r in results["rounds"]]


#: Seconds within which every process of a stopped run must be gone.
GONE_WITHIN_S = 5.0


def interrupt(tmp_path: Path, name: str, args: list[str], signum: int, *, group: bool) -> tuple[Run, float]:
    """Start a run, signal it once round 1 is reported; return it and the seconds it took to exit."""
    run = Run([*args, f"output_dir={tmp_path / name}"], tmp_path)
    run.wait_for("dpfl round 1/")
    processes = [psutil.Process(run.process.pid), *run.descendants()]
    sent = time.monotonic()
    if group:
        os.killpg(run.process.pid, signum)
    else:
        run.process.send_signal(signum)
    code = run.finish(timeout=60)
    took = time.monotonic() - sent
    wait_until(lambda: not alive(processes), timeout=GONE_WITHIN_S)
    assert alive(processes) == [], run.output[-2000:]
    assert code == 128 + signum, run.output[-3000:]
    return run, took


# --------------------------------------------------------------------------- simulations


@pytest.mark.simulation
def test_ctrl_c_stops_within_seconds_keeps_the_ledger_and_resume_matches_an_uninterrupted_run(
    tmp_path, simulate
):
    args = [*RUN, "strategy=dp_fedavg"]
    run, took = interrupt(tmp_path, "stopped", args, signal.SIGINT, group=True)
    assert took < 30
    out = tmp_path / "stopped"
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "interrupted"
    done = results["stopped"]["after_round"]
    assert 1 <= done < 4 and len(results["rounds"]) == done
    assert results["stopped"]["resume"] == f"python -m fl_app resume={out}"
    ledger = json.loads((out / "privacy_ledger.json").read_text())
    assert len(ledger["events"]) == done  # every round whose noise was released
    assert read_header(out)["completed_round"] == done
    assert "Traceback" not in run.output
    assert f"continue with: python -m fl_app resume={out}" in run.output
    # the server's private state: named for it, readable by its owner only, and the line says so
    state = out / CHECKPOINT_FILE
    assert state.name == "private_server_state.pkl" and stat.S_IMODE(state.stat().st_mode) == 0o600
    assert f"{state} is the server's private state" in run.output
    assert "never publish it" in results["stopped"]["private_state"]

    # A private run keeps the rounds its noise was calibrated for, and nothing else may change.
    with pytest.raises(ConfigError, match=r"num_rounds=6: must stay 4"):
        validate_config(compose_config([f"resume={out}", "num_rounds=6"]), check_data=False)
    with pytest.raises(ConfigError, match=r"only num_rounds and simulation"):
        compose_config([f"resume={out}", "lr=0.5"])

    # resumed with its clients inline (a resume may change simulation.*): the rounds equal across
    # backends, and the interrupted run above is the one whose Ray processes had to stop
    resumed = Run([f"resume={out}", INLINE], tmp_path, delay=0.0)  # nothing to stop
    assert resumed.finish(timeout=300) == 0, resumed.output[-3000:]
    assert f"resuming after round {done}" in resumed.output
    continued = json.loads((out / "results.json").read_text())
    assert continued["status"] == "completed" and "stopped" not in continued
    assert not (out / CHECKPOINT_FILE).exists()  # a completed private run keeps no server state

    reference = simulate([*args, INLINE], name="uninterrupted")
    assert rounds_of(continued) == rounds_of(reference)
    assert continued["final"]["epsilon"] == reference["final"]["epsilon"]
    assert (
        continued["privacy"]["randomness"]["noise_seed"] == reference["privacy"]["randomness"]["noise_seed"]
    )


@pytest.mark.simulation
def test_sigterm_stops_the_run_and_leaves_nothing_running(tmp_path):
    run, took = interrupt(tmp_path, "terminated", [*RUN, "strategy=fedavg"], signal.SIGTERM, group=False)
    assert took < 30
    # the run's last line says how it ended once (the command printed it again in its own words)
    assert sum("dpfl: run interrupted" in line for line in run.lines) == 1, run.output[-3000:]
    results = json.loads((tmp_path / "terminated" / "results.json").read_text())
    assert results["status"] == "interrupted" and results["stopped"]["reason"] == "stopped by SIGTERM"
    # A non-private run can be extended beyond its planned rounds.
    cfg = compose_config([f"resume={tmp_path / 'terminated'}", "num_rounds=9"])
    validate_config(cfg, check_data=False)
    assert cfg.num_rounds == 9 and cfg.strategy.name == "fedavg" and cfg.dataset.name == "digits"


@pytest.mark.simulation
def test_a_killed_worker_fails_the_run_with_one_line_never_completed(tmp_path):
    out = tmp_path / "killed"
    run = Run([*RUN, TWO_ACTORS, "strategy=fedavg", "num_rounds=6", f"output_dir={out}"], tmp_path)
    run.wait_for("dpfl round 1/")
    actors = [p for p in run.descendants() if BatchingActor.__name__ in p.name()]
    assert len(actors) == 2
    actors[0].kill()
    code = run.finish(timeout=300)
    assert code == 1, run.output[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "failed"
    assert "Traceback" not in run.output
    errors = [line for line in run.output.splitlines() if line.startswith("error: job failed")]
    assert len(errors) == 1 and "simulation worker (Ray actor) died" in errors[0]


# --------------------------------------------------------------------------- units


@pytest.mark.parametrize(
    ("clients", "failures", "reasons", "message"),
    [
        (3, 3, ["boom"], "none of the 3 clients replied"),
        (4, 3, ["x"], "3 of 4 clients failed, more than simulation.max_failure_fraction=0.5"),
        (10, 1, ["ray.exceptions.ActorDiedError: The actor died"], "simulation worker"),
    ],
)
def test_round_health_fails_the_run(clients, failures, reasons, message):
    with pytest.raises(RunFailed, match=message):
        check_round(7, clients=clients, failures=failures, reasons=reasons, max_failure_fraction=0.5)


def test_round_health_accepts_failures_within_the_fraction_and_empty_cohorts():
    check_round(1, clients=4, failures=2, reasons=["x", "y"], max_failure_fraction=0.5)
    check_round(1, clients=0, failures=0, reasons=[], max_failure_fraction=0.5)  # empty Poisson cohort


def test_console_shows_a_client_failure_as_one_line():
    record = logging.LogRecord(
        "flwr", logging.ERROR, "", 0, "Traceback (most recent call last):\n  x", (), None
    )
    assert one_line_console(record) is False
    record = logging.LogRecord("flwr", logging.ERROR, "", 0, "The actor died.\n\tclass_name: X", (), None)
    assert one_line_console(record) is True and record.getMessage() == "The actor died."


def test_checkpoint_rebinds_clients_and_context_to_the_resumed_run(tmp_path):
    from fl_app.run.checkpoint import Checkpoint, save_checkpoint

    overrides = [*FAST, "strategy=fedavg_ldp"]  # its planned schedule holds roster entries
    run = build_run_context(overrides, tmp_path)
    strategy = STRATEGIES.get("fedavg_ldp")(run)
    strategy.cohorts.planned[1] = run.roster[:3]
    strategy.replies.record_selected(1, run.roster[:3])  # the round's cohort: not written
    save_checkpoint(
        tmp_path,
        Checkpoint(
            completed_round=1,
            num_rounds=2,
            status="incomplete",
            overrides=overrides,
            fingerprint="f",
            arrays=strategy.initial_arrays(),
            strategy=strategy,
            recorder={},
            elapsed_s=1.0,
        ),
        run,
    )
    # The resumed simulation registers its nodes under new ids.
    other = build_run_context(overrides, tmp_path)
    other.roster[:] = [type(c)(c.client_id, c.node_id + 500, c.num_examples) for c in other.roster]
    restored = load_checkpoint(tmp_path, other).strategy
    assert restored.run is other and restored.run.settings is other.settings
    assert [c.node_id for c in restored.cohorts.planned[1]] == [1500, 1501, 1502]
    assert restored.replies.selected(1) == [] and strategy.replies.selected(1)  # the original keeps it
    assert restored.noise_multiplier == strategy.noise_multiplier


def test_checkpoint_size_does_not_grow_with_the_rounds(tmp_path):
    """Per-round state is kept for the latest rounds only: the checkpoint written after every
    round must not grow with the run (it did: every round's cohort was pickled again)."""
    from flwr.app import ConfigRecord

    from fl_app.run.checkpoint import Checkpoint, save_checkpoint

    overrides = [*FAST, "strategy=fedavg", "num_rounds=40"]  # 3 clients every round (no Poisson draw)
    run = build_run_context(overrides, tmp_path)
    strategy = STRATEGIES.get("fedavg")(run)
    arrays = strategy.initial_arrays()
    sizes = {}
    for server_round in range(1, 41):
        messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), None))
        assert messages  # a cohort was selected and remembered
        if server_round in (4, 40):
            checkpoint = Checkpoint(
                completed_round=server_round,
                num_rounds=40,
                status="incomplete",
                overrides=overrides,
                fingerprint="f",
                arrays=arrays,
                strategy=strategy,
                recorder={},
                elapsed_s=1.0,
            )
            sizes[server_round] = save_checkpoint(tmp_path, checkpoint, run).stat().st_size
    assert abs(sizes[40] - sizes[4]) < 200, sizes
    assert len(strategy.replies.selected(40)) == len(messages) and strategy.replies.selected(1) == []


def test_recent_rounds_keeps_the_latest_rounds_only():
    from strategies.base import RecentRounds

    store = RecentRounds()
    for server_round in range(1, 6):
        store[server_round] = server_round * 10
    assert dict(store) == {4: 40, 5: 50}
    store[5] = 55  # a round's entry may be replaced
    assert dict(store) == {4: 40, 5: 55}


def test_resume_of_a_directory_without_checkpoint_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"resume=.*holds no private_server_state.pkl"):
        compose_config([f"resume={tmp_path}"])


def test_a_new_run_refuses_a_directory_with_an_earlier_run(tmp_path):
    (tmp_path / "results.json").write_text("{}")
    cfg = compose_config([*FAST, f"output_dir={tmp_path}"])
    with pytest.raises(
        ConfigError, match=r"holds an earlier run that ended \(results.json; nothing to continue\)"
    ):
        check_output_dir(cfg)


# --------------------------------------------------------------------------- bad input (one line, rc 2)


def cli(*args: str, module: str = "fl_app", cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m <module> args`` in a new process (as a user runs it)."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120, cwd=cwd
    )


def preflight_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m fl_app args`` run in this process, for input the preflight refuses.

    The command's own code from ``main()`` on, without a new interpreter (about 3 s of CPU each:
    ``tests/test_config.py`` runs the real process for a sample of bad values).
    """
    import contextlib
    import io

    from fl_app.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    argv, here = sys.argv, Path.cwd()
    sys.argv = ["fl_app", *args]
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main()
    finally:
        sys.argv = argv
        os.chdir(here)
    return subprocess.CompletedProcess(["fl_app", *args], code, out.getvalue(), err.getvalue())


def assert_one_line(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_bad_output_dirs_are_refused_before_anything_starts(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    result = preflight_cli(*FAST, f"output_dir={blocker / 'run'}", cwd=tmp_path)
    assert_one_line(result, "output_dir=", "is a file, not a directory")
    assert not (tmp_path / "outputs").exists()  # nothing half-written (no Hydra directory either)
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        result = preflight_cli(*FAST, f"output_dir={locked / 'run'}", cwd=tmp_path)
        assert_one_line(result, "no write permission")


def test_iid_partition_with_more_clients_than_examples_is_one_line(tmp_path):
    result = preflight_cli(*FAST, "partition=iid", "num_clients=5000", "clients_per_round=3", cwd=tmp_path)
    assert_one_line(result, "num_clients=5000", "too many clients")


def test_a_truncated_data_file_is_one_line(tmp_path):
    import gzip

    folder = tmp_path / "mnist"
    folder.mkdir()
    images = gzip.compress(bytes([0, 0, 8, 3]) + (60000).to_bytes(4, "big") + (28).to_bytes(4, "big") * 2)
    (folder / "train-images-idx3-ubyte.gz").write_bytes(images[: len(images) // 2])
    for stem in ("train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        (folder / f"{stem}.gz").write_bytes(gzip.compress(b"\0\0\x08\x01\0\0\0\0"))
    data = ("dataset=mnist", f"dataset.data_dir={folder}", "dataset.download=false")
    result = preflight_cli(*data, cwd=tmp_path)
    assert_one_line(result, "dataset.data_dir=", "truncated or corrupt", "fl_app.data.fetch")


@pytest.mark.parametrize(
    ("argument", "fragments"),
    [
        ("+foo=1", ("foo='1': unknown key",)),
        ("+num_round=3", ("num_round='3': unknown key (did you mean num_rounds?)",)),
        ("num_round=3", ("did you mean num_rounds?",)),
        ("strategy=fedavgg", ("strategy='fedavgg': unknown strategy (did you mean fedavg?)", "dp_fedavg")),
        ("resume=/nonexistent/run", ("resume='/nonexistent/run': no such directory",)),
    ],
)
def test_unknown_keys_and_names_are_one_line_with_a_did_you_mean(tmp_path, argument, fragments):
    assert_one_line(preflight_cli(argument, cwd=tmp_path), *fragments)
    assert not (tmp_path / "outputs").exists()


def test_the_calculator_prints_strict_json_or_one_line():
    big = cli("rr", "--epsilon", "800", "--k", "2", "--classes", "10", module="fl_app.privacy")
    assert big.returncode == 0 and json.loads(big.stdout)["beta"] == 1.0
    tiny = cli("laplace", "--tau", "1e-320", "--prob", "0.5", module="fl_app.privacy")
    assert tiny.returncode == 2 and tiny.stdout == "" and "not a finite number (epsilon=inf)" in tiny.stderr


def test_a_gone_supernode_is_reported_as_that_client_failing():
    # The SuperLink answers a message for a vanished SuperNode itself (sender: the SuperLink).
    from fl_app.engine.messages import LINK_NODE_ID, set_message_id, set_reply_source
    from fl_app.engine.metering import attribute_link_errors
    from tests.conftest import error_reply, make_message

    message = make_message({}, node_id=1005)
    set_message_id(message, "m-1005")
    reply = error_reply(message, "node unavailable")
    set_reply_source(reply, LINK_NODE_ID)
    healthy = error_reply(make_message({}, node_id=1006), "client crashed")
    attribute_link_errors([message], [reply, healthy])
    assert reply.metadata.src_node_id == 1005
    assert healthy.metadata.src_node_id == 1006


def test_a_resumed_run_saves_the_overrides_it_was_composed_from(tmp_path, monkeypatch):
    """Saving ``resume=DIR`` alone made a second resume of the same run compose the defaults."""
    from fl_app.run import checkpoint
    from fl_app.run.resume import checkpoint_overrides

    header = {"overrides": ["strategy=fedavg", "seed=3", f"output_dir={tmp_path}"]}
    monkeypatch.setattr(checkpoint, "read_header", lambda directory: header)
    saved = checkpoint_overrides([f"resume={tmp_path}", "simulation.num_cpus=2"])
    assert saved == ["strategy=fedavg", "seed=3", "simulation.num_cpus=2"]
    assert checkpoint_overrides(["strategy=fedavg", f"output_dir={tmp_path}"]) == ["strategy=fedavg"]


def test_a_round_that_breaks_the_failure_rule_is_neither_recorded_nor_checkpointed(tmp_path, monkeypatch):
    """The failure rule is checked before the round's checkpoint: a resumed run never continues from
    a degraded model to end ``completed_with_failures``."""
    from dataclasses import replace

    from fl_app.run.reporter import RoundReporter
    from fl_app.run.results import RunRecorder

    run = build_run_context([*FAST, "strategy=fedavg", "num_rounds=3"], tmp_path)
    strategy = STRATEGIES.get("fedavg")(run)
    arrays = strategy.initial_arrays()
    healthy = strategy.report_round(1)

    class Grid:
        def take(self) -> dict[str, float]:
            return {}

    reports = iter(
        [
            replace(healthy, clients=4),
            replace(healthy, clients=4, failures=(1, 2, 3), failure_reasons=("x",) * 3),
        ]
    )
    monkeypatch.setattr(type(strategy), "report_round", lambda self, server_round: next(reports))
    recorder = RunRecorder(run.output_dir, run.settings)
    test = run.data.test()
    reporter = RoundReporter(
        strategy, Grid(), recorder, test.x, test.y, num_rounds=3, every=1, max_failure_fraction=0.5
    )
    reporter(1, arrays)
    reporter.checkpointer.settle()  # written while the next round runs: wait for it
    assert read_header(run.output_dir)["completed_round"] == 1
    with pytest.raises(RunFailed, match="3 of 4 clients failed"):
        reporter(2, arrays)
    reporter.checkpointer.settle()
    assert read_header(run.output_dir)["completed_round"] == 1  # resume repeats round 2
    assert [r["round"] for r in recorder.rounds] == [1] and reporter.completed_round == 1


def test_a_second_run_into_a_claimed_output_dir_is_one_line_and_writes_nothing(tmp_path):
    """A second run into a claimed directory stops with one line and never writes into it."""
    from fl_app.run.output_claim import LOCK_FILE, claim_output_dir

    out = tmp_path / "run"
    with claim_output_dir(out, resume=False):  # a run that has not written a file yet
        result = cli(*FAST, f"output_dir={out}", cwd=tmp_path)
        assert_one_line(result, f"output_dir='{out}'", f"is in use by another run (process {os.getpid()})")
        assert sorted(p.name for p in out.iterdir()) == [LOCK_FILE]
        with claim_output_dir(out, resume=False):  # the same process (its ServerApp) may claim again
            pass
    with claim_output_dir(out, resume=False):  # released: free again (the lock file stays)
        (out / "results.json").write_text("{}")
    with pytest.raises(ConfigError, match="holds an earlier run"), claim_output_dir(out, resume=False):
        pass
    with claim_output_dir(out, resume=True):
        pass


@pytest.mark.simulation
def test_an_interrupted_sweep_continues_into_its_directory(tmp_path):
    """Running a stopped sweep again skips its completed jobs and resumes the stopped one;
    the stopped job is not counted as done, and the line to continue the sweep is printed."""
    sweep = tmp_path / "sweep"
    args = ["-m", *FAST, INLINE, "num_rounds=3", "strategy=fedavg", "seed=1,2", f"hydra.sweep.dir={sweep}"]
    run = Run(args, tmp_path)
    run.wait_for("1/2 jobs done")
    run.wait_for("dpfl round 1/3: accuracy")
    while run.output.count("dpfl round 1/3: accuracy") < 2:
        run.wait_for("dpfl round")
        time.sleep(0.1)
    os.killpg(run.process.pid, signal.SIGINT)
    assert run.finish(timeout=120) == 130, run.output[-3000:]
    assert "Traceback" not in run.output and "2/2 jobs done" not in run.output
    lines = [line for line in run.output.splitlines() if line.startswith("dpfl sweep: stopped")]
    assert len(lines) == 1 and "1 of 2 jobs done" in lines[0], run.output[-2000:]
    assert lines[0].endswith(f"hydra.sweep.dir={sweep}")
    stopped = json.loads((sweep / "1-fedavg" / "results.json").read_text())
    assert stopped["status"] == "interrupted"

    again = Run(args, tmp_path, delay=0.0)
    assert again.finish(timeout=300) == 0, again.output[-3000:]
    assert f"job 0: already completed in {sweep / '0-fedavg'}" in again.output
    assert f"job 1: resuming after round {stopped['stopped']['after_round']}" in again.output
    assert "2/2 jobs done" in again.output
    for job in ("0-fedavg", "1-fedavg"):
        results = json.loads((sweep / job / "results.json").read_text())
        assert results["status"] == "completed" and len(results["rounds"]) == 3


def test_a_sweep_job_directory_of_another_configuration_is_refused_and_an_empty_attempt_restarts(tmp_path):
    from fl_app.run.sweep_resume import plan_sweep_job

    job = tmp_path / "0-fedavg"
    job.mkdir()
    cfg = compose_config([*FAST, "strategy=fedavg", f"output_dir={job}"])
    assert plan_sweep_job(cfg, [], job).action == "run"
    (job / "run.log").write_text("killed before round 1")  # what kill -9 before round 1 leaves
    plan = plan_sweep_job(cfg, [], job)
    assert plan.action == "run" and "ended before its first round (killed)" in plan.note
    assert not (job / "run.log").exists()
    other = compose_config([*FAST, "strategy=fedavg", "seed=9", f"output_dir={job}"])
    plain = OmegaConf.to_container(other, resolve=True)
    (job / "results.json").write_text(json.dumps({"status": "completed", "config": plain}))
    with pytest.raises(ConfigError, match="holds a run of another configuration"):
        plan_sweep_job(cfg, [], job)
    assert plan_sweep_job(other, [], job).action == "skip"


def test_ctrl_c_between_sweep_jobs_is_one_line_and_says_how_to_continue(tmp_path, monkeypatch):
    """A Ctrl-C while Hydra composed the next job printed Hydra's 100-line traceback (42.5, 42.7)."""
    import fl_app.__main__ as entry

    def interrupted_while_composing(*_: object) -> None:
        state = entry.SweepState.current()
        state.note_sweep_dir(tmp_path / "sweep")
        state.job_finished()  # the first job finished, then Ctrl-C
        raise KeyboardInterrupt

    monkeypatch.setattr(entry, "_job", interrupted_while_composing)
    result = preflight_cli("-m", *FAST, "seed=1,2", cwd=tmp_path)
    assert result.returncode == 130 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if not line.startswith("dpfl: starting Ray")]
    assert len(lines) == 2 and lines[0].startswith("dpfl: interrupted"), result.stderr
    assert "stopped with 1 of 2 jobs done" in lines[1] and lines[1].endswith(
        f"hydra.sweep.dir={tmp_path / 'sweep'}"
    )


def test_a_full_disk_at_a_checkpoint_is_one_failure_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """Disk full at a checkpoint is one failure line, no traceback, no partial .tmp file."""
    import errno

    from fl_app.run import files
    from fl_app.run.checkpoint import Checkpoint, save_checkpoint
    from fl_app.run.files import WriteFailed
    from fl_app.run.results import write_json

    run = build_run_context([*FAST, "strategy=fedavg"], tmp_path)
    strategy = STRATEGIES.get("fedavg")(run)

    def checkpoint(completed_round: int) -> Checkpoint:
        return Checkpoint(
            completed_round=completed_round,
            num_rounds=2,
            status="incomplete",
            overrides=[],
            fingerprint="f",
            arrays=strategy.initial_arrays(),
            strategy=strategy,
            recorder={},
            elapsed_s=1.0,
        )

    save_checkpoint(tmp_path, checkpoint(1), run)
    write_json(tmp_path / "results.json", {"round": 1})
    real_fdopen = files.os.fdopen

    def full_disk(descriptor: int, *args: object, **kwargs: object):
        handle = real_fdopen(descriptor, *args, **kwargs)

        def write(data: bytes) -> int:
            handle.raw.write(bytes(data)[:100]) if hasattr(handle, "raw") else None  # a partial write
            raise OSError(errno.ENOSPC, "No space left on device")

        handle.write = write
        return handle

    monkeypatch.setattr(files.os, "fdopen", full_disk)
    with pytest.raises(
        WriteFailed, match=r"could not write .*private_server_state.pkl: No space left on device \(errno 28\)"
    ):
        save_checkpoint(tmp_path, checkpoint(2), run)
    with pytest.raises(WriteFailed, match=r"results\.json: No space left"):
        write_json(tmp_path / "results.json", {"round": 2})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temporary left
    assert read_header(tmp_path)["completed_round"] == 1
    assert json.loads((tmp_path / "results.json").read_text()) == {"round": 1}


@pytest.mark.parametrize("epsilon", ["1e4", "1e300"])
def test_a_huge_budget_builds_every_private_strategy(tmp_path, epsilon):
    """Every private strategy builds at a huge privacy.epsilon, without PrivateKT's 'math range error'."""
    from strategies.privatekt.privacy import privatekt_keep_probability

    assert privatekt_keep_probability(epsilon=float(epsilon), k=2, num_classes=10) == 1.0
    private = sorted(name for name in STRATEGIES.names() if STRATEGIES.get(name).declaration.unit != "none")
    assert "privatekt" in private and "dp_fedavg" in private
    for name in private:
        cfg = compose_config([*FAST, f"strategy={name}", f"privacy.epsilon={epsilon}"])
        validate_config(cfg, check_data=False)
        run = build_run_context([*FAST, f"strategy={name}", f"privacy.epsilon={epsilon}"], tmp_path / name)
        STRATEGIES.get(name)(run).describe()


def test_svhn_without_its_files_is_one_line(tmp_path):
    """dataset=svhn offline without its files is one line, no traceback."""
    empty = tmp_path / "svhn"
    empty.mkdir()
    result = preflight_cli(
        "dataset=svhn", f"dataset.data_dir={empty}", "dataset.download=false", cwd=tmp_path
    )
    assert_one_line(result, "dataset.data_dir=", "train_32x32.mat")


@pytest.mark.simulation
def test_sigterm_before_round_one_says_there_is_nothing_to_resume(tmp_path):
    """No "continue with resume=DIR" for a directory without a checkpoint."""
    out = tmp_path / "early"
    run = Run([*RUN, "strategy=fedavg", f"output_dir={out}"], tmp_path, delay=5.0)  # round 1: >= 15 s
    run.wait_for("dpfl: strategy=fedavg")
    run.process.send_signal(signal.SIGTERM)
    assert run.finish(timeout=120) == 128 + signal.SIGTERM, run.output[-3000:]
    assert "nothing to resume (no round completed)" in run.output
    assert "resume=" not in run.output and "Traceback" not in run.output
    assert not (out / CHECKPOINT_FILE).exists()
    # redirected output carries no colour codes, a non-private run no privacy-randomness banner
    assert "\x1b[" not in run.output and "privacy randomness" not in run.output


def test_a_rounds_writes_do_not_grow_with_the_run_and_resume_restores_the_records(tmp_path):
    """A long run's writes do not grow with the square of its rounds: metrics.csv is appended to,
    not rewritten whole, and the checkpoint counts the records instead of holding every round's."""
    import pickle

    from fl_app.run.results import METRICS_FILE, ROUNDS_FILE, RunRecorder

    settings = settings_of([*FAST, "strategy=fedavg"])
    recorder = RunRecorder(tmp_path, settings)
    states, metrics_sizes = {}, {}
    for server_round in range(1, 301):
        recorder.add_round({"round": server_round, "accuracy": 0.5, "loss": 1.0, "epsilon": None})
        if server_round in (10, 300):
            states[server_round] = len(pickle.dumps(recorder.state()))
            metrics_sizes[server_round] = (tmp_path / METRICS_FILE).stat().st_size
    assert states[300] - states[10] < 8, states  # a count, not the records
    row_bytes = (metrics_sizes[300] - metrics_sizes[10]) / 290
    assert row_bytes < 40, row_bytes  # one appended row per round
    state = recorder.state()
    recorder.add_round({"round": 301, "accuracy": 0.6, "loss": 0.9, "epsilon": None})  # after the checkpoint

    resumed = RunRecorder(tmp_path, settings)
    resumed.restore(state)
    assert resumed.rounds == recorder.rounds[:300]
    assert len((tmp_path / ROUNDS_FILE).read_text().splitlines()) == 300
    assert len((tmp_path / METRICS_FILE).read_text().splitlines()) == 301  # header and 300 rounds
    resumed.add_round(
        {"round": 301, "accuracy": 0.7, "loss": 0.8, "epsilon": None, "extra": 1}
    )  # a new column
    header = (tmp_path / METRICS_FILE).read_text().splitlines()[0]
    assert header.endswith(",extra") and len((tmp_path / METRICS_FILE).read_text().splitlines()) == 302


def test_num_clients_below_clients_per_round_names_both_keys(tmp_path):
    """num_clients=1 below clients_per_round is refused with a line naming both keys."""
    result = preflight_cli("num_clients=1", "clients_per_round=30", cwd=tmp_path)
    assert_one_line(result, "clients_per_round=30", "num_clients=1", "at most 1")


def test_the_default_cohort_fits_any_population():
    """``clients_per_round`` defaults to a fraction: num_clients=20 just runs, 6 per round.

    The main job's cohort is unchanged: 0.3 of the default 100 clients is the 30 it always drew.
    """
    from fl_app.config.compose import compose_config
    from fl_app.config.validation import validate_config
    from fl_app.run.context import resolve_clients_per_round

    default = compose_config([])
    assert resolve_clients_per_round(default.clients_per_round, default.num_clients) == 30
    small = compose_config(["num_clients=20", "dataset=digits"])
    validate_config(small, check_data=False)
    assert resolve_clients_per_round(small.clients_per_round, small.num_clients) == 6


def group_processes(pgid: int) -> list[psutil.Process]:
    """The running processes of process group ``pgid`` (orphans included: they keep the group)."""
    members = []
    for process in psutil.process_iter():
        try:
            if os.getpgid(process.pid) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                members.append(process)
        except (psutil.NoSuchProcess, ProcessLookupError, PermissionError):
            pass
    return members


@pytest.mark.simulation
def test_sigterm_to_a_parallel_sweep_stops_every_worker_and_starts_no_new_job(tmp_path):
    """``kill -- -PGID`` on a joblib sweep ended its jobs as interrupted, but the command died at
    once and its loky workers, orphaned, went on with the queued jobs (each with its own Ray).

    The jobs run their clients inline: the subject is the launcher's workers; a run's Ray processes
    under a group's signal are checked by the single-run tests above and in test_run_completion.py
    (two Ray sessions here cost about 30 s of CPU and taught nothing more)."""
    sweep = tmp_path / "sweep"
    args = [
        "-m",
        *FAST,
        INLINE,
        "num_rounds=1000",  # no job can end before both are running, however loaded the machine
        "strategy=fedavg",
        "seed=1,2,3,4",
        "hydra/launcher=joblib",
        "hydra.launcher.n_jobs=2",
        f"hydra.sweep.dir={sweep}",
    ]
    run = Run(args, tmp_path, delay=0.0)
    pgid = run.process.pid
    try:
        wait_until(lambda: run.output.count("dpfl round 2/1000") >= 2, timeout=300)
        assert run.output.count("dpfl round 2/1000") >= 2, run.output[-3000:]
        os.killpg(pgid, signal.SIGTERM)
        assert run.finish(timeout=120) == 128 + signal.SIGTERM, run.output[-3000:]
        wait_until(lambda: not group_processes(pgid), timeout=60)
        assert not group_processes(pgid), [p.cmdline()[:3] for p in group_processes(pgid)]
    finally:
        for process in group_processes(pgid):
            process.kill()
    assert "Traceback" not in run.output, run.output[-3000:]
    assert "dpfl sweep: stopped with 0 of 4 jobs done" in run.output, run.output[-3000:]
    # the two running jobs wrote their results as interrupted; the queued two never started
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == ["0-fedavg", "1-fedavg"]
    for job in ("0-fedavg", "1-fedavg"):
        assert json.loads((sweep / job / "results.json").read_text())["status"] == "interrupted"


def test_a_run_stopped_by_the_sweeps_stop_file_still_takes_its_own_first_signal(monkeypatch):
    """A parallel sweep's worker often sees the stop file (its watcher thread) before the SIGTERM sent
    to the whole group reaches its main thread; that signal is the first, a stop request, not the
    second that exits at once (the worker died of it, -15, and the launcher raised)."""
    from fl_app.run import lifecycle

    try:
        with lifecycle.stop_on_signals():
            lifecycle.request_stop(signal.SIGTERM)  # what the stop-file watcher does
            signal.raise_signal(signal.SIGINT)  # the group's signal arrives: no exit
            assert lifecycle.stop_requested() == signal.SIGTERM
            monkeypatch.setenv(lifecycle.SIGNAL_GRACE_ENV, "0")  # a repeat after the grace period
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)  # a second one exits at once
    finally:
        lifecycle.STOP.clear()
