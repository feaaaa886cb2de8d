"""Ray's start and the lifetime of its processes: a stop while Ray starts, a command killed with ``kill -9``.

The command runs as a user runs it (``python -m fl_app`` in a process group of its own). Ray's start is
made as long as a test needs with ``DPFL_INJECT_RAY_START_DELAY`` (Ray up, its start not yet reported),
never by relying on a loaded machine; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from fl_app.config.compose import compose_config
from fl_app.config.validation import ConfigError, check_output_dir
from fl_app.engine import ray_session
from fl_app.engine.orphan_reaper import MARK_ENV, watch_owner
from fl_app.run import lifecycle
from fl_app.run.lifecycle import RunInterrupted
from tests.conftest import FAST, wait_until

RUN = [*FAST, "num_rounds=2", "simulation.num_cpus=2", "strategy=fedavg"]
#: Lines of Ray's own that a stopped command must not print (its C++ logging, its lost-GCS errors).
RAY_ERROR_LINES = ("rpc_client", "GCS", "logging.cc", "SIGTERM received at time", "Traceback")
#: A child process that looks like one of Ray's (its command line says "ray") and sleeps.
SLEEPING_RAY = "import time  # ray\ntime.sleep(120)"
#: The same, holding a log file open (argv[1]) as Ray's renamed workers and agents do.
LOGGING_RAY = (
    "import sys, time  # ray\nlog = open(sys.argv[1], 'w')\nprint('open', flush=True)\ntime.sleep(120)"
)


class Command:
    """``python -m fl_app`` in its own process group, its output read as it comes."""

    def __init__(self, args: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "fl_app", *args],
            cwd=cwd,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    def processes(self) -> list[psutil.Process]:
        """The command and every process below it now."""
        me = psutil.Process(self.process.pid)
        return [me, *me.children(recursive=True)]

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


# --------------------------------------------------------------------------- a stop while Ray starts


def test_a_stop_while_ray_starts_ends_the_wait_at_once_and_the_start_is_not_waited_for(monkeypatch):
    """The job waited for Ray's start whatever happened (up to its 120 s timeout; a start whose
    processes a group's signal killed failed only after 33-60 s), then failed with exit 1."""
    blocked = threading.Event()
    monkeypatch.setattr(ray_session, "start_ray", lambda init_args: blocked.wait(60))  # never returns
    monkeypatch.setattr(ray_session, "import_ray_modules", lambda: None)
    monkeypatch.setattr(ray_session, "START_TIMEOUT_S", 20.0)
    session = ray_session.RaySession()
    session.ends_with_process = True  # as in python -m fl_app: the start is abandoned, not waited for
    args = {"address": "ray://nowhere:1"}  # not a private instance: no watchdog, nothing to kill
    session.begin(args)
    try:
        lifecycle.request_stop(signal.SIGTERM)
        asked = time.monotonic()
        with pytest.raises(RunInterrupted) as stop:
            session.ready(args)
        assert stop.value.exit_code == 128 + signal.SIGTERM
        session.end()  # the start still hangs: it is abandoned, not waited for
        assert time.monotonic() - asked < 5.0
    finally:
        blocked.set()
        lifecycle.STOP.clear()
        lifecycle._signal_received.clear()


def test_an_abandoned_start_kills_what_it_started_and_nothing_else(tmp_path, monkeypatch):
    """Processes carrying the start's mark, and renamed ones (blank environment) logging into a session
    folder of this process, are killed; another command's Ray process is left alone.

    The session folders looked at are this test's (a test process may hold a Ray instance of its own,
    for other tests, whose session folder also carries this process's id)."""
    from fl_app.engine import orphan_reaper

    real = orphan_reaper.in_sessions_of
    inside_tmp = str(tmp_path) + os.sep
    monkeypatch.setattr(
        orphan_reaper,
        "in_sessions_of",
        lambda pid: lambda path: path.startswith(inside_tmp) and real(pid)(path),
    )
    unmarked = {key: value for key, value in os.environ.items() if key != MARK_ENV}
    logs = tmp_path / f"session_2026-11-29_01-00-00_000000_{os.getpid()}" / "logs"
    logs.mkdir(parents=True)
    owner = watch_owner()
    children: list[subprocess.Popen[str]] = []
    try:
        marked = subprocess.Popen([sys.executable, "-c", SLEEPING_RAY], text=True)  # inherits the mark
        renamed = subprocess.Popen(
            [sys.executable, "-c", LOGGING_RAY, str(logs / "agent.log")],
            env=unmarked,
            stdout=subprocess.PIPE,
            text=True,
        )
        other = subprocess.Popen([sys.executable, "-c", SLEEPING_RAY], env=unmarked, text=True)
        children = [marked, renamed, other]
        assert renamed.stdout is not None and renamed.stdout.readline().strip() == "open"
        assert owner.end_now() == 2
        wait_until(lambda: marked.poll() is not None and renamed.poll() is not None, timeout=10)
        assert marked.poll() is not None and renamed.poll() is not None  # killed (and reaped by psutil)
        assert other.poll() is None
    finally:
        for child in children:
            child.kill()
            child.wait(timeout=10)
        owner.close()
    assert owner.watchdog.wait(timeout=20) == 0


@pytest.mark.subprocess
def test_sigterm_to_the_group_while_ray_starts_ends_at_once_with_results_saying_nothing_ran(tmp_path):
    """Under ``timeout 40`` on a loaded machine: "Ray did not start: The current node timed out during
    startup" and a folder holding only ``.dpfl.lock``; with ``kill -TERM -<pgid>`` exit 1 after 85 s with
    Ray's internal error lines; ``resume=`` then said the folder "is not the output directory of a dpfl
    run"."""
    out, timeline = tmp_path / "early", tmp_path / "timeline.jsonl"
    env = {ray_session.INJECT_START_DELAY_ENV: "600", "DPFL_TIMELINE": str(timeline)}
    command = Command([*RUN, f"output_dir={out}"], tmp_path, env)
    try:
        phases = lambda: timeline.read_text() if timeline.exists() else ""  # noqa: E731
        wait_until(lambda: '"job"' in phases() and '"ray_init"' in phases(), timeout=180)
        assert '"ray_init"' in phases(), command.output[-3000:]  # Ray is up; its start is not reported
        processes = command.processes()
        asked = time.monotonic()
        os.killpg(command.process.pid, signal.SIGTERM)
        code = command.process.wait(timeout=100)
        took = time.monotonic() - asked
    finally:
        if command.process.poll() is None:
            os.killpg(command.process.pid, signal.SIGKILL)
    command.reader.join(timeout=30)
    output = command.output
    assert code == 128 + signal.SIGTERM, output[-3000:]
    assert took < 60, f"took {took:.0f} s"  # measured 6-9 s: the shutdown of a Ray whose processes died
    wait_until(lambda: not alive(processes), timeout=30)
    assert alive(processes) == [], output[-3000:]
    lines = output.splitlines()
    assert lines[0].startswith("dpfl: starting Ray"), output[-3000:]  # said before anything else
    assert [line for line in lines if any(text in line for text in RAY_ERROR_LINES)] == [], output[-3000:]
    assert sum("run interrupted" in line for line in lines) == 1, output[-3000:]
    assert "stopped by SIGTERM while Ray was starting" in output
    results = json.loads((out / "results.json").read_text())
    assert results["status"] == "interrupted" and results["rounds"] == [], results
    assert results["stopped"]["reason"] == "stopped by SIGTERM while Ray was starting"
    # a new run into the folder reuses it; resume= says there is nothing to continue
    check_output_dir(compose_config([*RUN, f"output_dir={out}"]))
    with pytest.raises(ConfigError, match="ended before its first round, nothing to continue"):
        compose_config([f"resume={out}"])


# --------------------------------------------------------------------------- kill -9


@pytest.mark.subprocess
def test_kill_9_of_the_command_leaves_no_ray_process_and_says_so(tmp_path):
    """``kill -9`` of the command left Ray's dashboard and runtime-env agents running for about 96 s."""
    command = Command(
        [*RUN, "num_rounds=1000", f"output_dir={tmp_path / 'killed'}"], tmp_path, {"DPFL_INJECT_DELAY": "0.2"}
    )
    try:
        wait_until(
            lambda: "dpfl round 1/" in command.output or command.process.poll() is not None, timeout=180
        )
        assert "dpfl round 1/" in command.output, command.output[-3000:]
        processes = command.processes()
        assert len(processes) > 3, [p.name() for p in processes]  # the GCS, the raylet, its agents, ...
        command.process.kill()
        command.process.wait(timeout=30)
        wait_until(lambda: not alive(processes), timeout=30)
        assert alive(processes) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(command.process.pid, signal.SIGKILL)
    command.reader.join(timeout=30)  # the watchdog holds the output until it is done
    assert f"Ray process(es) left running by dpfl process {command.process.pid}" in command.output
