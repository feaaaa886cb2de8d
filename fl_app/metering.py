"""Real message sizes: a Grid wrapper that counts the bytes of every message.

A message's size is the size of its content serialised the way Flower sends
it: the sum of the serialised objects of its object tree (records, arrays,
array chunks). ``upload`` is what clients send, ``download`` what they receive.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from flwr.app import ArrayRecord, Message
from flwr.serverapp import Grid

from fl_app.engine.dispatch import (
    MESSAGES_PUSHED,
    REPLIES_STORED,
    adaptive_interval,
    is_in_memory_grid,
    replied_ids,
)
from fl_app.engine.messages import LINK_NODE_ID, MAX_ARRAY_CHUNK_BYTES, content_bytes, set_reply_source
from fl_app.lifecycle import raise_if_stopped

#: Most message ids named in one pull of the in-memory grid (see ``MeteredGrid._exchange``).
PULL_WINDOW = 128
#: Seconds between pulls that name every pending id, not only those with a stored reply.
FULL_PULL_S = 0.5

#: Serialised sizes by content layout (see :func:`message_bytes`).
_SIZES: dict[tuple[Any, ...], int] = {}
_MAX_SIZES = 4096


def content_layout(message: Message) -> tuple[Any, ...]:
    """Everything the serialised size of a message's content depends on, cheaply.

    Flower serialises a content as its distinct nested objects (records,
    arrays, array chunks of at most ``MAX_ARRAY_CHUNK_BYTES``
    bytes); an object refers to its children by fixed-length SHA-256 ids, so
    the total length is fixed by: the record names and kinds, each array's
    name, dtype, shape, serialisation type and data length, which chunks are
    byte-identical (identical objects are sent once), and the serialised
    length of every small record (and which of those are identical). This
    tuple holds exactly that; chunks are compared byte by byte, after a cheap
    fingerprint (length, first and last 32 bytes), so the layout is exact.
    """
    groups: dict[tuple[int, bytes, bytes], list[tuple[int, memoryview]]] = {}
    small: dict[bytes, int] = {}
    parts: list[tuple[Any, ...]] = []
    for name, record in message.content.items():
        if isinstance(record, ArrayRecord):
            arrays = []
            for key, array in record.items():
                view = memoryview(array.data).cast("B")
                chunks = []
                for start in range(0, len(view), MAX_ARRAY_CHUNK_BYTES):
                    chunk = view[start : start + MAX_ARRAY_CHUNK_BYTES]
                    bucket = groups.setdefault((len(chunk), bytes(chunk[:32]), bytes(chunk[-32:])), [])
                    group = next((gid for gid, other in bucket if other == chunk), None)
                    if group is None:
                        group = sum(len(b) for b in groups.values())
                        bucket.append((group, chunk))
                    chunks.append(group)
                arrays.append((key, array.dtype, tuple(array.shape), array.stype, len(view), tuple(chunks)))
            parts.append((name, "ArrayRecord", tuple(arrays)))
        else:
            body = record.deflate()
            parts.append((name, type(record).__name__, len(body), small.setdefault(body, len(small))))
    return tuple(parts)


def message_bytes(message: Message) -> int:
    """:func:`content_bytes`, computed once per content layout (:func:`content_layout`).

    Serialising and hashing a 0.4 MB model reply costs about 0.5 ms of the
    server's time per reply (more under load); at 100 replies a round that was
    a large share of a cross-device round. Replies of one run share few layouts.
    """
    if not message.has_content():
        return 0
    layout = content_layout(message)
    size = _SIZES.get(layout)
    if size is None:
        if len(_SIZES) >= _MAX_SIZES:
            _SIZES.clear()
        size = _SIZES[layout] = content_bytes(message)
    return size


def array_payload_bytes(message: Message) -> int:
    """Raw bytes of the array data in a message's ArrayRecords (no framing)."""
    if not message.has_content():
        return 0
    return sum(
        len(array.data) for record in message.content.array_records.values() for array in record.values()
    )


def attribute_link_errors(outgoing: list[Message], replies: list[Message]) -> list[Message]:
    """Credit the SuperLink's error replies to the node the message was for.

    When a SuperNode is gone (killed, disconnected), the SuperLink answers its message itself
    with a "node unavailable" error whose sender is the SuperLink (node id
    ``SUPERLINK_NODE_ID``), not the node. The strategy must see that the *client* failed (one
    log line naming it), not a reply from an unknown node plus a client that "did not reply
    in time". Flower's ``Metadata`` has no setter for the sender
    (:func:`fl_app.engine.messages.set_reply_source`).
    """
    destination = {message.metadata.message_id: message.metadata.dst_node_id for message in outgoing}
    for reply in replies:
        metadata = reply.metadata
        if metadata.src_node_id == LINK_NODE_ID and reply.has_error():
            node = destination.get(metadata.reply_to_message_id)
            if node is not None:
                set_reply_source(reply, node)
    return replies


class MeteredGrid:
    """Wraps a :class:`~flwr.serverapp.Grid` and counts message bytes per message category.

    Counters accumulate until :meth:`take` returns and resets them.
    """

    def __init__(self, grid: Grid) -> None:
        self._grid = grid
        self._counts: dict[str, float] = defaultdict(float)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def get_node_ids(self) -> Iterable[int]:
        """Node ids of the connected SuperNodes."""
        return self._grid.get_node_ids()

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        """Send, wait for replies, and count both directions."""
        outgoing = list(messages)
        sizes: dict[int, tuple[int, int]] = {}
        for message in outgoing:
            category = message.metadata.message_type.split(".")[0]
            key = id(message.content)
            if key not in sizes:
                sizes[key] = (message_bytes(message), array_payload_bytes(message))
            self._counts[f"{category}_download_bytes"] += sizes[key][0]
            self._counts[f"{category}_download_array_bytes"] += sizes[key][1]
            self._counts[f"{category}_messages"] += 1
        if not outgoing:
            return []
        if is_in_memory_grid(self._grid):
            replies = self._exchange(outgoing, timeout)  # counts each reply as it arrives
        else:  # a deployment's SuperLink: Flower's own pacing
            replies = list(self._grid.send_and_receive(outgoing, timeout=timeout))
            for reply in replies:
                self._count_reply(reply)
        return attribute_link_errors(outgoing, replies)

    def _count_reply(self, reply: Message) -> None:
        category = reply.metadata.message_type.split(".")[0]
        self._counts[f"{category}_upload_bytes"] += message_bytes(reply)
        self._counts[f"{category}_upload_array_bytes"] += array_payload_bytes(reply)
        self._counts[f"{category}_replies"] += 1

    def _exchange(self, messages: list[Message], timeout: float | None) -> list[Message]:
        """Push ``messages`` and pull their replies until all arrived or ``timeout`` passed.

        For the simulation's in-memory grid: Flower's ``Grid.send_and_receive``
        with a polling interval that adapts to the cost of a pull (a few
        milliseconds when pulls are cheap) instead of a fixed 100 ms, which at a
        0.25 s cross-device round was a large share of the round; each pull names
        at most ``PULL_WINDOW`` ids (a 5000-client roster query named all 5000 in
        every pull, which then took most of the server's time), and between full
        pulls only the ids whose reply has arrived (:func:`fl_app.engine.dispatch.replied_ids`:
        a pull of 100 pending ids every few milliseconds was a fifth of the server's
        time in a cross-device round). Each reply is metered as it arrives, while the other
        clients still train. A stop request (:mod:`fl_app.lifecycle`) abandons the
        wait at once.
        """
        order = list(self._grid.push_messages(messages))
        MESSAGES_PUSHED.set()
        pending = set(order)
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        began = last_full = time.perf_counter()
        while pending:
            raise_if_stopped()  # SIGINT/SIGTERM: abandon the round
            started = time.perf_counter()
            REPLIES_STORED.clear()  # a reply stored after this wakes the wait below
            # A pull costs time in proportion to the ids it names (Flower checks each): name only
            # the ids whose reply the engine has stored; every FULL_PULL_S, and at the deadline,
            # name all pending ids (at most PULL_WINDOW, oldest first, except at the deadline), so
            # Flower turns expired messages and lost nodes into error replies.
            order = [msg_id for msg_id in order if msg_id in pending]
            expired = deadline is not None and time.monotonic() >= deadline
            window = replied_ids(self._grid, order)
            if expired or window is None or started - last_full >= FULL_PULL_S:
                window = order if expired else order[:PULL_WINDOW]
                last_full = started
            pulled = list(self._grid.pull_messages(window)) if window else []
            replies.extend(pulled)
            for reply in pulled:  # while the other clients still work
                self._count_reply(reply)
            pending.difference_update(reply.metadata.reply_to_message_id for reply in pulled)
            if not pending or expired:
                break
            if not pulled:
                REPLIES_STORED.wait(adaptive_interval(time.perf_counter() - started, started - began))
        return replies

    def take(self) -> dict[str, float]:
        """Return the counters since the last call and reset them."""
        counts, self._counts = dict(self._counts), defaultdict(float)
        return counts
