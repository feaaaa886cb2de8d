"""Budget arithmetic across stages and disjoint client groups (KD-DP's split).

Three rules, each stated for one privacy unit (what a neighbouring pair is):

* **sequential composition** (basic): mechanisms applied to the *same* data
  with guarantees ``(eps_i, delta_i)`` are together ``(sum eps_i, sum delta_i)``
  (Dwork & Roth 2014, Theorem 3.16) -- :func:`sequential_epsilon`;
* **parallel composition**: mechanisms applied to *disjoint* data sets give
  every individual the guarantee of the one mechanism that touched their data,
  so the guarantee for everyone is the maximum (McSherry 2009) --
  :func:`parallel_epsilon`;
* **post-processing**: a function of a DP output that does not touch the data
  again costs nothing. Adding a charge that post-processing makes
  unnecessary keeps an upper bound an upper bound (:func:`charged_report`).

:func:`grouped_epsilon` evaluates a split across disjoint groups on an accountant (KD-DP's split
and ledgers are in :mod:`strategies.kd_dp.privacy`). Every function is keyword-only and validates
its arguments.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.checks import require_non_negative
from fl_app.privacy.composition import EpsilonReport


def sequential_epsilon(*, epsilons: Sequence[float]) -> float:
    """Basic sequential composition on the same data: the sum of the epsilons."""
    for i, value in enumerate(epsilons):
        require_non_negative(f"epsilons[{i}]", value)
    return float(sum(epsilons))


def parallel_epsilon(*, epsilons: Sequence[float]) -> float:
    """Parallel composition over disjoint data: the largest epsilon (0 for none)."""
    for i, value in enumerate(epsilons):
        require_non_negative(f"epsilons[{i}]", value)
    return float(max(epsilons, default=0.0))


def charged_report(report: EpsilonReport, *, extra_epsilon: float) -> EpsilonReport:
    """``report`` with a pure-epsilon charge added by basic sequential composition.

    The delta is unchanged (the charge is pure); ``method`` becomes
    ``"<method>+basic"`` when the charge is positive.
    """
    require_non_negative("extra_epsilon", extra_epsilon)
    if extra_epsilon == 0:
        return report
    return replace(
        report,
        epsilon=sequential_epsilon(epsilons=[report.epsilon, extra_epsilon]),
        method=f"{report.method}+basic",
    )


@dataclass(frozen=True)
class GroupedEpsilon:
    """Per-group worst-client epsilons (with charges) and their parallel composition.

    Attributes
    ----------
    groups : dict[str, EpsilonReport]
        The worst client's charged report in every group.
    overall : EpsilonReport
        The largest of them (parallel composition).
    worst_group : str
        The group that gave ``overall``.

    """

    groups: dict[str, EpsilonReport]
    overall: EpsilonReport
    worst_group: str


def _zero_report(delta: float) -> EpsilonReport:
    return EpsilonReport(0.0, delta, "none", 0.0, None, None, 0.0)


def grouped_epsilon(
    *,
    accountant: PrivacyAccountant,
    groups: Mapping[str, Sequence[int]],
    delta: float,
    charges: Mapping[str, float] | None = None,
) -> GroupedEpsilon:
    """Worst client of each disjoint group, plus that group's charge; the overall maximum.

    Parameters
    ----------
    accountant : PrivacyAccountant
        Holds every group's events (one unit for all of them).
    groups : Mapping[str, Sequence[int]]
        Disjoint client-id sets, each within the accountant's population.
    delta : float
        The delta every report is computed at.
    charges : Mapping[str, float], optional
        Pure epsilon added to every client of a group (sequential composition).

    Raises
    ------
    ValueError
        When groups overlap (parallel composition would not apply) or a charge
        names an unknown group.

    """
    charges = dict(charges or {})
    unknown = set(charges) - set(groups)
    if unknown:
        raise ValueError(f"charges name unknown groups: {sorted(unknown)}")
    if not groups:
        raise ValueError("groups must not be empty")
    seen: set[int] = set()
    for name, members in groups.items():
        overlap = seen & set(members)
        if overlap:
            raise ValueError(f"group {name!r} overlaps another group in {sorted(overlap)[:5]}")
        seen |= set(members)
    reports: dict[str, EpsilonReport] = {}
    for name, members in groups.items():
        worst = max(
            (accountant.epsilon(delta=delta, client=c) for c in members),
            key=lambda report: report.epsilon,
            default=_zero_report(delta),
        )
        reports[name] = charged_report(worst, extra_epsilon=float(charges.get(name, 0.0)))
    worst_group = max(reports, key=lambda name: reports[name].epsilon)
    return GroupedEpsilon(groups=reports, overall=reports[worst_group], worst_group=worst_group)
