"""The run-wide configuration, typed: read from the composed configuration once, after validation.

``conf/`` composes into one ``DictConfig`` (Hydra), which :func:`fl_app.validation.validate_config`
checks value by value (one line naming the key on a bad value). :meth:`RunSettings.from_config` then
reads it once into frozen dataclasses, the only place where a configuration value is converted; the
platform (the run, the results, the simulation) and :class:`~fl_app.run_context.RunContext` read these
typed fields. An algorithm's own keys are typed by its settings class
(:mod:`strategies.settings`, named by its declaration).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig

from fl_app.read_once import read_once


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
    """``simulation.*``: Ray, the client actors and the round's deadline and failure rule."""

    num_cpus: int | None
    client_cpus: float
    client_gpus: float
    ray_address: str | None
    max_concurrent_clients: int | None
    messages_per_task: int
    timeout: float
    max_failure_fraction: float


@dataclass(frozen=True)
class RunSettings:
    """The whole run's typed configuration (the ``strategy`` node stays the algorithm's settings')."""

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
    tracking: str
    label: str | None
    privacy: PrivacySettings
    evaluation: EvaluationSettings
    simulation: SimulationSettings

    @classmethod
    def from_config(cls, cfg: DictConfig) -> RunSettings:
        """Read ``cfg`` (composed and validated) into typed fields; once per frozen ``cfg`` (read_once)."""
        return read_once(cfg, cls, cls._read)

    @classmethod
    def _read(cls, cfg: DictConfig) -> RunSettings:
        def optional(value: Any, kind: type) -> Any:
            return None if value is None else kind(value)

        privacy, evaluation, simulation = cfg.privacy, cfg.evaluation, cfg.simulation
        per_round = cfg.clients_per_round
        return cls(
            strategy=str(cfg.strategy.name),
            dataset=str(cfg.dataset.name),
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
            output_dir=optional(cfg.get("output_dir"), str),
            resume=optional(cfg.get("resume"), str),
            tracking=str(cfg.get("tracking", "none")),
            label=optional(cfg.get("label"), str),
            privacy=PrivacySettings(
                epsilon=float(privacy.epsilon),
                delta=float(privacy.delta),
                accountant=str(privacy.accountant),
                secure_rng=bool(privacy.secure_rng),
                noise_seed=optional(privacy.noise_seed, int),
                budget_scope=str(privacy.budget_scope),
                diagnostics=bool(privacy.get("diagnostics", False)),
                canaries=int(privacy.get("canaries", 0) or 0),
            ),
            evaluation=EvaluationSettings(
                every=int(evaluation.every),
                test_subset=optional(evaluation.test_subset, int),
                federated_fraction=float(evaluation.federated_fraction),
                split=str(evaluation.get("split", "test")),
                stage=optional(evaluation.get("stage"), str),
            ),
            simulation=SimulationSettings(
                num_cpus=optional(simulation.num_cpus, int),
                client_cpus=float(simulation.client_cpus),
                client_gpus=float(simulation.get("client_gpus", 0.0)),
                ray_address=str(simulation.ray_address) if simulation.ray_address else None,
                max_concurrent_clients=optional(simulation.get("max_concurrent_clients"), int),
                messages_per_task=int(simulation.get("messages_per_task", 8)),
                timeout=float(simulation.timeout),
                max_failure_fraction=float(simulation.get("max_failure_fraction", 0.5)),
            ),
        )
