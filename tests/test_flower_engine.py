"""The adapter to Flower's private simulation APIs, the fast message path, and results unchanged by it."""

from __future__ import annotations

import inspect
import json
import os
import re
import secrets
import subprocess
import sys
import threading
from pathlib import Path
from queue import Queue
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import NOOP_ACCOUNT_NAME, NOOP_FLWR_AID, SUPERLINK_NODE_ID
from flwr.proto.task_pb2 import Task
from flwr.server.superlink.fleet.vce import vce_api
from flwr.server.superlink.linkstate import LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid.inmemory_grid import InMemoryGrid

from fl_app.engine import FLOWER_VERSION, SUPPORTED_FLOWER_VERSIONS, dispatch, flower_version, pool
from fl_app.engine import batching as batching_module
from fl_app.engine.batching import batch_size, batched_worker, process_batch, run_jobs, take_batch
from fl_app.engine.dispatch import (
    adaptive_interval,
    fast_add_messages_to_queue,
    install_fast_dispatch,
    is_in_memory_grid,
    replied_ids,
    take_undelivered,
)
from fl_app.engine.launch import actor_limit
from fl_app.engine.messages import content_bytes
from fl_app.engine.metering import MeteredGrid
from fl_app.engine.pool import BalancedSlots, load_dpfl_client_app, pipeline_pool
from fl_app.learning.training import array_values
from strategies.arrays import mean_arrays
from tests.conftest import FAST, TWO_ACTORS

GOLDEN = Path(__file__).parent / "data" / "golden_rounds.json"
ROOT = Path(__file__).resolve().parents[1]


def test_pins_the_flower_release_whose_private_apis_it_uses() -> None:
    """A Flower upgrade must revisit fl_app/engine/ (this test names the reason)."""
    assert flower_version() in SUPPORTED_FLOWER_VERSIONS
    assert FLOWER_VERSION in SUPPORTED_FLOWER_VERSIONS
    pin = re.search(r"flwr\[simulation\]==([0-9.]+)", (ROOT / "pyproject.toml").read_text())
    assert pin is not None and pin.group(1) == FLOWER_VERSION
    parameters = list(inspect.signature(vce_api.add_messages_to_queue).parameters)
    if vce_api.add_messages_to_queue is fast_add_messages_to_queue:
        parameters = list(inspect.signature(dispatch._original_dispatch).parameters)
    assert parameters == ["state", "queue", "nodes_mapping", "f_stop"]
    from flwr.simulation.run_simulation import _run_simulation

    assert {"num_supernodes", "server_app_attr", "client_app_attr", "backend_config"} <= set(
        inspect.signature(_run_simulation).parameters
    )


def test_pins_the_actor_pool_flower_lends_from() -> None:
    """``pipeline_pool`` relies on BasicActorPool lending ``pool.pop()`` and one worker per ``num_actors``."""
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend
    from flwr.simulation.ray_transport.ray_actor import BasicActorPool

    assert "self.pool.pop()" in inspect.getsource(BasicActorPool.submit)
    assert "self.pool.num_actors" in inspect.getsource(RayBackend.num_workers.fget)
    assert "backend.num_workers" in inspect.getsource(vce_api.run_api)


def test_install_replaces_the_dispatcher_once() -> None:
    install_fast_dispatch()
    install_fast_dispatch()
    assert vce_api.add_messages_to_queue is fast_add_messages_to_queue
    assert dispatch._original_dispatch is not fast_add_messages_to_queue


@pytest.mark.parametrize("cost", [0.0, 1e-5, 1e-4, 1e-3, 0.01, 1.0])
def test_adaptive_interval_is_bounded_and_grows_with_cost(cost: float) -> None:
    interval = adaptive_interval(cost)
    assert dispatch.MIN_POLL_S <= interval <= dispatch.MAX_POLL_S
    assert adaptive_interval(cost * 2 + 1e-4) >= interval
    # a long wait polls less often, but never adds more than ~2 % latency or exceeds the cap
    assert adaptive_interval(cost, 1.0) >= interval
    assert adaptive_interval(0.0, 0.5) == pytest.approx(max(dispatch.MIN_POLL_S, 0.01))
    assert adaptive_interval(0.0, 100.0) == dispatch.MAX_POLL_S


@pytest.fixture(autouse=True)
def superlink_identity(task_identity: None) -> Any:
    """Messages built here come from the SuperLink (node 1), as a ServerApp's do."""
    saved = TaskIdentity._node_id
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    yield
    TaskIdentity._node_id = saved


def _linkstate(num_nodes: int) -> tuple[Any, InMemoryGrid, list[int]]:
    """An in-memory LinkState with a run and ``num_nodes`` nodes, as the simulation engine builds it."""
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    state = factory.state()
    run = Run.create_empty(run_id=77)
    run.primary_task_id = 5
    run.federation_id = NOOP_FEDERATION_ID
    state.run_ids[run.run_id] = RunRecord(run=run)
    state.task_store[5] = Task(task_id=5, run_id=run.run_id)
    nodes = []
    for _ in range(num_nodes):
        node = state.create_node(
            NOOP_FLWR_AID, NOOP_ACCOUNT_NAME, secrets.token_bytes(32), heartbeat_interval=1e9
        )
        state.acknowledge_node_heartbeat(node_id=node, heartbeat_interval=1e9)
        nodes.append(node)
    grid = InMemoryGrid(state_factory=factory)
    grid.set_run(run)
    return state, grid, nodes


def _messages(nodes: list[int], per_node: int) -> list[Message]:
    return [
        Message(
            content=RecordDict({"config": ConfigRecord({"i": i})}),
            dst_node_id=node,
            message_type=MessageType.TRAIN,
        )
        for i in range(per_node)
        for node in nodes
    ]


def test_take_undelivered_hands_out_what_flowers_per_node_query_would() -> None:
    """Same messages as ``get_message_ins(node, limit=1)`` for every node, each once, marked delivered."""
    state, grid, nodes = _linkstate(20)
    ids = set(grid.push_messages(_messages(nodes[:15], per_node=2)))
    seen: set[str] = set()
    first = take_undelivered(state, set(nodes), seen)
    assert sorted(m.metadata.dst_node_id for m in first) == sorted(nodes[:15])  # one per node
    assert all(m.metadata.delivered_at != "" for m in first)
    second = take_undelivered(state, set(nodes), seen)
    assert sorted(m.metadata.dst_node_id for m in second) == sorted(nodes[:15])
    assert take_undelivered(state, set(nodes), seen) == []
    handed = {m.metadata.message_id for m in first + second}
    assert handed == ids
    # Flower's own query agrees that nothing is left
    assert all(state.get_message_ins(node_id=node, limit=1) == [] for node in nodes)
    # a node outside the simulation's mapping gets nothing
    state2, grid2, nodes2 = _linkstate(3)
    grid2.push_messages(_messages(nodes2, per_node=1))
    assert [m.metadata.dst_node_id for m in take_undelivered(state2, {nodes2[0]}, set())] == [nodes2[0]]


def test_fast_dispatcher_feeds_the_queue_and_stops() -> None:
    state, grid, nodes = _linkstate(50)
    ids = set(grid.push_messages(_messages(nodes, per_node=1)))
    queue: Queue[Message] = Queue()
    stop = threading.Event()
    thread = threading.Thread(
        target=fast_add_messages_to_queue, args=(state, queue, {n: i for i, n in enumerate(nodes)}, stop)
    )
    thread.start()
    received = {queue.get(timeout=5).metadata.message_id for _ in ids}
    stop.set()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert received == ids and queue.empty()


def test_metered_exchange_returns_all_replies_and_counts_their_bytes() -> None:
    state, grid, nodes = _linkstate(4)
    assert is_in_memory_grid(grid) and not is_in_memory_grid(MeteredGrid(grid))
    metered = MeteredGrid(grid)
    outgoing = _messages(nodes, per_node=1)

    def answer() -> None:  # a stand-in for the simulation engine: reply to every message
        done = 0
        while done < len(nodes):
            for message in take_undelivered(state, set(nodes), set()):
                reply = Message(content=RecordDict({"config": ConfigRecord({"ok": 1})}), reply_to=message)
                reply.metadata.__dict__["_message_id"] = reply.object_id
                state.store_message_res(reply)
                done += 1

    worker = threading.Thread(target=answer)
    worker.start()
    replies = list(metered.send_and_receive(outgoing, timeout=10))
    worker.join()
    assert len(replies) == len(nodes)
    counts = metered.take()
    assert counts["train_replies"] == len(nodes)
    assert counts["train_upload_bytes"] == sum(content_bytes(r) for r in replies)


def test_replied_ids_names_exactly_the_messages_with_a_stored_reply() -> None:
    """The exchange pulls only these between full pulls: none may be missed or invented."""
    state, grid, nodes = _linkstate(5)
    ids = list(grid.push_messages(_messages(nodes, per_node=1)))
    assert replied_ids(grid, ids) == []
    answered = []
    for message in take_undelivered(state, set(nodes[:3]), set()):
        reply = Message(content=RecordDict({"config": ConfigRecord({"ok": 1})}), reply_to=message)
        reply.metadata.__dict__["_message_id"] = reply.object_id
        state.store_message_res(reply)
        answered.append(message.metadata.message_id)
    assert sorted(replied_ids(grid, ids)) == sorted(answered)
    assert replied_ids(MeteredGrid(grid), ids) is None  # not the in-memory grid: pull everything
    pulled = list(grid.pull_messages(replied_ids(grid, ids)))
    assert sorted(r.metadata.reply_to_message_id for r in pulled) == sorted(answered)


def test_actor_limit_caps_flowers_pool_size_and_restores_it(monkeypatch) -> None:
    """Flower sizes its pool from the whole cluster: the cap lets parallel jobs share one."""
    from flwr.simulation.ray_transport import ray_actor

    from fl_app.config.compose import compose_config
    from fl_app.config.validation import ConfigError, validate_common

    monkeypatch.setattr(ray_actor, "pool_size_from_resources", lambda resources: 8)
    with actor_limit(3):
        assert ray_actor.pool_size_from_resources({"num_cpus": 1}) == 3
    assert ray_actor.pool_size_from_resources({"num_cpus": 1}) == 8
    with actor_limit(None):
        assert ray_actor.pool_size_from_resources({"num_cpus": 1}) == 8
    with actor_limit(20):  # never more than the cluster holds
        assert ray_actor.pool_size_from_resources({"num_cpus": 1}) == 8
    with pytest.raises(ConfigError, match=r"simulation\.max_concurrent_clients=0"):
        validate_common(compose_config(["dataset=digits", "simulation.max_concurrent_clients=0"]))
    with pytest.raises(ConfigError, match=r"simulation\.messages_per_task=0: must be an integer >= 1"):
        validate_common(compose_config(["dataset=digits", "simulation.messages_per_task=0"]))


def test_array_values_equals_numpy_for_every_layout() -> None:
    rng = np.random.default_rng(0)
    cases = [
        rng.normal(size=(3, 4)).astype(np.float32),
        rng.normal(size=(5,)),
        np.asfortranarray(rng.normal(size=(4, 6))),
        rng.integers(0, 255, size=(2, 3, 4), dtype=np.uint8),
        np.zeros((0, 3), dtype=np.float32),
        np.array(3.5),
    ]
    for values in cases:
        array = Array(values)
        decoded = array_values(array)
        assert decoded.dtype == array.numpy().dtype
        np.testing.assert_array_equal(decoded, array.numpy())


def test_mean_arrays_is_bitwise_the_sequential_float64_mean() -> None:
    rng = np.random.default_rng(1)
    records = [
        ArrayRecord({"w": Array(rng.normal(size=(7, 3)).astype(np.float32)), "b": Array(rng.normal(size=3))})
        for _ in range(9)
    ]
    weights = list(rng.integers(1, 50, size=9).astype(float))
    factors = np.asarray(weights) / float(np.sum(weights))
    result = mean_arrays(records, weights)
    for key in ("w", "b"):
        expected = sum(f * r[key].numpy().astype(np.float64) for f, r in zip(factors, records, strict=True))
        expected = np.asarray(expected, dtype=records[0][key].numpy().dtype)
        assert result[key].numpy().dtype == expected.dtype
        assert np.array_equal(result[key].numpy(), expected)


@pytest.mark.simulation
@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("fedavg", ["strategy=fedavg"]),
        (
            "dp_fedavg",
            [
                "strategy=dp_fedavg",
                "strategy.sampling=fixed",
                "strategy.noise_multiplier=0.5",
                "privacy.noise_seed=7",
                "privacy.accountant=rdp",  # the golden rounds were made when RDP was the default
            ],
        ),
    ],
)
@pytest.mark.parametrize("backend", ["ray", "inline", "processes"])
def test_results_equal_the_code_before_the_speed_work(
    shared_simulation: Any, name: str, overrides: list[str], backend: str
) -> None:
    """Round by round, the per-message path's accuracy and loss, and commit 48fef10's epsilon and bytes.

    ``tests/data/golden_rounds.json``: the accuracy and loss of one message per client, nothing
    packed or vectorised, in the driver; the epsilon and bytes as the code before the speed work
    (commit 48fef10) gave them. On Ray's client actors, with the clients in the driver
    (``simulation.backend=inline``) and in worker processes forked from it (``processes``), with the
    default fast paths: where a client runs and how its round is sent changes nothing it computes.
    The loss is compared to 1e-6 (float sums in another association).
    """
    golden = json.loads(GOLDEN.read_text())["runs"][name]
    fast = [item for item in FAST if not item.startswith("num_rounds=")]
    where = [] if backend == "ray" else [f"simulation.backend={backend}"]
    results = shared_simulation([*fast, "num_rounds=3", *overrides, *where])  # fedavg on ray: FEDAVG_RUN
    assert len(results["rounds"]) == len(golden)
    for got, want in zip(results["rounds"], golden, strict=True):
        assert {key: got[key] for key in want if key != "loss"} == {
            k: v for k, v in want.items() if k != "loss"
        }
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)


def _random_content(rng: np.random.Generator) -> RecordDict:
    """Contents with the shapes of real replies, and with the duplicates Flower sends once."""
    shared = rng.normal(size=(int(rng.integers(1, 40)), 7)).astype(np.float32)
    arrays = {
        "w": Array(rng.normal(size=(int(rng.integers(1, 60)), 9)).astype(np.float32)),
        "zeros": Array(np.zeros(int(rng.integers(1, 300)), dtype=np.float32)),
        "copy-a": Array(shared),
        "copy-b": Array(shared.copy() if rng.random() < 0.5 else shared + 1),
        "ints": Array(rng.integers(0, 5, size=int(rng.integers(1, 20)))),
    }
    picked = {k: v for k, v in arrays.items() if rng.random() < 0.8} or {"w": arrays["w"]}
    content = RecordDict({"arrays": ArrayRecord(picked)})
    if rng.random() < 0.5:
        content["again"] = ArrayRecord(dict(picked))
    metrics = {
        "loss": float(rng.normal()),
        "num-examples": int(rng.integers(0, 10 ** int(rng.integers(1, 9)))),
    }
    content["metrics"] = MetricRecord(metrics)
    if rng.random() < 0.5:
        content["metrics-copy"] = MetricRecord(dict(metrics))
    if rng.random() < 0.5:
        content["config"] = ConfigRecord({"name": "x" * int(rng.integers(0, 30)), "blob": b"\0" * 5})
    return content


def test_message_bytes_equals_flowers_serialised_size() -> None:
    """The layout-cached size equals the real one, duplicates (sent once) included."""
    from fl_app.engine.message_sizes import message_bytes

    rng = np.random.default_rng(3)
    for _ in range(200):
        message = Message(content=_random_content(rng), dst_node_id=5, message_type=MessageType.TRAIN)
        assert message_bytes(message) == content_bytes(message)


def test_message_bytes_tells_duplicate_arrays_from_distinct_ones() -> None:
    """Same names, shapes and sizes; only whether two arrays are byte-identical differs."""
    from fl_app.engine import message_sizes as metering

    base = np.arange(64, dtype=np.float32)
    twins = {"a": Array(base), "b": Array(base.copy()), "z": Array(np.zeros(64, dtype=np.float32))}
    distinct = {"a": Array(base), "b": Array(base + 1), "z": Array(np.zeros(64, dtype=np.float32))}
    for order in ((twins, distinct), (distinct, twins)):
        metering._SIZES.clear()
        for arrays in order:
            message = Message(
                content=RecordDict({"arrays": ArrayRecord(arrays)}),
                dst_node_id=5,
                message_type=MessageType.TRAIN,
            )
            assert metering.message_bytes(message) == content_bytes(message)


def test_numpy_array_is_byte_identical_to_flowers_array() -> None:
    from fl_app.learning.training import numpy_array

    rng = np.random.default_rng(4)
    cases = [
        rng.normal(size=(3, 4)).astype(np.float32),
        np.zeros(0),
        np.array(2.0),
        rng.integers(0, 9, size=(2, 2, 2)),
        np.asfortranarray(rng.normal(size=(3, 5))),
        rng.normal(size=(128, 784)).astype(np.float32),
    ]
    for values in cases * 2:  # the second time from the header cache
        ours, flowers = numpy_array(values), Array(values)
        assert (ours.data, ours.dtype, ours.shape, ours.stype) == (
            flowers.data,
            flowers.dtype,
            flowers.shape,
            flowers.stype,
        )


def test_pipelined_slots_lend_the_least_busy_actor() -> None:
    slots = BalancedSlots(["a", "b"], 3)
    assert sorted(slots) == ["a", "a", "a", "b", "b", "b"] and len(slots) == 6
    with pytest.raises(ValueError, match="depth"):
        BalancedSlots(["a"], 0)
    # Flower's pattern with fewer messages in flight than slots: lend 3, give 3 back, repeat.
    # A stack lends the last slots again and again (which may all be one actor's); every round
    # here must use both actors.
    for _ in range(20):
        lent = [slots.pop() for _ in range(3)]
        assert set(lent) == {"a", "b"}
        for actor in reversed(lent):
            slots.append(actor)
    slots[:] = ["a", "a", "a", "b", "b", "b"]  # an order in which a stack would lend only "b"
    assert {slots.pop() for _ in range(2)} == {"a", "b"}
    slots[:] = ["a", "a", "a", "b", "b", "b"]
    lent = [slots.pop() for _ in range(6)]
    assert sorted(lent) == ["a", "a", "a", "b", "b", "b"]
    with pytest.raises(IndexError):
        slots.pop()


def test_pipelined_pool_lends_each_actor_depth_times_and_ends_it_once(monkeypatch) -> None:
    import ray

    killed: list[str] = []
    monkeypatch.setattr(ray, "kill", lambda actor, no_restart=True: killed.append(actor))
    actors = ["a", "b"]
    pool = type("Pool", (), {})()
    pool.pool, pool.num_actors = list(actors), 2
    pipeline_pool(pool, 3)
    assert pool.num_actors == 6  # Flower starts one worker thread per slot
    lent = [pool.pool.pop() for _ in range(2)]
    assert lent[0] is not lent[1]  # consecutive loans go to different actors
    pool.terminate_all_actors()
    assert killed == ["a", "b"]


def test_client_app_loader_travels_by_reference() -> None:
    import ray.cloudpickle

    from fl_app.client_app import app

    assert len(ray.cloudpickle.dumps(load_dpfl_client_app)) < 200  # a name, not code
    assert load_dpfl_client_app() is app
    assert pool.loads_dpfl_client_app(lambda: app)
    assert not pool.loads_dpfl_client_app(lambda: object())


# ---------------------------------------------------------------- batched workers


def test_pins_the_worker_and_reply_store_it_replaces() -> None:
    """``install_batched_workers`` and the reply store replace these by name, with these arguments."""
    from flwr.server.superlink.fleet.vce.backend import raybackend
    from flwr.simulation.ray_transport.ray_actor import BasicActorPool

    worker = batching_module._original_worker or vce_api.worker
    assert list(inspect.signature(worker).parameters) == [
        "messageins_queue",
        "messageres_queue",
        "node_info_store",
        "backend",
        "f_stop",
        "metrics",
    ]
    store = dispatch._original_store or vce_api.put_message_into_state
    assert list(inspect.signature(store).parameters) == ["state", "queue", "f_stop"]
    assert "worker," in inspect.getsource(vce_api.run_api)  # looked up at call time, by name
    build = pool._original_build or raybackend.RayBackend.build
    assert "actor_type=ClientAppActor" in inspect.getsource(build)
    assert "app_fn, mssg, cid, context = job" in inspect.getsource(BasicActorPool.submit)


@pytest.mark.parametrize("sharers", [1, 2, 4, 6])
@pytest.mark.parametrize("limit", [1, 8, 32])
def test_batch_size_shares_the_queue(sharers: int, limit: int) -> None:
    for queued in range(1, 130):
        size = batch_size(queued, sharers, limit)
        assert 1 <= size <= limit
        assert size == min(limit, -(-queued // sharers))
        assert size * sharers >= min(queued, limit * sharers)  # the sharers take it all (up to the cap)
    assert batch_size(100, 4, 8) == 8 and batch_size(10, 4, 8) == 3 and batch_size(3, 4, 8) == 1
    assert batch_size(5, 0, 8) == 5  # never divides by zero


def test_heavy_messages_are_shared_among_all_slots_cheap_ones_among_the_idle_senders() -> None:
    batching = batching_module.Batching(lambda jobs: [], slots=4)
    assert batching.sharers(1) == 4  # nothing measured yet: heavy until shown otherwise
    batching.record(8, 0.02)  # 2.5 ms a message: a cross-device client
    assert batching.sharers(1) == 1 and batching.sharers(3) == 3
    batching.record(5, 5 * 4.4)  # a PrivateKT demo client
    assert batching.sharers(1) == 4
    batching.record(0, 0.0)  # an empty batch does not divide by zero
    assert batching.message_s == 0.0


def _burst(message_s: float, queued: int = 40) -> list[int]:
    """Messages each of 2 actors (2 slots each) runs in one round of ``queued`` equal messages.

    Four senders wait when the round's messages arrive and take in turn, each counting the senders
    still waiting; then each takes again when its task ends. An actor runs its tasks one after
    another (the second actor 1 % slower, as no two are equally fast); a task goes to the actor
    with fewer tasks in flight.
    """
    import heapq

    batching = batching_module.Batching(lambda jobs: [], slots=4)
    batching.record(1, message_s)
    senders = [(0.0, sender) for sender in range(4)]
    actor_of: dict[int, int] = {}
    ends, work = [0.0, 0.0], [0, 0]
    while queued:
        now, sender = heapq.heappop(senders)
        waiting = 1 + sum(1 for at, _ in senders if at <= now)
        size = batch_size(queued, batching.sharers(waiting), 8)
        queued -= size
        busy = [sum(1 for at, s in senders if at > now and actor_of.get(s) == a) for a in (0, 1)]
        actor = 0 if busy[0] <= busy[1] else 1
        ends[actor] = max(now, ends[actor]) + size * (1.0, 1.01)[actor]
        actor_of[sender] = actor
        work[actor] += size
        heapq.heappush(senders, (ends[actor], sender))
    return work


def test_a_round_of_heavy_messages_ends_balanced_over_the_actors() -> None:
    """40 clients of 4.4 s: 20 per actor. Shared among the idle senders (right for cheap messages,
    fewer tasks), the last sender of the burst takes the remainder: 24 and 16 (the round 20 % longer)."""
    assert _burst(message_s=4.4) == [20, 20]
    assert sorted(_burst(message_s=0.002)) == [16, 24]


def _queued(nodes: list[int]) -> tuple[Queue[Message], list[Message]]:
    queue: Queue[Message] = Queue()
    messages = _messages(nodes, per_node=1)
    for message in messages:
        queue.put(message)
    return queue, messages


def test_take_batch_never_puts_two_messages_of_one_node_together() -> None:
    queue, messages = _queued([11, 12, 13, 12, 14])
    first = queue.get()
    batch, carried = take_batch(queue, first, limit=8)
    assert [m.metadata.dst_node_id for m in batch] == [11, 12, 13]
    assert carried is messages[3]  # node 12 again: it starts the next batch
    batch, carried = take_batch(queue, carried, limit=8)
    assert [m.metadata.dst_node_id for m in batch] == [12, 14] and carried is None
    queue, _ = _queued([1, 2, 3, 4, 5])
    batch, carried = take_batch(queue, queue.get(), limit=2)
    assert [m.metadata.dst_node_id for m in batch] == [1, 2] and carried is None and queue.qsize() == 3


def test_take_batch_sends_each_packed_message_alone() -> None:
    from flwr.app import ConfigRecord

    from fl_app import keys

    queue, messages = _queued([1, 2, 3, 4, 5, 6])
    for index in (2, 3):  # a block of clients each (fl_app/engine/packed.py)
        messages[index].content[keys.PACKED] = ConfigRecord({"block": index})
    batches = []
    carried = queue.get()
    while carried is not None:
        batch, carried = take_batch(queue, carried, limit=8)
        batches.append([m.metadata.dst_node_id for m in batch])
        if carried is None and not queue.empty():
            carried = queue.get()
    assert batches == [[1, 2], [3], [4], [5, 6]]


class _Store:
    """A node's DeprecatedRunInfoStore, as the engine keeps it: one Context per run."""

    def __init__(self, context: Any) -> None:
        self.context, self.updates = context, 0

    def retrieve_context(self, run_id: int) -> Any:
        return self.context

    def update_context(self, run_id: int, context: Any) -> None:
        self.context, self.updates = context, self.updates + 1


def _contexts(nodes: list[int]) -> dict[int, _Store]:
    from flwr.app import Context

    return {
        node: _Store(Context(run_id=77, node_id=node, node_config={}, state=RecordDict(), run_config={}))
        for node in nodes
    }


def _echo_app(message: Message, context: Any) -> Message:
    """A ClientApp: counts its calls in the node's state; fails for config i == 99."""
    if int(message.content.config_records["config"]["i"]) == 99:
        raise ValueError("client code failed")
    calls = context.state.config_records.get("calls", ConfigRecord({"n": 0}))
    context.state["calls"] = ConfigRecord({"n": int(calls["n"]) + 1})
    return Message(RecordDict({"config": ConfigRecord({"from": context.node_id})}), reply_to=message)


def test_run_jobs_answers_each_message_with_its_own_context_and_errors() -> None:
    from flwr.common.constant import ErrorCode

    stores = _contexts([1, 2, 3])
    messages = _messages([1, 2, 3], per_node=1)
    messages[1] = Message(
        content=RecordDict({"config": ConfigRecord({"i": 99})}), dst_node_id=2, message_type=MessageType.TRAIN
    )
    outcomes = run_jobs(lambda: _echo_app, [(m, stores[m.metadata.dst_node_id].context) for m in messages])
    assert [o[0] for o in outcomes] == ["reply", "error", "reply"]
    assert int(outcomes[0][1].content.config_records["config"]["from"]) == 1
    assert int(outcomes[2][2].state.config_records["calls"]["n"]) == 1
    _, code, reason, remote_traceback = outcomes[1]
    assert code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert "ClientAppException" in reason and "client code failed" in reason
    assert "ValueError" in remote_traceback

    from flwr.clientapp.client_app import LoadClientAppError

    def cannot_load() -> Any:
        raise LoadClientAppError("no such app")

    failed = run_jobs(cannot_load, [(m, None) for m in messages])
    assert [o[:2] for o in failed] == [("error", ErrorCode.LOAD_CLIENT_APP_EXCEPTION)] * 3


def test_process_batch_replies_to_every_message_as_flowers_worker_does() -> None:
    from flwr.common.constant import ErrorCode

    nodes = [1, 2, 3, 4]
    stores = _contexts(nodes)
    messages = _messages(nodes, per_node=1)
    messages[2] = Message(
        content=RecordDict({"config": ConfigRecord({"i": 99})}), dst_node_id=3, message_type=MessageType.TRAIN
    )
    replies = process_batch(messages, stores, lambda jobs: run_jobs(lambda: _echo_app, jobs))
    assert [r.metadata.reply_to_message_id for r in replies] == [m.metadata.message_id for m in messages]
    assert len({r.metadata.message_id for r in replies}) == 4 and all(r.metadata.message_id for r in replies)
    assert [r.has_error() for r in replies] == [False, False, True, False]
    assert replies[2].error.code == ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    assert [stores[n].updates for n in nodes] == [1, 1, 0, 1]  # a failed message leaves its Context
    assert int(stores[4].context.state.config_records["calls"]["n"]) == 1

    class ActorDiedError(Exception):
        pass

    def dead_actor(jobs: list[Any]) -> list[Any]:
        raise ActorDiedError("The actor is dead")

    lost = process_batch(_messages(nodes, per_node=1), stores, dead_actor)
    assert all(r.has_error() and r.error.code == ErrorCode.UNKNOWN for r in lost)
    assert all("ActorDiedError" in r.error.reason and "The actor is dead" in r.error.reason for r in lost)
    short = process_batch(_messages(nodes, per_node=1), stores, lambda jobs: [])  # never a missing reply
    assert len(short) == 4 and all(r.has_error() for r in short)


def test_batched_worker_answers_every_message_in_batches_and_stops() -> None:
    nodes = list(range(1, 41))
    stores = _contexts(nodes)
    queue, messages = _queued(nodes)
    replies: Queue[Message] = Queue()
    sizes: list[int] = []

    def send(jobs: list[Any]) -> list[Any]:
        sizes.append(len(jobs))
        return run_jobs(lambda: _echo_app, jobs)

    backend = type("Backend", (), {})()
    setattr(backend, batching_module.BATCHING_FLAG, batching_module.Batching(send, slots=2))
    metrics = type("Metrics", (), {"add_clientapp_runtime": lambda self, seconds: None})()
    stop = threading.Event()
    threads = [
        threading.Thread(target=batched_worker, args=(queue, replies, stores, backend, stop, metrics))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    answered = {replies.get(timeout=10).metadata.reply_to_message_id for _ in messages}
    stop.set()
    for thread in threads:
        thread.join(timeout=5)
    assert answered == {m.metadata.message_id for m in messages} and replies.empty()
    assert not any(thread.is_alive() for thread in threads)
    assert sum(sizes) == 40 and max(sizes) <= batching_module.MAX_BATCH and max(sizes) > 1


def test_a_batch_in_flight_is_abandoned_when_the_run_stops(monkeypatch) -> None:
    """A stopped run does not wait for an actor's batch (a demo batch: a minute of CNN training)."""
    import ray

    class Pool:
        def __init__(self) -> None:
            self.returned: list[str] = []

        def submit(self, fn: Any, job: tuple[Any, ...]) -> str:
            return "future"

        def add_actor_back_to_pool(self, future: str) -> None:
            self.returned.append(future)

    backend = type("Backend", (), {"pool": Pool(), "app_fn": None})()
    polls: list[float] = []
    finished = [False]

    def wait(futures: list[str], timeout: float) -> tuple[list[str], list[str]]:
        polls.append(timeout)
        return (futures, []) if finished[0] else ([], futures)

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get", lambda future: [("reply", "message", "context")])
    stop = threading.Event()
    send = batching_module.ray_batch_sender(backend, stopped=stop.is_set)
    finished[0] = True
    assert send([("m", "c")]) == [("reply", "message", "context")]  # a finished batch: its outcomes
    finished[0], polls[:] = False, []
    threading.Timer(1.2, stop.set).start()
    with pytest.raises(batching_module.AbandonedBatchError):
        send([("m", "c")])
    assert len(polls) >= 2 and set(polls) == {batching_module.STOP_POLL_S}  # it waited, then gave up
    assert backend.pool.returned == ["future", "future"]  # the actor goes back to the pool either way

    # The worker that sent it ends without replies or error replies for the abandoned messages.
    nodes = [1, 2, 3]
    queue, _ = _queued(nodes)
    replies: Queue[Message] = Queue()
    worker_stop = threading.Event()

    def abandoned(jobs: list[Any]) -> list[Any]:
        worker_stop.set()
        raise batching_module.AbandonedBatchError("stopped")

    batching = batching_module.Batching(abandoned, slots=1)
    setattr(backend, batching_module.BATCHING_FLAG, batching)
    metrics = type("Metrics", (), {"add_clientapp_runtime": lambda self, seconds: None})()
    thread = threading.Thread(
        target=batched_worker, args=(queue, replies, _contexts(nodes), backend, worker_stop, metrics)
    )
    thread.start()
    thread.join(timeout=5)
    assert not thread.is_alive() and replies.empty()
    assert batching.stop_event is worker_stop and batching.stopped()


@pytest.mark.simulation
def test_results_do_not_depend_on_how_messages_are_batched(shared_simulation: Any) -> None:
    """A cohort of 24 goes in batches of up to 8 or one message per task: the same run, round by round.

    On forked workers (the engine batches messages the same way for every backend; a run on Ray took
    37 s of the machine's CPU against 16 s, the golden rounds check Ray's batches).
    """
    fast = [item for item in FAST if not item.startswith(("num_clients=", "clients_per_round="))]
    shape = [*fast, TWO_ACTORS, "num_clients=30", "clients_per_round=24", "strategy=dp_fedavg"]
    shape.append("strategy.sampling=fixed")  # a public cohort: its size and bytes are published
    shape.append("privacy.noise_seed=3")
    shape.append("simulation.backend=processes")
    batched = shared_simulation([*shape, "simulation.messages_per_task=8"])
    single = shared_simulation([*shape, "simulation.messages_per_task=1"])
    fields = ("accuracy", "loss", "epsilon", "upload_bytes", "download_bytes", "clients", "failures")
    assert [{k: r[k] for k in fields} for r in batched["rounds"]] == [
        {k: r[k] for k in fields} for r in single["rounds"]
    ]


@pytest.mark.subprocess
def test_the_server_app_patches_the_engine_only_where_the_engine_runs() -> None:
    """``flwr-simulation`` loads the engine before the ServerApp; a deployment's ServerApp never does."""
    import subprocess
    import sys

    probe = (
        "import sys\n{prelude}import fl_app.server_app\n"
        "from fl_app import engine\n"
        "from fl_app.engine import batching\n"
        "print(engine.SIMULATION_ENGINE_MODULE in sys.modules, batching._workers_installed)\n"
    )
    outputs = [
        subprocess.run(
            [sys.executable, "-c", probe.format(prelude=prelude)], capture_output=True, text=True, check=True
        ).stdout.split()
        for prelude in ("", "import flwr.simulation.run_simulation\n")
    ]
    assert outputs == [["False", "False"], ["True", "True"]]


# ------------------------------------------------------------------------------ Shamir, FAB installs


def test_shamir_shares_are_made_and_joined_without_a_thread_per_call(monkeypatch):
    """The engine's patch: Flower's create/combine_shares run in the caller's thread (no pool of
    GIL-bound threads per secret) and still round-trip, from any threshold-sized subset of shares."""
    from flwr.common.secure_aggregation.crypto import shamir

    from fl_app.engine import secagg  # every process that runs SecAgg+ imports it: the patch is applied

    assert shamir.ThreadPoolExecutor is secagg.InlineExecutor

    def no_thread(self):
        raise AssertionError("a thread was started for Shamir secret sharing")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    secret = bytes(range(40))  # three 16-byte chunks after padding
    shares = shamir.create_shares(secret, 3, 5)
    assert len(shares) == 5 and len(set(shares)) == 5
    assert shamir.combine_shares(shares[:3]) == secret
    assert shamir.combine_shares([shares[4], shares[1], shares[2]]) == secret
    try:  # below the threshold: not the secret (usually not even validly padded)
        below = shamir.combine_shares(shares[:2])
    except ValueError:
        below = None
    assert below != secret


@pytest.mark.subprocess
def test_every_process_of_the_environment_serialises_flowers_fab_installs() -> None:
    """The installed .pth wraps ``flwr.cli.install.validate_and_install`` in a fresh interpreter (as in
    Flower's own flwr-serverapp and flwr-clientapp processes, which install the run's FAB first)."""
    probe = (
        "import dpfl_env, flwr.cli.install as m; "
        "print(getattr(m.validate_and_install, '_dpfl_serialised', False)); print(dpfl_env.__file__)"
    )
    answer = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    wrapped, module = answer.stdout.split()
    assert wrapped == "True", answer.stderr
    # the copy the environment imports (pyproject's force-include) is this repository's: else setup.sh again
    assert Path(module).read_text() == (ROOT / "dpfl_env.py").read_text()


@pytest.mark.subprocess
def test_every_process_of_the_environment_runs_numpy_on_one_blas_thread() -> None:
    """The .pth sets OPENBLAS_NUM_THREADS=1 before numpy loads (a fresh interpreter's numpy reports one
    BLAS thread; docs/benchmarks/blas_threads.md), unless the user exported a value."""
    probe = (
        "import numpy, threadpoolctl; "
        "print(sum(p['num_threads'] for p in threadpoolctl.threadpool_info() if p['user_api'] == 'blas'))"
    )
    environment = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    answer = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=environment
    )
    assert answer.stdout.split() == ["1"], answer.stderr
    chosen = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environment, "OPENBLAS_NUM_THREADS": "2"},
    )
    assert chosen.stdout.split() == ["2"], chosen.stderr  # the user's value wins


def test_a_second_install_of_the_same_fab_waits_for_a_complete_app(tmp_path: Path, monkeypatch) -> None:
    """Flower's install creates the app folder and then copies into it; a second install of the same FAB
    took the half-copied folder as installed (the ServerApp then failed: no pyproject.toml). With the
    lock the second install returns only once the first has copied everything."""
    import flwr.cli.install as install

    import dpfl_env

    dpfl_env.serialise_installs_of(install)  # idempotent (the .pth already did it)
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    (project / "app.py").write_text("x = 1\n")
    copy_started, release = threading.Event(), threading.Event()
    original_copy = install.shutil.copy2

    def first_copy_waits(source, target, *args, **kwargs):
        if threading.current_thread().name == "first" and not copy_started.is_set():
            copy_started.set()
            assert release.wait(60)
        return original_copy(source, target, *args, **kwargs)

    monkeypatch.setattr(install.shutil, "copy2", first_copy_waits)
    seen: dict[str, list[str]] = {}

    def run(name: str) -> None:
        path = install.validate_and_install(project, "ab" * 32, None, tmp_path / "home", True)
        seen[name] = sorted(p.name for p in Path(path).iterdir())

    first = threading.Thread(target=run, args=("first",), name="first")
    second = threading.Thread(target=run, args=("second",), name="second")
    first.start()
    assert copy_started.wait(60)  # the first install made the folder and is copying
    second.start()
    second.join(timeout=3)  # without the lock the second returns here, with an empty folder
    release.set()
    first.join(60)
    second.join(60)
    assert seen == {"first": ["app.py", "pyproject.toml"], "second": ["app.py", "pyproject.toml"]}


def _inline_jobs(count: int) -> list[tuple[Message, Any]]:
    from tests.conftest import make_context, make_message

    return [
        (make_message({}, ArrayRecord({"w": Array(np.full(3, i, dtype=np.float32))})), make_context())
        for i in range(count)
    ]


def test_the_inline_backend_runs_a_batch_on_copies_and_refuses_after_a_stop() -> None:
    """Each batch runs through run_jobs on a pickled copy (as Ray's transport makes one); the
    engine's own Message and Context objects are never handed to a client; a stopped run's batch is
    abandoned before it starts."""
    from fl_app.engine.inline import InlineBackend, inline_backend, isolated

    jobs = _inline_jobs(2)
    seen: list[tuple[Any, Any]] = []

    def client_app(message: Message, context: Any) -> Message:
        seen.append((message, context))
        context.state["touched"] = ConfigRecord({"yes": True})
        return Message(RecordDict(), reply_to=message)

    backend = InlineBackend({})
    backend.build(lambda: client_app)
    batching = getattr(backend, batching_module.BATCHING_FLAG)
    assert backend.num_workers == 1 and batching.slots == 1
    outcomes = batching.send(jobs)
    assert [o[0] for o in outcomes] == ["reply", "reply"]
    for (message, context), (got_message, got_context) in zip(jobs, seen, strict=True):
        assert got_message is not message and got_context is not context
        assert "touched" not in context.state  # the engine's Context changes only through the outcome
    assert all("touched" in o[2].state for o in outcomes)
    copy = isolated(jobs)
    assert copy[0][0].content["arrays"]["w"].numpy().tolist() == [0.0, 0.0, 0.0]

    stop = threading.Event()
    batching.stop_event = stop
    stop.set()
    with pytest.raises(batching_module.AbandonedBatchError):
        batching.send(jobs)

    from flwr.server.superlink.fleet.vce.backend import raybackend

    original = raybackend.RayBackend
    with inline_backend():
        assert raybackend.RayBackend is InlineBackend
    assert raybackend.RayBackend is original


def test_the_inline_backend_stands_in_for_flowers_ray_backend_without_importing_it(monkeypatch) -> None:
    """Where Flower's Ray backend module is not imported yet, the engine's by-name import finds a
    stand-in holding the inline backend (so an inline run never imports Ray), gone after the run."""
    import importlib
    import sys

    from fl_app.engine.inline import RAY_BACKEND_MODULE, InlineBackend, inline_backend

    monkeypatch.delitem(sys.modules, RAY_BACKEND_MODULE, raising=False)
    with inline_backend():
        # what vce_api.start_vce does: ``from .backend.raybackend import RayBackend``
        assert importlib.import_module(RAY_BACKEND_MODULE).RayBackend is InlineBackend
    assert RAY_BACKEND_MODULE not in sys.modules
    assert importlib.import_module(RAY_BACKEND_MODULE).RayBackend.__name__ == "RayBackend"  # the real one


def test_the_inline_backend_reports_a_raising_client_as_its_error_reply() -> None:
    from fl_app.engine.inline import InlineBackend

    def client_app(message: Message, context: Any) -> Message:
        raise ValueError("no data here")

    backend = InlineBackend({})
    backend.build(lambda: client_app)
    outcomes = getattr(backend, batching_module.BATCHING_FLAG).send(_inline_jobs(1))
    assert outcomes[0][0] == "error" and "no data here" in outcomes[0][2]


@pytest.mark.parametrize("cpus", [1.0, 2.0])
def test_inline_clients_run_on_client_cpus_torch_threads(cpus: float) -> None:
    """As an actor gets ``simulation.client_cpus`` threads, an inline batch runs on that many torch
    threads (on 2 cores, torch's default of one per core made rounds 1.8x slower), and the
    process's own setting comes back after the batch."""
    import torch

    from fl_app.engine.inline import InlineBackend

    seen: list[int] = []

    def client_app(message: Message, context: Any) -> Message:
        seen.append(torch.get_num_threads())
        return Message(RecordDict(), reply_to=message)

    before = torch.get_num_threads()
    other = 3 if before != 3 else 4
    torch.set_num_threads(other)
    try:
        backend = InlineBackend({"client_resources": {"num_cpus": cpus, "num_gpus": 0.0}})
        backend.build(lambda: client_app)
        getattr(backend, batching_module.BATCHING_FLAG).send(_inline_jobs(2))
        assert seen == [int(cpus), int(cpus)]
        assert torch.get_num_threads() == other
    finally:
        torch.set_num_threads(before)


def test_a_signal_delivered_to_another_thread_is_handled_while_the_engine_runs() -> None:
    """A process-directed signal may land on any thread; its Python handler runs on the main thread,
    which used to wait for the whole engine run in an untimed join (the SIGTERM stop test then saw its
    request handled after the last round). The engine's thread signals itself and waits for the handler."""
    import signal
    import threading
    import time

    from fl_app.engine.launch import watched_from_the_main_thread

    handled = threading.Event()
    seen: list[bool] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: handled.set())
    try:

        def engine() -> None:
            time.sleep(0.5)  # the main thread is waiting for this one by then (else it handles it anyway)
            signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # to this thread, not the main one
            seen.append(handled.wait(timeout=10))

        watched_from_the_main_thread(engine)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert seen == [True]


def test_the_engines_error_reaches_the_caller() -> None:
    """What the engine raises on its helper thread is raised to the caller, as if it had run there."""
    from fl_app.engine.launch import watched_from_the_main_thread

    def engine() -> None:
        raise RuntimeError("the engine failed")

    with pytest.raises(RuntimeError, match="the engine failed"):
        watched_from_the_main_thread(engine)
