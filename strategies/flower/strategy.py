"""``strategy=flower``: its settings and the registered strategy (the adapter; Flower's DP wrappers)."""

from __future__ import annotations

import copyreg
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid, RdpAccountant

from fl_app import keys
from fl_app.config.checks import ConfigError
from fl_app.config.settings import RunSettings
from fl_app.privacy.composition import EpsilonReport
from fl_app.privacy.fixed_noise import FixedNoise
from fl_app.run.context import RunContext
from fl_app.run.lifecycle import RunFailed
from fl_app.run.text import epsilon_text
from strategies import register_strategy
from strategies.contract import Declaration, QuickExample
from strategies.flower.adapter import FlowerRounds, build_flower_strategy, flower_class
from strategies.flower.dp import (
    UNIT,
    DPArguments,
    WrapperRun,
    check_dp_arguments,
    check_not_wrapped,
    check_wrapper,
    unproven_reason,
    wrapper_kind,
)
from strategies.private import PrivateStrategy
from strategies.reporting import RunReport
from strategies.settings import CHECK, StrategySettings, setting


def check_flower(key: str, value: Any) -> str:
    """A Flower strategy class name (``strategy.flower``)."""
    if not isinstance(value, str) or not value:
        raise ConfigError(key, value, "must name a Flower strategy class, e.g. FedAdam")
    try:
        flower_class(value)
    except ValueError as error:
        raise ConfigError(key, value, str(error)) from None
    return value


def check_kwargs(key: str, value: Any) -> dict[str, Any]:
    """Keyword arguments of the Flower strategy's constructor (``strategy.kwargs``)."""
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise ConfigError(key, value, "must be a mapping of keyword arguments, e.g. {eta: 0.01}")
    return dict(value)


@dataclass(frozen=True)
class FlowerSettings(StrategySettings):
    """``cfg.strategy`` of ``flower`` (``conf/strategy/flower.yaml``)."""

    flower: str = setting(check_flower)
    kwargs: dict[str, Any] = field(default_factory=dict, metadata={CHECK: check_kwargs})
    wrapped: str | None = setting(check_flower, optional=True, default=None)
    dp: DPArguments = field(default_factory=DPArguments, metadata={CHECK: check_dp_arguments})

    @property
    def is_wrapper(self) -> bool:
        """Whether ``flower`` is one of Flower's DP wrappers."""
        return wrapper_kind(flower_class(self.flower)) is not None

    def check(self, run: Any) -> None:
        """The class must take the keyword arguments (built once here, one line if not)."""
        if self.is_wrapper:
            check_wrapper(self.flower, self.wrapped, self.kwargs, self.dp, run)
            return
        check_not_wrapped(self.flower, self.wrapped, self.dp)
        try:
            build_flower_strategy(self.flower, self.kwargs, lr=run.lr)
        except ValueError as error:
            raise ConfigError("strategy.kwargs", self.kwargs, str(error)) from None


def proven(settings: RunSettings) -> bool:
    """Whether dpfl proves an epsilon for a run with ``settings`` (a DP wrapper around FedAvg's average)."""
    own = settings.strategy_settings
    if not isinstance(own, FlowerSettings) or not own.is_wrapper:
        return False
    return unproven_reason(own.wrapped or "FedAvg", own.kwargs) is None


@register_strategy("flower")
class FlowerStrategy(PrivateStrategy):
    """A Flower strategy's configure/aggregate on dpfl's cohorts, clients and reports."""

    declaration = Declaration(
        name="flower",
        paper=(
            "Flower's strategies (flwr.serverapp.strategy): e.g. FedProx (Li et al., MLSys 2020), "
            "FedAdam/FedYogi/FedAdagrad (Reddi et al., ICLR 2021), FedAvgM (Hsu et al., 2019); its DP "
            "wrappers (McMahan et al., ICLR 2018; Andrew et al., NeurIPS 2021)"
        ),
        unit="none",
        mechanism="none",
        client="flower",
        settings=FlowerSettings,
        canaries="is not private, or runs Flower's DP code: there is no dpfl claim to check",
        private=proven,
        quick=QuickExample(
            overrides=(
                "num_clients=100",
                "clients_per_round=10",
                "num_rounds=20",
                "strategy.flower=FedAdam",
                "++strategy.kwargs={eta: 0.01, beta_1: 0.9, beta_2: 0.99, tau: 0.001}",
            ),
            suite_rounds=4,
            about="Flower's FedAdam (not private), 100 clients, 10 per round, 20 rounds",
        ),
    )
    settings: FlowerSettings

    def __init__(self, run: RunContext, settings: FlowerSettings | None = None) -> None:
        super().__init__(run, settings)
        own = self.settings
        self.dp: WrapperRun | None = None
        if own.is_wrapper:
            self.dp = WrapperRun(run, own.flower, own.wrapped, own.kwargs, own.dp)
            self.flower = FlowerRounds(self.dp.wrapper)
            self.accountant = self.dp.accountant
            if self.accountant is not None:
                self.privacy_unit = UNIT
            self.mechanism_name = f"Flower's {own.flower} around {self.dp.wrapped}"
        else:
            self.flower = FlowerRounds(build_flower_strategy(own.flower, own.kwargs, lr=run.settings.lr))

    def extra_train_config(self, server_round: int) -> dict[str, Any]:
        """A client-side DP wrapper's clients: the Flower mod that clips."""
        return {} if self.dp is None else self.dp.extra_config()

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The cohort and train config dpfl draws; the Flower strategy's messages."""
        clients = self._begin_round(server_round, arrays)
        return self.flower.configure(
            server_round,
            self.records_for_clients(server_round, arrays)[keys.ARRAYS],
            self.train_config(server_round, config),
            [c.node_id for c in clients],
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The Flower strategy's aggregate of the valid replies (a DP wrapper's: noised, accounted)."""
        valid, _ = self.replies.split(server_round, replies)
        if not valid:
            return None, None
        messages = [message for _, message in valid]
        if self.dp is None:
            return self.flower.aggregate(server_round, messages, like=self.round_global)
        self.dp.check_clipping(server_round, messages, self.round_global)
        try:
            with self.dp.noise(server_round):
                arrays, _ = self.flower.aggregate(server_round, messages, like=self.round_global)
        except ZeroDivisionError:
            raise RunFailed(
                f"round {server_round}: a client's update is exactly zero, and Flower's clipping divides by "
                f"the update's norm (flwr's {type(self.dp.wrapper).__name__} cannot aggregate the round)"
            ) from None
        if arrays is not None:
            selected = tuple(info.client_id for info in self.replies.selected(server_round))
            self.dp.record(server_round, selected, len(messages))
        # Flower's aggregated train metrics (losses, counts) are un-noised: they stay on the server
        return arrays, MetricRecord()

    def epsilon(self) -> EpsilonReport | None:
        """The epsilon dpfl proves for a DP wrapper's releases (None: not private, or no bound it proves)."""
        return None if self.dp is None else self.dp.epsilon()

    def round_extras(self, server_round: int) -> dict[str, Any]:
        """A DP wrapper's round: the epsilon Flower's own accountant reports (None: it has none)."""
        return {} if self.dp is None else {"flower_epsilon": self.dp.flower_epsilon()}

    def final_extras(self) -> dict[str, Any]:
        """A DP wrapper's run: Flower's epsilon beside dpfl's (``final.epsilon``)."""
        return {} if self.dp is None else {"flower_epsilon": self.dp.flower_epsilon()}

    def privacy_summary(self) -> dict[str, Any]:
        """The unit, mechanism and accountant; with a DP wrapper, ``flower_dp`` (both epsilons, why)."""
        summary = super().privacy_summary()
        return summary if self.dp is None else {**summary, "flower_dp": self.dp.summary()}

    def report_run(self, final: ArrayRecord) -> RunReport:
        """The run's report; a DP wrapper's run also logs Flower's epsilon beside dpfl's."""
        report = super().report_run(final)
        if self.dp is not None:
            delta = self.run.settings.privacy.delta
            flower = self.dp.flower_epsilon()
            if flower is None:
                log(INFO, "dpfl: Flower reports no epsilon: %s", self.dp.why_flower_has_none())
            else:
                releases = f"over {self.dp.flower_releases()} releases, every client in each"
                log(INFO, "dpfl: Flower's accountant: %s", epsilon_text(flower, delta, note=releases))
            if self.dp.epsilon() is None:
                log(WARNING, "dpfl: no epsilon dpfl can prove: %s", self.dp.why_no_epsilon())
        return report

    def fixed_noise(self) -> FixedNoise | None:
        """A DP wrapper's noise is ``strategy.dp``'s, never calibrated: what dpfl proves for the plan.

        The busiest client of the planned cohorts (seeded: known before round 1), every reply arriving.
        """
        if self.dp is None:
            return None
        rounds = self.run.settings.num_rounds
        taken = Counter(c.client_id for t in range(1, rounds + 1) for c in self.cohorts.select(t))
        setting = f"strategy.dp.noise_multiplier={self.dp.given_noise_multiplier:g}"
        return FixedNoise(setting, self.dp.planned_epsilon(max(taken.values(), default=0)), rounds)

    def describe(self) -> None:
        """The run's header: the settings that apply, and what the Flower object runs with."""
        log(INFO, "\t├──> %s: %s", type(self).__name__, self.cohort_text())
        log(INFO, "\t│\t├── strategy.name = %s", self.declaration.name)
        shown = ("flower", "kwargs", "wrapped", "dp") if self.dp is not None else ("flower", "kwargs")
        for name in shown:
            value = getattr(self.settings, name)
            if isinstance(value, DPArguments):
                value = value.given()
            elif name == "wrapped" and self.dp is not None:
                value = self.dp.wrapped
            log(INFO, "\t│\t├── strategy.%s = %s", name, value)
        if self.dp is None:
            log(INFO, "\t│\t├── %s", self.flower.settings_line())
        else:
            log(INFO, "\t│\t├── %s", self.dp.settings_line())
            log(INFO, "\t│\t├── %s", FlowerRounds(self.dp.wrapper.strategy).settings_line())
        budget = f", {self.budget_text()}" if self.dp is not None else ""
        log(INFO, "\t└──> privacy: unit=%s, mechanism=%s%s", self.privacy_unit, self.mechanism_name, budget)


def restore_accountant(config: Any, state: dict[str, Any]) -> RdpAccountant:
    """Flower's ``RdpAccountant`` from its config and state (a checkpoint keeps the strategy pickled)."""
    accountant = RdpAccountant(config)
    accountant.load_state_dict(state)
    return accountant


# Flower's accountant holds its backend's modules, which pickle refuses: it travels as its state.
copyreg.pickle(RdpAccountant, lambda a: (restore_accountant, (a.config, a.state_dict())))

__all__ = ["FlowerSettings", "FlowerStrategy", "check_flower", "check_kwargs"]
