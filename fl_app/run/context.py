"""What a strategy is given: the run's typed settings and its shared resources."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fl_app.config.settings import RunSettings, cohort_size
from fl_app.data.federated import FederatedData
from fl_app.learning.model_spec import ModelSpec
from fl_app.privacy.rng import RandomSource
from fl_app.run.roster import ClientInfo


def resolve_clients_per_round(clients_per_round: int | float, num_clients: int) -> int:
    """Turn ``clients_per_round`` (a count, or a fraction in (0, 1]) into a count."""
    return cohort_size(clients_per_round, num_clients)


@dataclass
class RunContext:
    """Everything a strategy needs besides its own hyperparameters.

    Attributes
    ----------
    settings : RunSettings
        The run's configuration, typed and validated (every value a strategy reads: ``run.settings.lr``,
        ``run.settings.privacy.delta``; its own keys are ``run.settings.strategy_settings``).
    roster : list[ClientInfo]
        The federation's clients, ordered by ``client_id``.
    data : FederatedData
        The server's view of the data: the test split and the unlabeled public
        split (client partitions are only read by simulated clients).
    model_spec : ModelSpec
        The global model's architecture.
    randomness : RandomSource
        Non-privacy randomness (client sampling, initialisation), from ``seed``.
    noise : RandomSource
        Privacy-noise randomness: seeded, or OS entropy with ``privacy.secure_rng``.
    output_dir : Path
        Where this run writes its files.

    """

    settings: RunSettings
    roster: list[ClientInfo]
    data: FederatedData
    model_spec: ModelSpec
    randomness: RandomSource
    noise: RandomSource
    output_dir: Path

    @property
    def num_clients(self) -> int:
        """N: the roster's clients (a deployment's federation may differ from the configured count)."""
        return len(self.roster)

    @property
    def client_ids(self) -> list[int]:
        """Ids of all clients, in roster order."""
        return [info.client_id for info in self.roster]

    @property
    def clients_per_round(self) -> int:
        """Clients sampled per round: the configured count, or fraction of the roster's clients."""
        return cohort_size(self.settings.clients_per_round, self.num_clients)

    def info(self, client_id: int) -> ClientInfo:
        """The roster entry of ``client_id``."""
        for entry in self.roster:
            if entry.client_id == client_id:
                return entry
        raise KeyError(f"client {client_id} is not in the roster")


def output_path(path: str | Path) -> Path:
    """Absolute form of an output path."""
    return Path(path).expanduser().resolve()
