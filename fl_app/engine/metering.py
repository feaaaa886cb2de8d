"""Real message sizes: a Grid wrapper that counts the bytes of every message.

A message's size is the size of its content serialised the way Flower sends
it: the sum of the serialised objects of its object tree (records, arrays,
array chunks). ``upload`` is what clients send, ``download`` what they receive.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid

from fl_app.engine.client_states import ClientStates, carry
from fl_app.engine.dispatch import (
    MESSAGES_PUSHED,
    REPLIES_STORED,
    adaptive_interval,
    is_in_memory_grid,
    replied_ids,
    simulated_partitions,
)
from fl_app.engine.message_sizes import array_payload_bytes, message_bytes
from fl_app.engine.messages import LINK_NODE_ID, Broadcast, set_reply_source
from fl_app.engine.packed import metered, pack, packable, unpack
from fl_app.learning.sums import Summand, is_partial_sum
from fl_app.run.lifecycle import raise_if_stopped

#: Most message ids named in one pull of the in-memory grid (see ``MeteredGrid._exchange``).
PULL_WINDOW = 128
#: Seconds between pulls that name every pending id, not only those with a stored reply.
FULL_PULL_S = 0.5


def attribute_link_errors(outgoing: Sequence[Message], replies: list[Message]) -> list[Message]:
    """Credit the SuperLink's error replies to the node the message was for.

    When a SuperNode is gone (killed, disconnected), the SuperLink answers its message itself
    with a "node unavailable" error whose sender is the SuperLink (node id
    ``SUPERLINK_NODE_ID``), not the node. The strategy must see that the *client* failed (one
    log line naming it), not a reply from an unknown node plus a client that "did not reply
    in time". Flower's ``Metadata`` has no setter for the sender
    (:func:`fl_app.engine.messages.set_reply_source`).
    """
    destination: dict[str, int] | None = None  # built only when the link answered for a node
    for reply in replies:
        metadata = reply.metadata
        if metadata.src_node_id == LINK_NODE_ID and reply.has_error():
            if destination is None:
                destination = {m.metadata.message_id: m.metadata.dst_node_id for m in outgoing}
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
        #: The stateful clients' records, carried in their messages (a simulation; None: none kept).
        self.client_states: ClientStates | None = None
        #: Bulk messages a packable round goes as (one per worker; 0: packed messages of one block).
        self.bulk_shares = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def get_node_ids(self) -> Iterable[int]:
        """Node ids of the connected SuperNodes."""
        return self._grid.get_node_ids()

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None, summand: Summand | None = None
    ) -> Iterable[Message]:
        """Send, wait for replies, and count both directions.

        With ``summand`` (the strategy's, :func:`fl_app.run.round_loop.packing_summand`) a
        simulation sends the round as packed messages (:meth:`_exchange_in_memory`); the messages and
        replies are counted as the plain ones would weigh.
        """
        outgoing = messages if isinstance(messages, Broadcast) else list(messages)
        self._count_outgoing(outgoing)
        if not outgoing:
            return []
        if is_in_memory_grid(self._grid):
            replies = self._exchange_in_memory(outgoing, timeout, summand)
        else:  # a deployment's SuperLink: Flower's own pacing
            replies = list(self._grid.send_and_receive(outgoing, timeout=timeout))
            for reply in replies:
                self._count_reply(reply)
        return attribute_link_errors(outgoing, replies)

    def _count_outgoing(self, outgoing: Sequence[Message]) -> None:
        """Count the messages and their bytes (a content sent to many nodes weighed once)."""
        if isinstance(outgoing, Broadcast):  # every message weighs what the first one does
            if outgoing:
                probe = outgoing.to(outgoing.node_ids[:1])[0]
                category = outgoing.message_type.split(".")[0]
                self._counts[f"{category}_download_bytes"] += message_bytes(probe) * len(outgoing)
                self._counts[f"{category}_download_array_bytes"] += array_payload_bytes(probe) * len(outgoing)
                self._counts[f"{category}_messages"] += len(outgoing)
            return
        sizes: dict[int, tuple[int, int]] = {}
        for message in outgoing:
            category = message.metadata.message_type.split(".")[0]
            key = id(message.content)
            if key not in sizes:
                sizes[key] = (message_bytes(message), array_payload_bytes(message))
            self._counts[f"{category}_download_bytes"] += sizes[key][0]
            self._counts[f"{category}_download_array_bytes"] += sizes[key][1]
            self._counts[f"{category}_messages"] += 1

    def _carrying(self, messages: list[Message], partitions: dict[int, int] | None) -> list[Message]:
        """``messages``, each with its client's state records when the run keeps client states."""
        if self.client_states is None or partitions is None:
            return messages
        states = self.client_states
        return [
            Message(
                content=carry(m.content, states.of(partitions[int(m.metadata.dst_node_id)])),
                dst_node_id=m.metadata.dst_node_id,
                message_type=m.metadata.message_type,
                group_id=m.metadata.group_id,
            )
            for m in messages
        ]

    def _receive(self, reply: Message, partitions: dict[int, int] | None) -> None:
        """Move a reply's client state into the store (before anyone reads it), then count the reply."""
        if self.client_states is not None and partitions is not None:
            if is_partial_sum(reply):
                self.client_states.take_packed(reply)
            else:
                self.client_states.take_from(reply, partitions.get(int(reply.metadata.src_node_id), -1))
        self._count_reply(reply)

    def _count_reply(self, reply: Message) -> None:
        """Count a reply; a packed message's reply as its members' plain replies (:func:`metered`).

        ``<category>_replies`` and ``_upload_bytes`` count every reply, error replies included;
        ``_ok_replies`` and ``_ok_upload_bytes`` only the replies with content (a packed reply's
        members that succeeded: its failed members come as error replies of their own).
        """
        category = reply.metadata.message_type.split(".")[0]
        weighed = metered(reply)
        size, array_size, count = (
            weighed if weighed is not None else (message_bytes(reply), array_payload_bytes(reply), 1)
        )
        self._counts[f"{category}_upload_bytes"] += size
        self._counts[f"{category}_upload_array_bytes"] += array_size
        self._counts[f"{category}_replies"] += count
        if not reply.has_error():
            self._counts[f"{category}_ok_upload_bytes"] += size
            self._counts[f"{category}_ok_replies"] += count

    def _exchange_in_memory(
        self, messages: list[Message], timeout: float | None, summand: Summand | None
    ) -> list[Message]:
        """:meth:`_exchange`, with a round of a summed aggregation sent as packed messages.

        Packed (:func:`fl_app.engine.packed.pack`) when there is a ``summand``, the messages can
        go together (:func:`~fl_app.engine.packed.packable`) and the engine's node numbering is
        known; the replies, counted after :func:`~fl_app.engine.packed.unpack`, weigh what the
        members' plain replies would have. With :attr:`bulk_shares` (a client that does exactly what
        FedAvg's does, no state kept) the round goes as that many bulk messages (:mod:`fl_app.engine.bulk`).
        """
        partitions = simulated_partitions(self._grid)
        if summand is None or partitions is None or not packable(messages):
            return self._exchange(self._carrying(messages, partitions), timeout, partitions=partitions)[1]
        shares = self.bulk_shares if self.client_states is None else 0
        packed = pack(
            messages, partitions=partitions, summand=summand, states=self.client_states, shares=shares
        )
        pushed, replies = self._exchange([c.message for c in packed], timeout, count=False)
        replies = unpack(replies, packed, pushed)
        for reply in replies:
            self._receive(reply, partitions)
        return replies

    def _exchange(
        self,
        messages: list[Message],
        timeout: float | None,
        *,
        count: bool = True,
        partitions: dict[int, int] | None = None,
    ) -> tuple[list[str], list[Message]]:
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
        clients still train. A stop request (:mod:`fl_app.run.lifecycle`) abandons the
        wait at once.
        """
        pushed = list(self._grid.push_messages(messages))
        order = list(pushed)
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
            for reply in pulled if count else ():  # while the other clients still work
                self._receive(reply, partitions)
            pending.difference_update(reply.metadata.reply_to_message_id for reply in pulled)
            if not pending or expired:
                break
            if not pulled:
                REPLIES_STORED.wait(adaptive_interval(time.perf_counter() - started, started - began))
        return pushed, replies

    def take(self) -> dict[str, float]:
        """Return the counters since the last call and reset them."""
        counts, self._counts = dict(self._counts), defaultdict(float)
        return counts
