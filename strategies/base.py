"""The usual implementation of the strategy contract: cohorts, replies, reports.

:class:`FederatedStrategy` satisfies :class:`strategies.contract.Strategy` for an algorithm whose
round is "select a cohort, send the model (and its own records) and a train config, aggregate the
replies". It composes collaborators instead of inheriting their state:

* ``self.cohorts`` (:class:`~strategies.cohorts.Cohorts`): seeded samples, planned schedules that
  a local-DP calibration can count exactly, secret Poisson cohorts;
* ``self.replies`` (:class:`~strategies.replies.ReplyBook`): who was asked, who answered, who failed
  (logged once, left out);

and builds the typed reports the platform reads (:meth:`report_round`, :meth:`report_run`). What an
algorithm writes (the rest is the contract, which the platform calls):

* :meth:`select_clients`, :meth:`extra_train_config`, :meth:`records_for_clients`: who gets what;
* :meth:`aggregate` (the valid replies, sorted by client id) and :meth:`summand` (when the
  aggregation is a sum of per-client terms, which the engine may then compute where the clients ran);
* :meth:`round_extras`, :meth:`diagnostics` (un-noised statistics: written only outside the
  guarantee, never on devices), :meth:`final_extras`: what its results add.

A private algorithm builds on :class:`strategies.private.PrivateStrategy`, which adds the accountant,
the canaries and the privacy report's hooks. A subclass declares its algorithm in ``declaration``.
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
from fl_app.engine.messages import Broadcast
from fl_app.learning.sums import PartialSum, Summand, blocks_of, summed
from fl_app.learning.training import evaluate, load_arrays, model_to_arrays, torch_seed
from fl_app.privacy.composition import EpsilonReport
from fl_app.run.context import RunContext
from fl_app.run.roster import ClientInfo, on_devices
from strategies.cohorts import Cohorts
from strategies.contract import JSON, Declaration
from strategies.replies import RecentRounds, Replies, ReplyBook
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

__all__ = ["FederatedStrategy", "RecentRounds", "Replies", "base_train_config"]


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
    if run.settings.simulation.vectorises:
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
        self._round_global: ArrayRecord | None = None

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

    def train_config(self, server_round: int, config: ConfigRecord) -> ConfigRecord:
        """The full train config: every client's keys (:func:`base_train_config`), the loop's, the extras."""
        record = base_train_config(self.run, client=self.declaration.client, server_round=server_round)
        for key, value in config.items():
            record[key] = value
        for key, value in self.extra_train_config(server_round).items():
            record[key] = value
        return record

    def summand(self, server_round: int) -> Summand | None:
        """The per-client term whose sum this round's aggregation is, or None: it reads every reply.

        Declaring the sum is declaring what the aggregation is: :meth:`aggregate` then reads
        ``replies.sum(self.summand(t))``, which the engine may compute where the clients ran (several
        clients packed in one message) with the same result. A subclass that overrides
        :meth:`aggregate` without declaring its own summand is never packed.
        """
        return None

    def _sum_of(
        self, valid: list[tuple[ClientInfo, Message]], server_round: int, summand: Summand
    ) -> PartialSum:
        """The sum of ``summand``'s terms over the valid replies, plain and packed alike.

        In the blocks of the round's cohort in client order (:func:`fl_app.learning.sums.summed`; the
        clients selected in ``server_round`` and those that replied), so a run sums the same way
        whether its replies came one per client or packed.
        """
        cohort = {info.client_id: info for info, _ in valid}
        cohort.update((info.client_id, info) for info in self.replies.selected(server_round))
        blocks = blocks_of(cohort[client].node_id for client in sorted(cohort))
        pairs = ((info.node_id, reply) for info, reply in valid)
        return summed(pairs, summand, self.round_global, blocks=blocks)

    def extra_train_config(self, server_round: int) -> dict[str, Any]:
        """Algorithm-specific hyperparameters for the clients (override)."""
        return {}

    def _begin_round(self, server_round: int, arrays: ArrayRecord) -> list[ClientInfo]:
        """Keep the round's global model (:attr:`round_global`), select the cohort and record it."""
        self._round_global = arrays
        clients = self.select_clients(server_round)
        self.replies.record_selected(server_round, clients)
        return clients

    def select_clients(self, server_round: int) -> list[ClientInfo]:
        """The round's cohort (override; default: the planned schedule, else a seeded sample)."""
        return self.cohorts.select(server_round)

    def records_for_clients(self, server_round: int, arrays: ArrayRecord) -> dict[str, ArrayRecord]:
        """What every selected client receives besides its config: the model, and more (override).

        The default sends the global model as ``keys.ARRAYS``; a strategy may transform it (downlink
        noise) or add records of its own (SCAFFOLD's server control variate), which its client reads
        with :meth:`clients.base.FederatedClient.received`.
        """
        return {keys.ARRAYS: arrays}

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Select the cohort and send each client the global arrays, its records and the train config."""
        clients = self._begin_round(server_round, arrays)
        content = RecordDict(dict(self.records_for_clients(server_round, arrays)))
        content[keys.CONFIG] = self.train_config(server_round, config)
        return Broadcast(content, [c.node_id for c in clients], MessageType.TRAIN)

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
        """Flower's hook: the replies split once (failures logged), then :meth:`aggregate`."""
        valid, failed = self.replies.split(server_round, replies)
        return self.aggregate(
            server_round,
            Replies(valid, failed, lambda kept, summand: self._sum_of(kept, server_round, summand)),
        )

    def aggregate(
        self, server_round: int, replies: Replies
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The round's new global model (None: unchanged) and its metrics, from the valid replies.

        ``replies`` are sorted by client id, failures already logged and left out (subclasses implement).
        """
        raise NotImplementedError

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
        record = base_train_config(self.run, client=self.declaration.client, server_round=server_round)
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
        epsilon = self._epsilon()
        return RoundReport(
            clients=len(self.replies.selected(server_round)),
            failures=tuple(self.replies.failures(server_round)),
            failure_reasons=tuple(self.replies.failure_reasons(server_round)),
            epsilon=epsilon,
            training_epsilon=epsilon,
            extras=dict(self.round_extras(server_round)),
            diagnostics=dict(self.diagnostics(server_round)),
            secret_cohort=self.replies.secret_cohort,
            selected=tuple(info.client_id for info in self.replies.selected(server_round)),
        )

    def report_run(self, final: ArrayRecord) -> RunReport:
        """The run's privacy (summary, randomness, total, canary estimate) and final fields."""
        total = self._epsilon()
        secret = self.replies.secret_cohort
        privacy = PrivacyReport(
            summary=dict(self._privacy_summary()),
            randomness=self.randomness(),
            total=PrivacyTotal(
                epsilon=None if total is None else total.epsilon,
                delta=self.run.settings.privacy.delta,
                method=None if total is None else total.method,
                unit=self.privacy_unit,
                per_stage={"training": None if total is None else total.epsilon},
                covers=("training: the released models (and, under local DP, every client's upload)",),
                not_covered=NOT_COVERED + (SECRET_COHORT_NOT_COVERED if secret else ()),
                holds_for=self._epsilon_holds_for(),
            ),
            empirical_epsilon=self._empirical_privacy(final),
        )
        return RunReport(privacy=privacy, final=dict(self.final_extras()))

    def randomness(self) -> Randomness:
        """Where the privacy noise comes from (the run's) and the cohorts."""
        return randomness_of(
            self.run, cohort=self._cohort_randomness(), secret_cohort=self.replies.secret_cohort
        )

    def ledgers(self) -> dict[str, dict[str, JSON]]:
        """The privacy ledgers by file name (none without an accountant)."""
        return {}

    def for_checkpoint(self) -> FederatedStrategy:
        """A shallow copy without what only lives within a round (:attr:`ROUND_STATE`, the replies)."""
        kept = copy.copy(self)
        kept.replies = self.replies.forget()
        for name in self.ROUND_STATE:
            value = getattr(self, name, None)
            setattr(kept, name, type(value)() if isinstance(value, dict) else None)
        return kept

    def describe(self) -> None:
        """Log the strategy's configuration, the privacy unit and the budget asked for."""
        log(INFO, "\t├──> %s: %s", type(self).__name__, self._cohort_text())
        log(INFO, "\t│\t├── strategy.name = %s", self.declaration.name)
        for item in dataclasses.fields(self.settings) if self.settings is not None else ():
            log(INFO, "\t│\t├── strategy.%s = %s", item.name, getattr(self.settings, item.name))
        budget = f", {self._budget_text()}" if self.privacy_unit != "none" else ""
        log(INFO, "\t└──> privacy: unit=%s, mechanism=%s%s", self.privacy_unit, self.mechanism_name, budget)

    # ------------------------------------------------------------------ what an algorithm's results add

    def round_extras(self, server_round: int) -> dict[str, JSON]:
        """Per-round fields for the results file beyond the platform's (override)."""
        return {}

    def diagnostics(self, server_round: int) -> dict[str, JSON]:
        """Statistics of un-noised client data (``outside_guarantee``; simulation-only, opt-in; override)."""
        return {}

    def final_extras(self) -> dict[str, JSON]:
        """Extra fields for the results file's ``final`` object (override)."""
        return {}

    # ------------------------------------------------------------------ the privacy report's parts

    def _epsilon(self) -> EpsilonReport | None:
        """The cumulative epsilon (none: :class:`strategies.private.PrivateStrategy` accounts)."""
        return None

    def _privacy_summary(self) -> dict[str, JSON]:
        return {"unit": self.privacy_unit, "mechanism": self.mechanism_name, "accountant": "none"}

    def _epsilon_holds_for(self) -> str | None:
        return None

    def _cohort_randomness(self) -> str:
        return (
            "public: drawn from `seed` (reproducible; the accounting names every selected client and "
            "credits no amplification by sampling)"
        )

    def _cohort_text(self) -> str:
        return f"{self.run.clients_per_round} of {self.run.num_clients} clients per round"

    def _budget_text(self) -> str:
        return ""

    def _empirical_privacy(self, final: ArrayRecord) -> dict[str, JSON] | None:
        return None
