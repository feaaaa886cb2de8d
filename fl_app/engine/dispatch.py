"""The simulation engine's message dispatcher and reply store, replaced (flwr 1.41 private APIs).

:func:`install_fast_dispatch` replaces ``vce_api.add_messages_to_queue`` and
``vce_api.put_message_into_state``. Flower's dispatcher asks the in-memory LinkState once *per
registered node* for that node's next message, and each ask walks every stored message:
``N x stored`` checks per sweep, ten sweeps a second, for the whole run. At 1000 nodes and 100
messages in flight that is a CPU core spent on dispatch (the cross-device round was 7.7x plain
PyTorch, docs/benchmarks/platform.md), and the 1000-message roster query alone took 30 s. The
replacement walks
the stored messages once per sweep, hands out the same messages (undelivered, not expired, one per
node per sweep, marked delivered exactly as ``get_message_ins`` does), and polls with an interval
that adapts to its own cost instead of a fixed 100 ms. Other LinkState implementations fall back
to Flower's function. The reply store signals each burst of stored replies
(:data:`REPLIES_STORED`) and the server signals its pushes (:data:`MESSAGES_PUSHED`), so neither
side waits for its next poll. :func:`replied_ids` reads which replies the in-memory LinkState
holds (the server's pull then names only those).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from queue import Empty, Queue
from typing import Any

from fl_app.engine.batching import QUEUE_WAIT_S

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
            reply = queue.get(timeout=QUEUE_WAIT_S)
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


#: The simulation engine's node id -> partition id mapping of the latest run started in this process.
_node_partitions: dict[int, int] = {}


def forget_node_partitions() -> None:
    """Drop the previous run's node numbering (a sweep's next run registers new nodes)."""
    _node_partitions.clear()


def simulated_partitions(grid: Any) -> dict[int, int] | None:
    """Each simulated node's partition id, as the engine assigned them (None outside a simulation).

    The engine numbers the nodes it registers 0..N-1 (``vce_api._register_nodes``, recorded by
    :func:`install_fast_dispatch`); the server can then build its roster without asking N nodes
    (10,000 roster queries took 7 s, measured with benchmarks/startup.py).
    """
    if not is_in_memory_grid(grid) or not _node_partitions:
        return None
    return dict(_node_partitions)


def install_fast_dispatch() -> None:
    """Replace the simulation engine's dispatcher and reply store (idempotent; module docstring)."""
    global _installed, _original_dispatch, _original_store
    if _installed:
        return
    from flwr.server.superlink.fleet.vce import vce_api

    _original_dispatch = vce_api.add_messages_to_queue
    _original_store = vce_api.put_message_into_state
    vce_api.add_messages_to_queue = fast_add_messages_to_queue
    vce_api.put_message_into_state = signalling_put_message_into_state
    register_nodes = vce_api._register_nodes

    def recording_register_nodes(num_nodes: int, state_factory: Any) -> dict[int, int]:
        mapping = register_nodes(num_nodes, state_factory)
        _node_partitions.clear()
        _node_partitions.update(mapping)
        return mapping

    vce_api._register_nodes = recording_register_nodes
    _installed = True
