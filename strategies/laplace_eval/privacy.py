"""The clustering evaluation's Laplace reports: their calibration, their two ledgers, the total.

MindSpore Federated documentation, "Horizontal Federated-Local Differential Privacy Inference
Result Protection": each evaluated device uploads the softmax vector of every local example with
i.i.d. Laplace noise ``Lap(b)`` per coordinate, ``b = sensitivity / eps``. Two probability vectors
differ by up to 2 in L1 (:data:`PROBABILITY_VECTOR_L1_SENSITIVITY`;
the document's 1 understates it), so a report is ``2 / b``-DP whatever sensitivity was configured,
and that is what is charged (``docs/algorithms/laplace_eval.md``).

Two units, two accountants (:class:`EvaluationLedger`):

* one local example's inference result (replace one example): one ``Laplace(2 / b)`` event per
  evaluation round naming every sampled client (different examples give disjoint reports);
* the training strategy's unit (a client's whole data set): an evaluated client's data set decides
  all ``n_c`` of its vectors, so each evaluation charges it ``n_c`` uses. :meth:`EvaluationLedger.total`
  composes these with the training's epsilon into the run's epsilon per client
  (:func:`~fl_app.privacy.composition.sequential_stages`: the smaller of the joint composition and
  training plus the evaluation's basic epsilon).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fl_app.privacy.accountant import PrivacyAccountant, combined_epsilon
from fl_app.privacy.checks import require_positive, require_positive_int, require_probability
from fl_app.privacy.composition import EpsilonReport, sequential_stages
from fl_app.privacy.events import (
    Laplace,
    PrivacyEvent,
)

# --------------------------------------------------------------------------------------
# Laplace (MindSpore Federated inference-result protection)
# --------------------------------------------------------------------------------------


def laplace_scale(*, sensitivity: float, epsilon: float) -> float:
    """Laplace scale ``b = sensitivity / epsilon``."""
    require_positive("sensitivity", sensitivity)
    require_positive("epsilon", epsilon)
    return sensitivity / epsilon


def laplace_epsilon_for_tail(*, tau: float, probability: float, sensitivity: float) -> float:
    """Epsilon whose Laplace noise stays below ``tau`` in magnitude with ``probability``.

    ``P(|X| <= tau) = 1 - exp(-tau / b) = p`` gives ``b = tau / ln(1 / (1 - p))``
    and ``epsilon = sensitivity / b``. The MindSpore document's example
    (tau = 1e-5, p = 0.9, sensitivity 1) gives ``ln(10) / 1e-5 ~ 2.3e5``; the
    correct sensitivity of probability vectors, 2, doubles it.
    """
    require_positive("tau", tau)
    require_probability("probability", probability)
    require_positive("sensitivity", sensitivity)
    return sensitivity * math.log(1.0 / (1.0 - probability)) / tau


#: L1 sensitivity of a probability vector (e.g. one softmax output) when its input is replaced:
#: ``||p - q||_1 <= ||p||_1 + ||q||_1 = 2``, attained by ``(1, 0, ...)`` and ``(0, 1, ...)``.
#: The MindSpore document states 1.
PROBABILITY_VECTOR_L1_SENSITIVITY = 2.0


def laplace_epsilon_for_scale(*, scale: float, sensitivity: float) -> float:
    """Epsilon that Laplace noise of scale ``b`` gives a query of L1 ``sensitivity``: ``sensitivity / b``.

    Used to report the guarantee noise actually delivers when it was calibrated
    with another sensitivity: noise calibrated as ``Laplace(1 / epsilon)`` (the
    document's sensitivity 1) on probability vectors (true sensitivity 2) gives
    ``2 * epsilon``, not ``epsilon``.
    """
    require_positive("scale", scale)
    require_positive("sensitivity", sensitivity)
    return sensitivity / scale


def laplace_epsilon_per_report(*, budget: float, reports: int) -> float:
    """Per-report Laplace epsilon whose ``reports`` uses by one client stay within ``budget``.

    Basic (sequential) composition of pure Laplace releases (Dwork & Roth 2014,
    Theorem 3.16): ``reports * epsilon <= budget``, an (epsilon, 0) bound, so
    adding it to any (epsilon_train, delta) training guarantee keeps delta.
    For the clustering evaluation (MindSpore's inference-result protection)
    ``reports`` is the largest number of softmax vectors one client may upload
    over the run: its number of examples times the evaluation rounds, because
    one client's data set determines all of its vectors (client-level unit).

    Parameters
    ----------
    budget : float
        The evaluation's share of the per-client epsilon (> 0).
    reports : int
        Laplace releases charged to the worst client (>= 1).

    Returns
    -------
    float
        ``budget / reports``.

    """
    require_positive("budget", budget)
    require_positive_int("reports", reports)
    return budget / reports


EVALUATION_UNIT = (
    "one local example's inference result (its softmax vector; replace one example), local DP "
    "against the server; the number of a client's examples is disclosed by the array shape"
)


@dataclass(frozen=True)
class LaplaceReportPlan:
    """The noise of every report: what clients are sent, its scale, and the epsilon it really gives.

    Attributes
    ----------
    configured_epsilon : float
        ``evaluation.laplace_eval_eps`` sent to clients (they use ``b = sensitivity / eps``).
    sensitivity : float
        The configured L1 sensitivity.
    scale : float
        ``b``.
    epsilon_per_report : float
        ``2 / b``: the epsilon one report really has (what is charged).
    source : str
        Where ``configured_epsilon`` came from.
    budget : float or None
        The evaluation's share of the per-client epsilon when calibrated (None: set by hand).

    """

    configured_epsilon: float
    sensitivity: float
    scale: float
    epsilon_per_report: float
    source: str
    budget: float | None = None

    @classmethod
    def for_settings(
        cls,
        *,
        laplace: bool,
        epsilon: float | None,
        budget: float,
        largest_client: int,
        rounds: int,
        sensitivity: float,
    ) -> LaplaceReportPlan | None:
        """The plan of ``evaluation.*``: None for clear reports, ``epsilon`` if set, else calibrated."""
        if not laplace:
            return None
        if epsilon is not None:
            return cls.given(
                epsilon=epsilon, sensitivity=sensitivity, source="evaluation.laplace_eval_eps (set by hand)"
            )
        return cls.calibrated(
            budget=budget, largest_client=largest_client, rounds=rounds, sensitivity=sensitivity
        )

    @classmethod
    def given(
        cls, *, epsilon: float, sensitivity: float, source: str, budget: float | None = None
    ) -> LaplaceReportPlan:
        """The plan for a per-report epsilon sent as is."""
        scale = laplace_scale(sensitivity=sensitivity, epsilon=epsilon)
        true = laplace_epsilon_for_scale(scale=scale, sensitivity=PROBABILITY_VECTOR_L1_SENSITIVITY)
        return cls(epsilon, sensitivity, scale, true, source, budget)

    @classmethod
    def calibrated(
        cls, *, budget: float, largest_client: int, rounds: int, sensitivity: float
    ) -> LaplaceReportPlan:
        """Per-report epsilon: the largest client's reports over ``rounds`` evaluations cost ``budget``.

        Basic composition over ``largest_client x rounds`` reports, at the true sensitivity 2. Clients
        divide by the configured ``sensitivity``, so they are sent the epsilon giving scale ``2 / eps``.
        """
        true = laplace_epsilon_per_report(budget=budget, reports=largest_client * rounds)
        source = (
            f"calibrated: budget {budget:.6g} (evaluation.budget_fraction of the per-client epsilon) over "
            f"{largest_client} reports x {rounds} evaluation rounds, basic composition"
        )
        return cls.given(
            epsilon=true * sensitivity / PROBABILITY_VECTOR_L1_SENSITIVITY,
            sensitivity=sensitivity,
            source=source,
            budget=budget,
        )

    def planned_epsilon(self, *, largest_client: int, rounds: int) -> float:
        """The client-level epsilon the largest client's reports reach over ``rounds`` evaluations.

        Basic composition of its ``largest_client`` reports per evaluation at :attr:`epsilon_per_report`
        (the bound :meth:`calibrated` spends): the evaluation's cost beside the training's.
        """
        return self.epsilon_per_report * largest_client * rounds

    def fixed_text(self, *, largest_client: int, rounds: int, epsilon: float) -> str | None:
        """For a per-report epsilon set by hand, the header's words on what it fixes (None: calibrated)."""
        if self.budget is not None:
            return None
        reached = self.planned_epsilon(largest_client=largest_client, rounds=rounds)
        return (
            f"noise fixed by evaluation.laplace_eval_eps={self.configured_epsilon:g}, not calibrated to "
            f"privacy.epsilon={epsilon:g}: the {rounds} planned evaluations reach epsilon={reached:.4g} "
            f"(the largest client's {largest_client} reports each, basic composition), on top of the "
            "training's"
        )

    def understated(self) -> str | None:
        """What the noise gives when the configured sensitivity is below the true one, else None."""
        if self.sensitivity >= PROBABILITY_VECTOR_L1_SENSITIVITY:
            return None
        return (
            f"evaluation.sensitivity={self.sensitivity:g} is below the L1 sensitivity of probability "
            f"vectors ({PROBABILITY_VECTOR_L1_SENSITIVITY:g}): the noise scale {self.scale:.3g} gives "
            f"epsilon {self.epsilon_per_report:.6g} per report, not the configured "
            f"{self.configured_epsilon:.6g}; the results report {self.epsilon_per_report:.6g}"
        )

    @staticmethod
    def clear_json(sensitivity: float) -> dict[str, Any]:
        """:meth:`to_json` when the vectors are sent in the clear (no plan)."""
        return {
            "mechanism": "none: softmax vectors uploaded in the clear (no finite epsilon)",
            "sensitivity_configured": sensitivity,
            "sensitivity_true": PROBABILITY_VECTOR_L1_SENSITIVITY,
            "laplace_eval_eps": None,
            "epsilon_source": "none (clear reports)",
            "budget": None,
            "scale": None,
        }

    def to_json(self) -> dict[str, Any]:
        """The plan's part of ``privacy.evaluation``."""
        return {
            "mechanism": "Laplace noise of scale b on every coordinate of each softmax vector, on the device",
            "sensitivity_configured": self.sensitivity,
            "sensitivity_true": PROBABILITY_VECTOR_L1_SENSITIVITY,
            "laplace_eval_eps": self.configured_epsilon,
            "epsilon_source": self.source,
            "budget": self.budget,
            "scale": self.scale,
        }


class EvaluationLedger:
    """The evaluation's per-example and client-level accountants, and the run's total per client.

    Parameters
    ----------
    population : Sequence[int]
        Every client's id.
    training_unit : str
        The training strategy's privacy unit (the client-level ledger's).
    epsilon_per_report : float or None
        What one report costs (None: clear reports, no finite epsilon).
    delta : float
        The delta every epsilon is reported at.

    """

    def __init__(
        self,
        *,
        population: Sequence[int],
        training_unit: str,
        epsilon_per_report: float | None,
        delta: float,
        method: str = "pld",
    ) -> None:
        self.epsilon_per_report = epsilon_per_report
        self.delta = delta
        #: The run's ``privacy.accountant`` (a PLD is only built where it is small: large epsilons of
        #: many Laplace reports are bounded by RDP and basic composition, see ``PLD_MAX_EPSILON``).
        self.method = method
        self.example_accountant = PrivacyAccountant(
            population=population, unit=EVALUATION_UNIT, method=method
        )
        self.client_accountant = PrivacyAccountant(population=population, unit=training_unit, method=method)
        self.evaluations: Counter[int] = Counter()
        self._total: tuple[tuple[int, int], EpsilonReport | None] | None = None

    def record(self, server_round: int, vectors: Sequence[tuple[int, int]]) -> None:
        """One evaluation of every sampled client (failures included) as ``(client, vectors it owns)``."""
        self.evaluations.update(client for client, _ in vectors)
        if self.epsilon_per_report is None:
            return
        mechanism = Laplace(self.epsilon_per_report)
        self.example_accountant.record(
            PrivacyEvent(
                server_round,
                mechanism,
                count=1,
                participants=tuple(client for client, _ in vectors),
                label="clustering evaluation: one Laplace report per local example",
            )
        )
        for client, count in vectors:
            self.client_accountant.record(
                PrivacyEvent(
                    server_round,
                    mechanism,
                    count=count,
                    participants=(client,),
                    label="clustering evaluation: the client's vectors (client level)",
                )
            )

    def example_epsilon(self) -> float | None:
        """Cumulative per-report epsilon of the most-evaluated client (0 before any; None: clear reports)."""
        return self._worst(self.example_accountant)

    def client_epsilon(self) -> float | None:
        """The evaluation's cumulative epsilon in the training unit (worst client; None: clear reports)."""
        return self._worst(self.client_accountant)

    def _worst(self, accountant: PrivacyAccountant) -> float | None:
        if not self.evaluations:
            return 0.0
        return None if self.epsilon_per_report is None else accountant.epsilon(delta=self.delta).epsilon

    def total(
        self, training: EpsilonReport | None, *, joint_with: PrivacyAccountant | None
    ) -> EpsilonReport | None:
        """Training and evaluation per client (None: training not private, or clear reports sent).

        ``joint_with``: the training accountant whose worst client *is* the training epsilon (then the
        events of both are also composed jointly); None when the training epsilon is computed otherwise.
        """
        if training is None or not self.evaluations:
            return training
        if self.epsilon_per_report is None:
            return None
        state = (len(joint_with.events) if joint_with else 0, len(self.client_accountant.events))
        if self._total is None or self._total[0] != state:
            joint = None
            if joint_with is not None:
                joint = combined_epsilon(
                    accountants=[joint_with, self.client_accountant],
                    delta=self.delta,
                    method=self.method,
                )
            pure = self.client_accountant.basic_epsilon()
            assert pure is not None  # Laplace only
            self._total = (state, sequential_stages(training=training, pure_epsilon=pure, joint=joint))
        return self._total[1]

    def summary(self) -> dict[str, Any]:
        """The ledger's part of ``privacy.evaluation``."""
        report = (
            None if self.epsilon_per_report is None else self.example_accountant.epsilon(delta=self.delta)
        )
        return {
            "unit": EVALUATION_UNIT,
            "epsilon_per_report": self.epsilon_per_report,
            "epsilon_cumulative": self.example_epsilon(),
            "epsilon_client_level": self.client_epsilon(),
            "epsilon_cumulative_basic": None if report is None else report.basic,
            "epsilon_cumulative_method": None if report is None else report.method,
            "delta": self.delta,
            "max_evaluations_per_client": max(self.evaluations.values(), default=0),
            "accountant": (
                f"{self.method} (dp-accounting 0.6.0) and basic composition, per client, over one "
                "Laplace event per evaluation round naming every sampled client (epsilon_cumulative: one "
                "example's unit); epsilon_client_level charges each evaluated client n_c uses (its whole "
                "data set, the training strategy's unit) and is composed with training into rounds[].epsilon "
                "(the total per client); rounds[].epsilon_training is training alone"
            ),
            "disclosed": (
                "which clients were evaluated and each one's number of local examples (the shape of its "
                "upload; public in the roster); see privacy.randomness for whether the noise is secret"
            ),
        }
