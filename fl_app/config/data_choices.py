"""Choices a run makes from the clients' data before training: public, declared, or made with DP.

Every choice a private run makes from the clients' data before or beside training is either public
(by construction, or declared by the user and stated as an assumption) or made by a DP mechanism
charged to every user with the training (docs/privacy.md, "Choices made from the data"). Validation
applies the rule before anything starts:

* :func:`decide_vocabulary`, a text data set's vocabulary, recorded in the run's data spec
  (``dataset.vocabulary_choice``):

  - characters (``dataset.level=char``): TFF's 86, public by construction;
  - a converted corpus named as it is (``dataset.path=<folder>``) keeps its vocabulary: a generated
    one's is public by construction, a DP release is charged again, a word file's needs the same
    declaration as below, and one counted un-noised on its users is refused for a private run;
  - a word file (``dataset.vocabulary``): a private run must declare it public
    (``dataset.vocabulary_public=true``), an assumption its header, ``results.json`` and the report
    state;
  - otherwise a private run releases a DP vocabulary: ``dataset.vocabulary_budget_fraction`` of
    ``privacy.epsilon`` and of ``privacy.delta``, each training user's
    ``dataset.vocabulary_words_per_user`` most used words counted once, Gaussian noise and a
    threshold (:mod:`fl_app.privacy.partition_selection`), drawn from the run's privacy randomness
    (OS entropy with ``privacy.secure_rng``); the training gets the rest of the budget
    (:mod:`fl_app.run.vocabulary`). A run that is not private counts the words un-noised on the
    training users (TFF's rule);

* :func:`check_declared_classes`, a ``dataset=hf`` run's number of classes: a private run takes it
  from the data set's schema (a ``ClassLabel``) or ``dataset.num_classes``, never from the labels'
  values (one client's label could add a class, and a row to the model's output).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fl_app.config.checks import ConfigError, require_bool, require_int, require_range
from fl_app.data.examples import TEXT_DATASETS
from fl_app.data.sources import DataFileError
from fl_app.data.text_vocabulary import CHOICE_KEY, VocabularyChoice, read_release, write_release
from fl_app.privacy.rng import RandomSource, derive_noise_seed

if TYPE_CHECKING:
    from fl_app.config.settings import RunSettings
    from strategies.contract import Declaration

#: The end of the unit of an algorithm whose noise the server adds (the DP vocabulary's threat model).
CENTRAL_DP = "central DP"
#: The noise generator's purpose (:meth:`fl_app.privacy.rng.RandomSource.generator`).
NOISE_PURPOSE = "vocabulary-selection"
#: What a private run can use instead of a DP vocabulary (completes the refusals below).
PUBLIC_FILE_HINT = (
    "name a public word file instead: dataset.vocabulary=<file> dataset.vocabulary_public=true "
    "(stated in the results as an assumption)"
)


def validate_vocabulary_keys(dataset: Any) -> None:
    """``dataset.vocabulary_public``, ``vocabulary_words_per_user`` and ``vocabulary_budget_fraction``."""
    public = require_bool("dataset.vocabulary_public", dataset.get("vocabulary_public", False))
    if public and dataset.get("vocabulary") is None:
        raise ConfigError(
            "dataset.vocabulary_public", public, "declares a word file public: name it (dataset.vocabulary)"
        )
    require_int("dataset.vocabulary_words_per_user", dataset.get("vocabulary_words_per_user", 100), minimum=1)
    require_range(
        "dataset.vocabulary_budget_fraction",
        dataset.get("vocabulary_budget_fraction", 0.1),
        0.0,
        1.0,
        low_open=True,
        high_open=True,
    )


def decide_vocabulary(settings: RunSettings, declaration: Declaration) -> RunSettings:
    """``settings`` whose data spec records the vocabulary (``dataset.vocabulary_choice``).

    Unchanged for a data set that is not text. Raises :class:`ConfigError` (one line) for a private
    run whose vocabulary would be outside its epsilon; data errors (a missing file) as the data
    layer raises them.
    """
    dataset = settings.data.dataset
    if dataset["name"] not in TEXT_DATASETS:
        return settings
    private = declaration.is_private(settings)
    choice = vocabulary_choice(settings, declaration, private=private)
    if private and not choice.covered:
        raise ConfigError(*uncovered(choice, settings))
    if private and choice.budget is not None:
        check_share(choice.budget, settings)
    spec = dataclasses.replace(settings.data, dataset={**dataset, CHOICE_KEY: choice.to_json()})
    return dataclasses.replace(settings, data=spec)


def vocabulary_choice(settings: RunSettings, declaration: Declaration, *, private: bool) -> VocabularyChoice:
    """Where the vocabulary comes from (a DP release drawn now, for a private run without a public one)."""
    from fl_app.data.text import META_FILE, text_source

    dataset = settings.data.dataset
    if private and settings.resume is not None:
        resumed = resumed_release(settings.resume)
        if resumed is not None:
            return resumed
    source = text_source(dataset, settings.data.partition)
    local = source.local_path()
    if local is not None and (local / META_FILE).is_file():
        return converted_choice(local, dataset)
    if source.level == "char":
        return VocabularyChoice("characters", words=86)
    if source.vocabulary is not None:
        public = bool(dataset.get("vocabulary_public", False))
        return VocabularyChoice("public_file" if public else "file", file=source.vocabulary)
    if not private:
        return VocabularyChoice("counted")
    return dp_release(settings, declaration, source)


def resumed_release(directory: str) -> VocabularyChoice | None:
    """The DP vocabulary the run in ``directory`` released, from its checkpoint (None: none released).

    A resumed run trains on the words its first part released and was charged for: it never draws
    them again (under ``privacy.secure_rng`` a new draw would differ, and be a second release).
    """
    from fl_app.run.checkpoint import read_header

    try:
        recorded = read_header(Path(directory)).get(CHOICE_KEY)
    except (OSError, ValueError):
        return None  # validate_resume names what is wrong with the folder
    choice = None if recorded is None else VocabularyChoice.from_json(recorded)
    if choice is None or choice.origin != "dp" or choice.release is None:
        return None
    try:
        read_release(choice.release)
    except DataFileError as error:
        raise ConfigError(
            "resume",
            directory,
            f"the run's DP vocabulary is not kept on this machine ({error}): resume it where it was released",
        ) from None
    return choice


def converted_choice(folder: Path, dataset: Any) -> VocabularyChoice:
    """The vocabulary a converted corpus holds, by what its ``meta.json`` says it was built from."""
    from fl_app.data.text import META_FILE

    try:
        meta = json.loads((folder / META_FILE).read_text())
        built_from, words = dict(meta.get("source") or {}), len(meta["vocabulary"])
    except (OSError, ValueError, KeyError, TypeError):
        raise ConfigError(
            "dataset.path", str(folder), f"a converted corpus whose {META_FILE} cannot be read"
        ) from None
    if "generated" in built_from:
        return VocabularyChoice("generated", words=words)
    if built_from.get("level") == "char":
        return VocabularyChoice("characters", words=words)
    if built_from.get("release"):
        _, budget = read_release(str(built_from["release"]))
        return VocabularyChoice("dp", words=words, release=str(built_from["release"]), budget=budget)
    if built_from.get("vocabulary"):
        public = bool(dataset.get("vocabulary_public", False))
        origin = "public_file" if public else "file"
        return VocabularyChoice(origin, words=words, file=str(built_from["vocabulary"]))
    return VocabularyChoice("counted", words=words)


def dp_release(settings: RunSettings, declaration: Declaration, source: Any) -> VocabularyChoice:
    """Release the vocabulary by DP partition selection on the training users, now."""
    from fl_app.data.text import training_word_counts
    from fl_app.privacy.partition_selection import calibrate_selection

    refuse_dp_release(settings, declaration)
    dataset, privacy = settings.data.dataset, settings.privacy
    fraction = float(dataset.get("vocabulary_budget_fraction", 0.1))
    budget = calibrate_selection(
        epsilon=fraction * privacy.epsilon,
        delta=fraction * privacy.delta,
        words_per_user=int(dataset.get("vocabulary_words_per_user", 100)),
        method=privacy.accountant,
    )
    counts = training_word_counts(source, budget.selection.words_per_user)
    rng = release_randomness(settings, budget.to_json()).generator(NOISE_PURPOSE)
    words = budget.selection.select(counts, source.vocab_size, rng)
    release = write_release(words, budget.to_json())
    return VocabularyChoice("dp", words=len(words), release=release, budget=budget.to_json())


def release_randomness(settings: RunSettings, budget: dict[str, Any]) -> RandomSource:
    """The DP vocabulary's noise: OS entropy, ``privacy.noise_seed``, or a seed derived from what it reads.

    As the run's privacy noise (:func:`fl_app.run.server.noise_source`), but the derived seed is
    :func:`~fl_app.privacy.rng.derive_noise_seed` of ``seed`` and the release's inputs alone (the data
    set and partition groups, the mechanism): the jobs of a sweep over the training's settings share
    one release, and one conversion, instead of each drawing its own.
    """
    privacy = settings.privacy
    if privacy.secure_rng:
        return RandomSource(seed=None, secure=True)
    if privacy.noise_seed is not None:
        return RandomSource(seed=privacy.noise_seed)
    data = settings.data
    inputs = {"dataset": data.dataset, "partition": data.partition, "selection": budget}
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()
    return RandomSource(seed=derive_noise_seed(seed=settings.seed, fingerprint=f"vocabulary|{digest}"))


def refuse_dp_release(settings: RunSettings, declaration: Declaration) -> None:
    """A DP vocabulary needs central DP and a total budget."""
    if not declaration.unit.endswith(CENTRAL_DP):
        raise ConfigError(
            "dataset.vocabulary",
            None,
            f"strategy={declaration.name} protects the clients' data against the server (local or "
            "distributed DP): a DP vocabulary is a central-DP release by whoever converts the data set, "
            f"outside that threat model; {PUBLIC_FILE_HINT}",
        )
    if settings.privacy.budget_scope != "total":
        raise ConfigError(
            "privacy.budget_scope",
            settings.privacy.budget_scope,
            "must be total for a DP vocabulary (it takes dataset.vocabulary_budget_fraction of the run's "
            f"budget); or {PUBLIC_FILE_HINT}",
        )


def check_share(budget: Any, settings: RunSettings) -> None:
    """A DP vocabulary's share (a converted corpus's recorded one) must leave the training a budget."""
    epsilon, delta = (
        float(budget["epsilon"]),
        float(budget["delta_gaussian"]) + float(budget["delta_threshold"]),
    )
    privacy = settings.privacy
    if epsilon >= privacy.epsilon or delta >= privacy.delta:
        raise ConfigError(
            "privacy.epsilon",
            privacy.epsilon,
            f"must exceed the DP vocabulary's epsilon {epsilon:g} (and privacy.delta its delta {delta:g}): "
            "the converted corpus's vocabulary was released at that budget, which this run charges",
        )


def uncovered(choice: VocabularyChoice, settings: RunSettings) -> tuple[str, Any, str]:
    """The key, value and reason of a private run's refused vocabulary (:class:`ConfigError`'s arguments)."""
    if choice.origin == "file":
        return (
            "dataset.vocabulary_public",
            False,
            f"must be true to use dataset.vocabulary={choice.file} in a private run: that declares the file "
            "public, independent of this data set's users (TFF's stackoverflow.word_count is counted on the "
            "same training users), an assumption the results state; or set dataset.vocabulary=null for a "
            "DP vocabulary",
        )
    return (
        "dataset.path",
        settings.data.dataset.get("path"),
        "a converted corpus whose vocabulary was counted on its training users, un-noised: no epsilon "
        "would cover it; name the source instead (a private run releases a DP vocabulary), or convert "
        "it with a public word file",
    )


def check_declared_classes(settings: RunSettings, declaration: Declaration) -> None:
    """A private ``dataset=hf`` run's number of classes is declared, not counted from the labels.

    Read after the data set is converted (its cache records whether the label column is a
    ``ClassLabel``). Raises :class:`ConfigError` naming ``dataset.num_classes``.
    """
    dataset = settings.data.dataset
    if dataset["name"] != "hf" or dataset.get("num_classes") is not None:
        return
    if not declaration.is_private(settings):
        return
    from fl_app.data.federated import hf_source
    from fl_app.data.hf import cache_path, read_cache

    source = hf_source(settings.data)
    splits = None if source is None else read_cache(cache_path(source))
    if splits is None or splits[0].declared_classes:
        return
    raise ConfigError(
        "dataset.num_classes",
        None,
        f"must be set in a private run: the label column {dataset.get('label_column')!r} holds integers, "
        "whose number of classes would be counted from the clients' labels (one client's label can add a "
        "class, and a row to the model's output, outside the epsilon); set the data set's number of classes",
    )
