"""DP-BLT: DP-FTRL whose noise is correlated across rounds by a buffered-linear-Toeplitz matrix.

Dvijotham, McMahan, Pillutla, Steinke, Thakurta, "Efficient and near-optimal noise generation for
streaming differential privacy", FOCS 2024 (arXiv 2404.16706), and McMahan, Xu, Zhang, "A
Hassle-free Algorithm for Private Learning in Practice: Don't Use Tree Aggregation, Use BLTs",
EMNLP Industry 2024 (arXiv 2408.08868), the mechanism of Gboard's production DP-FTRL
(:mod:`strategies.dp_blt.buffered_toeplitz` says what a BLT is and how it is chosen).

**Schedule.** A seeded permutation of the N clients is cut into ``b = N // m`` public groups of
near-equal size (``m = clients_per_round``); round t takes the whole group ``(t - 1) mod b``. A
client therefore takes part in at most ``k = ceil(T / b)`` rounds, exactly ``b`` apart: single
participation when ``T <= b``, else the min-separation schema (k participations at least b rounds
apart). The cohorts are public; no amplification by sampling is claimed.

**Each round t.** The group trains ``w_t`` locally; the server clips each update to ``C``
(``strategy.clip``), sums them (``x_t``) and adds the round's noise ``y_t = (C^{-1} z)_t``,
``z_t ~ N(0, sigma^2 I)``, streamed with the BLT's buffers (``BLTNoise``: the noise state is
``d`` vectors of the model's size, d = the buffers, whatever T). The server step is heavy-ball
momentum on the average: ``v_t = beta v_{t-1} + (x_t + y_t) / m``, ``w_{t+1} = w_t + eta v_t``.
With ``beta = 0`` the models are ``w_1 + (eta / m)`` times the prefix sums the BLT is optimised for;
momentum is post-processing, outside the objective.

**The matrix.** The BLT ``C`` with ``strategy.buffers`` buffers (``auto``: as many as lower the loss
by more than 1 %) minimising ``sens^2 x`` the max (``strategy.error``) squared error of the T prefix
sums, for the schema above: public, computed from ``T``, ``b`` and ``k`` only.

**Privacy.** Unit: one client's entire data set (add or remove one client of a group; its updates
are zero), central DP, the server trusted. Everything released is post-processing of ``C x + z``
(the first t rows of it and the first t noisy sums determine each other). A client's contributions
``x`` (rows of norm at most C) change ``C x`` by at most ``C ||C u||`` for its participation
vector ``u`` (``C`` is non-negative), adaptively chosen contributions included (Denisov et al.,
NeurIPS 2022, for one participation; Choquette-Choo et al., ICML 2023, for several); the
largest over the schema is the min-separation sensitivity ``C sens``, with ``sens^2 = ||C u*||^2``
for ``u*`` the rounds ``1, 1 + b, ..., 1 + (k - 1) b`` (arXiv 2405.13763, Theorem 2; jax_privacy's
``toeplitz.minsep_sensitivity_squared``). With ``sigma = z C sens`` the whole release is the
Gaussian mechanism with noise multiplier at least ``z`` for every client: jax_privacy's
``SingleReleaseTrainingAccountant`` charges ``GaussianDpEvent(z)`` once.

The accountant charges a group in its rounds, as it takes part: at its ``j``-th participation
``Gaussian(z sens / sqrt(d_j))``, ``d_j`` the ``j``-th increment of ``||C u*_j||^2`` (all its
future rows included, so the epsilon after any round covers everything released so far). The
increments sum to ``sens^2``, so the first group's members end exactly at ``Gaussian(z)`` (the
Gaussians compose to the Gaussian with ``1 / z^2 = sum_j d_j / (z sens)^2``); later groups,
whose rows are fewer, are charged at most what they leak. Unless ``strategy.noise_multiplier`` is
set, ``z`` is the smallest for which the first group ends at ``privacy.epsilon``.

Released: the models only; the groups, the schedule and the BLT are public. The clients' train
losses and update norms stay on the server. The BLT's buffers and the momentum are private server
state (kept in the private checkpoint, never released).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, MetricRecord
from flwr.common import log

from fl_app.config.checks import ConfigError, require_int
from fl_app.config.settings import RunSettings
from fl_app.learning.sums import ClippedUpdate
from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.calibration import noise_multiplier_for_histories
from fl_app.privacy.events import PrivacyEvent
from fl_app.run.context import RunContext
from fl_app.run.roster import ClientInfo
from strategies import register_strategy
from strategies.arrays import ServerMomentum, arrays_like
from strategies.base import Replies
from strategies.contract import Declaration, QuickExample
from strategies.dp_blt.buffered_toeplitz import (
    ERRORS,
    MAX_AUTO_BUFFERS,
    BLTNoise,
    BufferedToeplitz,
    error,
    loss,
    optimal_blt,
    sensitivity_squared,
)
from strategies.dp_blt.privacy import participation_mechanisms, participation_schema, worst_history
from strategies.private import PrivateStrategy
from strategies.settings import StrategySettings, between, one_of, positive, setting


@dataclass(frozen=True)
class DPBLTSettings(StrategySettings):
    """``cfg.strategy`` of ``dp_blt`` (``conf/strategy/dp_blt.yaml`` explains each key)."""

    clip: float = positive()
    buffers: int | str = setting(
        lambda key, value: (
            value if value == "auto" else require_int(key, value, minimum=0, maximum=MAX_AUTO_BUFFERS)
        )
    )
    error: str = one_of(ERRORS)
    noise_multiplier: float | None = positive(optional=True)
    server_lr: float = positive()
    server_momentum: float = between(0.0, 1.0, high_open=True)

    budget_scopes = ("total",)  # calibrated for the whole run


def check(run: RunSettings) -> None:
    """Each group must hold a cohort (``clients_per_round <= num_clients``)."""
    if run.cohort > run.num_clients:
        raise ConfigError(
            "clients_per_round",
            run.cohort,
            f"must be at most num_clients={run.num_clients} (a group is a cohort)",
        )


def blt_text(blt: BufferedToeplitz) -> str:
    """The BLT in one line: its buffers, decays and scales."""
    if not blt.buffers:
        return "buffers: 0, C = I: independent noise each round"
    decays = ", ".join(f"1 - {1 - v:.2g}" if 1 - v < 1e-4 else f"{v:.6g}" for v in blt.buf_decay)
    scales = ", ".join(f"{v:.6g}" for v in blt.output_scale)
    return f"buffers: {blt.buffers}, decays theta=({decays}), scales omega=({scales})"


@register_strategy("dp_blt")
class DPBLTStrategy(PrivateStrategy):
    """DP-FTRL with BLT-correlated noise over a public cyclic schedule of groups (no sampling)."""

    declaration = Declaration(
        name="dp_blt",
        paper=(
            "Dvijotham, McMahan, Pillutla, Steinke, Thakurta, FOCS 2024 (BLT noise); McMahan, Xu, Zhang, "
            "EMNLP Industry 2024 (BLT-DP-FTRL)"
        ),
        unit=(
            "one client's entire data set (add or remove one client of its group; public groups and "
            "schedule), central DP"
        ),
        mechanism=(
            "buffered-linear-Toeplitz matrix-factorization Gaussian noise on sums of clipped model updates "
            "(no sampling)"
        ),
        client="fedavg",  # plain local training: clipping and noise run on the server
        settings=DPBLTSettings,
        checkpoint_holds=(
            "DP-BLT's noise buffers and its momentum (with the released models they reveal the un-noised "
            "sums of clipped updates)"
        ),
        canaries=None,
        check=check,
        quick=QuickExample(
            overrides=("num_clients=1000", "clients_per_round=100", "num_rounds=100", "privacy.epsilon=8.0"),
            suite_rounds=15,
            about=(
                "DP-BLT at epsilon 8 per client (delta 1e-5), cross-device: 1000 clients, 100 per round in "
                "10 public groups (each client every 10th round), 100 rounds; strategy.buffers=auto"
            ),
        ),
        comparisons=("cross_device",),
    )
    settings: DPBLTSettings

    def __init__(self, run: RunContext, settings: DPBLTSettings | None = None) -> None:
        super().__init__(run, settings)
        settings = self.settings
        self.num_rounds = run.settings.num_rounds
        self.num_groups = run.num_clients // run.clients_per_round
        self.groups = self._public_groups()
        self.schema = participation_schema(
            num_clients=run.num_clients, clients_per_round=run.clients_per_round, rounds=self.num_rounds
        )
        self.blt = optimal_blt(self.schema, buffers=settings.buffers, kind=settings.error)
        self.sensitivity = math.sqrt(sensitivity_squared(self.blt, self.schema))
        if settings.noise_multiplier is not None:
            self.noise_multiplier = settings.noise_multiplier
        else:
            self.noise_multiplier = noise_multiplier_for_histories(
                epsilon=run.settings.privacy.epsilon,
                delta=run.settings.privacy.delta,
                histories_of=lambda z: [worst_history(self.blt, self.schema, noise_multiplier=z)],
                method=run.settings.privacy.accountant,
            )
        #: What each participation charges its group (1-based: ``self.charges[j - 1]``).
        self.charges = participation_mechanisms(self.blt, self.schema, noise_multiplier=self.noise_multiplier)
        self.noise = BLTNoise(self.blt, sigma=self.noise_multiplier * settings.clip * self.sensitivity)
        self.accountant = PrivacyAccountant(
            population=run.client_ids, unit=self.privacy_unit, method=run.settings.privacy.accountant
        )
        self.server_optimizer = ServerMomentum(lr=settings.server_lr, momentum=settings.server_momentum)
        log(
            INFO,
            "DP-BLT noise: C^-1 z for the BLT C (%s), optimised for the %s error",
            blt_text(self.blt),
            settings.error,
        )
        log(
            INFO,
            "DP-BLT sensitivity: %s; sens=%.4f x clip C=%g; z=%.4f, noise std z C sens=%.4g; %d groups",
            self.schema.describe(),
            self.sensitivity,
            settings.clip,
            self.noise_multiplier,
            self.noise.sigma,
            self.num_groups,
        )

    # ------------------------------------------------------------------ schedule and accounting

    def _public_groups(self) -> list[list[ClientInfo]]:
        """``N // m`` groups of near-equal size from a seeded permutation of the roster."""
        order = self.run.randomness.generator("blt-groups").permutation(len(self.run.roster))
        parts = np.array_split(order, self.num_groups)
        return [[self.run.roster[int(i)] for i in sorted(part)] for part in parts]

    def group_index(self, server_round: int) -> int:
        """The index ``(t - 1) mod b`` of the group that takes part in ``server_round``."""
        return (server_round - 1) % self.num_groups

    def participation(self, server_round: int) -> int:
        """Which participation (1-based) of its group ``server_round`` is."""
        return (server_round - 1) // self.num_groups + 1

    def select_clients(self, server_round: int) -> list[ClientInfo]:
        """The round's public group."""
        if server_round > self.num_rounds:
            raise RuntimeError(
                f"round {server_round} is beyond num_rounds={self.num_rounds}, which the matrix and the "
                "privacy calibration assumed"
            )
        return list(self.groups[self.group_index(server_round)])

    def canary_patterns(self, count: int) -> list[frozenset[int]]:
        """Each canary takes part in every round of the first group (the accounted worst client)."""
        return [frozenset(range(1, self.num_rounds + 1, self.num_groups))] * count

    # ------------------------------------------------------------------ rounds

    def summand(self, server_round: int) -> ClippedUpdate:
        """Each client's update clipped to the round's bound: the aggregation sums them."""
        return ClippedUpdate(clip=self.settings.clip)

    def aggregate(
        self, server_round: int, replies: Replies
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Clip, sum, add the round's BLT noise, take the momentum step."""
        global_arrays = self.round_global
        _, reference, total, _ = self.clipped_update_sum(
            replies, max_norm=self.settings.clip, server_round=server_round
        )
        noise = self.noise.draw(total, self.run.noise.generator("blt-noise", server_round=server_round))
        m = float(self.run.clients_per_round)
        average = [(s + n) / m for s, n in zip(total, noise, strict=True)]
        new = arrays_like(self.server_optimizer.step(reference, average), global_arrays)
        self._record_release(server_round)
        # No train loss (nor anything else computed from the clients' data) in the metrics.
        return new, MetricRecord()

    def _record_release(self, server_round: int) -> None:
        """Charge the round's whole group (failures included) for its participation."""
        assert self.accountant is not None
        group, j = self.group_index(server_round), self.participation(server_round)
        self.accountant.record(
            PrivacyEvent(
                server_round,
                self.charges[j - 1],
                participants=tuple(info.client_id for info in self.groups[group]),
                label=(
                    f"group {group + 1} of {self.num_groups}, "
                    f"participation {j} of {self.schema.max_participations}"
                ),
            )
        )

    # ------------------------------------------------------------------ reporting

    def cohort_text(self) -> str:
        """The public cyclic schedule, for the run's header."""
        return (
            f"public cyclic schedule: round t takes group (t - 1) mod {self.num_groups} of {self.num_groups} "
            f"seeded groups of ~{self.run.num_clients // self.num_groups} clients (no sampling)"
        )

    def round_extras(self, server_round: int) -> dict[str, Any]:
        """The round's group and its participation (public)."""
        return {
            "group": self.group_index(server_round) + 1,
            "participation": self.participation(server_round),
        }

    def privacy_summary(self) -> dict[str, Any]:
        """Unit, mechanism, accountant, the BLT, the schema and the schedule."""
        identity = BufferedToeplitz((), ())
        return {
            **super().privacy_summary(),
            "noise_multiplier": self.noise_multiplier,
            "clip": self.settings.clip,
            "sensitivity": self.sensitivity,
            "noise_std": self.noise.sigma,
            "participation_schema": {
                "kind": "single participation" if self.schema.max_participations == 1 else "min-separation",
                "rounds": self.schema.rounds,
                "min_separation": self.schema.min_separation,
                "max_participations": self.schema.max_participations,
                "text": self.schema.describe(),
            },
            "groups": self.num_groups,
            "max_participations": self.schema.max_participations,
            "strategy_matrix": {
                "kind": "buffered linear Toeplitz (BLT), c_0 = 1, c_k = sum_i omega_i theta_i^(k-1)",
                "buffers": self.blt.buffers,
                "buffers_chosen": (
                    "strategy.buffers=auto: one more while the loss falls by more than 1 % (jax_privacy's)"
                    if self.settings.buffers == "auto"
                    else "strategy.buffers"
                ),
                "buf_decay": list(self.blt.buf_decay),
                "output_scale": list(self.blt.output_scale),
                "optimised_for": f"{self.settings.error} squared error of the {self.num_rounds} prefix sums",
                "loss": loss(self.blt, self.schema, kind=self.settings.error),
                "max_error": self.sensitivity**2 * error(self.blt.inverse(), self.num_rounds, kind="max"),
                "loss_relative_to_independent_noise": (
                    loss(self.blt, self.schema, kind=self.settings.error)
                    / loss(identity, self.schema, kind=self.settings.error)
                ),
            },
            "accounting": (
                "the Gaussian mechanism with noise multiplier z for the first group (sensitivity C sens "
                "under the schema), charged in its rounds by the increments of ||C u||^2; no amplification"
            ),
            "server_lr": self.settings.server_lr,
            "server_momentum": self.settings.server_momentum,
        }
