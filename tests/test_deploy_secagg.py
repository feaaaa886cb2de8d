"""Distributed DP deployed: SecAgg+ rounds on SuperNodes with TLS and authentication, one SuperNode killed.

Its own module (and federation of four SuperNodes), so that the suite's workers can run it beside
``tests/test_deploy.py``'s federation of two. Uses that module's deployment helpers.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest
from test_deploy import (
    AFTER_IMPORT,
    ROOT,
    RUN_DEADLINE_S,
    STATUS_POLL_S,
    Federation,
    Submission,
    local_deployment,
    make_device_data,
)


@pytest.fixture(scope="module")
def staged_app(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The app as `flwr run` submits it."""
    return local_deployment.stage_app(ROOT, tmp_path_factory.mktemp("app") / "dpfl")


#: SecAgg+ with a SuperNode killed inside a round, after the key sharing and before the collect stage.
#: Every ServerApp holds before it sends the collect stage's messages until the test has killed the
#: SuperNode (SERVER_HOLD_PATCH: it waits for a file the test writes after the kill), so no device can
#: have answered before, however loaded the machine (a fixed delay of 12 s did not hold on a loaded
#: machine). The hold is on the servers, not on the devices: a SuperNode answers one message at a time,
#: so a device holding one run's collect message kept the other run's key sharing waiting behind it,
#: and the other run timed out (seen under the whole suite: 712 s, then a failure).
#: The SuperLink declares a silent node offline after two missed heartbeats and
#: answers for it with an error: the SuperNodes here beat every HEARTBEAT_S seconds (Flower's default,
#: 30 s, would keep the test waiting a minute). The stage's wait (simulation.timeout) is a bound only.
HEARTBEAT_S = 10  # the SuperLink accepts 10 s at least
KILL_TIMEOUT_S = 600  # a bound only: under the whole suite on 2 cores, 240 s was once too short
#: Set in the SuperNodes' processes before Flower's fleet connection reads it.
HEARTBEAT_PATCH = f"""import flwr.common.constant as constant

constant.HEARTBEAT_DEFAULT_INTERVAL = {HEARTBEAT_S}
"""
#: Names the file whose existence releases the held ServerApps.
SERVER_HOLD_ENV = "DPFL_TEST_SERVER_HOLD"
#: Set in the SuperLink's processes (its ServerApps inherit it): SecAggRound.collect_messages, the
#: collect stage's first step, waits for the file named by SERVER_HOLD_ENV (at most 600 s).
SERVER_HOLD_PATCH = (
    f"""import os
import time


def _held(collect_messages):
    def held(self, *args, **kwargs):
        deadline = time.monotonic() + 600
        while not os.path.exists(os.environ["{SERVER_HOLD_ENV}"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        return collect_messages(self, *args, **kwargs)

    return held


def _hold(module):
    module.SecAggRound.collect_messages = _held(module.SecAggRound.collect_messages)


PATCHES = {{"strategies.dp_fedavg_secagg.secagg": _hold}}
"""
    + AFTER_IMPORT
)


def collecting(submission: Submission) -> bool:
    """Whether the run's log says its devices are in SecAgg+'s collect stage."""
    log = submission.output_dir / "run.log"
    return log.is_file() and "shared their keys" in log.read_text()


def has_results(submission: Submission) -> bool:
    return (submission.output_dir / "results.json").is_file()


def fail_if_finished(
    federation: Federation,
    submissions: Iterable[Submission],
    *,
    before: str,
    unless: Callable[[Submission], bool],
) -> None:
    """Fail at once, with the run's log, when a run the test waits for finished ``before`` a point.

    (A ServerApp that raised at start-up, e.g. when its FAB did not install, finishes in seconds:
    waiting for :data:`RUN_DEADLINE_S` would only hold up the suite.) ``unless`` is checked after the
    status, so a run that got there and then finished is not failed.
    """
    for submission in submissions:
        status = federation.status(submission.run_id)
        if status.startswith("finished") and not unless(submission):
            log = federation.log(submission.run_id)
            pytest.fail(
                f"{submission.name} (run {submission.run_id}) {status} before {before}\n{log[-4000:]}"
            )


@pytest.mark.deploy
def test_a_supernode_killed_during_a_secure_aggregation_round(
    tmp_path: Path, staged_app: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four SuperNodes (TLS, authentication); one is killed inside a SecAgg+ round, after the key sharing.

    One run of one round, calibrated for 3 survivors of 4 (a released sum holds at least 3): the
    SuperLink's error for the dead node is a dropout, and the round completes with the other three (one
    failure, one release charged to the four scheduled clients). What follows a dropout when fewer
    survive than the calibration needs (the round discarded: nothing unmasked or released, the model
    and the ledger unchanged) is the strategy's own decision on the same replies, checked in
    tests/test_dp_fedavg_secagg.py (the module took 166 s of machine CPU alone with a
    second deployed run for it, 114 s without).
    """
    data = ["dataset=digits", "partition=iid", "num_clients=4"]
    files = make_device_data.write_device_files(tmp_path / "devices", data)
    cli_env = {**os.environ, "FLWR_HOME": str(tmp_path / "cli-home")}
    patch = tmp_path / "heartbeat"
    patch.mkdir()
    (patch / "sitecustomize.py").write_text(HEARTBEAT_PATCH)
    python_path = os.pathsep.join(filter(None, [str(patch), os.environ.get("PYTHONPATH", "")]))
    killed = tmp_path / "supernode-killed"  # the servers' collect stage waits for this file
    server_patch = tmp_path / "server-hold"
    server_patch.mkdir()
    (server_patch / "sitecustomize.py").write_text(SERVER_HOLD_PATCH)
    # the SuperLink starts with this process's environment; its ServerApps inherit it
    monkeypatch.setenv(SERVER_HOLD_ENV, str(killed))
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(server_patch), os.environ.get("PYTHONPATH")]))
    )
    deployment = local_deployment.start(
        tmp_path / "federation",
        data_files=files,
        secure=True,
        port=local_deployment.free_port(),
        connection="dpfl-test-kill",
        cli_env=cli_env,
        supernode_env={"PYTHONPATH": python_path},
        die_with_parent=True,
    )
    federation = Federation("secure", tmp_path, staged_app, deployment, cli_env)
    try:
        common = [
            *data,
            "strategy=dp_fedavg_secagg",
            "clients_per_round=4",
            "num_rounds=1",
            "local_epochs=1",
            "batch_size=16",
            f"simulation.timeout={KILL_TIMEOUT_S}",
        ]
        runs = {"survives": federation.submit("survives", [*common, "strategy.min_survivors=0.75"])}
        deadline = time.monotonic() + RUN_DEADLINE_S
        next_poll = 0.0
        while not all(collecting(submission) for submission in runs.values()):
            assert time.monotonic() < deadline, "the runs never reached the collect stage"
            assert not deployment.problems(), deployment.problems()
            if time.monotonic() >= next_poll:  # a run whose ServerApp failed at once can never get there
                fail_if_finished(federation, runs.values(), before="the collect stage", unless=collecting)
                next_poll = time.monotonic() + STATUS_POLL_S
            time.sleep(0.5)
        victim = deployment.processes[4]  # the fourth SuperNode, with its ClientApp processes
        os.killpg(os.getpgid(victim.pid), signal.SIGKILL)
        gone = time.monotonic() + 60
        while victim.alive() and time.monotonic() < gone:
            time.sleep(0.1)
        assert not victim.alive(), "the killed SuperNode still runs"
        killed.write_text("the fourth SuperNode is dead: the others may answer\n")
        results = {}
        for name, submission in runs.items():
            path = submission.output_dir / "results.json"
            next_poll = time.monotonic() + STATUS_POLL_S
            while not path.is_file():
                assert time.monotonic() < deadline, f"{name}: no results.json"
                if time.monotonic() >= next_poll:
                    fail_if_finished(
                        federation, [submission], before="writing results.json", unless=has_results
                    )
                    next_poll = time.monotonic() + STATUS_POLL_S
                time.sleep(1.0)
            results[name] = json.loads(path.read_text())
    finally:
        deployment.stop()
    survived = results["survives"]
    (released,) = survived["rounds"]
    assert released["secure_aggregation"] == "released: sum of 3 clients", released
    assert released["failures"] == 1 and released["clients"] == 4
    ledger = json.loads((runs["survives"].output_dir / "privacy_ledger.json").read_text())
    # one release, charged to the four scheduled devices (a device's id is its node id)
    assert [sorted(e["participants"]) for e in ledger["events"]] == [sorted(deployment.node_ids)]
    assert survived["final"]["epsilon"] == pytest.approx(survived["config"]["privacy"]["epsilon"], rel=1e-3)
