"""DP-FedAvgM with adaptive clipping: the clip norm follows a private quantile of the update norms.

Andrew, Thakkar, McMahan, Ramaswamy, "Differentially Private Learning with
Adaptive Clipping", NeurIPS 2021, Algorithm 1 (DP-FedAvg with adaptive
clipping), run with server momentum (DP-FedAvgM: McMahan, Ramage, Talwar,
Zhang, ICLR 2018; the server optimizer of Reddi et al., "Adaptive Federated
Optimization", ICLR 2021). Each round t, with clip norm ``C_t``:

1. Poisson sampling: every client joins independently with probability
   ``q = clients_per_round / N``; the coins come from the privacy randomness
   (``run.noise``), because amplification by sampling needs a secret cohort;
2. each sampled client trains locally and returns its model; the server forms
   ``Delta_k = w_k - w_t``, the bit ``b_k = 1[||Delta_k|| <= C_t]``, and clips
   ``Delta_k <- Delta_k min(1, C_t / ||Delta_k||)``;
3. it releases ``Delta~_t = (sum_k Delta_k + N(0, z_Delta^2 C_t^2 I)) / m`` and
   ``b~_t = (sum_k (b_k - 1/2) + N(0, sigma_b^2)) / m + 1/2``, with the fixed
   denominator ``m = qN`` (the expected cohort size; every client has weight 1);
4. server momentum (``strategy.server_momentum`` beta, ``strategy.server_lr`` eta_s):
   ``v_t = beta v_{t-1} + Delta~_t``, ``w_{t+1} = w_t + eta_s v_t`` (beta = 0, eta_s = 1:
   DP-FedAvg);
5. geometric clip update towards the target quantile gamma
   (``strategy.target_quantile``, rate eta_C = ``strategy.clip_lr``):
   ``C_{t+1} = C_t exp(-eta_C (b~_t - gamma))``.

Privacy: unit = one client's entire data set (add or remove one client), central
DP (the trusted server sees clipped, un-noised updates). The paper's Theorem 1:
the update sum (sensitivity ``C_t``, noise ``z_Delta C_t``) and the centred bit sum
(sensitivity 1/2, noise ``sigma_b``) together are the Gaussian mechanism with
``z = (z_Delta^-2 + (2 sigma_b)^-2)^(-1/2)``; ``C_t`` is a function of earlier
releases only. So each round is ONE ``SampledGaussian(z, q)`` event covering every
client, exactly as DP-FedAvg. ``z`` is calibrated from ``privacy.epsilon`` for
``num_rounds`` Poisson-sampled rounds (``strategy.noise_multiplier`` overrides it),
``sigma_b`` is ``strategy.bit_noise`` (default ``m / 20``, the paper's), and
``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)``, which exists only when
``z < 2 sigma_b``; otherwise the run is refused before it starts.

Released: the noised models, and per round the clip norm and the noised
unclipped fraction (functions of the noised releases only). The clients' train
losses and update norms stay on the server.

Flower's ``DifferentialPrivacyServerSideAdaptiveClipping`` (flwr 1.41): its
noise split (``compute_adaptive_noise_params``: the same ``z_Delta`` formula and
the same ``z < 2 sigma_b`` refusal) is right, and tests check that this module
agrees with it. It is not used because:

* it counts the *clipped* updates (``norm_bit`` is true when an update was
  scaled down) and feeds that fraction to the paper's update, which expects the
  *unclipped* fraction: the clip norm moves away from the target quantile
  (shrinking further while most updates are clipped);
* it updates the clip norm before noising the round's aggregate, so the noise
  std uses ``C_{t+1}`` while the updates were clipped to ``C_t``: a round in which
  the clip norm shrinks is under-noised;
* its bits are not centred: the clipped-count sum has sensitivity 1, not the
  1/2 behind the ``2 sigma_b`` of the formula it uses;
* it divides the noisy count by the number of replies (data-dependent under
  Poisson sampling) instead of the expected cohort size;
* and, as its fixed-clipping sibling (see :mod:`strategies.dp_fedavg`): noise from
  the global ``np.random``, the inner strategy's example weights, the whole
  round skipped when one client fails, and no accounting.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, MetricRecord
from flwr.common import log

from fl_app.config.checks import ConfigError
from fl_app.config.settings import RunSettings
from fl_app.learning.sums import ClippedUpdate
from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.calibration import dp_fedavg_noise_multiplier
from fl_app.privacy.checks import require_positive
from fl_app.privacy.events import (
    PrivacyEvent,
    SampledGaussian,
)
from fl_app.privacy.fixed_noise import FixedNoise
from fl_app.privacy.mechanisms import gaussian_mechanism
from fl_app.run.context import RunContext
from fl_app.run.roster import ClientInfo
from strategies import register_strategy
from strategies.arrays import ServerMomentum, arrays_like
from strategies.base import Replies
from strategies.contract import Declaration, QuickExample
from strategies.private import PrivateStrategy
from strategies.settings import StrategySettings, between, positive

# --------------------------------------------------------------------------------------
# Adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021)
# --------------------------------------------------------------------------------------


def adaptive_clipping_default_bit_noise(*, expected_clients: float) -> float:
    """The paper's default std of the noise on the clipped-count sum: ``sigma_b = m / 20``.

    ``m`` is the expected number of clients per round; the noisy fraction then
    has std 0.05 (Andrew et al. 2021, Section 3).
    """
    require_positive("expected_clients", expected_clients)
    return expected_clients / 20.0


def adaptive_clipping_effective_noise_multiplier(
    *, update_noise_multiplier: float, bit_noise: float
) -> float:
    """``z = (z_Delta^-2 + (2 sigma_b)^-2)^(-1/2)`` (Andrew et al. 2021, Theorem 1).

    One round releases the noised sum of updates clipped to C (noise std
    ``z_Delta C``, sensitivity C) and the noised sum of the centred bits
    ``b_k - 1/2`` (noise std ``sigma_b``, sensitivity 1/2): jointly the Gaussian
    mechanism with noise multiplier ``z`` (add or remove one client).
    """
    require_positive("update_noise_multiplier", update_noise_multiplier)
    require_positive("bit_noise", bit_noise)
    return (update_noise_multiplier**-2 + (2.0 * bit_noise) ** -2) ** -0.5


def adaptive_clipping_update_noise_multiplier(*, noise_multiplier: float, bit_noise: float) -> float:
    """``z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2)``: the update noise that makes the round's release ``z``.

    Inverse of :func:`adaptive_clipping_effective_noise_multiplier`. Possible
    only when ``z < 2 sigma_b`` (the bit release alone must already be at least
    as private as the whole round); raises ``ValueError`` otherwise.
    """
    require_positive("noise_multiplier", noise_multiplier)
    require_positive("bit_noise", bit_noise)
    if noise_multiplier >= 2.0 * bit_noise:
        raise ValueError(
            f"noise_multiplier={noise_multiplier} needs bit_noise > {noise_multiplier / 2} "
            f"(z < 2 sigma_b), got {bit_noise}"
        )
    return (noise_multiplier**-2 - (2.0 * bit_noise) ** -2) ** -0.5


@dataclass(frozen=True)
class AdaptiveClippingSettings(StrategySettings):
    """``cfg.strategy`` of ``dp_fedavg_adaptive``, names as in the paper (the conf explains each key)."""

    initial_clip: float = positive()  # C_0
    target_quantile: float = between(0.0, 1.0, low_open=True, high_open=True)  # gamma
    clip_lr: float = positive()  # eta_C
    noise_multiplier: float | None = positive(optional=True)  # the round's effective z
    bit_noise: float | None = positive(optional=True)  # sigma_b
    server_lr: float = positive()  # eta_s
    server_momentum: float = between(0.0, 1.0, high_open=True)  # beta

    budget_scopes = ("total",)  # calibrated for the whole run

    def check(self, run: RunSettings) -> None:
        """The noise split must exist (``z < 2 sigma_b``)."""
        noise_plan(run, self)


@dataclass(frozen=True)
class NoisePlan:
    """The round's noise: effective ``z``, its split into ``z_Delta`` and ``sigma_b``, and ``q``."""

    noise_multiplier: float
    update_noise_multiplier: float
    bit_noise: float
    sampling_rate: float
    expected_clients: float


@functools.lru_cache(maxsize=64)
def _calibrated(epsilon: float, delta: float, rate: float, rounds: int, method: str) -> float:
    """DP-FedAvg's calibration (cached: ``validate_config`` and ``__init__`` both need it)."""
    return dp_fedavg_noise_multiplier(
        epsilon=epsilon, delta=delta, sampling_rate=rate, rounds=rounds, method=method
    )


def noise_plan(run: RunSettings, settings: AdaptiveClippingSettings) -> NoisePlan:
    """Calibrate ``z`` and split it (Andrew et al. Theorem 1); :class:`ConfigError` if impossible."""
    num_clients = run.num_clients
    expected = float(run.cohort)
    rate = expected / num_clients
    if settings.noise_multiplier is not None:
        z = settings.noise_multiplier
        source = "strategy.noise_multiplier"
    else:
        z = _calibrated(run.privacy.epsilon, run.privacy.delta, rate, run.num_rounds, run.privacy.accountant)
        source = f"calibrated from privacy.epsilon={run.privacy.epsilon:g}"
    default = adaptive_clipping_default_bit_noise(expected_clients=expected)
    bit_noise = settings.bit_noise if settings.bit_noise is not None else default
    if z >= 2.0 * bit_noise:
        raise ConfigError(
            "strategy.bit_noise",
            settings.bit_noise,
            f"sigma_b={bit_noise:.4g} must exceed z/2={z / 2:.4g} (z={z:.4g}, {source}): the clipped-count "
            f"release alone would cost more than the whole round (Andrew et al. Theorem 1 needs "
            f"z < 2 sigma_b); the default, expected clients per round / 20 = {default:.4g}, suits large "
            "cohorts: set strategy.bit_noise larger or sample more clients per round",
        )
    return NoisePlan(
        noise_multiplier=z,
        update_noise_multiplier=adaptive_clipping_update_noise_multiplier(
            noise_multiplier=z, bit_noise=bit_noise
        ),
        bit_noise=bit_noise,
        sampling_rate=rate,
        expected_clients=expected,
    )


@register_strategy("dp_fedavg_adaptive")
class DPFedAvgAdaptiveStrategy(PrivateStrategy):
    """Central-DP FedAvg with server momentum and a privately adapted clip norm."""

    declaration = Declaration(
        name="dp_fedavg_adaptive",
        paper="Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021 (DP-FedAvgM with adaptive clipping)",
        unit="one client's entire data set (add or remove one client), central DP",
        mechanism=(
            "Gaussian noise on the sum of clipped model updates and on the count of unclipped updates "
            "(adaptive clipping), Poisson-sampled cohorts"
        ),
        client="fedavg",  # plain local training: the bits, the clipping and the noise run on the server
        settings=AdaptiveClippingSettings,
        canaries=None,
        quick=QuickExample(
            overrides=(
                "num_clients=1000",
                "clients_per_round=100",
                "num_rounds=100",
                "privacy.epsilon=8.0",
            ),
            suite_rounds=15,
            about=(
                "DP-FedAvgM with adaptive clipping at epsilon 8 per client (delta 1e-5), cross-device: 1000"
                " clients, Poisson cohorts of expected size 100, 100 rounds"
            ),
        ),
        comparisons=("cross_device",),
        deploy=("strategy.bit_noise=1.0",),
    )
    settings: AdaptiveClippingSettings

    def __init__(self, run: RunContext, settings: AdaptiveClippingSettings | None = None) -> None:
        super().__init__(run, settings)
        self.secret_cohort = True  # amplification by sampling needs the cohort secret
        self.plan = noise_plan(run.settings, self.settings)
        self.clip = self.settings.initial_clip
        self.accountant = PrivacyAccountant(
            population=run.client_ids, unit=self.privacy_unit, method=self.run.settings.privacy.accountant
        )
        self.server_optimizer = ServerMomentum(
            lr=self.settings.server_lr, momentum=self.settings.server_momentum
        )
        self._rounds: dict[int, dict[str, float]] = {}
        log(
            INFO,
            "DP-FedAvg adaptive clipping: z=%.4f (z_Delta=%.4f, sigma_b=%.4g), q=%.4f, C_0=%g, gamma=%g",
            self.plan.noise_multiplier,
            self.plan.update_noise_multiplier,
            self.plan.bit_noise,
            self.plan.sampling_rate,
            self.clip,
            self.settings.target_quantile,
        )

    def fixed_noise(self) -> FixedNoise | None:
        """``strategy.noise_multiplier`` set: the epsilon its planned rounds reach (None: calibrated)."""
        if self.settings.noise_multiplier is None:
            return None
        return self.planned_gaussian(
            "strategy.noise_multiplier",
            noise_multiplier=self.plan.noise_multiplier,
            sampling_rate=self.plan.sampling_rate,
            participations=self.run.settings.num_rounds,
        )

    def select_clients(self, server_round: int) -> list[ClientInfo]:
        """Poisson sampling with rate q; secret coins from the privacy randomness."""
        return self.cohorts.poisson(server_round, self.plan.sampling_rate)

    def summand(self, server_round: int) -> ClippedUpdate:
        """Each client's update clipped to the round's bound: the aggregation sums them."""
        return ClippedUpdate(clip=self.clip)

    def aggregate(
        self, server_round: int, replies: Replies
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Clip, noise the update sum and the unclipped count, step with momentum, adapt C."""
        global_arrays = self.round_global
        clip = self.clip
        _, reference, total, norms = self.clipped_update_sum(
            replies, max_norm=clip, server_round=server_round
        )
        m = self.plan.expected_clients
        rng = self.run.noise.generator("central-noise", server_round=server_round)
        sigma = self.plan.update_noise_multiplier * clip
        average = [gaussian_mechanism(values=t, sigma=sigma, rng=rng) / m for t in total]
        centred = float(sum(1.0 if norm <= clip else 0.0 for norm in norms) - 0.5 * len(norms))
        bit_rng = self.run.noise.generator("clip-count-noise", server_round=server_round)
        noised = float(gaussian_mechanism(values=np.array(centred), sigma=self.plan.bit_noise, rng=bit_rng))
        unclipped = noised / m + 0.5
        self._record_release(server_round)
        new = arrays_like(self.server_optimizer.step(reference, average), global_arrays)
        self.clip = clip * math.exp(-self.settings.clip_lr * (unclipped - self.settings.target_quantile))
        self._rounds[server_round] = {
            "clip_norm": clip,
            "next_clip_norm": self.clip,
            "unclipped_fraction_noised": unclipped,
        }
        # No train loss (nor anything else computed from the clients' data) in the metrics: they are
        # not noised (the platform's release rule, as DP-FedAvg).
        return new, MetricRecord()

    def _record_release(self, server_round: int) -> None:
        """One ``SampledGaussian(z, q)`` per round: the update sum and the count, jointly."""
        assert self.accountant is not None
        self.accountant.record(
            PrivacyEvent(
                server_round,
                SampledGaussian(self.plan.noise_multiplier, self.plan.sampling_rate),
                participants=None,
                label="central release (clipped update sum + unclipped count)",
            )
        )

    def round_extras(self, server_round: int) -> dict[str, Any]:
        """The clip norm used, the next one, and the released (noised) unclipped fraction.

        All three are functions of the noised releases only (the clip norm is public post-processing).
        """
        return dict(self._rounds.get(server_round, {}))

    def cohort_randomness(self) -> str:
        """Poisson cohorts come from the privacy randomness."""
        return (
            "secret: Poisson coins drawn from the privacy randomness (run.noise), as amplification by "
            "sampling requires; see `source` for whether that randomness is secret"
        )

    def privacy_summary(self) -> dict[str, Any]:
        """Unit, mechanism, accountant, the noise split and the clipping schedule."""
        plan = self.plan
        return {
            **super().privacy_summary(),
            "noise_multiplier": plan.noise_multiplier,
            "update_noise_multiplier": plan.update_noise_multiplier,
            "bit_noise": plan.bit_noise,
            "effective_noise_multiplier_check": adaptive_clipping_effective_noise_multiplier(
                update_noise_multiplier=plan.update_noise_multiplier, bit_noise=plan.bit_noise
            ),
            "sampling": "poisson (coins from the privacy randomness)",
            "sampling_rate": plan.sampling_rate,
            "denominator": plan.expected_clients,
            "initial_clip": self.settings.initial_clip,
            "final_clip": self.clip,
            "target_quantile": self.settings.target_quantile,
            "clip_lr": self.settings.clip_lr,
            "server_lr": self.settings.server_lr,
            "server_momentum": self.settings.server_momentum,
        }
