"""The usual implementation of the strategy contract: cohorts, replies, one accountant, reports.

:class:`FederatedStrategy` satisfies :class:`strategies.contract.Strategy` for an algorithm whose
round is "select a cohort, send the model and a train config, aggregate the replies, account".
It composes collaborators instead of inheriting their state:

* ``self.cohorts`` (:class:`~strategies.cohorts.Cohorts`): seeded samples, planned schedules that
  a local-DP calibration can count exactly, secret Poisson cohorts;
* ``self.replies`` (:class:`~strategies.replies.ReplyBook`): who was asked, who answered, who failed
  (logged, left out; privacy events still name every *selected* client, so a failure never makes
  the accounting optimistic);
* ``self.accountant`` (:class:`~fl_app.privacy.accountant.PrivacyAccountant`, or None when not
  private): the events the strategy records, composed per client;

and builds the typed reports the platform reads (:meth:`report_round`, :meth:`report_run`) from
hooks a subclass overrides where it has more to say: :meth:`round_extras`, :meth:`diagnostics`
(un-noised statistics: written only outside the guarantee, never on devices),
:meth:`privacy_summary`, :meth:`final_extras`, :meth:`stage_epsilons`, :meth:`released_stages`,
:meth:`cohort_randomness`, :meth:`extra_ledgers`. A subclass implements :meth:`aggregate_train`
and declares its algorithm in the class attribute ``declaration``.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from logging import INFO
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
from flwr.common import log
from flwr.serverapp import Grid

from fl_app import keys
from fl_app.privacy.accountant import LEDGER_FILE, PrivacyAccountant
from fl_app.privacy.canaries import CanaryPopulation
from fl_app.privacy.composition import EpsilonReport
from fl_app.privacy.mechanisms import clip_l2
from fl_app.reply_sums import ClippedUpdate, PartialSum, Summand, blocks_of, summed
from fl_app.roster import ClientInfo, on_devices
from fl_app.run_context import RunContext
from fl_app.training import array_values, evaluate, load_arrays, model_to_arrays, torch_seed
from strategies.arrays import flat_vector, split_vector
from strategies.cohorts import Cohorts
from strategies.contract import JSON, Declaration
from strategies.replies import RecentRounds, ReplyBook
from strategies.reporting import (
    NOT_COVERED,
    SECRET_COHORT_NOT_COVERED,
    PrivacyReport,
    PrivacyTotal,
    Randomness,
    RoundReport,
    RunReport,
)
from strategies.settings import StrategySettings

__all__ = ["FederatedStrategy", "RecentRounds", "base_train_config"]


def base_train_config(run: RunContext, *, client: str, server_round: int) -> ConfigRecord:
    """The train ConfigRecord every client reads: its class, the data and model, local SGD, randomness."""
    record = ConfigRecord(
        {
            keys.ALGORITHM: client,
            keys.SERVER_ROUND: server_round,
            keys.DATA_SPEC: run.settings.data.to_json(),
            keys.MODEL_SPEC: run.model_spec.to_json(),
            keys.LOCAL_EPOCHS: run.settings.local_epochs,
            keys.BATCH_SIZE: run.settings.batch_size,
            keys.LR: run.settings.lr * run.settings.lr_decay ** (server_round - 1),
            keys.MOMENTUM: run.settings.momentum,
            keys.SEED: run.settings.seed,
            keys.SECURE_RNG: bool(run.noise.secure),
        }
    )
    if not run.noise.secure and run.noise.seed is not None:
        record[keys.NOISE_SEED] = int(run.noise.seed)
    if run.settings.simulation.client_gpus > 0:
        record[keys.DEVICE] = "cuda"
    if run.settings.simulation.trains_cohorts:
        record[keys.VECTORISE] = True
    return record


def randomness_of(run: RunContext, *, cohort: str, secret_cohort: bool = False) -> Randomness:
    """Where ``run``'s privacy noise comes from, and its cohorts (``cohort``: the strategy's words)."""
    noise = run.noise
    origin = None
    if not noise.secure:
        origin = (
            "privacy.noise_seed"
            if run.settings.privacy.noise_seed is not None
            else "derived from seed and the experiment's settings (fl_app.privacy.rng.derive_noise_seed)"
        )
    return Randomness(
        secure=bool(noise.secure),
        noise_seed=None if noise.secure else noise.seed,
        noise_seed_origin=origin,
        devices=on_devices(run.roster),
        cohort=cohort,
        secret_cohort=secret_cohort,
    )


class FederatedStrategy:
    """The contract's usual implementation (see the module docstring)."""

    #: The algorithm (name, paper, unit, mechanism, client, settings, ...): set by every subclass.
    declaration: ClassVar[Declaration]

    #: Attributes that only live within a round (the arrays it started from, un-noised statistics for
    #: the diagnostics): never written to the server's private state file (:meth:`for_checkpoint`).
    ROUND_STATE: ClassVar[tuple[str, ...]] = ("_round_global",)

    def __init__(self, run: RunContext, settings: StrategySettings | None = None) -> None:
        self.run = run
        settings_type = self.declaration.settings
        if settings is None and settings_type is not None:
            settings = run.settings.strategy_settings
            if not isinstance(settings, settings_type):
                raise TypeError(
                    f"{type(self).__name__} needs {settings_type.__name__}: the run is configured for "
                    f"strategy={run.settings.strategy}"
                )
        #: The checked ``strategy`` group (an instance of the declaration's settings type).
        self.settings = settings
        #: The unit and mechanism of this run (the declaration's; a noise-free variant says "none").
        self.privacy_unit: str = self.declaration.unit
        self.mechanism_name: str = self.declaration.mechanism
        self.cohorts = Cohorts(run)
        self.replies = ReplyBook(run)
        self.accountant: PrivacyAccountant | None = None
        self.canaries: CanaryPopulation | None = None
        self._round_global: ArrayRecord | None = None
        self._initial_vector: np.ndarray | None = None

    # ------------------------------------------------------------------ declared facts

    @property
    def secret_cohort(self) -> bool:
        """Whether the accounting relies on the cohort being secret (amplification by sampling)."""
        return self.replies.secret_cohort

    @secret_cohort.setter
    def secret_cohort(self, value: bool) -> None:
        self.replies.secret_cohort = bool(value)

    # ------------------------------------------------------------------ the model

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

    def arrays_for_evaluation(self, arrays: ArrayRecord) -> ArrayRecord:
        """What clients evaluate (override when the global arrays need transforming)."""
        return arrays

    # ------------------------------------------------------------------ train messages

    def base_config(self, server_round: int) -> ConfigRecord:
        """The train ConfigRecord every client reads (:func:`base_train_config`)."""
        return base_train_config(self.run, client=self.declaration.client, server_round=server_round)

    def train_config(self, server_round: int, config: ConfigRecord) -> ConfigRecord:
        """The full train config: base keys, what the round loop passed, and extras."""
        record = self.base_config(server_round)
        for key, value in config.items():
            record[key] = value
        for key, value in self.extra_train_config(server_round).items():
            record[key] = value
        return record

    def reply_summand(self, server_round: int) -> Summand | None:
        """The per-client term this round's aggregation sums, or None: it needs every reply (override).

        A strategy that returns one aggregates with :meth:`summed_replies` (or
        :meth:`clipped_update_sum`), which take cohort messages' partial sums
        (:mod:`fl_app.cohort_messages`) as well as plain replies.
        """
        return None

    def cohort_summand(self, server_round: int) -> Summand | None:
        """The summand the round loop hands the grid: the round may go as cohort messages (else None).

        :meth:`reply_summand` where the run asks for cohort messages (``simulation.cohort_messages``);
        the grid packs only in a simulation (:class:`fl_app.metering.MeteredGrid`).
        """
        if not self.run.settings.simulation.sends_cohort_messages:
            return None
        return self.reply_summand(server_round)

    def summed_replies(
        self, valid: list[tuple[ClientInfo, Message]], summand: Summand, *, server_round: int | None = None
    ) -> PartialSum:
        """The sum of ``summand``'s terms over the valid replies, plain and partial sums alike.

        In the blocks of the round's cohort in client order (:func:`fl_app.reply_sums.summed`; the
        clients selected in ``server_round`` and those that replied), so a run sums the same way
        whether its replies came one per client or as cohort messages.
        """
        cohort = {info.client_id: info for info, _ in valid}
        if server_round is not None:
            cohort.update((info.client_id, info) for info in self.replies.selected(server_round))
        blocks = blocks_of(cohort[client].node_id for client in sorted(cohort))
        pairs = ((info.node_id, reply) for info, reply in valid)
        return summed(pairs, summand, self.round_global, blocks=blocks)

    def extra_train_config(self, server_round: int) -> dict[str, Any]:
        """Algorithm-specific hyperparameters for the clients (override)."""
        return {}

    def select_clients(self, server_round: int) -> list[ClientInfo]:
        """The round's cohort (override; default: the planned schedule, else a seeded sample)."""
        return self.cohorts.select(server_round)

    def arrays_for_clients(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        """What the clients receive (override, e.g. to add downlink noise)."""
        return arrays

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Select the cohort and send each client the global arrays and the train config."""
        self._round_global = arrays
        count = self.run.settings.privacy.canaries
        if self._initial_vector is None and count and self.declaration.canaries is None:
            self._initial_vector = flat_vector(arrays)  # the canaries' cosines are against the total change
            self.canaries = CanaryPopulation(
                count=count,
                rate=self.run.clients_per_round / self.run.num_clients,
                dimension=self._initial_vector.size,
                randomness=self.run.randomness,
                patterns=self.canary_patterns(count),
            )
        clients = self.select_clients(server_round)
        self.replies.record_selected(server_round, clients)
        content = RecordDict(
            {
                keys.ARRAYS: self.arrays_for_clients(server_round, arrays),
                keys.CONFIG: self.train_config(server_round, config),
            }
        )
        return [
            Message(content=content, dst_node_id=c.node_id, message_type=MessageType.TRAIN) for c in clients
        ]

    @property
    def round_global(self) -> ArrayRecord:
        """The global model of the current round, as ``configure_train`` received it.

        Client updates are relative to it. Raises ``RuntimeError`` before the first ``configure_train``.
        """
        if self._round_global is None:
            raise RuntimeError("aggregate_train before configure_train")
        return self._round_global

    # ------------------------------------------------------------------ aggregation helpers

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate the round (subclasses implement)."""
        raise NotImplementedError

    def clipped_update_sum(
        self, valid: list[tuple[ClientInfo, Message]], *, max_norm: float, server_round: int | None = None
    ) -> tuple[list[str], list[np.ndarray], list[np.ndarray], list[float]]:
        """The central-DP step every update-clipping strategy starts with.

        Returns the array names, the round's global arrays in float64, the float64 sum of the
        valid replies' updates ``w_k - w_t`` each clipped to L2 norm ``max_norm``
        (:func:`fl_app.privacy.mechanisms.clip_l2`'s arithmetic), and each reply's update norm
        before clipping (un-noised: never release it), in client order. Summed by
        :meth:`summed_replies`: plain replies and cohort messages' partial sums
        (:mod:`fl_app.cohort_messages`, each member's update clipped where it ran, with the bound
        this strategy sent and checks) give the same sum. With ``server_round`` and canaries
        (``privacy.canaries``), the canaries sampled in that round join the sum after the clients,
        through the same clipping; their norms are not returned.
        """
        names = list(self.round_global.keys())
        reference = [array_values(self.round_global[name]).astype(np.float64) for name in names]
        clients = self.summed_replies(valid, ClippedUpdate(clip=max_norm), server_round=server_round)
        total = [clients.arrays[name] for name in names]
        if server_round is not None:
            for upload in self.canary_uploads(server_round, clip=max_norm, like=reference):
                clipped, _ = clip_l2(arrays=upload, max_norm=max_norm)
                for t, c in zip(total, clipped, strict=True):
                    t += c
        return names, reference, total, clients.per_member.get("norm", [])

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

    # ------------------------------------------------------------------ federated evaluation

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation on ``evaluation.federated_fraction`` of the clients (0: none)."""
        fraction = self.run.settings.evaluation.federated_fraction
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

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Example-weighted mean of the clients' evaluation metrics."""
        valid, _ = self.replies.split(server_round, replies, stage="evaluate")
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

    # ------------------------------------------------------------------ the contract's reports

    def report_round(self, server_round: int) -> RoundReport:
        """The round's report, from the hooks below (after ``aggregate_train``)."""
        return RoundReport(
            clients=len(self.replies.selected(server_round)),
            failures=tuple(self.replies.failures(server_round)),
            failure_reasons=tuple(self.replies.failure_reasons(server_round)),
            epsilon=self.epsilon(),
            training_epsilon=self.training_epsilon(),
            extras=dict(self.round_extras(server_round)),
            diagnostics=dict(self.diagnostics(server_round)),
            secret_cohort=self.secret_cohort,
            selected=tuple(info.client_id for info in self.replies.selected(server_round)),
        )

    def report_run(self, final: ArrayRecord) -> RunReport:
        """The run's privacy (summary, randomness, total by stage, canary estimate) and final fields."""
        total = self.epsilon()
        privacy = PrivacyReport(
            summary=dict(self.privacy_summary()),
            randomness=self.randomness(),
            total=PrivacyTotal(
                epsilon=None if total is None else total.epsilon,
                delta=self.run.settings.privacy.delta,
                method=None if total is None else total.method,
                unit=self.privacy_unit,
                per_stage=dict(self.stage_epsilons()),
                covers=tuple(self.released_stages()),
                not_covered=NOT_COVERED + (SECRET_COHORT_NOT_COVERED if self.secret_cohort else ()),
            ),
            empirical_epsilon=self.empirical_privacy(final),
        )
        return RunReport(privacy=privacy, final=dict(self.final_extras()))

    def randomness(self) -> Randomness:
        """Where the privacy noise comes from (the run's) and the cohorts (:meth:`cohort_randomness`)."""
        return randomness_of(self.run, cohort=self.cohort_randomness(), secret_cohort=self.secret_cohort)

    def ledgers(self) -> dict[str, dict[str, JSON]]:
        """``privacy_ledger.json`` (the accountant's events) and :meth:`extra_ledgers`."""
        main = {} if self.accountant is None else {LEDGER_FILE: self.accountant.state_dict()}
        return {**main, **self.extra_ledgers()}

    def for_checkpoint(self) -> FederatedStrategy:
        """A shallow copy without what only lives within a round (:attr:`ROUND_STATE`, the replies)."""
        kept = copy.copy(self)
        kept.replies = self.replies.forget()
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

    def describe(self) -> None:
        """Log the strategy's configuration, the privacy unit and the budget asked for."""
        log(INFO, "\t├──> %s: %s", type(self).__name__, self.cohort_text())
        log(INFO, "\t│\t├── strategy.name = %s", self.declaration.name)
        for item in dataclasses.fields(self.settings) if self.settings is not None else ():
            log(INFO, "\t│\t├── strategy.%s = %s", item.name, getattr(self.settings, item.name))
        budget = f", {self.budget_text()}" if self.privacy_unit != "none" else ""
        log(
            INFO,
            "\t└──> privacy: unit=%s, mechanism=%s%s",
            self.privacy_unit,
            self.mechanism_name,
            budget,
        )

    # ------------------------------------------------------------------ hooks of the reports

    def cohort_text(self) -> str:
        """How many clients a round selects, for :meth:`describe`."""
        if self.secret_cohort:
            return (
                f"secret Poisson cohorts of {self.run.clients_per_round} of {self.run.num_clients} clients "
                "per round in expectation (their sizes are not published)"
            )
        return f"{self.run.clients_per_round} of {self.run.num_clients} clients per round"

    def budget_text(self) -> str:
        """The budget asked for, for :meth:`describe` (override where it is not in the unit)."""
        privacy = self.run.settings.privacy
        return (
            f"budget epsilon={privacy.epsilon:g} delta={privacy.delta:g} "
            f"(privacy.budget_scope={privacy.budget_scope})"
        )

    def epsilon(self) -> EpsilonReport | None:
        """Cumulative epsilon of the worst client at ``privacy.delta`` (None: not private).

        The rounds' ``epsilon``: it must cover everything the run released about a client.
        """
        if self.accountant is None:
            return None
        return self.accountant.epsilon(delta=self.run.settings.privacy.delta)

    def training_epsilon(self) -> EpsilonReport | None:
        """The training stage's epsilon alone (``rounds[].epsilon_training``)."""
        return self.epsilon()

    def stage_epsilons(self) -> dict[str, float | None]:
        """Each stage's cumulative epsilon in the strategy's unit (``privacy.total.per_stage``)."""
        training = self.training_epsilon()
        return {"training": None if training is None else training.epsilon}

    def released_stages(self) -> list[str]:
        """What the total epsilon covers (``privacy.total.covers``)."""
        return ["training: the released models (and, under local DP, every client's upload)"]

    def cohort_randomness(self) -> str:
        """Where the clients of a round come from (``privacy.randomness.cohort``)."""
        return (
            "public: drawn from `seed` (reproducible; the accounting names every selected client and "
            "credits no amplification by sampling)"
        )

    def extra_ledgers(self) -> dict[str, dict[str, JSON]]:
        """Ledgers beyond the accountant's ``privacy_ledger.json``: file name -> accountant state."""
        return {}

    def round_extras(self, server_round: int) -> dict[str, JSON]:
        """Per-round fields for the results file beyond the platform's (override)."""
        return {}

    def diagnostics(self, server_round: int) -> dict[str, JSON]:
        """Statistics of un-noised client data (``outside_guarantee``; simulation-only, opt-in; override)."""
        return {}

    def privacy_summary(self) -> dict[str, JSON]:
        """The results file's ``privacy`` object: unit, mechanism, accountant (override to add details)."""
        accountant = "none"
        if self.accountant is not None:
            accountant = (
                f"{self.accountant.method} (dp-accounting 0.6.0): per-client composition of the "
                "recorded events (each names the clients whose data it touched, or all clients); "
                "min with basic composition for pure-epsilon mechanisms; the worst client is reported"
            )
        return {"unit": self.privacy_unit, "mechanism": self.mechanism_name, "accountant": accountant}

    def final_extras(self) -> dict[str, JSON]:
        """Extra fields for the results file's ``final`` object (override)."""
        return {}

    def empirical_privacy(self, final: ArrayRecord) -> dict[str, JSON] | None:
        """``privacy.empirical_epsilon``: the canaries' one-shot estimate from the final model (None: off)."""
        if self.canaries is None or self._initial_vector is None:
            return None
        estimate = self.canaries.estimate(
            flat_vector(final) - self._initial_vector,
            delta=self.run.settings.privacy.delta,
            rng=self.run.randomness.generator("canary-bootstrap"),
        )
        return estimate.to_json()
