"""DP-BandMF: DP-FedAvg whose noise is correlated across rounds by a banded Toeplitz matrix.

Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, "(Amplified) Banded Matrix
Factorization: A unified approach to private training", NeurIPS 2023 (Algorithm 1 with cyclic
Poisson sampling, their Section 4 and Theorem 4), with the banded Toeplitz strategy matrix of
McKenna, "Scaling up the Banded Matrix Factorization Mechanism for Differentially Private ML", 2024
(:mod:`strategies.dp_bandmf.factorization` says why this matrix).

**Groups and cohorts.** A seeded permutation of the N clients is cut into ``b = strategy.bands``
groups of near-equal size (public). Round t draws its cohort from group ``g = (t - 1) mod b``:
each member joins independently with probability ``q = m b / N`` (``m = clients_per_round``), so a
cohort holds m clients on average; ``q = 1`` (``b = N / m``) takes the whole group. A client
therefore takes part only in rounds ``g + 1, g + 1 + b, ...``: at least ``b`` rounds apart.

**Each round t.** The cohort trains ``w_t`` locally; the server clips each update to ``C``
(``strategy.clip``), sums them (``x_t``), and adds the correlated noise of the banded Toeplitz
``C`` optimised for the run's workload (``num_rounds`` rounds, the server momentum):
``x^_t = x_t + y_t``, ``y_t = (z_t - sum_{j=1}^{b-1} c_j y_{t-j}) / c_0``, ``z_t ~ N(0, (z C)^2 I)``
with noise multiplier ``z``, drawn from the run's noise stream, which can draw any round again
(:mod:`fl_app.privacy.keyed_noise`): the last ``b - 1`` noise vectors are kept in memory while they
fit ``strategy.noise_memory_gib``, else every earlier ``z_s`` is drawn again; none is checkpointed.
The server step is heavy-ball momentum on the average:
``v_t = beta v_{t-1} + x^_t / m``, ``w_{t+1} = w_t + eta v_t`` (``strategy.server_momentum``,
``strategy.server_lr``). With one band (``C = I``) and ``beta = 0, eta = 1`` this is DP-FedAvg
with Poisson sampling exactly (``strategy=dp_fedavg``).

**Privacy.** Unit: one client's entire data set (add or remove one client of a group; a removed
client contributes zero updates), central DP, the server trusted. The released models are
post-processing of ``C x + z`` (``x^ = C^{-1}(C x + z)``), where ``C`` has unit column norms and
``b`` bands; a client's participations are at least ``b`` rounds apart, so its columns of ``C``
never overlap. Theorem 4 of the paper: this is exactly as private as DP-SGD with noise multiplier
``z``, sampling rate ``q`` and ``ceil(T / b)`` steps. Each round records, for the members of its
group, ``SampledGaussian(z, q)`` (``q < 1``) or ``Gaussian(z)`` (``q = 1``: the cohort is the
public group, and k participations compose to the Gaussian with sensitivity ``sqrt(k)``, the
paper's min-separation bound); the accountant composes them per client (PLD by default). Unless
``strategy.noise_multiplier`` is set, ``z`` is the smallest for which the busiest group's members
end at ``privacy.epsilon``. With ``q < 1`` the amplification needs a secret cohort: the Poisson
coins come from the privacy randomness (``run.noise``), as DP-FedAvg's; the groups may be public.

Released: the models only; the matrix ``C`` and the schedule of groups are public. The clients'
train losses and update norms stay on the server. The last ``b - 1`` noise vectors and the
momentum are private server state (kept in the private checkpoint, never released).
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
from fl_app.privacy.calibration import dp_fedavg_noise_multiplier
from fl_app.privacy.events import Gaussian, Mechanism, PrivacyEvent, SampledGaussian
from fl_app.privacy.fixed_noise import FixedNoise
from fl_app.privacy.keyed_noise import NoiseStream, noise_stream
from fl_app.run.context import RunContext
from fl_app.run.roster import ClientInfo
from strategies import register_strategy
from strategies.arrays import ServerMomentum, arrays_like
from strategies.base import Replies
from strategies.contract import Declaration, QuickExample
from strategies.dp_bandmf.factorization import CorrelatedNoise, optimal_banded_toeplitz
from strategies.private import PrivateStrategy
from strategies.settings import StrategySettings, between, positive, setting


@dataclass(frozen=True)
class DPBandMFSettings(StrategySettings):
    """``cfg.strategy`` of ``dp_bandmf`` (``conf/strategy/dp_bandmf.yaml`` explains each key)."""

    clip: float = positive()
    bands: int | str = setting(
        lambda key, value: value if value == "auto" else require_int(key, value, minimum=1)
    )
    noise_multiplier: float | None = positive(optional=True)
    server_lr: float = positive()
    server_momentum: float = between(0.0, 1.0, high_open=True)
    noise_memory_gib: float = between(0.0, math.inf, high_open=True, default=1.0)

    budget_scopes = ("total",)  # calibrated for the whole run


def group_sampling_rate(*, num_clients: int, clients_per_round: int, bands: int) -> float:
    """``q = m b / N``: the rate at which a group of ``N / b`` clients yields ``m`` on average.

    Raises :class:`ConfigError` when ``m b > N`` (a group could not hold a cohort).
    """
    rate = clients_per_round * bands / num_clients
    if rate > 1.0 + 1e-12:
        raise ConfigError(
            "strategy.bands",
            bands,
            f"too many: with num_clients={num_clients} and clients_per_round={clients_per_round} at most "
            f"{num_clients // clients_per_round} (each band's group of clients must hold a cohort)",
        )
    return min(rate, 1.0)


def check(run: RunSettings) -> None:
    """The groups must hold a cohort (``clients_per_round * bands <= num_clients``)."""
    settings: DPBandMFSettings = run.strategy_settings
    if settings.bands != "auto":
        group_sampling_rate(
            num_clients=run.num_clients,
            clients_per_round=run.cohort,
            bands=int(settings.bands),
        )


def expected_error(
    *,
    bands: int,
    epsilon: float,
    delta: float,
    num_clients: int,
    clients_per_round: int,
    rounds: int,
    momentum: float,
) -> float:
    """``z_b^2 ||A C_b^{-1}||_F^2``: the total noise variance of the released models with ``b`` bands.

    ``z_b`` is the RDP calibration for the budget with ``b`` bands (``q = m b / N``, ``ceil(T / b)``
    steps), ``C_b`` the optimised matrix; in units of ``(C eta / m)^2`` per coordinate. It ranks band
    counts as jax_privacy's ``toeplitz.optimize_coefs_for_amplifications`` does (its RMSE, squared and
    times T): more bands correlate the noise better but amplify less.
    """
    rate = group_sampling_rate(num_clients=num_clients, clients_per_round=clients_per_round, bands=bands)
    z = dp_fedavg_noise_multiplier(
        epsilon=epsilon, delta=delta, sampling_rate=rate, rounds=math.ceil(rounds / bands), method="rdp"
    )
    return z**2 * optimal_banded_toeplitz(rounds=rounds, bands=bands, momentum=momentum).loss


def max_bands(*, num_clients: int, clients_per_round: int, rounds: int) -> int:
    """The most bands worth considering: ``min(N / m, T)`` (each group must hold a cohort)."""
    return min(num_clients // clients_per_round, rounds)


def choose_bands(
    *, epsilon: float, delta: float, num_clients: int, clients_per_round: int, rounds: int, momentum: float
) -> int:
    """``strategy.bands=auto``: the ``b <= min(N / m, T)`` of least :func:`expected_error`.

    Depends on the budget and the schedule only (no data): choosing it costs no privacy.
    """
    candidates = range(
        1, max_bands(num_clients=num_clients, clients_per_round=clients_per_round, rounds=rounds) + 1
    )
    return min(
        candidates,
        key=lambda b: expected_error(
            bands=b,
            epsilon=epsilon,
            delta=delta,
            num_clients=num_clients,
            clients_per_round=clients_per_round,
            rounds=rounds,
            momentum=momentum,
        ),
    )


@register_strategy("dp_bandmf")
class DPBandMFStrategy(PrivateStrategy):
    """Banded matrix-factorization noise over the rounds, cyclic Poisson cohorts (amplified BandMF)."""

    declaration = Declaration(
        name="dp_bandmf",
        paper=(
            "Choquette-Choo, Ganesh, McKenna, McMahan, Rush, Thakurta, Xu, NeurIPS 2023 ((Amplified) "
            "Banded Matrix Factorization); banded Toeplitz: McKenna 2024"
        ),
        unit=(
            "one client's entire data set (add or remove one client of its group; public groups), central DP"
        ),
        mechanism="banded Toeplitz matrix-factorization Gaussian noise on sums of clipped model updates",
        client="fedavg",  # plain local training: clipping and noise run on the server
        settings=DPBandMFSettings,
        checkpoint_holds=(
            "DP-BandMF's noise key (under privacy.secure_rng; a seeded run's noise follows from its "
            "configuration) and its momentum (with the released models the key gives back the noise and "
            "the un-noised sums of clipped updates); no noise vector"
        ),
        canaries=None,
        check=check,
        quick=QuickExample(
            overrides=(
                "num_clients=1000",
                "clients_per_round=100",
                "num_rounds=100",
                "privacy.epsilon=8.0",
            ),
            suite_rounds=15,
            about=(
                "DP-BandMF at epsilon 8 per client (delta 1e-5), cross-device: 1000 clients, 100 per round "
                "on average, 100 rounds; strategy.bands=auto picks the band count"
            ),
        ),
        comparisons=("cross_device",),
    )
    settings: DPBandMFSettings

    def __init__(self, run: RunContext, settings: DPBandMFSettings | None = None) -> None:
        super().__init__(run, settings)
        settings = self.settings
        self.num_rounds = run.settings.num_rounds
        if settings.bands == "auto":
            #: Groups of clients (= bands, unless there are fewer rounds than groups).
            self.num_groups = choose_bands(
                epsilon=run.settings.privacy.epsilon,
                delta=run.settings.privacy.delta,
                num_clients=run.num_clients,
                clients_per_round=run.clients_per_round,
                rounds=self.num_rounds,
                momentum=settings.server_momentum,
            )
        else:
            self.num_groups = int(settings.bands)
        self.bands = min(self.num_groups, self.num_rounds)
        self.rate = group_sampling_rate(
            num_clients=run.num_clients, clients_per_round=run.clients_per_round, bands=self.num_groups
        )
        self.groups = self._public_groups()
        self.steps = math.ceil(self.num_rounds / self.num_groups)  # the busiest group's rounds
        self.matrix = optimal_banded_toeplitz(
            rounds=self.num_rounds, bands=self.bands, momentum=settings.server_momentum
        )
        if settings.noise_multiplier is not None:
            self.noise_multiplier = settings.noise_multiplier
        else:
            self.noise_multiplier = dp_fedavg_noise_multiplier(
                epsilon=run.settings.privacy.epsilon,
                delta=run.settings.privacy.delta,
                sampling_rate=self.rate,
                rounds=self.steps,
                method=run.settings.privacy.accountant,
            )
        self.noise = CorrelatedNoise(self.matrix.coefficients, sigma=self.noise_multiplier * settings.clip)
        #: The stream of ``z_t`` (:func:`~fl_app.privacy.keyed_noise.noise_stream` of the run's privacy
        #: randomness: a key from OS entropy, or the noise seed), made at the first release.
        self.noise_stream: NoiseStream | None = None
        self.accountant = PrivacyAccountant(
            population=run.client_ids, unit=self.privacy_unit, method=run.settings.privacy.accountant
        )
        self.secret_cohort = self.rate < 1.0
        self.server_optimizer = ServerMomentum(lr=settings.server_lr, momentum=settings.server_momentum)
        log(
            INFO,
            "DP-BandMF: %d bands (groups of ~%d clients, q=%.4f), z=%.4f, clip C=%g, at most %d "
            "participations per client; noise error %.3f of independent noise's at equal z",
            self.bands,
            run.num_clients // self.num_groups,
            self.rate,
            self.noise_multiplier,
            settings.clip,
            self.steps,
            self.matrix.loss / self.matrix.identity_loss,
        )

    def fixed_noise(self) -> FixedNoise | None:
        """``strategy.noise_multiplier`` set: the epsilon its planned rounds reach (None: calibrated)."""
        if self.settings.noise_multiplier is None:
            return None
        return self.planned_gaussian(
            "strategy.noise_multiplier",
            noise_multiplier=self.noise_multiplier,
            sampling_rate=self.rate,
            participations=self.steps,
        )

    # ------------------------------------------------------------------ schedule

    def _public_groups(self) -> list[list[ClientInfo]]:
        """``strategy.bands`` groups of near-equal size from a seeded permutation of the roster."""
        order = self.run.randomness.generator("bandmf-groups").permutation(len(self.run.roster))
        parts = np.array_split(order, self.num_groups)
        return [[self.run.roster[int(i)] for i in sorted(part)] for part in parts]

    def group_index(self, server_round: int) -> int:
        """The index ``(t - 1) mod b`` of the group round ``server_round`` samples from."""
        return (server_round - 1) % self.num_groups

    def group_of_round(self, server_round: int) -> list[ClientInfo]:
        """The group round ``server_round`` samples from."""
        return self.groups[self.group_index(server_round)]

    def select_clients(self, server_round: int) -> list[ClientInfo]:
        """The round's group (``q = 1``) or its Poisson sample with secret coins (``q < 1``)."""
        if server_round > self.num_rounds:
            raise RuntimeError(
                f"round {server_round} is beyond num_rounds={self.num_rounds}, which the matrix and the "
                "privacy calibration assumed"
            )
        group = self.group_of_round(server_round)
        if self.rate >= 1.0:
            return list(group)
        return self.cohorts.poisson(server_round, self.rate, among=group)

    def canary_patterns(self, count: int) -> list[frozenset[int]]:
        """Each canary sits in the busiest group and joins each of its rounds with probability q."""
        rounds = list(range(1, self.num_rounds + 1, self.num_groups))
        rng = self.run.randomness.generator("canary-pattern")
        return [frozenset(t for t in rounds if rng.random() < self.rate) for _ in range(count)]

    # ------------------------------------------------------------------ rounds

    def summand(self, server_round: int) -> ClippedUpdate:
        """Each client's update clipped to the round's bound: the aggregation sums them."""
        return ClippedUpdate(clip=self.settings.clip)

    def aggregate(
        self, server_round: int, replies: Replies
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Clip, sum, add the round's correlated noise, take the momentum step."""
        global_arrays = self.round_global
        _, reference, total, _ = self.clipped_update_sum(
            replies, max_norm=self.settings.clip, server_round=server_round
        )
        noise = self._round_noise(total, server_round)
        m = float(self.run.clients_per_round)
        average = [(s + n) / m for s, n in zip(total, noise, strict=True)]
        new = arrays_like(self.server_optimizer.step(reference, average), global_arrays)
        self._record_release(server_round)
        # No train loss (nor anything else computed from the clients' data) in the metrics.
        return new, MetricRecord()

    def _round_noise(self, like: list[np.ndarray], server_round: int) -> list[np.ndarray]:
        """Round t's correlated noise, its ``z`` from the run's noise stream (any round drawn again).

        The last ``b - 1`` noise vectors stay in memory while they fit ``strategy.noise_memory_gib``;
        beyond, each round draws every earlier ``z_s`` again (no vector kept).
        """
        if self.noise.history:  # a checkpoint of an earlier version kept its noise vectors: continue them
            return self.noise.draw(like, self.run.noise.generator("bandmf-noise", server_round=server_round))
        if self.noise_stream is None:
            self.noise_stream = noise_stream(self.run.noise, "bandmf-noise")
        keep = self.settings.noise_memory_gib * 2**30
        return self.noise.at_round(like, self.noise_stream, server_round, keep_bytes=keep)

    def mechanism(self) -> Mechanism:
        """What one round charges each member of its group."""
        if self.rate >= 1.0:
            return Gaussian(self.noise_multiplier)
        return SampledGaussian(self.noise_multiplier, self.rate)

    def _record_release(self, server_round: int) -> None:
        """Charge the round's whole group (its public members; the cohort within it stays secret)."""
        assert self.accountant is not None
        group = self.group_of_round(server_round)
        self.accountant.record(
            PrivacyEvent(
                server_round,
                self.mechanism(),
                participants=tuple(info.client_id for info in group),
                label=f"group {self.group_index(server_round) + 1} of {self.num_groups}",
            )
        )

    # ------------------------------------------------------------------ reporting

    def cohort_randomness(self) -> str:
        """Public groups; Poisson coins within a group from the privacy randomness (``q < 1``)."""
        if self.rate >= 1.0:
            return super().cohort_randomness()
        return (
            "groups public (seeded); within the round's group, secret Poisson coins drawn from the "
            "privacy randomness (run.noise), as amplification by sampling requires; see `source`"
        )

    def round_extras(self, server_round: int) -> dict[str, Any]:
        """The round's group (public)."""
        return {"group": self.group_index(server_round) + 1}

    def privacy_summary(self) -> dict[str, Any]:
        """Unit, mechanism, accountant, the matrix and the schedule."""
        limit = max_bands(
            num_clients=self.run.num_clients,
            clients_per_round=self.run.clients_per_round,
            rounds=self.num_rounds,
        )
        return {
            **super().privacy_summary(),
            "noise_multiplier": self.noise_multiplier,
            "clip": self.settings.clip,
            "bands": self.bands,
            "groups": self.num_groups,
            "bands_chosen": (
                f"strategy.bands=auto: the least z^2 ||A C^-1||_F^2 over 1..{limit} bands"
                if self.settings.bands == "auto"
                else "strategy.bands"
            ),
            "sampling_rate": self.rate,
            "max_participations": self.steps,
            "strategy_matrix": {
                "kind": "banded Toeplitz, unit column norm",
                "coefficients": list(self.matrix.coefficients),
                "workload": f"prefix sums, momentum {self.matrix.momentum}, {self.matrix.rounds} rounds",
                "loss": self.matrix.loss,
                "loss_relative_to_independent_noise": self.matrix.loss / self.matrix.identity_loss,
            },
            "accounting": (
                f"as DP-SGD with noise multiplier z, sampling rate q and ceil(T / b) = {self.steps} steps "
                "(Choquette-Choo et al. 2023, Theorem 4)"
            ),
            "server_lr": self.settings.server_lr,
            "server_momentum": self.settings.server_momentum,
        }
