"""NbAFL: noising before model aggregation, with K-random scheduling (the server side).

Wei, Li, Ding, Ma, Yang, Farokhi, Jin, Quek, Poor, "Federated Learning with
Differential Privacy: Algorithms and Performance Analysis", IEEE TIFS 15, 2020
(arXiv 1911.00222): Algorithm 1, the uplink sensitivity ``Delta s_U = 2C/m``
and noise ``sigma_U = c L Delta s_U / epsilon``, Lemma 1 (downlink sensitivity
``2C p_i / m``, minimised by uniform ``p_i``), Theorem 1 (downlink noise
``sigma_D = 2cC sqrt(T^2 - L^2 N) / (m N epsilon)`` if ``T > L sqrt(N)``) and the
K-random scheduling theorem (``sigma_D = 2cC sqrt(T^2/b^2 - L^2 K) / (m K epsilon)``
if ``T > epsilon / gamma``). Each round:

1. ``K`` clients (``strategy.k``; null: ``clients_per_round``) are drawn uniformly
   without replacement. The whole schedule is drawn from the run seed when the
   strategy is built, so ``L`` (the most uploads of any client) is known before
   round 1; with ``K = N`` every client uploads every round and ``L = T``;
2. each scheduled client trains, clips its whole parameter vector to L2 norm
   ``C`` and adds ``N(0, sigma_U^2)`` to every coordinate (:mod:`clients.nbafl`);
3. the server averages the uploads with ``p_i = 1/K`` and adds ``N(0, sigma_D^2)``
   (zero unless ``T`` exceeds the threshold) before the broadcast; the noised
   aggregate is the new global model.

Privacy accounting (see ``docs/algorithms/nbafl.md``). The reported epsilon comes from the
accountant and is **client level**: one ``Gaussian(sigma_U / 2C)`` event per round for
every scheduled client (failures included), composed over the uploads each client
actually made. Any two data sets of a client give clipped parameter vectors at most
``2C`` apart, so this is proven for the training that runs (multi-step local SGD), against
the server and anyone who sees the uploads (local noise). The document's record-level
reading (``Delta s_U = 2C/m``, replace one record) assumes that a client's upload is an
average of per-record terms of norm at most ``C``, which multi-step SGD does not satisfy:
it is composed by a second accountant and reported beside the headline by name
(``document_reading``), never as the run's epsilon.

``strategy.unit`` says what ``privacy.epsilon`` calibrates: ``client`` (default: the
headline epsilon is the requested one) or ``document_record`` (the document's reading
meets ``privacy.epsilon``; the headline client-level epsilon of the same noise is far
larger, and a warning says so). ``strategy.calibration`` says how: ``accountant``
(default: the L-fold composition meets the budget), ``analytic`` or the document's
``classic`` ``sigma_U = c L Delta s_U / epsilon``, which splits the budget by basic
composition (``(epsilon, L delta)``) and whose constant ``c`` is proven only for
``epsilon / L < 1``. The broadcast is post-processing of the noised uploads, so the
downlink noise does not change either epsilon; it is added as the document prescribes,
with the unit's sensitivity (``m = 1`` in Theorem 1 for the client unit).
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

from flwr.app import Array, ArrayRecord, MetricRecord
from flwr.common import log

from clients.nbafl import NBAFL_CLIP, NBAFL_MU, NBAFL_SIGMA_UP
from fl_app.config.checks import require_int, require_positive, require_range
from fl_app.config.settings import RunSettings
from fl_app.learning.sums import Upload
from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.calibration import (
    CLASSIC_GAUSSIAN_MAX_EPSILON,
    ClassicGaussianRangeWarning,
    classic_gaussian_constant,
)
from fl_app.privacy.events import Gaussian, PrivacyEvent
from fl_app.privacy.fixed_noise import FixedNoise
from fl_app.privacy.mechanisms import gaussian_mechanism
from fl_app.run.context import RunContext
from fl_app.run.roster import ClientInfo
from strategies import register_strategy
from strategies.arrays import arrays_like
from strategies.base import Replies
from strategies.contract import Declaration, QuickExample
from strategies.nbafl.privacy import (
    NBAFL_AMPLIFICATIONS,
    NBAFL_CALIBRATIONS,
    NBAFL_UNITS,
    nbafl_client_sensitivity,
    nbafl_downlink_sigma,
    nbafl_downlink_threshold,
    nbafl_sensitivity,
    nbafl_unit_sensitivity,
    nbafl_uplink_sigma,
)
from strategies.private import PrivateStrategy
from strategies.settings import StrategySettings, integer, non_negative, one_of, positive

RECORD_UNIT = (
    "one record of a client's local data set (replace one record; sensitivity Delta s_U = 2C/m): the "
    "document's reading, valid only if a client's uploaded model were an average of per-record terms of "
    "norm <= C; the implemented multi-step SGD does not satisfy it, so it is not a guarantee of this run"
)
CLIENT_UNIT = (
    "one client's entire data set (replace: any two clipped parameter vectors, sensitivity 2C), local DP "
    "(noised on the client: holds against the server and anyone who sees the uploads)"
)


@dataclass(frozen=True)
class NbAFLSettings(StrategySettings):
    """``cfg.strategy`` of ``nbafl`` (``conf/strategy/nbafl.yaml`` explains each key)."""

    clip: float = positive()
    k: int | None = integer(minimum=1, optional=True)
    mu: float = non_negative()
    unit: str = one_of(NBAFL_UNITS)
    calibration: str = one_of(NBAFL_CALIBRATIONS)
    amplification: str = one_of(NBAFL_AMPLIFICATIONS)
    sigma_up: float | None = non_negative(optional=True)
    sigma_down: float | None = non_negative(optional=True)

    def check(self, run: RunSettings) -> None:
        """K at most N; the (epsilon, delta) the calibration targets."""
        if self.k is not None:
            require_int("strategy.k", self.k, minimum=1, maximum=run.num_clients)
        require_positive("privacy.epsilon", run.privacy.epsilon)
        require_range("privacy.delta", run.privacy.delta, 0.0, 1.0, low_open=True, high_open=True)


@register_strategy("nbafl")
class NbAFLStrategy(PrivateStrategy):
    """Uniform averaging of locally noised models, downlink noise, K-random scheduling."""

    declaration = Declaration(
        name="nbafl",
        paper="Wei, Li, Ding, Ma, Yang, Farokhi, Jin, Quek, Poor, IEEE TIFS 15, 2020 (NbAFL)",
        unit=CLIENT_UNIT,
        mechanism=(
            "Gaussian noise N(0, sigma_U^2) on each scheduled client's clipped parameter vector (uplink), "
            "Gaussian noise N(0, sigma_D^2) on the uniform average (downlink, if T exceeds the threshold)"
        ),
        client="nbafl",
        settings=NbAFLSettings,
        canaries=(
            "uploads noised parameters, not updates: the analogue would be a canary whose parameters "
            "differ along u_k; not built (see docs/empirical_privacy.md)"
        ),
        quick=QuickExample(
            overrides=(
                "num_clients=50",
                "clients_per_round=50",
                "num_rounds=25",
                "lr=0.05",
                "partition.alpha=100.0",
                "privacy.epsilon=4.0",
                "privacy.delta=0.01",
                "strategy.clip=10.0",
                "strategy.unit=document_record",
                "strategy.calibration=accountant",
            ),
            suite_rounds=4,
            about=(
                "NbAFL with its noise calibrated for the document's record-level reading at epsilon 4 "
                "(delta 0.01); the run's headline epsilon is the client-level one of the same noise"
            ),
        ),
        comparisons=("comparison", "record_level"),
    )
    settings: NbAFLSettings

    def __init__(self, run: RunContext, settings: NbAFLSettings | None = None) -> None:
        super().__init__(run, settings)
        settings = self.settings
        self.clip = settings.clip
        self.mu = settings.mu
        self.calibration = settings.calibration
        self.amplification = settings.amplification
        self.num_rounds = self.run.settings.num_rounds
        self.epsilon_target = self.run.settings.privacy.epsilon
        self.k = settings.k if settings.k is not None else run.clients_per_round
        if not 1 <= self.k <= run.num_clients:
            raise ValueError(f"K={self.k} clients per round is not in [1, N={run.num_clients}]")
        self.schedule = self._draw_schedule()
        uploads = Counter(c.client_id for clients in self.schedule.values() for c in clients)
        self.exposures = max(uploads.values())
        self.min_dataset_size = min(info.num_examples for info in run.roster)
        if self.min_dataset_size < 1:
            raise ValueError("NbAFL needs every client to hold at least one example (m = 0 in the roster)")
        self.unit = settings.unit
        #: The sensitivity ``privacy.epsilon`` is calibrated for (``strategy.unit``).
        self.sensitivity = nbafl_unit_sensitivity(
            unit=self.unit, clip=self.clip, min_dataset_size=self.min_dataset_size
        )
        self.client_sensitivity = nbafl_client_sensitivity(clip=self.clip)
        self.record_sensitivity = nbafl_sensitivity(clip=self.clip, min_dataset_size=self.min_dataset_size)
        self.per_exposure_epsilon = self.epsilon_target / self.exposures
        self.classic_bound_holds = self.per_exposure_epsilon < CLASSIC_GAUSSIAN_MAX_EPSILON
        self._set_uplink_sigma(settings)
        self.downlink_threshold = nbafl_downlink_threshold(
            epsilon=self.epsilon_target,
            exposures=self.exposures,
            num_clients=run.num_clients,
            clients_per_round=self.k,
            amplification=self.amplification,
        )
        self._set_downlink_sigma(settings)
        self._open_accountants()
        self._uploads: dict[int, int] = {}
        self._sigma_down_used: dict[int, float] = {}
        self._log_setup()

    def _set_uplink_sigma(self, settings: NbAFLSettings) -> None:
        """``sigma_U``: set by hand, or calibrated for ``strategy.unit`` (warns outside its proven range)."""
        self.range_warning: str | None = None
        if settings.sigma_up is not None:
            self.sigma_up = settings.sigma_up
            self.sigma_up_source = "strategy.sigma_up (set by hand)"
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ClassicGaussianRangeWarning)
            self.sigma_up = nbafl_uplink_sigma(
                epsilon=self.epsilon_target,
                delta=self.run.settings.privacy.delta,
                clip=self.clip,
                min_dataset_size=self.min_dataset_size,
                exposures=self.exposures,
                calibration=self.calibration,
                method=self.run.settings.privacy.accountant,
                unit=self.unit,
            )
        self.sigma_up_source = f"calibration={self.calibration}, unit={self.unit}"
        if caught:
            self.range_warning = (
                f"epsilon/L = {self.epsilon_target:g}/{self.exposures} = {self.per_exposure_epsilon:.4g} "
                ">= 1 per upload: the classic Gaussian bound (sigma = c Delta s / epsilon, Dwork & Roth "
                "Theorem A.1) is not proven here, so the document's (epsilon, delta) claim is not a "
                "guarantee; the accountant's epsilon is. strategy.calibration=analytic (exact Gaussian "
                "per upload) or accountant (L-fold composition meets epsilon) calibrate soundly"
            )

    def _set_downlink_sigma(self, settings: NbAFLSettings) -> None:
        """``sigma_D``: set by hand, or the document's theorem for the unit's sensitivity."""
        if settings.sigma_down is not None:
            self.sigma_down = settings.sigma_down
            self.sigma_down_source = "strategy.sigma_down (set by hand)"
            return
        self.sigma_down = nbafl_downlink_sigma(
            epsilon=self.epsilon_target,
            delta=self.run.settings.privacy.delta,
            clip=self.clip,
            # Theorem 1's 2C/m is the unit's sensitivity: 2C (m = 1) for the client unit
            min_dataset_size=self.min_dataset_size if self.unit == "document_record" else 1,
            exposures=self.exposures,
            num_rounds=self.num_rounds,
            num_clients=self.run.num_clients,
            clients_per_round=self.k,
            amplification=self.amplification,
        )
        self.sigma_down_source = f"the document's theorem (amplification={self.amplification})"

    def _open_accountants(self) -> None:
        """The client-level accountant (the headline) and the document's record-level reading beside it."""
        #: The document's record-level reading (not a guarantee of this run), beside the headline.
        self.document_accountant: PrivacyAccountant | None = None
        if self.sigma_up > 0:
            method = self.run.settings.privacy.accountant
            self.accountant = PrivacyAccountant(
                population=self.run.client_ids, unit=CLIENT_UNIT, method=method
            )
            self.document_accountant = PrivacyAccountant(
                population=self.run.client_ids, unit=RECORD_UNIT, method=method
            )
        if self.unit == "document_record":
            log(
                WARNING,
                "NbAFL: strategy.unit=document_record calibrates privacy.epsilon=%g for the document's "
                "record-level reading, which multi-step local SGD does not satisfy; the run's epsilon is "
                "the client-level one of the same noise (see the round lines and results.json)",
                self.epsilon_target,
            )

    # ------------------------------------------------------------------ configuration

    def extra_train_config(self, server_round: int) -> dict[str, Any]:
        """C, sigma_U and mu for the clients."""
        return {NBAFL_CLIP: self.clip, NBAFL_SIGMA_UP: self.sigma_up, NBAFL_MU: self.mu}

    # ------------------------------------------------------------------ K-random scheduling

    def _draw_schedule(self) -> dict[int, list[ClientInfo]]:
        """K clients per round for all T rounds, uniform without replacement (seeded as the base's)."""
        schedule: dict[int, list[ClientInfo]] = {}
        for server_round in range(1, self.num_rounds + 1):
            rng = self.run.randomness.generator("client-sampling", server_round=server_round)
            chosen = rng.choice(self.run.num_clients, size=self.k, replace=False)
            schedule[server_round] = [self.run.roster[i] for i in sorted(chosen)]
        return schedule

    def select_clients(self, server_round: int) -> list[ClientInfo]:
        """The precomputed K-random schedule."""
        if server_round not in self.schedule:
            raise RuntimeError(f"round {server_round} is outside the schedule of T={self.num_rounds} rounds")
        return list(self.schedule[server_round])

    def uploads_per_client(self) -> dict[int, int]:
        """How many times the schedule asks each client to upload (L is the maximum)."""
        counts = Counter(c.client_id for clients in self.schedule.values() for c in clients)
        return {client: counts.get(client, 0) for client in self.run.client_ids}

    # ------------------------------------------------------------------ aggregation

    def summand(self, server_round: int) -> Upload:
        """Each client's noised model as it came: the average is their sum / count."""
        return Upload()

    def aggregate(
        self, server_round: int, replies: Replies
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Uniform average of the noised uploads plus the downlink noise."""
        self._record_uploads(server_round)
        self._uploads[server_round] = len(replies)
        if not replies:
            return None, None
        if len(replies) < self.k and self.sigma_down > 0:
            log(
                WARNING,
                "NbAFL round %d: %d of %d uploads; sigma_D is the one computed for K=%d",
                server_round,
                len(replies),
                self.k,
                self.k,
            )
        total = replies.sum(self.summand(server_round))
        count = len(total.members)
        average = arrays_like([total.arrays[name] / count for name in total.arrays], self.round_global)
        self._sigma_down_used[server_round] = self.sigma_down
        if self.sigma_down > 0:
            rng = self.run.noise.generator("nbafl-downlink", server_round=server_round)
            average = ArrayRecord(
                {
                    name: Array(gaussian_mechanism(values=array.numpy(), sigma=self.sigma_down, rng=rng))
                    for name, array in average.items()
                }
            )
        return average, MetricRecord({"uploads": len(replies)})

    def _record_uploads(self, server_round: int) -> None:
        """One Gaussian event per scheduled client (failures included), client level and the document's."""
        if self.accountant is None or self.document_accountant is None:
            return
        participants = tuple(c.client_id for c in self.replies.selected(server_round))
        if not participants:
            return
        self.accountant.record(
            PrivacyEvent(
                server_round,
                Gaussian(self.sigma_up / self.client_sensitivity),
                participants=participants,
                label="uplink (client level)",
            )
        )
        self.document_accountant.record(
            PrivacyEvent(
                server_round,
                Gaussian(self.sigma_up / self.record_sensitivity),
                participants=participants,
                label="uplink (the document's record-level reading)",
            )
        )

    # ------------------------------------------------------------------ reporting

    def document_record_epsilon(self) -> float | None:
        """The document's record-level reading of the worst client (None: no noise); not a guarantee."""
        if self.document_accountant is None:
            return None
        return self.document_accountant.epsilon(delta=self.run.settings.privacy.delta).epsilon

    def round_extras(self, server_round: int) -> dict[str, Any]:
        """Uploads aggregated, downlink sigma used, the document's record-level reading so far."""
        return {
            "uploads": self._uploads.get(server_round, 0),
            "sigma_down": self._sigma_down_used.get(server_round, 0.0),
            "epsilon_document_record": self.document_record_epsilon(),
        }

    def privacy_summary(self) -> dict[str, Any]:
        """Unit, mechanism, accountant, the calibration, the document's reading and claim."""
        uploads = self.uploads_per_client()
        return {
            **super().privacy_summary(),
            "noise_multiplier": self.sigma_up / self.client_sensitivity,
            "document_reading": {
                "unit": RECORD_UNIT,
                "accountant": (
                    f"{self.run.settings.privacy.accountant}, Gaussian(sigma_U / (2C/m)) per upload: what "
                    "the "
                    "document's Delta s_U = 2C/m would give; not a guarantee for multi-step local SGD"
                ),
                "noise_multiplier": self.sigma_up / self.record_sensitivity,
                "epsilon": self.document_record_epsilon(),
            },
            "budget": {
                "epsilon": self.epsilon_target,
                "delta": self.run.settings.privacy.delta,
                "unit": self.unit,
                "per_upload_epsilon": self.per_exposure_epsilon,
                "classic_bound_holds": self.classic_bound_holds,
                "holds_as": self._claim_status(),
                "warning": self.range_warning,
            },
            "calibration": self.calibration,
            "sigma_up": self.sigma_up,
            "sigma_up_source": self.sigma_up_source,
            "sigma_down": self.sigma_down,
            "sigma_down_source": self.sigma_down_source,
            "downlink_threshold_rounds": self.downlink_threshold,
            "amplification": self.amplification,
            "clip": self.clip,
            "sensitivity": self.client_sensitivity,
            "sensitivity_document_record": self.record_sensitivity,
            "c": classic_gaussian_constant(delta=self.run.settings.privacy.delta),
            "m": self.min_dataset_size,
            "N": self.run.num_clients,
            "K": self.k,
            "T": self.num_rounds,
            "L": self.exposures,
            "uploads_min": min(uploads.values()),
            "uploads_max": max(uploads.values()),
            "weights": "uniform p_i = 1/K over the received uploads",
        }

    def fixed_noise(self) -> FixedNoise | None:
        """``strategy.sigma_up`` set: the busiest client's epsilon over its L uploads (None: calibrated)."""
        if self.settings.sigma_up is None:
            return None
        return self.planned_gaussian(
            "strategy.sigma_up",
            noise_multiplier=self.sigma_up / self.client_sensitivity,
            sampling_rate=1.0,
            participations=self.exposures,
            value=self.sigma_up,
        )

    def _claim_status(self) -> str:
        """What ``privacy.epsilon`` amounts to for this run's unit and calibration."""
        if self.settings.sigma_up is not None:
            return "sigma_U set by hand: no calibration applies; the accountant's client-level epsilon does"
        reading = (
            "the client-level epsilon (the run's)"
            if self.unit == "client"
            else "the document's record-level reading only (not a guarantee of this run; the run's "
            "client-level epsilon of the same noise is far larger)"
        )
        if self.calibration == "accountant":
            return f"{reading}, by the accountant's composition of the L uploads"
        if self.calibration == "classic" and not self.classic_bound_holds:
            return f"{reading}: not proven (epsilon/L >= 1, see warning); the accountant's epsilon is"
        return (
            f"{reading}: (epsilon, L delta) = ({self.epsilon_target:g}, "
            f"{self.exposures * self.run.settings.privacy.delta:g}) "
            "by basic composition of L uploads at (epsilon/L, delta)"
        )

    def final_extras(self) -> dict[str, Any]:
        """The document's record-level reading and the schedule beside the run's (client-level) epsilon."""
        return {
            "epsilon_document_record": self.document_record_epsilon(),
            "L": self.exposures,
            "K": self.k,
        }

    def cohort_text(self) -> str:
        """K instead of clients_per_round."""
        return f"K={self.k} of N={self.run.num_clients} clients per round"

    def _log_setup(self) -> None:
        log(
            INFO,
            "NbAFL: N=%d, K=%d, T=%d, L=%d, m=%d, C=%g; sigma_U=%.5g (%s, noise multiplier %.4g per client), "
            "sigma_D=%.5g (threshold T > %.4g)",
            self.run.num_clients,
            self.k,
            self.num_rounds,
            self.exposures,
            self.min_dataset_size,
            self.clip,
            self.sigma_up,
            self.sigma_up_source,
            self.sigma_up / self.client_sensitivity,
            self.sigma_down,
            self.downlink_threshold,
        )
        if self.range_warning:
            log(WARNING, "NbAFL: %s", self.range_warning)
        if self.sigma_up <= 0:
            log(WARNING, "NbAFL: sigma_U = 0: uploads are not noised, epsilon is reported as null (infinite)")
        if self.run.settings.evaluation.federated_fraction > 0:
            log(
                WARNING,
                "NbAFL: federated evaluation sends un-noised local metrics; they are outside the guarantee",
            )
