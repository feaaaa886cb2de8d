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
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log
from omegaconf import DictConfig

from fl_app import keys
from fl_app.models import resolve_model_name
from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.canaries import CanaryPopulation
from fl_app.privacy.composition import EpsilonReport
from fl_app.privacy.mechanisms import sum_clipped_updates
from fl_app.roster import ClientInfo
from fl_app.run_context import RunContext
from fl_app.training import array_values, evaluate, load_arrays, model_to_arrays, torch_seed
from fl_app.validation import ConfigError
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


class FederatedStrategy(Strategy):
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

    #: True when the privacy accounting relies on the cohort being secret (amplification by
    #: sampling): failures are then logged without naming the client.
    secret_cohort: bool = False

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

    # ------------------------------------------------------------------ configuration

    @classmethod
    def validate_config(cls, cfg: DictConfig) -> None:
        """Check this strategy's own keys (its :attr:`settings_type`); raise ``ConfigError``."""
        if cls.settings_type is not None:
            cls.settings_type.from_config(cfg)

    @classmethod
    def is_private(cls, cfg: DictConfig) -> bool:
        """Whether a run of this strategy with ``cfg`` claims a finite epsilon (override if configurable)."""
        return cls.privacy_unit != "none"

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

    def base_config(self, server_round: int) -> ConfigRecord:
        """The train ConfigRecord every client reads."""
        cfg = self.cfg
        record = ConfigRecord(
            {
                keys.ALGORITHM: self.client_name,
                keys.SERVER_ROUND: server_round,
                keys.DATA_SPEC: self.run.data_spec.to_json(),
                keys.MODEL_SPEC: self.run.model_spec.to_json(),
                keys.LOCAL_EPOCHS: int(cfg.local_epochs),
                keys.BATCH_SIZE: int(cfg.batch_size),
                keys.LR: float(cfg.lr) * float(cfg.lr_decay) ** (server_round - 1),
                keys.MOMENTUM: float(cfg.momentum),
                keys.SEED: int(cfg.seed),
                keys.SECURE_RNG: bool(self.run.noise.secure),
            }
        )
        if not self.run.noise.secure and self.run.noise.seed is not None:
            record[keys.NOISE_SEED] = int(self.run.noise.seed)
        if float(cfg.simulation.get("client_gpus", 0.0)) > 0:
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

    # ------------------------------------------------------------------ sampling

    def select_clients(self, server_round: int) -> list[ClientInfo]:
        """The cohort of ``server_round``: the planned schedule if there is one, else a seeded sample.

        Without a plan: ``clients_per_round`` clients uniformly without replacement (seeded).
        """
        if self.planned_cohorts is not None:
            if server_round not in self.planned_cohorts:
                raise RuntimeError(
                    f"round {server_round} is beyond num_rounds={len(self.planned_cohorts)}, which the "
                    "privacy calibration assumed"
                )
            return self.planned_cohorts[server_round]
        return self.uniform_cohort(server_round)

    def uniform_cohort(self, server_round: int) -> list[ClientInfo]:
        """``clients_per_round`` clients uniformly without replacement, from the run seed."""
        rng = self.run.randomness.generator("client-sampling", server_round=server_round)
        count = self.run.clients_per_round
        chosen = rng.choice(len(self.run.roster), size=count, replace=False)
        return [self.run.roster[i] for i in sorted(chosen)]

    def epoch_cohorts(self, num_rounds: int, *, purpose: str = "epoch-schedule") -> list[list[int]]:
        """Roster indices of rounds 1..``num_rounds``, each client at most once per epoch.

        Each epoch is a permutation of the roster, seeded by the run seed and the epoch, cut
        into ``N // m`` cohorts of exactly ``m = clients_per_round`` clients (the ``N mod m``
        left over sit that epoch out). A client therefore takes part in at most
        ``ceil(num_rounds / (N // m))`` rounds: the balanced schedule of Kairouz et al.
        (ICML 2021, DP-FTRL) and of "every client once per pass over the population".
        The schedule is public; it must not be what a privacy claim's amplification rests on.
        """
        size = self.run.clients_per_round
        per_epoch = self.run.num_clients // size
        cohorts: list[list[int]] = []
        epoch = 0
        while len(cohorts) < num_rounds:
            order = self.run.randomness.generator(purpose, server_round=epoch).permutation(
                self.run.num_clients
            )
            cohorts += [sorted(int(i) for i in order[k * size : (k + 1) * size]) for k in range(per_epoch)]
            epoch += 1
        return cohorts[:num_rounds]

    def seeded_schedule(self, num_rounds: int, *, balanced: bool = False) -> dict[int, list[ClientInfo]]:
        """The cohorts of rounds 1..``num_rounds``, fixed at start-up from the run seed.

        ``balanced=False``: each round a uniform sample (:meth:`uniform_cohort`); some clients
        then take part more often than others. ``balanced=True``: :meth:`epoch_cohorts`. Local-DP
        strategies plan their schedule so that calibration can count the busiest client's
        participations exactly (:func:`max_participations`).
        """
        if balanced:
            roster = self.run.roster
            return {
                t: [roster[i] for i in cohort]
                for t, cohort in enumerate(self.epoch_cohorts(num_rounds), start=1)
            }
        return {t: self.uniform_cohort(t) for t in range(1, num_rounds + 1)}

    def poisson_cohort(self, server_round: int, rate: float) -> list[ClientInfo]:
        """Every client joins independently with probability ``rate`` (Poisson sampling).

        The coins come from the privacy randomness (``run.noise``: OS entropy with
        ``privacy.secure_rng`` and always on devices), because amplification by
        sampling holds only for a cohort the adversary cannot predict.
        """
        rng = self.run.noise.generator("poisson-cohort", server_round=server_round)
        joins = rng.random(self.run.num_clients) < rate
        return [info for info, joined in zip(self.run.roster, joins, strict=True) if joined]

    def selected(self, server_round: int) -> list[ClientInfo]:
        """The clients sent a train message in ``server_round``."""
        return self._selected.get(server_round, [])

    # ------------------------------------------------------------------ Flower hooks

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Sample clients and send each the global arrays and the train config."""
        self._round_global = arrays
        count = int(self.cfg.privacy.get("canaries", 0) or 0)
        if self._initial_vector is None and count and self.supports_canaries:
            self._initial_vector = flat_vector(arrays)  # the canaries' cosines are against the total change
            self.canaries = CanaryPopulation(
                count=count,
                rate=self.run.clients_per_round / self.run.num_clients,
                dimension=self._initial_vector.size,
                randomness=self.run.randomness,
                max_participations=self.canary_participation_cap(),
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

    def canary_participation_cap(self) -> int | None:
        """At most how often a canary may be inserted: the accountant's worst client (None: no cap).

        Sampled cohorts (Poisson) need none: canaries are sampled like clients. A schedule that
        bounds participations must bound the canaries' too, or they would measure a larger
        release than any real client's.
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
        fraction = float(self.cfg.evaluation.federated_fraction)
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

    def cohort_text(self) -> str:
        """How many clients a round selects, for :meth:`summary`."""
        return f"{self.run.clients_per_round} of {self.run.num_clients} clients per round"

    def summary(self) -> None:
        """Log the strategy's configuration, the privacy unit and the budget asked for."""
        log(INFO, "\t├──> %s: %s", type(self).__name__, self.cohort_text())
        for key, value in self.cfg.strategy.items():
            log(INFO, "\t│\t├── strategy.%s = %s", key, value)
        budget = f", {self.budget_text()}" if self.is_private(self.cfg) else ""
        log(INFO, "\t└──> privacy: unit=%s, mechanism=%s%s", self.privacy_unit, self.mechanism_name, budget)

    def budget_text(self) -> str:
        """The budget asked for, for :meth:`summary` (override where it is not in :attr:`privacy_unit`)."""
        privacy = self.cfg.privacy
        return (
            f"budget epsilon={float(privacy.epsilon):g} delta={float(privacy.delta):g} "
            f"(privacy.budget_scope={privacy.budget_scope})"
        )

    # ------------------------------------------------------------------ replies

    def split_replies(
        self, server_round: int, replies: Iterable[Message], *, stage: str = "train"
    ) -> tuple[list[tuple[ClientInfo, Message]], list[ClientInfo]]:
        """Separate good replies from failures (logged), mapped to roster entries."""
        by_node = {info.node_id: info for info in self.run.roster}
        valid: list[tuple[ClientInfo, Message]] = []
        failed: list[ClientInfo] = []
        reasons: list[str] = []
        for reply in replies:
            info = by_node.get(int(reply.metadata.src_node_id))
            if info is None:
                log(WARNING, "%s: reply from unknown node %s ignored", stage, reply.metadata.src_node_id)
                continue
            if reply.has_error():
                failed.append(info)
                reasons.append(reply.error.reason or "?")
                reason = reply.error.reason.strip().splitlines()[-1] if reply.error.reason else "?"
                secret = self.secret_cohort and stage == "train"
                log(
                    WARNING,
                    "%s round %d: client %s failed: %s",
                    stage,
                    server_round,
                    "(secret cohort)" if secret else info.client_id,
                    "(reason withheld)" if secret else reason[:300],
                )
            else:
                valid.append((info, reply))
        # Replies arrive in an order that depends on timing: aggregate them by client id, so a
        # seeded run sums its floating-point updates in the same order every time.
        valid.sort(key=lambda pair: pair[0].client_id)
        if stage == "train":
            expected = {c.client_id for c in self.selected(server_round)}
            answered = {info.client_id for info, _ in valid} | {info.client_id for info in failed}
            failed += [self.run.info(c) for c in sorted(expected - answered)]
            self._failed[server_round] = sorted(info.client_id for info in failed)
            self._failure_reasons[server_round] = reasons
            if expected - answered:
                log(
                    WARNING,
                    "train round %d: %d clients did not reply in time",
                    server_round,
                    len(expected - answered),
                )
        return valid, failed

    # ------------------------------------------------------------------ reporting

    def evaluate_global(self, arrays: ArrayRecord, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """Loss and accuracy of the global model on ``(x, y)`` (override for e.g. BNNs)."""
        model = self.run.model_spec.build()
        load_arrays(model, arrays)
        return evaluate(model, x, y)

    def epsilon(self) -> EpsilonReport | None:
        """Cumulative epsilon of the worst client at ``privacy.delta`` (None: not private).

        The platform's ``rounds[].epsilon``: it must cover everything the run released about a client
        (an evaluation stage composes its own cost into it).
        """
        if self.accountant is None:
            return None
        return self.accountant.epsilon(delta=self.run.delta)

    def training_epsilon(self) -> EpsilonReport | None:
        """The training stage's epsilon alone (``rounds[].epsilon_training``)."""
        return self.epsilon()

    def stage_epsilons(self) -> dict[str, float | None]:
        """Each stage's cumulative epsilon in the unit of :attr:`privacy_unit` (``privacy.total``)."""
        training = self.training_epsilon()
        return {"training": None if training is None else training.epsilon}

    def extra_ledgers(self) -> dict[str, dict[str, Any]]:
        """Ledgers beyond :attr:`accountant`'s ``privacy_ledger.json``: file name -> accountant state."""
        return {}

    def released_stages(self) -> list[str]:
        """What the total epsilon covers (``privacy.total.covers``)."""
        return ["training: the released models (and, under local DP, every client's upload)"]

    def cohort_randomness(self) -> str:
        """Where the clients of a round come from (``privacy.randomness.cohort``)."""
        return (
            "public: drawn from `seed` (reproducible; the accounting names every selected client and "
            "credits no amplification by sampling)"
        )

    def diagnostics(self, server_round: int) -> dict[str, Any]:
        """Statistics of un-noised client data (``outside_guarantee``; simulation-only, opt-in; override)."""
        return {}

    def round_extras(self, server_round: int) -> dict[str, Any]:
        """Per-round fields for the results file beyond the platform's (override)."""
        return {}

    def round_failures(self, server_round: int) -> list[int]:
        """Ids of the clients that failed in ``server_round``."""
        return self._failed.get(server_round, [])

    def round_failure_reasons(self, server_round: int) -> list[str]:
        """The error reasons of the train replies that failed in ``server_round`` (for the health check)."""
        return self._failure_reasons.get(server_round, [])

    def privacy_summary(self) -> dict[str, Any]:
        """The results file's ``privacy`` object (override to add details)."""
        accountant = "none"
        if self.accountant is not None:
            accountant = (
                f"{self.accountant.method} (dp-accounting 0.6.0): per-client composition of the "
                "recorded events (each names the clients whose data it touched, or all clients); "
                "min with basic composition for pure-epsilon mechanisms; the worst client is reported"
            )
        return {"unit": self.privacy_unit, "mechanism": self.mechanism_name, "accountant": accountant}

    def final_extras(self) -> dict[str, Any]:
        """Extra fields for the results file's ``final`` object (override)."""
        return {}


class ServerMomentum:
    """Server SGD with heavy-ball momentum (FedAvgM / DP-FedAvgM; Reddi et al., ICLR 2021, Alg. 1).

    ``v_t = beta v_{t-1} + Delta_t`` (``v_1 = Delta_1``) and ``w_{t+1} = w_t + eta_s v_t``, array
    by array. The velocity is part of the strategy's state (checkpointed with it).
    """

    def __init__(self, *, lr: float, momentum: float) -> None:
        self.lr = lr
        self.momentum = momentum
        self.velocity: list[np.ndarray] | None = None

    def step(self, start: list[np.ndarray], update: list[np.ndarray]) -> list[np.ndarray]:
        """``w_t + eta_s v_t`` for the model ``start`` (w_t) and this round's ``update`` (Delta_t)."""
        if self.velocity is None:
            self.velocity = list(update)
        else:
            self.velocity = [self.momentum * v + u for v, u in zip(self.velocity, update, strict=True)]
        return [w + self.lr * v for w, v in zip(start, self.velocity, strict=True)]


def arrays_like(values: list[np.ndarray], like: ArrayRecord) -> ArrayRecord:
    """``values`` (one array per key of ``like``, in key order) as an ArrayRecord with ``like``'s dtypes."""
    return ArrayRecord(
        {
            name: Array(np.asarray(value).astype(array_values(like[name]).dtype))
            for name, value in zip(like.keys(), values, strict=True)
        }
    )


#: Values of a planned schedule (``strategy.schedule``; :meth:`FederatedStrategy.seeded_schedule`).
SCHEDULES = ("random", "balanced")


def max_participations(schedule: dict[int, list[ClientInfo]]) -> int:
    """Rounds the most-selected client of ``schedule`` takes part in."""
    counts = Counter(info.client_id for clients in schedule.values() for info in clients)
    return max(counts.values()) if counts else 0


def echo_mismatch(reply: Message, expected: dict[str, float | int]) -> str:
    """Empty when the reply's metrics echo every ``expected`` mechanism parameter, else what differs.

    A client that applied other parameters than it was sent (an old client, a tampered config)
    would release under another guarantee than the one accounted: its reply is rejected.
    """
    metrics = reply.content.metric_records.get(keys.METRICS)
    if metrics is None:
        return "no metrics"
    for key, value in expected.items():
        if key not in metrics or not math.isclose(float(metrics[key]), float(value), rel_tol=1e-9):
            return f"{key}={metrics.get(key)!r}, expected {float(value)!r}"
    return ""


def arrays_mismatch(reply: Message, like: ArrayRecord) -> str:
    """Empty when the reply holds arrays with the names and shapes of ``like``, else what is wrong."""
    if keys.ARRAYS not in reply.content.array_records:
        return "no arrays"
    received = reply.content.array_records[keys.ARRAYS]
    if list(received.keys()) != list(like.keys()) or any(
        tuple(received[k].shape) != tuple(like[k].shape) for k in like
    ):
        return "arrays do not match the model"
    return ""


def flat_vector(arrays: ArrayRecord) -> np.ndarray:
    """All arrays of a record as one float64 vector (in key order)."""
    return np.concatenate([array_values(arrays[name]).astype(np.float64).ravel() for name in arrays])


def split_vector(vector: np.ndarray, like: list[np.ndarray]) -> list[np.ndarray]:
    """``vector`` cut into arrays shaped like ``like`` (the inverse of :func:`flat_vector`)."""
    parts, offset = [], 0
    for template in like:
        parts.append(vector[offset : offset + template.size].reshape(template.shape))
        offset += template.size
    return parts


def mean_arrays(records: list[ArrayRecord], weights: list[float] | None = None) -> ArrayRecord:
    """(Weighted) mean of ArrayRecords with identical keys and shapes.

    Accumulates in float64, client by client in the given order, and casts the
    mean back to each array's dtype. All arrays of a record are handled as one
    flat vector (the same arithmetic element by element as array by array).
    """
    if not records:
        raise ValueError("nothing to average")
    factors = (
        np.full(len(records), 1.0 / len(records))
        if weights is None
        else (np.asarray(weights, dtype=np.float64) / float(np.sum(weights)))
    )
    names = list(records[0].keys())
    first = [array_values(records[0][name]) for name in names]
    total = np.zeros(sum(a.size for a in first), dtype=np.float64)
    flat = np.empty_like(total)  # one buffer for every record: no per-client allocations
    for factor, record in zip(factors, records, strict=True):
        np.concatenate([array_values(record[name]).ravel() for name in names], out=flat)
        flat *= factor
        total += flat
    parts = split_vector(total, first)
    return ArrayRecord(
        {
            name: Array(np.ascontiguousarray(part, dtype=template.dtype))
            for name, part, template in zip(names, parts, first, strict=True)
        }
    )
