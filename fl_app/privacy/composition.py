"""How to account: compose a history of mechanism uses into one (epsilon, delta).

One function, :func:`compose_epsilon`, turns ``{mechanism: number of uses}``
into an epsilon at a given delta. The accountant, the calibrations and the
budget calculator all call it, so every epsilon the project prints comes from
this code path.

Backends (Google's dp-accounting 0.6.0):

* **RDP**: each mechanism's Renyi-DP curve over :data:`RDP_ORDERS`,
  summed over the history and converted to (epsilon, delta) with
  dp-accounting's conversion (Canonne, Kamath, Steinke 2020). Randomized
  response is evaluated under ``REPLACE_ONE`` (the LDP relation: any input may
  be replaced by any other); Gaussian and Laplace descriptors are already
  normalised by their sensitivity and are evaluated under ``ADD_OR_REMOVE_ONE``,
  which for a sensitivity-1 mechanism is the plain two-Gaussian (two-Laplace)
  comparison. Poisson-sampled Gaussians use the add-or-remove amplification
  analysis (Mironov, Talwar, Zhang 2019).
* **PLD** (``method="pld"``, the default of ``privacy.accountant``): privacy-loss
  distributions with pessimistic discretisation (a sound upper bound, tighter than
  RDP: for a Poisson-sampled Gaussian at q = 0.1 over 100 rounds, epsilon 8 needs
  noise multiplier 0.936 under PLD against 0.994 under RDP), composed object by object.
  dp-accounting 0.6.0's ``PLDAccountant`` ignores ``count`` for randomized
  response (it composes the event once), so this module never uses that class:
  it builds each mechanism's PLD and calls ``self_compose(count)`` itself.
  Histories with more than :data:`PLD_MAX_COMPOSITIONS` uses, or whose RDP
  epsilon is above :data:`PLD_MAX_EPSILON`, are bounded by RDP alone (reported in
  :attr:`EpsilonReport.method`).
* The distributed **Skellam** mechanism (:class:`~fl_app.privacy.events.Skellam`) has an RDP
  curve only (Agarwal, Kairouz, Liu 2021; :func:`fl_app.privacy.rdp.skellam_rdp`): a
  history that contains it is bounded by RDP, also with ``method="pld"``.
* **Basic composition** for pure-epsilon mechanisms (randomized response,
  Laplace): ``sum(count * epsilon)``, a valid (epsilon, 0) bound.

The reported epsilon is the smallest of the sound bounds computed.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from absl import logging as absl_logging

from fl_app.privacy.events import (
    BinaryRandomizedResponse,
    Gaussian,
    Laplace,
    Mechanism,
    RandomizedResponse,
    SampledGaussian,
    Skellam,
    TreeAggregation,
)
from fl_app.privacy.rdp import poisson_subsampled_gaussian_rdp, skellam_rdp


class LazyModule:
    """A module imported on first attribute access.

    dp-accounting, with the scipy.stats it loads, took 1.1 s of every run's start-up, also of runs
    that account nothing (measured, benchmarks/startup.py); it is imported when a run first accounts.
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        return getattr(importlib.import_module(self._name), attribute)


dpa = LazyModule("dp_accounting")
pld_lib = LazyModule("dp_accounting.pld.privacy_loss_distribution")
rdp_lib = LazyModule("dp_accounting.rdp.rdp_privacy_accountant")

# dp-accounting logs a harmless convergence warning for some fractional orders
# of the sampled Gaussian (those orders become +inf and are ignored).
absl_logging.set_verbosity(absl_logging.ERROR)
logging.getLogger("absl").setLevel(logging.ERROR)

#: Renyi orders: dp-accounting's defaults, plus orders close to 1 (needed after
#: very many compositions, e.g. DPFL-BNN's d bits x T rounds) and large orders
#: (few compositions of near-pure mechanisms). Never ``inf``: dp-accounting's
#: conversion then returns 0. Orders <= 1.01 are useless to its conversion.
#: (:func:`rdp_orders`; the module attribute ``RDP_ORDERS`` is its value.)
_EXTRA_RDP_ORDERS = (1.011, 1.02, 1.03, 1.05, 1.075, 2048.0, 4096.0, 8192.0, 16384.0)


@functools.cache
def rdp_orders() -> tuple[float, ...]:
    """The Renyi orders every RDP curve is evaluated at (see the comment above)."""
    return tuple(sorted(set(rdp_lib.DEFAULT_RDP_ORDERS) | set(_EXTRA_RDP_ORDERS)))


def __getattr__(name: str) -> Any:
    """``RDP_ORDERS``: :func:`rdp_orders`, computed when first read (dp-accounting is imported then)."""
    if name == "RDP_ORDERS":
        return rdp_orders()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


PLD_VALUE_DISCRETIZATION = 1e-3
PLD_MAX_COMPOSITIONS = 1_000_000
#: PLD is not computed for a history whose RDP epsilon is above this: its grid grows with epsilon
#: (35 s for 25 Gaussians of noise multiplier 0.01, epsilon 1.3e5), while the two bounds differ by
#: a few percent there (0.2 % at that point, 1.6 % at epsilon 1.5e3).
PLD_MAX_EPSILON = 250.0
METHODS: tuple[str, ...] = ("rdp", "pld")

History = Mapping[Mechanism, int]


@dataclass(frozen=True)
class EpsilonReport:
    """The epsilon of a history at one delta, with every bound that was computed.

    Attributes
    ----------
    epsilon : float
        The smallest sound bound below (the one to report).
    delta : float
        The delta it holds at.
    method : str
        Which bound gave ``epsilon`` (``"rdp"``, ``"pld"`` or ``"basic"``).
    rdp : float or None
        RDP-converted epsilon (always computed).
    rdp_order : float or None
        The Renyi order that gave ``rdp``.
    pld : float or None
        PLD epsilon (only with ``method="pld"`` and a feasible history).
    basic : float or None
        Sum of pure epsilons (only when every mechanism is pure).

    """

    epsilon: float
    delta: float
    method: str
    rdp: float | None
    rdp_order: float | None
    pld: float | None
    basic: float | None


def to_dp_event(mechanism: Mechanism) -> dpa.DpEvent:
    """Translate a mechanism descriptor into a dp-accounting event."""
    if isinstance(mechanism, Gaussian):
        return dpa.GaussianDpEvent(mechanism.noise_multiplier)
    if isinstance(mechanism, SampledGaussian):
        return dpa.PoissonSampledDpEvent(
            mechanism.sampling_rate, dpa.GaussianDpEvent(mechanism.noise_multiplier)
        )
    if isinstance(mechanism, Laplace):
        return dpa.LaplaceDpEvent(1.0 / mechanism.epsilon)
    if isinstance(mechanism, RandomizedResponse):
        return dpa.RandomizedResponseDpEvent(1.0 - mechanism.keep_probability, mechanism.num_classes)
    if isinstance(mechanism, BinaryRandomizedResponse):
        return dpa.RandomizedResponseDpEvent(1.0 - 2.0 * mechanism.gamma, 2)
    if isinstance(mechanism, TreeAggregation):
        return dpa.SingleEpochTreeAggregationDpEvent(mechanism.noise_multiplier, int(mechanism.steps))
    raise TypeError(f"unknown mechanism {mechanism!r}")


def _relation(mechanism: Mechanism) -> dpa.NeighboringRelation:
    if isinstance(mechanism, RandomizedResponse | BinaryRandomizedResponse):
        return dpa.NeighboringRelation.REPLACE_ONE
    if isinstance(mechanism, TreeAggregation):
        # dp-accounting 0.6.0 accounts tree aggregation only under zero-out (REPLACE_SPECIAL)
        return dpa.NeighboringRelation.REPLACE_SPECIAL
    return dpa.NeighboringRelation.ADD_OR_REMOVE_ONE


def _is_lossless(mechanism: Mechanism) -> bool:
    """Mechanisms whose output does not depend on the input (epsilon 0)."""
    return isinstance(mechanism, BinaryRandomizedResponse) and mechanism.gamma == 0.0


@functools.lru_cache(maxsize=4096)
def rdp_curve(mechanism: Mechanism) -> np.ndarray:
    """RDP of one use of ``mechanism`` at each of :data:`RDP_ORDERS`.

    dp-accounting's ``RdpAccountant`` computes it, except for the Poisson-subsampled Gaussian,
    whose curve :func:`fl_app.privacy.rdp.poisson_subsampled_gaussian_rdp` computes the same way
    (bit for bit, tested) about 15 times faster.
    """
    if isinstance(mechanism, Skellam):
        curve = skellam_rdp(
            orders=np.asarray(rdp_orders()),
            variance=mechanism.variance,
            l1_sensitivity=mechanism.l1_sensitivity,
            l2_sensitivity=mechanism.l2_sensitivity,
        )
        curve.setflags(write=False)
        return curve
    if isinstance(mechanism, SampledGaussian):
        curve = poisson_subsampled_gaussian_rdp(
            q=mechanism.sampling_rate, noise_multiplier=mechanism.noise_multiplier, orders=rdp_orders()
        )
        curve.setflags(write=False)
        return curve
    accountant = rdp_lib.RdpAccountant(orders=list(rdp_orders()), neighboring_relation=_relation(mechanism))
    accountant.compose(to_dp_event(mechanism), 1)
    curve = np.asarray(accountant.rdp, dtype=np.float64)
    curve.setflags(write=False)
    return curve


def _validate(history: History, delta: float) -> None:
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    for mechanism, count in history.items():
        if int(count) != count or count < 0:
            raise ValueError(f"count of {mechanism!r} must be an integer >= 0, got {count!r}")


def rdp_epsilon(history: History, *, delta: float) -> tuple[float, float]:
    """RDP-based epsilon of ``history`` at ``delta``, and the optimal order."""
    _validate(history, delta)
    total = np.zeros(len(rdp_orders()))
    for mechanism, count in history.items():
        if count and not _is_lossless(mechanism):
            total = total + int(count) * rdp_curve(mechanism)
    # an order whose RDP could not be computed (NaN: a Poisson-subsampled Gaussian of noise below
    # about 1e-160 overflows) bounds nothing; dp-accounting would read its NaN as epsilon 0
    total = np.where(np.isnan(total), np.inf, total)
    if not total.any():
        return 0.0, float(rdp_orders()[0])
    epsilon, order = rdp_lib.compute_epsilon(list(rdp_orders()), list(total), delta)
    return float(epsilon), float(order)


@functools.lru_cache(maxsize=256)
def _pld_once(mechanism: Mechanism) -> pld_lib.PrivacyLossDistribution:
    vdi = PLD_VALUE_DISCRETIZATION
    if isinstance(mechanism, Gaussian):
        return pld_lib.from_gaussian_mechanism(mechanism.noise_multiplier, value_discretization_interval=vdi)
    if isinstance(mechanism, SampledGaussian):
        return pld_lib.from_gaussian_mechanism(
            mechanism.noise_multiplier,
            sampling_prob=mechanism.sampling_rate,
            value_discretization_interval=vdi,
        )
    if isinstance(mechanism, Laplace):
        return pld_lib.from_laplace_mechanism(1.0 / mechanism.epsilon, value_discretization_interval=vdi)
    if isinstance(mechanism, RandomizedResponse | BinaryRandomizedResponse):
        event = to_dp_event(mechanism)
        return pld_lib.from_randomized_response(
            event.noise_parameter, event.num_buckets, value_discretization_interval=vdi
        )
    if isinstance(mechanism, TreeAggregation):
        # one leaf is in at most `depth` noisy nodes: the Gaussian with multiplier z / sqrt(depth)
        # dominates the tree (dp-accounting 0.6.0 has no PLD for tree aggregation)
        return pld_lib.from_gaussian_mechanism(
            mechanism.noise_multiplier / math.sqrt(mechanism.depth), value_discretization_interval=vdi
        )
    raise TypeError(f"unknown mechanism {mechanism!r}")


def has_pld(mechanism: Mechanism) -> bool:
    """Whether this module can build the mechanism's privacy-loss distribution (Skellam: no)."""
    return not isinstance(mechanism, Skellam)


def pld_epsilon(history: History, *, delta: float) -> float:
    """PLD-based epsilon of ``history`` at ``delta`` (pessimistic, hence an upper bound)."""
    _validate(history, delta)
    composed: pld_lib.PrivacyLossDistribution | None = None
    for mechanism, count in history.items():
        if not count or _is_lossless(mechanism):
            continue
        part = _pld_once(mechanism).self_compose(int(count))
        composed = part if composed is None else composed.compose(part)
    if composed is None:
        return 0.0
    return float(composed.get_epsilon_for_delta(delta))


def basic_epsilon(history: History) -> float | None:
    """Sum of pure epsilons, or ``None`` when some mechanism is not pure."""
    total = 0.0
    for mechanism, count in history.items():
        if not count:
            continue
        pure = mechanism.pure_epsilon
        if pure is None:
            return None
        total += int(count) * pure
    return total


def compose_epsilon(history: History, *, delta: float, method: str = "rdp") -> EpsilonReport:
    """Compose a history of mechanism uses into an epsilon at ``delta``.

    Parameters
    ----------
    history : Mapping[Mechanism, int]
        How many times each mechanism was applied (to one client's data).
    delta : float
        Target delta in (0, 1).
    method : str
        ``"rdp"`` or ``"pld"``; RDP is always computed too, and basic
        composition whenever every mechanism is pure.

    Returns
    -------
    EpsilonReport
        The smallest sound epsilon and all bounds computed. Memoised on the history's uses
        (:func:`history_key`): accountants and calibrations ask for the same histories again.

    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    _validate(history, delta)
    return _compose(history_key(history), float(delta), method)


def history_key(history: History) -> tuple[tuple[Mechanism, int], ...]:
    """A hashable, order-free form of a history: its non-zero uses, sorted."""
    return tuple(sorted(((m, int(c)) for m, c in history.items() if c), key=repr))


@functools.lru_cache(maxsize=16384)
def _compose(key: tuple[tuple[Mechanism, int], ...], delta: float, method: str) -> EpsilonReport:
    history = dict(key)
    rdp, order = rdp_epsilon(history, delta=delta)
    pld = None
    if (
        method == "pld"
        and rdp <= PLD_MAX_EPSILON
        and sum(int(c) for c in history.values()) <= PLD_MAX_COMPOSITIONS
        and all(has_pld(m) for m in history)
    ):
        pld = pld_epsilon(history, delta=delta)
    basic = basic_epsilon(history)
    candidates = {"rdp": rdp}
    if pld is not None:
        candidates["pld"] = pld
    if basic is not None:
        candidates["basic"] = basic
    best = min(candidates, key=lambda key: candidates[key])
    epsilon = candidates[best]
    if math.isnan(epsilon):
        raise ArithmeticError(f"accounting produced a non-number epsilon for {dict(history)!r}")
    return EpsilonReport(epsilon, delta, best, rdp, order, pld, basic)


def sequential_stages(
    *, training: EpsilonReport, pure_epsilon: float, joint: EpsilonReport | None = None
) -> EpsilonReport:
    """The total epsilon of a training stage followed by a pure-epsilon stage, for one client.

    Two sound bounds, the smaller is reported: basic composition
    ``training.epsilon + pure_epsilon`` (Dwork & Roth 2014, Theorem 3.16; the
    pure stage adds no delta, so it holds at ``training.delta``) and, when
    given, the ``joint`` composition of both stages' events by the accountant.
    Both must be worst-client bounds in the same unit at the same delta.
    """
    if not (math.isfinite(pure_epsilon) and pure_epsilon >= 0):
        raise ValueError(f"pure_epsilon must be a finite number >= 0, got {pure_epsilon!r}")
    summed = training.epsilon + pure_epsilon
    if joint is not None:
        if joint.delta != training.delta:
            raise ValueError(f"joint delta {joint.delta} differs from training delta {training.delta}")
        if joint.epsilon <= summed:
            return joint
    return EpsilonReport(
        epsilon=summed,
        delta=training.delta,
        method=f"{training.method} + basic",
        rdp=None if joint is None else joint.rdp,
        rdp_order=None if joint is None else joint.rdp_order,
        pld=None,
        basic=None if training.basic is None else training.basic + pure_epsilon,
    )
