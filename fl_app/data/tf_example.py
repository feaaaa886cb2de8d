"""Read ``tf.train.Example`` records without TensorFlow: the rows of TFF's SQLite data sets.

TFF's Stack Overflow file (``stackoverflow.sqlite``, what ``tff.simulation.datasets.stackoverflow``
downloads) keeps each sentence as a serialized ``tf.train.Example`` (column
``serialized_example_proto`` of the table ``examples``). The message is small and fixed
(tensorflow/core/example/example.proto and feature.proto)::

    Example  { Features features = 1; }
    Features { map<string, Feature> feature = 1; }
    Feature  { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2; Int64List int64_list = 3; } }
    BytesList { repeated bytes value = 1; }   FloatList { repeated float value = 1 [packed]; }
    Int64List { repeated int64 value = 1 [packed]; }

:func:`example_features` decodes it with the protocol buffers wire format (varints and
length-delimited fields), which is all the format needs; ``tests/test_text_data.py`` checks it against
messages that the ``protobuf`` library builds from the same definitions.
"""

from __future__ import annotations

import struct

Feature = list[bytes] | list[float] | list[int]


class ExampleError(ValueError):
    """The bytes are not a ``tf.train.Example``."""


def _varint(data: bytes, position: int) -> tuple[int, int]:
    """The varint at ``position`` and the position after it."""
    result, shift = 0, 0
    while True:
        if position >= len(data) or shift > 63:
            raise ExampleError("truncated varint")
        byte = data[position]
        position += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, position
        shift += 7


def _fields(data: bytes) -> list[tuple[int, int, bytes | int]]:
    """Every field of one message: ``(number, wire type, value)`` (bytes for length-delimited ones)."""
    fields: list[tuple[int, int, bytes | int]] = []
    position = 0
    while position < len(data):
        key, position = _varint(data, position)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, position = _varint(data, position)
            fields.append((number, wire, value))
        elif wire == 2:
            length, position = _varint(data, position)
            if position + length > len(data):
                raise ExampleError("truncated field")
            fields.append((number, wire, data[position : position + length]))
            position += length
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            fields.append((number, wire, data[position : position + size]))
            position += size
        else:
            raise ExampleError(f"wire type {wire} is not used by tf.train.Example")
    return fields


def _feature(data: bytes) -> Feature:
    """The values of one ``Feature``."""
    for number, wire, value in _fields(data):
        if wire != 2 or not isinstance(value, bytes):
            continue
        items = [v for n, w, v in _fields(value) if n == 1]
        if number == 1:
            return [bytes(v) for v in items if isinstance(v, bytes)]
        if number == 2:
            return _floats(items)
        if number == 3:
            return _ints(items)
    return []


def _floats(items: list[bytes | int]) -> list[float]:
    out: list[float] = []
    for item in items:
        if isinstance(item, bytes):  # packed (wire 2) or one fixed32 (wire 5): both little-endian floats
            out += [v for (v,) in struct.iter_unpack("<f", item[: len(item) // 4 * 4])]
    return out


def _ints(items: list[bytes | int]) -> list[int]:
    out: list[int] = []
    for item in items:
        if isinstance(item, int):
            out.append(item - (1 << 64) if item >= 1 << 63 else item)
            continue
        position = 0
        while position < len(item):  # packed varints
            value, position = _varint(item, position)
            out.append(value - (1 << 64) if value >= 1 << 63 else value)
    return out


def example_features(data: bytes) -> dict[str, Feature]:
    """The features of a serialized ``tf.train.Example``, by name (``ExampleError`` if it is not one)."""
    features: dict[str, Feature] = {}
    for number, wire, value in _fields(bytes(data)):
        if number != 1 or wire != 2 or not isinstance(value, bytes):
            continue
        for entry_number, entry_wire, entry in _fields(value):
            if entry_number != 1 or entry_wire != 2 or not isinstance(entry, bytes):
                continue
            key, feature = "", b""
            for n, w, v in _fields(entry):
                if n == 1 and w == 2 and isinstance(v, bytes):
                    key = v.decode("utf-8")
                elif n == 2 and w == 2 and isinstance(v, bytes):
                    feature = v
            features[key] = _feature(feature)
    return features
