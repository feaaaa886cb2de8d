"""DP-FedAvg: central differential privacy with fixed clipping (the DP baseline).

McMahan, Ramage, Talwar, Zhang, "Learning Differentially Private Recurrent
Language Models", ICLR 2018 (Algorithm 1, the fixed-denominator estimator), and
Geyer, Klein, Nabi 2017. Each round:

1. every client joins independently with probability ``q = clients_per_round / N``
   (``strategy.sampling=poisson``), or exactly ``clients_per_round`` clients are
   drawn (``fixed``), or the cohorts follow a public balanced schedule (``balanced``: each client
   once per pass over the population, as DP-FTRL's and the distributed-DP strategy's);
2. each selected client trains locally and returns its model; the server clips
   each update ``Delta_k = w_k - w_t`` to L2 norm ``C`` (``strategy.clip``):
   ``Delta_k <- Delta_k min(1, C / ||Delta_k||)``;
3. the server releases ``w_{t+1} = w_t + (sum_k Delta_k + N(0, z^2 C^2 I)) / W``
   with the fixed denominator ``W = qN`` (Poisson) or ``W = clients_per_round``
   (fixed). Every client has weight 1 (uniform weighting: weighting by example
   counts would let one client's weight exceed the clipping bound).

Privacy: unit = one client's entire data set (add or remove one client; a failed
or absent client contributes a zero update, so the sensitivity of the sum stays
C). Central DP: the server sees clipped, un-noised updates and is trusted.
Poisson sampling: one ``SampledGaussian(z, q)`` event per round covering every
client (amplification by sampling, Mironov, Talwar, Zhang 2019). Amplification
needs a cohort the adversary cannot predict, so the Poisson coins come from the
privacy randomness ``run.noise`` (OS entropy with ``privacy.secure_rng`` and
always on devices), never from the public ``seed``; a seeded simulation says in
``privacy.randomness`` that its cohort is reproducible and that the epsilon
describes a deployment with a secret cohort. Failures are then logged without
naming the client. Fixed-size sampling: one ``Gaussian(z)`` event per round for
the selected clients (no amplification is credited; the cohort may be public); ``fixed`` is
calibrated as if a client took part in every round, ``balanced`` for the rounds the busiest client
of its schedule takes part in (the central counterpart of ``strategy=dp_fedavg_secagg``: same
schedule, no amplification, the server trusted).
Unless ``strategy.noise_multiplier`` is set, ``z`` is calibrated with the same
accountant so that the worst client's epsilon after ``num_rounds`` is at most
``privacy.epsilon``.

**The large-cohort convention** (``strategy.noise_cohort_size=M``, pfl-research's
``noise_cohort_size``): the run simulates a deployment that samples secret Poisson cohorts of expected
size ``M`` from ``P`` clients (``strategy.noise_population``, default ``num_clients``; ``q = M / P``),
adds ``N(0, z^2 C^2 I)`` to the sum of their clipped updates and divides by ``M``. The run itself
draws public fixed-size cohorts of ``m = clients_per_round < M`` (``strategy.sampling=fixed``), adds
noise of std ``z C m / M`` to their sum (:func:`~fl_app.privacy.calibration.large_cohort_noise_multiplier`)
and divides by ``m``: its average carries the deployment's noise ``z C / M``, at a fraction of its
cost. ``z`` is calibrated for the deployment and the accountant records its ``SampledGaussian(z, q)``
per round for every client, so the epsilon holds for that deployment, not for this run's model, and
every place that prints it says so (:meth:`DPFedAvgStrategy.epsilon_holds_for`). Secret Poisson cohorts
are refused with it: the run would keep a secret cohort and its amplification for an epsilon that is
not its own. Real devices are refused: their cohort is the deployment.

Released: the noised model only. The clients' train losses stay on the server,
and the update norms (a tuning aid for ``C``) are un-noised: they go to
``outside_guarantee`` with ``privacy.diagnostics=true`` in a simulation, nowhere
else. Federated evaluation is refused (:meth:`FederatedStrategy.validate_releases`).

Why not Flower's ``DifferentialPrivacyServerSideFixedClipping`` wrapper: its
noise comes from the global ``np.random`` (not seeded, not secure), it averages
with the inner strategy's example weights unless every weight is equal, it
skips the whole round's aggregation when a single client fails, and its
accountant credits no sampling amplification. The clipping and noising
themselves are the same operations, taken from :mod:`fl_app.privacy`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, MetricRecord
from flwr.common import log

from fl_app.config.checks import ConfigError, require_int
from fl_app.config.settings import RunSettings
from fl_app.learning.sums import ClippedUpdate
from fl_app.learning.training import array_values
from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.calibration import dp_fedavg_noise_multiplier, large_cohort_noise_multiplier
from fl_app.privacy.events import Gaussian, PrivacyEvent, SampledGaussian
from fl_app.privacy.fixed_noise import FixedNoise
from fl_app.privacy.mechanisms import gaussian_mechanism
from fl_app.run.context import RunContext
from fl_app.run.roster import ClientInfo, on_devices
from strategies import register_strategy
from strategies.base import RecentRounds, Replies
from strategies.cohorts import max_participations
from strategies.contract import Declaration, QuickExample
from strategies.private import PrivateStrategy
from strategies.settings import CHECK, StrategySettings, one_of, positive

SAMPLINGS = ("poisson", "fixed", "balanced")


def _optional_count(key: str, value: Any) -> int | None:
    """Null, or an integer >= 2 (a cohort, a population)."""
    return None if value is None else require_int(key, value, minimum=2)


@dataclass(frozen=True)
class DPFedAvgSettings(StrategySettings):
    """``cfg.strategy`` of ``dp_fedavg`` (``conf/strategy/dp_fedavg.yaml`` explains each key)."""

    clip: float = positive()
    noise_multiplier: float | None = positive(optional=True)
    sampling: str = one_of(SAMPLINGS)
    # keyword-only, with defaults: a subclass's settings may add keys without defaults after them
    noise_cohort_size: int | None = field(default=None, kw_only=True, metadata={CHECK: _optional_count})
    noise_population: int | None = field(default=None, kw_only=True, metadata={CHECK: _optional_count})

    def check(self, run: RunSettings) -> None:
        """The large-cohort convention's constraints (:func:`check_large_cohort`)."""
        check_large_cohort(self, run)


def check_large_cohort(settings: DPFedAvgSettings, run: RunSettings) -> None:
    """``strategy.noise_cohort_size``: fixed cohorts smaller than it, a population that holds it.

    Raises :class:`ConfigError` naming the key, the value and what is allowed.
    """
    size, population = settings.noise_cohort_size, settings.noise_population
    if size is None:
        if population is not None:
            raise ConfigError(
                "strategy.noise_population",
                population,
                "is the population of strategy.noise_cohort_size's "
                "deployment: set strategy.noise_cohort_size too, or leave it null",
            )
        return
    if settings.sampling != "fixed":
        raise ConfigError(
            "strategy.noise_cohort_size",
            size,
            f"needs strategy.sampling=fixed (got {settings.sampling}): "
            "the run simulates a deployment with cohorts of this size, so its own cohorts are public and "
            "fixed-size; with secret Poisson cohorts it would keep a secrecy and an amplification for an "
            "epsilon that is not its own",
        )
    if size <= run.cohort:
        raise ConfigError(
            "strategy.noise_cohort_size",
            size,
            f"must exceed the simulated cohort (clients_per_round gives "
            f"{run.cohort}): it is the larger cohort the noise is calibrated for",
        )
    if run.privacy.canaries:
        raise ConfigError(
            "privacy.canaries",
            run.privacy.canaries,
            "must be 0 with strategy.noise_cohort_size: the canaries measure this run's model, whose "
            "release the deployment's epsilon does not cover (its noise is smaller by cohort / "
            "noise_cohort_size)",
        )
    deployed = population if population is not None else run.num_clients
    if size > deployed:
        key, value = (
            ("strategy.noise_population", population) if population is not None else ("num_clients", deployed)
        )
        raise ConfigError(
            key,
            value,
            f"must hold a cohort of strategy.noise_cohort_size={size} (set "
            "strategy.noise_population, the deployment's clients, to at least that)",
        )


@dataclass(frozen=True)
class SimulatedDeployment:
    """The deployment a run with ``strategy.noise_cohort_size`` stands for (the large-cohort convention).

    Attributes
    ----------
    cohort : int
        ``m``: this run's fixed cohort.
    noise_cohort_size : int
        ``M``: the deployment's expected (Poisson) cohort.
    population : int
        ``P``: the deployment's clients.

    """

    cohort: int
    noise_cohort_size: int
    population: int

    @property
    def rate(self) -> float:
        """``q = M / P``: the deployment's sampling rate."""
        return self.noise_cohort_size / self.population

    def statement(self) -> str:
        """What every place that prints the run's epsilon says about it."""
        return (
            f"simulates a deployment with cohorts of {self.noise_cohort_size}: the epsilon holds for that "
            "deployment, not for this run's model"
        )

    def as_dict(self, *, noise_multiplier: float) -> dict[str, Any]:
        """The results' ``privacy.simulated_deployment`` object."""
        on_sum = large_cohort_noise_multiplier(
            noise_multiplier=noise_multiplier, cohort=self.cohort, noise_cohort_size=self.noise_cohort_size
        )
        return {
            "statement": self.statement(),
            "noise_cohort_size": self.noise_cohort_size,
            "population": self.population,
            "sampling": f"secret Poisson cohorts, q = {self.noise_cohort_size}/{self.population}",
            "sampling_rate": self.rate,
            "noise_multiplier": noise_multiplier,
            "this_run": (
                f"public fixed cohorts of {self.cohort}, noise multiplier z x {self.cohort}/"
                f"{self.noise_cohort_size} = {on_sum:.6g} on their sum: no epsilon of this run covers "
                "its model"
            ),
        }


@register_strategy("dp_fedavg")
class DPFedAvgStrategy(PrivateStrategy):
    """Central-DP FedAvg with server-side fixed clipping and seeded Gaussian noise."""

    declaration = Declaration(
        name="dp_fedavg",
        paper="McMahan, Ramage, Talwar, Zhang, ICLR 2018 (DP-FedAvg, Algorithm 1)",
        unit="one client's entire data set (add or remove one client), central DP",
        mechanism="Gaussian noise on the sum of clipped model updates",
        client="fedavg",  # plain local training: clipping and noise run on the server
        settings=DPFedAvgSettings,
        canaries=None,
        quick=QuickExample(
            overrides=(
                "num_clients=1000",
                "clients_per_round=100",
                "num_rounds=100",
                "privacy.epsilon=8.0",
            ),
            suite_rounds=15,
            suite_overrides=("privacy.diagnostics=true",),
            about=(
                "DP-FedAvg at epsilon 8 per client (delta 1e-5) in the cross-device shape it needs: 1000 "
                "clients, Poisson cohorts of expected size 100 (amplification), 100 rounds"
            ),
        ),
        comparisons=("comparison", "cross_device"),
    )
    settings: DPFedAvgSettings
    ROUND_STATE = (*PrivateStrategy.ROUND_STATE, "_norms")  # un-noised: never checkpointed

    def __init__(self, run: RunContext, settings: DPFedAvgSettings | None = None) -> None:
        super().__init__(run, settings)
        settings = self.settings
        self.clip = settings.clip
        self.sampling = settings.sampling
        self.deployment = simulated_deployment(settings, run)
        self.rate = run.clients_per_round / run.num_clients
        rounds = self.run.settings.num_rounds
        if self.sampling == "balanced":
            self.cohorts.plan(self.cohorts.seeded_schedule(rounds, balanced=True))
            rounds = max_participations(self.cohorts.planned)
        #: The worst client's accounted releases over the planned rounds (what the noise is calibrated for).
        self.accounted_rounds = rounds
        if settings.noise_multiplier is not None:
            self.noise_multiplier = settings.noise_multiplier
        else:
            self.noise_multiplier = dp_fedavg_noise_multiplier(
                epsilon=self.run.settings.privacy.epsilon,
                delta=run.settings.privacy.delta,
                sampling_rate=self.accounted_rate,
                rounds=rounds,
                method=self.run.settings.privacy.accountant,
            )
        #: The noise multiplier on the sum of this run's cohort (``z``; ``z m / M`` for a deployment).
        self.sum_noise_multiplier = (
            self.noise_multiplier
            if self.deployment is None
            else large_cohort_noise_multiplier(
                noise_multiplier=self.noise_multiplier,
                cohort=run.clients_per_round,
                noise_cohort_size=self.deployment.noise_cohort_size,
            )
        )
        self.denominator = (
            self.rate * run.num_clients if self.sampling == "poisson" else float(run.clients_per_round)
        )
        self.accountant = PrivacyAccountant(
            population=run.client_ids, unit=self.privacy_unit, method=self.run.settings.privacy.accountant
        )
        self.secret_cohort = self.sampling == "poisson"
        self._norms: dict[int, list[float]] = RecentRounds()
        log(
            INFO,
            "DP-FedAvg: noise multiplier z=%.4f, clip C=%g, sampling=%s (q=%.4f)",
            self.noise_multiplier,
            self.clip,
            self.sampling,
            self.rate,
        )
        if self.deployment is not None:
            log(
                INFO,
                "DP-FedAvg: z for the deployment's Poisson cohorts of %d of %d clients (q=%.4g); noise "
                "multiplier z x %d/%d = %.4g on the sum of this run's cohort of %d; %s",
                self.deployment.noise_cohort_size,
                self.deployment.population,
                self.deployment.rate,
                run.clients_per_round,
                self.deployment.noise_cohort_size,
                self.sum_noise_multiplier,
                run.clients_per_round,
                self.deployment.statement(),
            )

    @property
    def accounted_rate(self) -> float:
        """The sampling rate the accountant credits: q (Poisson), the deployment's, else 1 (none)."""
        if self.deployment is not None:
            return self.deployment.rate
        return self.rate if self.sampling == "poisson" else 1.0

    def select_clients(self, server_round: int) -> list[ClientInfo]:
        """Poisson sampling (each client w.p. q, secret coins from ``run.noise``), fixed-size or planned."""
        if self.sampling != "poisson":
            return super().select_clients(server_round)
        return self.cohorts.poisson(server_round, self.rate)

    def summand(self, server_round: int) -> ClippedUpdate:
        """Each client's update clipped to the round's bound: the aggregation sums them."""
        return ClippedUpdate(clip=self.clip)

    def aggregate(
        self, server_round: int, replies: Replies
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Clip each update, add noise to the sum, divide by the fixed denominator."""
        global_arrays = self.round_global
        names, reference, total, norms = self.clipped_update_sum(
            replies, max_norm=self.clip, server_round=server_round
        )
        rng = self.run.noise.generator("central-noise", server_round=server_round)
        sigma = self.sum_noise_multiplier * self.clip
        noised = [gaussian_mechanism(values=t, sigma=sigma, rng=rng) for t in total]
        new = {
            n: Array(np.asarray(r + s / self.denominator, dtype=array_values(global_arrays[n]).dtype))
            for n, r, s in zip(names, reference, noised, strict=True)
        }
        self._record_release(server_round)
        self._norms[server_round] = norms
        # No train loss (nor anything else computed from the clients' data) in the metrics: Flower
        # logs them, and they are not noised.
        return ArrayRecord(new), MetricRecord()

    def _record_release(self, server_round: int) -> None:
        assert self.accountant is not None
        if self.deployment is not None:  # the deployment's Poisson cohort: every client, each round
            rate = self.deployment.rate
            event = PrivacyEvent(
                server_round,
                Gaussian(self.noise_multiplier)
                if rate >= 1.0
                else SampledGaussian(self.noise_multiplier, rate),
                participants=None,
                label=f"central release (a deployment's cohorts of {self.deployment.noise_cohort_size})",
            )
        elif self.sampling == "poisson":
            event = PrivacyEvent(
                server_round,
                SampledGaussian(self.noise_multiplier, self.rate),
                participants=None,
                label="central release",
            )
        else:
            event = PrivacyEvent(
                server_round,
                Gaussian(self.noise_multiplier),
                label="central release",
                participants=tuple(c.client_id for c in self.replies.selected(server_round)),
            )
        self.accountant.record(event)

    def diagnostics(self, server_round: int) -> dict[str, Any]:
        """Update norms before clipping (a tuning aid for ``strategy.clip``): un-noised, no guarantee."""
        norms = self._norms.get(server_round, [])
        return {
            "update_norm_median": float(np.median(norms)) if norms else None,
            "clipped_fraction": float(np.mean(np.array(norms) > self.clip)) if norms else None,
        }

    def cohort_randomness(self) -> str:
        """Poisson cohorts come from the privacy randomness; fixed-size and balanced ones are public."""
        if self.sampling != "poisson":
            return super().cohort_randomness()
        return (
            "secret: Poisson coins drawn from the privacy randomness (run.noise), as amplification by "
            "sampling requires; see `source` for whether that randomness is secret"
        )

    def privacy_summary(self) -> dict[str, Any]:
        """Unit, mechanism, accountant and the calibrated noise (and the simulated deployment)."""
        summary = {
            **super().privacy_summary(),
            "noise_multiplier": self.noise_multiplier,
            "clip": self.clip,
            "sampling": self.sampling,
            "sampling_rate": self.rate,
            "denominator": self.denominator,
        }
        if self.deployment is not None:
            summary["simulated_deployment"] = self.deployment.as_dict(noise_multiplier=self.noise_multiplier)
        return summary

    def fixed_noise(self) -> FixedNoise | None:
        """``strategy.noise_multiplier`` set: the epsilon its planned rounds reach (None: calibrated)."""
        if self.settings.noise_multiplier is None:
            return None
        return self.planned_gaussian(
            "strategy.noise_multiplier",
            noise_multiplier=self.noise_multiplier,
            sampling_rate=self.accounted_rate,
            participations=self.accounted_rounds,
        )

    def epsilon_holds_for(self) -> str | None:
        """The large-cohort convention's statement (None: the epsilon is this run's)."""
        return None if self.deployment is None else self.deployment.statement()

    def budget_text(self) -> str:
        """The budget asked for, and with ``strategy.noise_cohort_size`` whose epsilon it is."""
        text = super().budget_text()
        return text if self.deployment is None else f"{text}; {self.deployment.statement()}"


def simulated_deployment(settings: DPFedAvgSettings, run: RunContext) -> SimulatedDeployment | None:
    """The deployment ``strategy.noise_cohort_size`` describes (None: not set); refused on real devices."""
    if settings.noise_cohort_size is None:
        return None
    if on_devices(run.roster):
        raise ConfigError(
            "strategy.noise_cohort_size",
            settings.noise_cohort_size,
            "is a simulation convention: on real devices the cohort is the deployment's own, and noise "
            "scaled down for a larger one would leave it under-noised; leave it null",
        )
    return SimulatedDeployment(
        cohort=run.clients_per_round,
        noise_cohort_size=settings.noise_cohort_size,
        population=settings.noise_population or run.num_clients,
    )
