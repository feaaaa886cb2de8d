"""The run's configuration, typed: what every part of a run reads after validation.

``conf/`` composes into one ``DictConfig`` (Hydra, :mod:`fl_app.config.compose`), which
:func:`fl_app.config.validation.validate_config` checks value by value (one line naming the key on a bad
value) and reads, once, into a :class:`RunSettings`: the run-wide keys as frozen dataclasses, the data
split (:class:`~fl_app.data.federated.DataSpec`), the algorithm's own settings (its declaration's
:class:`~strategies.settings.StrategySettings`) and the evaluation stage's. Nothing after validation
reads the ``DictConfig``: the platform (the run, the results, the simulation), the strategies (through
:class:`~fl_app.run.context.RunContext`) and the declarations' callables take these typed fields
(``tests/test_repository.py`` checks that no raw read comes back outside the configuration modules).

:attr:`RunSettings.config` keeps the resolved configuration as plain data, for what must echo it:
``config.yaml`` and ``results.json`` (``config``) and TensorBoard's text. No value is read from it:
the fingerprint that checkpoints and derived noise seeds are tied to digests the typed values
(:meth:`RunSettings.experiment`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from fl_app.config.fingerprint import canonical_number, experiment_fingerprint
from fl_app.data.examples import TEXT_DATASETS
from fl_app.data.federated import DataSpec


@dataclass(frozen=True)
class PrivacySettings:
    """``privacy.*``: the budget and where its randomness comes from."""

    epsilon: float
    delta: float
    accountant: str
    secure_rng: bool
    noise_seed: int | None
    budget_scope: str
    diagnostics: bool
    canaries: int


@dataclass(frozen=True)
class EvaluationSettings:
    """``evaluation.*``: the server's evaluation schedule and split, federated evaluation, a stage."""

    every: int
    test_subset: int | None
    federated_fraction: float
    split: str
    stage: str | None


@dataclass(frozen=True)
class SimulationSettings:
    """``simulation.*``: where the clients run (Ray's actors or inline), the round's deadline and failures."""

    num_cpus: int | None
    client_cpus: float
    client_gpus: float
    ray_address: str | None
    max_concurrent_clients: int | None
    messages_per_task: int
    timeout: float
    max_failure_fraction: float
    vectorise: str = "auto"
    #: ``true``: a round of a summed aggregation goes as packed messages (:mod:`fl_app.engine.packed`).
    pack_messages: str = "auto"
    #: ``true``: with packing, a round of plain FedAvg clients goes as one bulk message per worker
    #: (:mod:`fl_app.engine.bulk`).
    bulk: str = "auto"
    #: ``ray``: client actors on a Ray instance; ``inline``: the clients run in the command's own
    #: process, one after another (:mod:`fl_app.engine.inline`); ``processes``: in worker processes
    #: forked from it (:mod:`fl_app.engine.processes`).
    backend: str = "ray"

    @property
    def uses_ray(self) -> bool:
        """Whether the clients run on Ray's actors (``inline`` and ``processes`` start no Ray)."""
        return self.backend == "ray"

    @property
    def vectorises(self) -> bool:
        """Whether actors train a batch's train messages as one computation (``simulation.vectorise``).

        ``auto``: where clients train on CUDA (``client_gpus > 0``); on the CPU the per-client loop
        is as fast or faster (docs/benchmarks/cohort_training.md).
        """
        return self.vectorising[0]

    @property
    def vectorising(self) -> tuple[bool, str]:
        """:attr:`vectorises`, and why in words (the run's header reports both)."""
        if self.vectorise != "auto":
            return self.vectorise == "true", f"simulation.vectorise={self.vectorise}"
        if self.client_gpus > 0:
            return True, "simulation.vectorise=auto with GPU clients"
        return False, "simulation.vectorise=auto with CPU clients"

    @property
    def packs_messages(self) -> bool:
        """Whether a summed aggregation's round goes as packed messages (``simulation.pack_messages``).

        ``auto`` and ``true``: yes. On the 2-core cross-device task the round took 6-20 % less on Ray's
        actors and, since the members hand over their train results unencoded, 13-16 % less inline
        (docs/benchmarks/pfl_research.md). The results are the same bit for bit either way.
        """
        return self.pack_messages != "false"

    @property
    def sends_bulk(self) -> bool:
        """Whether a packed round of plain FedAvg clients goes in bulk, one message per worker."""
        return self.packs_messages and self.bulk != "false"


def cohort_size(clients_per_round: int | float, num_clients: int) -> int:
    """Turn ``clients_per_round`` (a count, or a fraction in (0, 1]) into a count."""
    if isinstance(clients_per_round, float):
        return max(1, round(clients_per_round * num_clients))
    return int(clients_per_round)


def dataset_label(dataset: Mapping[str, Any]) -> str:
    """The data set's name in results and reports: ``dataset.name``, or ``<name>:<dataset.path>``.

    The path is named for the data sets read from one (``hf:flwrlabs/femnist``,
    ``stackoverflow:/data/stackoverflow.sqlite``): two Hugging Face data sets, or two text corpora
    (TFF's file, a generated one, a local copy), are two data sets in a report (tables, chance
    levels, plots).
    """
    name = str(dataset["name"])
    return f"{name}:{dataset['path']}" if name in ("hf", *TEXT_DATASETS) else name


@dataclass(frozen=True)
class TrackerSettings:
    """Where ``tracking=mlflow`` and ``tracking=wandb`` write (the ``tracker`` group, docs/tracking.md).

    Attributes
    ----------
    mlflow_uri : str or None
        MLflow's tracking URI; None: ``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db`` in the
        directory the command runs in (MLflow's own default).
    experiment : str
        The MLflow experiment and the W&B project.
    wandb_mode : str
        ``offline`` (files under ``<output dir>/wandb``, ``wandb sync`` later) or ``online``.
    run_name : str or None
        The run's name in MLflow and W&B; None: ``<strategy> (<label>) seed <seed>``. Not a
        configuration key: a sweep's job sets it (:func:`fl_app.run.sweep_names.named_in_sweep`).

    """

    mlflow_uri: str | None = None
    experiment: str = "dpfl"
    wandb_mode: str = "offline"
    run_name: str | None = None


@dataclass(frozen=True)
class RunSettings:
    """The whole run's typed configuration (see the module docstring).

    ``strategy`` is the algorithm's name; ``strategy_settings`` its typed ``strategy`` group (None for
    an algorithm without settings); ``stage_settings`` the evaluation stage's typed keys (None: no
    stage); ``data`` the split every process rebuilds identically.
    """

    strategy: str
    dataset: str
    partition: str
    num_clients: int
    clients_per_round: int | float
    num_rounds: int
    local_epochs: int
    batch_size: int
    lr: float
    momentum: float
    lr_decay: float
    model: str
    seed: int
    output_dir: str | None
    resume: str | None
    tracking: tuple[str, ...]
    label: str | None
    privacy: PrivacySettings
    evaluation: EvaluationSettings
    simulation: SimulationSettings
    data: DataSpec
    strategy_settings: Any = None
    stage_settings: Any = None
    tracker: TrackerSettings = field(default_factory=TrackerSettings)
    config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_config(
        cls, cfg: DictConfig, *, strategy_settings: Any = None, stage_settings: Any = None
    ) -> RunSettings:
        """Read ``cfg`` (composed and validated) into typed fields; the algorithm's and stage's settings."""
        per_round = cfg.clients_per_round
        config = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(config, dict)
        return cls(
            strategy=str(cfg.strategy.name),
            dataset=dataset_label(cfg.dataset),
            partition=str(cfg.partition.name),
            num_clients=int(cfg.num_clients),
            clients_per_round=per_round if isinstance(per_round, float) else int(per_round),
            num_rounds=int(cfg.num_rounds),
            local_epochs=int(cfg.local_epochs),
            batch_size=int(cfg.batch_size),
            lr=float(cfg.lr),
            momentum=float(cfg.momentum),
            lr_decay=float(cfg.lr_decay),
            model=str(cfg.model),
            seed=int(cfg.seed),
            output_dir=_optional(cfg.get("output_dir"), str),
            resume=_optional(cfg.get("resume"), str),
            tracking=tracker_names(cfg.get("tracking", "none")),
            label=_optional(cfg.get("label"), str),
            privacy=privacy_settings(cfg.privacy),
            evaluation=evaluation_settings(cfg.evaluation),
            simulation=simulation_settings(cfg.simulation),
            data=DataSpec.from_config(cfg),
            strategy_settings=strategy_settings,
            stage_settings=stage_settings,
            tracker=TrackerSettings(**(config.get("tracker") or {})),
            config=config,
        )

    @property
    def cohort(self) -> int:
        """Clients per round as a count (``clients_per_round`` of ``num_clients``)."""
        return cohort_size(self.clients_per_round, self.num_clients)

    def experiment(self) -> dict[str, Any]:
        """The experiment: every typed value, as plain data, in the form that decides what a run computes.

        Numbers are the typed values validation read (``privacy.epsilon=8`` is ``8.0``), the cohort is
        its count (``clients_per_round=0.3`` of 100 clients is 30), and the data set's and partition's
        numbers, read as they come, are floats. :meth:`fingerprint` digests it without what is not the
        experiment (:data:`fl_app.config.fingerprint.NOT_THE_EXPERIMENT`: the label, trackers, output folder).
        """
        derived = ("config", "dataset", "partition")  # the echo, and the names in data.dataset/partition
        values = {
            item.name: _plain(getattr(self, item.name)) for item in fields(self) if item.name not in derived
        }
        values["clients_per_round"] = self.cohort
        for group in ("dataset", "partition"):
            values["data"][group] = {key: canonical_number(v) for key, v in getattr(self.data, group).items()}
        return values

    def fingerprint(self, *, ignore: Sequence[str] = ()) -> str:
        """The digest of :meth:`experiment` (:func:`fl_app.config.fingerprint.experiment_fingerprint`).

        A derived noise seed and a checkpoint are tied to it; ``ignore``: more dotted keys to leave out.
        """
        return experiment_fingerprint(self.experiment(), ignore=ignore)

    def to_yaml(self) -> str:
        """The resolved configuration as YAML (``config.yaml``, TensorBoard's text)."""
        return OmegaConf.to_yaml(OmegaConf.create(dict(self.config)))

    def with_values(self, values: Mapping[str, Any]) -> RunSettings:
        """These settings with dotted keys set (``{"privacy.epsilon": 3.0}``), the echo included.

        For what the platform decides after validation: OS entropy on real devices, the training's
        share of the budget under an evaluation stage.
        """
        config = copy.deepcopy(dict(self.config))
        for dotted, value in values.items():
            node = config
            *parents, leaf = dotted.split(".")
            for part in parents:
                node = node[part]
            node[leaf] = value
        cfg = OmegaConf.create(config)
        settings = RunSettings.from_config(
            cfg, strategy_settings=self.strategy_settings, stage_settings=self.stage_settings
        )
        derived = {k: v for k, v in self.data.dataset.items() if k not in settings.data.dataset}
        if not derived:  # else what validation added to the spec (a text run's vocabulary) is kept
            return settings
        dataset = {**settings.data.dataset, **derived}
        return dataclasses.replace(settings, data=dataclasses.replace(settings.data, dataset=dataset))


def privacy_settings(privacy: DictConfig) -> PrivacySettings:
    """The validated ``privacy`` group, typed."""
    return PrivacySettings(
        epsilon=float(privacy.epsilon),
        delta=float(privacy.delta),
        accountant=str(privacy.accountant),
        secure_rng=bool(privacy.secure_rng),
        noise_seed=_optional(privacy.noise_seed, int),
        budget_scope=str(privacy.budget_scope),
        diagnostics=bool(privacy.get("diagnostics", False)),
        canaries=int(privacy.get("canaries", 0) or 0),
    )


def evaluation_settings(evaluation: DictConfig) -> EvaluationSettings:
    """The validated ``evaluation`` group, typed."""
    return EvaluationSettings(
        every=int(evaluation.every),
        test_subset=_optional(evaluation.test_subset, int),
        federated_fraction=float(evaluation.federated_fraction),
        split=str(evaluation.get("split", "test")),
        stage=_optional(evaluation.get("stage"), str),
    )


def simulation_settings(simulation: DictConfig) -> SimulationSettings:
    """The validated ``simulation`` group, typed (its keys' defaults where a configuration lacks them)."""
    return SimulationSettings(
        num_cpus=_optional(simulation.num_cpus, int),
        client_cpus=float(simulation.client_cpus),
        client_gpus=float(simulation.get("client_gpus", 0.0)),
        ray_address=str(simulation.ray_address) if simulation.ray_address else None,
        max_concurrent_clients=_optional(simulation.get("max_concurrent_clients"), int),
        messages_per_task=int(simulation.get("messages_per_task", 8)),
        timeout=float(simulation.timeout),
        max_failure_fraction=float(simulation.get("max_failure_fraction", 0.5)),
        vectorise=str(simulation.get("vectorise", "auto")).lower(),
        pack_messages=str(simulation.get("pack_messages", "auto")).lower(),
        bulk=str(simulation.get("bulk", "auto")).lower(),
        backend=str(simulation.get("backend", "ray")),
    )


def _optional(value: Any, kind: type) -> Any:
    """None, or ``value`` converted to ``kind``."""
    return None if value is None else kind(value)


def tracker_names(value: Any) -> tuple[str, ...]:
    """The trackers ``tracking`` names: a name or a list of names, ``none`` for none, in order, once."""
    names = [value] if isinstance(value, str) else list(value)
    return tuple(dict.fromkeys(str(name) for name in names if name != "none"))


def _plain(value: Any) -> Any:
    """A settings value as plain data (a dataclass as its fields, its private ones left out)."""
    if is_dataclass(value) and not isinstance(value, type):
        return {key: v for key, v in asdict(value).items() if not key.startswith("_")}
    return value
