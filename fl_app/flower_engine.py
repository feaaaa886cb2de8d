"""The one adapter to Flower's private simulation APIs (flwr 1.41).

Everything dpfl needs from Flower that is not public API lives here, so a
Flower upgrade touches one file and ``tests/test_flower_engine.py`` (which pins
the version this was written against) says what broke:

* :func:`run_simulation_engine` wraps ``flwr.simulation.run_simulation._run_simulation``,
  the function ``flwr-simulation`` calls: the public ``run_simulation`` passes an
  empty run config, and dpfl's overrides travel in the run config.
* :func:`start_ray` starts Ray with the arguments Flower's Ray backend would use
  (which then finds it running), so the driver can handle SIGTERM itself.
* :func:`install_fast_dispatch` replaces the simulation engine's message
  dispatcher. Flower's ``vce_api.add_messages_to_queue`` asks the in-memory
  LinkState once *per registered node* for that node's next message, and each
  ask walks every stored message: ``N x stored`` checks per sweep, ten sweeps
  a second, for the whole run. At 1000 nodes and 100 messages in flight that
  is a CPU core spent on dispatch (the cross-device round was 7.7x plain
  PyTorch, BENCHMARKS.md), and the 1000-message roster query alone took 30 s.
  The replacement walks the stored messages once per sweep, hands out the same
  messages (undelivered, not expired, one per node per sweep, marked delivered
  exactly as ``get_message_ins`` does), and polls with an interval that adapts
  to its own cost instead of a fixed 100 ms. Other LinkState implementations
  fall back to Flower's function.
* :func:`install_pipelined_pool` lets every actor of Flower's actor pool hold
  ``PIPELINE_DEPTH`` messages at once. Flower lends an actor to one message at
  a time; between two messages the actor waits for the driver to fetch the
  reply, store it and submit the next (measured: 3 ms per round trip on 2
  busy cores, while the MLP's client work is 1.5 ms). With a second message
  already queued at the actor, Ray starts it as soon as the first ends. Actors
  still run one message at a time, in order; only the wait is hidden.
  The same install makes the ClientApp loader Flower ships with every message a
  reference to a module function (a few bytes) instead of a closure that
  ``cloudpickle`` serialises by value on every call.

These run in the process that runs the simulation engine: the driver of
``python -m fl_app`` and the ``flwr-simulation`` process of ``flwr run`` (the
ServerApp module imports this module; the engine starts its dispatcher only
after Ray is up, seconds later).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from queue import Queue
from typing import Any

import flwr

#: The Flower release whose private APIs this module was written against.
FLOWER_VERSION = "1.41.0"

#: Bounds of the dispatcher's polling interval (seconds).
MIN_POLL_S = 0.002
MAX_POLL_S = 0.05
#: Keep polling below about 1/(1 + COST_FACTOR) of one core.
COST_FACTOR = 20.0

_installed = False
_original_dispatch: Callable[..., None] | None = None


#: Poll at least this often relative to the time already waited (latency <= ~2 % of a wait).
WAIT_FACTOR = 0.02

#: Messages each Ray actor may hold at once (1 is Flower's own behaviour).
PIPELINE_DEPTH = 3

_pool_installed = False


def adaptive_interval(cost_s: float, waited_s: float = 0.0) -> float:
    """Sleep after a poll that cost ``cost_s`` seconds, ``waited_s`` seconds into a wait.

    Cheap polls early in a wait poll often (a cross-device round lasts a few
    hundred milliseconds); an expensive poll, or a long wait (a cross-silo round
    of seconds, where every core trains), polls less, so polling neither burns a
    core nor adds more than about ``WAIT_FACTOR`` of the wait in latency.
    """
    return min(MAX_POLL_S, max(MIN_POLL_S, COST_FACTOR * cost_s, WAIT_FACTOR * waited_s))


def take_undelivered(state: Any, nodes: set[int], seen: set[str]) -> list[Any]:
    """Mark and return the next undelivered message of every node in ``nodes``.

    The same selection as Flower's ``InMemoryLinkState.get_message_ins(node, limit=1)``
    called for every node, in one walk over the store: expired or invalid
    messages are dropped by the state's own check, a node gets at most one
    message per call, and the chosen messages get ``delivered_at``. ``seen``
    holds the ids already handed out (updated here), so messages in flight are
    not checked again on every sweep.
    """
    from flwr.supercore.date import now

    chosen: dict[int, Any] = {}
    with state.lock:
        store = state.message_ins_store
        if len(seen) > 2 * len(store) + 1024:
            seen.intersection_update(store.keys())
        fresh = [msg_id for msg_id in store if msg_id not in seen]
        if not fresh:
            return []
        state._check_stored_messages(set(fresh))
        for msg_id in fresh:
            message = store.get(msg_id)
            if message is None:
                continue
            metadata = message.metadata
            node = metadata.dst_node_id
            if node in nodes and node not in chosen and metadata.delivered_at == "":
                chosen[node] = message
                seen.add(msg_id)
        delivered_at = now().isoformat()
        for message in chosen.values():
            message.metadata.delivered_at = delivered_at
    return list(chosen.values())


def fast_add_messages_to_queue(
    state: Any, queue: Queue[Any], nodes_mapping: dict[int, int], f_stop: threading.Event
) -> None:
    """Drop-in for ``vce_api.add_messages_to_queue`` (same arguments, same messages)."""
    if not (hasattr(state, "message_ins_store") and hasattr(state, "_check_stored_messages")):
        assert _original_dispatch is not None
        _original_dispatch(state, queue, nodes_mapping, f_stop)
        return
    nodes = set(nodes_mapping)
    seen: set[str] = set()
    last_delivery = time.perf_counter()
    while not f_stop.is_set():
        started = time.perf_counter()
        messages = take_undelivered(state, nodes, seen)
        for message in messages:
            queue.put(message)
        if messages:
            last_delivery = time.perf_counter()
        else:
            idle = min(started - last_delivery, 1.0)  # a new round's messages must not wait long
            f_stop.wait(adaptive_interval(time.perf_counter() - started, idle))


def is_in_memory_grid(grid: Any) -> bool:
    """Whether ``grid`` is the simulation engine's in-memory grid (not a deployment's SuperLink)."""
    from flwr.superlink.grid.inmemory_grid import InMemoryGrid

    return isinstance(grid, InMemoryGrid)


def replied_ids(grid: Any, message_ids: list[str]) -> list[str] | None:
    """Of ``message_ids``, those whose reply the in-memory LinkState already holds.

    None when ``grid`` is not the simulation's in-memory grid (a deployment's SuperLink): the
    caller then pulls them all. Reads ``InMemoryLinkState.message_ins_id_to_message_res_id``
    without the state's lock: a membership test of a dict is atomic, and a reply stored a moment
    later is found by the next poll.
    """
    answered = getattr(getattr(grid, "state", None), "message_ins_id_to_message_res_id", None)
    if not is_in_memory_grid(grid) or not isinstance(answered, dict):
        return None
    return [message_id for message_id in message_ids if message_id in answered]


def install_fast_dispatch() -> None:
    """Replace the simulation engine's dispatcher (idempotent; see the module docstring)."""
    global _installed, _original_dispatch
    if _installed:
        return
    from flwr.server.superlink.fleet.vce import vce_api

    _original_dispatch = vce_api.add_messages_to_queue
    vce_api.add_messages_to_queue = fast_add_messages_to_queue
    _installed = True


def load_dpfl_client_app() -> Any:
    """The dpfl ClientApp (``fl_app.client_app:app``), imported once per process.

    A module-level function: ``cloudpickle`` sends it by reference, so an actor
    call carries its name, not its code.
    """
    from fl_app.client_app import app

    return app


class BalancedSlots(list):  # type: ignore[type-arg]
    """The pool's lendable slots: every actor ``depth`` times; ``pop()`` lends the least busy actor.

    Flower's pool lends ``pool.pop()`` (the last slot) and gives it back with ``append``. With
    several slots per actor that is a stack: when fewer messages are in flight than there are
    slots, the same few slots at the end are lent again and again, and they can all belong to
    one actor, leaving the other idle (half the throughput) and a dead actor unnoticed (a killed
    worker went undetected for a whole run in a test). ``pop()`` therefore lends a slot of the actor
    with the most free slots, ties going round-robin.
    """

    def __init__(self, actors: list[Any], depth: int) -> None:
        if depth < 1:
            raise ValueError(f"pipeline depth must be >= 1, got {depth}")
        super().__init__(actor for _ in range(depth) for actor in actors)
        self._order = list(actors)
        self._next = 0

    def pop(self, index: Any = -1) -> Any:
        """A slot of the least busy actor (``index`` is ignored: any free slot serves)."""
        if not self:
            raise IndexError("pop from an empty pool")
        free = {id(actor): 0 for actor in self._order}
        for actor in self:
            free[id(actor)] = free.get(id(actor), 0) + 1
        most = max(free.values())
        count = len(self._order)
        for step in range(count):
            actor = self._order[(self._next + step) % count]
            if free[id(actor)] == most:
                self._next = (self._next + step + 1) % count
                self.remove(actor)
                return actor
        return super().pop(index)  # an actor appended from outside the order


def pipeline_pool(pool: Any, depth: int) -> None:
    """Turn a freshly built ``BasicActorPool`` into one that lends each actor ``depth`` times.

    ``num_actors`` becomes the number of slots: Flower starts one worker thread per
    ``num_workers`` (= ``pool.num_actors``), and each thread keeps one message in flight.
    Terminating ends each actor once, quietly (``ray.kill``).
    """
    actors = list(dict.fromkeys(pool.pool))
    pool.pool = BalancedSlots(actors, depth)
    pool.num_actors = len(pool.pool)

    def terminate_all_actors() -> None:
        # Flower's ``actor.terminate.remote()`` makes every actor log a WARNING ("Manually
        # terminating ClientAppActor") that Ray forwards to the console at the end of every run;
        # the run is over, so end them quietly.
        import ray

        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)

    pool.terminate_all_actors = terminate_all_actors


def install_pipelined_pool(depth: int = PIPELINE_DEPTH) -> None:
    """Let each actor of the Ray backend's pool hold ``depth`` messages (idempotent; module docstring)."""
    global _pool_installed
    if _pool_installed:
        return
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    original_build = RayBackend.build

    def build(self: Any, app_fn: Callable[[], Any]) -> None:
        if _loads_dpfl_client_app(app_fn):
            app_fn = load_dpfl_client_app
        original_build(self, app_fn)
        pipeline_pool(self.pool, depth)

    RayBackend.build = build
    _pool_installed = True


def _loads_dpfl_client_app(app_fn: Callable[[], Any]) -> bool:
    """Whether Flower's loader returns dpfl's ClientApp (then a by-reference loader replaces it)."""
    try:
        return app_fn() is load_dpfl_client_app()
    except Exception:  # Flower's loader reports its own errors later
        return False


def install_engine_patches() -> None:
    """Install the fast dispatcher and the pipelined actor pool (idempotent)."""
    install_fast_dispatch()
    install_pipelined_pool()


@contextlib.contextmanager
def actor_limit(limit: int | None) -> Any:
    """Build Flower's actor pool with at most ``limit`` actors (None: as many as the cluster holds).

    Flower sizes the pool from the CPUs of the whole Ray cluster (``pool_size_from_resources``):
    on a cluster shared by the jobs of a parallel sweep, every job would ask for all of it, and the
    jobs would queue for the same actors instead of running side by side.
    """
    if limit is None:
        yield
        return
    from flwr.simulation.ray_transport import ray_actor

    original = ray_actor.pool_size_from_resources

    def capped(client_resources: dict[str, int | float]) -> int:
        return min(original(client_resources), limit)

    ray_actor.pool_size_from_resources = capped
    try:
        yield
    finally:
        ray_actor.pool_size_from_resources = original


def run_simulation_engine(
    *,
    num_supernodes: int,
    server_app_attr: str,
    client_app_attr: str,
    app_dir: str,
    server_app_context: Any,
    backend_config: dict[str, Any],
    max_actors: int | None = None,
) -> None:
    """Run a ServerApp and ClientApp in Flower's Ray-backed simulation engine, in this process.

    ``max_actors`` caps the number of client actors (:func:`actor_limit`).
    """
    from flwr.simulation.run_simulation import _run_simulation
    from flwr.supercore.telemetry import EventType

    install_engine_patches()
    with actor_limit(max_actors):
        _run_simulation(
            num_supernodes=num_supernodes,
            exit_event=EventType.PYTHON_API_RUN_SIMULATION_LEAVE,
            server_app_attr=server_app_attr,
            client_app_attr=client_app_attr,
            app_dir=app_dir,
            server_app_context=server_app_context,
            backend_config=backend_config,
        )


def start_ray(init_args: dict[str, Any]) -> None:
    """Start (or join) Ray exactly as Flower's Ray backend would, before the engine does.

    ``RayBackend.init_ray`` (flwr 1.41) skips ``ray.init`` when Ray is already up; starting it
    here lets the caller install its own SIGTERM handler afterwards (``ray.init`` replaces the
    driver's with one that exits at once). Same arguments as Flower's: the backend's
    ``init_args``, no dashboard, and this process's ``sys.path`` as the workers' ``PYTHONPATH``.
    """
    import os
    import sys

    import ray

    if ray.is_initialized():
        return
    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    os.environ["PYTHONPATH"] = pythonpath
    ray.init(
        runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, **{"include_dashboard": False, **init_args}
    )


def flower_version() -> str:
    """The installed Flower release."""
    return str(flwr.__version__)
