"""Several messages per Ray task: the engine's worker threads and Flower's actor, replaced.

:func:`install_batched_workers` replaces the simulation engine's worker threads
(``vce_api.worker``, flwr 1.41): each takes several queued messages (an even share of the queue among
the idle senders, or among all actor slots when messages are heavy, at most
``simulation.messages_per_task``: :meth:`Batching.sharers`) and sends them to an actor in one Ray
task (:class:`BatchingActor`'s ``run_batch``, a ``ClientAppActor`` with one more method). On these
2 cores Ray costs about 1.5 ms of CPU per task on each side, more than a cross-device client's own
work; a batch pays it once, and the global model that the messages of a round share travels once
per batch (pickle keeps one copy of an object several messages reference). Each message still runs
through the ClientApp on its own with its node's Context and gets its own reply or error reply, with
the codes and reasons Flower's worker gives; a batch never holds two messages for one node. When the
run stops (the ServerApp ended, e.g. on Ctrl-C), a worker waiting for a batch abandons it
(:class:`AbandonedBatchError`) instead of waiting for the actor to finish it: Flower then ends the
actors, and a stopped run exits in seconds rather than after the batch.
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

from fl_app.engine.messages import client_app_error, log_client_error, raised_in_client_app, set_message_id
from fl_app.keys import PACKED
from fl_app.learning.records import config_record

#: How often a worker waiting for a batch looks whether the run has stopped (seconds).
STOP_POLL_S = 0.5
#: How long an idle engine thread waits for a message before it looks whether the engine stopped.
#: Flower's own threads wait 1 s, which every run waited out after its last round (the engine ends
#: when its threads have seen the stop); 0.1 s costs a few wake-ups a second.
QUEUE_WAIT_S = 0.1


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


def set_messages_per_task(limit: int) -> None:
    """The most messages one Ray task carries to an actor here (``simulation.messages_per_task``)."""
    global _messages_per_task
    _messages_per_task = limit


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
        """Whether the engine or the run is stopping: batches in flight are abandoned.

        The engine stops when its ServerApp ended; the run when a signal asked it to
        (:func:`fl_app.run.lifecycle.stop_requested`), which may also have ended the actors.
        """
        from fl_app.run.lifecycle import stop_requested

        engine_stopping = self.stop_event is not None and self.stop_event.is_set()
        return engine_stopping or stop_requested() is not None


def _no_sender(jobs: list[Job]) -> list[Outcome]:
    raise RuntimeError("Batching.send was not set")


def run_jobs(client_app_fn: Callable[[], Any], jobs: list[Job]) -> list[Outcome]:
    """Run each ``(message, context)`` through the ClientApp, in order (an actor's ``run_batch``).

    Returns one outcome per job: ``("reply", message, context)``, or ``("error", code, reason,
    traceback)`` when the ClientApp raised (as Flower's actor wraps it, ``ClientAppException``;
    the Context is then not updated, as in Flower). A ClientApp that cannot be loaded fails
    every job of the batch with ``LoadClientAppError``, as it fails every message in Flower.
    """
    import traceback

    from flwr.clientapp.client_app import LoadClientAppError

    try:
        app = client_app_fn()
    except LoadClientAppError as ex:
        code, reason = client_app_error(ex)
        return [("error", code, reason, traceback.format_exc()) for _ in jobs]
    outcomes: list[Outcome] = []
    with cohort_hook(jobs):
        for message, context in jobs:
            try:
                reply = app(message=message, context=context)
            except Exception as ex:  # reported as the message's error reply
                code, reason = raised_in_client_app(ex)
                outcomes.append(("error", code, reason, traceback.format_exc()))
                continue
            outcomes.append(("reply", reply, context))
    return outcomes


def cohort_hook(jobs: list[Job]) -> contextlib.AbstractContextManager[Any]:
    """What trains the batch's train messages as one computation before they run one by one.

    :func:`fl_app.client_app.trained_vectorised` (``simulation.vectorise``); nothing where the
    ClientApp's modules cannot be imported (that error is each message's, reported by the loop).
    """
    try:
        from fl_app.client_app import trained_vectorised
    except Exception:
        return contextlib.nullcontext()
    return trained_vectorised(jobs)


def warm_up_client_process() -> None:
    """Import what the first message needs when a client actor starts (torch alone takes about 1 s).

    :func:`fl_app.engine.pool.prestart_actors` overlaps it with the driver's set-up. An import that
    fails here fails again, reported, at the first message.
    """
    with contextlib.suppress(Exception):
        from fl_app.client_app import warm_up

        warm_up()


class BatchingActor:
    """Flower's ``ClientAppActor`` with ``run_batch``: several messages in one Ray task.

    Made a Ray actor class by :func:`batching_actor_type` (lazily: importing Ray costs a
    deployment's ServerApp a second for nothing). ``run`` is Flower's own one-message call.
    """

    def __init__(self, on_actor_init_fn: Callable[[], None] | None = None) -> None:
        if on_actor_init_fn:
            on_actor_init_fn()
        warm_up_client_process()

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
    ``stopped()`` turns true before the batch is done (looked at every :data:`STOP_POLL_S`) or
    holds when it failed.
    """
    import ray

    def send(jobs: list[Job]) -> list[Outcome]:
        pool = backend.pool
        future = pool.submit(
            lambda actor, app_fn, batch, _cid, _context: actor.run_batch.remote(app_fn, batch),
            (backend.app_fn, jobs, "", None),
        )
        abandoned = f"the run stopped with {len(jobs)} messages at an actor"
        try:
            while not ray.wait([future], timeout=STOP_POLL_S)[0]:
                if stopped():
                    raise AbandonedBatchError(abandoned)
            try:
                return list(ray.get(future))
            except Exception as error:  # e.g. SIGTERM to the process group ended the actor too
                if stopped():
                    raise AbandonedBatchError(abandoned) from error
                raise
        finally:
            pool.add_actor_back_to_pool(future)

    return send


def take_batch(queue: Queue[Any], first: Any, limit: int) -> tuple[list[Any], Any]:
    """``first`` and up to ``limit - 1`` more queued messages, each for a different node.

    Returns the batch and the message that stopped it because its node is already in the batch
    or it is a packed message (None if none did): the caller starts its next batch with it, so a
    node's messages keep their order and never share a task (each would need the Context the other
    leaves), and a packed message goes alone (:func:`is_packed_message`).
    """
    batch, nodes = [first], {first.metadata.dst_node_id}
    while len(batch) < limit and not is_packed_message(first):
        try:
            message = queue.get_nowait()
        except Empty:
            break
        if message.metadata.dst_node_id in nodes or is_packed_message(message):
            return batch, message
        batch.append(message)
        nodes.add(message.metadata.dst_node_id)
    return batch, None


def is_packed_message(message: Any) -> bool:
    """Whether ``message`` carries a block of clients (:mod:`fl_app.engine.packed`): a task of its own.

    A packed message is 16 clients' work: batched with others, a cross-device round of 7 of them went
    to two workers as 4 + 3 (64 and 36 clients, the round as long as the 64); one per task, the workers
    pull them as they free up (52 and 48). On forked workers one per task made the round 8-19 % shorter
    (docs/benchmarks/pfl_research.md); on Ray's actors it made no difference.
    """
    return message.has_content() and config_record(message.content, PACKED) is not None


def process_batch(
    batch: list[Any],
    node_info_store: dict[int, Any],
    send: Sender,
) -> list[Any]:
    """The replies to ``batch`` (one per message, in order), Contexts updated as Flower's worker does."""
    from flwr.app import Message
    from flwr.app.error import Error
    from flwr.common import log

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
                log_client_error(reason, remote_traceback)
            reply = Message(Error(code=code, reason=reason), reply_to=message)
        set_message_id(reply, str(uuid4()))
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
                    first = messageins_queue.get(timeout=QUEUE_WAIT_S)
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
