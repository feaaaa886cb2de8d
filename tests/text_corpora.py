"""Small text corpora built inside the tests, in every format the text data sets accept.

:func:`styled_rows` makes users who each favour a few words (so that a network can learn something a
unigram model cannot: who writes tends to repeat its own words), with heavy-tailed numbers of
sentences; the rows come in a shuffled order (a reader must group them by user). The writers put the
same rows in a parquet, csv or json file, a ``save_to_disk`` folder, or TFF's SQLite layout with
``tf.train.Example`` rows encoded by the ``protobuf`` library (an encoder independent of dpfl's
decoder).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path

import numpy as np

Row = tuple[str, str]  # user id, text


def styled_rows(
    users: int, *, seed: int = 0, words: int = 60, favourites: int = 4, max_sentences: int = 12
) -> list[Row]:
    """Sentences of ``users`` users: each favours ``favourites`` words (70 % of its words), else Zipf.

    Upper-case letters appear now and then (the conversion keeps the case, as TFF's); sentence lengths
    1..25 words (some longer than a sequence of 20).
    """
    rng = np.random.default_rng(seed)
    vocabulary = [f"w{i}" for i in range(words)]
    rows: list[Row] = []
    for user in range(users):
        favourite = rng.choice(words, size=favourites, replace=False)
        for _ in range(1 + int(rng.zipf(1.6)) % max_sentences):
            length = int(rng.integers(1, 26))
            own = rng.random(length) < 0.7
            picks = np.where(
                own, rng.choice(favourite, size=length), (rng.zipf(1.3, size=length) - 1) % words
            )
            text = " ".join(vocabulary[i].upper() if rng.random() < 0.05 else vocabulary[i] for i in picks)
            rows.append((f"user{user:03d}", text))
    order = rng.permutation(len(rows))
    return [rows[i] for i in order]


def char_rows(users: int, *, seed: int = 0) -> list[Row]:
    """Short snippets of characters (TFF's Shakespeare form): each user repeats its own syllables."""
    rng = np.random.default_rng(seed)
    syllables = ["ha", "th", "ou", "er", "in", "st", "me", "lo", "ve", "ar", " ", ",", "!", "\n", "Z", "}"]
    rows: list[Row] = []
    for user in range(users):
        own = rng.choice(len(syllables), size=3, replace=False)
        for _ in range(1 + int(rng.integers(0, 4))):
            parts = [syllables[i] for i in rng.choice(own, size=int(rng.integers(1, 20)))]
            rows.append((f"ROLE_{user:02d}", "".join(parts)))
    return [rows[i] for i in rng.permutation(len(rows))]


def windows(rows: Sequence[Row], width: int) -> list[tuple[str, str, str]]:
    """LEAF's form of ``rows``: per user, every ``width``-character window of its text and the next one."""
    texts: dict[str, str] = {}
    for user, text in rows:
        texts[user] = texts.get(user, "") + text
    out = []
    for user, text in texts.items():
        text = text.ljust(width + 1, " ")
        out += [(user, text[i : i + width], text[i + width]) for i in range(len(text) - width)]
    return out


def write_rows(
    rows: Sequence[Row], path: Path, form: str, *, user: str = "client_id", text: str = "tokens"
) -> Path:
    """``rows`` as ``form`` (parquet, csv, json, disk, sqlite) at ``path``; returns dataset.path."""
    if form == "sqlite":
        return write_tff_sqlite({"train": rows}, path, text_feature=text)
    import datasets

    table = datasets.Dataset.from_dict({user: [r[0] for r in rows], text: [r[1] for r in rows]})
    if form == "parquet":
        table.to_parquet(str(path))
    elif form == "csv":
        table.to_csv(str(path), index=False)
    elif form == "json":
        table.to_json(str(path))
    elif form == "disk":
        table.save_to_disk(str(path))
    else:
        raise ValueError(form)
    return path


def example_class() -> type:
    """``tf.train.Example`` as a ``protobuf`` message class, from tensorflow's ``example.proto``."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FileDescriptorProto(name="dpfl_test_example.proto", package="tensorflow")
    field = descriptor_pb2.FieldDescriptorProto

    def message(name: str, fields: list[tuple[str, int, int, int, str | None, str | None]]) -> None:
        msg = proto.message_type.add(name=name)
        for fname, number, ftype, label, type_name, oneof in fields:
            entry = msg.field.add(name=fname, number=number, type=ftype, label=label)
            if type_name:
                entry.type_name = type_name
            if oneof is not None:
                entry.oneof_index = 0
        if any(f[5] is not None for f in fields):
            msg.oneof_decl.add(name="kind")

    repeated, optional = field.LABEL_REPEATED, field.LABEL_OPTIONAL
    message("BytesList", [("value", 1, field.TYPE_BYTES, repeated, None, None)])
    message("FloatList", [("value", 1, field.TYPE_FLOAT, repeated, None, None)])
    message("Int64List", [("value", 1, field.TYPE_INT64, repeated, None, None)])
    message(
        "Feature",
        [
            ("bytes_list", 1, field.TYPE_MESSAGE, optional, ".tensorflow.BytesList", "kind"),
            ("float_list", 2, field.TYPE_MESSAGE, optional, ".tensorflow.FloatList", "kind"),
            ("int64_list", 3, field.TYPE_MESSAGE, optional, ".tensorflow.Int64List", "kind"),
        ],
    )
    features = proto.message_type.add(name="Features")
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=field.TYPE_STRING, label=optional)
    entry.field.add(
        name="value", number=2, type=field.TYPE_MESSAGE, label=optional, type_name=".tensorflow.Feature"
    )
    features.field.add(
        name="feature",
        number=1,
        type=field.TYPE_MESSAGE,
        label=repeated,
        type_name=".tensorflow.Features.FeatureEntry",
    )
    message("Example", [("features", 1, field.TYPE_MESSAGE, optional, ".tensorflow.Features", None)])
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tensorflow.Example"))


def encode_example(features: dict[str, list[bytes] | list[float] | list[int]]) -> bytes:
    """A serialized ``tf.train.Example`` holding ``features`` (encoded by ``protobuf``)."""
    example = example_class()()
    for name, values in features.items():
        feature = example.features.feature[name]
        if values and isinstance(values[0], bytes):
            feature.bytes_list.value.extend(values)
        elif values and isinstance(values[0], float):
            feature.float_list.value.extend(values)
        else:
            feature.int64_list.value.extend(values)
    return example.SerializeToString()


def write_tff_sqlite(splits: dict[str, Sequence[Row]], path: Path, *, text_feature: str = "tokens") -> Path:
    """TFF's SQLite client data: tables ``examples`` and ``client_metadata`` (its schema and indexes).

    Each row's ``tf.train.Example`` has Stack Overflow's six features (``creation_date``, ``score``,
    ``tags``, ``title``, ``type`` and the text), as TFF's file and pfl-research's reader expect.
    """
    connection = sqlite3.connect(path)
    with connection:
        connection.execute(
            "CREATE TABLE examples (split_name TEXT NOT NULL, client_id TEXT NOT NULL, "
            "serialized_example_proto BLOB NOT NULL)"
        )
        connection.execute("CREATE INDEX idx_examples_client_id ON examples (client_id)")
        connection.execute("CREATE INDEX idx_examples_client_id_split ON examples (split_name, client_id)")
        connection.execute(
            "CREATE TABLE client_metadata (client_id TEXT NOT NULL, split_name TEXT NOT NULL, "
            "num_examples INTEGER NOT NULL)"
        )
        for split, rows in splits.items():
            counts: dict[str, int] = {}
            for user, text in rows:
                blob = encode_example(
                    {
                        text_feature: [text.encode()],
                        "title": [b"a title"],
                        "score": [3],
                        "creation_date": [b"2010-01-01"],
                        "tags": [b"python|numpy"],
                        "type": [b"answer"],
                    }
                )
                connection.execute("INSERT INTO examples VALUES (?, ?, ?)", (split, user, blob))
                counts[user] = counts.get(user, 0) + 1
            connection.executemany(
                "INSERT INTO client_metadata VALUES (?, ?, ?)", [(u, split, n) for u, n in counts.items()]
            )
    connection.close()
    return path


def text_networks() -> tuple[type, type]:
    """Two networks of one's own (``model=<module>:<Class>``) that do not fit a text data set's shape.

    ``TenTokens`` gives scores for 10 tokens whatever the vocabulary; ``EightTokensLong`` refuses
    sequences longer than 8 (as a network with 8 learned positions must).
    """
    import torch
    from torch import nn

    class TenTokens(nn.Module):
        def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
            super().__init__()
            self.embedding, self.output = nn.Embedding(10, 4), nn.Linear(4, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.output(self.embedding(x.clamp(max=9)))

    class EightTokensLong(nn.Module):
        def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
            super().__init__()
            self.positions = nn.Parameter(torch.zeros(8, num_classes))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.shape[-1] > 8:
                raise ValueError(f"built for sequences of at most 8 tokens, got {x.shape[-1]}")
            return self.positions[: x.shape[-1]].expand(x.shape[0], -1, -1)

    return TenTokens, EightTokensLong


TenTokens, EightTokensLong = text_networks()


def words_options(path: Path, **extra: object) -> dict:
    """The word-level text data set options of a corpus file at ``path``, updated by ``extra``."""
    options = {
        "name": "stackoverflow",
        "path": str(path),
        "split": "train",
        "test_split": None,
        "test_fraction": 0.25,
        "text_column": "tokens",
        "target_column": None,
        "level": "word",
        "vocab_size": 25,
        "vocabulary": None,
        "sequence_length": 20,
        "max_sequences_per_user": None,
        "accuracy_without_oov": True,
        "revision": None,
    }
    options.update(extra)
    return options
