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

from dataclasses import dataclass
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, MetricRecord
from flwr.common import log

from fl_app.learning.sums import ClippedUpdate
from fl_app.learning.training import array_values
from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.calibration import dp_fedavg_noise_multiplier
from fl_app.privacy.events import Gaussian, PrivacyEvent, SampledGaussian
from fl_app.privacy.mechanisms import gaussian_mechanism
from fl_app.run.context import RunContext
from fl_app.run.roster import ClientInfo
from strategies import register_strategy
from strategies.base import RecentRounds, Replies
from strategies.cohorts import max_participations
from strategies.contract import Declaration, QuickExample
from strategies.private import PrivateStrategy
from strategies.settings import StrategySettings, one_of, positive

SAMPLINGS = ("poisson", "fixed", "balanced")


@dataclass(frozen=True)
class DPFedAvgSettings(StrategySettings):
    """``cfg.strategy`` of ``dp_fedavg`` (``conf/strategy/dp_fedavg.yaml`` explains each key)."""

    clip: float = positive()
    noise_multiplier: float | None = positive(optional=True)
    sampling: str = one_of(SAMPLINGS)


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
        self.rate = run.clients_per_round / run.num_clients
        rounds = self.run.settings.num_rounds
        if self.sampling == "balanced":
            self.cohorts.plan(self.cohorts.seeded_schedule(rounds, balanced=True))
            rounds = max_participations(self.cohorts.planned)
        if settings.noise_multiplier is not None:
            self.noise_multiplier = settings.noise_multiplier
        else:
            self.noise_multiplier = dp_fedavg_noise_multiplier(
                epsilon=self.run.settings.privacy.epsilon,
                delta=run.settings.privacy.delta,
                sampling_rate=self.rate if self.sampling == "poisson" else 1.0,
                rounds=rounds,
                method=self.run.settings.privacy.accountant,
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
        sigma = self.noise_multiplier * self.clip
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
        if self.sampling == "poisson":
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
        """Unit, mechanism, accountant and the calibrated noise."""
        return {
            **super().privacy_summary(),
            "noise_multiplier": self.noise_multiplier,
            "clip": self.clip,
            "sampling": self.sampling,
            "sampling_rate": self.rate,
            "denominator": self.denominator,
        }
