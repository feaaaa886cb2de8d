"""What a strategy reports, as data: each round, the run's privacy and final fields, its randomness.

The platform (:mod:`fl_app.run.server`) reads a round as one :class:`RoundReport`
(:meth:`~strategies.contract.Strategy.report_round`), the end of a run as one :class:`RunReport`
(:meth:`~strategies.contract.Strategy.report_run`: the :class:`PrivacyReport` and the final
fields) and where the privacy randomness comes from as one :class:`Randomness`. Un-noised
statistics go only to :attr:`RoundReport.diagnostics` (written outside the guarantee, never on
devices).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fl_app.privacy.composition import EpsilonReport

#: A value ``results.json`` can hold.
JSON = Any


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
    extras : Mapping[str, JSON]
        The strategy's own per-round fields (all of them functions of released values).
    diagnostics : Mapping[str, JSON]
        Statistics of un-noised client data: written only to the ``outside_guarantee`` block.
    secret_cohort : bool
        Whether the round's cohort is secret (amplification by sampling rests on it): then nothing
        that depends on it (its size, failures, bytes, round time) may be published with the round.
    selected : tuple[int, ...]
        Ids of the clients sent a train message (never published: the platform counts, per client,
        the rounds it was selected for and failed in, to tell a client that never contributed).

    """

    clients: int
    failures: tuple[int, ...]
    failure_reasons: tuple[str, ...]
    epsilon: EpsilonReport | None
    training_epsilon: EpsilonReport | None
    extras: Mapping[str, JSON] = field(default_factory=dict)
    diagnostics: Mapping[str, JSON] = field(default_factory=dict)
    secret_cohort: bool = False
    selected: tuple[int, ...] = ()

    def privacy_fields(self) -> dict[str, float | str | None]:
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


#: What no epsilon of a run covers (``privacy.total.not_covered``).
NOT_COVERED = (
    "each client's number of examples (treated as public: the roster reports it)",
    "the outside_guarantee block of results.json, when privacy.diagnostics=true (simulation only)",
)
#: What no epsilon covers in addition when the cohorts are secret (amplification by sampling).
SECRET_COHORT_NOT_COVERED = (
    "the run's total wall time (final.wall_s, the last line of run.log) and whether any sampled client "
    "failed (status completed_with_failures): both depend on the secret cohorts; nothing per round does "
    "(each round's cohort size, failures, bytes and duration are written only to outside_guarantee; "
    "run.log's lines carry no clock time after the header, TensorBoard's events one wall time, the "
    "run's files one modification time, set when the run ends, and none of them is created while the "
    "rounds run)",
    "the output folder's files while the run writes them: a reader watching them during the run sees "
    "when each round ends (publish them after the run)",
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
    per_stage : Mapping[str, float | None]
        Each stage's own epsilon (training, an evaluation stage).
    covers : tuple[str, ...]
        What the epsilon covers.
    not_covered : tuple[str, ...]
        What no epsilon of the run covers.
    holds_for : str | None
        When the epsilon is not this run's but a deployment's it simulates (a larger cohort's noise:
        ``strategy.noise_cohort_size``), the sentence that says so; None: the epsilon is this run's.

    """

    epsilon: float | None
    delta: float
    method: str | None
    unit: str
    per_stage: Mapping[str, float | None]
    covers: tuple[str, ...]
    not_covered: tuple[str, ...] = NOT_COVERED
    holds_for: str | None = None

    def as_dict(self) -> dict[str, JSON]:
        """The results' ``privacy.total`` object (``holds_for`` only when the epsilon is a deployment's)."""
        total = {
            "epsilon": self.epsilon,
            "delta": self.delta,
            "method": self.method,
            "unit": self.unit,
            "worst_client": "the reported epsilon is the largest over the clients",
            "per_stage": dict(self.per_stage),
            "covers": list(self.covers),
            "not_covered": list(self.not_covered),
        }
        if self.holds_for is not None:
            total["holds_for"] = self.holds_for
        return total


SEEDED_NOTE = (
    "seeded simulation: the client sampling and every noise draw (server and clients) are reproducible "
    "from the published configuration (config.yaml), so anyone holding it can regenerate and subtract "
    "the noise; the epsilon describes a deployment in which they are secret (privacy.secure_rng=true, "
    "always on real devices)"
)
SECURE_NOTE = (
    "OS entropy: every privacy noise draw (server and clients) and every secret client sample come "
    "from the operating system's CSPRNG; nothing published predicts them and the run is not reproducible"
)


@dataclass(frozen=True)
class Randomness:
    """Where a run's privacy noise and cohorts come from (the results' ``privacy.randomness``).

    Attributes
    ----------
    secure : bool
        OS entropy (True) or a seed reproducible from the published configuration.
    noise_seed : int | None
        The seed of the privacy noise (None with OS entropy).
    noise_seed_origin : str | None
        Where that seed comes from.
    devices : bool
        Whether the clients are real devices.
    cohort : str
        How the strategy draws its cohorts (public or secret).
    secret_cohort : bool
        Whether the accounting relies on the cohorts being secret (amplification by sampling): then
        nothing that depends on them is published (:class:`RoundReport`).

    """

    secure: bool
    noise_seed: int | None
    noise_seed_origin: str | None
    devices: bool
    cohort: str
    secret_cohort: bool = False

    def as_dict(self) -> dict[str, JSON]:
        """The results' ``privacy.randomness`` object."""
        return {
            "source": "os_entropy" if self.secure else "seeded",
            "noise_seed": None if self.secure else self.noise_seed,
            "noise_seed_origin": self.noise_seed_origin,
            "devices": self.devices,
            "cohort": self.cohort,
            "note": SECURE_NOTE if self.secure else SEEDED_NOTE,
        }

    def describe(self) -> str:
        """One short line for the run's header; the full note and the seed's origin are in :meth:`as_dict`."""
        if not self.secure:
            return (
                f"privacy randomness SEEDED (noise seed {self.noise_seed}): config.yaml reproduces the noise "
                "and cohorts; the epsilon holds where they are secret (privacy.secure_rng=true)"
            )
        return "privacy randomness from OS entropy (privacy.secure_rng=true): noise and cohorts unpredictable"


@dataclass(frozen=True)
class PrivacyReport:
    """A run's privacy, read once at its end and written as the results' ``privacy`` object.

    Attributes
    ----------
    summary : Mapping[str, JSON]
        The strategy's own account: unit, mechanism, accountant and the algorithm's parameters.
    randomness : Randomness
        Where the privacy noise and the cohorts came from.
    total : PrivacyTotal
        The epsilon the run promises, by stage.
    empirical_epsilon : Mapping[str, JSON] | None
        The canary estimate beside it (None: not measured for this run).

    """

    summary: Mapping[str, JSON]
    randomness: Randomness
    total: PrivacyTotal
    empirical_epsilon: Mapping[str, JSON] | None = None

    def as_dict(self) -> dict[str, JSON]:
        """The results' ``privacy`` object (the strategy's summary first, then the platform's fields)."""
        privacy = {**self.summary, "randomness": self.randomness.as_dict(), "total": self.total.as_dict()}
        if self.empirical_epsilon is not None:
            privacy["empirical_epsilon"] = dict(self.empirical_epsilon)
        return privacy


@dataclass(frozen=True)
class RunReport:
    """What a strategy reports at the end of a run: its privacy and its own fields of ``final``."""

    privacy: PrivacyReport
    final: Mapping[str, JSON] = field(default_factory=dict)
