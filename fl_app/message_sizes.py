"""Message sizes as Flower sends them, computed once per content layout (the grid's metering).

A message's size is the size of its content serialised the way Flower sends it: the sum of the
serialised objects of its object tree (records, arrays, array chunks). Used by
:class:`fl_app.metering.MeteredGrid` and by a cohort message's members
(:mod:`fl_app.cohort_messages`), which weigh the plain replies they stand for.
"""

from __future__ import annotations

from typing import Any

from flwr.app import ArrayRecord, Message

from fl_app.engine.messages import MAX_ARRAY_CHUNK_BYTES, content_bytes

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
