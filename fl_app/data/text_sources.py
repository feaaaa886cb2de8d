"""Where a text data set's rows come from: a Hugging Face data set or TFF's SQLite file, user by user.

``dataset.path`` names

* a hub name (``flwrlabs/shakespeare``), a ``save_to_disk`` folder or a folder of data files: read
  with ``datasets`` (:mod:`fl_app.data.hf`'s loaders);
* a data file: ``.parquet`` (or a glob of them), ``.csv``, ``.json``/``.jsonl``, ``.arrow``: one split,
  the training split;
* TFF's SQLite database (``stackoverflow.sqlite``; any file that starts with SQLite's header): the
  tables ``examples (split_name, client_id, serialized_example_proto)`` and ``client_metadata``
  that ``tff.simulation.datasets`` writes, each row a ``tf.train.Example``
  (:mod:`fl_app.data.tf_example`) whose ``dataset.text_column`` feature is the text.

A reader gives a split's users in the order of their ids, each with its texts in the source's order
(:class:`UserTexts`), so that a user's first ``n`` sentences are the first ``n`` the source holds, as
TFF's ``take(n)``. Every problem is one line naming the key (:class:`~fl_app.data.sources.DataFileError`,
:class:`~fl_app.data.sources.DataNotFoundError`).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fl_app.data.hf import (
    HFSource,
    column_error,
    describe_feature,
    looks_like_a_path,
    missing_path,
    open_split,
    quiet_datasets,
)
from fl_app.data.sources import DataFileError, DataNotFoundError, data_home
from fl_app.data.text_tokens import Level
from fl_app.data.text_vocabulary import CHOICE_KEY
from fl_app.data.tf_example import ExampleError, example_features

#: ``datasets`` builders by file suffix (a data file is one split, the training split).
FILE_BUILDERS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json", ".arrow": "arrow"}
#: SQLite's file header.
SQLITE_MAGIC = b"SQLite format 3\x00"
#: What ``dataset.path`` may name on this machine (said when a path names nothing).
TEXT_FORMS = (
    "set dataset.path to TFF's SQLite file (stackoverflow.sqlite), a parquet, csv or json file (or a glob "
    "of parquet files), a save_to_disk folder or a hub name (flwrlabs/shakespeare); docs/text.md says how "
    "to fetch them"
)
#: Rows fetched at a time.
BATCH_ROWS = 65536


@dataclass(frozen=True)
class TextSource:
    """Which text data set, its columns and how it becomes sequences (the ``dataset`` group)."""

    name: str
    path: str
    split: str
    test_split: str | None
    test_fraction: float
    user_column: str
    text_column: str
    target_column: str | None
    level: Level
    vocab_size: int
    vocabulary: str | None
    sequence_length: int
    max_sequences_per_user: int | None
    revision: str | None = None
    #: The key of a DP vocabulary release (:mod:`fl_app.data.text_vocabulary`); None: no release.
    release: str | None = None

    @classmethod
    def from_options(cls, options: Mapping[str, Any], *, user_column: str) -> TextSource:
        """Read the (validated) ``dataset`` group and the users' column (``partition.column``)."""

        def optional(key: str) -> str | None:
            value = options.get(key)
            return None if value is None else str(value)

        limit = options.get("max_sequences_per_user")
        return cls(
            name=str(options["name"]),
            path=str(options["path"]),
            split=str(options.get("split", "train")),
            test_split=optional("test_split"),
            test_fraction=float(options.get("test_fraction", 0.2)),
            user_column=user_column,
            text_column=str(options["text_column"]),
            target_column=optional("target_column"),
            level="word" if options.get("level") == "word" else "char",
            vocab_size=int(options.get("vocab_size", 10000)),
            vocabulary=optional("vocabulary"),
            sequence_length=int(options["sequence_length"]),
            max_sequences_per_user=None if limit is None else int(limit),
            revision=optional("revision"),
            release=(options.get(CHOICE_KEY) or {}).get("release"),
        )

    def as_hf(self) -> HFSource:
        """The same path as :mod:`fl_app.data.hf` reads it (its loaders, its fingerprint)."""
        return HFSource(
            self.path, self.split, self.test_split, self.test_fraction, "", "", None, self.revision
        )

    def local_path(self) -> Path | None:
        """The local file, folder or glob ``path`` names; None for a hub name."""
        return self.as_hf().local_path()


@dataclass(frozen=True)
class UserTexts:
    """One user's texts in the source's order (and, for LEAF's windows, each one's next character)."""

    user: str
    texts: list[str]
    followers: list[str] | None


def is_sqlite(path: Path) -> bool:
    """Whether ``path`` is an SQLite database (by its header)."""
    try:
        with path.open("rb") as handle:
            return handle.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC
    except OSError:
        return False


class SQLiteReader:
    """TFF's SQLite client data: a split's users and their sentences (a ``tf.train.Example`` per row)."""

    def __init__(self, source: TextSource, path: Path) -> None:
        self.source = source
        self.connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        tables = {
            row[0] for row in self.connection.execute("SELECT name FROM sqlite_master WHERE type='table'")
        }
        if not {"examples", "client_metadata"} <= tables:
            raise DataFileError(
                f"dataset.path={source.path!r}: an SQLite file without TFF's tables examples and "
                f"client_metadata (it has {', '.join(sorted(tables)) or 'no tables'}); expected the file "
                "tff.simulation.datasets writes (stackoverflow.sqlite)"
            )
        rows = self.connection.execute("SELECT DISTINCT split_name FROM client_metadata")
        self.splits = sorted(str(row[0]) for row in rows)

    def user_ids(self, split: str) -> list[str]:
        """The split's users' ids."""
        rows = self.connection.execute(
            "SELECT DISTINCT client_id FROM client_metadata WHERE split_name = ?", (split,)
        )
        return [str(row[0]) for row in rows]

    def users(self, split: str, key: str = "dataset.split") -> Iterator[UserTexts]:
        """The split's users in the order of their ids, each with its sentences in row order."""
        if split not in self.splits:
            raise DataNotFoundError(
                f"{key}={split!r}: {self.source.path} has the splits {', '.join(self.splits)}"
            )
        query = (
            "SELECT client_id, serialized_example_proto FROM examples WHERE split_name = ? "
            "ORDER BY client_id, rowid"
        )
        user: str | None = None
        texts: list[str] = []
        for client_id, blob in self.connection.execute(query, (split,)):
            if client_id != user:
                if user is not None:
                    yield UserTexts(user, texts, None)
                user, texts = str(client_id), []
            texts.append(self.text_of(blob, str(client_id)))
        if user is not None:
            yield UserTexts(user, texts, None)

    def text_of(self, blob: bytes, user: str) -> str:
        """The text feature of one serialized example (one line naming the key when it has none)."""
        column = self.source.text_column
        try:
            features = example_features(blob)
        except (ExampleError, UnicodeDecodeError) as error:
            raise DataFileError(
                f"dataset.path={self.source.path!r}: a row of user {user!r} is not a tf.train.Example "
                f"({error}); expected TFF's SQLite file"
            ) from None
        values = features.get(column)
        if values is None or (values and not isinstance(values[0], bytes)):
            kinds = ", ".join(
                f"{k} ({'text' if v and isinstance(v[0], bytes) else 'numbers'})" for k, v in features.items()
            )
            problem = "no such feature" if values is None else "holds numbers, not text"
            raise DataFileError(
                f"dataset.text_column={column!r}: {problem}; the examples' features are {kinds}"
            )
        return b" ".join(v for v in values if isinstance(v, bytes)).decode("utf-8", errors="replace")


class DatasetsReader:
    """A ``datasets`` split's users (their ids as text, sorted) and their texts in row order."""

    def __init__(self, source: TextSource) -> None:
        self.source = source
        self._open: dict[str, Any] = {}
        local = source.local_path()
        self.single_file = local is not None and (local.is_file() or not local.is_dir())
        self.splits = [source.split] if self.single_file else []

    def dataset(self, split: str, key: str) -> Any:
        """The ``datasets.Dataset`` of ``split`` with its columns checked (raises naming ``key``)."""
        if split not in self._open:
            with quiet_datasets():
                self._open[split] = self._checked(self._load(split, key))
        return self._open[split]

    def _load(self, split: str, key: str) -> Any:
        import datasets

        local = self.source.local_path()
        if local is None and looks_like_a_path(self.source.path):
            raise missing_path(self.source.path, TEXT_FORMS)
        if not self.single_file or local is None:
            # the text cache (fl_app.data.text.cache_folder) is named when the hub is out of reach
            return open_split(self.source.as_hf(), split, key=key, cache=data_home() / "text")
        if split != self.source.split:
            raise DataNotFoundError(f"{key}={split!r}: {self.source.path} is one data file: one split")
        suffix = next((s for s in FILE_BUILDERS if local.name.endswith(s)), ".parquet")
        try:
            return datasets.load_dataset(
                FILE_BUILDERS[suffix], data_files={"train": str(local)}, split="train"
            )
        except (OSError, ValueError) as error:
            raise DataFileError(
                f"dataset.path={self.source.path!r}: datasets cannot read it as {FILE_BUILDERS[suffix]} "
                f"({type(error).__name__}: {' '.join(str(error).split())[:160]})"
            ) from None

    def _checked(self, dataset: Any) -> Any:
        import datasets

        source = self.source
        for key, column in (
            ("partition.column", source.user_column),
            ("dataset.text_column", source.text_column),
            ("dataset.target_column", source.target_column),
        ):
            if column is None:
                continue
            if column not in dataset.features:
                raise column_error(key, column, dataset, "no such column")
            feature = dataset.features[column]
            text = isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")
            if key != "partition.column" and not text:
                raise column_error(key, column, dataset, f"is {describe_feature(feature)}, not text (string)")
            if key == "partition.column" and not isinstance(feature, datasets.Value | datasets.ClassLabel):
                raise column_error(key, column, dataset, f"is {describe_feature(feature)}, not an id")
        return dataset

    def user_names(self, split: str, key: str = "dataset.split") -> np.ndarray:
        """Every row's user id, as text."""
        column = self.source.user_column
        ids = self.dataset(split, key).with_format("arrow", columns=[column])[:][column]
        return np.asarray(ids.to_numpy(zero_copy_only=False)).astype(str)

    def user_ids(self, split: str) -> list[str]:
        """The split's users' ids."""
        return [str(user) for user in np.unique(self.user_names(split))]

    def users(self, split: str, key: str = "dataset.split") -> Iterator[UserTexts]:
        """The split's users in the order of their ids (as text), each with its texts in row order."""
        dataset = self.dataset(split, key)
        source = self.source
        users, codes = np.unique(self.user_names(split, key), return_inverse=True)
        order = np.argsort(codes, kind="stable")
        bounds = np.searchsorted(codes[order], np.arange(len(users) + 1))
        columns = [c for c in (source.text_column, source.target_column) if c is not None]
        table = dataset.with_format("arrow", columns=columns)
        first = 0
        while first < len(users):  # whole users at a time, about BATCH_ROWS rows
            last = max(first + 1, int(np.searchsorted(bounds, bounds[first] + BATCH_ROWS, side="right")) - 1)
            last = min(last, len(users))
            batch = table.select(order[bounds[first] : bounds[last]])[:]
            texts = batch[source.text_column].to_pylist()
            follow = batch[source.target_column].to_pylist() if source.target_column else None
            for user in range(first, last):
                lo, hi = bounds[user] - bounds[first], bounds[user + 1] - bounds[first]
                yield self._user(str(users[user]), texts[lo:hi], None if follow is None else follow[lo:hi])
            first = last

    def _user(self, user: str, texts: list[Any], follow: list[Any] | None) -> UserTexts:
        """One user's texts, refusing a missing value (one line naming the column and the user)."""
        for key, column, values in (
            ("dataset.text_column", self.source.text_column, texts),
            ("dataset.target_column", self.source.target_column, follow),
        ):
            if values is not None and any(value is None for value in values):
                raise DataFileError(f"{key}={column!r}: user {user!r} has a row without a value (null)")
        return UserTexts(user, texts, follow)


def open_reader(source: TextSource) -> SQLiteReader | DatasetsReader:
    """The reader of ``source.path``: TFF's SQLite file, or a ``datasets`` source."""
    local = source.local_path()
    if local is not None and local.is_file() and is_sqlite(local):
        return SQLiteReader(source, local)
    return DatasetsReader(source)


def test_split_of(reader: SQLiteReader | DatasetsReader, source: TextSource) -> str | None:
    """The test split: ``dataset.test_split``, else ``test`` when the source has one, else None."""
    if source.test_split is not None:
        if isinstance(reader, SQLiteReader) and source.test_split not in reader.splits:
            raise DataNotFoundError(
                f"dataset.test_split={source.test_split!r}: {source.path} has the splits "
                f"{', '.join(reader.splits)}"
            )
        return source.test_split
    if isinstance(reader, SQLiteReader):
        return "test" if "test" in reader.splits and source.split != "test" else None
    if reader.single_file or source.split == "test":
        return None
    try:
        reader.dataset("test", "dataset.test_split")
    except DataNotFoundError:
        return None
    return "test"
