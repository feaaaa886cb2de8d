"""Text data sets per user (``dataset=shakespeare``, ``dataset=stackoverflow``) as token arrays on disk.

A source (:mod:`fl_app.data.text_sources`: a hub name, a ``save_to_disk`` folder, a parquet, csv or
json file, TFF's SQLite file) is converted once into token sequences (:mod:`fl_app.data.text_tokens`)
and kept in ``$DPFL_DATA_HOME/text/<key>/``:

* ``train.tokens`` and ``test.tokens``: every sequence of ``sequence_length + 1`` ids, one user's
  after another in the order of the users' ids (raw ``uint16``, or ``int32`` for a vocabulary of
  more than 65,536 tokens), read as memory maps: a user's rows are read from disk when a client of
  that user trains;
* ``train_offsets.npy`` and ``test_offsets.npy``: where each user's rows start (``int64``, one more
  than the users);
* ``meta.json``: the vocabulary, the counts, the shapes, what the arrays were built from and each
  array file's size and SHA-256;
* ``verified.json``: the files' ``stat`` when their last check passed (:mod:`fl_app.data.text_cache`).

The key covers the source (path and files' fingerprint as :func:`fl_app.data.hf.fingerprint` takes it,
splits, columns) and the task (level, vocabulary size, file or DP release, sequence length, the cap
per user), so another setting is converted again and the same one never is. The folder is written under a
temporary name and renamed: a reader never sees half of it, and a stopped conversion leaves nothing
(a killed one's folder is removed by a later run). A cached folder that fails its check (sizes,
checksums, token ids: :func:`fl_app.data.text_cache.check_arrays`) is converted again, with one line
saying why.

Users are the natural partition: the test users are the source's test split when it has one (TFF's
Stack Overflow ``test``), else the held-out users, a fixed ``dataset.test_fraction`` of the users
chosen by a hash of their ids (the same users in every run, so that the vocabulary is counted on the
training users alone). The training users are put in a seeded order (``seed``) as
:func:`fl_app.data.natural.natural_split` orders them: the first ``num_clients`` are the clients, the
next ones, whole, the public and then the validation split. A training user keeps at most
``dataset.max_sequences_per_user`` sequences (its first ones, as TFF's ``take(n)``); test users keep
all theirs.

What a process holds: the offsets (8 bytes per user), the clients' user numbers, and the rows of
the users it trains or evaluates; the token arrays stay on disk (``benchmarks/text_memory.py``
measures a Stack Overflow-sized corpus: docs/benchmarks/text.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO, overload

import numpy as np

from fl_app.data.examples import DEFAULT_USER_COLUMNS, ClientDataset, concatenated_ranges
from fl_app.data.hf import file_stamp, fingerprint
from fl_app.data.natural import draw_client_users
from fl_app.data.sources import ArrayDataset, DataFileError, DataNotFoundError, data_home
from fl_app.data.text_cache import (
    META_FILE,
    CacheCheckError,
    check_arrays,
    file_records,
    record_verified,
    remove_abandoned,
    staging_folder,
    stat_record,
)
from fl_app.data.text_sources import TextSource, UserTexts, open_reader, test_split_of
from fl_app.data.text_tokens import (
    CHAR_VOCAB,
    PAD,
    Vocabulary,
    count_user_words,
    read_word_counts,
    top_words,
    user_sequences,
)
from fl_app.data.text_vocabulary import count_bounded_words, read_counts, read_release, write_counts

#: Bump when the conversion changes: corpora of another version are converted again (2: words split on
#: single spaces, case kept, as TFF splits them).
CONVERTER_VERSION = 2


def user_column(dataset: dict[str, Any], partition: dict[str, Any]) -> str:
    """The users' column: ``partition.column``, else the data set's own (``character_id``, ``client_id``)."""
    column = partition.get("column")
    return str(column) if column is not None else DEFAULT_USER_COLUMNS[str(dataset["name"])]


def cache_folder() -> Path:
    """Where converted text data sets are kept: ``$DPFL_DATA_HOME/text``."""
    return data_home() / "text"


def file_fingerprint(path: str | None) -> str | None:
    """The vocabulary file's name, size and modification time (None: no file named)."""
    if path is None:
        return None
    return file_stamp(Path(path).expanduser())


def cache_key(source: TextSource) -> str:
    """The converted corpus's folder name: the source, its files' fingerprint, the task's settings."""
    fields = {
        **asdict(source),
        "fingerprint": fingerprint(source.as_hf()),
        "vocabulary_file": file_fingerprint(source.vocabulary),
        "version": CONVERTER_VERSION,
    }
    if source.level == "char":
        del fields["vocab_size"]  # the characters are TFF's fixed 86
    if source.release is None:
        del fields["release"]  # the keys of corpora converted before DP releases existed
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def corpus_path(source: TextSource) -> Path:
    """The folder the converted arrays of ``source`` are (or will be) kept in."""
    return cache_folder() / cache_key(source)


@dataclass(frozen=True)
class Split:
    """One split's sequences ``(n, length + 1)`` (a memory map) and where each user's rows start.

    ``path``: the token file; a user's rows are read from it (:meth:`rows`) rather than through the
    memory map, so that reading a cohort leaves no mapped pages behind (the page cache keeps them).
    """

    tokens: np.ndarray
    offsets: np.ndarray
    path: Path | None = None

    @property
    def users(self) -> int:
        """Number of users."""
        return len(self.offsets) - 1

    def sizes(self) -> np.ndarray:
        """Each user's number of sequences."""
        return np.diff(self.offsets)

    def rows(self, user: int) -> np.ndarray:
        """User ``user``'s sequences, read from disk now (one read of its contiguous rows)."""
        start, end = int(self.offsets[user]), int(self.offsets[user + 1])
        if self.path is None or end == start:
            return np.asarray(self.tokens[start:end])
        width, dtype = self.tokens.shape[1], self.tokens.dtype
        flat = np.fromfile(
            self.path, dtype=dtype, count=(end - start) * width, offset=start * width * dtype.itemsize
        )
        return flat.reshape(end - start, width)


@dataclass(frozen=True)
class TextCorpus:
    """A converted text data set: its train and test splits, vocabulary and settings."""

    train: Split
    test: Split
    vocabulary: Vocabulary
    sequence_length: int
    meta: dict[str, Any]


def open_corpus(folder: Path) -> TextCorpus | None:
    """The corpus kept in ``folder``; None when it is absent, of another version or fails its check."""
    try:
        return read_corpus(folder)
    except CacheCheckError:
        return None


def read_corpus(folder: Path, *, require_checksums: bool = True) -> TextCorpus:
    """The corpus kept in ``folder``, checked (:func:`fl_app.data.text_cache.check_arrays`).

    Raises
    ------
    CacheCheckError
        Why it cannot be read, in one line: a file missing or unreadable, another version, a file
        of the wrong size or checksum, a token id outside the vocabulary.

    """
    try:
        meta = json.loads((folder / META_FILE).read_text())
        if meta.get("version") != CONVERTER_VERSION:
            raise CacheCheckError(f"converted by another dpfl version ({meta.get('version')})")
        offsets = {
            name: np.load(folder / f"{name}_offsets.npy", allow_pickle=False) for name in ("train", "test")
        }
        rows = {name: int(split_offsets[-1]) for name, split_offsets in offsets.items()}
        check_arrays(folder, meta, rows, require_checksums=require_checksums)
        width = int(meta["sequence_length"]) + 1
        dtype = np.dtype(meta["dtype"])
        splits = {}
        for name in ("train", "test"):
            tokens = (
                np.memmap(folder / f"{name}.tokens", dtype=dtype, mode="r", shape=(rows[name], width))
                if rows[name]
                else np.zeros((0, width), dtype=dtype)
            )
            splits[name] = Split(tokens, offsets[name], folder / f"{name}.tokens")
        vocabulary = Vocabulary(tuple(meta["vocabulary"]))
    except (OSError, KeyError, ValueError, TypeError, IndexError, AttributeError) as error:
        raise CacheCheckError(unreadable(error)) from None
    return TextCorpus(splits["train"], splits["test"], vocabulary, int(meta["sequence_length"]), meta)


def unreadable(error: Exception) -> str:
    """Why a converted folder's files could not be read, in a few words."""
    if isinstance(error, FileNotFoundError) and error.filename:
        return f"{Path(error.filename).name} is missing"
    if isinstance(error, KeyError):
        return f"{META_FILE} lacks {error}"
    return f"a file cannot be read ({type(error).__name__}: {' '.join(str(error).split())[:120]})"


def load_text_corpus(source: TextSource) -> TextCorpus:
    """The corpus of ``source``: from the cache, else converted (once) and kept there.

    Raises
    ------
    DataNotFoundError, DataFileError
        One line naming the key: a source that cannot be found or read, a column missing or not
        text, a user without text, a vocabulary file that cannot be read.

    """
    local = source.local_path()
    if local is not None and (local / META_FILE).is_file():  # a converted corpus, named as it is
        return converted_folder(source, local)
    folder = corpus_path(source)
    remove_leftovers(folder.parent)
    if folder.exists():
        try:
            return read_corpus(folder)
        except CacheCheckError as problem:
            print(
                f"dpfl: the converted {source.path} in {folder} fails its check ({problem}): converting "
                "it again",
                file=sys.stderr,
                flush=True,
            )
    convert(source, folder)
    try:
        return read_corpus(folder)
    except CacheCheckError as problem:
        raise DataFileError(
            f"dataset.path={source.path!r}: the converted arrays in {folder} cannot be read ({problem})"
        ) from None


def remove_leftovers(cache: Path) -> None:
    """Remove the partial conversions killed processes left in ``cache`` (one line if any)."""
    removed = remove_abandoned(cache)
    if removed:
        print(
            f"dpfl: removed {len(removed)} partial conversion(s) that stopped processes left in {cache} "
            f"({', '.join(folder.name for folder in removed[:3])}{', ...' if len(removed) > 3 else ''})",
            file=sys.stderr,
            flush=True,
        )


def converted_folder(source: TextSource, folder: Path) -> TextCorpus:
    """A folder holding converted arrays (this module's, copied from another machine's cache, or generated).

    Its sequence length must be the configured one (its vocabulary is its own).
    """
    try:
        corpus = read_corpus(folder, require_checksums=False)
    except CacheCheckError as problem:
        raise DataFileError(
            f"dataset.path={source.path!r}: a converted corpus that fails its check ({problem}); convert "
            "the data set again"
        ) from None
    if corpus.sequence_length != source.sequence_length:
        raise DataFileError(
            f"dataset.sequence_length={source.sequence_length}: the converted corpus {folder} holds "
            f"sequences of {corpus.sequence_length} tokens; set it to {corpus.sequence_length}"
        )
    return corpus


def user_hash(user: str) -> int:
    """A user id's place in the hold-out order: the first 8 bytes of its SHA-256."""
    return int.from_bytes(hashlib.sha256(user.encode("utf-8")).digest()[:8], "big")


def held_out_users(users: list[str], fraction: float) -> set[str]:
    """The test users of a source without a test split: ``max(1, round(fraction * n))`` of the ``n`` users.

    Those of the smallest :func:`user_hash`: fixed for a data set (the run's seed plays no part), so
    that the vocabulary is counted on the same training users in every run.
    """
    count = max(1, round(fraction * len(users)))
    if count >= len(users):
        raise DataFileError(
            f"dataset.test_fraction={fraction}: holds out {count} of the {len(users)} users, leaving no "
            "training user; lower it (or provide a test split)"
        )
    return set(sorted(users, key=user_hash)[:count])


def convert(source: TextSource, folder: Path) -> None:
    """Read ``source`` (every check first), build the vocabulary, write the token arrays into ``folder``."""
    reader, test_split, held = open_training_side(source)
    vocabulary = build_vocabulary(reader, source, held)
    print(
        f"dpfl: reading {source.path} ({source.split}) and converting it to token sequences, once: later "
        f"runs read {folder}",
        flush=True,
    )
    with staging_folder(folder) as staging, abandoned_on_stop(source):
        counts = write_splits(reader, source, test_split, held, vocabulary, staging)
        meta = {
            "version": CONVERTER_VERSION,
            "source": {k: v for k, v in asdict(source).items()},
            "test": test_split or f"held-out users ({len(held)}: the smallest SHA-256 of their ids)",
            "sequence_length": source.sequence_length,
            "dtype": vocabulary.dtype().str,
            "vocabulary": list(vocabulary.tokens),
            **counts,
            "files": file_records(staging),
        }
        (staging / META_FILE).write_text(json.dumps(meta))
        with contextlib.suppress(OSError):
            shutil.rmtree(folder)  # an earlier conversion that failed its check
        os.replace(staging, folder)
    record_verified(folder, stat_record(folder))


@contextlib.contextmanager
def abandoned_on_stop(source: TextSource) -> Iterator[None]:
    """Note on a stop (Ctrl-C, SIGTERM as the command raises it) that the conversion was abandoned."""
    try:
        yield
    except KeyboardInterrupt as stop:
        stop.add_note(f"converting {source.path}: its partial arrays were removed")
        raise


def open_training_side(source: TextSource) -> tuple[Any, str | None, set[str]]:
    """The reader of ``source``, its test split and its held-out users (none with a test split).

    Each split's first user is read first (:func:`probe`): a missing split or column fails at once.
    """
    reader = open_reader(source)
    test_split = test_split_of(reader, source)
    probe(reader, source, test_split)
    held = (
        set()
        if test_split is not None
        else held_out_users(reader.user_ids(source.split), source.test_fraction)
    )
    return reader, test_split, held


def training_word_counts(source: TextSource, words_per_user: int) -> dict[str, int]:
    """Each word's number of training users among whose ``words_per_user`` most used words it is.

    The bounded contributions a DP vocabulary is released from
    (:func:`fl_app.data.text_vocabulary.count_bounded_words`; every sentence of a user, test users
    left out). Kept under a key of the source, its files' fingerprint and ``words_per_user``
    (:func:`fl_app.data.text_vocabulary.counts_path`): a sweep's releases count once.
    """
    fields = {
        key: value
        for key, value in asdict(source).items()
        if key in ("path", "split", "test_split", "test_fraction", "user_column", "text_column", "revision")
    }
    fields |= {
        "fingerprint": fingerprint(source.as_hf()),
        "words_per_user": words_per_user,
        "version": CONVERTER_VERSION,
    }
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]
    kept = read_counts(key)
    if kept is not None:
        return kept
    reader, _, held = open_training_side(source)
    print(f"dpfl: counting the training users' words of {source.path} for a DP vocabulary, once", flush=True)
    counts = count_bounded_words(
        (user.texts for user in training_users(reader, source, held)), words_per_user
    )
    write_counts(key, counts)
    return counts


def training_users(reader: Any, source: TextSource, held: set[str]) -> Iterator[UserTexts]:
    """The training split's users but the held-out ones."""
    for user in reader.users(source.split, "dataset.split"):
        if user.user not in held:
            yield user


def test_users(
    reader: Any, source: TextSource, test_split: str | None, held: set[str]
) -> Iterator[UserTexts]:
    """The test users: the test split's, or the held-out users of the training split."""
    if test_split is not None:
        yield from reader.users(test_split, "dataset.test_split")
        return
    for user in reader.users(source.split, "dataset.split"):
        if user.user in held:
            yield user


def probe(reader: Any, source: TextSource, test_split: str | None) -> None:
    """Read each split's first user: missing splits, columns and text types fail before the conversion."""
    for split, key in ((source.split, "dataset.split"), (test_split, "dataset.test_split")):
        if split is not None and next(iter(reader.users(split, key)), None) is None:
            raise DataFileError(f"{key}={split!r}: the split of {source.path} holds no rows")


def build_vocabulary(reader: Any, source: TextSource, held: set[str]) -> Vocabulary:
    """TFF's 86 characters; or the ``vocab_size`` words used by the most training users (or a file's)."""
    if source.level == "char":
        return Vocabulary(CHAR_VOCAB)
    if source.release is not None:  # a DP release (fl_app.config.data_choices chose it)
        return Vocabulary(read_release(source.release)[0])
    if source.vocabulary is not None:
        try:
            with Path(source.vocabulary).expanduser().open(encoding="utf-8") as lines:
                words = read_word_counts(lines, source.vocab_size)
        except (OSError, UnicodeDecodeError) as error:
            raise DataNotFoundError(
                f"dataset.vocabulary={source.vocabulary!r}: cannot be read ({type(error).__name__}); name "
                "TFF's stackoverflow.word_count file (one 'word count' a line, most used first) or set null"
            ) from None
        if len(words) < source.vocab_size:
            raise DataFileError(
                f"dataset.vocabulary={source.vocabulary!r}: holds {len(words)} words, fewer than "
                f"dataset.vocab_size={source.vocab_size}"
            )
        return Vocabulary(words)
    counts: dict[str, int] = {}
    for user in training_users(reader, source, held):
        count_user_words(user.texts, counts)
    return Vocabulary(top_words(counts, source.vocab_size))


class _Writer:
    """Appends one split's users' rows to a raw token file and records the offsets."""

    def __init__(self, handle: BinaryIO, dtype: np.dtype) -> None:
        self.handle, self.dtype = handle, dtype
        self.offsets = [0]

    def add(self, rows: np.ndarray) -> None:
        self.handle.write(np.ascontiguousarray(rows, dtype=self.dtype).tobytes())
        self.offsets.append(self.offsets[-1] + len(rows))


def write_splits(
    reader: Any,
    source: TextSource,
    test_split: str | None,
    held: set[str],
    vocabulary: Vocabulary,
    folder: Path,
) -> dict[str, int]:
    """Tokenize the training users (capped) and the test users (whole) into ``folder``; their counts."""
    ids = vocabulary.ids()
    counts: dict[str, int] = {}
    for name, users, limit in (
        ("train", training_users(reader, source, held), source.max_sequences_per_user),
        ("test", test_users(reader, source, test_split, held), None),
    ):
        with (folder / f"{name}.tokens").open("wb") as handle:
            writer = _Writer(handle, vocabulary.dtype())
            for user in users:
                if not any(text.strip() for text in user.texts):
                    raise DataFileError(
                        f"dataset.text_column={source.text_column!r}: user {user.user!r} has no text (its "
                        f"{len(user.texts)} rows are empty); remove the user from the data set"
                    )
                rows = user_sequences(
                    user.texts,
                    user.followers,
                    level=source.level,
                    ids=ids,
                    vocabulary=vocabulary,
                    length=source.sequence_length,
                    limit=limit,
                )
                writer.add(rows)
        np.save(folder / f"{name}_offsets.npy", np.asarray(writer.offsets, dtype=np.int64))
        counts[f"{name}_users"], counts[f"{name}_sequences"] = len(writer.offsets) - 1, writer.offsets[-1]
    return counts


def natural_users(
    sizes: np.ndarray,
    *,
    num_clients: int,
    public_fraction: float,
    validation_fraction: float,
    seed: int,
    column: str,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Public, client and validation users (by number) of users of ``sizes`` sequences each.

    The users are ordered as :func:`fl_app.data.natural.natural_split` orders them (the same seeded
    permutation); ``ValueError`` (one line) for fewer users than ``num_clients`` or too few sequences
    left for the public or validation split.
    """
    clients, rest = draw_client_users(len(sizes), num_clients=num_clients, seed=seed, column=column)
    total = int(sizes.sum())
    taken = []
    for key, fraction in (
        ("dataset.public_fraction", public_fraction),
        ("evaluation.validation_fraction", validation_fraction),
    ):
        target = round(fraction * total)
        reach = np.cumsum(sizes[rest])
        count = int(np.searchsorted(reach, target)) + 1 if target > 0 else 0
        if target > 0 and (not len(reach) or reach[-1] < target):
            raise ValueError(
                f"{key}={fraction} asks for {target} rows from users that are not clients, but only "
                f"{int(reach[-1]) if len(reach) else 0} are left (the other users are clients): lower "
                "num_clients or the fraction"
            )
        taken.append(np.sort(rest[:count]))
        rest = rest[count:]
    return taken[0], clients, taken[1]


class TextData:
    """The federated view of a text data set: the clients (one user each), the test and public splits.

    The same interface as :class:`fl_app.data.federated.FederatedData`, over memory-mapped token
    arrays: a client's examples are its user's sequences, the input their first ``length`` tokens
    (``x``) and the targets their last ``length`` (``y``), views of the memory map.
    """

    def __init__(
        self,
        corpus: TextCorpus,
        users: tuple[np.ndarray, np.ndarray, np.ndarray],
        uncounted: tuple[int, ...],
        *,
        requested_words: int | None = None,
    ) -> None:
        self.corpus = corpus
        self.public_users, self.client_users, self.validation_users = users
        self.uncounted_targets = uncounted
        self.requested_words = requested_words

    def vocabulary_shortfall(self) -> tuple[int, int] | None:
        """``(words, asked)`` when the vocabulary holds fewer words than ``dataset.vocab_size`` asked for."""
        words = len(self.corpus.vocabulary.tokens)
        if self.requested_words is None or words >= self.requested_words:
            return None
        return words, self.requested_words

    @property
    def num_classes(self) -> int:
        """The vocabulary's size (the networks' number of outputs at every position)."""
        return self.corpus.vocabulary.size

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One example: a sequence of ``length`` token ids."""
        return (self.corpus.sequence_length,)

    @property
    def natural(self) -> bool:
        """Every client is one user."""
        return True

    @property
    def arrays(self) -> ArrayDataset:
        """The splits as ``FederatedData.arrays`` holds them: views of the memory maps (no copy, no read).

        ``x_train[rows]`` reads those rows only; rows are numbered as :attr:`client_rows` numbers them.
        """
        train, test = self.corpus.train.tokens, self.corpus.test.tokens
        return ArrayDataset(
            "text", train[:, :-1], train[:, 1:], test[:, :-1], test[:, 1:], self.num_classes, None
        )

    @property
    def client_rows(self) -> ClientRows:
        """Each client's rows of the training split (computed when asked: no list of every client's rows)."""
        return ClientRows(self.corpus.train.offsets, self.client_users)

    def rows_of(self, partitions: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The training rows of ``partitions``' users, one client's after another's, and each one's count."""
        users = self.client_users[np.asarray(partitions, dtype=np.int64)]
        offsets = self.corpus.train.offsets
        starts, sizes = offsets[users], offsets[users + 1] - offsets[users]
        return concatenated_ranges(starts, sizes), sizes.astype(np.int64)

    def client_sizes(self) -> list[int]:
        """Number of sequences of every client."""
        sizes = self.corpus.train.sizes()
        return [int(sizes[user]) for user in self.client_users]

    def client(self, partition_id: int) -> Any:
        """The sequences of client ``partition_id``'s user (read from disk now)."""
        return pairs(self.corpus.train.rows(int(self.client_users[partition_id])))

    def public_x(self) -> np.ndarray:
        """The inputs of the public users' sequences."""
        return self.users_rows(self.public_users)[:, :-1]

    def test(self) -> Any:
        """The test users' sequences (views of the memory map)."""
        return pairs(self.corpus.test.tokens)

    @property
    def evaluation_split(self) -> str:
        """``"validation"`` when validation users were set aside, else ``"test"``."""
        return "validation" if len(self.validation_users) else "test"

    def evaluation(self) -> Any:
        """The validation users' sequences, else the test split's."""
        if not len(self.validation_users):
            return self.test()
        return pairs(self.users_rows(self.validation_users))

    def users_rows(self, users: np.ndarray) -> np.ndarray:
        """The sequences of ``users`` (training split), one after another."""
        width = self.corpus.sequence_length + 1
        parts = [self.corpus.train.rows(int(user)) for user in users]
        return np.concatenate(parts) if parts else np.zeros((0, width), dtype=self.corpus.train.tokens.dtype)


class ClientRows(Sequence[np.ndarray]):
    """Client ``k``'s rows of the training split: ``offsets[user] .. offsets[user + 1]`` of its user."""

    def __init__(self, offsets: np.ndarray, users: np.ndarray) -> None:
        self.offsets, self.users = offsets, users

    def __len__(self) -> int:
        return len(self.users)

    @overload
    def __getitem__(self, index: int) -> np.ndarray: ...
    @overload
    def __getitem__(self, index: slice) -> list[np.ndarray]: ...
    def __getitem__(self, index: int | slice) -> np.ndarray | list[np.ndarray]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        user = int(self.users[index])
        return np.arange(self.offsets[user], self.offsets[user + 1], dtype=np.int64)


def pairs(rows: np.ndarray) -> ClientDataset:
    """Sequences ``(n, length + 1)`` as examples: inputs ``rows[:, :-1]``, targets ``rows[:, 1:]``."""
    return ClientDataset(rows[:, :-1], rows[:, 1:])


def text_source(dataset: dict[str, Any], partition: dict[str, Any]) -> TextSource:
    """The :class:`TextSource` of a text data set's ``dataset`` and ``partition`` groups."""
    return TextSource.from_options(dataset, user_column=user_column(dataset, partition))


def uncounted_targets(dataset: dict[str, Any], vocabulary: Vocabulary) -> tuple[int, ...]:
    """What accuracy leaves out: the pad; end of sentence and out of vocabulary as the data set says.

    ``dataset.accuracy_without_eos`` (default true: TFF's ``accuracy_no_oov_or_eos``, what the DP-FTRL
    and matrix-factorization papers report) and ``dataset.accuracy_without_oov``; both false counts
    every non-pad target, as pfl-research's ``accuracy`` does (its ``accuracy wo unk``: only the
    out-of-vocabulary one true).
    """
    tokens = [PAD]
    if dataset.get("accuracy_without_eos", True):
        tokens.append(vocabulary.eos)
    if dataset.get("accuracy_without_oov", False):
        tokens.append(vocabulary.oov)
    return tuple(sorted(tokens))


def build_text_data(
    dataset: dict[str, Any],
    partition: dict[str, Any],
    *,
    num_clients: int,
    seed: int,
    validation_fraction: float,
) -> TextData:
    """The converted corpus of a text data set, split into clients (one user each) as the spec says."""
    source = text_source(dataset, partition)
    corpus = load_text_corpus(source)
    users = natural_users(
        corpus.train.sizes(),
        num_clients=num_clients,
        public_fraction=float(dataset.get("public_fraction", 0.0)),
        validation_fraction=validation_fraction,
        seed=seed,
        column=f"partition.column={source.user_column!r}",
    )
    asked = source.vocab_size if source.level == "word" else None
    return TextData(corpus, users, uncounted_targets(dataset, corpus.vocabulary), requested_words=asked)
