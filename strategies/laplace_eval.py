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

Correction to the document: it bounds the L1 sensitivity of a probability
vector by ``Delta f = 1``; two probability vectors can differ by 2 (``(1, 0)``
and ``(0, 1)``). ``evaluation.sensitivity`` defaults to 2; the document's 1 is
accepted when set explicitly, with a warning, and the accountant always charges
the epsilon the noise really gives, ``2 / b`` with ``b = sensitivity / eps``.

Privacy. The stage's own figure (``cluster_eval_epsilon``, ``privacy.evaluation``)
has the document's unit: one local example's inference result, i.e. its
softmax vector (replacement of one example; the number of a client's examples
is visible in the array shape and is public in the roster). One evaluation round
is one ``Laplace(2 / b)`` event for every sampled client (failures included):
different examples give disjoint reports (parallel composition), and the same
example is reported again, under a new model, each time its client is
evaluated, so those events compose (RDP plus basic composition; PLD of a
Laplace mechanism at epsilon ~1e5 would need ~1e8 bins).

What a user is promised is one epsilon per client covering everything the run
released about it: ``rounds[].epsilon`` is the *total*, in the training
strategy's unit. An evaluated client's data set determines all ``n_c`` of its
vectors, so each evaluation charges it ``n_c`` uses of ``Laplace(2 / b)``
(``cluster_eval_epsilon_client``; sound for a record-level training unit too,
where one record touches one vector); the total is the smaller of the joint
composition of training and evaluation events and the training epsilon plus
the evaluation's pure (basic) epsilon (:func:`~fl_app.privacy.composition.sequential_stages`).
``rounds[].epsilon_training`` is the training stage alone.

Budget. ``evaluation.laplace_eval_eps: null`` (default) takes
``evaluation.budget_fraction`` of ``privacy.epsilon`` for the evaluation and
gives the training strategy the rest (:meth:`LaplaceEvalStage.training_config`);
the per-report epsilon is then ``budget / (max_c n_c x evaluation rounds)``
(:func:`~fl_app.privacy.calibration.laplace_epsilon_per_report`), so the total
is at most ``privacy.epsilon``. A number sets the per-report epsilon directly
(the document's 230260 is ``+experiment=laplace_eval``); the training then keeps
the whole ``privacy.epsilon`` and the total reports what both cost.

The stage is selected by ``evaluation.stage=laplace_eval`` (``conf/evaluation/
laplace_eval.yaml``) and wraps the built strategy by composition: every hook and
attribute is delegated to it except the evaluation hooks, which add the
clustering messages to the strategy's own federated evaluation (if any).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from flwr.supercore import log
from omegaconf import DictConfig, ListConfig, OmegaConf
from sklearn.metrics import calinski_harabasz_score, silhouette_score

from clients.laplace_eval import LAPLACE, NOT_ENCRYPT, PRIVACY_EVAL_TYPES, REPORTS_ARRAY
from fl_app import keys
from fl_app.config import freeze
from fl_app.privacy.accountant import PrivacyAccountant, combined_epsilon
from fl_app.privacy.calibration import (
    PROBABILITY_VECTOR_L1_SENSITIVITY,
    laplace_epsilon_for_scale,
    laplace_epsilon_per_report,
    laplace_scale,
)
from fl_app.privacy.composition import EpsilonReport, sequential_stages
from fl_app.privacy.events import Laplace, PrivacyEvent
from fl_app.results import write_json
from fl_app.roster import ClientInfo
from fl_app.run_context import RunContext
from fl_app.validation import ConfigError, require_choice, require_int, require_positive, require_range
from strategies import STRATEGIES, register_evaluation_stage
from strategies.base import FederatedStrategy, RecentRounds

STAGE_NAME = "laplace_eval"
CLIENT_NAME = "laplace_eval"
SILHOUETTE = "SILHOUETTE_SCORE"
CALINSKI_HARABASZ = "CALINSKI_HARABASZ"
EVAL_TYPES: tuple[str, ...] = (SILHOUETTE, CALINSKI_HARABASZ)
LEDGER_FILE = "privacy_ledger_evaluation.json"
ACCOUNTANT_METHOD = "rdp"
#: ``evaluation.*`` key the budget split adds for the stage (see :meth:`LaplaceEvalStage.training_config`).
BUDGET_KEY = "epsilon_budget"


class SensitivityWarning(UserWarning):
    """``evaluation.sensitivity`` is below the L1 sensitivity of probability vectors (2)."""


@dataclass(frozen=True)
class ClusteringScores:
    """The server's clustering evaluation of one round.

    Attributes
    ----------
    silhouette : float or None
        Silhouette score (None: not requested, or undefined with fewer than 2 clusters).
    calinski_harabasz : float or None
        Calinski-Harabasz index (None: not requested or undefined).
    reports : int
        Number of vectors clustered.
    clusters : int
        Number of distinct argmax clusters.

    """

    silhouette: float | None
    calinski_harabasz: float | None
    reports: int
    clusters: int


def eval_types_of(value: Any) -> tuple[str, ...]:
    """``evaluation.eval_type`` (one name or a list of names) as a tuple of names."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, ListConfig | list | tuple):
        return tuple(str(v) for v in value)
    raise ConfigError(
        "evaluation.eval_type", value, f"must be one of {', '.join(EVAL_TYPES)} or a list of them"
    )


def clustering_scores(
    reports: np.ndarray,
    *,
    eval_types: Sequence[str] = EVAL_TYPES,
    silhouette_sample_size: int | None = None,
    seed: int = 0,
) -> ClusteringScores:
    """Cluster vectors by their largest coordinate and score the clustering (scikit-learn).

    Parameters
    ----------
    reports : np.ndarray
        Shape ``(n, classes)``: the (noised) softmax vectors.
    eval_types : Sequence[str]
        Which of ``SILHOUETTE_SCORE`` and ``CALINSKI_HARABASZ`` to compute.
    silhouette_sample_size : int, optional
        Compute the silhouette on this many vectors drawn without replacement
        (scikit-learn's ``sample_size``); None or ``>= n``: on all.
    seed : int
        ``random_state`` of that subsample.

    Returns
    -------
    ClusteringScores
        Both scores are None when the clustering has fewer than 2 or more than
        ``n - 1`` clusters (where scikit-learn does not define them).

    """
    reports = np.asarray(reports, dtype=np.float64)
    if reports.ndim != 2:
        raise ValueError(f"reports must have shape (n, classes), got {reports.shape}")
    n = reports.shape[0]
    labels = np.argmax(reports, axis=1) if n else np.zeros(0, dtype=np.int64)
    clusters = len(np.unique(labels))
    silhouette = calinski = None
    if 2 <= clusters <= n - 1:
        if SILHOUETTE in eval_types:
            sample = silhouette_sample_size if silhouette_sample_size and silhouette_sample_size < n else None
            try:
                silhouette = float(silhouette_score(reports, labels, sample_size=sample, random_state=seed))
            except ValueError:  # the subsample holds a single cluster
                silhouette = None
        if CALINSKI_HARABASZ in eval_types:
            calinski = float(calinski_harabasz_score(reports, labels))
    return ClusteringScores(silhouette, calinski, n, clusters)


@register_evaluation_stage(STAGE_NAME)
class LaplaceEvalStage(Strategy):
    """Wraps a built training strategy and adds the clustering evaluation (see the module docstring).

    Parameters
    ----------
    strategy : FederatedStrategy
        The training strategy; every hook except the evaluation ones is delegated to it.

    """

    evaluation_unit = (
        "one local example's inference result (its softmax vector; replace one example), local DP "
        "against the server; the number of a client's examples is disclosed by the array shape"
    )

    def __init__(self, strategy: FederatedStrategy) -> None:
        self.inner = strategy
        run = strategy.run
        settings = run.cfg.evaluation
        self.mode = str(settings.privacy_eval_type)
        self.eval_types = eval_types_of(settings.eval_type)
        self.every = int(settings.cluster_every)
        self.num_rounds = int(run.cfg.num_rounds)
        self.clients_per_evaluation = min(int(settings.cluster_client_num), run.num_clients)
        size = settings.silhouette_sample_size
        self.silhouette_sample_size = None if size is None else int(size)
        self.sensitivity = float(settings.sensitivity)
        self.configured_epsilon: float | None = None
        self.scale: float | None = None
        self.epsilon_per_report: float | None = None
        self.evaluation_rounds = sum(1 for t in range(1, self.num_rounds + 1) if self.evaluates(t))
        self.budget: float | None = None
        self.epsilon_source = "none (clear reports)"
        if self.mode == LAPLACE:
            if settings.laplace_eval_eps is None:
                self.budget = evaluation_budget(run.cfg)
                largest = max(info.num_examples for info in run.roster)
                true_epsilon = laplace_epsilon_per_report(
                    budget=self.budget, reports=max(1, largest) * self.evaluation_rounds
                )
                # Calibrate what the noise really gives (sensitivity 2); the client divides by the
                # configured sensitivity, so send the epsilon that yields scale 2 / true_epsilon.
                self.configured_epsilon = true_epsilon * self.sensitivity / PROBABILITY_VECTOR_L1_SENSITIVITY
                self.epsilon_source = (
                    f"calibrated: budget {self.budget:.6g} (evaluation.budget_fraction of the per-client "
                    f"epsilon) over {largest} reports x {self.evaluation_rounds} evaluation rounds, "
                    "basic composition"
                )
            else:
                self.configured_epsilon = float(settings.laplace_eval_eps)
                self.epsilon_source = "evaluation.laplace_eval_eps (set by hand)"
            self.scale = laplace_scale(sensitivity=self.sensitivity, epsilon=self.configured_epsilon)
            self.epsilon_per_report = laplace_epsilon_for_scale(
                scale=self.scale, sensitivity=PROBABILITY_VECTOR_L1_SENSITIVITY
            )
            if self.sensitivity < PROBABILITY_VECTOR_L1_SENSITIVITY:
                message = (
                    f"evaluation.sensitivity={self.sensitivity:g} is below the L1 sensitivity of "
                    f"probability vectors ({PROBABILITY_VECTOR_L1_SENSITIVITY:g}): the noise scale "
                    f"{self.scale:.3g} gives "
                    f"epsilon {self.epsilon_per_report:.6g} per report, not the configured "
                    f"{self.configured_epsilon:.6g}; the results report {self.epsilon_per_report:.6g}"
                )
                warnings.warn(message, SensitivityWarning, stacklevel=2)
                log(WARNING, "%s", message)
        self.eval_accountant = PrivacyAccountant(
            population=run.client_ids, unit=self.evaluation_unit, method=ACCOUNTANT_METHOD
        )
        # The same releases in the training strategy's unit (a client's whole data set): n_c uses each.
        self.client_accountant = PrivacyAccountant(
            population=run.client_ids, unit=strategy.privacy_unit, method=ACCOUNTANT_METHOD
        )
        self._total_cache: tuple[tuple[int, int], EpsilonReport | None] | None = None
        self._evaluations: Counter[int] = Counter()
        self._sampled: dict[int, list[ClientInfo]] = RecentRounds()
        self._messages: dict[int, list[Message]] = RecentRounds()
        self._inner_nodes: dict[int, set[int]] = RecentRounds()
        self._failed: dict[int, list[int]] = {}
        self._scores: dict[int, ClusteringScores] = {}
        self._train_loss: dict[int, float] = {}
        if int(settings.cluster_client_num) > run.num_clients:
            log(
                INFO,
                "clustering evaluation: cluster_client_num=%d > num_clients=%d, every client is evaluated",
                int(settings.cluster_client_num),
                run.num_clients,
            )

    # ------------------------------------------------------------------ configuration

    @classmethod
    def validate_config(cls, cfg: DictConfig) -> None:
        """Check the ``evaluation.*`` keys of the stage; raise :class:`ConfigError`."""
        settings = cfg.evaluation
        for key in (
            "privacy_eval_type",
            "laplace_eval_eps",
            "sensitivity",
            "cluster_client_num",
            "eval_type",
            "cluster_every",
        ):
            if key not in settings:
                raise ConfigError(
                    f"evaluation.{key}", None, "missing: select the stage with evaluation=laplace_eval"
                )
        mode = require_choice("evaluation.privacy_eval_type", settings.privacy_eval_type, PRIVACY_EVAL_TYPES)
        if mode == LAPLACE and settings.laplace_eval_eps is not None:
            require_positive("evaluation.laplace_eval_eps", settings.laplace_eval_eps)
        elif mode == LAPLACE:
            require_range(
                "evaluation.budget_fraction",
                settings.get("budget_fraction"),
                0.0,
                1.0,
                low_open=True,
                high_open=True,
            )
            if cfg.privacy.budget_scope != "total":
                raise ConfigError(
                    "evaluation.laplace_eval_eps",
                    None,
                    "must be set (a per-report epsilon) with privacy.budget_scope=per_round: the calibrated "
                    "default splits a total budget",
                )
        sensitivity = require_positive("evaluation.sensitivity", settings.sensitivity)
        if sensitivity < 1.0:
            raise ConfigError(
                "evaluation.sensitivity",
                settings.sensitivity,
                "must be a number >= 1 (2 is the L1 sensitivity of probability vectors; "
                "1 reproduces the MindSpore document, with a warning)",
            )
        require_int("evaluation.cluster_client_num", settings.cluster_client_num, minimum=1)
        require_int("evaluation.cluster_every", settings.cluster_every, minimum=1)
        types = eval_types_of(settings.eval_type)
        if not types:
            raise ConfigError(
                "evaluation.eval_type", list(types), f"must name one or more of {', '.join(EVAL_TYPES)}"
            )
        for name in types:
            require_choice("evaluation.eval_type", name, EVAL_TYPES)
        size = settings.get("silhouette_sample_size")
        if size is not None:
            require_int("evaluation.silhouette_sample_size", size, minimum=2)
        strategy = STRATEGIES.get(str(cfg.strategy.name))
        if strategy.start is not Strategy.start:
            raise ConfigError(
                "evaluation.stage",
                STAGE_NAME,
                f"cannot wrap strategy.name={cfg.strategy.name}: it overrides Strategy.start, whose round "
                "loop would bypass the stage",
            )

    @classmethod
    def training_config(cls, cfg: DictConfig) -> DictConfig:
        """The configuration the training strategy gets: ``privacy.epsilon`` minus the evaluation's budget.

        Only when the stage calibrates its noise (``LAPLACE`` with ``laplace_eval_eps: null``): the
        evaluation takes ``budget_fraction`` of ``privacy.epsilon`` (``evaluation.epsilon_budget``) and
        training the rest, so the total per client is at most ``privacy.epsilon``. Otherwise ``cfg``.
        """
        settings = cfg.evaluation
        if str(settings.privacy_eval_type) != LAPLACE or settings.laplace_eval_eps is not None:
            return cfg
        total = float(cfg.privacy.epsilon)
        budget = total * float(settings.budget_fraction)
        container = OmegaConf.to_container(cfg, resolve=True)
        assert isinstance(container, dict)
        container["privacy"]["epsilon"] = total - budget
        container["evaluation"][BUDGET_KEY] = budget
        return freeze(OmegaConf.create(container))

    # ------------------------------------------------------------------ delegation

    def __getattr__(self, name: str) -> Any:
        """Everything not defined here is the training strategy's."""
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def run(self) -> RunContext:
        """The training strategy's run context."""
        return self.inner.run

    @property
    def cfg(self) -> DictConfig:
        """The run configuration."""
        return self.inner.cfg

    @property
    def accountant(self) -> PrivacyAccountant | None:
        """The *training* accountant (``privacy_ledger.json``); the stage's is :attr:`eval_accountant`."""
        return self.inner.accountant

    def initial_arrays(self) -> ArrayRecord:
        """Delegated."""
        return self.inner.initial_arrays()

    def summary(self) -> None:
        """The training strategy's summary, then the stage's settings."""
        self.inner.summary()
        log(
            INFO,
            "\t└──> clustering evaluation: %s, %s, %d clients every %d round(s), sensitivity %g%s",
            self.mode,
            "+".join(self.eval_types),
            self.clients_per_evaluation,
            self.every,
            self.sensitivity,
            ""
            if self.epsilon_per_report is None
            else f", scale {self.scale:.3g}, epsilon {self.epsilon_per_report:.6g} per report",
        )

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Delegated."""
        return self.inner.configure_train(server_round, arrays, config, grid)

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Delegated; a non-private strategy's training loss is kept to log it beside the clustering scores.

        A private strategy's is not: an un-noised training loss would leave the run outside its epsilon.
        """
        arrays, metrics = self.inner.aggregate_train(server_round, replies)
        if self.inner.accountant is None and metrics is not None and keys.TRAIN_LOSS in metrics:
            self._train_loss[server_round] = float(metrics[keys.TRAIN_LOSS])
        return arrays, metrics

    def evaluate_global(self, arrays: ArrayRecord, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """Delegated."""
        return self.inner.evaluate_global(arrays, x, y)

    def epsilon(self) -> EpsilonReport | None:
        """The *total* epsilon per client (``rounds[].epsilon``): training and clustering evaluation.

        None (no finite guarantee) when the training is not private or clear vectors were sent.
        """
        training = self.inner.epsilon()
        if training is None or not self._evaluations:
            return training
        if self.epsilon_per_report is None:
            return None
        state = (
            len(self.inner.accountant.events) if self.inner.accountant else 0,
            len(self.client_accountant.events),
        )
        if self._total_cache is not None and self._total_cache[0] == state:
            return self._total_cache[1]
        pure = self.client_accountant.basic_epsilon()
        assert pure is not None  # Laplace only
        joint = None
        if type(self.inner).epsilon is FederatedStrategy.epsilon and self.inner.accountant is not None:
            joint = combined_epsilon(
                accountants=[self.inner.accountant, self.client_accountant],
                delta=self.run.delta,
                method=ACCOUNTANT_METHOD,
            )
        total = sequential_stages(training=training, pure_epsilon=pure, joint=joint)
        self._total_cache = (state, total)
        return total

    def training_epsilon(self) -> EpsilonReport | None:
        """The training stage's epsilon alone (``rounds[].epsilon_training``)."""
        return self.inner.epsilon()

    def stage_epsilons(self) -> dict[str, float | None]:
        """Training and clustering evaluation, each in the training strategy's unit."""
        stages = dict(self.inner.stage_epsilons())
        stages["clustering_evaluation"] = self.client_level_evaluation_epsilon()
        return stages

    def released_stages(self) -> list[str]:
        """The training strategy's releases plus the evaluation's vectors."""
        return [
            *self.inner.released_stages(),
            "clustering evaluation: every (noised) softmax vector of every evaluated client",
        ]

    def selected(self, server_round: int) -> list[ClientInfo]:
        """Delegated (clients of the train round)."""
        return self.inner.selected(server_round)

    def round_failures(self, server_round: int) -> list[int]:
        """Delegated (failures of the train round)."""
        return self.inner.round_failures(server_round)

    # ------------------------------------------------------------------ evaluation

    def evaluates(self, server_round: int) -> bool:
        """Whether ``server_round`` has a clustering evaluation (every ``cluster_every``, and the last)."""
        return server_round % self.every == 0 or server_round == self.num_rounds

    def sample_clients(self, server_round: int) -> list[ClientInfo]:
        """``min(cluster_client_num, N)`` clients uniformly without replacement (seeded)."""
        rng = self.run.randomness.generator("cluster-eval-sampling", server_round=server_round)
        chosen = rng.choice(self.run.num_clients, size=self.clients_per_evaluation, replace=False)
        return [self.run.roster[i] for i in sorted(chosen)]

    def clustering_config(self, server_round: int, config: ConfigRecord) -> ConfigRecord:
        """The evaluate ConfigRecord: the strategy's base keys, the stage's client and its mechanism."""
        record = self.inner.base_config(server_round)
        for key, value in config.items():
            record[key] = value
        record[keys.ALGORITHM] = CLIENT_NAME
        record[keys.PRIVACY_EVAL_TYPE] = self.mode
        if self.mode == LAPLACE:
            assert self.configured_epsilon is not None
            record[keys.LAPLACE_EVAL_EPS] = self.configured_epsilon
            record[keys.EVAL_SENSITIVITY] = self.sensitivity
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
        self._messages[server_round] = ours
        self._inner_nodes[server_round] = {int(m.metadata.dst_node_id) for m in messages}
        return messages + ours

    def _is_ours(self, reply: Message, server_round: int) -> bool:
        ours = self._messages.get(server_round, [])
        ids = {m.metadata.message_id for m in ours}
        if reply.metadata.reply_to_message_id and reply.metadata.reply_to_message_id in ids:
            return True
        if all(ids) and ids:  # the grid assigned ids: the reply answers another message
            return False
        if reply.has_content():
            return keys.INFERENCE_REPORTS in reply.content.array_records
        source = int(reply.metadata.src_node_id)
        return source in {int(m.metadata.dst_node_id) for m in ours} and source not in self._inner_nodes.get(
            server_round, set()
        )

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Score the clustering of the received vectors; pass the other replies to the strategy."""
        replies = list(replies)
        mine = [r for r in replies if self._is_ours(r, server_round)]
        theirs = [r for r in replies if not self._is_ours(r, server_round)]
        metrics = self.inner.aggregate_evaluate(server_round, theirs)
        if server_round not in self._sampled:
            return metrics
        scores = self._score(server_round, mine)
        extra = {
            name: value
            for name, value in (
                ("silhouette", scores.silhouette),
                ("calinski_harabasz", scores.calinski_harabasz),
            )
            if value is not None
        }
        if not extra:
            return metrics
        result = MetricRecord(dict(metrics.items()) if metrics is not None else {})
        for name, value in extra.items():
            result[name] = value
        return result

    def _score(self, server_round: int, replies: list[Message]) -> ClusteringScores:
        sampled = self._sampled[server_round]
        valid, failed = self.inner.split_replies(server_round, replies, stage="clustering evaluation")
        failures = {info.client_id for info in failed}
        parts: list[np.ndarray] = []
        rows: dict[int, int] = {}
        classes = int(self.run.model_spec.num_classes)
        for info, reply in valid:
            record = reply.content.array_records.get(keys.INFERENCE_REPORTS)
            vectors = None if record is None or REPORTS_ARRAY not in record else record[REPORTS_ARRAY].numpy()
            if vectors is not None and vectors.ndim >= 1:
                rows[info.client_id] = int(vectors.shape[0])
            if vectors is None or vectors.ndim != 2 or vectors.shape[1] != classes:
                log(
                    WARNING,
                    "clustering evaluation round %d: client %d sent no valid vectors",
                    server_round,
                    info.client_id,
                )
                failures.add(info.client_id)
                continue
            parts.append(np.asarray(vectors, dtype=np.float64))
        answered = {info.client_id for info, _ in valid} | {info.client_id for info in failed}
        failures |= {c.client_id for c in sampled if c.client_id not in answered}
        self._failed[server_round] = sorted(failures)
        # Every sampled client applied (or may have applied) the mechanism: failures are charged too.
        participants = tuple(c.client_id for c in sampled)
        self._evaluations.update(participants)
        if self.epsilon_per_report is not None:
            self.eval_accountant.record(
                PrivacyEvent(
                    server_round,
                    Laplace(self.epsilon_per_report),
                    count=1,
                    participants=participants,
                    label="clustering evaluation: one Laplace report per local example",
                )
            )
            for client in sampled:  # client level: all of a client's vectors (at least its roster size)
                self.client_accountant.record(
                    PrivacyEvent(
                        server_round,
                        Laplace(self.epsilon_per_report),
                        count=max(1, client.num_examples, rows.get(client.client_id, 0)),
                        participants=(client.client_id,),
                        label="clustering evaluation: the client's vectors (client level)",
                    )
                )
            write_json(self.run.output_dir / LEDGER_FILE, self.eval_accountant.state_dict())
        reports = np.concatenate(parts) if parts else np.zeros((0, classes))
        seed = int(
            self.run.randomness.generator("silhouette-sample", server_round=server_round).integers(2**31)
        )
        scores = clustering_scores(
            reports, eval_types=self.eval_types, silhouette_sample_size=self.silhouette_sample_size, seed=seed
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
            if self.epsilon_per_report is None
            else f"Laplace epsilon {self.epsilon_per_report:.6g} per report",
        )
        return scores

    # ------------------------------------------------------------------ reporting

    def evaluation_epsilon(self) -> float | None:
        """Cumulative per-report epsilon of the most-evaluated client (None: clear reports were sent)."""
        if not self._evaluations:
            return 0.0
        if self.epsilon_per_report is None:
            return None
        return self.eval_accountant.epsilon(delta=self.run.delta).epsilon

    def client_level_evaluation_epsilon(self) -> float | None:
        """The evaluation's cumulative epsilon in the training strategy's unit (worst client; None: clear)."""
        if not self._evaluations:
            return 0.0
        if self.epsilon_per_report is None:
            return None
        return self.client_accountant.epsilon(delta=self.run.delta).epsilon

    def round_extras(self, server_round: int) -> dict[str, Any]:
        """The strategy's extras plus ``silhouette``, ``calinski_harabasz`` and the stage's epsilon."""
        extras = dict(self.inner.round_extras(server_round))
        extras.setdefault("train_loss", self._train_loss.get(server_round))
        scores = self._scores.get(server_round)
        evaluated = server_round in self._sampled
        extras.update(
            {
                "silhouette": None if scores is None else scores.silhouette,
                "calinski_harabasz": None if scores is None else scores.calinski_harabasz,
                "cluster_eval_clients": len(self._sampled[server_round]) if evaluated else None,
                "cluster_eval_failures": len(self._failed.get(server_round, [])) if evaluated else None,
                "cluster_eval_reports": None if scores is None else scores.reports,
                "cluster_eval_clusters": None if scores is None else scores.clusters,
                "cluster_eval_epsilon_per_report": self.epsilon_per_report,
                "cluster_eval_epsilon": self.evaluation_epsilon(),
                "cluster_eval_epsilon_client": self.client_level_evaluation_epsilon(),
            }
        )
        return extras

    def privacy_summary(self) -> dict[str, Any]:
        """The training strategy's summary plus an ``evaluation`` object for the stage."""
        summary = dict(self.inner.privacy_summary())
        report = (
            None if self.epsilon_per_report is None else self.eval_accountant.epsilon(delta=self.run.delta)
        )
        summary["evaluation"] = {
            "stage": STAGE_NAME,
            "privacy_eval_type": self.mode,
            "unit": self.evaluation_unit,
            "mechanism": (
                "none: softmax vectors uploaded in the clear (no finite epsilon)"
                if self.mode == NOT_ENCRYPT
                else "Laplace noise of scale b on every coordinate of each softmax vector, on the device"
            ),
            "sensitivity_configured": self.sensitivity,
            "sensitivity_true": PROBABILITY_VECTOR_L1_SENSITIVITY,
            "laplace_eval_eps": self.configured_epsilon,
            "epsilon_source": self.epsilon_source,
            "budget": self.budget,
            "training_budget": None if self.budget is None else float(self.run.cfg.privacy.epsilon),
            "evaluation_rounds": self.evaluation_rounds,
            "scale": self.scale,
            "epsilon_per_report": self.epsilon_per_report,
            "epsilon_cumulative": self.evaluation_epsilon(),
            "epsilon_client_level": self.client_level_evaluation_epsilon(),
            "epsilon_cumulative_basic": None if report is None else report.basic,
            "epsilon_cumulative_method": None if report is None else report.method,
            "delta": self.run.delta,
            "max_evaluations_per_client": max(self._evaluations.values(), default=0),
            "accountant": (
                f"{ACCOUNTANT_METHOD} (dp-accounting 0.6.0) and basic composition, per client, over one "
                "Laplace event per evaluation round naming every sampled client (epsilon_cumulative: one "
                "example's unit); epsilon_client_level charges each evaluated client n_c uses (its whole "
                "data set, the training strategy's unit) and is composed with training into rounds[].epsilon "
                "(the total per client); rounds[].epsilon_training is training alone"
            ),
            "disclosed": (
                "which clients were evaluated and each one's number of local examples (the shape of its "
                "upload; public in the roster); see privacy.randomness for whether the noise is secret"
            ),
            "ledger": LEDGER_FILE if self.epsilon_per_report is not None else None,
        }
        return summary

    def final_extras(self) -> dict[str, Any]:
        """The strategy's extras plus the last clustering scores."""
        extras = dict(self.inner.final_extras())
        last = self._scores[max(self._scores)] if self._scores else None
        extras["silhouette"] = None if last is None else last.silhouette
        extras["calinski_harabasz"] = None if last is None else last.calinski_harabasz
        extras["cluster_eval_epsilon"] = self.evaluation_epsilon()
        return extras


def evaluation_budget(cfg: DictConfig) -> float:
    """The evaluation's share of the per-client epsilon (set by the budget split, or the fraction)."""
    settings = cfg.evaluation
    if settings.get(BUDGET_KEY) is not None:
        return float(settings[BUDGET_KEY])
    return float(cfg.privacy.epsilon) * float(settings.budget_fraction)


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.4g}"
