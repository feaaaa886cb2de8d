"""``simulation.backend=processes``: clients in worker processes forked from the command.

Layers: the worker pool on its own (real Flower messages, a test ClientApp: each batch runs in a forked
worker, a dying worker fails its batch, a stopped run abandons it, randomness a client draws from OS
entropy differs between workers); a real simulation (the same rounds as the inline backend, nothing
left running); the command (Ctrl-C, a killed worker, a killed command: no process outlives it).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
from conftest import make_context
from flwr.app import ConfigRecord, Message, RecordDict

from fl_app.config.compose import compose_config
from fl_app.config.validation import ConfigError, validate_config
from fl_app.engine.batching import AbandonedBatchError
from fl_app.engine.processes import ClientWorkerDiedError, WorkerPool, worker_count
from fl_app.privacy.rng import RandomSource
from tests.conftest import FAST, INLINE, TWO_ACTORS, wait_until
from tests.test_reliability import GONE_WITHIN_S, RUN, Run, alive, interrupt, rounds_of

PROCESSES = "simulation.backend=processes"


# ------------------------------------------------------------------------------ the pool


def answering_app(message: Message, context: Any) -> Message:
    """A ClientApp's call: reply with this process's id, the node and a draw from a secure generator.

    The ``action`` config says what else to do: ``exit`` ends the process, ``sleep`` waits 30 s.
    """
    action = str(message.content["config"]["action"])
    if action == "exit":
        os._exit(3)
    if action == "sleep":
        time.sleep(30)
    draw = RandomSource(None, secure=True).generator("noise", client=0, server_round=1).standard_normal()
    answer = ConfigRecord({"pid": os.getpid(), "node": context.node_id, "draw": float(draw)})
    content = RecordDict({"answer": answer})
    return Message(content, reply_to=message)


def load_answering_app() -> Any:
    """The test ClientApp's loader (a module function: it travels by reference)."""
    return answering_app


def job(action: str = "answer", node: int = 1) -> tuple[Message, Any]:
    """One query message with ``action`` and its node's Context."""
    content = RecordDict({"config": ConfigRecord({"action": action})})
    message = Message(content, dst_node_id=node, message_type="query")
    return message, make_context(node_id=node)


@pytest.fixture
def pool() -> Any:
    """Two forked workers (one torch thread each), ended after the test."""
    workers = WorkerPool(2, threads=1)
    yield workers
    workers.close()
    assert [w for w in workers.workers if w.process.is_alive()] == []


def answers(outcomes: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
    """The replies' answer records."""
    assert [o[0] for o in outcomes] == ["reply"] * len(outcomes), outcomes
    return [dict(o[1].content["answer"]) for o in outcomes]


def test_two_batches_at_once_run_in_two_forked_workers_with_their_own_secure_randomness(pool):
    results: dict[int, list[dict[str, Any]]] = {}

    def send(index: int) -> None:
        results[index] = answers(pool.run(load_answering_app, [job(node=index)], lambda: False))

    # both workers busy at once: the second batch cannot go to the first worker
    first = pool.workers[0].connection
    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert first is pool.workers[0].connection and set(results) == {1, 2}
    pids = {results[i][0]["pid"] for i in (1, 2)}
    children = {w.process.pid for w in pool.workers}
    assert os.getpid() not in pids and pids <= children
    # a generator keyed from OS entropy in each worker: never a stream the fork copied
    again = answers(pool.run(load_answering_app, [job()], lambda: False))[0]["draw"]
    draws = [results[i][0]["draw"] for i in (1, 2)] + [again]
    assert len(set(draws)) == 3


def test_a_batch_keeps_its_order_and_each_message_gets_its_reply(pool):
    batch = [job(node=n) for n in (4, 5, 6)]
    outcomes = pool.run(load_answering_app, batch, lambda: False)
    replied = answers(outcomes)
    assert [a["node"] for a in replied] == [4, 5, 6]
    assert len({a["pid"] for a in replied}) == 1  # one batch, one worker


def test_a_worker_that_dies_fails_its_batch_and_says_how(pool):
    with pytest.raises(ClientWorkerDiedError, match=r"exit code 3"):
        pool.run(load_answering_app, [job("exit")], lambda: False)


def test_a_stopped_run_abandons_the_batch_at_a_worker(pool):
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    with pytest.raises(AbandonedBatchError):
        pool.run(load_answering_app, [job("sleep")], stop.is_set)
    assert time.monotonic() - started < 25  # the worker's 30 s sleep was not waited for


def test_the_worker_count_follows_the_cpus_and_the_limit():
    assert worker_count(num_cpus=4, client_cpus=1.0, limit=None) == 4
    assert worker_count(num_cpus=4, client_cpus=2.0, limit=None) == 2
    assert worker_count(num_cpus=4, client_cpus=1.0, limit=3) == 3
    assert worker_count(num_cpus=1, client_cpus=2.0, limit=None) == 1
    assert worker_count(num_cpus=None, client_cpus=1.0, limit=None) == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (["simulation.client_gpus=0.5"], "simulation.client_gpus"),
        (["simulation.ray_address=127.0.0.1:6379"], "simulation.ray_address"),
    ],
)
def test_settings_the_processes_cannot_honour_are_one_line(overrides, key):
    with pytest.raises(ConfigError) as raised:
        validate_config(compose_config([*FAST, PROCESSES, *overrides]), check_data=False)
    assert raised.value.key == key and "simulation.backend=processes" in str(raised.value)


def test_forked_workers_outside_linux_are_one_line(monkeypatch):
    monkeypatch.setattr("sys.platform", "darwin")
    with pytest.raises(ConfigError) as raised:
        validate_config(compose_config([*FAST, PROCESSES]), check_data=False)
    assert raised.value.key == "simulation.backend" and "needs Linux" in str(raised.value)


# ------------------------------------------------------------------------------ simulations


@pytest.mark.simulation
def test_a_run_on_forked_workers_gives_the_inline_runs_rounds_and_leaves_none(simulate):
    overrides = [*FAST, TWO_ACTORS, "strategy=dp_fedavg", "clients_per_round=4"]
    inline = simulate([*overrides, INLINE], name="inline")
    forked = simulate([*overrides, PROCESSES], name="processes")
    assert forked["status"] == "completed"
    assert rounds_of(forked) == rounds_of(inline)
    assert forked["final"]["epsilon"] == inline["final"]["epsilon"]
    saved = [np.load(Path(r["_output_dir"]) / "final_model.npz") for r in (inline, forked)]
    for name in saved[0].files:
        np.testing.assert_array_equal(saved[0][name], saved[1][name])
    assert multiprocessing.active_children() == []


@pytest.mark.subprocess
def test_ctrl_c_stops_a_run_on_forked_workers_and_ends_them(tmp_path):
    run, took = interrupt(tmp_path, "stopped", [*RUN, TWO_ACTORS, PROCESSES], signal.SIGINT, group=True)
    assert took < 30 and "Traceback" not in run.output


@pytest.mark.subprocess
def test_a_killed_worker_process_fails_the_run_with_one_line(tmp_path):
    out = tmp_path / "killed"
    run = Run([*RUN, TWO_ACTORS, PROCESSES, "num_rounds=6", f"output_dir={out}"], tmp_path)
    run.wait_for("dpfl round 1/")
    workers = run.descendants()
    assert len(workers) == 2, workers
    workers[0].kill()
    assert run.finish(timeout=300) == 1, run.output[-3000:]
    errors = [line for line in run.output.splitlines() if line.startswith("error: job failed")]
    assert len(errors) == 1 and "simulation worker (client process) died" in errors[0], run.output[-3000:]
    assert "Traceback" not in run.output
    wait_until(lambda: not alive(workers), timeout=GONE_WITHIN_S)
    assert alive(workers) == []


@pytest.mark.subprocess
def test_the_workers_end_when_the_command_is_killed(tmp_path):
    run = Run([*RUN, TWO_ACTORS, PROCESSES, "num_rounds=6", f"output_dir={tmp_path / 'k'}"], tmp_path)
    run.wait_for("dpfl round 1/")
    workers = run.descendants()
    assert len(workers) == 2
    psutil.Process(run.process.pid).kill()  # no handler runs: the workers see their pipes close
    run.finish(timeout=60)
    wait_until(lambda: not alive(workers), timeout=GONE_WITHIN_S + 30)  # a batch in progress ends first
    assert alive(workers) == []


@pytest.mark.subprocess
def test_a_sweep_forks_workers_for_each_job_and_leaves_none(tmp_path):
    sweep = tmp_path / "sweep"
    args = ["-m", *FAST, TWO_ACTORS, PROCESSES, "strategy=fedavg,dp_fedavg", f"hydra.sweep.dir={sweep}"]
    run = Run(args, tmp_path, delay=0.0)
    started: list[psutil.Process] = []
    deadline = time.monotonic() + 300
    while run.process.poll() is None and time.monotonic() < deadline:  # every worker any job forked
        started += [p for p in run.descendants() if p not in started]
        time.sleep(0.2)
    assert run.finish(timeout=300) == 0, run.output[-3000:]
    loaded = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/results.json"))]
    assert sorted(r["strategy"] for r in loaded) == ["dp_fedavg", "fedavg"]
    assert all(r["status"] == "completed" for r in loaded)
    assert len(started) >= 2 and alive(started) == []
