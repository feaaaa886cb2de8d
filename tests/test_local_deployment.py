"""scripts/local_deployment.py's process handling: what it starts it finds, stops and never confuses."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import psutil
import pytest

pytestmark = pytest.mark.subprocess  # runs the command in subprocesses: not in the fast tier


SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "local_deployment.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("local_deployment_under_test", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_spawned_process_tree_is_found_and_stopped(tmp_path: Path) -> None:
    deployment = _script()
    process = deployment.spawn(
        "sleeper",
        ["sh", "-c", "sleep 60 & sleep 60"],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
        log=tmp_path / "sleeper.log",
        die_with_parent=True,
    )
    deadline = time.monotonic() + 10
    while len(deployment.descendants(process.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    children = deployment.descendants(process.pid)
    assert len(children) >= 2  # both sleeps (children of the shell)
    assert process.alive()
    assert process.start_time == psutil.Process(process.pid).create_time()
    assert deployment.stop_processes([process], timeout=5) == []  # SIGTERM was enough
    assert not process.alive()
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in children)


def test_a_reused_pid_is_not_the_process_that_was_started(tmp_path: Path) -> None:
    deployment = _script()
    process = deployment.spawn(
        "sleeper", ["sleep", "60"], cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}, log=tmp_path / "s.log"
    )
    impostor = deployment.Process("sleeper", process.pid, (process.start_time or 0) - 100.0, process.log)
    assert process.alive() and not impostor.alive()
    assert deployment.stop_processes([impostor], timeout=1) == []  # not signalled: not ours
    assert process.alive()
    deployment.stop_processes([process], timeout=5)
    assert not process.alive()


def test_a_supernode_port_taken_before_it_binds_is_replaced(tmp_path: Path, monkeypatch) -> None:
    """free_port() can return a port another process takes before the SuperNode binds it (the suite's
    parallel workers start Ray, whose servers bind ephemeral ports): start() tries a fresh one."""
    import socket

    script = _script()
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real_free_port = script.free_port
    monkeypatch.setattr(script, "free_port", lambda host="127.0.0.1": next(ports, 0) or real_free_port(host))
    deployment = script.start(
        tmp_path / "federation",
        data_files=[tmp_path / "unused.npz"],
        secure=False,
        port=real_free_port(),
        connection="dpfl-port-test",
        cli_env={"FLWR_HOME": str(tmp_path / "cli-home"), "PATH": str(Path(sys.executable).parent)},
        die_with_parent=True,
    )
    try:
        supernode_log = (tmp_path / "federation" / "logs" / "supernode-0.log").read_text()
        assert script.PORT_IN_USE in supernode_log  # the first try hit the taken port ...
        assert len(deployment.running()) == 2  # ... and the SuperLink and a SuperNode run
    finally:
        deployment.stop()
        taken.close()
    assert deployment.running() == []


def test_stop_superlink_stops_only_this_users_superlink_of_this_home_by_pid(tmp_path: Path) -> None:
    """scripts/stop-superlink.sh ends this user's `flower-superlink` of this Flower home, by pid.

    Never by a command-line pattern: on a shared machine that could end another user's."""
    import subprocess

    deployment = _script()
    fake = tmp_path / "bin" / "flower-superlink"
    fake.parent.mkdir()
    fake.write_text("import time\ntime.sleep(60)\n")
    mine, other = tmp_path / "mine", tmp_path / "other"

    def superlink(home: Path) -> subprocess.Popen:
        database = str(home / "local-superlink" / "state.db")
        return subprocess.Popen([sys.executable, str(fake), "--simulation", "--database", database])

    ours, theirs = superlink(mine), superlink(other)
    database = str(mine / "local-superlink" / "state.db")  # named in its arguments, but another program
    decoy = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)", "flower-superlink", "--database", database]
    )
    try:
        deadline = time.monotonic() + 10
        while not deployment.local_superlinks(mine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [p.pid for p in deployment.local_superlinks(mine)] == [ours.pid]
        line = deployment.stop_local_superlink(mine)
        assert line.startswith(f"stopped SuperLink {ours.pid}")
        assert ours.wait(timeout=20) is not None
        assert theirs.poll() is None and decoy.poll() is None  # another home, another program: untouched
        assert deployment.stop_local_superlink(mine).startswith("no local SuperLink running")
    finally:
        for process in (ours, theirs, decoy):
            process.kill()
            process.wait(timeout=10)


def test_status_answers_with_exit_status_zero_when_nothing_runs(tmp_path: Path, capsys) -> None:
    """`dpfl deploy status` exits 0 when nothing runs."""
    assert _script().main(["status", "--dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("not running")


def test_the_serverapp_gate_runs_at_most_its_slots_and_frees_a_slot_when_one_ends(tmp_path: Path) -> None:
    """Launches beyond the slots exit at once (status 75) without running the ServerApp."""
    started = tmp_path / "started"
    real = tmp_path / "fake-serverapp"
    real.write_text(f'#!/bin/sh\necho "$@" >> {started}\nexec sleep 30\n')
    real.chmod(0o755)
    local_deployment = _script()
    gate = local_deployment.write_serverapp_gate(tmp_path / "link", slots=2, real=str(real))
    gate = gate / "flwr-serverapp"
    first, second = (subprocess.Popen([str(gate), "--token", t]) for t in ("a", "b"))
    try:
        deadline = time.monotonic() + 30
        while (not started.is_file() or len(started.read_text().splitlines()) < 2) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        third = subprocess.run([str(gate), "--token", "c"], capture_output=True, text=True, timeout=30)
        assert third.returncode == local_deployment.GATE_BUSY_EXIT
        assert "2 ServerApps running" in third.stderr
        assert sorted(started.read_text().split()) == ["--token", "--token", "a", "b"]
        first.kill()
        first.wait(timeout=30)
        fourth = subprocess.Popen([str(gate), "--token", "d"])
        try:
            deadline = time.monotonic() + 30
            while "d" not in started.read_text().split() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "d" in started.read_text().split()
            assert fourth.poll() is None  # it became the (fake) ServerApp and holds the freed slot
        finally:
            fourth.kill()
            fourth.wait(timeout=30)
    finally:
        for process in (first, second):
            process.kill()
            process.wait(timeout=30)
