"""Real message sizes: a Grid wrapper that counts the bytes of every message.

A message's size is the size of its content serialised the way Flower sends
it: the sum of the serialised objects of its object tree (records, arrays,
array chunks). ``upload`` is what clients send, ``download`` what they receive.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects


def content_bytes(message: Message) -> int:
    """Serialised size of a message's content (0 for error replies)."""
    if not message.has_content():
        return 0
    objects = get_all_nested_objects(message.content)
    return sum(len(obj.deflate()) for obj in objects.values())


def array_payload_bytes(message: Message) -> int:
    """Raw bytes of the array data in a message's ArrayRecords (no framing)."""
    if not message.has_content():
        return 0
    return sum(
        len(array.data) for record in message.content.array_records.values() for array in record.values()
    )


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
                sizes[key] = (content_bytes(message), array_payload_bytes(message))
            self._counts[f"{category}_download_bytes"] += sizes[key][0]
            self._counts[f"{category}_download_array_bytes"] += sizes[key][1]
            self._counts[f"{category}_messages"] += 1
        replies = list(self._grid.send_and_receive(outgoing, timeout=timeout)) if outgoing else []
        for reply in replies:
            category = reply.metadata.message_type.split(".")[0]
            self._counts[f"{category}_upload_bytes"] += content_bytes(reply)
            self._counts[f"{category}_upload_array_bytes"] += array_payload_bytes(reply)
            self._counts[f"{category}_replies"] += 1
        return replies

    def take(self) -> dict[str, float]:
        """Return the counters since the last call and reset them."""
        counts, self._counts = dict(self._counts), defaultdict(float)
        return counts
