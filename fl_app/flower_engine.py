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
* :func:`install_batched_workers` replaces the engine's worker threads: each
  takes several queued messages (an even share of the queue among the idle
  senders, or among all actor slots when messages are heavy, at most
  ``simulation.messages_per_task``: :meth:`Batching.sharers`) and sends them to an actor
  in one Ray task (:class:`BatchingActor`'s ``run_batch``). On these 2 cores Ray
  costs about 1.5 ms of CPU per task on each side, more than a cross-device
  client's own work; a batch pays it once, and the global model that the
  messages of a round share travels once per batch (pickle keeps one copy of an
  object several messages reference). Each message still runs through the
  ClientApp on its own with its node's Context and gets its own reply or error
  reply, with the codes and reasons Flower's worker gives; a batch never holds
  two messages for one node. The reply store signals each burst of stored
  replies (:data:`REPLIES_STORED`) and the server signals its pushes
  (:data:`MESSAGES_PUSHED`), so neither side waits for its next poll. When the
  run stops (the ServerApp ended, e.g. on Ctrl-C), a worker waiting for a batch
  abandons it (:class:`AbandonedBatchError`) instead of waiting for the actor to finish
  it: Flower then ends the actors, and a stopped run exits in seconds rather than
  after the batch (a PrivateKT demo batch: about a minute of CNN training).

These run in the process that runs the simulation engine: the driver of
``python -m fl_app`` and the ``flwr-simulation`` process of ``flwr run`` (the
ServerApp module imports this module; the engine starts its dispatcher only
after Ray is up, seconds later).
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from collections.abc import Callable
from logging import ERROR
from queue import Empty, Queue
from typing import Any
from uuid import uuid4

import flwr

#: The Flower release whose private APIs this module was written against.
FLOWER_VERSION = "1.41.0"
#: The simulation engine's module (imported by every process that runs the engine).
SIMULATION_ENGINE_MODULE = "flwr.server.superlink.fleet.vce.vce_api"

#: Bounds of the dispatcher's polling interval (seconds).
MIN_POLL_S = 0.002
MAX_POLL_S = 0.05
#: Keep polling below about 1/(1 + COST_FACTOR) of one core.
COST_FACTOR = 20.0

_installed = False
_original_dispatch: Callable[..., None] | None = None
_original_store: Callable[..., None] | None = None

#: Set when the server pushed messages (the dispatcher wakes at once instead of at its next poll).
MESSAGES_PUSHED = threading.Event()
#: Set when the engine stored a burst of replies (the server wakes at once instead of at its next poll).
REPLIES_STORED = threading.Event()


#: Poll at least this often relative to the time already waited (latency <= ~2 % of a wait).
WAIT_FACTOR = 0.02

#: Messages each Ray actor may hold at once (1 is Flower's own behaviour).
PIPELINE_DEPTH = 2

#: How often a worker waiting for a batch looks whether the run has stopped (seconds).
STOP_POLL_S = 0.5

_pool_installed = False
_original_build: Callable[..., None] | None = None


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
        MESSAGES_PUSHED.clear()  # a push after this wakes the wait below
        messages = take_undelivered(state, nodes, seen)
        for message in messages:
            queue.put(message)
        if messages:
            last_delivery = time.perf_counter()
        else:
            idle = min(started - last_delivery, 1.0)  # a new round's messages must not wait long
            MESSAGES_PUSHED.wait(adaptive_interval(time.perf_counter() - started, idle))


def signalling_put_message_into_state(state: Any, queue: Queue[Any], f_stop: threading.Event) -> None:
    """Drop-in for ``vce_api.put_message_into_state``: store each reply; signal each burst.

    :data:`REPLIES_STORED` is set once the queue of replies is empty, so a server waiting for
    replies wakes once per batch of replies instead of polling.
    """
    while not f_stop.is_set():
        try:
            reply = queue.get(timeout=1.0)
        except Empty:
            continue
        state.store_message_res(reply)
        if queue.empty():
            REPLIES_STORED.set()


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
    """Replace the simulation engine's dispatcher and reply store (idempotent; module docstring)."""
    global _installed, _original_dispatch
    if _installed:
        return
    from flwr.server.superlink.fleet.vce import vce_api

    _original_dispatch = vce_api.add_messages_to_queue
    _original_store = vce_api.put_message_into_state
    vce_api.add_messages_to_queue = fast_add_messages_to_queue
    vce_api.put_message_into_state = signalling_put_message_into_state
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
    global _pool_installed, _original_build
    if _pool_installed:
        return
    from flwr.server.superlink.fleet.vce.backend import raybackend
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    original_build = _original_build = RayBackend.build

    def build(self: Any, app_fn: Callable[[], Any]) -> None:
        if _loads_dpfl_client_app(app_fn):
            app_fn = load_dpfl_client_app
        raybackend.ClientAppActor = batching_actor_type()  # the actor class Flower's build creates
        original_build(self, app_fn)
        pipeline_pool(self.pool, depth)
        batching = Batching(None, slots=self.pool.num_actors)
        batching.send = ray_batch_sender(self, stopped=batching.stopped)
        setattr(self, BATCHING_FLAG, batching)

    RayBackend.build = build
    _pool_installed = True


def _loads_dpfl_client_app(app_fn: Callable[[], Any]) -> bool:
    """Whether Flower's loader returns dpfl's ClientApp (then a by-reference loader replaces it)."""
    try:
        return app_fn() is load_dpfl_client_app()
    except Exception:  # Flower's loader reports its own errors later
        return False


#: One message for an actor and its node's Context.
Job = tuple[Any, Any]
#: What an actor returns for a job: ``("reply", message, context)`` or ``("error", code, reason, traceback)``.
Outcome = tuple[Any, ...]
#: Sends a batch of jobs to an actor and returns one outcome per job (raises if the whole task failed).
Sender = Callable[[list[Job]], list[Outcome]]

#: Default for the most messages one Ray task carries to an actor (``simulation.messages_per_task``).
MAX_BATCH = 8

#: The limit in force in this process (``run_simulation_engine`` sets the configured one).
_messages_per_task = MAX_BATCH
_workers_installed = False
_original_worker: Callable[..., None] | None = None
_batching_actor: Any = None

#: Set on a Ray backend whose pool holds :class:`BatchingActor` actors.
BATCHING_FLAG = "_dpfl_batching"


def batch_size(queued: int, sharers: int, limit: int) -> int:
    """How many of ``queued`` messages a sending thread takes in one task.

    An even share of what is queued among ``sharers`` (:meth:`Batching.sharers`), rounded up, at
    least 1 and at most ``limit``. Few messages (a cross-silo round of 10 on 4 slots) go one to
    three per task; a cross-device round of 100 goes in about a dozen tasks instead of 100.
    """
    return max(1, min(limit, -(-queued // max(1, sharers))))


#: Seconds per message (a batch's wall time over its messages) from which messages count as heavy.
HEAVY_MESSAGE_S = 0.05


class Batching:
    """What the batched workers of one Ray backend share: how to send a batch, who waits for work."""

    def __init__(self, send: Sender | None, slots: int) -> None:
        self.send: Sender = send if send is not None else _no_sender
        self.slots = slots
        #: The engine's stop event, handed over by the first worker (:meth:`stopped` reads it).
        self.stop_event: threading.Event | None = None
        self.waiting_count = 0
        #: Wall seconds per message of the last batch sent (None before the first).
        self.message_s: float | None = None
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def waiting(self) -> Any:
        """Count the calling thread as waiting for work while the block runs."""
        with self._lock:
            self.waiting_count += 1
        try:
            yield
        finally:
            with self._lock:
                self.waiting_count -= 1

    def sharers(self, senders: int) -> int:
        """Among how many to share the queue: the idle ``senders``, or every slot for heavy messages.

        Cheap messages (a cross-device client: milliseconds) go in as few tasks as the idle senders
        can take at once. For heavy ones (at least :data:`HEAVY_MESSAGE_S`, or not yet measured)
        balance matters more than the tasks' cost: shared among the idle senders, the last sender
        of a burst takes the whole remainder (a PrivateKT demo round of 40 clients of 4-5 s went
        8 + 8 + 8 to one actor and 8 + 8 to the other, the round about 20 % longer); one slot's
        share of what is left (shrinking as the queue does) ends the round in small tasks that the
        actors pull as they free up, and they finish together.
        """
        heavy = self.message_s is None or self.message_s >= HEAVY_MESSAGE_S
        return self.slots if heavy else senders

    def record(self, messages: int, seconds: float) -> None:
        """Note the wall time of a batch of ``messages`` (what :meth:`sharers` decides on)."""
        self.message_s = seconds / max(1, messages)

    def stopped(self) -> bool:
        """Whether the engine is stopping (its ServerApp ended): batches in flight are abandoned."""
        return self.stop_event is not None and self.stop_event.is_set()


def _no_sender(jobs: list[Job]) -> list[Outcome]:
    raise RuntimeError("Batching.send was not set")


def client_app_error(ex: BaseException) -> tuple[int, str]:
    """The error code and reason Flower's worker gives a message whose processing raised ``ex``."""
    from flwr.clientapp.client_app import ClientAppException, LoadClientAppError
    from flwr.common.constant import ErrorCode

    if isinstance(ex, ClientAppException):
        code = ErrorCode.CLIENT_APP_RAISED_EXCEPTION
    elif isinstance(ex, LoadClientAppError):
        code = ErrorCode.LOAD_CLIENT_APP_EXCEPTION
    else:
        code = ErrorCode.UNKNOWN
    return int(code), str(type(ex)) + ":<'" + str(ex) + "'>"


def run_jobs(client_app_fn: Callable[[], Any], jobs: list[Job]) -> list[Outcome]:
    """Run each ``(message, context)`` through the ClientApp, in order (an actor's ``run_batch``).

    Returns one outcome per job: ``("reply", message, context)``, or ``("error", code, reason,
    traceback)`` when the ClientApp raised (as Flower's actor wraps it, ``ClientAppException``;
    the Context is then not updated, as in Flower). A ClientApp that cannot be loaded fails
    every job of the batch with ``LoadClientAppError``, as it fails every message in Flower.
    """
    import traceback

    from flwr.clientapp.client_app import ClientAppException, LoadClientAppError

    try:
        app = client_app_fn()
    except LoadClientAppError as ex:
        code, reason = client_app_error(ex)
        return [("error", code, reason, traceback.format_exc()) for _ in jobs]
    outcomes: list[Outcome] = []
    for message, context in jobs:
        try:
            reply = app(message=message, context=context)
        except Exception as ex:  # reported as the message's error reply
            code, reason = client_app_error(ClientAppException(str(ex)))
            outcomes.append(("error", code, reason, traceback.format_exc()))
            continue
        outcomes.append(("reply", reply, context))
    return outcomes


class BatchingActor:
    """Flower's ``ClientAppActor`` with ``run_batch``: several messages in one Ray task.

    Made a Ray actor class by :func:`batching_actor_type` (lazily: importing Ray costs a
    deployment's ServerApp a second for nothing). ``run`` is Flower's own one-message call.
    """

    def __init__(self, on_actor_init_fn: Callable[[], None] | None = None) -> None:
        if on_actor_init_fn:
            on_actor_init_fn()

    def run(self, client_app_fn: Callable[[], Any], message: Any, cid: str, context: Any) -> tuple[Any, ...]:
        """Flower's ``VirtualClientEngineActor.run`` (one message)."""
        from flwr.simulation.ray_transport.ray_actor import VirtualClientEngineActor

        return VirtualClientEngineActor.run(self, client_app_fn, message, cid, context)  # type: ignore[arg-type]

    def run_batch(self, client_app_fn: Callable[[], Any], jobs: list[Job]) -> list[Outcome]:
        """:func:`run_jobs` in this actor."""
        return run_jobs(client_app_fn, jobs)

    def terminate(self) -> None:
        """End this actor (Flower's hook; dpfl's pool ends actors with ``ray.kill``)."""
        import ray

        ray.actor.exit_actor()


def batching_actor_type() -> Any:
    """:class:`BatchingActor` as a Ray actor class (made once per process)."""
    global _batching_actor
    if _batching_actor is None:
        import ray

        _batching_actor = ray.remote(BatchingActor)
    return _batching_actor


class AbandonedBatchError(Exception):
    """The run stopped while a batch was at an actor: nobody waits for its replies any more."""


def ray_batch_sender(backend: Any, stopped: Callable[[], bool] = lambda: False) -> Sender:
    """Send a batch of jobs to an actor of ``backend``'s pool and wait for its outcomes.

    Uses the pool as Flower's ``process_message`` does (``submit`` lends an actor; it goes
    back to the pool afterwards, also when the task failed). Raises what ``ray.get`` raises
    when the whole task failed (e.g. the actor died), and :class:`AbandonedBatchError` when
    ``stopped()`` turns true before the batch is done (looked at every :data:`STOP_POLL_S`).
    """
    import ray

    def send(jobs: list[Job]) -> list[Outcome]:
        pool = backend.pool
        future = pool.submit(
            lambda actor, app_fn, batch, _cid, _context: actor.run_batch.remote(app_fn, batch),
            (backend.app_fn, jobs, "", None),
        )
        try:
            while not ray.wait([future], timeout=STOP_POLL_S)[0]:
                if stopped():
                    raise AbandonedBatchError(f"the run stopped with {len(jobs)} messages at an actor")
            return list(ray.get(future))
        finally:
            pool.add_actor_back_to_pool(future)

    return send


def take_batch(queue: Queue[Any], first: Any, limit: int) -> tuple[list[Any], Any]:
    """``first`` and up to ``limit - 1`` more queued messages, each for a different node.

    Returns the batch and the message that stopped it because its node is already in the batch
    (None if none did): the caller starts its next batch with it, so a node's messages keep
    their order and never share a task (each would need the Context the other leaves).
    """
    batch, nodes = [first], {first.metadata.dst_node_id}
    while len(batch) < limit:
        try:
            message = queue.get_nowait()
        except Empty:
            break
        if message.metadata.dst_node_id in nodes:
            return batch, message
        batch.append(message)
        nodes.add(message.metadata.dst_node_id)
    return batch, None


def process_batch(
    batch: list[Any],
    node_info_store: dict[int, Any],
    send: Sender,
) -> list[Any]:
    """The replies to ``batch`` (one per message, in order), Contexts updated as Flower's worker does."""
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.supercore import log

    stores = [node_info_store[message.metadata.dst_node_id] for message in batch]
    jobs = [
        (message, store.retrieve_context(run_id=message.metadata.run_id))
        for message, store in zip(batch, stores, strict=True)
    ]
    try:
        outcomes = send(jobs)
        if len(outcomes) != len(batch):
            raise RuntimeError(f"{len(outcomes)} outcomes for a batch of {len(batch)} messages")
    except AbandonedBatchError:  # the run stopped: no replies, no error (the caller ends)
        raise
    except Exception as ex:  # the whole task failed: every message gets its error reply
        log(ERROR, ex)
        log(ERROR, traceback.format_exc())
        code, reason = client_app_error(ex)
        outcomes = [("error", code, reason, "") for _ in batch]
    replies = []
    for message, store, outcome in zip(batch, stores, outcomes, strict=True):
        if outcome[0] == "reply":
            _, reply, context = outcome
            store.update_context(message.metadata.run_id, context=context)
        else:
            _, code, reason, remote_traceback = outcome
            if remote_traceback:
                log(ERROR, reason)
                log(ERROR, remote_traceback)
            reply = Message(Error(code=code, reason=reason), reply_to=message)
        reply.metadata.__dict__["_message_id"] = str(uuid4())
        replies.append(reply)
    return replies


def batched_worker(
    messageins_queue: Queue[Any],
    messageres_queue: Queue[Any],
    node_info_store: dict[int, Any],
    backend: Any,
    f_stop: threading.Event,
    metrics: Any,
) -> None:
    """Drop-in for ``vce_api.worker`` (same arguments, same replies), several messages per Ray task.

    A backend whose pool was not built with :class:`BatchingActor` actors gets Flower's worker.
    """
    batching: Batching | None = getattr(backend, BATCHING_FLAG, None)
    if batching is None:
        assert _original_worker is not None
        _original_worker(messageins_queue, messageres_queue, node_info_store, backend, f_stop, metrics)
        return
    if batching.stop_event is None:
        batching.stop_event = f_stop  # one engine run per backend: its workers share one stop event
    carried = None
    while not f_stop.is_set():
        if carried is None:
            with batching.waiting():
                try:
                    first = messageins_queue.get(timeout=1.0)
                except Empty:
                    continue
                senders = batching.waiting_count
        else:
            first, carried = carried, None
            senders = batching.waiting_count + 1
        limit = batch_size(messageins_queue.qsize() + 1, batching.sharers(senders), _messages_per_task)
        batch, carried = take_batch(messageins_queue, first, limit)
        started = time.perf_counter()
        try:
            replies = process_batch(batch, node_info_store, batching.send)
        except AbandonedBatchError:
            return
        elapsed = time.perf_counter() - started
        batching.record(len(batch), elapsed)
        metrics.add_clientapp_runtime(elapsed)
        for reply in replies:
            messageres_queue.put(reply)


def install_batched_workers() -> None:
    """Replace the simulation engine's worker with :func:`batched_worker` (idempotent)."""
    global _workers_installed, _original_worker
    if _workers_installed:
        return
    from flwr.server.superlink.fleet.vce import vce_api

    _original_worker = vce_api.worker
    vce_api.worker = batched_worker
    _workers_installed = True


def install_engine_patches() -> None:
    """Install the fast dispatcher, batched workers and the pipelined actor pool (idempotent)."""
    install_fast_dispatch()
    install_batched_workers()
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
    messages_per_task: int = MAX_BATCH,
) -> None:
    """Run a ServerApp and ClientApp in Flower's Ray-backed simulation engine, in this process.

    ``max_actors`` caps the number of client actors (:func:`actor_limit`); ``messages_per_task``
    is the most messages one Ray task carries to an actor (1: one per task, as Flower sends them).
    """
    from flwr.simulation.run_simulation import _run_simulation
    from flwr.supercore.telemetry import EventType

    global _messages_per_task
    if messages_per_task < 1:
        raise ValueError(f"messages_per_task must be >= 1, got {messages_per_task}")
    _messages_per_task = messages_per_task
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
