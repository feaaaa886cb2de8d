"""The text vocabulary around any training strategy: a DP release charged, an assumption stated.

Validation decides where a text run's vocabulary comes from and records it in the data spec
(:mod:`fl_app.config.data_choices`, :class:`~fl_app.data.text_vocabulary.VocabularyChoice`); the
platform (:func:`fl_app.run.server.evaluation_stage`) then wraps the training strategy in
:class:`VocabularyStage`, with :class:`strategies.stage.EvaluationStage`'s forwarding of the strategy
contract, as an evaluation stage is wrapped. The stage:

* for a DP vocabulary (:mod:`fl_app.privacy.partition_selection`), gives the training the rest of the
  budget (:meth:`VocabularyStage.training_settings`: ``privacy.epsilon`` and ``privacy.delta`` less
  the release's share), records the release's Gaussian part as one event of round 0 naming every
  client (``privacy_ledger_vocabulary.json``) and reports the run's total per client
  (:func:`~fl_app.privacy.partition_selection.total_with_selection`): the smaller of the training's
  epsilon plus the release's alone (basic composition) and the accountant's joint composition of the
  release's event with the training's ledger, both with the threshold's delta and epsilon shift;
  the platform reads the run's whole budget from :attr:`VocabularyStage.run`;
* for a word file declared public, names the assumption in the header, ``privacy.vocabulary``,
  ``privacy.total.not_covered`` (and so the report's table heading); for a vocabulary public by
  construction (characters, a generated corpus), says so; for a run that is not private, says how
  the words were chosen.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from logging import INFO
from typing import Any

from flwr.app import ArrayRecord
from flwr.common import log

from fl_app.config.checks import ConfigError
from fl_app.config.settings import RunSettings
from fl_app.data.examples import TEXT_DATASETS
from fl_app.data.text_vocabulary import VocabularyChoice, choice_of
from fl_app.privacy.accountant import LEDGER_FILE, PrivacyAccountant
from fl_app.privacy.composition import EpsilonReport
from fl_app.privacy.events import PrivacyEvent
from fl_app.privacy.partition_selection import REFERENCES, SelectionBudget, total_with_selection
from fl_app.run.context import RunContext
from strategies import STRATEGIES
from strategies.contract import JSON, Strategy
from strategies.reporting import RoundReport, RunReport
from strategies.stage import EvaluationStage

#: The DP vocabulary's ledger (the run's output folder).
VOCABULARY_LEDGER_FILE = "privacy_ledger_vocabulary.json"
#: The event's label.
EVENT_LABEL = "vocabulary: DP partition selection, Gaussian part (every user's bounded word counts)"


def stage_for(settings: RunSettings) -> type[VocabularyStage] | None:
    """The stage of a run whose vocabulary validation decided (a text run); None for other data sets.

    Raises :class:`~fl_app.config.checks.ConfigError` for a private text run whose settings did not
    pass validation's data checks (its vocabulary was never decided: it would be counted un-noised).
    """
    if choice_of(settings.data.dataset) is not None:
        return VocabularyStage
    if settings.data.dataset["name"] not in TEXT_DATASETS:
        return None
    if STRATEGIES.get(settings.strategy).declaration.is_private(settings):
        raise ConfigError(
            "dataset.vocabulary_choice",
            None,
            "a private text run's vocabulary is decided by validation (fl_app.config.validation."
            "validate_config with its data checks), which these settings did not pass",
        )
    return None


def release_budget(settings: RunSettings) -> SelectionBudget | None:
    """The DP vocabulary's share of the budget (None: the vocabulary is not a DP release)."""
    choice = choice_of(settings.data.dataset)
    if choice is None or choice.origin != "dp" or choice.budget is None:
        return None
    return SelectionBudget.from_json(choice.budget)


def whole_budget(training: RunContext, budget: SelectionBudget) -> RunContext:
    """The training's context with the run's whole budget: its share and the release's added back.

    Rounded to 12 significant digits: the configured values, which the split into shares changed in
    their last bits.
    """
    privacy = training.settings.privacy
    settings = training.settings.with_values(
        {
            "privacy.epsilon": float(f"{privacy.epsilon + budget.epsilon:.12g}"),
            "privacy.delta": float(f"{privacy.delta + budget.delta:.12g}"),
        }
    )
    return dataclasses.replace(training, settings=settings)


class VocabularyStage(EvaluationStage):
    """Wraps a built training strategy of a text run (see the module docstring)."""

    def __init__(self, strategy: Strategy) -> None:
        super().__init__(strategy)
        settings = strategy.run.settings
        choice = choice_of(settings.data.dataset)
        assert choice is not None, "a text run's vocabulary is decided by validation"
        self.choice: VocabularyChoice = choice
        self.budget = release_budget(settings)
        self.method = settings.privacy.accountant
        self.private = strategy.declaration.is_private(settings)
        self._run = strategy.run if self.budget is None else whole_budget(strategy.run, self.budget)
        self.delta = self._run.settings.privacy.delta
        self.ledger: PrivacyAccountant | None = None
        self._training: PrivacyAccountant | None = None  # the training's ledger, replayed
        self._joint: PrivacyAccountant | None = None  # the release's event and the training's
        self._replayed = 0
        self._last: EpsilonReport | None = None  # the training's epsilon after the last round
        if self.budget is not None and self.private:
            self.ledger = PrivacyAccountant(
                population=strategy.run.client_ids, unit=strategy.declaration.unit, method=self.method
            )
            self.ledger.record(self.release_event())

    @classmethod
    def training_settings(cls, settings: RunSettings) -> RunSettings:
        """A DP vocabulary's run: the training gets ``privacy.epsilon`` and ``.delta`` less its share."""
        budget = release_budget(settings)
        if budget is None:
            return settings
        privacy = settings.privacy
        return settings.with_values(
            {
                "privacy.epsilon": privacy.epsilon - budget.epsilon,
                "privacy.delta": privacy.delta - budget.delta,
            }
        )

    @property
    def run(self) -> RunContext:
        """The run as the platform reads it: the training's context with the whole budget in its settings."""
        return self._run

    def release_event(self) -> PrivacyEvent:
        """The release's Gaussian part: one use by every client, before the first round."""
        assert self.budget is not None
        return PrivacyEvent(0, self.budget.selection.mechanism, count=1, participants=None, label=EVENT_LABEL)

    @property
    def summand(self) -> Callable[[int], Any] | None:
        """The training's per-client sum when its rounds may be packed (the stage reads no reply)."""
        from fl_app.run.round_loop import packing_refusal

        return None if packing_refusal(self.inner) is not None else self.inner.summand  # type: ignore[attr-defined]

    def describe(self) -> None:
        """The training strategy's header, then the vocabulary's line."""
        self.inner.describe()
        log(INFO, "\t└──> vocabulary: %s", self.header_text())

    def header_text(self) -> str:
        """The vocabulary's header line (after ``vocabulary: ``)."""
        text = self.choice.text()
        if self.budget is not None and self.ledger is not None:
            training, charged = self.inner.run.settings.privacy, self.budget.own_epsilon(self.method)
            text += (
                f"; charged epsilon {charged:.4g} delta {self.budget.delta:.3g} of "
                f"the budget, composed with the training's (its budget: epsilon {training.epsilon:.4g} delta "
                f"{training.delta:.3g})"
            )
        assumption = self.choice.assumption() if self.private else None
        return text if assumption is None else f"{text}; ASSUMED: {assumption}"

    # ------------------------------------------------------------------ the run's epsilon

    def total_epsilon(self, training: EpsilonReport | None) -> EpsilonReport | None:
        """The run's epsilon per client: the training's and the release's (None: not private)."""
        if training is None or self.budget is None or self.ledger is None:
            return training
        return total_with_selection(
            training=training,
            budget=self.budget,
            joint=self.joint(training),
            delta=self.delta,
            method=self.method,
        )

    def joint(self, training: EpsilonReport) -> EpsilonReport | None:
        """The release's event and the training's ledger composed by the accountant.

        At the run's delta less the threshold's; None when the training's ledger is not what its
        epsilon comes from (a strategy that computes it otherwise).
        """
        assert self.budget is not None
        state = self.inner.ledgers().get(LEDGER_FILE)
        if state is None:
            return None
        if self._training is None or self._joint is None:
            self._training = PrivacyAccountant(
                population=state["population"], unit=state["unit"], method=self.method
            )
            self._joint = PrivacyAccountant(
                population=state["population"], unit=state["unit"], method=self.method
            )
            self._joint.record(self.release_event())
        events = state["events"]
        for data in events[self._replayed :]:
            event = PrivacyEvent.from_dict(data)
            self._training.record(event)
            self._joint.record(event)
        self._replayed = len(events)
        if self._training.epsilon(delta=training.delta).epsilon != training.epsilon:
            return None
        return self._joint.epsilon(delta=self.delta - self.budget.delta_threshold)

    def report_round(self, server_round: int) -> RoundReport:
        """The training's round, its epsilon the run's total (the release's included)."""
        inner = self.inner.report_round(server_round)
        if self.ledger is None:
            return inner
        self._last = inner.epsilon
        return dataclasses.replace(inner, epsilon=self.total_epsilon(inner.epsilon))

    def report_run(self, final: ArrayRecord) -> RunReport:
        """The training's report with the vocabulary: its summary, stage, coverage or assumption."""
        inner = self.inner.report_run(final)
        privacy, total = inner.privacy, inner.privacy.total
        covers, not_covered = tuple(total.covers), tuple(total.not_covered)
        per_stage, epsilon, method = dict(total.per_stage), total.epsilon, total.method
        if self.ledger is not None and self.budget is not None and epsilon is not None:
            training = self._last or EpsilonReport(epsilon, total.delta, str(method), None, None, None, None)
            run_total = self.total_epsilon(training)
            assert run_total is not None
            epsilon, method = run_total.epsilon, run_total.method
            per_stage["vocabulary"] = self.budget.own_epsilon(self.method)
            covers += (f"the vocabulary: {self.choice.text()}",)
        elif self.private and self.choice.origin in ("characters", "generated"):
            covers += (f"the vocabulary: {self.choice.text()}",)
        assumption = self.choice.assumption() if self.private else None
        if assumption is not None:
            not_covered += (f"ASSUMED: {assumption}",)
        report = dataclasses.replace(
            privacy,
            summary={**privacy.summary, "vocabulary": self.summary()},
            total=dataclasses.replace(
                total,
                epsilon=epsilon,
                delta=self.delta if self.ledger is not None else total.delta,
                method=method,
                per_stage=per_stage,
                covers=covers,
                not_covered=not_covered,
            ),
        )
        return RunReport(privacy=report, final=inner.final)

    def summary(self) -> dict[str, JSON]:
        """``privacy.vocabulary`` of the results."""
        summary: dict[str, JSON] = {
            "origin": self.choice.origin,
            "text": self.choice.text(),
            "words": self.choice.words,
            "file": self.choice.file,
            "assumption": self.choice.assumption() if self.private else None,
        }
        if self.budget is None:
            return summary
        selection = self.budget.selection
        return summary | {
            "release": self.choice.release,
            "mechanism": (
                "DP partition selection: each training user's words_per_user most used words counted once "
                "(L2 sensitivity sqrt(words_per_user)), Gaussian noise of std noise_multiplier x "
                "sqrt(words_per_user) on each word's count of users, the words above threshold released, "
                "the largest noisy counts first"
            ),
            "references": REFERENCES,
            **self.budget.to_json(),
            "noise_std": selection.noise_std,
            "threshold_delta": selection.threshold_delta(),
            "epsilon_shift": selection.epsilon_shift(),
            "epsilon_charged": self.budget.own_epsilon(self.method) if self.ledger is not None else None,
            "ledger": VOCABULARY_LEDGER_FILE if self.ledger is not None else None,
            "accountant": (
                "the Gaussian part is one event of round 0 naming every client, composed with the training's "
                "events by the run's accountant at the run's delta less delta_threshold; the threshold adds "
                "delta_threshold to delta and epsilon_shift to epsilon; the smaller of that and the "
                "training's epsilon plus epsilon_charged (basic composition) is the run's total"
            ),
        }

    def ledgers(self) -> dict[str, dict[str, JSON]]:
        """The training strategy's ledgers plus the vocabulary's (a DP release in a private run)."""
        ledgers = self.inner.ledgers()
        if self.ledger is not None:
            ledgers[VOCABULARY_LEDGER_FILE] = self.ledger.state_dict()
        return ledgers
