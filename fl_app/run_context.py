"""What a strategy is given: the composed configuration and the run's shared resources."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from fl_app.data.federated import DataSpec, FederatedData
from fl_app.model_spec import ModelSpec
from fl_app.privacy.rng import RandomSource
from fl_app.roster import ClientInfo
from fl_app.run_settings import RunSettings


def resolve_clients_per_round(clients_per_round: int | float, num_clients: int) -> int:
    """Turn ``clients_per_round`` (a count, or a fraction in (0, 1]) into a count."""
    if isinstance(clients_per_round, float):
        return max(1, round(clients_per_round * num_clients))
    return int(clients_per_round)


@dataclass
class RunContext:
    """Everything a strategy needs besides its own hyperparameters.

    Attributes
    ----------
    cfg : DictConfig
        The resolved, read-only run configuration.
    roster : list[ClientInfo]
        The federation's clients, ordered by ``client_id``.
    data : FederatedData
        The server's view of the data: the test split and the unlabeled public
        split (client partitions are only read by simulated clients).
    data_spec : DataSpec
        The reproducible description of the split (sent to simulated clients).
    model_spec : ModelSpec
        The global model's architecture.
    randomness : RandomSource
        Non-privacy randomness (client sampling, initialisation), from ``seed``.
    noise : RandomSource
        Privacy-noise randomness: seeded, or OS entropy with ``privacy.secure_rng``.
    output_dir : Path
        Where this run writes its files.

    """

    cfg: DictConfig
    roster: list[ClientInfo]
    data: FederatedData
    data_spec: DataSpec
    model_spec: ModelSpec
    randomness: RandomSource
    noise: RandomSource
    output_dir: Path

    @property
    def num_clients(self) -> int:
        """N."""
        return len(self.roster)

    @property
    def client_ids(self) -> list[int]:
        """Ids of all clients, in roster order."""
        return [info.client_id for info in self.roster]

    @functools.cached_property
    def settings(self) -> RunSettings:
        """The run-wide configuration, typed (read once from :attr:`cfg`; :mod:`fl_app.run_settings`)."""
        return RunSettings.from_config(self.cfg)

    @functools.cached_property
    def clients_per_round(self) -> int:
        """Clients sampled per round (the configured count or fraction)."""
        return resolve_clients_per_round(self.settings.clients_per_round, self.num_clients)

    # The run-wide settings strategies read most, by name (all of them: :attr:`settings`).

    @property
    def delta(self) -> float:
        """The run's target delta."""
        return self.settings.privacy.delta

    @property
    def epsilon(self) -> float:
        """The run's target epsilon (``privacy.epsilon``; the training's share under an evaluation stage)."""
        return self.settings.privacy.epsilon

    @property
    def num_rounds(self) -> int:
        """T, the rounds of the run."""
        return self.settings.num_rounds

    @property
    def seed(self) -> int:
        """``seed``: public randomness (initialisation, seeded schedules, data order)."""
        return self.settings.seed

    @property
    def lr(self) -> float:
        """``lr``: the clients' learning rate (also the server's where an algorithm trains there)."""
        return self.settings.lr

    @property
    def lr_decay(self) -> float:
        """``lr_decay``: the clients' learning rate is ``lr * lr_decay ** (round - 1)``."""
        return self.settings.lr_decay

    @property
    def momentum(self) -> float:
        """``momentum`` of the clients' SGD."""
        return self.settings.momentum

    @property
    def batch_size(self) -> int:
        """``batch_size`` of local training."""
        return self.settings.batch_size

    @property
    def local_epochs(self) -> int:
        """``local_epochs`` per round."""
        return self.settings.local_epochs

    @property
    def budget_scope(self) -> str:
        """``privacy.budget_scope``: ``total`` (the whole run) or ``per_round``."""
        return self.settings.privacy.budget_scope

    @property
    def canaries(self) -> int:
        """``privacy.canaries``: simulated canary clients of the empirical estimate (0: none)."""
        return self.settings.privacy.canaries

    @property
    def federated_fraction(self) -> float:
        """``evaluation.federated_fraction``: share of clients evaluating the model each round."""
        return self.settings.evaluation.federated_fraction

    @property
    def client_gpus(self) -> float:
        """``simulation.client_gpus``: GPU share per simulated client (0: CPU)."""
        return self.settings.simulation.client_gpus

    @property
    def accountant_method(self) -> str:
        """``privacy.accountant``: the composition method of every accountant of the run."""
        return self.settings.privacy.accountant

    def info(self, client_id: int) -> ClientInfo:
        """The roster entry of ``client_id``."""
        for entry in self.roster:
            if entry.client_id == client_id:
                return entry
        raise KeyError(f"client {client_id} is not in the roster")


def output_path(path: str | Path) -> Path:
    """Absolute form of an output path."""
    return Path(path).expanduser().resolve()
