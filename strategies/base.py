"""The base of every strategy: Flower's hooks plus the plumbing all algorithms share.

A strategy implements Flower's hooks (``configure_train``, ``aggregate_train``,
``configure_evaluate``, ``aggregate_evaluate``, ``summary``) and leaves the round
loop to :meth:`flwr.serverapp.strategy.Strategy.start`. This base adds what
every algorithm of the project needs:

* seeded client sampling over the roster (reproducible, unlike Flower's global
  ``random.sample``), or a schedule planned at start-up (uniform or balanced,
  :meth:`seeded_schedule`) that a local-DP calibration can count exactly;
* the train ``ConfigRecord`` every client reads (:meth:`base_config`, keys in
  :mod:`fl_app.keys`);
* failure handling: replies with errors are logged and left out, the round goes
  on (:meth:`split_replies`); privacy events name every *selected* client, so
  a failure never makes the accounting optimistic;
* reporting hooks for the results file (:meth:`round_extras`,
  :meth:`privacy_summary`, :meth:`final_extras`) and the accountant
  (:attr:`accountant`), read once per round by the platform;
* the release rule of private runs: nothing computed from un-noised client
  data leaves them (federated evaluation is refused, :meth:`validate_releases`;
  un-noised statistics go to :meth:`diagnostics`, written only outside the
  guarantee and never on devices).

Subclasses override :meth:`aggregate_train` (and whatever else differs) and set
the class attributes naming their privacy unit and mechanism.

The shared parts live in one module each, mixed in here: client selection
(:mod:`strategies.cohorts`), reply triage (:mod:`strategies.replies`), the reporting hooks
(:mod:`strategies.reporting`); array arithmetic is in :mod:`strategies.arrays`.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from omegaconf import DictConfig

from fl_app import keys
from fl_app.config_checks import ConfigError
from fl_app.models import resolve_model_name
from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.canaries import CanaryPopulation
from fl_app.privacy.mechanisms import sum_clipped_updates
from fl_app.roster import ClientInfo
from fl_app.run_context import RunContext
from fl_app.training import array_values, evaluate, load_arrays, model_to_arrays, torch_seed
from strategies.arrays import flat_vector, split_vector
from strategies.cohorts import CohortSampling
from strategies.replies import ReplyTriage
from strategies.reporting import ReportingHooks
from strategies.settings import StrategySettings


class RecentRounds(dict):  # type: ignore[type-arg]
    """A per-round store that keeps only the latest :attr:`KEEP` rounds.

    Strategies keep per-round state (the cohort, the arrays a round started from, norms for the
    diagnostics) until the round is reported. A plain dict grows with every round, and the whole
    strategy is checkpointed after every round, so the checkpoint grew with the run: at 1000
    clients, 100 per round, round 170 pickled 17,000 cohort entries (writing the checkpoint was 234
    of the server thread's ~520 busy py-spy samples there).
    Setting a round's entry drops the entries older than the latest ``KEEP`` rounds.
    """

    KEEP = 2

    def __setitem__(self, server_round: int, value: Any) -> None:
        super().__setitem__(server_round, value)
        for old in [r for r in self if r <= server_round - self.KEEP]:
            del self[old]


class FederatedStrategy(CohortSampling, ReplyTriage, ReportingHooks, Strategy):
    """Shared plumbing; see the module docstring.

    Class attributes
    ----------------
    client_name : str
        Registry name of the client class (``algorithm`` in the train config).
    privacy_unit : str
        What a neighbouring pair is for the reported epsilon ("none" if not private).
    mechanism_name : str
        Human-readable mechanism ("none" if not private).
    """

    client_name: ClassVar[str] = ""
    privacy_unit: ClassVar[str] = "none"
    mechanism_name: ClassVar[str] = "none"
    #: The typed settings of ``cfg.strategy`` (:mod:`strategies.settings`); None: no settings of its own.
    settings_type: ClassVar[type[StrategySettings] | None] = None

    #: Whether ``privacy.canaries`` applies: canary clients whose updates join the clipped sum
    #: (:meth:`clipped_update_sum`) or the local-DP uploads (see :mod:`fl_app.privacy.canaries`).
    supports_canaries: ClassVar[bool] = False
    #: Why not, or what the analogue is, when it does not (completes "strategy=<name> ...").
    canaries_note: ClassVar[str] = (
        "has no model-update upload that a canary direction could ride on (see docs/empirical_privacy.md)"
    )

    #: Whether ``resume=`` can continue a run of this strategy exactly (see :mod:`fl_app.checkpoint`).
    resumable: ClassVar[bool] = True
    #: Why not, when it cannot (completes "strategy=<name> ...").
    resumable_note: ClassVar[str] = ""

    #: Appended to the release rule's refusal of federated evaluation (what to use instead).
    release_hint: ClassVar[str] = ""

    def __init__(self, run: RunContext, settings: StrategySettings | None = None) -> None:
        self.run = run
        self.cfg: DictConfig = run.cfg
        if settings is None and self.settings_type is not None:
            settings = self.settings_type.from_config(run.cfg)
        #: The checked ``cfg.strategy`` (an instance of :attr:`settings_type`).
        self.settings = settings
        self.accountant: PrivacyAccountant | None = None
        self._selected: dict[int, list[ClientInfo]] = RecentRounds()
        self._round_global: ArrayRecord | None = None
        self._failed: dict[int, list[int]] = {}
        self._failure_reasons: dict[int, list[str]] = RecentRounds()
        self._initial_vector: np.ndarray | None = None
        self.canaries: CanaryPopulation | None = None
        #: Cohorts fixed at start-up (:meth:`seeded_schedule`), or None to sample each round.
        self.planned_cohorts: dict[int, list[ClientInfo]] | None = None

    # ------------------------------------------------------------------ checkpoints

    #: Attributes that only live within a round (its cohort, failures, the arrays it started from,
    #: un-noised statistics for the diagnostics): never written to the server's private state file.
    ROUND_STATE: ClassVar[tuple[str, ...]] = ("_selected", "_failed", "_failure_reasons", "_round_global")

    def for_checkpoint(self) -> FederatedStrategy:
        """What a checkpoint keeps: a shallow copy, :attr:`ROUND_STATE` emptied (:mod:`fl_app.checkpoint`)."""
        kept = copy.copy(self)
        for name in self.ROUND_STATE:
            value = getattr(self, name, None)
            setattr(kept, name, type(value)() if isinstance(value, dict) else None)
        return kept

    def private_state(self) -> str | None:
        """What the checkpoint holds that no epsilon covers (un-noised aggregates, secrets), or None.

        Said in the interrupt line and the results' ``stopped`` object (override where a strategy
        must carry un-noised state across rounds to continue exactly).
        """
        return None

    # ------------------------------------------------------------------ configuration

    @classmethod
    def validate_config(cls, cfg: DictConfig) -> None:
        """Check this strategy's own keys (its :attr:`settings_type`); raise ``ConfigError``."""
        if cls.settings_type is not None:
            cls.settings_type.from_config(cfg)

    @classmethod
    def validate_releases(cls, cfg: DictConfig) -> None:
        """The platform's release rule: a private run refuses federated evaluation.

        Clients' evaluation replies (local loss and accuracy) are un-noised functions of
        their data: no epsilon covers them.
        """
        if cls.is_private(cfg) and float(cfg.evaluation.federated_fraction) > 0:
            raise ConfigError(
                "evaluation.federated_fraction",
                cfg.evaluation.federated_fraction,
                f"must be 0 with strategy={cfg.strategy.name}: clients' evaluation metrics are un-noised "
                f"functions of their data, outside the reported epsilon{cls.release_hint}",
            )

    @classmethod
    def resolve_model(cls, cfg: DictConfig, input_shape: tuple[int, ...]) -> str:
        """The model to train: ``model`` unless ``auto`` (override to pick the algorithm's own)."""
        return resolve_model_name(str(cfg.model), input_shape)

    def initial_arrays(self) -> ArrayRecord:
        """The initial global model (seeded initialisation)."""
        seed = torch_seed(self.run.randomness.generator("model-init"))
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            model = self.run.model_spec.build()
        return model_to_arrays(model)

    def evaluate_global(self, arrays: ArrayRecord, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """Loss and accuracy of the global model on ``(x, y)`` (override for e.g. BNNs)."""
        model = self.run.model_spec.build()
        load_arrays(model, arrays)
        return evaluate(model, x, y)

    def base_config(self, server_round: int) -> ConfigRecord:
        """The train ConfigRecord every client reads."""
        run = self.run
        record = ConfigRecord(
            {
                keys.ALGORITHM: self.client_name,
                keys.SERVER_ROUND: server_round,
                keys.DATA_SPEC: run.data_spec.to_json(),
                keys.MODEL_SPEC: run.model_spec.to_json(),
                keys.LOCAL_EPOCHS: run.local_epochs,
                keys.BATCH_SIZE: run.batch_size,
                keys.LR: run.lr * run.lr_decay ** (server_round - 1),
                keys.MOMENTUM: run.momentum,
                keys.SEED: run.seed,
                keys.SECURE_RNG: bool(run.noise.secure),
            }
        )
        if not run.noise.secure and run.noise.seed is not None:
            record[keys.NOISE_SEED] = int(run.noise.seed)
        if run.client_gpus > 0:
            record[keys.DEVICE] = "cuda"
        return record

    def train_config(self, server_round: int, config: ConfigRecord) -> ConfigRecord:
        """The full train config: base keys, what ``Strategy.start`` passed, and extras."""
        record = self.base_config(server_round)
        for key, value in config.items():
            record[key] = value
        for key, value in self.extra_train_config(server_round).items():
            record[key] = value
        return record

    def extra_train_config(self, server_round: int) -> dict[str, Any]:
        """Algorithm-specific hyperparameters for the clients (override)."""
        return {}

    # ------------------------------------------------------------------ Flower hooks

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample clients and send each the global arrays and the train config."""
        self._round_global = arrays
        count = self.run.canaries
        if self._initial_vector is None and count and self.supports_canaries:
            self._initial_vector = flat_vector(arrays)  # the canaries' cosines are against the total change
            self.canaries = CanaryPopulation(
                count=count,
                rate=self.run.clients_per_round / self.run.num_clients,
                dimension=self._initial_vector.size,
                randomness=self.run.randomness,
                patterns=self.canary_patterns(count),
            )
        clients = self.select_clients(server_round)
        self._selected[server_round] = clients
        content = RecordDict(
            {
                keys.ARRAYS: self.arrays_for_clients(server_round, arrays),
                keys.CONFIG: self.train_config(server_round, config),
            }
        )
        return [
            Message(content=content, dst_node_id=c.node_id, message_type=MessageType.TRAIN) for c in clients
        ]

    def arrays_for_clients(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        """What the clients receive (override, e.g. to add downlink noise)."""
        return arrays

    @property
    def round_global(self) -> ArrayRecord:
        """The global model of the current round, as ``configure_train`` received it.

        Client updates are relative to it. Raises ``RuntimeError`` before the first ``configure_train``.
        """
        if self._round_global is None:
            raise RuntimeError("aggregate_train before configure_train")
        return self._round_global

    def clipped_update_sum(
        self, valid: list[tuple[ClientInfo, Message]], *, max_norm: float, server_round: int | None = None
    ) -> tuple[list[str], list[np.ndarray], list[np.ndarray], list[float]]:
        """The central-DP step every update-clipping strategy starts with.

        Returns the array names, the round's global arrays in float64, the float64 sum of the
        valid replies' updates ``w_k - w_t`` each clipped to L2 norm ``max_norm``
        (:func:`fl_app.privacy.mechanisms.sum_clipped_updates`), and each reply's update norm
        before clipping (un-noised: never release it). With ``server_round`` and canaries
        (``privacy.canaries``), the canaries sampled in that round join the sum through the same
        clipping; their norms are not returned.
        """
        names = list(self.round_global.keys())
        reference = [array_values(self.round_global[name]).astype(np.float64) for name in names]
        updates: Iterable[list[np.ndarray]] = (
            [
                array_values(reply.content.array_records[keys.ARRAYS][name]).astype(np.float64) - r
                for name, r in zip(names, reference, strict=True)
            ]
            for _, reply in valid
        )
        if server_round is not None:
            updates = itertools.chain(
                updates, self.canary_uploads(server_round, clip=max_norm, like=reference)
            )
        total, norms = sum_clipped_updates(updates=updates, like=reference, max_norm=max_norm)
        return names, reference, total, norms[: len(valid)]

    def canary_uploads(
        self, server_round: int, *, clip: float, like: list[np.ndarray]
    ) -> list[list[np.ndarray]]:
        """The uploads of the canaries sampled in ``server_round``, shaped like ``like`` (none if off)."""
        if self.canaries is None:
            return []
        return [
            split_vector(self.canaries.upload(k, clip=clip), like)
            for k in self.canaries.sampled(server_round)
        ]

    def canary_patterns(self, count: int) -> list[frozenset[int]] | None:
        """The rounds each canary takes part in under a planned schedule (None: sampled like clients).

        Sampled cohorts (Poisson) need none: canaries are sampled at the cohort rate. A strategy
        whose schedule is planned returns, for each canary, the rounds of a client its epsilon is
        about (:func:`fl_app.privacy.canaries.worst_client_patterns`): a canary that took part
        more often, or in a worse pattern, would measure a larger release than any real client's.
        """
        return None

    def empirical_privacy(self, final: ArrayRecord) -> dict[str, Any] | None:
        """``privacy.empirical_epsilon``: the canaries' one-shot estimate from the final model (None: off)."""
        if self.canaries is None or self._initial_vector is None:
            return None
        estimate = self.canaries.estimate(
            flat_vector(final) - self._initial_vector,
            delta=self.run.delta,
            rng=self.run.randomness.generator("canary-bootstrap"),
        )
        return estimate.to_json()

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate the round (subclasses implement)."""
        raise NotImplementedError

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation on ``evaluation.federated_fraction`` of the clients (0: none)."""
        fraction = self.run.federated_fraction
        if fraction <= 0:
            return []
        rng = self.run.randomness.generator("evaluate-sampling", server_round=server_round)
        count = max(1, round(fraction * self.run.num_clients))
        chosen = sorted(rng.choice(self.run.num_clients, size=count, replace=False))
        clients = [self.run.roster[i] for i in chosen]
        record = self.base_config(server_round)
        for key, value in config.items():
            record[key] = value
        content = RecordDict({keys.ARRAYS: self.arrays_for_evaluation(arrays), keys.CONFIG: record})
        return [
            Message(content=content, dst_node_id=c.node_id, message_type=MessageType.EVALUATE)
            for c in clients
        ]

    def arrays_for_evaluation(self, arrays: ArrayRecord) -> ArrayRecord:
        """What clients evaluate (override when the global arrays need transforming)."""
        return arrays

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Example-weighted mean of the clients' evaluation metrics."""
        valid, _ = self.split_replies(server_round, replies, stage="evaluate")
        if not valid:
            return None
        weights = np.array(
            [float(m.content.metric_records[keys.METRICS][keys.NUM_EXAMPLES]) for _, m in valid]
        )
        result = MetricRecord()
        for name in (keys.EVAL_LOSS, keys.EVAL_ACCURACY):
            values = np.array([float(m.content.metric_records[keys.METRICS][name]) for _, m in valid])
            result[f"federated-{name}"] = float(np.average(values, weights=weights))
        return result
