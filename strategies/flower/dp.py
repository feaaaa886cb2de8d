"""Flower's differential-privacy wrappers run by dpfl, with Flower's epsilon and dpfl's side by side.

``strategy=flower strategy.flower=DifferentialPrivacyServerSideFixedClipping`` (or
``...ClientSideFixedClipping``, ``...ServerSideAdaptiveClipping``, ``...ClientSideAdaptiveClipping``)
wraps ``strategy.wrapped`` (FedAvg unless set; ``strategy.kwargs`` are its keyword arguments) with the
wrapper's own arguments from ``strategy.dp``. What Flower's code does (flwr 1.41:
``serverapp/strategy/dp_fixed_clipping.py``, ``dp_adaptive_clipping.py``,
``supercore/differential_privacy.py``, ``supercore/privacy_accounting``):

* each update ``w_k - w_t`` is clipped to L2 norm ``C`` (on the server, or by the client's mod);
  the wrapped strategy aggregates; Gaussian noise of std ``z C / m`` is added to the aggregate, with
  ``m = num_sampled_clients``: on the uniform average of ``m`` updates that is std ``z C`` on their
  sum, whose sensitivity to one client's update is ``C`` (zero-out: the update replaced by zero);
* the noise comes from numpy's global generator (``np.random.normal``), which Flower never seeds;
* the fixed-clipping wrappers' accountant (``RdpAccountant``) composes one ``Gaussian(z)`` event per
  release for every client, only with ``sampling_method=no-amplification`` (it refuses Poisson and
  without-replacement), and refuses unequal client weights and a reply count other than ``m``;
* the adaptive wrappers have no accountant. They release a noised count of the updates above the
  clipping norm (std ``clipped_count_stddev``; the count of 0/1 bits has sensitivity 1, while the
  noise split ``z_model = (z^-2 - (2 sigma_b)^-2)^-1/2`` of Andrew et al. assumes centred bits of
  sensitivity 1/2), move the clipping norm to ``C' = C exp(-lr (noised fraction - quantile))``, and
  then noise the aggregate with std ``z_model C' / m``: the *new* norm, while the updates were clipped
  to ``C``. A round whose count comes out high shrinks the noise below what ``z`` says.

What dpfl changes around the Flower object, and nothing else: the cohort is dpfl's (``m =
clients_per_round`` clients each round, drawn from the public seed: no amplification, as Flower's
accountant assumes); the wrapped strategy averages by the ``uniform-weight`` every ``flower`` client
reports (Flower's accountant refuses example weights); numpy's global generator is seeded for each
release from the privacy randomness (``run.noise``: OS entropy with ``privacy.secure_rng``) and
restored after; a client-side wrapper's clipping runs in dpfl's ``flower`` client (Flower's own
mods), and the server checks each reply's update against the norm the client was sent.

dpfl's epsilon (:class:`WrapperRun`): per client, the rounds it took part in, unit one client's data
set with its update replaced by zero (dpfl's fixed-size cohorts' unit), composed by dpfl's
accountant (``privacy.accountant``):

* fixed clipping: ``Gaussian(z n / m)`` for a release averaging ``n`` replies (``n = m`` unless some
  failed: the average is over ``n`` while the noise is sized for ``m``);
* adaptive clipping: ``Gaussian(clipped_count_stddev)`` for the count, and
  ``Gaussian(z_model r n / m)`` for the model, where ``r = exp(-lr (1 + k sigma_b / n - quantile))``
  bounds ``C' / C`` from below unless the count's noise exceeds ``k sigma_b``; ``k`` is the normal
  quantile of ``1 - delta'``, ``delta' = delta / (2 T)`` per round. The bound fails with
  probability at most ``T delta'``, a set of outputs on which the mechanism equals one that
  clamps ``C'`` at ``r C``, so the epsilon composed at ``delta / 2`` holds at ``delta``.
* none (null, with the reason) when Flower's noise is added after a server optimiser's step
  (the wrapped class has its own ``aggregate_train``), when the average is weighted by examples, or
  once a client-side reply exceeds its clipping norm.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from statistics import NormalDist
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, Message
from flwr.serverapp import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    RdpAccountant,
    SamplingMethod,
)
from flwr.serverapp import strategy as flower_strategies

from clients.flower import CLIPPING_MOD, UNIFORM_WEIGHT
from fl_app.config.checks import ConfigError, require_choice, require_positive, require_range
from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.composition import EpsilonReport, compose_epsilon
from fl_app.privacy.events import Gaussian, PrivacyEvent
from fl_app.run.context import resolve_clients_per_round
from strategies.arrays import flat_vector
from strategies.flower.adapter import build_flower_strategy, flower_class

if TYPE_CHECKING:
    from fl_app.config.settings import RunSettings
    from fl_app.run.context import RunContext

#: Flower's DP wrappers: name -> (clipping kind, the client mod a client-side one needs or None).
WRAPPERS: dict[str, tuple[str, str | None]] = {
    "DifferentialPrivacyServerSideFixedClipping": ("fixed", None),
    "DifferentialPrivacyClientSideFixedClipping": ("fixed", "fixedclipping_mod"),
    "DifferentialPrivacyServerSideAdaptiveClipping": ("adaptive", None),
    "DifferentialPrivacyClientSideAdaptiveClipping": ("adaptive", "adaptiveclipping_mod"),
}
#: ``strategy.dp.accountant``: Flower's ``PrivacyConfig.sampling_method``, or none.
ACCOUNTANTS = ("none", *(method.value for method in SamplingMethod))
#: The unit of dpfl's epsilon for these runs.
UNIT = "one client's entire data set (its update replaced by zero), central DP"
#: The share of delta the adaptive wrappers' tail bound takes (the accountant gets the rest).
TAIL_SHARE = 0.5
#: The privacy randomness's purpose for the noise Flower draws.
NOISE_PURPOSE = "flower-dp-noise"


def wrapper_kind(cls: type) -> tuple[str, str | None] | None:
    """``(kind, mod)`` of a Flower DP wrapper class (or a subclass of one); None for any other class."""
    for name, kind in WRAPPERS.items():
        if issubclass(cls, getattr(flower_strategies, name)):
            return kind
    return None


@dataclass(frozen=True)
class DPArguments:
    """``strategy.dp``: a Flower DP wrapper's own arguments (None: Flower's default, or not given)."""

    noise_multiplier: float | None = None
    clipping_norm: float | None = None
    target_clipped_quantile: float | None = None
    clip_norm_lr: float | None = None
    clipped_count_stddev: float | None = None
    accountant: str | None = None
    max_epsilon: float | None = None

    def given(self) -> dict[str, Any]:
        """The keys set (not None)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Shape:
    """What a wrapper is built for: the cohort size, the population, delta, rounds, the clients' lr."""

    m: int
    population: int
    delta: float
    rounds: int
    lr: float

    @classmethod
    def of_settings(cls, run: RunSettings) -> Shape:
        """As configured (validation: before the roster is known)."""
        m = resolve_clients_per_round(run.clients_per_round, run.num_clients)
        return cls(m, run.num_clients, run.privacy.delta, run.num_rounds, run.lr)

    @classmethod
    def of_run(cls, run: RunContext) -> Shape:
        """As the run's roster has it (a deployment's federation may differ from the configured count)."""
        own = run.settings
        return cls(run.clients_per_round, run.num_clients, own.privacy.delta, own.num_rounds, own.lr)


#: Keys of :class:`DPArguments` only one kind of wrapper takes (the other kind refuses them).
ONLY: dict[str, str] = {
    "target_clipped_quantile": "adaptive",
    "clip_norm_lr": "adaptive",
    "clipped_count_stddev": "adaptive",
    "accountant": "fixed",
    "max_epsilon": "fixed",
}


def check_dp_arguments(key: str, value: Any) -> DPArguments:
    """``strategy.dp``: a mapping of :class:`DPArguments`' keys (each null or a valid value)."""
    names = [item.name for item in fields(DPArguments)]
    if value is None:
        return DPArguments()
    if not isinstance(value, dict):
        raise ConfigError(key, value, f"must be a mapping with keys {', '.join(names)}")
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ConfigError(f"{key}.{unknown[0]}", value[unknown[0]], f"unknown; the keys: {', '.join(names)}")
    checked: dict[str, Any] = {}
    for name, item in value.items():
        if item is None:
            continue
        if name == "accountant":
            checked[name] = require_choice(f"{key}.{name}", item, ACCOUNTANTS)
        elif name == "target_clipped_quantile":
            checked[name] = require_range(f"{key}.{name}", item, 0.0, 1.0)
        else:
            checked[name] = require_positive(f"{key}.{name}", item)
    return DPArguments(**checked)


def check_not_wrapped(flower: str, wrapped: str | None, dp: DPArguments) -> None:
    """Without a DP wrapper as ``strategy.flower``, ``strategy.wrapped`` and ``strategy.dp`` stay null."""
    hint = "only with a Flower DP wrapper as strategy.flower (DifferentialPrivacy...)"
    if wrapped is not None:
        raise ConfigError("strategy.wrapped", wrapped, f"{hint}; strategy.flower={flower} is not one")
    for name, value in dp.given().items():
        raise ConfigError(f"strategy.dp.{name}", value, f"{hint}; strategy.flower={flower} is not one")


def check_wrapper(
    flower: str, wrapped: str | None, kwargs: Mapping[str, Any], dp: DPArguments, run: RunSettings
) -> None:
    """The wrapper's arguments, its wrapped class and Flower's budget (one :class:`ConfigError`)."""
    kind, _ = wrapper_kind(flower_class(flower)) or ("", None)
    inner = wrapped or "FedAvg"
    try:
        inner_class = flower_class(inner)
    except ValueError as error:
        raise ConfigError("strategy.wrapped", wrapped, str(error)) from None
    if wrapper_kind(inner_class) is not None:
        raise ConfigError("strategy.wrapped", wrapped, "must be an aggregator, not another DP wrapper")
    if dp.noise_multiplier is None:
        raise ConfigError("strategy.dp.noise_multiplier", None, f"{flower} needs one: a number > 0")
    if kind == "fixed" and dp.clipping_norm is None:
        raise ConfigError("strategy.dp.clipping_norm", None, f"{flower} needs one: a number > 0")
    for name, value in dp.given().items():
        if ONLY.get(name, kind) != kind:
            refusal = f"Flower's {kind}-clipping wrappers do not take it"
            raise ConfigError(f"strategy.dp.{name}", value, refusal)
    accounted = accountant_method(kind, dp) is not None
    if accounted and inner_class.aggregate_train is not flower_strategies.FedAvg.aggregate_train:
        raise ConfigError(
            "strategy.wrapped",
            wrapped,
            "Flower's accountant takes only FedAvg's aggregate_train (FedAvg, FedProx): set "
            "strategy.dp.accountant=none to run it without one, or use strategy=dp_flower",
        )
    weighting = weighted_by(inner_class, kwargs)
    if accounted and weighting not in (None, UNIFORM_WEIGHT):
        raise ConfigError(
            "strategy.kwargs.weighted_by_key",
            weighting,
            f"Flower's accountant refuses unequal client weights: leave it unset ({UNIFORM_WEIGHT}) "
            "or set strategy.dp.accountant=none",
        )
    if dp.max_epsilon is not None and accountant_method(kind, dp) is None:
        raise ConfigError("strategy.dp.max_epsilon", dp.max_epsilon, "needs Flower's accountant (not none)")
    shape = Shape.of_settings(run)
    try:
        wrapper = build_wrapper(flower, wrapped, kwargs, dp, shape)
    except ValueError as error:
        raise ConfigError("strategy.dp", dp.given(), " ".join(str(error).split())) from None
    check_budget(wrapper, dp, shape)


def weighted_by(inner_class: type, kwargs: Mapping[str, Any]) -> str | None:
    """The metric the wrapped class averages by (None: it takes no ``weighted_by_key``)."""
    if "weighted_by_key" not in inspect.signature(inner_class.__init__).parameters:
        return None
    return str(kwargs.get("weighted_by_key", UNIFORM_WEIGHT))


def accountant_method(kind: str, dp: DPArguments) -> str | None:
    """The sampling method of Flower's accountant (None: no accountant).

    Fixed clipping's default is no-amplification, the only one Flower's fixed-clipping wrappers take.
    """
    if kind != "fixed" or dp.accountant == "none":
        return None
    return dp.accountant or SamplingMethod.NO_AMPLIFICATION.value


def flower_accountant(kind: str, dp: DPArguments, shape: Shape) -> RdpAccountant | None:
    """Flower's ``RdpAccountant`` for the wrapper (its ``PrivacyConfig`` from dpfl's run), or None."""
    method = accountant_method(kind, dp)
    if method is None:
        return None
    sampling = SamplingMethod(method)
    relation = (
        NeighboringRelation.REPLACE_ONE
        if sampling is SamplingMethod.WITHOUT_REPLACEMENT
        else NeighboringRelation.ADD_OR_REMOVE_ONE
    )
    config = PrivacyConfig(
        target_delta=shape.delta,
        population_size=shape.population,
        neighboring_relation=relation,
        sampling_method=sampling,
        max_epsilon=dp.max_epsilon,
    )
    return RdpAccountant(config)


def build_wrapper(
    flower: str, wrapped: str | None, kwargs: Mapping[str, Any], dp: DPArguments, shape: Shape
) -> flower_strategies.Strategy:
    """The Flower DP wrapper around the wrapped aggregator, as dpfl runs it.

    ``num_sampled_clients`` is dpfl's cohort size; the wrapped class averages by
    :data:`UNIFORM_WEIGHT` unless ``strategy.kwargs.weighted_by_key`` says otherwise.
    """
    cls = flower_class(flower)
    kind, _ = wrapper_kind(cls) or ("", None)
    inner_class = flower_class(wrapped or "FedAvg")
    weighting = {"weighted_by_key": UNIFORM_WEIGHT} if weighted_by(inner_class, kwargs) is not None else {}
    inner = build_flower_strategy(wrapped or "FedAvg", {**weighting, **kwargs}, lr=shape.lr)
    assert dp.noise_multiplier is not None
    if kind == "fixed":
        assert dp.clipping_norm is not None
        accountant = flower_accountant(kind, dp, shape)
        return cls(inner, dp.noise_multiplier, dp.clipping_norm, shape.m, accountant=accountant)
    adaptive = {
        "initial_clipping_norm": dp.clipping_norm,
        "target_clipped_quantile": dp.target_clipped_quantile,
        "clip_norm_lr": dp.clip_norm_lr,
        "clipped_count_stddev": dp.clipped_count_stddev,
    }
    return cls(inner, dp.noise_multiplier, shape.m, **{k: v for k, v in adaptive.items() if v is not None})


def check_budget(wrapper: Any, dp: DPArguments, shape: Shape) -> None:
    """With ``max_epsilon``, Flower's accountant must allow every round (else it stops the run mid-way)."""
    accountant = getattr(wrapper, "accountant", None)
    if accountant is None or dp.max_epsilon is None:
        return
    event = GaussianPrivacyEvent(wrapper.noise_multiplier, shape.m, shape.population)

    def spent(releases: int) -> float:
        fresh = RdpAccountant(accountant.config)
        fresh.compose(event, releases)
        return fresh.get_epsilon(shape.delta)

    if spent(shape.rounds) <= dp.max_epsilon:
        return
    low, high = 0, shape.rounds  # spent(low) <= max < spent(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if spent(middle) <= dp.max_epsilon else (low, middle)
    raise ConfigError(
        "strategy.dp.max_epsilon",
        dp.max_epsilon,
        f"Flower's accountant would refuse round {high} of num_rounds={shape.rounds} (its epsilon "
        f"{spent(high):.4g} at delta {shape.delta:g}): raise it or set num_rounds={low}",
    )


@contextmanager
def global_numpy_from(rng: np.random.Generator) -> Iterator[None]:
    """Numpy's global generator (the one Flower's noise draws from) seeded from ``rng``, then restored."""
    before = np.random.get_state()  # noqa: NPY002 (Flower's noise draws from the global generator)
    np.random.seed(rng.integers(0, 2**32, size=624, dtype=np.uint64).astype(np.uint32))  # noqa: NPY002
    try:
        yield
    finally:
        np.random.set_state(before)  # noqa: NPY002


def exceeds_clip(reply: Message, sent: ArrayRecord, clip: float) -> bool:
    """Whether a reply's update ``w_k - w_t`` is longer than ``clip`` (beyond float32 rounding)."""
    start = flat_vector(sent)
    update = flat_vector(next(iter(reply.content.array_records.values()))) - start
    rounding = float(np.linalg.norm(np.spacing((np.abs(start) + clip).astype(np.float32)))) * 4
    return float(np.linalg.norm(update)) > clip * (1 + 1e-6) + rounding


class WrapperRun:
    """A Flower DP wrapper in a dpfl run: its noise source, dpfl's events and both epsilons.

    Parameters
    ----------
    run : RunContext
        The run (its cohort size, population, privacy randomness and delta).
    flower, wrapped, kwargs, dp :
        ``strategy.flower``, ``strategy.wrapped``, ``strategy.kwargs``, ``strategy.dp``.

    """

    def __init__(
        self, run: RunContext, flower: str, wrapped: str | None, kwargs: Mapping[str, Any], dp: DPArguments
    ) -> None:
        self.run = run
        cls = flower_class(flower)
        self.kind, self.mod = wrapper_kind(cls) or ("", None)
        self.wrapped = wrapped or "FedAvg"
        self.shape = Shape.of_run(run)
        self.wrapper = build_wrapper(flower, wrapped, kwargs, dp, self.shape)
        self.given_noise_multiplier = float(dp.noise_multiplier or 0.0)
        self.unproven = unproven_reason(self.wrapped, kwargs)
        self.unclipped_round: int | None = None
        self.accountant: PrivacyAccountant | None = None
        if self.unproven is None:
            self.accountant = PrivacyAccountant(
                population=run.client_ids, unit=UNIT, method=run.settings.privacy.accountant
            )

    @property
    def m(self) -> int:
        """``num_sampled_clients``: the cohort size Flower's noise is sized for."""
        return int(self.wrapper.num_sampled_clients)

    def extra_config(self) -> dict[str, Any]:
        """What a client-side wrapper's clients read: the Flower mod that clips."""
        return {} if self.mod is None else {CLIPPING_MOD: self.mod}

    def noise(self, server_round: int) -> Any:
        """The scope of one release: Flower's noise drawn from the privacy randomness."""
        return global_numpy_from(self.run.noise.generator(NOISE_PURPOSE, server_round=server_round))

    def check_clipping(self, server_round: int, replies: list[Message], sent: ArrayRecord) -> None:
        """A client-side wrapper's replies must be clipped to the norm the clients were sent."""
        if self.mod is None or self.unclipped_round is not None:
            return
        clip = float(self.wrapper.clipping_norm)
        if any(exceeds_clip(reply, sent, clip) for reply in replies):
            self.unclipped_round = server_round

    def record(self, server_round: int, participants: tuple[int, ...], replies: int) -> None:
        """The events dpfl records for a release that averaged ``replies`` replies (module docstring)."""
        if self.accountant is None:
            return
        share = replies / self.m
        if self.kind == "fixed":
            events = [(Gaussian(self.wrapper.noise_multiplier * share), "central release")]
        else:
            sigma = float(self.wrapper.clipped_count_stddev)
            floor = self.norm_ratio_floor(replies)
            events = [
                (Gaussian(sigma), "clipped count"),
                (Gaussian(self.wrapper.noise_multiplier * floor * share), "central release"),
            ]
        for mechanism, label in events:
            event = PrivacyEvent(server_round, mechanism, participants=participants, label=label)
            self.accountant.record(event)

    def norm_ratio_floor(self, replies: int) -> float:
        """``r``: the least ``C' / C`` of an adaptive round, unless the count's noise exceeds ``k sigma``."""
        tail = self.shape.delta * TAIL_SHARE / self.shape.rounds
        k = NormalDist().inv_cdf(1 - tail)
        w = self.wrapper
        most = 1 + k * float(w.clipped_count_stddev) / replies
        return math.exp(-float(w.clip_norm_lr) * (most - float(w.target_clipped_quantile)))

    def why_no_epsilon(self) -> str | None:
        """Why dpfl reports no epsilon (None: it does)."""
        if self.unproven is not None:
            return self.unproven
        if self.unclipped_round is not None:
            return (
                f"in round {self.unclipped_round} a reply's update exceeded the clipping norm its client "
                "was sent (Flower's client-side wrappers do not check): no bound covers that client"
            )
        return None

    def epsilon(self) -> EpsilonReport | None:
        """The epsilon dpfl proves for the worst client at ``privacy.delta`` (None: see why_no_epsilon)."""
        if self.accountant is None or self.why_no_epsilon() is not None:
            return None
        delta = self.run.settings.privacy.delta
        if self.kind == "fixed":
            return self.accountant.epsilon(delta=delta)
        return dataclasses.replace(self.accountant.epsilon(delta=delta * (1 - TAIL_SHARE)), delta=delta)

    def planned_epsilon(self, participations: int) -> float | None:
        """The epsilon dpfl proves for a client in ``participations`` releases that every reply reached.

        What :meth:`record` and :meth:`epsilon` give such a client; None when dpfl proves no bound.
        """
        if self.accountant is None or participations < 1:
            return None
        delta, method = self.run.settings.privacy.delta, self.run.settings.privacy.accountant
        if self.kind == "fixed":
            history = {Gaussian(self.wrapper.noise_multiplier): participations}
            return compose_epsilon(history, delta=delta, method=method).epsilon
        count = Gaussian(float(self.wrapper.clipped_count_stddev))
        release = Gaussian(self.wrapper.noise_multiplier * self.norm_ratio_floor(self.m))
        history = {count: participations, release: participations}
        return compose_epsilon(history, delta=delta * (1 - TAIL_SHARE), method=method).epsilon

    def flower_epsilon(self) -> float | None:
        """The epsilon Flower's accountant reports (None: the wrapper has none)."""
        spent = getattr(self.wrapper, "privacy_spent", lambda: None)()
        return None if spent is None else float(spent.epsilon)

    def flower_releases(self) -> int:
        """The releases Flower's accountant composed."""
        accountant = getattr(self.wrapper, "accountant", None)
        return 0 if accountant is None else int(accountant.num_releases)

    def why_flower_has_none(self) -> str | None:
        """Why Flower reports no epsilon (None: it does)."""
        if self.kind == "adaptive":
            return "Flower's adaptive-clipping wrappers have no accountant (flwr 1.41)"
        if getattr(self.wrapper, "accountant", None) is None:
            return "no accountant (strategy.dp.accountant=none)"
        return None

    def settings_line(self) -> str:
        """``Flower <wrapper>: ...``: its arguments as the object holds them (the run's header)."""
        w = self.wrapper
        items = [f"noise_multiplier={self.given_noise_multiplier:g}"]
        if self.kind == "fixed":
            items.append(f"clipping_norm={w.clipping_norm:g}")
            config = getattr(w.accountant, "config", None)
            if config is None:
                items.append("no accountant")
            else:
                method, most = config.sampling_method.value, config.max_epsilon
                items.append(f"accountant=RdpAccountant({method}, max_epsilon={most})")
        else:
            items += [
                f"noise multiplier on the model {w.noise_multiplier:.4g}",
                f"initial_clipping_norm={w.clipping_norm:g}",
                f"target_clipped_quantile={w.target_clipped_quantile:g}",
                f"clip_norm_lr={w.clip_norm_lr:g}",
                f"clipped_count_stddev={w.clipped_count_stddev:g}",
            ]
        items.append(f"num_sampled_clients={self.m}")
        return f"Flower {type(w).__name__}: {', '.join(items)}"

    def summary(self) -> dict[str, Any]:
        """``privacy.flower_dp`` of results.json: what ran, where its noise came from, both epsilons."""
        w = self.wrapper
        ours = self.epsilon()
        return {
            "wrapper": type(w).__name__,
            "wrapped": self.wrapped,
            "clipping": "server" if self.mod is None else f"client: Flower's {self.mod} in dpfl's client",
            "noise_multiplier": self.given_noise_multiplier,
            "noise_multiplier_on_model": float(w.noise_multiplier),
            "clipping_norm": float(w.clipping_norm),
            "num_sampled_clients": self.m,
            "weighted_by": getattr(w.strategy, "weighted_by_key", None),
            "noise_source": (
                "numpy's global generator (Flower's add_gaussian_noise_inplace), seeded for each release "
                f"from the privacy randomness (purpose {NOISE_PURPOSE!r}) and restored after"
            ),
            "flower": {
                "epsilon": self.flower_epsilon(),
                "delta": self.run.settings.privacy.delta,
                "releases": self.flower_releases(),
                "accounting": "Flower's RdpAccountant: Gaussian(z) per release for every client",
                "why_null": self.why_flower_has_none(),
            },
            "dpfl": {
                "epsilon": None if ours is None else ours.epsilon,
                "delta": self.run.settings.privacy.delta,
                "accounting": self.accounting_text(),
                "why_null": self.why_no_epsilon(),
            },
        }

    def accounting_text(self) -> str:
        """What dpfl composes, in words."""
        if self.kind == "fixed":
            return "Gaussian(z n / m) per release for each client in its cohort (n replies averaged)"
        return (
            "per release, for each client in its cohort: Gaussian(clipped_count_stddev) for the count and "
            "Gaussian(z_model r n / m) for the model, r the least ratio of the new clipping norm to the "
            "one the updates were clipped to unless the count's noise is in its tail (delta / 2 of "
            "delta goes to the tail)"
        )


def unproven_reason(wrapped: str, kwargs: Mapping[str, Any]) -> str | None:
    """Why no bound covers the wrapper's releases whatever happens in the run (None: dpfl proves one)."""
    inner_class = flower_class(wrapped)
    if getattr(inner_class, "aggregate_train", None) is not flower_strategies.FedAvg.aggregate_train:
        return (
            f"Flower adds its noise after {wrapped}'s own aggregate_train (a server step that keeps "
            "un-noised state): the release's sensitivity to one client is not the C / m the noise is "
            "sized for; strategy=dp_flower noises the average before the server step"
        )
    weighting = weighted_by(inner_class, kwargs)
    if weighting not in (None, UNIFORM_WEIGHT):
        return (
            f"the average is weighted by {weighting!r}: a client's weight comes from its own data and "
            "can reach the whole average, while Flower's noise is sized for 1 / m of it"
        )
    return None


__all__ = [
    "ACCOUNTANTS",
    "WRAPPERS",
    "DPArguments",
    "WrapperRun",
    "build_wrapper",
    "check_dp_arguments",
    "check_not_wrapped",
    "check_wrapper",
    "wrapper_kind",
]
