"""What a strategy reports: its epsilon by stage, ledgers, per-round and final fields, its summary.

:class:`ReportingHooks` is mixed into :class:`strategies.base.FederatedStrategy`; a strategy
overrides the hooks where it has more to say. The platform (:mod:`fl_app.run`) reads a round as
one typed :class:`RoundReport` (:func:`round_report`) and the end of the run's privacy as one
typed :class:`PrivacyReport` (:func:`privacy_report`). Un-noised statistics go only to
:meth:`~ReportingHooks.diagnostics` (written outside the guarantee, never on devices).
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import INFO
from typing import Any, ClassVar, Protocol

from flwr.app import ArrayRecord
from flwr.common import log
from omegaconf import DictConfig

from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.composition import EpsilonReport
from fl_app.run_context import RunContext


@dataclass(frozen=True)
class RoundReport:
    """What a strategy reports about one completed round, read once by the platform after it.

    Attributes
    ----------
    clients : int
        Clients sent a train message.
    failures : tuple[int, ...]
        Ids of the clients whose train reply failed or did not come.
    failure_reasons : tuple[str, ...]
        The error reasons of the failed replies (the round's health check reads them).
    epsilon : EpsilonReport | None
        The worst client's cumulative epsilon over everything released so far (None: not private).
    training_epsilon : EpsilonReport | None
        The training stage's alone.
    extras : dict[str, Any]
        The strategy's own per-round fields (all of them functions of released values).
    diagnostics : dict[str, Any]
        Statistics of un-noised client data: written only to the ``outside_guarantee`` block.
    secret_cohort : bool
        Whether the round's cohort is secret (amplification by sampling rests on it): then nothing
        that depends on it (its size, failures, bytes, round time) may be published with the round.

    """

    clients: int
    failures: tuple[int, ...]
    failure_reasons: tuple[str, ...]
    epsilon: EpsilonReport | None
    training_epsilon: EpsilonReport | None
    extras: dict[str, Any]
    diagnostics: dict[str, Any]
    secret_cohort: bool = False

    def privacy_fields(self) -> dict[str, Any]:
        """The round's epsilon fields of ``results.json`` (``None`` throughout when not private)."""
        total, training = self.epsilon, self.training_epsilon
        return {
            "epsilon": None if total is None else total.epsilon,
            "epsilon_method": None if total is None else total.method,
            "epsilon_rdp": None if total is None else total.rdp,
            "epsilon_pld": None if total is None else total.pld,
            "epsilon_basic": None if total is None else total.basic,
            "epsilon_training": None if training is None else training.epsilon,
        }


class ReportsRounds(Protocol):
    """The hooks a round report is read from (a strategy, or an evaluation stage wrapping one)."""

    secret_cohort: bool

    def selected(self, server_round: int) -> list[Any]: ...  # noqa: D102
    def round_failures(self, server_round: int) -> list[int]: ...  # noqa: D102
    def round_failure_reasons(self, server_round: int) -> list[str]: ...  # noqa: D102
    def epsilon(self) -> EpsilonReport | None: ...  # noqa: D102
    def training_epsilon(self) -> EpsilonReport | None: ...  # noqa: D102
    def round_extras(self, server_round: int) -> dict[str, Any]: ...  # noqa: D102
    def diagnostics(self, server_round: int) -> dict[str, Any]: ...  # noqa: D102


def round_report(strategy: ReportsRounds, server_round: int) -> RoundReport:
    """Read ``strategy``'s report of ``server_round`` (after its ``aggregate_train``)."""
    return RoundReport(
        clients=len(strategy.selected(server_round)),
        failures=tuple(strategy.round_failures(server_round)),
        failure_reasons=tuple(strategy.round_failure_reasons(server_round)),
        epsilon=strategy.epsilon(),
        training_epsilon=strategy.training_epsilon(),
        extras=dict(strategy.round_extras(server_round)),
        diagnostics=dict(strategy.diagnostics(server_round)),
        secret_cohort=bool(strategy.secret_cohort),
    )


#: What no epsilon of a run covers (``privacy.total.not_covered``).
NOT_COVERED = (
    "each client's number of examples (treated as public: the roster reports it)",
    "the outside_guarantee block of results.json, when privacy.diagnostics=true (simulation only)",
)
#: What no epsilon covers in addition when the cohorts are secret (amplification by sampling).
SECRET_COHORT_NOT_COVERED = (
    "the run's total wall time (final.wall_s, the last line of run.log) and whether any sampled client "
    "failed (status completed_with_failures): both depend on the secret cohorts; nothing per round does "
    "(each round's cohort size, failures, bytes and duration are written only to outside_guarantee)",
)


@dataclass(frozen=True)
class PrivacyTotal:
    """One epsilon per client covering everything a run released, and its parts by stage.

    Attributes
    ----------
    epsilon : float | None
        The worst client's cumulative epsilon (None: not private).
    delta : float
        The delta it holds at.
    method : str | None
        Which bound gave it (``rdp``, ``pld``, ``basic``).
    unit : str
        What one epsilon protects (record, client, report).
    per_stage : dict[str, float | None]
        Each stage's own epsilon (training, an evaluation stage).
    covers : tuple[str, ...]
        What the epsilon covers.

    """

    epsilon: float | None
    delta: float
    method: str | None
    unit: str
    per_stage: dict[str, float | None]
    covers: tuple[str, ...]
    not_covered: tuple[str, ...] = NOT_COVERED

    def as_dict(self) -> dict[str, Any]:
        """The results' ``privacy.total`` object."""
        return {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "method": self.method,
            "unit": self.unit,
            "worst_client": "the reported epsilon is the largest over the clients",
            "per_stage": dict(self.per_stage),
            "covers": list(self.covers),
            "not_covered": list(self.not_covered),
        }


@dataclass(frozen=True)
class PrivacyReport:
    """A run's privacy, read once at its end and written as the results' ``privacy`` object.

    Attributes
    ----------
    summary : dict[str, Any]
        The strategy's own account: unit, mechanism, accountant and the algorithm's parameters
        (:meth:`ReportingHooks.privacy_summary`).
    randomness : dict[str, Any]
        Where the privacy noise and the cohorts came from (seeded or OS entropy).
    total : PrivacyTotal
        The epsilon the run promises, by stage.
    empirical_epsilon : dict[str, Any] | None
        The canary estimate beside it (None: not measured for this run).

    """

    summary: dict[str, Any]
    randomness: dict[str, Any]
    total: PrivacyTotal
    empirical_epsilon: dict[str, Any] | None

    def as_dict(self) -> dict[str, Any]:
        """The results' ``privacy`` object (the strategy's summary first, then the platform's fields)."""
        privacy = {**self.summary, "randomness": self.randomness, "total": self.total.as_dict()}
        if self.empirical_epsilon is not None:
            privacy["empirical_epsilon"] = self.empirical_epsilon
        return privacy


class ReportsPrivacy(Protocol):
    """The hooks a privacy report is read from (a strategy, or an evaluation stage wrapping one)."""

    run: RunContext
    privacy_unit: str
    secret_cohort: bool

    def epsilon(self) -> EpsilonReport | None: ...  # noqa: D102
    def stage_epsilons(self) -> dict[str, float | None]: ...  # noqa: D102
    def released_stages(self) -> list[str]: ...  # noqa: D102
    def privacy_summary(self) -> dict[str, Any]: ...  # noqa: D102
    def empirical_privacy(self, final: ArrayRecord) -> dict[str, Any] | None: ...  # noqa: D102


def privacy_total(strategy: ReportsPrivacy) -> PrivacyTotal:
    """``strategy``'s epsilon over everything released so far, by stage."""
    total = strategy.epsilon()
    return PrivacyTotal(
        epsilon=None if total is None else total.epsilon,
        delta=strategy.run.delta,
        method=None if total is None else total.method,
        unit=strategy.privacy_unit,
        per_stage=dict(strategy.stage_epsilons()),
        covers=tuple(strategy.released_stages()),
        not_covered=NOT_COVERED + (SECRET_COHORT_NOT_COVERED if strategy.secret_cohort else ()),
    )


def privacy_report(
    strategy: ReportsPrivacy, *, randomness: dict[str, Any], final: ArrayRecord
) -> PrivacyReport:
    """Read ``strategy``'s privacy at the end of a run whose released model is ``final``."""
    return PrivacyReport(
        summary=dict(strategy.privacy_summary()),
        randomness=randomness,
        total=privacy_total(strategy),
        empirical_epsilon=strategy.empirical_privacy(final),
    )


class ReportingHooks:
    """Reporting for a strategy (see the module docstring)."""

    run: RunContext
    cfg: DictConfig
    accountant: PrivacyAccountant | None
    privacy_unit: ClassVar[str]
    mechanism_name: ClassVar[str]
    secret_cohort: bool

    @classmethod
    def is_private(cls, cfg: DictConfig) -> bool:
        """Whether a run of this strategy with ``cfg`` claims a finite epsilon (override if configurable)."""
        return cls.privacy_unit != "none"

    def cohort_text(self) -> str:
        """How many clients a round selects, for :meth:`summary`."""
        if self.secret_cohort:
            return (
                f"secret Poisson cohorts of {self.run.clients_per_round} of {self.run.num_clients} clients "
                "per round in expectation (their sizes are not published)"
            )
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
