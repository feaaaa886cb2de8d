"""The checks of a text data set's run (``dataset=shakespeare``, ``dataset=stackoverflow``).

Each problem is one :class:`~fl_app.config.checks.ConfigError` naming the key, found before anything
starts: the ``dataset`` keys (:func:`validate_text_options`), the partition (the users are the
clients: ``partition=natural``), an algorithm or evaluation stage that cannot train or evaluate a
next-token network (:func:`refuse_on_text`), a network of the wrong kind or one that does not take
the configured sequences, before the data is converted (:func:`check_model_kind`), and a network
that does not give one score per vocabulary entry of the converted data (:func:`check_text_model`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig

from fl_app.config.checks import (
    ConfigError,
    require_bool,
    require_choice,
    require_int,
    require_text,
    validate_split_keys,
)

if TYPE_CHECKING:
    from fl_app.config.settings import RunSettings
    from strategies.contract import Declaration

#: ``dataset.level``: characters or words.
LEVELS = ("char", "word")
#: The longest sequence accepted (a longer one is almost surely a mistake for these tasks).
MAX_SEQUENCE_LENGTH = 4096
#: Why an evaluation stage cannot evaluate a next-token network.
STAGE_REFUSALS = {
    "laplace_eval": (
        "its clients release one noised probability vector per example and the server clusters them by "
        "class; a text example predicts a token at every position, which it does not evaluate"
    ),
}


def validate_text_options(cfg: DictConfig) -> None:
    """Check a text data set's ``dataset`` keys and its partition (no file is read; one is looked for)."""
    dataset, name = cfg.dataset, str(cfg.dataset.name)
    require_text(
        "dataset.path",
        dataset.get("path"),
        "a hub name (flwrlabs/shakespeare), TFF's SQLite file, a save_to_disk folder or a parquet, csv or "
        "json file with a user id and a text column (docs/text.md: how to fetch them)",
    )
    validate_split_keys(dataset)
    require_text("dataset.text_column", dataset.get("text_column"), "the column (or feature) of the text")
    level = require_choice("dataset.level", dataset.get("level"), LEVELS)
    if dataset.get("target_column") is not None:
        require_text(
            "dataset.target_column", dataset.target_column, "null or the column of the next character"
        )
        if level != "char":
            raise ConfigError(
                "dataset.target_column", dataset.target_column, "must be null with dataset.level=word"
            )
    require_int(
        "dataset.sequence_length", dataset.get("sequence_length"), minimum=1, maximum=MAX_SEQUENCE_LENGTH
    )
    if level == "word":
        require_int("dataset.vocab_size", dataset.get("vocab_size"), minimum=1)
    if dataset.get("max_sequences_per_user") is not None:
        require_int("dataset.max_sequences_per_user", dataset.max_sequences_per_user, minimum=1)
    require_bool("dataset.accuracy_without_oov", dataset.get("accuracy_without_oov", False))
    require_bool("dataset.accuracy_without_eos", dataset.get("accuracy_without_eos", True))
    validate_vocabulary_file(dataset, level)
    if cfg.partition.name != "natural":
        raise ConfigError(
            "partition.name",
            cfg.partition.name,
            f"must be natural with dataset={name}: its clients are its users (partition.column null: "
            "the data set's own user column)",
        )
    if cfg.partition.get("column") is not None:
        require_text("partition.column", cfg.partition.column, "null or the column naming each row's user")


def validate_vocabulary_file(dataset: DictConfig, level: str) -> None:
    """``dataset.vocabulary``: null, or an existing word count file (words only); the vocabulary keys."""
    from fl_app.config.data_choices import validate_vocabulary_keys

    validate_vocabulary_keys(dataset)
    vocabulary = dataset.get("vocabulary")
    if vocabulary is None:
        return
    require_text("dataset.vocabulary", vocabulary, "null or TFF's stackoverflow.word_count file")
    if level != "word":
        raise ConfigError("dataset.vocabulary", vocabulary, "must be null with dataset.level=char")
    if not Path(vocabulary).expanduser().is_file():
        raise ConfigError(
            "dataset.vocabulary",
            vocabulary,
            f"{Path(vocabulary).expanduser()} does not exist; name TFF's stackoverflow.word_count file (from "
            "stackoverflow.word_count.tar.bz2, docs/text.md) or set null to count the training users' words",
        )


def refuse_on_text(cfg: DictConfig, declaration: Declaration) -> None:
    """An algorithm or evaluation stage that cannot run on token sequences, in one line with the reason."""
    dataset = cfg.dataset.name
    if declaration.sequences is not None:
        raise ConfigError(
            "strategy", declaration.name, f"does not run on dataset={dataset}: {declaration.sequences}"
        )
    stage = cfg.evaluation.get("stage")
    if stage is not None:
        why = STAGE_REFUSALS.get(stage, "it evaluates classifiers only")
        raise ConfigError("evaluation.stage", stage, f"does not run on dataset={dataset}: {why}")


def check_model_kind(settings: RunSettings, declaration: Declaration) -> None:
    """The run's network against the kind of data set, before any data is read, downloaded or converted.

    On a text data set an image network is refused by name, and a ``module:Class`` network must take
    one sequence of ``dataset.sequence_length`` ids and give a score vector per position (built for
    the vocabulary the settings imply: its exact size is checked by :func:`check_text_model` once the
    data is converted). On an image data set a next-token network is refused by name.
    """
    from fl_app.data.examples import TEXT_DATASETS
    from fl_app.learning.text_models import TEXT_MODELS

    dataset = settings.data.dataset
    if dataset["name"] not in TEXT_DATASETS:
        if settings.model in TEXT_MODELS:
            raise ConfigError(
                "model",
                settings.model,
                f"is a network of token sequences (dataset=shakespeare, stackoverflow); on "
                f"dataset={dataset['name']} use auto, {', '.join(image_networks())} or <module>:<Class>",
            )
        return
    length, vocabulary = int(dataset["sequence_length"]), implied_vocabulary(dataset)
    name = declaration.model_name(settings, (length,), vocabulary)
    refuse_image_network(name, settings)
    if ":" in name:
        probe_sequence_network(name, settings, declaration, length, vocabulary)


def image_networks() -> list[str]:
    """The registered networks that are not next-token networks."""
    from fl_app.learning.models import MODELS
    from fl_app.learning.text_models import TEXT_MODELS

    return sorted(name for name in MODELS if name not in TEXT_MODELS)


def implied_vocabulary(dataset: Any) -> int:
    """The vocabulary's size the settings imply: the 86 characters or ``vocab_size`` words, + 4 tokens.

    A counted vocabulary can hold fewer words (a corpus with fewer distinct words); a converted folder
    named by ``dataset.path`` has its own.
    """
    from fl_app.data.text_tokens import CHAR_VOCAB

    words = len(CHAR_VOCAB) if dataset.get("level") == "char" else int(dataset["vocab_size"])
    return words + 4


def refuse_image_network(name: str, settings: RunSettings) -> None:
    """``ConfigError`` (``model``) for a registered image network on a text data set."""
    from fl_app.learning.models import MODELS
    from fl_app.learning.text_models import TEXT_MODELS

    if name in MODELS and name not in TEXT_MODELS:
        raise ConfigError(
            "model",
            settings.model,
            f"{name} is an image network; on dataset={settings.data.dataset['name']} use auto, "
            f"{', '.join(TEXT_MODELS)} or <module>:<Class> (a network of token sequences)",
        )


def probe_sequence_network(
    name: str, settings: RunSettings, declaration: Declaration, length: int, vocabulary: int
) -> None:
    """A ``module:Class`` network built for ``(length,)`` and ``vocabulary``: one sequence through it."""
    import torch

    from fl_app.learning.models import build_model, private_state_refusal
    from fl_app.learning.probe import forward_probe

    try:
        network = build_model(name, (length,), vocabulary)
        batch = torch.zeros((1, length), dtype=torch.long)
        output = forward_probe(network, batch, name, f"token sequences of length {length}")
    except (RuntimeError, ValueError, TypeError) as error:
        raise ConfigError("model", settings.model, " ".join(str(error).split())) from None
    if not isinstance(output, torch.Tensor) or output.dim() != 3 or tuple(output.shape[:2]) != (1, length):
        got = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise ConfigError(
            "model",
            settings.model,
            f"the network {name!r} gives {got} for one sequence of {length} tokens; it must give next-token "
            f"scores of shape (1, {length}, vocabulary)",
        )
    if declaration.is_private(settings):
        refusal = private_state_refusal(
            network, torch.zeros((2, length), dtype=torch.long), settings.strategy
        )
        if refusal is not None:
            raise ConfigError("model", settings.model, refusal)


def check_text_model(settings: RunSettings, declaration: Declaration, data: Any) -> Any:
    """Build the run's network, run one of the data's sequences through it (``ConfigError``: ``model``)."""
    from fl_app.learning.models import build_model, private_state_refusal
    from fl_app.learning.text_models import check_text_model_fits

    name = declaration.model_name(settings, data.input_shape, data.num_classes)
    refuse_image_network(name, settings)
    example = data.test().x[:1]
    try:
        network = build_model(name, data.input_shape, data.num_classes)
    except (RuntimeError, ValueError, TypeError) as error:
        raise ConfigError("model", settings.model, " ".join(str(error).split())) from None
    try:
        check_text_model_fits(network, name, example, data.num_classes)
    except ValueError as error:
        raise ConfigError("model", settings.model, " ".join(str(error).split())) from None
    if declaration.is_private(settings):
        from fl_app.learning.sequence import token_tensor

        refusal = private_state_refusal(network, token_tensor(data.test().x[:2]), settings.strategy)
        if refusal is not None:
            raise ConfigError("model", settings.model, refusal)
    return network
