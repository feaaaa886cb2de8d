"""Clustering evaluation on Laplace-protected inference results, around any training strategy.

MindSpore Federated documentation, "Horizontal Federated-Local Differential
Privacy Inference Result Protection". Besides the training loss, training is
monitored by clustering the clients' inference results on the server: in an
evaluation round, ``cluster_client_num`` sampled devices run the current global
model on their local data and upload the softmax vectors, each protected on the
device by the Laplace mechanism ``M(x, eps) = X + Lap(Delta f / eps)`` (i.i.d.
per coordinate; ``privacy_eval_type: LAPLACE``) or sent in the clear
(``NOT_ENCRYPT``). The server assigns each vector to the cluster of its largest
coordinate (``argmax``, as the document's code) and computes the silhouette
score and the Calinski-Harabasz index (``eval_type``), here with scikit-learn.

Correction to the document: two probability vectors can differ by 2 in L1, not the
document's ``Delta f = 1``; ``evaluation.sensitivity`` defaults to 2, the document's 1 is
accepted with a warning, and the epsilon charged is always the one the noise really gives,
``2 / b`` with ``b = sensitivity / eps``.

Privacy (:mod:`strategies.laplace_eval.privacy`): the stage's own figure (``cluster_eval_epsilon``)
is in the document's unit, one local example's softmax vector; ``rounds[].epsilon`` is the
*total* per client in the training strategy's unit, each evaluation charging a client ``n_c``
uses of ``Laplace(2 / b)`` (its data set decides all ``n_c`` of its vectors) composed with the
training's epsilon; ``rounds[].epsilon_training`` is the training stage alone.

Budget: ``evaluation.laplace_eval_eps: null`` (default) gives the evaluation ``budget_fraction``
of ``privacy.epsilon`` and the training the rest (:meth:`LaplaceEvalStage.training_settings`), with
``budget / (max_c n_c x evaluation rounds)`` per report; a number sets the per-report epsilon
(the document's 230260: ``+experiment=laplace_eval``) and the total reports what both cost.

The stage is selected by ``evaluation.stage=laplace_eval`` (``conf/evaluation/
laplace_eval.yaml``) and wraps the built strategy (:class:`strategies.stage.EvaluationStage`
forwards every other hook): its evaluate messages join the strategy's own (if any), and replies
are routed back by the id of the message they answer. The noise plan and both ledgers are in
:mod:`strategies.laplace_eval.privacy`, the scores in :mod:`strategies.laplace_eval.clustering`.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from clients.laplace_eval import (
    EVAL_SENSITIVITY,
    LAPLACE,
    LAPLACE_EVAL_EPS,
    PRIVACY_EVAL_TYPE,
    PRIVACY_EVAL_TYPES,
    reported_vectors,
)
from fl_app import keys
from fl_app.config.checks import ConfigError
from fl_app.config.settings import RunSettings
from fl_app.privacy.accountant import LEDGER_FILE, PrivacyAccountant
from fl_app.privacy.composition import EpsilonReport
from fl_app.run.roster import ClientInfo
from strategies import register_evaluation_stage
from strategies.base import base_train_config
from strategies.contract import Strategy
from strategies.laplace_eval.clustering import EVAL_TYPES, ClusteringScores, clustering_scores
from strategies.laplace_eval.privacy import (
    EvaluationLedger,
    LaplaceReportPlan,
)
from strategies.replies import RecentRounds, ReplyBook
from strategies.reporting import RoundReport, RunReport
from strategies.settings import StrategySettings, between, integer, names, one_of, positive
from strategies.stage import EvaluationStage

STAGE_NAME = "laplace_eval"
CLIENT_NAME = "laplace_eval"
EVALUATION_LEDGER_FILE = "privacy_ledger_evaluation.json"


class SensitivityWarning(UserWarning):
    """``evaluation.sensitivity`` is below the L1 sensitivity of probability vectors (2)."""


@dataclass(frozen=True)
class LaplaceEvalSettings(StrategySettings):
    """``cfg.evaluation`` of the stage (``conf/evaluation/laplace_eval.yaml`` explains each key)."""

    section = "evaluation"
    budget_scopes = None

    stage: str = one_of((STAGE_NAME,))
    privacy_eval_type: str = one_of(PRIVACY_EVAL_TYPES)
    laplace_eval_eps: float | None = positive(optional=True)
    budget_fraction: float = between(0.0, 1.0, low_open=True, high_open=True)
    sensitivity: float = between(1.0, math.inf)  # 2: probability vectors; 1: the document (a warning)
    cluster_client_num: int = integer(minimum=1)
    eval_type: tuple[str, ...] = names(EVAL_TYPES)
    cluster_every: int = integer(minimum=1)
    silhouette_sample_size: int | None = integer(minimum=2, optional=True)
    #: Set by :meth:`LaplaceEvalStage.training_settings`: the evaluation's share of ``privacy.epsilon``.
    epsilon_budget: float | None = field(default=None)

    @classmethod
    def missing_text(cls, strategy: str) -> str:
        """The stage's keys come with its config group."""
        return "missing: select the stage with evaluation=laplace_eval"

    @property
    def calibrated(self) -> bool:
        """Whether the stage calibrates its noise from a share of ``privacy.epsilon``."""
        return self.privacy_eval_type == LAPLACE and self.laplace_eval_eps is None

    def check(self, run: RunSettings) -> None:
        """A total budget to split."""
        if self.calibrated and run.privacy.budget_scope != "total":
            raise ConfigError(
                "evaluation.laplace_eval_eps",
                None,
                "must be set (a per-report epsilon) with privacy.budget_scope=per_round: the calibrated "
                "default splits a total budget",
            )

    def budget(self, run: RunSettings) -> float:
        """The evaluation's share of the per-client epsilon (set by the budget split, or the fraction)."""
        if self.epsilon_budget is not None:
            return self.epsilon_budget
        return run.privacy.epsilon * self.budget_fraction


@register_evaluation_stage(STAGE_NAME)
class LaplaceEvalStage(EvaluationStage):
    """Wraps a built training strategy and adds the clustering evaluation (see the module docstring)."""

    def __init__(self, strategy: Strategy) -> None:
        super().__init__(strategy)
        run = strategy.run
        self.settings = settings = run.settings.stage_settings
        self.num_rounds = run.settings.num_rounds
        self.clients_per_evaluation = min(settings.cluster_client_num, run.num_clients)
        self.evaluation_rounds = sum(1 for t in range(1, self.num_rounds + 1) if self.evaluates(t))
        self.largest_client = max(1, max(info.num_examples for info in run.roster))
        self.plan = LaplaceReportPlan.for_settings(
            laplace=settings.privacy_eval_type == LAPLACE,
            epsilon=settings.laplace_eval_eps,
            budget=settings.budget(run.settings),
            largest_client=self.largest_client,
            rounds=self.evaluation_rounds,
            sensitivity=settings.sensitivity,
        )
        warning = None if self.plan is None else self.plan.understated()
        if warning is not None:
            warnings.warn(warning, SensitivityWarning, stacklevel=2)
            log(WARNING, "%s", warning)
        self.ledger = EvaluationLedger(
            population=run.client_ids,
            training_unit=strategy.declaration.unit,
            epsilon_per_report=None if self.plan is None else self.plan.epsilon_per_report,
            delta=run.settings.privacy.delta,
            method=run.settings.privacy.accountant,
        )
        self.replies = ReplyBook(run)
        self._training: EpsilonReport | None = None  # the training's epsilon after the last round
        self._sampled: dict[int, list[ClientInfo]] = RecentRounds()
        self._messages: dict[int, list[Message]] = RecentRounds()
        self._failed: dict[int, list[int]] = {}
        self._scores: dict[int, ClusteringScores] = {}
        self._train_loss: dict[int, float] = {}

    settings_type = LaplaceEvalSettings

    @classmethod
    def training_settings(cls, settings: RunSettings) -> RunSettings:
        """Calibrated noise: training gets ``privacy.epsilon`` minus the evaluation's ``budget_fraction``."""
        stage: LaplaceEvalSettings = settings.stage_settings
        if not stage.calibrated:
            return settings
        budget = stage.budget(settings)
        training = settings.with_values(
            {"privacy.epsilon": settings.privacy.epsilon - budget, "evaluation.epsilon_budget": budget}
        )
        return dataclasses.replace(training, stage_settings=dataclasses.replace(stage, epsilon_budget=budget))

    def describe(self) -> None:
        """The training strategy's header, then the stage's settings."""
        self.inner.describe()
        plan = self.plan
        log(
            INFO,
            "\t└──> clustering evaluation: %s, %s, %d clients every %d round(s), sensitivity %g%s",
            self.settings.privacy_eval_type,
            "+".join(self.settings.eval_type),
            self.clients_per_evaluation,
            self.settings.cluster_every,
            self.settings.sensitivity,
            ""
            if plan is None
            else f", scale {plan.scale:.3g}, epsilon {plan.epsilon_per_report:.6g} per report",
        )
        fixed = (
            None
            if plan is None
            else plan.fixed_text(
                largest_client=self.largest_client,
                rounds=self.evaluation_rounds,
                epsilon=self.run.settings.privacy.epsilon,
            )
        )
        if fixed is not None:
            log(INFO, "\t└──> %s", fixed)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Forwarded; a non-private strategy's training loss is kept to log it beside the clustering scores.

        A private strategy's is not: an un-noised training loss would leave the run outside its epsilon.
        """
        arrays, metrics = self.inner.aggregate_train(server_round, replies)
        private = self.inner.declaration.is_private(self.run.settings)
        if not private and metrics is not None and keys.TRAIN_LOSS in metrics:
            self._train_loss[server_round] = float(metrics[keys.TRAIN_LOSS])
        return arrays, metrics

    def total_epsilon(self, training: EpsilonReport | None) -> EpsilonReport | None:
        """The *total* epsilon per client: the training's and the clustering evaluation's.

        Composed jointly with the training's main ledger when that ledger's worst client *is* the
        training epsilon (read back from :meth:`ledgers`, the contract); else by basic composition.
        None (no finite guarantee) when the training is not private or clear vectors were sent.
        """
        state = self.inner.ledgers().get(LEDGER_FILE)
        joint = None
        if state is not None and training is not None:
            accountant = PrivacyAccountant.from_state_dict(state)
            if accountant.epsilon(delta=self.run.settings.privacy.delta).epsilon == training.epsilon:
                joint = accountant
        return self.ledger.total(training, joint_with=joint)

    def report_round(self, server_round: int) -> RoundReport:
        """The training's round plus the clustering scores, the stage's epsilon and the total."""
        inner = self.inner.report_round(server_round)
        self._training = inner.training_epsilon
        return dataclasses.replace(
            inner,
            epsilon=self.total_epsilon(inner.training_epsilon),
            extras={**inner.extras, **self.round_extras(server_round)},
        )

    def report_run(self, final: ArrayRecord) -> RunReport:
        """The training's report with the evaluation's stage, ledger, summary and last scores."""
        inner = self.inner.report_run(final)
        privacy = inner.privacy
        total = self.total_epsilon(self._training)
        report = dataclasses.replace(
            privacy,
            summary={**privacy.summary, "evaluation": self.evaluation_summary()},
            total=dataclasses.replace(
                privacy.total,
                epsilon=None if total is None else total.epsilon,
                method=None if total is None else total.method,
                per_stage={**privacy.total.per_stage, "clustering_evaluation": self.ledger.client_epsilon()},
                covers=(
                    *privacy.total.covers,
                    "clustering evaluation: every (noised) softmax vector of every evaluated client",
                ),
            ),
        )
        last = self._scores[max(self._scores)] if self._scores else None
        final_fields = {
            **inner.final,
            "silhouette": None if last is None else last.silhouette,
            "calinski_harabasz": None if last is None else last.calinski_harabasz,
            "cluster_eval_epsilon": self.ledger.example_epsilon(),
        }
        return RunReport(privacy=report, final=final_fields)

    def ledgers(self) -> dict[str, dict[str, Any]]:
        """The training strategy's ledgers plus the per-example evaluation ledger."""
        ledgers = self.inner.ledgers()
        if self.plan is not None:
            ledgers[EVALUATION_LEDGER_FILE] = self.ledger.example_accountant.state_dict()
        return ledgers

    def evaluates(self, server_round: int) -> bool:
        """Whether ``server_round`` has a clustering evaluation (every ``cluster_every``, and the last)."""
        return server_round % self.settings.cluster_every == 0 or server_round == self.num_rounds

    def sample_clients(self, server_round: int) -> list[ClientInfo]:
        """``min(cluster_client_num, N)`` clients uniformly without replacement (seeded)."""
        rng = self.run.randomness.generator("cluster-eval-sampling", server_round=server_round)
        chosen = rng.choice(self.run.num_clients, size=self.clients_per_evaluation, replace=False)
        return [self.run.roster[i] for i in sorted(chosen)]

    def clustering_config(self, server_round: int, config: ConfigRecord) -> ConfigRecord:
        """The evaluate ConfigRecord: the strategy's base keys, the stage's client and its mechanism."""
        record = base_train_config(self.run, client=CLIENT_NAME, server_round=server_round)
        for key, value in config.items():
            record[key] = value
        record[PRIVACY_EVAL_TYPE] = self.settings.privacy_eval_type
        if self.plan is not None:
            record[LAPLACE_EVAL_EPS] = self.plan.configured_epsilon
            record[EVAL_SENSITIVITY] = self.plan.sensitivity
        return record

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The strategy's own evaluate messages plus, in evaluation rounds, the clustering ones."""
        messages = list(self.inner.configure_evaluate(server_round, arrays, config, grid))
        if not self.evaluates(server_round):
            return messages
        clients = self.sample_clients(server_round)
        content = RecordDict(
            {
                keys.ARRAYS: self.inner.arrays_for_evaluation(arrays),
                keys.CONFIG: self.clustering_config(server_round, config),
            }
        )
        ours = [
            Message(content=content, dst_node_id=c.node_id, message_type=MessageType.EVALUATE)
            for c in clients
        ]
        self._sampled[server_round] = clients
        self._messages[server_round] = ours  # the grid gives each an id when it sends them
        return messages + ours

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Score the clustering of the replies to the stage's messages; pass the others to the strategy.

        A reply is the stage's when it answers one of the stage's messages (Flower's grids give every
        sent message an id, and every reply names the id it answers).
        """
        ids = {m.metadata.message_id for m in self._messages.get(server_round, [])}
        replies = list(replies)
        mine = [r for r in replies if r.metadata.reply_to_message_id in ids]
        metrics = self.inner.aggregate_evaluate(
            server_round, [r for r in replies if r.metadata.reply_to_message_id not in ids]
        )
        if server_round not in self._sampled:
            return metrics
        scores = self._score(server_round, mine)
        extra = {"silhouette": scores.silhouette, "calinski_harabasz": scores.calinski_harabasz}
        extra = {name: value for name, value in extra.items() if value is not None}
        return MetricRecord({**(metrics or {}), **extra}) if extra else metrics

    def _score(self, server_round: int, replies: list[Message]) -> ClusteringScores:
        sampled = self._sampled[server_round]
        valid, failed = self.replies.split(server_round, replies, stage="clustering evaluation")
        failures = {info.client_id for info in failed}
        parts: list[np.ndarray] = []
        rows: dict[int, int] = {}
        classes = int(self.run.model_spec.num_classes)
        for info, reply in valid:
            vectors, rows[info.client_id] = reported_vectors(reply, num_classes=classes)
            if vectors is None:
                log(WARNING, "clustering round %d: client %d sent no vectors", server_round, info.client_id)
                failures.add(info.client_id)
            else:
                parts.append(vectors)
        answered = {info.client_id for info, _ in valid} | failures
        failures |= {c.client_id for c in sampled if c.client_id not in answered}
        self._failed[server_round] = sorted(failures)
        # Every sampled client applied (or may have applied) the mechanism: failures are charged too;
        # client level, all of a client's vectors (at least its roster size).
        self.ledger.record(
            server_round,
            [(c.client_id, max(1, c.num_examples, rows.get(c.client_id, 0))) for c in sampled],
        )
        reports = np.concatenate(parts) if parts else np.zeros((0, classes))
        seed = int(
            self.run.randomness.generator("silhouette-sample", server_round=server_round).integers(2**31)
        )
        scores = clustering_scores(
            reports,
            eval_types=self.settings.eval_type,
            silhouette_sample_size=self.settings.silhouette_sample_size,
            seed=seed,
        )
        self._scores[server_round] = scores
        log(
            INFO,
            "dpfl clustering round %d/%d: silhouette %s, calinski-harabasz %s | train loss %s | "
            "%d vectors from %d of %d clients, %d clusters, %s",
            server_round,
            self.num_rounds,
            _fmt(scores.silhouette),
            _fmt(scores.calinski_harabasz),
            _fmt(self._train_loss.get(server_round)),
            scores.reports,
            len(sampled) - len(failures),
            len(sampled),
            scores.clusters,
            "clear (NOT_ENCRYPT)"
            if self.plan is None
            else f"Laplace epsilon {self.plan.epsilon_per_report:.6g} per report",
        )
        return scores

    def round_extras(self, server_round: int) -> dict[str, Any]:
        """``silhouette``, ``calinski_harabasz``, the stage's epsilon (and a non-private run's train loss)."""
        extras: dict[str, Any] = {"train_loss": self._train_loss.get(server_round)}
        scores = self._scores.get(server_round)
        evaluated = server_round in self._sampled
        return extras | {
            "silhouette": None if scores is None else scores.silhouette,
            "calinski_harabasz": None if scores is None else scores.calinski_harabasz,
            "cluster_eval_clients": len(self._sampled[server_round]) if evaluated else None,
            "cluster_eval_failures": len(self._failed.get(server_round, [])) if evaluated else None,
            "cluster_eval_reports": None if scores is None else scores.reports,
            "cluster_eval_clusters": None if scores is None else scores.clusters,
            "cluster_eval_epsilon_per_report": self.ledger.epsilon_per_report,
            "cluster_eval_epsilon": self.ledger.example_epsilon(),
            "cluster_eval_epsilon_client": self.ledger.client_epsilon(),
        }

    def evaluation_summary(self) -> dict[str, Any]:
        """The ``evaluation`` object of the results' privacy summary."""
        plan = self.plan
        clear = LaplaceReportPlan.clear_json(self.settings.sensitivity)
        evaluation = {
            "stage": STAGE_NAME,
            "privacy_eval_type": self.settings.privacy_eval_type,
            **(clear if plan is None else plan.to_json()),
            "training_budget": None
            if plan is None or plan.budget is None
            else self.run.settings.privacy.epsilon,
            "evaluation_rounds": self.evaluation_rounds,
            "planned_epsilon_fixed_noise": None
            if plan is None or plan.budget is not None
            else plan.planned_epsilon(largest_client=self.largest_client, rounds=self.evaluation_rounds),
            **self.ledger.summary(),
            "ledger": None if plan is None else EVALUATION_LEDGER_FILE,
        }
        return evaluation


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"
