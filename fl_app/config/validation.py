"""Check a composed configuration before anything starts.

Every problem becomes one :class:`ConfigError` whose message is a single line
naming the key, the value and what is allowed; the entry points print it and
exit with status 2 before Ray starts or an output directory is written.
"""

from __future__ import annotations

import os
import sys
from logging import WARNING
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig, ListConfig

from fl_app.config.checks import (
    ConfigError,
    require_bool,
    require_choice,
    require_int,
    require_positive,
    require_range,
    require_text,
    validate_split_keys,
)
from fl_app.config.settings import RunSettings
from fl_app.config.text_checks import (
    check_model_kind,
    check_text_model,
    refuse_on_text,
    validate_text_options,
)
from fl_app.data import PARTITION_SCHEMES
from fl_app.data.examples import TEXT_DATASETS
from fl_app.data.sources import (
    DATASET_NAMES,
    IDX_DATASETS,
    DataFileError,
    DataNotFoundError,
    resolve_idx_folder,
    resolve_svhn_folder,
)
from fl_app.privacy.composition import METHODS
from fl_app.report.tracking import TRACKERS, WANDB_MODES, tracker_available
from fl_app.run.output_claim import in_use, lock_holder, refuse_earlier_run

if TYPE_CHECKING:
    from fl_app.data.federated import DataSpec
    from strategies.contract import Declaration

BUDGET_SCOPES = ("total", "per_round")
EVALUATION_SPLITS = ("test", "validation")
#: Where a simulation's clients run (``simulation.backend``): Ray's actors, or the command's own process.
SIMULATION_BACKENDS = ("ray", "inline", "processes")


def cuda_available() -> bool:
    """Whether torch sees a CUDA device in this process."""
    import torch

    return bool(torch.cuda.is_available())


def validate_common(cfg: DictConfig) -> None:
    """Check the keys every run has (not the strategy's own ones)."""
    validate_cohort_size(cfg)
    validate_training(cfg)
    validate_privacy_options(cfg.privacy)
    validate_evaluation(cfg.evaluation)
    validate_simulation(cfg.simulation)
    validate_tracking(cfg)
    label = cfg.get("label")
    if label is not None and (not isinstance(label, str) or not label.strip() or "\n" in label):
        raise ConfigError("label", label, "must be null or a one-line name")

    validate_data_options(cfg)


def validate_cohort_size(cfg: DictConfig) -> None:
    """Check ``num_clients`` and ``clients_per_round`` (a whole number of clients or a fraction)."""
    num_clients = require_int("num_clients", cfg.num_clients, minimum=1)
    per_round = cfg.clients_per_round
    allowed = "must be a whole number of clients >= 1 or a fraction of num_clients in (0, 1] (e.g. 0.3)"
    if isinstance(per_round, float) and not isinstance(per_round, bool):
        if not 0.0 < per_round <= 1.0:  # NaN too
            raise ConfigError("clients_per_round", per_round, allowed)
    else:
        if isinstance(per_round, bool) or not isinstance(per_round, int) or per_round < 1:
            raise ConfigError("clients_per_round", per_round, allowed)
        if per_round > num_clients:
            raise ConfigError(
                "clients_per_round",
                per_round,
                f"more clients per round than num_clients={num_clients}: set clients_per_round to at "
                f"most {num_clients} (or a fraction in (0, 1])",
            )


def validate_training(cfg: DictConfig) -> None:
    """Check the local-training keys (rounds, epochs, batch size, learning rate, seed) and ``model``."""
    require_int("num_rounds", cfg.num_rounds, minimum=1)
    require_int("local_epochs", cfg.local_epochs, minimum=1)
    require_int("batch_size", cfg.batch_size, minimum=1)
    require_positive("lr", cfg.lr)
    require_range("momentum", cfg.momentum, 0.0, 1.0, high_open=True)
    require_range("lr_decay", cfg.lr_decay, 0.0, 1.0, low_open=True)
    require_int("seed", cfg.seed, minimum=0)
    if cfg.model != "auto":
        from fl_app.learning.models import MODELS, model_factory  # imports torch: only when a model is named

        if isinstance(cfg.model, str) and ":" in cfg.model:
            try:
                model_factory(cfg.model)
            except ValueError as error:
                raise ConfigError("model", cfg.model, str(error).partition(": ")[2]) from None
        else:
            require_choice("model", cfg.model, ["auto", *sorted(MODELS), "<module>:<Class>"])


def validate_privacy_options(privacy: DictConfig) -> None:
    """Check the ``privacy`` keys every run has (budget, accountant, noise source, canaries)."""
    require_positive("privacy.epsilon", privacy.epsilon)
    require_range("privacy.delta", privacy.delta, 0.0, 1.0, low_open=True, high_open=True)
    require_choice("privacy.accountant", privacy.accountant, METHODS)
    secure = require_bool("privacy.secure_rng", privacy.secure_rng)
    if privacy.noise_seed is not None:
        require_int("privacy.noise_seed", privacy.noise_seed, minimum=0)
        if secure:
            raise ConfigError(
                "privacy.noise_seed",
                privacy.noise_seed,
                "must be null when privacy.secure_rng=true (OS entropy refuses a seed)",
            )
    require_choice("privacy.budget_scope", privacy.budget_scope, BUDGET_SCOPES)
    require_bool("privacy.diagnostics", privacy.get("diagnostics", False))
    canaries = require_int("privacy.canaries", privacy.get("canaries", 0), minimum=0)
    if canaries == 1:
        raise ConfigError(
            "privacy.canaries", canaries, "must be 0 (off) or >= 2 (the estimate fits two Gaussians)"
        )


def validate_evaluation(evaluation: DictConfig) -> None:
    """Check the ``evaluation`` keys (split, validation fraction, cadence, subsets)."""
    require_choice("evaluation.split", evaluation.get("split", "test"), EVALUATION_SPLITS)
    if evaluation.get("split", "test") == "validation":
        require_range(
            "evaluation.validation_fraction",
            evaluation.validation_fraction,
            0.0,
            0.5,
            low_open=True,
            high_open=True,
        )
    require_int("evaluation.every", evaluation.every, minimum=1)
    if evaluation.test_subset is not None:
        require_int("evaluation.test_subset", evaluation.test_subset, minimum=1)
    require_range("evaluation.federated_fraction", evaluation.federated_fraction, 0.0, 1.0)


def validate_simulation(simulation: DictConfig) -> None:
    """Check the ``simulation`` keys (backend, resources, batching, timeouts)."""
    require_positive("simulation.client_cpus", simulation.client_cpus)
    backend = require_choice("simulation.backend", simulation.get("backend", "ray"), SIMULATION_BACKENDS)
    if backend == "processes" and not sys.platform.startswith("linux"):
        raise ConfigError(
            "simulation.backend",
            backend,
            f"needs Linux (its workers are forked, which is not safe on {sys.platform}); use ray or inline",
        )
    validate_client_gpus(simulation, backend)
    if simulation.num_cpus is not None:
        require_int("simulation.num_cpus", simulation.num_cpus, minimum=1)
    if simulation.get("max_concurrent_clients") is not None:
        require_int("simulation.max_concurrent_clients", simulation.max_concurrent_clients, minimum=1)
    require_int("simulation.messages_per_task", simulation.get("messages_per_task", 8), minimum=1)
    vectorise = simulation.get("vectorise", "auto")
    if not isinstance(vectorise, bool):
        require_choice("simulation.vectorise", vectorise, ("auto", "true", "false"))
    for key in ("pack_messages", "bulk"):
        value = simulation.get(key, "auto")
        if not isinstance(value, bool):
            require_choice(f"simulation.{key}", value, ("auto", "true", "false"))
    if backend != "ray" and simulation.ray_address:
        raise ConfigError(
            "simulation.ray_address",
            simulation.ray_address,
            f"must be null with simulation.backend={backend} (the clients run on this machine, not on Ray)",
        )
    require_positive("simulation.timeout", simulation.timeout)
    require_range("simulation.max_failure_fraction", simulation.get("max_failure_fraction", 0.5), 0.0, 1.0)


def validate_client_gpus(simulation: DictConfig, backend: str) -> None:
    """Check ``simulation.client_gpus``: a fraction of a GPU, only where the backend and machine have one."""
    gpus = require_range("simulation.client_gpus", simulation.get("client_gpus", 0.0), 0.0, 1.0)
    if gpus > 0 and backend == "processes":
        raise ConfigError(
            "simulation.client_gpus",
            gpus,
            "must be 0 with simulation.backend=processes (a forked worker cannot use CUDA); "
            "use simulation.backend=ray for clients on a GPU",
        )
    if gpus > 0 and not simulation.ray_address and not cuda_available():
        raise ConfigError(
            "simulation.client_gpus",
            gpus,
            "must be 0 on this machine: torch finds no CUDA device (torch.cuda.is_available() is false)",
        )


def validate_tracking(cfg: DictConfig) -> None:
    """Check ``tracking`` (a tracker's name or a list of them, each installed) and the ``tracker`` group."""
    tracking = cfg.get("tracking", "none")
    names = [tracking] if isinstance(tracking, str) else tracking
    if not isinstance(names, ListConfig | list) or not names:
        raise ConfigError("tracking", tracking, f"must be one of {', '.join(TRACKERS)}, or a list of them")
    for name in names:
        require_choice("tracking", name, TRACKERS)
        missing = tracker_available(str(name))
        if missing is not None:
            raise ConfigError("tracking", name, missing)
    tracker = cfg.get("tracker") or {}
    uri = tracker.get("mlflow_uri")
    if uri is not None and (not isinstance(uri, str) or not uri.strip()):
        raise ConfigError("tracker.mlflow_uri", uri, "must be null or a tracking URI (sqlite:///mlflow.db)")
    experiment = tracker.get("experiment", "dpfl")
    if not isinstance(experiment, str) or not experiment.strip() or "\n" in experiment:
        raise ConfigError("tracker.experiment", experiment, "must be a one-line name")
    require_choice("tracker.wandb_mode", tracker.get("wandb_mode", "offline"), WANDB_MODES)


def validate_data_options(cfg: DictConfig) -> None:
    """Check the dataset and partition groups (without loading the data)."""
    dataset = cfg.dataset
    name = require_choice("dataset.name", dataset.name, (*DATASET_NAMES, *TEXT_DATASETS))
    require_range("dataset.public_fraction", dataset.get("public_fraction", 0.0), 0.0, 1.0, high_open=True)
    if name == "digits":
        require_range("dataset.test_fraction", dataset.test_fraction, 0.0, 1.0, low_open=True, high_open=True)
    if name == "synthetic":
        for key in ("num_train", "num_test", "image_size", "num_classes"):
            require_int(f"dataset.{key}", dataset[key], minimum=2)
        require_positive("dataset.class_sep", dataset.class_sep)
    if name == "hf":
        validate_hf_options(dataset)
    if name in TEXT_DATASETS:
        validate_text_options(cfg)
        return
    with_files = (*IDX_DATASETS, "svhn")
    if name in with_files and dataset.data_dir is not None and not isinstance(dataset.data_dir, str):
        raise ConfigError("dataset.data_dir", dataset.data_dir, "must be a folder path or null")
    partition = cfg.partition
    require_choice("partition.name", partition.name, PARTITION_SCHEMES)
    if partition.name == "equal_size_dirichlet":
        require_positive("partition.alpha", partition.alpha)
        if partition.size is not None:
            require_int("partition.size", partition.size, minimum=1)
    if partition.name == "two_tier":
        require_int(
            "partition.large_clients", partition.get("large_clients"), minimum=1, maximum=cfg.num_clients - 1
        )
        require_range(
            "partition.large_share", partition.get("large_share"), 0.0, 1.0, low_open=True, high_open=True
        )
    if partition.name == "dirichlet":
        require_positive("partition.alpha", partition.alpha)
        require_int("partition.min_partition_size", partition.min_partition_size, minimum=0)
        require_bool("partition.self_balancing", partition.self_balancing)
    if partition.name == "natural":
        require_text("partition.column", partition.get("column"), "the column naming each row's user")
        if name != "hf":
            raise ConfigError(
                "partition.name",
                partition.name,
                f"needs a data set with a user column: dataset=hf (dataset={name} has no users; use iid, "
                "dirichlet, ...)",
            )


def validate_hf_options(dataset: DictConfig) -> None:
    """Check ``dataset=hf``'s keys (the data set itself is looked at by :func:`check_partitions`)."""
    require_text(
        "dataset.path",
        dataset.get("path"),
        "a Hugging Face data set name (flwrlabs/femnist), a save_to_disk folder or parquet file(s)",
    )
    validate_split_keys(dataset)
    require_text("dataset.image_column", dataset.get("image_column"), "the column of images")
    require_text("dataset.label_column", dataset.get("label_column"), "the column of class labels")
    if dataset.get("num_classes") is not None:
        require_int("dataset.num_classes", dataset.num_classes, minimum=2)
    if dataset.get("revision") is not None:
        require_text("dataset.revision", dataset.revision, "null or a hub revision (branch, tag, commit)")


def locate_data(settings: RunSettings) -> None:
    """Make sure the data set's files exist (raises a ConfigError naming dataset.data_dir)."""
    dataset = settings.data.dataset
    download = bool(dataset.get("download", True))
    try:
        if dataset["name"] in IDX_DATASETS:
            resolve_idx_folder(dataset["name"], data_dir=dataset.get("data_dir"), download=download)
        elif dataset["name"] == "svhn":
            resolve_svhn_folder(data_dir=dataset.get("data_dir"), download=download)
    except DataNotFoundError as error:
        key, _, rest = str(error).partition(": ")
        raise ConfigError(key.split("=")[0], dataset.get("data_dir"), " ".join(rest.split())) from error


#: Data specs whose split was already checked in this process (a sweep validates many jobs that
#: share a few splits; the split cache itself keeps only the last two).
_CHECKED_SPLITS: set[str] = set()


def check_partitions(settings: RunSettings) -> None:
    """Build the split (cached per process) and make sure every client gets data."""
    from fl_app.data.federated import federated_data

    spec = settings.data
    key = spec.to_json()
    if key in _CHECKED_SPLITS:
        return
    try:
        data = federated_data(spec)
    except (DataFileError, DataNotFoundError) as error:
        if spec.dataset["name"] in ("hf", *TEXT_DATASETS):
            raise keyed_error(str(error), spec) from None
        raise ConfigError(
            "dataset.data_dir", spec.dataset.get("data_dir"), " ".join(str(error).split())
        ) from error
    except ValueError as error:
        raise ConfigError(
            "num_clients",
            settings.num_clients,
            f"the {settings.partition} partition of {settings.dataset} failed: "
            f"{' '.join(str(error).split())}",
        ) from error
    sizes = data.client_sizes()
    if min(sizes) < 1:
        raise ConfigError(
            "num_clients",
            settings.num_clients,
            f"too many clients for {settings.dataset}: {sizes.count(0)} of the {len(sizes)} get no examples "
            f"({sum(sizes)} rows in all); use fewer clients or another partition",
        )
    _CHECKED_SPLITS.add(key)


def with_vocabulary(settings: RunSettings, declaration: Declaration) -> RunSettings:
    """A text run's settings with its vocabulary decided (:mod:`fl_app.config.data_choices`)."""
    from fl_app.config.data_choices import decide_vocabulary

    try:
        return decide_vocabulary(settings, declaration)
    except (DataFileError, DataNotFoundError) as error:
        raise keyed_error(str(error), settings.data) from None


def keyed_error(message: str, spec: DataSpec) -> ConfigError:
    """A data error whose message starts ``key='value': ...`` as the ConfigError of that key."""
    head, _, rest = " ".join(message.split()).partition(": ")
    key = head.split("=")[0]
    group, _, leaf = key.partition(".")
    options = {"dataset": spec.dataset, "partition": spec.partition}.get(group, {})
    value = options.get(leaf)
    return ConfigError(key, head.partition("=")[2].strip("'\"") if value is None else value, rest)


def check_model(settings: RunSettings, declaration: Declaration) -> None:
    """The run's network takes the data's examples and gives one score per class (a forward pass).

    A private run's network has nothing in its state but parameters
    (:func:`fl_app.learning.models.private_state_refusal`: no running statistics, no other buffers).
    Raises a :class:`ConfigError` naming ``model`` when it does not fit.
    """
    from fl_app.data.federated import federated_data
    from fl_app.learning.models import check_model_fits, private_state_refusal
    from fl_app.learning.training import to_tensor

    data = federated_data(settings.data)
    if settings.data.dataset["name"] in TEXT_DATASETS:
        check_text_model(settings, declaration, data)
        return
    name = declaration.model_name(settings, data.input_shape)
    try:
        network = check_model_fits(name, data.arrays.x_train[:1], data.num_classes)
    except ValueError as error:
        raise ConfigError("model", settings.model, " ".join(str(error).split())) from None
    if declaration.is_private(settings):
        refusal = private_state_refusal(network, to_tensor(data.arrays.x_train[:2]), settings.strategy)
        if refusal is not None:
            raise ConfigError("model", settings.model, refusal)
    buffers = [buffer_name for buffer_name, _ in network.named_buffers()]
    if buffers and settings.simulation.vectorises:
        from flwr.common import log

        log(
            WARNING,
            "simulation.vectorise: the network %r has buffers (%s), which the vectorised trainer does "
            "not train: its clients train one by one",
            name,
            ", ".join(buffers),
        )


def validate_releases(declaration: Declaration, settings: RunSettings) -> None:
    """The platform's release rule: a private run refuses federated evaluation.

    Clients' evaluation replies (local loss and accuracy) are un-noised functions of their data: no
    epsilon covers them.
    """
    fraction = settings.evaluation.federated_fraction
    if declaration.is_private(settings) and fraction > 0:
        raise ConfigError(
            "evaluation.federated_fraction",
            fraction,
            f"must be 0 with strategy={settings.strategy}: clients' evaluation metrics are un-noised "
            f"functions of their data, outside the reported epsilon{declaration.release_hint}",
        )


def typed_settings(cfg: DictConfig) -> RunSettings:
    """``cfg`` read once into :class:`RunSettings`: run-wide keys, the algorithm's and the stage's settings.

    Each group's own checks run as it is read (one :class:`ConfigError` naming the key); the
    environment (data files, output folder) is not looked at: :func:`validate_config` does that.
    """
    from strategies import EVALUATION_STAGES, STRATEGIES

    require_choice("strategy.name", cfg.strategy.name, STRATEGIES.names())
    base = RunSettings.from_config(cfg)
    declaration = STRATEGIES.get(base.strategy).declaration
    strategy = None if declaration.settings is None else declaration.settings.from_config(cfg, base)
    stage = None
    if base.evaluation.stage is not None:
        require_choice("evaluation.stage", base.evaluation.stage, EVALUATION_STAGES.names())
        stage_type = EVALUATION_STAGES.get(base.evaluation.stage).settings_type
        stage = None if stage_type is None else stage_type.from_config(cfg, base)
    return RunSettings.from_config(cfg, strategy_settings=strategy, stage_settings=stage)


def validate_config(cfg: DictConfig, *, check_data: bool = True) -> RunSettings:
    """Check everything: common keys, the strategy's and the stage's, the output, the data and its split.

    The one validation of a job (before any simulation starts); ``check_data=False`` skips the data.
    Returns the run's typed settings: nothing after this reads ``cfg``.
    """
    from fl_app.config.data_choices import check_declared_classes
    from strategies import STRATEGIES

    require_choice("strategy.name", cfg.strategy.name, STRATEGIES.names())
    validate_common(cfg)
    if cfg.dataset.name in TEXT_DATASETS:  # before the strategy's own checks: the reason comes first
        refuse_on_text(cfg, STRATEGIES.get(cfg.strategy.name).declaration)
    settings = typed_settings(cfg)
    declaration = STRATEGIES.get(settings.strategy).declaration
    declaration.check(settings)
    validate_releases(declaration, settings)
    canaries = settings.privacy.canaries
    if canaries and declaration.canaries is not None:
        raise ConfigError(
            "privacy.canaries", canaries, f"must be 0: strategy={settings.strategy} {declaration.canaries}"
        )
    check_output_dir(cfg)
    if settings.resume is not None:
        if declaration.resume is not None:
            raise ConfigError("resume", settings.resume, f"strategy={settings.strategy} {declaration.resume}")
        from fl_app.run.resume import validate_resume

        validate_resume(settings, is_private=declaration.is_private(settings))
    if check_data:
        check_model_kind(settings, declaration)  # before a download or a conversion
        locate_data(settings)
        settings = with_vocabulary(settings, declaration)
        check_partitions(settings)
        check_declared_classes(settings, declaration)
        check_model(settings, declaration)
    return settings


def check_output_dir(cfg: DictConfig) -> None:
    """``output_dir`` must be creatable and writable; a new run must not mix with an earlier run's files."""
    if cfg.output_dir is None:
        return
    directory = Path(str(cfg.output_dir)).expanduser().resolve()
    check_writable_dir("output_dir", directory)
    holder = lock_holder(directory) if directory.is_dir() else None
    if holder is not None:  # another run is writing there (a resumed run too)
        raise in_use(directory, holder)
    if cfg.get("resume") is None and directory.is_dir():
        refuse_earlier_run(directory)  # checked again under the run's claim (fl_app.run.output_claim)


def check_writable_dir(key: str, directory: Path) -> None:
    """``directory`` is a directory we can write, or can be created (nothing is created here)."""
    probe = directory
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise ConfigError(key, str(directory), f"cannot be created: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(key, str(directory), f"cannot be written: no write permission on {probe}")
