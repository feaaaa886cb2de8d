"""PrivateKT: private knowledge transfer with active sampling, a knowledge buffer and self-training.

Qi, Wu et al., "Differentially private knowledge transfer for federated
learning", Nature Communications 2023: Algorithm 1, Eq. 2-6 and Lemma 1; the
authors' public Keras code (taoqi98/PrivateKT) for the details the text leaves
open. Each round t:

1. the server sends Theta_t and the K knowledge-transfer (KT) samples of the
   round (``strategy.k``): rows of the unlabeled public split (its labels are
   never read), as indices in a simulation or, with ``strategy.send_kt_data``,
   as the samples themselves (what real devices need);
2. every selected client trains Theta_t on its data, predicts a label for each
   KT sample and perturbs each label by k-ary randomized response (Eq. 2) with
   keep probability beta; its reply is those K labels and nothing else
   (:mod:`clients.privatekt`);
3. the server debiases the average of the one-hot reports (Eq. 3), turns it
   into targets (``strategy.knowledge``: ``argmax`` as the authors' code,
   ``soft``: the estimate clipped to the simplex), pushes them into the FIFO
   knowledge buffer of B rounds (``strategy.buffer_size``), fine-tunes Theta_t
   on the buffer (``strategy.server_steps`` full-batch SGD steps), self-trains
   on M public samples drawn with weight ``exp(-entropy)`` (Eq. 5,
   ``strategy.self_train``), giving Theta_{t+1}. The self-training targets are
   the model's own predicted distributions (``strategy.self_train_targets=soft``,
   the authors' code) or their argmax (``hard``);
4. the next round's K KT samples are drawn with weight ``exp(entropy)`` under
   Theta_{t+1} (Eq. 4); round 1 draws them the same way under the initial model
   (``strategy.first_draw=entropy``, the authors' code) or uniformly (``uniform``, Algorithm 1, line 3).

No parameter averaging: the global model changes only on the server.

Privacy (local DP, unit: one client's entire data set; any two data sets of a
client may change all K predictions). One report of K labels, each perturbed
with ``RandomizedResponse(eps_label, C)``, is ``K eps_label``-LDP (Lemma 1 is
basic composition over the K labels). Reports of different rounds compose:
the document's claim that model shuffling stops budgets from accumulating does
not apply here (nothing shuffles the reports; the server knows who sent what).
``privacy.budget_scope=per_round`` sets ``eps_label = epsilon / K`` (the
document's per-round reading, beta of Lemma 1); ``total`` (default) calibrates
``eps_label`` so that the most-selected client's K x (rounds it takes part in)
reports compose to at most ``privacy.epsilon`` in the accountant. Client
selection is seeded, so the schedule of every round is fixed at start-up and
the maximum participation is known exactly. One event per round names every
selected client (failures included).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid

from clients.privatekt import (
    KT_INDICES,
    KT_LABEL_EPSILON,
    KT_LABELS,
    KT_LABELS_ARRAY,
    KT_SAMPLES,
    KT_SAMPLES_ARRAY,
    decode_labels,
)
from fl_app import keys
from fl_app.config.checks import ConfigError
from fl_app.config.settings import RunSettings
from fl_app.data.federated import federated_data
from fl_app.learning.models import is_28x28_image
from fl_app.learning.training import has_dropout, load_arrays, model_to_arrays, predict_proba
from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.composition import compose_epsilon
from fl_app.privacy.events import PrivacyEvent, RandomizedResponse
from fl_app.privacy.mechanisms import debias_label_average
from fl_app.run.context import RunContext
from fl_app.run.roster import ClientInfo
from strategies import register_strategy
from strategies.base import RecentRounds
from strategies.cohorts import SCHEDULES, max_participations
from strategies.contract import Declaration, QuickExample
from strategies.private import PrivateStrategy
from strategies.privatekt.knowledge import (
    KNOWLEDGE_MODES,
    KnowledgeBuffer,
    draw_weighted,
    fit_targets,
    knowledge_targets,
    prediction_entropy,
    sampling_weights,
)
from strategies.privatekt.privacy import privatekt_epsilon_per_label
from strategies.settings import StrategySettings, between, flag, integer, one_of

if TYPE_CHECKING:
    from torch import nn

SELF_TRAIN_TARGETS = ("soft", "hard")
FIRST_DRAWS = ("entropy", "uniform")
#: ``model=auto`` on 28x28 images: the authors' CNN with dropout (``fl_app.learning.models``).
PRIVATEKT_MODEL = "privatekt_cnn"
#: Self-training size when ``strategy.self_train`` is null: the authors' code's ratio of the public split.
SELF_TRAIN_RATIO = 0.1
#: Input dropout of self-training for a model without dropout layers (``self_train_dropout: null``).
SELF_TRAIN_INPUT_DROPOUT = 0.2
#: Labels travel as uint8 class indices.
MAX_CLASSES = 256


def public_split_size(run: RunSettings) -> int | None:
    """Rows of the run's public split (None when the data cannot be loaded here)."""
    try:
        return len(federated_data(run.data).public_rows)
    except (OSError, ValueError):  # missing files: locate_data reports them
        return None


def simulated_roster(roster: list[ClientInfo]) -> bool:
    """True when every node reported a partition id (simulated nodes; devices report none).

    Uses ``ClientInfo.device`` where the roster has it; otherwise a device is
    recognised by its client id being its node id (what the roster assigns
    when no partition id is reported).
    """
    return not any(getattr(info, "device", info.client_id == info.node_id) for info in roster)


@dataclass(frozen=True)
class PrivateKTSettings(StrategySettings):
    """``cfg.strategy`` of ``privatekt`` (``conf/strategy/privatekt.yaml`` explains each key)."""

    k: int = integer(minimum=1)
    buffer_size: int = integer(minimum=1)
    self_train: int | None = integer(minimum=0, optional=True)
    self_train_targets: str = one_of(SELF_TRAIN_TARGETS)
    self_train_dropout: float | None = between(0.0, 1.0, high_open=True, optional=True)
    first_draw: str = one_of(FIRST_DRAWS)
    server_steps: int = integer(minimum=0)
    local_epochs: int | None = integer(minimum=1, optional=True)
    knowledge: str = one_of(KNOWLEDGE_MODES)
    send_kt_data: bool | None = flag(optional=True)
    schedule: str = one_of(SCHEDULES)

    def check(self, run: RunSettings) -> None:
        """An unlabeled public split with at least K (and M) rows."""
        if float(run.data.dataset.get("public_fraction", 0.0)) <= 0:
            raise ConfigError(
                "dataset.public_fraction",
                run.data.dataset.get("public_fraction"),
                "PrivateKT needs an unlabeled public split: must be > 0",
            )
        public = public_split_size(run)
        for key, value in (("strategy.k", self.k), ("strategy.self_train", self.self_train)):
            if public is not None and value is not None and value > public:
                raise ConfigError(key, value, f"must be <= the public split size {public}")


@register_strategy("privatekt")
class PrivateKTStrategy(PrivateStrategy):
    """PrivateKT's server: KT sampling, Eq. 3 aggregation, buffer fine-tuning, self-training."""

    declaration = Declaration(
        name="privatekt",
        paper="Qi, Wu et al., Nature Communications 2023 (PrivateKT)",
        unit=(
            "one client's entire local data set (local DP: any two data sets of one client; "
            "each report of K labels is protected against the server)"
        ),
        mechanism="k-ary randomized response on each of the K predicted labels (Eq. 2)",
        client="privatekt",
        settings=PrivateKTSettings,
        model=lambda run, shape: PRIVATEKT_MODEL if is_28x28_image(shape) else None,
        canaries=(
            "uploads labels (k-ary randomized response): the analogue is a canary label with a known "
            "answer, a membership test on the label histogram, not a cosine (see docs/empirical_privacy.md)"
        ),
        quick=QuickExample(
            overrides=(
                "num_clients=80",
                "clients_per_round=40",
                "num_rounds=60",
                "local_epochs=2",
                "dataset.public_fraction=0.2",
                "privacy.epsilon=150.0",
            ),
            suite_rounds=10,
            about=(
                "PrivateKT in the shape of the authors' demo (80 clients, 40 per round, 20% public split), "
                "60 rounds; epsilon 150 per client over its ~30 reports (local DP)"
            ),
        ),
        comparisons=("comparison", "cross_device"),
        sequences=(
            "its clients transfer knowledge as one class label per public example (k-ary randomized "
            "response over the classes, sent as uint8); a text example has a next token at every position "
            "over a vocabulary of up to 10,004 tokens, which it has no label for"
        ),
    )
    settings: PrivateKTSettings

    def __init__(self, run: RunContext, settings: PrivateKTSettings | None = None) -> None:
        super().__init__(run, settings)
        settings = self.settings
        self.k = settings.k
        self.num_classes = int(run.model_spec.num_classes)
        self.public_x = run.data.public_x()
        self.num_public = len(self.public_x)
        default_self_train = round(SELF_TRAIN_RATIO * self.num_public)
        self.self_train = default_self_train if settings.self_train is None else settings.self_train
        if settings.self_train_dropout is not None:
            self.self_train_dropout = settings.self_train_dropout
        else:  # the authors' CNN brings its own dropout; a model without any needs input dropout
            self.self_train_dropout = 0.0 if has_dropout(run.model_spec.build()) else SELF_TRAIN_INPUT_DROPOUT
        if self.num_classes > MAX_CLASSES:
            raise ConfigError(
                "dataset", self.num_classes, f"PrivateKT sends labels as uint8: <= {MAX_CLASSES}"
            )
        self.buffer = KnowledgeBuffer(settings.buffer_size)
        self.local_epochs = (
            self.run.settings.local_epochs if settings.local_epochs is None else settings.local_epochs
        )
        simulated = simulated_roster(run.roster)
        self.send_kt_data = not simulated if settings.send_kt_data is None else settings.send_kt_data

        self.cohorts.plan(
            self.cohorts.seeded_schedule(
                self.run.settings.num_rounds, balanced=settings.schedule == "balanced"
            )
        )
        self.max_participations = max_participations(self.cohorts.planned)
        self._calibrate_reports()
        self._kt: dict[int, np.ndarray] = RecentRounds()
        self._stats: dict[int, dict[str, Any]] = RecentRounds()
        self._log_setup()

    def _calibrate_reports(self) -> None:
        """The per-label randomized response for the budget scope, its keep probability and accountant."""
        self.budget_scope = self.run.settings.privacy.budget_scope
        self.method = self.run.settings.privacy.accountant
        self.epsilon_per_label = privatekt_epsilon_per_label(
            epsilon=self.run.settings.privacy.epsilon,
            k=self.k,
            num_classes=self.num_classes,
            budget_scope=self.budget_scope,
            max_participations=max(self.max_participations, 1),
            delta=self.run.settings.privacy.delta,
            method=self.method,
        )
        self.mechanism = RandomizedResponse(self.epsilon_per_label, self.num_classes)
        self.beta = self.mechanism.keep_probability
        self.epsilon_per_round = compose_epsilon(
            {self.mechanism: self.k}, delta=self.run.settings.privacy.delta, method=self.method
        ).epsilon
        self.accountant = PrivacyAccountant(
            population=self.run.client_ids, unit=self.privacy_unit, method=self.method
        )

    def _log_setup(self) -> None:
        """One line with the round's shape and the privacy calibration."""
        log(
            INFO,
            "PrivateKT: K=%d, B=%d, M=%d, C=%d, %s budget: epsilon per label %.4g (beta %.4g), "
            "per round %.4g; most-selected client takes part in %d rounds; KT data sent as %s; "
            "self-training input dropout %g",
            self.k,
            self.buffer.size,
            self.self_train,
            self.num_classes,
            self.budget_scope,
            self.epsilon_per_label,
            self.beta,
            self.epsilon_per_round,
            self.max_participations,
            "samples" if self.send_kt_data else "indices",
            self.self_train_dropout,
        )

    # ------------------------------------------------------------------ configuration

    def extra_train_config(self, server_round: int) -> dict[str, Any]:
        """Per-label epsilon, local epochs, and the KT indices unless the samples travel."""
        extra: dict[str, Any] = {
            KT_LABEL_EPSILON: float(self.epsilon_per_label),
            keys.LOCAL_EPOCHS: self.local_epochs,
        }
        if not self.send_kt_data:
            extra[KT_INDICES] = [int(i) for i in self._kt[server_round]]
        return extra

    # ------------------------------------------------------------------ rounds

    def draw_kt_samples(self, server_round: int, arrays: ArrayRecord) -> np.ndarray:
        """K distinct public rows weighted by ``exp(entropy)`` under the current model (Eq. 4).

        Round 1 as well with ``first_draw: entropy`` (the authors' code, under the initial model);
        ``uniform``: round 1 draws uniformly (the paper's Algorithm 1, line 3).
        """
        rng = self.run.randomness.generator("privatekt-kt-sampling", server_round=server_round)
        if server_round <= 1 and self.settings.first_draw == "uniform":
            return np.sort(rng.choice(self.num_public, size=self.k, replace=False))
        model = self.run.model_spec.build()
        load_arrays(model, arrays)
        uncertainty = prediction_entropy(predict_proba(model, self.public_x))
        return draw_weighted(sampling_weights(uncertainty, sign=1.0), self.k, rng=rng)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Draw the round's KT samples, then send Theta_t, the config and the KT data."""
        self._kt[server_round] = self.draw_kt_samples(server_round, arrays)
        messages = list(super().configure_train(server_round, arrays, config, grid))
        if self.send_kt_data and messages:
            samples = np.ascontiguousarray(self.public_x[self._kt[server_round]])
            record = ArrayRecord({KT_SAMPLES_ARRAY: Array(samples)})
            for message in messages:
                message.content[KT_SAMPLES] = record
        return messages

    def parse_report(self, info: ClientInfo, reply: Message) -> np.ndarray | None:
        """The K labels of a reply, or None (logged) when the reply is malformed."""
        try:
            array = reply.content.array_records[KT_LABELS][KT_LABELS_ARRAY]
            return decode_labels(array, k=self.k, num_classes=self.num_classes)
        except (KeyError, ValueError) as error:
            log(WARNING, "PrivateKT: client %d sent a malformed report (%s); ignored", info.client_id, error)
            return None

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Eq. 3, the knowledge buffer, fine-tuning and self-training (Algorithm 1, lines 16-18)."""
        valid, _ = self.replies.split(server_round, replies)
        global_arrays = self.round_global
        self._record_reports(server_round)
        reports = [labels for info, reply in valid if (labels := self.parse_report(info, reply)) is not None]
        stats: dict[str, Any] = {"reports": len(reports), "kt_indices": self._kt[server_round].tolist()}
        self._stats[server_round] = stats
        if not reports:
            log(WARNING, "PrivateKT round %d: no valid reports; the global model is kept", server_round)
            stats["buffer_rounds"] = len(self.buffer)
            return None, MetricRecord({"reports": 0})
        estimate = debias_label_average(
            perturbed_labels=np.stack(reports), keep_probability=self.beta, num_classes=self.num_classes
        )
        rng = self.run.randomness.generator("privatekt-server", server_round=server_round)
        targets = knowledge_targets(estimate, mode=self.settings.knowledge, rng=rng)
        self.buffer.push(self._kt[server_round], targets)
        stats["kt_labels"] = targets.argmax(axis=1).tolist()

        model = self.run.model_spec.build()
        load_arrays(model, global_arrays)
        rows, targets = self.buffer.fetch()
        finetune_loss = fit_targets(
            model,
            self.public_x[rows],
            targets,
            steps=self.settings.server_steps,
            batch_size=None,
            lr=self.run.settings.lr,
            rng=rng,
        )
        self_train_loss = self._self_train(model, rng) if self.self_train > 0 else math.nan
        stats.update(
            buffer_rounds=len(self.buffer),
            finetune_loss=finetune_loss,
            self_train_loss=self_train_loss,
        )
        return model_to_arrays(model), MetricRecord({"reports": len(reports)})

    def _record_reports(self, server_round: int) -> None:
        """One event: every selected client (failures included) sent K perturbed labels."""
        assert self.accountant is not None
        self.accountant.record(
            PrivacyEvent(
                server_round,
                self.mechanism,
                count=self.k,
                participants=tuple(c.client_id for c in self.replies.selected(server_round)),
                label="perturbed KT labels",
            )
        )

    def _self_train(self, model: nn.Module, rng: np.random.Generator) -> float:
        """Eq. 5: fit ``model`` to its own predictions on M public rows drawn with weight ``exp(-entropy)``.

        Returns the self-training loss; the targets are the predicted distributions (``soft``) or
        their argmax (``hard``, ``strategy.self_train_targets``).
        """
        probabilities = predict_proba(model, self.public_x)
        weights = sampling_weights(prediction_entropy(probabilities), sign=-1.0)
        chosen = draw_weighted(weights, self.self_train, rng=rng)
        pseudo = probabilities[chosen]
        if self.settings.self_train_targets == "hard":
            pseudo = np.eye(self.num_classes)[pseudo.argmax(axis=1)]
        batch = self.run.settings.batch_size
        return fit_targets(
            model,
            self.public_x[chosen],
            pseudo,
            steps=math.ceil(self.self_train / batch),
            batch_size=batch,
            lr=self.run.settings.lr,
            rng=rng,
            input_dropout=self.self_train_dropout,
        )

    # ------------------------------------------------------------------ reporting

    def round_extras(self, server_round: int) -> dict[str, Any]:
        """Per-report and per-label epsilon, participation so far, and the round's knowledge.

        The cumulative epsilon (accountant, and its basic-composition bound) is
        in the platform's ``epsilon``/``epsilon_basic`` fields of the same round.
        """
        assert self.accountant is not None
        participated = max((self.accountant.rounds_participated(c) for c in self.run.client_ids), default=0)
        return {
            "epsilon_per_round": self.epsilon_per_round,
            "epsilon_per_label": self.epsilon_per_label,
            "max_participation": participated,
            **self._stats.get(server_round, {}),
        }

    def privacy_summary(self) -> dict[str, Any]:
        """Budget scope, per-label / per-round / cumulative epsilon, beta and the schedule."""
        assert self.accountant is not None
        cumulative = self.accountant.epsilon(delta=self.run.settings.privacy.delta)
        return {
            **super().privacy_summary(),
            "budget_scope": self.budget_scope,
            "epsilon_target": self.run.settings.privacy.epsilon,
            "epsilon_per_label": self.epsilon_per_label,
            "epsilon_per_round": self.epsilon_per_round,
            "epsilon_cumulative": cumulative.epsilon,
            "epsilon_cumulative_method": cumulative.method,
            "epsilon_basic_composition": self.accountant.basic_epsilon(),
            "beta": self.beta,
            "k": self.k,
            "num_classes": self.num_classes,
            "planned_max_participations": self.max_participations,
            "kt_data_sent_as": "samples" if self.send_kt_data else "indices",
            "note": (
                "budgets accumulate over rounds: the document's model-shuffling argument does not apply "
                "(nothing shuffles the reports); epsilon_per_round is one report of K labels, "
                "epsilon_cumulative the worst client over the run"
            ),
        }
