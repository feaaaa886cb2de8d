"""The checks of a text data set's run (``dataset=shakespeare``, ``dataset=stackoverflow``).

Each problem is one :class:`~fl_app.config.checks.ConfigError` naming the key, found before anything
starts: the ``dataset`` keys (:func:`validate_text_options`), the partition (the users are the
clients: ``partition=natural``), an algorithm or evaluation stage that cannot train or evaluate a
next-token network (:func:`refuse_on_text`), and a network that does not take the data's sequences
or does not give one score per vocabulary entry (:func:`check_text_model`).
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
    """``dataset.vocabulary``: null, or an existing word count file (words only)."""
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


def check_text_model(settings: RunSettings, declaration: Declaration, data: Any) -> Any:
    """Build the run's network, run one of the data's sequences through it (``ConfigError``: ``model``)."""
    from fl_app.learning.models import MODELS, build_model, private_state_refusal
    from fl_app.learning.text_models import TEXT_MODELS, check_text_model_fits

    name = declaration.model_name(settings, data.input_shape, data.num_classes)
    if name in MODELS and name not in TEXT_MODELS:
        raise ConfigError(
            "model",
            settings.model,
            f"{name} is an image network; on dataset={settings.dataset} use auto, {', '.join(TEXT_MODELS)} "
            "or <module>:<Class> (a network of token sequences)",
        )
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
