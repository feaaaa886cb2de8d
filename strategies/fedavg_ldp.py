"""FedAvg with local DP on the uploaded model update: the baseline of PrivateKT.

Qi, Wu et al., "Differentially private knowledge transfer for federated
learning", Nature Communications 2023, compare PrivateKT with federated
learning whose uploaded model is protected by local DP. Here: FedAvg
(McMahan et al., AISTATS 2017, Algorithm 1) where every selected client

1. trains the global model w_t locally and forms its update ``Delta = w - w_t``;
2. clips it to L2 norm C (``strategy.clip``): ``Delta <- Delta min(1, C / ||Delta||)``;
3. adds Gaussian noise ``N(0, (2 C z)^2 I)`` on the device (the L2 sensitivity of
   a clipped update under replacement of the client's whole data set is 2C);
4. uploads the noisy update only (no loss, no example count).

The server sets ``w_{t+1} = w_t + mean_k(noisy Delta_k)`` over the replies it
got (uniform weights; post-processing of LDP outputs). By default
(``strategy.project: true``) the mean is first projected onto the L2 ball of radius C: every true
update, and so their mean, lies in that ball, and the Euclidean projection onto a closed convex set
that holds a point never moves an estimate farther from it. At small epsilon the noise on the mean is
far larger than C; unprojected, it throws the model to NaN within a few rounds (measured: loss 7,136
after round 1 at the default epsilon 8) where projected it stays a bounded random walk.
``project: false`` is the paper's plain mean.

Privacy: local DP, unit = one client's entire data set (as PrivateKT). Every
upload is one ``Gaussian(z)`` release of that client's data; the accountant
composes them per client. ``privacy.budget_scope=total`` (default) calibrates z
so that the most-selected client's uploads over the run (seeded schedule,
fixed at start-up) meet ``(privacy.epsilon, privacy.delta)``; ``per_round``
so that one upload does. No amplification by sampling is credited (the client
knows it was selected and the server sees who uploaded what).
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from flwr.common import log

from clients.fedavg_ldp import LDP_CLIP, LDP_NOISE_MULTIPLIER
from fl_app.learning.sums import Upload, is_partial_sum
from fl_app.learning.train_results import arrays_mismatch
from fl_app.learning.training import array_values
from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.calibration import local_gaussian_noise_multiplier, local_gaussian_sigma
from fl_app.privacy.canaries import worst_client_patterns
from fl_app.privacy.composition import compose_epsilon
from fl_app.privacy.events import Gaussian, PrivacyEvent
from fl_app.privacy.fixed_noise import FixedNoise
from fl_app.privacy.mechanisms import clip_l2, local_gaussian_update
from fl_app.run.context import RunContext
from fl_app.run.roster import ClientInfo
from strategies import register_strategy
from strategies.base import Replies
from strategies.cohorts import SCHEDULES, max_participations
from strategies.contract import Declaration, QuickExample
from strategies.private import PrivateStrategy
from strategies.settings import StrategySettings, flag, one_of, positive


@dataclass(frozen=True)
class FedAvgLDPSettings(StrategySettings):
    """``cfg.strategy`` of ``fedavg_ldp`` (``conf/strategy/fedavg_ldp.yaml`` explains each key)."""

    clip: float = positive()
    noise_multiplier: float | None = positive(optional=True)
    project: bool = flag()
    schedule: str = one_of(SCHEDULES)


@register_strategy("fedavg_ldp")
class FedAvgLDPStrategy(PrivateStrategy):
    """FedAvg of client-side clipped and Gaussian-noised model updates."""

    declaration = Declaration(
        name="fedavg_ldp",
        paper="FedAvg with local DP on each upload: PrivateKT's equal-budget baseline (Qi, Wu et al. 2023)",
        unit=(
            "one client's entire local data set (local DP: any two data sets of one client; "
            "each upload is protected against the server)"
        ),
        mechanism="Gaussian noise on each client's clipped model update, added on the client",
        client="fedavg_ldp",
        settings=FedAvgLDPSettings,
        canaries=None,
        quick=QuickExample(
            overrides=(
                "num_clients=1000",
                "clients_per_round=100",
                "num_rounds=30",
                "privacy.epsilon=100.0",
                "strategy.schedule=balanced",
                "strategy.project=false",
            ),
            suite_rounds=10,
            about=(
                "FedAvg with local DP on each clipped update, 1000 clients, 100 per round on a balanced "
                "schedule, 30 rounds; epsilon 100 per client (local DP: a weak guarantee; below it this "
                "method barely learns in this shape)"
            ),
        ),
        comparisons=("comparison", "cross_device"),
    )
    settings: FedAvgLDPSettings

    def __init__(self, run: RunContext, settings: FedAvgLDPSettings | None = None) -> None:
        super().__init__(run, settings)
        settings = self.settings
        self.clip = settings.clip
        self.project = settings.project
        self.cohorts.plan(
            self.cohorts.seeded_schedule(
                self.run.settings.num_rounds, balanced=settings.schedule == "balanced"
            )
        )
        self.max_participations = max_participations(self.cohorts.planned)
        self.budget_scope = self.run.settings.privacy.budget_scope
        self.method = self.run.settings.privacy.accountant
        if settings.noise_multiplier is not None:
            self.noise_multiplier = settings.noise_multiplier
        else:
            self.noise_multiplier = local_gaussian_noise_multiplier(
                epsilon=self.run.settings.privacy.epsilon,
                delta=run.settings.privacy.delta,
                participations=max(self.max_participations, 1) if self.budget_scope == "total" else 1,
                method=self.method,
            )
        self.sigma = local_gaussian_sigma(clip=self.clip, noise_multiplier=self.noise_multiplier)
        self.epsilon_per_round = compose_epsilon(
            {Gaussian(self.noise_multiplier): 1}, delta=run.settings.privacy.delta, method=self.method
        ).epsilon
        self.accountant = PrivacyAccountant(
            population=run.client_ids, unit=self.privacy_unit, method=self.method
        )
        self._reports: dict[int, int] = {}
        log(
            INFO,
            "FedAvg+LDP: clip C=%g, noise multiplier z=%.4f (std %.4g per coordinate), %s budget, "
            "most-selected client takes part in %d rounds",
            self.clip,
            self.noise_multiplier,
            self.sigma,
            self.budget_scope,
            self.max_participations,
        )

    def fixed_noise(self) -> FixedNoise | None:
        """``strategy.noise_multiplier`` set: the busiest client's epsilon over the planned rounds."""
        if self.settings.noise_multiplier is None:
            return None
        return self.planned_gaussian(
            "strategy.noise_multiplier",
            noise_multiplier=self.noise_multiplier,
            sampling_rate=1.0,
            participations=self.max_participations,
        )

    def canary_patterns(self, count: int) -> list[frozenset[int]]:
        """Each canary uploads in the rounds of a busiest client of the schedule (the accounted one)."""
        assert self.cohorts.planned is not None
        rounds_of: dict[int, set[int]] = {}
        for server_round, cohort in self.cohorts.planned.items():
            for info in cohort:
                rounds_of.setdefault(info.client_id, set()).add(server_round)
        worst = sorted(c for c, rounds in rounds_of.items() if len(rounds) == self.max_participations)
        return worst_client_patterns(
            rounds_of, worst=worst, count=count, rng=self.run.randomness.generator("canary-pattern")
        )

    def extra_train_config(self, server_round: int) -> dict[str, Any]:
        """Clipping bound and noise multiplier for the clients."""
        return {LDP_CLIP: self.clip, LDP_NOISE_MULTIPLIER: self.noise_multiplier}

    def summand(self, server_round: int) -> Upload:
        """Each client's noisy update as it came: the mean is their sum over the count."""
        return Upload()

    def aggregate(
        self, server_round: int, replies: Replies
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """``w_{t+1} = w_t + mean of the noisy updates``; one Gaussian event for every selected client."""
        global_arrays = self.round_global
        assert self.accountant is not None
        self.accountant.record(
            PrivacyEvent(
                server_round,
                Gaussian(self.noise_multiplier),
                participants=tuple(c.client_id for c in self.replies.selected(server_round)),
                label="noisy model update",
            )
        )
        total = self._matching(replies).sum(self.summand(server_round))
        names = list(global_arrays.keys())
        sums = [total.arrays[name] for name in names]
        reports = len(total.members)
        self._reports[server_round] = reports
        like = [array_values(global_arrays[n]) for n in names]
        canaries = self.canary_uploads(server_round, clip=self.clip, like=like)
        for canary, upload in enumerate(canaries):
            rng = self.run.noise.generator("canary-ldp-noise", client=canary, server_round=server_round)
            noisy = local_gaussian_update(
                update=upload, clip=self.clip, noise_multiplier=self.noise_multiplier, rng=rng
            )
            for running, values in zip(sums, noisy, strict=True):
                running += values
        count = reports + len(canaries)
        if count == 0:
            return None, MetricRecord({"reports": 0})
        means = [values / count for values in sums]
        if self.project:
            means, _ = clip_l2(arrays=means, max_norm=self.clip)
        new = {}
        for name, mean in zip(names, means, strict=True):
            reference = array_values(global_arrays[name])
            new[name] = Array(np.asarray(reference.astype(np.float64) + mean, dtype=reference.dtype))
        return ArrayRecord(new), MetricRecord({"reports": count})

    def _matching(self, replies: Replies) -> Replies:
        """The valid replies whose update matches the model; any other is logged and ignored.

        A packed message's members were checked where they ran (a malformed one failed there).
        """

        def matches(info: ClientInfo, reply: Message) -> bool:
            if is_partial_sum(reply) or not arrays_mismatch(reply, self.round_global):
                return True
            log(WARNING, "FedAvg+LDP: client %d sent no matching update; ignored", info.client_id)
            return False

        return replies.only(matches)

    def round_extras(self, server_round: int) -> dict[str, Any]:
        """Valid uploads aggregated in the round and the epsilon of one upload.

        The cumulative epsilon (worst client, accountant) is the platform's ``epsilon`` of the round.
        """
        return {"reports": self._reports.get(server_round, 0), "epsilon_per_round": self.epsilon_per_round}

    def privacy_summary(self) -> dict[str, Any]:
        """Unit, mechanism, calibration, schedule, per-upload and cumulative epsilon."""
        cumulative = self.epsilon()
        return {
            **super().privacy_summary(),
            "budget_scope": self.budget_scope,
            "epsilon_target": self.run.settings.privacy.epsilon,
            "epsilon_per_round": self.epsilon_per_round,
            "epsilon_cumulative": None if cumulative is None else cumulative.epsilon,
            "noise_multiplier": self.noise_multiplier,
            "clip": self.clip,
            "noise_std": self.sigma,
            "sensitivity": "2 * clip (L2, replacement of a client's data set)",
            "planned_max_participations": self.max_participations,
        }
