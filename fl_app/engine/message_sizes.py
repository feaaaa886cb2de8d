"""Message sizes as Flower sends them, computed once per content layout (the grid's metering).

A message's size is the size of its content serialised the way Flower sends it: the sum of the
serialised objects of its object tree (records, arrays, array chunks). Used by
:class:`fl_app.engine.metering.MeteredGrid` and by a packed message's members
(:mod:`fl_app.engine.packed`), which weigh the plain replies they stand for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from fl_app import keys
from fl_app.engine.messages import MAX_ARRAY_CHUNK_BYTES, record_dict_bytes
from fl_app.learning.train_results import TrainResult
from fl_app.learning.training import npy_parts

#: Serialised sizes by content layout (see :func:`message_bytes`).
_SIZES: dict[tuple[Any, ...], int] = {}
_MAX_SIZES = 4096
_FINGERPRINT = 32


class _Chunks:
    """Numbers an object tree's array chunks, byte-identical chunks alike (Flower sends those once).

    Chunks are compared by a cheap fingerprint (length, first and last 32 bytes), then byte by byte.
    An array's data is given as two parts, its ``.npy`` header and its values (:func:`npy_parts`),
    which are not joined unless two chunks' fingerprints collide.
    """

    def __init__(self) -> None:
        self.groups: dict[tuple[int, bytes, bytes], list[tuple[int, bytes, memoryview, int, int]]] = {}
        self.count = 0

    def numbers(self, head: bytes, body: memoryview) -> tuple[int, ...]:
        """The chunk numbers of the data ``head + body``, chunks of ``MAX_ARRAY_CHUNK_BYTES``."""
        return tuple(
            self._number(head, body, start, stop) for start, stop in _chunk_bounds(len(head) + len(body))
        )

    def _number(self, head: bytes, body: memoryview, start: int, stop: int) -> int:
        first = _joined(head, body, start, min(stop, start + _FINGERPRINT))
        last = _joined(head, body, max(start, stop - _FINGERPRINT), stop)
        bucket = self.groups.setdefault((stop - start, first, last), [])
        if bucket:
            whole = _joined(head, body, start, stop)
            for number, *other in bucket:
                if _joined(*other) == whole:
                    return number
        bucket.append((self.count, head, body, start, stop))
        self.count += 1
        return self.count - 1


def _joined(head: bytes, body: memoryview, start: int, stop: int) -> bytes:
    """Bytes ``start:stop`` of ``head + body``, without joining the rest."""
    split = len(head)
    if start >= split:
        return bytes(body[start - split : stop - split])
    if stop <= split:
        return head[start:stop]
    return head[start:] + bytes(body[: stop - split])


#: ``str(dtype)`` by dtype (numpy formats it in Python: several microseconds per array).
_DTYPE_NAMES: dict[np.dtype, str] = {}


def _dtype_name(dtype: np.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype)
    return name


def _array_layout(
    name: str, arrays: Iterable[tuple[str, str, tuple[int, ...], str, bytes, memoryview]], chunks: _Chunks
) -> tuple[Any, ...]:
    """An ArrayRecord's part of a layout: each array's name, dtype, shape, stype, data length, chunks."""
    return (
        name,
        "ArrayRecord",
        tuple(
            (key, dtype, shape, stype, len(head) + len(body), chunks.numbers(head, body))
            for key, dtype, shape, stype, head, body in arrays
        ),
    )


def _small_layout(name: str, record: Any, small: dict[bytes, int]) -> tuple[Any, ...]:
    """A small record's part of a layout: its kind, serialised length and which of those are identical."""
    body = record.deflate()
    return (name, type(record).__name__, len(body), small.setdefault(body, len(small)))


def content_layout(message: Message) -> tuple[Any, ...]:
    """Everything the serialised size of a message's content depends on, cheaply.

    Flower serialises a content as its distinct nested objects (records,
    arrays, array chunks of at most ``MAX_ARRAY_CHUNK_BYTES``
    bytes); an object refers to its children by fixed-length SHA-256 ids, so
    the total length is fixed by: the record names and kinds, each array's
    name, dtype, shape, serialisation type and data length, which chunks are
    byte-identical (identical objects are sent once), and the serialised
    length of every small record (and which of those are identical). This
    tuple holds exactly that (chunks compared exactly: :class:`_Chunks`).
    """
    chunks, small = _Chunks(), {}
    parts: list[tuple[Any, ...]] = []
    for name, record in message.content.items():
        if isinstance(record, ArrayRecord):
            arrays = (
                (key, a.dtype, tuple(a.shape), a.stype, b"", memoryview(a.data).cast("B"))
                for key, a in record.items()
            )
            parts.append(_array_layout(name, arrays, chunks))
        else:
            parts.append(_small_layout(name, record, small))
    return tuple(parts)


#: The arrays' part of result layouts by the arrays' names, dtypes, shapes and memory order, for results
#: whose chunks all differ in length: no two of them can be identical, so the part is the same for every
#: result of that signature (None: some chunks have equal lengths, and are compared every time).
_DISTINCT_PARTS: dict[tuple[Any, ...], tuple[Any, ...] | None] = {}


def _result_array_layout(result: TrainResult) -> tuple[Any, ...]:
    """The arrays' part of :func:`result_layout`; found once per signature where chunk lengths all differ.

    A member of a packed message weighs its plain reply (:mod:`fl_app.engine.packed`): comparing its
    chunks' first and last bytes was about 30 us of every member's bookkeeping, for a model whose
    arrays all have different sizes (every model here) a comparison that can never find a pair.
    """
    signature: tuple[Any, ...] | None = tuple(
        (key, values.dtype, values.shape, values.flags.c_contiguous, values.flags.f_contiguous)
        for key, values in result.arrays.items()
    )
    if any(values.dtype.hasobject for values in result.arrays.values()):
        signature = None  # pickled: its length depends on the values
    known = _DISTINCT_PARTS.get(signature) if signature is not None else None
    if known is not None:
        return known
    arrays = (
        (key, _dtype_name(values.dtype), tuple(values.shape), "numpy.ndarray", *npy_parts(values))
        for key, values in result.arrays.items()
    )
    layout = _array_layout(keys.ARRAYS, arrays, _Chunks())
    if signature is not None and signature not in _DISTINCT_PARTS:
        if len(_DISTINCT_PARTS) >= _MAX_SIZES:
            _DISTINCT_PARTS.clear()
        lengths = [stop - start for *_, length, _ in layout[2] for start, stop in _chunk_bounds(length)]
        _DISTINCT_PARTS[signature] = layout if len(set(lengths)) == len(lengths) else None
    return layout


def _chunk_bounds(length: int) -> list[tuple[int, int]]:
    """Where the chunks of a data of ``length`` bytes start and stop (``MAX_ARRAY_CHUNK_BYTES`` each)."""
    return [
        (start, min(start + MAX_ARRAY_CHUNK_BYTES, length))
        for start in range(0, length, MAX_ARRAY_CHUNK_BYTES)
    ]


def result_layout(result: TrainResult) -> tuple[Any, ...]:
    """:func:`content_layout` of the reply :meth:`TrainResult.content` would make, without making it."""
    layout = _result_array_layout(result)
    if result.metrics is None:
        return (layout,)
    return (layout, _small_layout(keys.METRICS, MetricRecord(dict(result.metrics)), {}))


def message_bytes(message: Message) -> int:
    """``content_bytes`` (:mod:`fl_app.engine.messages`), computed once per layout (:func:`content_layout`).

    Serialising and hashing a 0.4 MB model reply costs about 0.5 ms of the
    server's time per reply (more under load); at 100 replies a round that was
    a large share of a cross-device round. Replies of one run share few layouts.
    """
    if not message.has_content():
        return 0
    return _size(content_layout(message), lambda: message.content)


def result_bytes(result: TrainResult) -> tuple[int, int]:
    """What the reply of ``result`` would weigh: :func:`message_bytes` and :func:`array_payload_bytes`."""
    if result.records:  # an algorithm's own records: weighed as encoded (no layout cache for them)
        content = result.content()
        payload = sum(len(a.data) for record in content.array_records.values() for a in record.values())
        return record_dict_bytes(content), payload
    layout = result_layout(result)
    _, _, arrays = layout[0]  # each array's data length is in its layout: no second pass over them
    return _size(layout, result.content), sum(length for _, _, _, _, length, _ in arrays)


def _size(layout: tuple[Any, ...], content: Callable[[], RecordDict]) -> int:
    """The serialised size of contents of ``layout``, computed from ``content()`` once per layout."""
    size = _SIZES.get(layout)
    if size is None:
        if len(_SIZES) >= _MAX_SIZES:
            _SIZES.clear()
        size = _SIZES[layout] = record_dict_bytes(content())
    return size


def array_payload_bytes(message: Message) -> int:
    """Raw bytes of the array data in a message's ArrayRecords (no framing)."""
    if not message.has_content():
        return 0
    return sum(
        len(array.data) for record in message.content.array_records.values() for array in record.values()
    )
