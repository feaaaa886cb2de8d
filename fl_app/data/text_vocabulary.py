"""Where a text run's vocabulary comes from, and the words a DP vocabulary is released from.

A word-level run's vocabulary is a choice made from data. Its origin (:class:`VocabularyChoice`) is
decided once, before anything starts (:mod:`fl_app.config.data_choices`), and recorded in the run's
data spec (``dataset.vocabulary_choice``), which every process reads:

* ``characters``: TFF's 86 characters, fixed by TFF's code (public by construction);
* ``generated``: the words of a generated corpus (public by construction);
* ``public_file``: a word file the user declared public (``dataset.vocabulary_public=true``): an
  assumption the run states, since TFF's ``stackoverflow.word_count`` is counted on the same
  training users;
* ``file``: a word file not declared public (a run that is not private);
* ``counted``: the ``vocab_size`` words used by the most training users, un-noised (TFF's rule; a
  run that is not private);
* ``dp``: released by DP partition selection (:mod:`fl_app.privacy.partition_selection`) on the
  training users, each contributing its :func:`user_top_words`, and charged to every user.

A DP release is kept in ``$DPFL_DATA_HOME/text/vocabularies/<key>.json`` (its words and the
mechanism's parameters, named by a digest of both), so that every process of the run reads the
same words and the spec carries only the key; the bounded counts it is drawn from are kept in
``$DPFL_DATA_HOME/text/counts/<key>.json`` (derived from the users' data, as the converted token
arrays are: never published).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fl_app.data.sources import DataFileError, data_home
from fl_app.data.text_tokens import words_of

#: The data spec's key (``dataset.vocabulary_choice``) that records a text run's vocabulary.
CHOICE_KEY = "vocabulary_choice"
#: Origins a private run may use: public by construction, declared public, or charged.
COVERED_ORIGINS = ("characters", "generated", "public_file", "dp")
#: Bump when the bounded counting changes: counts of another version are counted again.
COUNTS_VERSION = 1


@dataclass(frozen=True)
class VocabularyChoice:
    """Where a text run's vocabulary comes from (see the module docstring).

    Attributes
    ----------
    origin : str
        ``characters``, ``generated``, ``public_file``, ``file``, ``counted`` or ``dp``.
    words : int or None
        The words in it (None: known once the data set is converted).
    file : str or None
        The word file (``public_file``, ``file``).
    release : str or None
        The key of a DP release (``dp``).
    budget : Mapping or None
        The DP release's mechanism and its share of the budget
        (:meth:`fl_app.privacy.partition_selection.SelectionBudget.to_json`).

    """

    origin: str
    words: int | None = None
    file: str | None = None
    release: str | None = None
    budget: Mapping[str, Any] | None = None

    @property
    def covered(self) -> bool:
        """Whether a private run's epsilon can hold with it (public, declared public, or charged)."""
        return self.origin in COVERED_ORIGINS

    def text(self) -> str:
        """The vocabulary in words, for the run's header and results."""
        if self.origin == "characters":
            return "TFF's 86 characters (fixed by TFF's code: public by construction)"
        if self.origin == "generated":
            return "the generated corpus's words (public by construction)"
        if self.origin == "public_file":
            return f"the words of {self.file}, declared public (dataset.vocabulary_public=true)"
        if self.origin == "file":
            return f"the words of {self.file} (not declared public)"
        if self.origin == "counted":
            return "the words used by the most training users, counted un-noised (TFF's rule; not private)"
        budget = self.budget or {}
        return (
            f"{self.words} words released by DP partition selection on the training users (each user's "
            f"{budget.get('words_per_user')} most used words once, Gaussian noise of std "
            f"{float(budget.get('noise_multiplier', 0)) * float(budget.get('words_per_user', 0)) ** 0.5:.4g}"
            f", threshold {float(budget.get('threshold', 0)):.4g} users)"
        )

    def assumption(self) -> str | None:
        """What a private run's epsilon assumes about the vocabulary (None: nothing)."""
        if self.origin != "public_file":
            return None
        return (
            f"the vocabulary file {self.file} is public, as dataset.vocabulary_public=true declares: it "
            "must not depend on this data set's users (TFF's stackoverflow.word_count is counted on the "
            "same training users); if it does, no epsilon of this run covers the vocabulary"
        )

    def to_json(self) -> dict[str, Any]:
        """The choice as plain data (the spec's ``dataset.vocabulary_choice``)."""
        data = asdict(self)
        data["budget"] = None if self.budget is None else dict(self.budget)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> VocabularyChoice:
        """Inverse of :meth:`to_json`."""
        budget = data.get("budget")
        return cls(
            origin=str(data["origin"]),
            words=None if data.get("words") is None else int(data["words"]),
            file=None if data.get("file") is None else str(data["file"]),
            release=None if data.get("release") is None else str(data["release"]),
            budget=None if budget is None else dict(budget),
        )


def choice_of(dataset: Mapping[str, Any]) -> VocabularyChoice | None:
    """The choice a data spec's ``dataset`` group records (None: none recorded)."""
    recorded = dataset.get(CHOICE_KEY)
    return None if recorded is None else VocabularyChoice.from_json(recorded)


# ----------------------------------------------------------------------------- bounded counts


def user_top_words(texts: Iterable[str], k: int) -> list[str]:
    """One user's ``k`` most used words (split as the task splits them, no empty word), ties by word.

    A function of that user's texts alone: the user's contribution to the counts (each word once).
    """
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(word for word in words_of(text) if word)
    ranked = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    return [word for word, _ in ranked[:k]]


def count_bounded_words(users: Iterable[Sequence[str]], k: int) -> dict[str, int]:
    """Each word's number of users among whose :func:`user_top_words` it is (``users``: their texts)."""
    counts: Counter[str] = Counter()
    for texts in users:
        counts.update(user_top_words(texts, k))
    return dict(counts)


def counts_path(key: str) -> Path:
    """Where the bounded counts of key ``key`` are kept."""
    return data_home() / "text" / "counts" / f"{key}.json"


def read_counts(key: str) -> dict[str, int] | None:
    """The kept bounded counts of ``key`` (None: not kept, or unreadable)."""
    try:
        data = json.loads(counts_path(key).read_text(encoding="utf-8"))
        if data.get("version") != COUNTS_VERSION:
            return None
        return {str(word): int(count) for word, count in zip(data["words"], data["counts"], strict=True)}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_counts(key: str, counts: Mapping[str, int]) -> None:
    """Keep ``counts`` under ``key`` (written whole, then renamed into place)."""
    words = sorted(counts)
    data = {"version": COUNTS_VERSION, "words": words, "counts": [int(counts[w]) for w in words]}
    write_atomically(counts_path(key), json.dumps(data))


# ----------------------------------------------------------------------------- DP releases


def release_path(key: str) -> Path:
    """Where the DP release ``key`` is kept."""
    return data_home() / "text" / "vocabularies" / f"{key}.json"


def write_release(words: Sequence[str], budget: Mapping[str, Any]) -> str:
    """Keep a DP release (its words and mechanism) and return its key (a digest of both)."""
    data = {"words": list(words), "selection": dict(budget)}
    text = json.dumps(data, sort_keys=True)
    key = hashlib.sha256(text.encode("utf-8")).hexdigest()[:32]
    path = release_path(key)
    if not path.is_file():
        write_atomically(path, text)
    return key


def read_release(key: str) -> tuple[tuple[str, ...], dict[str, Any]]:
    """The words and the mechanism of the DP release ``key``.

    Raises
    ------
    DataFileError
        One line: the release is not kept on this machine, or its file does not match its key.

    """
    path = release_path(key)
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text)
        words, budget = tuple(str(w) for w in data["words"]), dict(data["selection"])
    except (OSError, ValueError, KeyError, TypeError):
        raise DataFileError(
            f"dataset.vocabulary_choice={key!r}: the DP vocabulary {path} cannot be read; convert the "
            "data set again (a private run releases a new one)"
        ) from None
    if hashlib.sha256(text.encode("utf-8")).hexdigest()[:32] != key:
        raise DataFileError(
            f"dataset.vocabulary_choice={key!r}: {path} does not hold that release (changed?)"
        )
    return words, budget


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` under a temporary name, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
