"""Text to token sequences, as TFF's Shakespeare and Stack Overflow tasks build them.

The vocabulary's layout is TFF's (google-research/federated ``utils/datasets/
stackoverflow_word_prediction.py``, ``get_special_tokens``; ``utils/datasets/shakespeare_dataset.py``):
``0`` is the pad, the ``K`` words (or characters) are ``1..K``, then out of vocabulary ``K + 1``,
beginning of sentence ``K + 2`` and end of sentence ``K + 3``: ``K + 4`` tokens in all.

* **Words** (:func:`word_sequence`, Stack Overflow): the sentence split on single spaces
  (:func:`words_of`: TFF's ``tf.strings.split(sentence, sep=' ')``, case kept, so two spaces in a row
  give an empty word, out of vocabulary), cut to ``length`` words, each word's id (out of vocabulary
  when it is not one of the ``K``), end of sentence appended when the sentence had fewer than
  ``length`` words, beginning of sentence put in front, padded to ``length + 1``: one sequence per
  sentence, the input its first ``length`` tokens, the target its last ``length``.
* **Characters** (:func:`character_sequences`, TFF's Shakespeare snippets): beginning of sentence,
  the characters' ids, end of sentence, padded to a multiple of ``length + 1`` and cut into sequences
  of ``length + 1``.
* **Windows** (:func:`window_sequence`, LEAF's Shakespeare as ``flwrlabs/shakespeare`` holds it: an
  80-character window ``x`` and its next character ``y``): the ids of ``x + y``, its last
  ``length + 1`` characters (padded at the end when shorter): one sequence whose targets are every
  next character of the window.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

#: The pad token: position filler, never a target of the loss.
PAD = 0
#: TFF's Shakespeare characters (``utils/datasets/shakespeare_dataset.py``, ``CHAR_VOCAB``): 86 symbols.
CHAR_VOCAB: tuple[str, ...] = tuple(
    "dhlptx@DHLPTX $(,048cgkoswCGKOSW[_#'/37;?bfjnrvzBFJNRVZ\"&*.26:\naeimquyAEIMQUY]!%)-159\r"
)
Level = Literal["char", "word"]


@dataclass(frozen=True)
class Vocabulary:
    """``K`` words or characters and the special tokens around them (pad 0, then oov, bos, eos)."""

    tokens: tuple[str, ...]

    @property
    def size(self) -> int:
        """All tokens: pad, the ``K`` words, out of vocabulary, beginning and end of sentence."""
        return len(self.tokens) + 4

    @property
    def oov(self) -> int:
        """Out of vocabulary."""
        return len(self.tokens) + 1

    @property
    def bos(self) -> int:
        """Beginning of sentence."""
        return len(self.tokens) + 2

    @property
    def eos(self) -> int:
        """End of sentence."""
        return len(self.tokens) + 3

    def ids(self) -> dict[str, int]:
        """Each word's id (``1..K``)."""
        return {token: i + 1 for i, token in enumerate(self.tokens)}

    def dtype(self) -> np.dtype:
        """The stored ids' type: ``uint16`` (never ``uint8``, which means images) while they fit."""
        return np.dtype(np.uint16) if self.size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


def top_words(user_counts: dict[str, int], size: int) -> tuple[str, ...]:
    """The ``size`` words used by the most users (TFF's word counts count users), ties by the word."""
    ranked = sorted(user_counts.items(), key=lambda item: (-item[1], item[0]))
    return tuple(word for word, _ in ranked[:size])


def count_user_words(texts: Iterable[str], counts: dict[str, int]) -> None:
    """Add one user's words to ``counts``: each word once per user who uses it."""
    seen: set[str] = set()
    for text in texts:
        seen.update(word for word in words_of(text) if word)
    for word in seen:
        counts[word] = counts.get(word, 0) + 1


def read_word_counts(lines: Iterable[str], size: int) -> tuple[str, ...]:
    """The first ``size`` words of a word count file (TFF's ``stackoverflow.word_count``: ``word count``)."""
    words: list[str] = []
    for line in lines:
        parts = line.split()
        if parts:
            words.append(parts[0])
        if len(words) >= size:
            break
    return tuple(words)


def words_of(text: str) -> list[str]:
    """A sentence's words as TFF's Stack Overflow task splits them: on every single space, case kept.

    google-research/federated ``utils/datasets/stackoverflow_word_prediction.py``, ``build_to_ids_fn``:
    ``tf.strings.split(sentence, sep=' ')``. TFF's sentences are lower-cased, space-separated tokens
    already; a tab or any other whitespace stays inside a word, and the empty sentence is one empty word.
    """
    return text.split(" ")


def word_sequence(text: str, ids: dict[str, int], vocabulary: Vocabulary, length: int) -> np.ndarray:
    """One sentence as ``length + 1`` ids: bos, its first ``length`` words, eos if it was shorter, pads."""
    words = words_of(text)[:length]
    row = np.full(length + 1, PAD, dtype=np.int64)
    row[0] = vocabulary.bos
    row[1 : 1 + len(words)] = [ids.get(word, vocabulary.oov) for word in words]
    if len(words) < length:
        row[1 + len(words)] = vocabulary.eos
    return row


def character_ids(text: str, ids: dict[str, int], vocabulary: Vocabulary) -> list[int]:
    """Each character's id (out of vocabulary for a character not in it)."""
    return [ids.get(char, vocabulary.oov) for char in text]


def character_sequences(text: str, ids: dict[str, int], vocabulary: Vocabulary, length: int) -> np.ndarray:
    """A snippet as rows of ``length + 1`` ids: bos, its characters, eos, padded to whole rows."""
    tokens = [vocabulary.bos, *character_ids(text, ids, vocabulary), vocabulary.eos]
    rows = -(-len(tokens) // (length + 1))
    flat = np.full(rows * (length + 1), PAD, dtype=np.int64)
    flat[: len(tokens)] = tokens
    return flat.reshape(rows, length + 1)


def window_sequence(
    window: str, following: str, ids: dict[str, int], vocabulary: Vocabulary, length: int
) -> np.ndarray:
    """LEAF's window and its next character as one row of ``length + 1`` ids (the last characters)."""
    tokens = character_ids(window + following, ids, vocabulary)[-(length + 1) :]
    row = np.full(length + 1, PAD, dtype=np.int64)
    row[: len(tokens)] = tokens
    return row


def user_sequences(
    texts: Sequence[str],
    followers: Sequence[str] | None,
    *,
    level: Level,
    ids: dict[str, int],
    vocabulary: Vocabulary,
    length: int,
    limit: int | None,
) -> np.ndarray:
    """One user's rows ``(n, length + 1)``: their texts in order, at most ``limit`` rows (None: all)."""
    rows: list[np.ndarray] = []
    count = 0
    for index, text in enumerate(texts):
        if limit is not None and count >= limit:
            break
        if followers is not None:
            part = window_sequence(text, followers[index], ids, vocabulary, length)[None]
        elif level == "word":
            part = word_sequence(text, ids, vocabulary, length)[None]
        else:
            part = character_sequences(text, ids, vocabulary, length)
        rows.append(part)
        count += len(part)
    if not rows:
        return np.zeros((0, length + 1), dtype=np.int64)
    stacked = np.concatenate(rows)
    return stacked if limit is None else stacked[:limit]
