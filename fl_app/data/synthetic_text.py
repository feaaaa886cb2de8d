"""A generated text corpus with users of their own style: a next-word task that learns in minutes.

``python -m fl_app.data.synthetic_text corpus.parquet --users 2000`` writes a parquet file with the
columns ``client_id`` and ``tokens`` (as TFF's Stack Overflow copy has them), for
``dataset=stackoverflow dataset.path=corpus.parquet`` (``+experiment=text_small``).

The sentences follow a shared Markov chain over ``words`` words (each word has two likely successors:
what a network can learn from everyone), and each user puts its own few favourite words in
(what a user's data says about that user). The users' numbers of sentences are heavy-tailed (Zipf),
as real users' are. A unigram model, always the most frequent word, is right about one time in
ten; a network that learned the chain about four times in ten.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def styled_corpus(
    users: int,
    *,
    seed: int = 0,
    words: int = 40,
    favourites: int = 3,
    own_share: float = 0.25,
    max_sentences: int = 30,
    sentence_words: tuple[int, int] = (4, 24),
) -> tuple[list[str], list[str]]:
    """``(user ids, sentences)`` of a generated corpus (rows grouped by user; see the module docstring)."""
    rng = np.random.default_rng(seed)
    vocabulary = np.array([f"w{i}" for i in range(words)])
    successors = np.stack([rng.permutation(words)[:2] for _ in range(words)])
    ids: list[str] = []
    texts: list[str] = []
    for user in range(users):
        own = rng.choice(words, size=favourites, replace=False)
        for _ in range(min(max_sentences, int(rng.zipf(1.8)))):
            length = int(rng.integers(*sentence_words))
            word = int(rng.integers(words))
            sentence = []
            for _ in range(length):
                sentence.append(word)
                draw = rng.random()
                if draw < own_share:
                    word = int(rng.choice(own))
                elif draw < own_share + 0.6:
                    word = int(successors[word, int(rng.random() < 0.3)])
                else:
                    word = int(rng.integers(words))
            ids.append(f"u{user:06d}")
            texts.append(" ".join(vocabulary[sentence]))
    return ids, texts


def write_corpus(path: Path, users: int, *, seed: int = 0) -> Path:
    """Write :func:`styled_corpus` as a parquet file with the columns ``client_id`` and ``tokens``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    ids, texts = styled_corpus(users, seed=seed)
    pq.write_table(pa.table({"client_id": ids, "tokens": texts}), str(path))
    return path


def main(argv: list[str] | None = None) -> None:
    """``python -m fl_app.data.synthetic_text <file.parquet> [--users N] [--seed S]``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--users", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    write_corpus(args.path, args.users, seed=args.seed)
    print(f"wrote {args.path}: {args.users} users")


if __name__ == "__main__":
    main()


def heavy_tailed_sizes(
    users: int, *, mean: float, rng: np.random.Generator, sigma: float = 1.6
) -> np.ndarray:
    """Sentences per user: log-normal with this ``mean`` (at least 1), heavy-tailed as real users' are."""
    mu = np.log(mean) - sigma**2 / 2
    return np.maximum(1, np.round(rng.lognormal(mu, sigma, size=users))).astype(np.int64)


def write_token_corpus(
    folder: Path,
    *,
    users: int,
    test_users: int,
    mean_sentences: float,
    cap: int | None,
    words: int = 10000,
    length: int = 20,
    seed: int = 0,
    test_mean_sentences: float | None = None,
    chunk_rows: int = 1 << 20,
) -> dict[str, int]:
    """A converted corpus (the folder :mod:`fl_app.data.text` writes) of random sentences, of a given shape.

    ``users`` training users with :func:`heavy_tailed_sizes` sentences each (``mean_sentences`` on
    average, at most ``cap``: the first ones, as the conversion keeps them), ``test_users`` test users
    (``test_mean_sentences`` on average, all kept); ``words`` words plus the four
    special tokens; sentences of 1 to ``length`` words (bos, ids, eos when shorter, pads). The token
    files are written a chunk at a time (memory: one chunk). For benchmarks and tests of the real
    data sets' shape (Stack Overflow: 342,477 users, 10,004 tokens) without their files.
    """
    import json

    from fl_app.data.text import CONVERTER_VERSION, META_FILE
    from fl_app.data.text_cache import file_records
    from fl_app.data.text_tokens import Vocabulary

    rng = np.random.default_rng(seed)
    vocabulary = Vocabulary(tuple(f"w{i}" for i in range(words)))
    folder.mkdir(parents=True, exist_ok=True)
    counts: dict[str, int] = {}
    test_mean = mean_sentences if test_mean_sentences is None else test_mean_sentences
    for name, population, limit, mean in (
        ("train", users, cap, mean_sentences),
        ("test", test_users, None, test_mean),
    ):
        sizes = heavy_tailed_sizes(population, mean=mean, rng=rng)
        if limit is not None:
            sizes = np.minimum(sizes, limit)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        with (folder / f"{name}.tokens").open("wb") as handle:
            for start in range(0, int(offsets[-1]), chunk_rows):
                rows = min(chunk_rows, int(offsets[-1]) - start)
                handle.write(random_sentences(rows, vocabulary, length, rng).tobytes())
        np.save(folder / f"{name}_offsets.npy", offsets)
        counts[f"{name}_users"], counts[f"{name}_sequences"] = population, int(offsets[-1])
    meta = {
        "version": CONVERTER_VERSION,
        "source": {"generated": "fl_app.data.synthetic_text.write_token_corpus", "seed": seed},
        "test": "generated test users",
        "sequence_length": length,
        "dtype": vocabulary.dtype().str,
        "vocabulary": list(vocabulary.tokens),
        **counts,
        "files": file_records(folder),
    }
    (folder / META_FILE).write_text(json.dumps(meta))
    return counts


def random_sentences(rows: int, vocabulary: object, length: int, rng: np.random.Generator) -> np.ndarray:
    """``rows`` sequences of ``length + 1`` ids: bos, 1..length random words, eos when shorter, pads."""
    from fl_app.data.text_tokens import PAD, Vocabulary

    assert isinstance(vocabulary, Vocabulary)
    words = rng.integers(1, len(vocabulary.tokens) + 1, size=(rows, length + 1), dtype=np.int64)
    sizes = rng.integers(1, length + 1, size=rows)
    position = np.arange(length + 1)
    out = np.where(position[None, :] <= sizes[:, None], words, PAD)
    out[:, 0] = vocabulary.bos
    short = sizes < length
    out[np.flatnonzero(short), sizes[short] + 1] = vocabulary.eos
    return out.astype(vocabulary.dtype())
