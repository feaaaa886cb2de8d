"""KD-DP's accounting: per-client DP-SGD plans, the two ledgers, and how they compose.

Tan, Xu, Wang, Luo, Computer Science 51(6A), 2024, 230600002 (the design: ``strategies/kd_dp/strategy.py``;
the reading: ``docs/algorithms/kd_dp.md``). Two units, never mixed:

* **one training example of a federated client** (add or remove; record-level DP): each client's
  local DP-SGD, planned by :class:`DPSGDGroupPlan` and recorded in :attr:`KDDPLedger.accountant`;
* **one pseudo-label of the public split** (replace; label-DP): the randomized response on the
  special client's labels, recorded once in :attr:`KDDPLedger.label_accountant`.

A large-data client is charged its DP-SGD epsilon plus ``epsilon_special`` (sequential
composition, the document's rule; an upper bound in the record unit, since the pseudo-labels are
post-processing of the DP teacher), a general client its DP-SGD epsilon, and the run's epsilon is
the larger of the two disjoint groups' worst clients (parallel composition,
:func:`~fl_app.privacy.budget.grouped_epsilon`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.budget import GroupedEpsilon, grouped_epsilon, parallel_epsilon, sequential_epsilon
from fl_app.privacy.calibration import dp_sgd_noise_multiplier
from fl_app.privacy.dp_sgd import dp_sgd_mechanism
from fl_app.privacy.events import PrivacyEvent, RandomizedResponse


@dataclass(frozen=True)
class KDDPBudget:
    """KD-DP's budget split, every value for one record of a federated client.

    Attributes
    ----------
    total : float
        ``privacy.epsilon``: the guarantee promised to every client.
    teacher : float
        The teacher stage's budget (large-data clients): ``total - special``.
    special : float or None
        The special pseudo-client's label-DP budget (``None``: no label noise).
    general : float
        The general clients' DP-SGD budget.

    """

    total: float
    teacher: float
    special: float | None
    general: float

    @property
    def large_client_total(self) -> float:
        """What a large-data client is charged: ``teacher + special`` (sequential)."""
        return sequential_epsilon(epsilons=[self.teacher, self.special or 0.0])

    @property
    def overall(self) -> float:
        """Parallel composition of the two disjoint groups: ``max(large, general)``."""
        return parallel_epsilon(epsilons=[self.large_client_total, self.general])


def split_kd_dp_budget(
    *, total: float, epsilon_special: float | None, epsilon_general: float | None
) -> KDDPBudget:
    """Split ``total`` into the teacher's, the special client's and the general clients' budgets.

    The training-stage budgets are fixed (``epsilon_special``,
    ``epsilon_general``; ``None`` for the latter means ``total``), and the
    teacher gets what the large-data clients have left:
    ``teacher = total - epsilon_special`` (``total`` when ``epsilon_special`` is
    ``None``). Raises ``ValueError`` when a budget is not positive or the split
    exceeds the total.
    """
    if not (isinstance(total, int | float) and math.isfinite(total) and total > 0):
        raise ValueError(f"total must be a finite number > 0, got {total!r}")
    if epsilon_special is not None:
        if not (isinstance(epsilon_special, int | float) and math.isfinite(epsilon_special)):
            raise ValueError(f"epsilon_special must be a finite number or None, got {epsilon_special!r}")
        if not 0 < epsilon_special < total:
            raise ValueError(
                f"epsilon_special must be in (0, total={total}) so that the teacher keeps a positive "
                f"budget, got {epsilon_special!r}"
            )
    general = total if epsilon_general is None else epsilon_general
    if not (isinstance(general, int | float) and math.isfinite(general) and 0 < general <= total):
        raise ValueError(f"epsilon_general must be in (0, total={total}], got {epsilon_general!r}")
    teacher = total if epsilon_special is None else total - epsilon_special
    return KDDPBudget(
        total=float(total),
        teacher=float(teacher),
        special=None if epsilon_special is None else float(epsilon_special),
        general=float(general),
    )


LARGE = "large"
GENERAL = "general"
SPECIAL = "special"
#: The special (server-side) pseudo-client's id in the label ledger.
SPECIAL_CLIENT_ID = -1
RECORD_UNIT = "one training example of a federated client (add or remove one example), record-level DP"
LABEL_UNIT = "one pseudo-label of the public split (replace one label), label-DP"


def group_by_size(
    sizes: Mapping[int, int], *, threshold: int | None, fraction: float | None
) -> tuple[list[int], list[int]]:
    """Split the clients into large-data and general clients by data-set size (KD-DP's step 1).

    Parameters
    ----------
    sizes : Mapping[int, int]
        Every client's number of examples, by client id (public).
    threshold : int or None
        Large-data clients have at least ``threshold`` examples.
    fraction : float or None
        Large-data clients are the ``ceil(fraction * N)`` largest (ties: lower id first).

    Returns
    -------
    tuple[list[int], list[int]]
        Sorted ids of the large-data clients and of the general clients.

    Raises
    ------
    ValueError
        Unless exactly one of ``threshold``/``fraction`` is given and both groups are non-empty.

    """
    if (threshold is None) == (fraction is None):
        raise ValueError("exactly one of threshold and fraction must be set")
    if threshold is not None:
        large = {client for client, size in sizes.items() if size >= threshold}
    else:
        assert fraction is not None
        if not 0 < fraction < 1:
            raise ValueError(f"fraction must be in (0, 1), got {fraction!r}")
        count = math.ceil(round(fraction * len(sizes), 9))  # 0.1 * 30 is 3.0000000000000004
        ordered = sorted(sizes, key=lambda client: (-sizes[client], client))
        large = set(ordered[:count])
    general = sorted(client for client in sizes if client not in large)
    if not large:
        raise ValueError("no client is a large-data client")
    if not general:
        raise ValueError("every client is a large-data client: no general client is left")
    return sorted(large), general


@dataclass
class DPSGDGroupPlan:
    """Local DP-SGD of one group of federated clients, each calibrated for its own participations.

    Client ``k`` with ``n_k`` examples runs DP-SGD with Poisson rate ``q_k = min(1, B / n_k)``
    (expected batch ``B``) for ``local_epochs * ceil(n_k / B)`` steps per round; over the
    ``r_k`` rounds it is scheduled in, that is ``r_k`` times as many ``SampledGaussian(z_k, q_k)``
    steps, and ``z_k`` is the smallest noise multiplier meeting the group's target epsilon for
    them (:func:`~fl_app.privacy.calibration.dp_sgd_noise_multiplier`). Sizes are public.

    Attributes
    ----------
    name : str
        The group's name.
    ids : list[int]
        The group's clients.
    epsilon : float
        Target epsilon of each client's DP-SGD (one example, add or remove).
    sampling_rates : dict[int, float]
        ``q_k`` per client.
    steps_per_round : dict[int, int]
        DP-SGD steps per round per client.
    participations : dict[int, int]
        Rounds each scheduled client takes part in (:meth:`calibrate`).
    noise_multipliers : dict[int, float]
        ``z_k`` per scheduled client (:meth:`calibrate`).

    """

    name: str
    ids: list[int]
    epsilon: float
    sampling_rates: dict[int, float]
    steps_per_round: dict[int, int]
    participations: dict[int, int] = field(default_factory=dict)
    noise_multipliers: dict[int, float] = field(default_factory=dict)

    @classmethod
    def for_sizes(
        cls, name: str, sizes: Mapping[int, int], *, epsilon: float, batch_size: int, local_epochs: int
    ) -> DPSGDGroupPlan:
        """The group's rates and steps from its clients' sizes (raises ``ValueError`` for an empty client)."""
        empty = [client for client, size in sizes.items() if size < 1]
        if empty:
            raise ValueError(f"client {empty[0]} has no examples for DP-SGD")
        return cls(
            name,
            list(sizes),
            epsilon,
            {client: min(1.0, batch_size / size) for client, size in sizes.items()},
            {client: local_epochs * max(1, math.ceil(size / batch_size)) for client, size in sizes.items()},
        )

    def calibrate(self, participations: Mapping[int, int], *, delta: float, method: str = "rdp") -> None:
        """Set each scheduled client's participations and its ``z_k`` calibrated with ``method``."""
        self.participations = dict(participations)
        self.noise_multipliers = {
            client: dp_sgd_noise_multiplier(
                epsilon=self.epsilon,
                delta=delta,
                sampling_rate=self.sampling_rates[client],
                steps=self.steps_per_round[client] * count,
                method=method,
            )
            for client, count in self.participations.items()
        }

    def describe(self) -> str:
        """One log line: the group's size, target epsilon and the ranges of q, steps and z."""

        def span(values: Iterable[float], fmt: str) -> str:
            ordered = sorted(values)
            return f"{ordered[0]:{fmt}}, {ordered[-1]:{fmt}}" if ordered else "-"

        return (
            f"{self.name} clients: {len(self.ids)}, epsilon {self.epsilon:.4g}, "
            f"q in [{span(self.sampling_rates.values(), '.4g')}], "
            f"DP-SGD steps/round in [{span(self.steps_per_round.values(), 'd')}], "
            f"z in [{span(self.noise_multipliers.values(), '.4g')}]"
        )

    def to_json(self, *, clip: float) -> dict[str, Any]:
        """The plan for ``results.json`` (per-client maps keyed by the client id as a string)."""

        def by_client(values: Mapping[int, Any]) -> dict[str, Any]:
            return {str(k): v for k, v in sorted(values.items())}

        return {
            "clip": clip,
            "sampling_rates": by_client(self.sampling_rates),
            "steps_per_round": by_client(self.steps_per_round),
            "target_epsilon": self.epsilon,
            "participations": by_client(self.participations),
            "noise_multipliers": by_client(self.noise_multipliers),
        }


class KDDPLedger:
    """KD-DP's record-level and label-level accountants, its groups and the charge between them.

    Parameters
    ----------
    plans : Mapping[str, DPSGDGroupPlan]
        The large-data (:data:`LARGE`) and general (:data:`GENERAL`) groups' DP-SGD plans.
    population : Sequence[int]
        Every federated client's id.
    budget : KDDPBudget
        The budget split (its ``special`` is the per-label epsilon, None: no label noise).
    num_classes : int
        Number of classes (the randomized response's alphabet).
    method : str
        The accountant's composition method (``privacy.accountant``).
    delta : float
        The delta every epsilon is reported at.

    """

    def __init__(
        self,
        *,
        plans: Mapping[str, DPSGDGroupPlan],
        population: Sequence[int],
        budget: KDDPBudget,
        num_classes: int,
        method: str,
        delta: float,
    ) -> None:
        self.plans = dict(plans)
        self.budget = budget
        self.num_classes = num_classes
        self.delta = delta
        self.accountant = PrivacyAccountant(population=population, unit=RECORD_UNIT, method=method)
        self.label_accountant = PrivacyAccountant(
            population=[SPECIAL_CLIENT_ID], unit=LABEL_UNIT, method=method
        )
        self._cache: tuple[tuple[int, int], GroupedEpsilon] | None = None

    def record_dp_sgd(self, server_round: int, group: str, clients: Iterable[int], *, stage: str) -> None:
        """One event per distinct ``(z, q, steps)`` of the group's plan, naming every given client."""
        plan = self.plans[group]
        by_mechanism: dict[tuple[float, float, int], list[int]] = {}
        for c in clients:
            key = (plan.noise_multipliers[c], plan.sampling_rates[c], plan.steps_per_round[c])
            by_mechanism.setdefault(key, []).append(c)
        for (multiplier, rate, steps), ids in sorted(by_mechanism.items()):
            self.accountant.record(
                PrivacyEvent(
                    server_round,
                    dp_sgd_mechanism(noise_multiplier=multiplier, sampling_rate=rate),
                    count=steps,
                    participants=tuple(ids),
                    label=f"{group} clients' local DP-SGD ({stage} stage)",
                )
            )

    def record_pseudo_labels(self, server_round: int) -> None:
        """The randomized response on every pseudo-label, once (nothing without label noise)."""
        if self.budget.special is None:
            return
        self.label_accountant.record(
            PrivacyEvent(
                server_round,
                RandomizedResponse(self.budget.special, self.num_classes),
                count=1,
                participants=(SPECIAL_CLIENT_ID,),
                label="randomized response on every pseudo-label (once; each label is one record)",
            )
        )

    def grouped(self) -> GroupedEpsilon:
        """Each group's worst client (large-data: DP-SGD + label charge) and the overall maximum."""
        state = (len(self.accountant.events), len(self.label_accountant.events))
        if self._cache is None or self._cache[0] != state:
            result = grouped_epsilon(
                accountant=self.accountant,
                groups={LARGE: self.plans[LARGE].ids, GENERAL: self.plans[GENERAL].ids},
                delta=self.delta,
                charges={LARGE: self.special_epsilon()},
            )
            self._cache = (state, result)
        return self._cache[1]

    def special_epsilon(self) -> float:
        """The special client's accounted label-DP epsilon (0 before the labels are released)."""
        return self.label_accountant.epsilon(delta=self.delta).epsilon

    def teacher_epsilon(self) -> float:
        """The large-data clients' worst DP-SGD epsilon alone (the post-processing bound)."""
        return max(
            (self.accountant.epsilon(delta=self.delta, client=c).epsilon for c in self.plans[LARGE].ids),
            default=0.0,
        )

    def epsilons(self) -> dict[str, float]:
        """Each group's cumulative epsilon and the special client's (per round and final)."""
        grouped = self.grouped()
        return {
            "epsilon_large": grouped.groups[LARGE].epsilon,
            "epsilon_general": grouped.groups[GENERAL].epsilon,
            "epsilon_special": self.special_epsilon(),
        }

    def summary(self, *, clip: float) -> dict[str, Any]:
        """Budget split (targets), each group's accounted epsilon, the overall one, the DP-SGD plans."""
        grouped = self.grouped()
        special = self.budget.special
        return {
            "guarantee": (
                f"every example of every federated client is ({grouped.overall.epsilon:.4g}, "
                f"{self.delta:g})-DP (add or remove one example): parallel composition over the "
                "disjoint large-data and general groups"
            ),
            "units": {
                LARGE: RECORD_UNIT + "; charged teacher DP-SGD + epsilon_special (upper bound: the "
                "pseudo-labels are post-processing of the DP teacher)",
                GENERAL: RECORD_UNIT,
                SPECIAL: LABEL_UNIT + " (not a federated client's data; reported on its own)",
            },
            "budget": asdict(self.budget)
            | {"large_client_total": self.budget.large_client_total, "overall": self.budget.overall},
            "epsilon_by_group": {
                LARGE: grouped.groups[LARGE].epsilon,
                "large_teacher_only": self.teacher_epsilon(),
                GENERAL: grouped.groups[GENERAL].epsilon,
                SPECIAL: self.special_epsilon(),
            },
            "epsilon_overall": grouped.overall.epsilon,
            "worst_group": grouped.worst_group,
            "dp_sgd": {name: plan.to_json(clip=clip) for name, plan in self.plans.items()},
            "special_label_noise": {
                "epsilon_per_label": special,
                "keep_probability": (
                    None
                    if special is None
                    else RandomizedResponse(special, self.num_classes).keep_probability
                ),
                "ledger": self.label_accountant.state_dict(),
            },
        }
