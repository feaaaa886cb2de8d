"""Text data sets: conversion to token sequences against an independent reading, in every accepted format.

The oracle (:func:`expected_words`, :func:`expected_snippets`) rebuilds what the papers' code builds
(google-research/federated ``stackoverflow_word_prediction.py`` and ``shakespeare_dataset.py``) from
the rows with plain Python: users grouped by id, their rows in source order, the vocabulary counted as
TFF's word counts are (users per word), bos + ids + eos padded to ``length + 1``.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from fl_app.data.federated import DataSpec, build_federated_data
from fl_app.data.sources import DataFileError, DataNotFoundError
from fl_app.data.text import load_text_corpus, natural_users, open_corpus, text_source
from fl_app.data.text_tokens import CHAR_VOCAB
from fl_app.data.tf_example import example_features
from tests.text_corpora import (
    char_rows,
    encode_example,
    styled_rows,
    windows,
    words_options,
    write_rows,
    write_tff_sqlite,
)

LENGTH = 20


@pytest.fixture(autouse=True)
def data_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test converts into its own cache."""
    home = tmp_path / "home"
    monkeypatch.setenv("DPFL_DATA_HOME", str(home))
    return home


def held_out_oracle(rows: list[tuple[str, str]], fraction: float) -> set[str]:
    """The documented hold-out: round(fraction * users) (at least 1) of smallest SHA-256 (first 8 bytes)."""
    users = sorted({user for user, _ in rows})
    ranked = sorted(users, key=lambda u: int.from_bytes(hashlib.sha256(u.encode()).digest()[:8], "big"))
    return set(ranked[: max(1, round(fraction * len(users)))])


def grouped(rows: list[tuple[str, str]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for user, text in rows:
        out.setdefault(user, []).append(text)
    return dict(sorted(out.items()))


def expected_words(
    train: dict[str, list[str]], test: dict[str, list[str]], size: int, cap: int | None
) -> tuple[list[str], dict[str, np.ndarray], dict[str, np.ndarray]]:
    users_per_word: Counter[str] = Counter()
    for texts in train.values():
        users_per_word.update({w for t in texts for w in t.split(" ") if w})
    vocabulary = [w for w, _ in sorted(users_per_word.items(), key=lambda kv: (-kv[1], kv[0]))][:size]
    oov, bos, eos = size + 1, size + 2, size + 3

    def sequence(text: str) -> list[int]:
        words = text.split(" ")[:LENGTH]
        ids = [vocabulary.index(w) + 1 if w in vocabulary else oov for w in words]
        ids = [bos, *ids] + ([eos] if len(words) < LENGTH else [])
        return ids + [0] * (LENGTH + 1 - len(ids))

    def rows(users: dict[str, list[str]], limit: int | None) -> dict[str, np.ndarray]:
        return {u: np.array([sequence(t) for t in texts][:limit]) for u, texts in users.items()}

    return vocabulary, rows(train, cap), rows(test, None)


def corpus_rows(split) -> dict[int, np.ndarray]:
    return {u: np.asarray(split.rows(u), dtype=np.int64) for u in range(split.users)}


def assert_corpus(corpus, train: dict[str, np.ndarray], test: dict[str, np.ndarray]) -> None:
    """Every user whole, in the order of the ids, in its split only."""
    for split, expected in ((corpus.train, train), (corpus.test, test)):
        assert split.users == len(expected)
        got = corpus_rows(split)
        for index, (user, rows) in enumerate(expected.items()):
            np.testing.assert_array_equal(got[index], rows, err_msg=f"user {user}")


@pytest.mark.parametrize("form", ["parquet", "csv", "json", "disk", "sqlite"])
def test_words_convert_as_the_papers_build_them(tmp_path: Path, form: str) -> None:
    rows = styled_rows(24, seed=3)
    path = write_rows(rows, tmp_path / f"corpus.{form}", form)
    source = text_source(words_options(path, max_sequences_per_user=5), {"column": "client_id"})
    corpus = load_text_corpus(source)
    users, held = grouped(rows), held_out_oracle(rows, 0.25)
    train = {u: t for u, t in users.items() if u not in held}
    test = {u: t for u, t in users.items() if u in held}
    assert len(test) == 6 and len(train) == 18
    vocabulary, train_rows, test_rows = expected_words(train, test, 25, cap=5)
    assert list(corpus.vocabulary.tokens) == vocabulary
    assert corpus.vocabulary.size == 29 and corpus.vocabulary.eos == 28
    assert corpus.train.tokens.dtype == np.uint16  # never uint8 (images)
    assert_corpus(corpus, train_rows, test_rows)


def test_a_test_split_is_the_test_users_and_counts_no_word(tmp_path: Path) -> None:
    """TFF's file has its own test split: those users (even one also in train) are the test split, whole."""
    train_rows, test_rows = styled_rows(12, seed=1), styled_rows(5, seed=9)
    path = write_tff_sqlite(
        {"train": train_rows, "test": test_rows, "heldout": test_rows[:3]}, tmp_path / "so.sqlite"
    )
    corpus = load_text_corpus(text_source(words_options(path), {"column": "client_id"}))
    vocabulary, train_expected, test_expected = expected_words(
        grouped(train_rows), grouped(test_rows), 25, None
    )
    assert list(corpus.vocabulary.tokens) == vocabulary
    assert_corpus(corpus, train_expected, test_expected)
    assert corpus.meta["test"] == "test"


def test_a_vocabulary_file_gives_the_words(tmp_path: Path) -> None:
    rows = styled_rows(10, seed=2)
    counts = tmp_path / "stackoverflow.word_count"
    counts.write_text("w5 900\nw1 800\nw44 10\nw2 1\n")
    path = write_rows(rows, tmp_path / "c.parquet", "parquet")
    corpus = load_text_corpus(text_source(words_options(path, vocab_size=3, vocabulary=str(counts)), {}))
    assert corpus.vocabulary.tokens == ("w5", "w1", "w44")
    first = corpus.train.rows(0)[0]
    held = held_out_oracle(rows, 0.25)
    user_text = grouped(rows)[next(u for u in grouped(rows) if u not in held)][0]
    expected = [{"w5": 1, "w1": 2, "w44": 3}.get(w, 4) for w in user_text.split(" ")[:LENGTH]]
    np.testing.assert_array_equal(first[1 : 1 + len(expected)], expected)


def expected_snippets(texts: list[str], length: int) -> np.ndarray:
    """TFF's Shakespeare: each snippet bos, its characters (unknown 87), eos, padded to whole rows."""
    out = []
    for text in texts:
        tokens = [88] + [CHAR_VOCAB.index(c) + 1 if c in CHAR_VOCAB else 87 for c in text] + [89]
        tokens += [0] * (-len(tokens) % (length + 1))
        out += [tokens[i : i + length + 1] for i in range(0, len(tokens), length + 1)]
    return np.array(out)


def test_character_snippets_and_leaf_windows(tmp_path: Path) -> None:
    rows = char_rows(8, seed=4)
    snippets = write_rows(
        rows, tmp_path / "snippets.parquet", "parquet", user="character_id", text="snippets"
    )
    options = words_options(
        snippets, name="shakespeare", level="char", text_column="snippets", sequence_length=10
    )
    options["accuracy_without_oov"] = False
    corpus = load_text_corpus(text_source(options, {}))
    assert corpus.vocabulary.size == 90 and corpus.vocabulary.tokens == CHAR_VOCAB
    users, held = grouped(rows), held_out_oracle(rows, 0.25)
    train = {u: expected_snippets(t, 10) for u, t in users.items() if u not in held}
    test = {u: expected_snippets(t, 10) for u, t in users.items() if u in held}
    assert_corpus(corpus, train, test)

    import datasets

    leaf = windows(rows, 10)
    folder = tmp_path / "leaf"
    datasets.Dataset.from_dict(
        {"character_id": [r[0] for r in leaf], "x": [r[1] for r in leaf], "y": [r[2] for r in leaf]}
    ).save_to_disk(str(folder))
    options = {**options, "path": str(folder), "text_column": "x", "target_column": "y"}
    corpus = load_text_corpus(text_source(options, {}))
    by_user: dict[str, list[list[int]]] = {}
    for user, x, y in leaf:  # one row per window: the ids of x + y
        by_user.setdefault(user, []).append(
            [CHAR_VOCAB.index(c) + 1 if c in CHAR_VOCAB else 87 for c in x + y]
        )
    expected = {u: np.array(r) for u, r in sorted(by_user.items()) if u not in held}
    held_rows = {u: np.array(r) for u, r in sorted(by_user.items()) if u in held}
    assert_corpus(corpus, expected, held_rows)


def test_converted_once_then_read_from_the_cache(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write_rows(styled_rows(10), tmp_path / "c.parquet", "parquet")
    source = text_source(words_options(path), {})
    first = load_text_corpus(source)
    assert "converting it to token sequences, once" in capsys.readouterr().out
    again = load_text_corpus(source)
    assert capsys.readouterr().out == ""
    np.testing.assert_array_equal(first.train.tokens, again.train.tokens)
    assert isinstance(again.train.tokens, np.memmap)  # read from disk, not held
    write_rows(styled_rows(11), path, "parquet")  # an edited file is converted again
    load_text_corpus(text_source(words_options(path), {}))
    assert "converting" in capsys.readouterr().out


def test_natural_users_as_the_natural_partition_orders_them() -> None:
    """The same users as fl_app.data.natural.natural_split takes for rows grouped the same way."""
    from fl_app.data.natural import natural_split

    sizes = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3])
    groups = np.repeat(np.arange(len(sizes)), sizes)
    public, clients, validation = natural_users(
        sizes, num_clients=5, public_fraction=0.2, validation_fraction=0.1, seed=7, column="c"
    )
    rows = natural_split(groups, num_clients=5, public_fraction=0.2, validation_fraction=0.1, seed=7)
    assert [groups[r[0]] for r in rows[1]] == list(clients)
    assert sorted(set(groups[rows[0]])) == list(public)
    assert sorted(set(groups[rows[2]])) == list(validation)
    with pytest.raises(ValueError, match="fewer than num_clients=11"):
        natural_users(sizes, num_clients=11, public_fraction=0, validation_fraction=0, seed=0, column="c")


def test_clients_are_users_whole(tmp_path: Path) -> None:
    path = write_rows(styled_rows(30, seed=5), tmp_path / "c.parquet", "parquet")
    spec = DataSpec(words_options(path), {"name": "natural", "column": "client_id"}, num_clients=12, seed=3)
    data = build_federated_data(spec)
    corpus = open_corpus(next((Path(str(tmp_path)) / "home" / "text").iterdir()))
    assert data.num_classes == 29 and data.input_shape == (LENGTH,)
    assert data.uncounted_targets == (0, 26, 28)  # pad, out of vocabulary, end of sentence
    for client in range(12):
        user = data.client_users[client]
        rows = np.asarray(corpus.train.rows(user))
        got = data.client(client)
        np.testing.assert_array_equal(got.x, rows[:, :-1])
        np.testing.assert_array_equal(got.y, rows[:, 1:])
        assert data.client_sizes()[client] == len(rows)
    assert len(set(data.client_users)) == 12
    rows, sizes = data.rows_of([7, 2, 7])
    np.testing.assert_array_equal(rows, np.concatenate([data.client_rows[c] for c in (7, 2, 7)]))
    assert sizes.tolist() == [data.client_sizes()[c] for c in (7, 2, 7)]
    np.testing.assert_array_equal(data.test().x, np.asarray(corpus.test.tokens)[:, :-1])


def test_decoder_reads_what_protobuf_encodes() -> None:
    blob = encode_example(
        {"tokens": ["héllo wörld".encode(), b"x"], "score": [-3, 2**40], "f": [0.5, -1.25], "empty": [b""]}
    )
    features = example_features(blob)
    assert features["tokens"] == ["héllo wörld".encode(), b"x"]
    assert features["score"] == [-3, 2**40]
    assert features["f"] == [0.5, -1.25]
    assert features["empty"] == [b""]
    assert struct.pack("<f", features["f"][0])  # floats, not bytes


def test_bad_sources_are_one_line(tmp_path: Path) -> None:
    missing = text_source(words_options(tmp_path / "nowhere.parquet"), {})
    with pytest.raises(DataNotFoundError, match=r"^dataset.path=.*does not exist"):
        load_text_corpus(missing)
    import datasets

    numbers = tmp_path / "numbers.parquet"
    datasets.Dataset.from_dict({"client_id": ["a", "b"], "tokens": [1, 2]}).to_parquet(str(numbers))
    with pytest.raises(DataFileError, match=r"^dataset.text_column='tokens': is int64, not text"):
        load_text_corpus(text_source(words_options(numbers), {}))
    empty = write_rows(
        [("a", "hello there"), ("b", "  "), ("b", ""), ("c", "x")], tmp_path / "e.parquet", "parquet"
    )
    with pytest.raises(DataFileError, match=r"user 'b' has no text"):
        load_text_corpus(text_source(words_options(empty, test_fraction=0.3), {}))
    sqlite = write_tff_sqlite({"train": [("a", "x y")]}, tmp_path / "so.sqlite", text_feature="body")
    with pytest.raises(
        DataFileError, match=r"^dataset.text_column='tokens': no such feature; .*body \(text\)"
    ):
        load_text_corpus(text_source(words_options(sqlite), {}))
    assert not any((tmp_path / "home" / "text").glob("*/meta.json"))  # nothing half-written
