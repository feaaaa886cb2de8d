"""Distributed DP-FedAvg: Skellam noise added on the devices, secure aggregation, no trusted server.

Agarwal, Kairouz, Liu, "The Skellam Mechanism for Differentially Private Federated Learning",
NeurIPS 2021, on the encoding of Kairouz, Liu, Steinke, "The Distributed Discrete Gaussian
Mechanism for Federated Learning with Secure Aggregation", ICML 2021, over SecAgg+ (Bell et al.,
CCS 2020) as Flower implements it. Each round t:

1. the cohort comes from a public, seeded balanced schedule (each client once per pass over the
   population, as DP-FTRL's): the server chooses the cohort, so no amplification by sampling is
   claimed against it;
2. the server runs SecAgg+'s setup and key-sharing stages (:class:`~.secagg.SecAggRound`), then
   sends the model with the round's public rotation seed inside the collect stage;
3. each client trains, clips its update to C, rotates it (randomized Hadamard), scales it by s,
   rounds it (conditional randomized rounding to the L2 bound Delta_2), adds Skellam noise of
   variance v per coordinate and reduces it mod 2^b (:func:`fl_app.privacy.distributed.encode_update`);
   SecAgg+'s client mod adds the masks;
4. when at least ``min_survivors`` clients' masked vectors arrived, the server unmasks their
   modular sum and decodes it: ``w_{t+1} = w_t + decode(sum) / m`` with ``m = clients_per_round``
   (the cohort it planned; a dropped client counts as a zero update). With fewer, the round is
   discarded: nothing is unmasked, nothing released, the model stays.

A round is charged as soon as the unmask requests go out, whether or not the sum then comes out:
the shares that come back may open the sum of a part of the survivors on its own
(:mod:`~.secagg`, "When a round is charged"). A round discarded before that is not charged.

Privacy: unit = one client's entire data set, zero-out neighbours (its data replaced by data whose
clipped update is zero; the public schedule is the same for both), against the server and anyone who
sees the models: the server learns only the modular sum, whose noise is the sum of at least
``min_survivors`` Skellam shares, i.e. Skellam of variance ``min_survivors * v``. One
:class:`~fl_app.privacy.events.Skellam` event per round whose unmasking started names every
scheduled client of that round; a client's rounds compose by RDP (the mechanism's own bound; no
PLD). ``s`` and ``v`` come from :func:`fl_app.privacy.distributed.plan_skellam`: the largest scale
whose sum fits in ``strategy.bits`` with ``strategy.k_stddevs`` standard deviations, and the
smallest noise with which the busiest client of the schedule ends at ``privacy.epsilon``. Trust: an
honest-but-curious server that runs the protocol as written and honest clients;
docs/algorithms/distributed_dp.md states the threat model and what breaks it.

Released: the models only. The replies carry no loss and no example count (SecAgg+ hides each
client's vector; the set of clients that completed a round is known to the server, as the schedule
is public).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import bytes_to_ndarray, log
from flwr.serverapp import Grid

from clients.dp_fedavg_secagg import ECHOED, ROTATION_SEED, SECAGG_PLAN
from fl_app import keys
from fl_app.config.checks import ConfigError
from fl_app.config.settings import RunSettings
from fl_app.engine.secagg import RECORD_KEY_CONFIGS, Key
from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.distributed import (
    SkellamPlan,
    decode_modular_sum,
    padded_dimension,
    plan_skellam,
    rotation_signs,
)
from fl_app.privacy.events import PrivacyEvent
from fl_app.run.context import RunContext
from strategies import register_strategy
from strategies.base import RecentRounds
from strategies.cohorts import max_participations
from strategies.contract import Declaration, QuickExample
from strategies.dp_fedavg_secagg.secagg import SecAggAbortedError, SecAggRound
from strategies.private import PrivateStrategy
from strategies.settings import StrategySettings, between, integer, positive

#: The fewest clients in any sum the server can unmask (see :meth:`DPFedAvgSecAggSettings.survivors`).
MIN_SUM = 3


@dataclass(frozen=True)
class DPFedAvgSecAggSettings(StrategySettings):
    """``cfg.strategy`` of ``dp_fedavg_secagg`` (its keys: ``conf/strategy/dp_fedavg_secagg.yaml``)."""

    clip: float = positive()
    bits: int = integer(minimum=4, maximum=30)
    min_survivors: float = between(0.0, 1.0, low_open=True)
    k_stddevs: float = positive()
    rounding_beta: float = between(0.0, 1.0, high_open=True)
    shares: int = integer(minimum=3)
    threshold: float = between(0.5, 1.0, low_open=True)
    budget_scopes = ("total",)

    def survivors(self, cohort: int) -> int:
        """The fewest vectors a released sum may hold: ``ceil(min_survivors * cohort)``, at least 3.

        Why 3: from a sum of 2, each of the two learns the other's vector, which carries one share of
        noise (and so does a server that colludes with one of them).
        """
        return max(MIN_SUM, math.ceil(self.min_survivors * cohort - 1e-9))

    def threshold_of(self, shares: int) -> int:
        """Shares needed to rebuild a secret: ``ceil(threshold * shares)``, more than half of them."""
        return max(shares // 2 + 1, math.ceil(self.threshold * shares - 1e-9))


def model_size(run: RunSettings) -> int:
    """Number of parameters of the run's network (the rotation's length before padding).

    Needs the data set's shape: the data and its split are checked first (each a one-line
    ``ConfigError``; the split is built once per process and reused by the run's own check).
    """
    from fl_app.config.validation import check_partitions, locate_data
    from fl_app.data.federated import federated_data
    from fl_app.learning.model_spec import ModelSpec

    locate_data(run)
    check_partitions(run)
    data = federated_data(run.data)
    name = DPFedAvgSecAggStrategy.declaration.model_name(run, data.input_shape)
    model = ModelSpec(name, data.input_shape, data.num_classes).build()
    return int(sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers()))


#: :func:`plan_skellam`, memoised (validation and the strategy's constructor plan the same run).
_plan = functools.lru_cache(maxsize=32)(plan_skellam)


def skellam_plan(run: RunSettings, *, size: int) -> SkellamPlan:
    """The run's plan; :class:`ConfigError` naming ``strategy.bits`` when the sum cannot fit."""
    settings: DPFedAvgSecAggSettings = run.strategy_settings
    cohort = min(run.cohort, run.num_clients)
    passes = max(1, run.num_clients // cohort)
    participations = math.ceil(run.num_rounds / passes)
    try:
        return _plan(
            epsilon=float(run.privacy.epsilon),
            delta=float(run.privacy.delta),
            clip=settings.clip,
            bits=settings.bits,
            dim=padded_dimension(size),
            survivors=settings.survivors(cohort),
            cohort=cohort,
            participations=participations,
            k=settings.k_stddevs,
            beta=settings.rounding_beta,
        )
    except ValueError as error:
        raise ConfigError("strategy.bits", settings.bits, f"too small: {error}") from None


def check(run: RunSettings) -> None:
    """The plan must exist (enough bits for the cohort, the model and the budget)."""
    if run.cohort < MIN_SUM:
        raise ConfigError(
            "clients_per_round",
            run.clients_per_round,
            f"must be at least {MIN_SUM} clients for secure aggregation (a released sum holds at least "
            f"{MIN_SUM}: from a sum of 2 each client learns the other's vector)",
        )
    skellam_plan(run, size=model_size(run))


@register_strategy("dp_fedavg_secagg")
class DPFedAvgSecAggStrategy(PrivateStrategy):
    """DP-FedAvg with distributed Skellam noise and SecAgg+ (see the module docstring)."""

    declaration = Declaration(
        name="dp_fedavg_secagg",
        paper=(
            "Agarwal, Kairouz, Liu, NeurIPS 2021 (Skellam mechanism); Kairouz, Liu, Steinke, ICML 2021 "
            "(distributed discrete Gaussian: rotation, conditional rounding, modular sum); SecAgg+ "
            "(Bell et al., CCS 2020) as implemented by Flower"
        ),
        unit=(
            "one client's entire data set (zero-out: replaced by data whose clipped update is zero; public "
            "cohort schedule), distributed DP: against the server and anyone who sees the models"
        ),
        mechanism=(
            "Skellam noise added on each device to its clipped, rotated, quantized update; secure "
            "aggregation (SecAgg+) reveals only the modular sum of at least min_survivors vectors"
        ),
        client="dp_fedavg_secagg",
        settings=DPFedAvgSecAggSettings,
        canaries=(
            "encodes and masks its uploads on the devices: a canary would have to run the protocol as a "
            "client (not built)"
        ),
        release_hint=": the models are the release",
        check=check,
        quick=QuickExample(
            overrides=(
                "num_clients=1000",
                "clients_per_round=100",
                "num_rounds=30",
                "local_epochs=5",
                "privacy.epsilon=8.0",
            ),
            suite_rounds=5,
            # 40 of the 1000 per round in the suite: SecAgg+'s four stages per round cost about the
            # cohort's size in messages and key agreements (100: 43.6 s for 5 rounds; 40: 26.7 s,
            # accuracy 0.604 against 0.486 at the same epsilon)
            suite_overrides=("clients_per_round=40",),
            about=(
                "distributed DP-FedAvg at epsilon 8 per client (delta 1e-5) against the server: 1000 "
                "clients, 100 per round on a balanced public schedule, 16-bit SecAgg+, noise calibrated for"
                " 90 survivors, 30 rounds of 5 local epochs"
            ),
        ),
        comparisons=("cross_device",),
        min_clients=MIN_SUM,
    )
    settings: DPFedAvgSecAggSettings
    ROUND_STATE = (*PrivateStrategy.ROUND_STATE, "_secagg", "_aborted")

    def __init__(self, run: RunContext, settings: DPFedAvgSecAggSettings | None = None) -> None:
        super().__init__(run, settings)
        settings = self.settings
        self.cohorts.plan(self.cohorts.seeded_schedule(run.settings.num_rounds, balanced=True))
        self.max_participations = max_participations(self.cohorts.planned)
        self.size = int(sum(int(np.prod(a.shape)) for a in self.initial_arrays().values()))
        self.plan = skellam_plan(run.settings, size=self.size)
        if self.max_participations > self.plan.participations:
            raise RuntimeError("the schedule gives a client more rounds than the calibration counted")
        self.survivors = self.plan.survivors
        self.denominator = float(run.clients_per_round)
        self.timeout = run.settings.simulation.timeout
        self.accountant = PrivacyAccountant(
            population=run.client_ids, unit=self.privacy_unit, method=run.settings.privacy.accountant
        )
        self._secagg: SecAggRound | None = None
        self._aborted: str | None = None
        self._outcome: dict[int, str] = RecentRounds()
        log(
            INFO,
            "DP-FedAvg with SecAgg+: clip C=%g, %d bits, scale %.4g, local Skellam variance %.4g, at least "
            "%d survivors of %d (noise of the sum / L2 bound = %.4f), busiest client in %d rounds",
            settings.clip,
            settings.bits,
            self.plan.scale,
            self.plan.local_variance,
            self.survivors,
            run.clients_per_round,
            self.plan.gaussian_noise_multiplier,
            self.max_participations,
        )

    # ------------------------------------------------------------------ the round

    def extra_train_config(self, server_round: int) -> dict[str, Any]:
        """The plan and the round's public rotation seed."""
        return {
            SECAGG_PLAN: json.dumps(self.plan.to_json()),
            ROTATION_SEED: self._rotation_seed(server_round),
        }

    def _rotation_seed(self, server_round: int) -> int:
        return int(self.run.randomness.generator("ddp-rotation", server_round=server_round).integers(2**62))

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """SecAgg+'s setup and key sharing with the cohort; then the collect stage's train messages."""
        clients = self._begin_round(server_round, arrays)
        settings = self.settings
        shares = min(settings.shares, len(clients))
        if shares < len(clients) and shares % 2 == 0:
            shares += 1
        self._secagg = SecAggRound(
            nodes=[c.node_id for c in clients],
            bits=settings.bits,
            shares=shares,
            threshold=settings.threshold_of(shares),
            send=lambda messages: grid.send_and_receive(messages, timeout=self.timeout),
            graph_rng=self.run.randomness.generator("secagg-graph", server_round=server_round),
            group=str(server_round),
            min_sum=self.survivors,
        )
        train = self.train_config(server_round, config)
        self._aborted = None
        try:
            keyed = self._secagg.setup_and_share_keys()
        except SecAggAbortedError as error:
            self._aborted = f"before training, {error}"
            return []
        log(
            INFO,
            "dp_fedavg_secagg round %d: %d of %d clients shared their keys; sending the train messages",
            server_round,
            len(keyed),
            len(clients),
        )
        return self._secagg.collect_messages(
            lambda nid: RecordDict({keys.ARRAYS: arrays, keys.CONFIG: train})
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Unmask the survivors' modular sum, decode it, account; or discard the round."""
        valid, _ = self.replies.split(server_round, replies)
        secagg, self._secagg = self._secagg, None
        aborted, self._aborted = self._aborted, None
        if secagg is not None and aborted is not None:  # discarded in setup or key sharing
            by_node = {c.node_id: c.client_id for c in self.replies.selected(server_round)}
            dropped = [by_node[n] for n in secagg.nodes if n not in secagg.keyed | set(secagg.refused)]
            self.replies.set_failures(server_round, dropped, "left the secure aggregation's first stages")
        if secagg is not None:
            self._mark_refused(server_round, secagg)
        if aborted is not None or secagg is None:
            self._discard(server_round, aborted or "no secure aggregation ran in this round")
            return None, MetricRecord()
        uploads: dict[int, list[np.ndarray]] = {}
        rejected = []
        for info, reply in valid:
            problem = self._reply_problem(reply)
            if problem:
                rejected.append(info.client_id)
                log(
                    WARNING,
                    "dp_fedavg_secagg round %d: client %d rejected: %s",
                    server_round,
                    info.client_id,
                    problem,
                )
                continue
            masked = reply.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS]
            uploads[info.node_id] = [bytes_to_ndarray(b) for b in masked]
        if rejected:
            self.replies.mark_failed(server_round, rejected, "applied other mechanism parameters than sent")
        if len(uploads) < self.survivors:
            self._discard(
                server_round,
                f"{len(uploads)} of {len(self.replies.selected(server_round))} clients completed the collect "
                f"stage, fewer than the {self.survivors} the noise is calibrated for "
                f"(strategy.min_survivors={self.settings.min_survivors:g}): nothing unmasked",
            )
            return None, MetricRecord()
        unmasked = self._unmask(server_round, secagg, uploads)
        if unmasked is None:
            return None, MetricRecord()
        total, parts = unmasked
        signs = rotation_signs(seed=self._rotation_seed(server_round), dim=self.plan.dim)
        estimate = (
            decode_modular_sum(total[-1], plan=self.plan, signs=signs, size=self.size) / self.denominator
        )
        self._outcome[server_round] = f"released: sum of {len(uploads)} clients" + (
            f" (in {len(parts)} parts the server can sum apart: "
            f"{' + '.join(str(len(p)) for p in parts)}, each at least {self.survivors})"
            if len(parts) > 1
            else ""
        )
        return self._apply(estimate), MetricRecord()

    def _unmask(
        self, server_round: int, secagg: SecAggRound, uploads: dict[int, list[np.ndarray]]
    ) -> tuple[list[np.ndarray], list[set[int]]] | None:
        """The survivors' modular sum and their graph's parts; None when the round is discarded.

        Charged as the unmask requests go out (even if too few shares then come back to finish) or,
        for a SecAgg+ round that releases a sum without asking, when it does; not charged when the
        survivors fail the checks before the requests.
        """
        charged: list[bool] = []

        def charge() -> None:
            charged.append(True)
            self._charge(server_round)

        try:
            parts = secagg.check_parts(set(uploads))
            total = secagg.unmask(secagg.masked_sum(uploads), set(uploads), charge=charge)
        except SecAggAbortedError as error:
            if charged:
                reason = f"unmasking failed: {error}: the shares that came back may open a part's sum"
                self._discard(server_round, f"{reason}: charged", charged=True)
            else:
                self._discard(server_round, f"unmasking refused: {error}: nothing unmasked")
            return None
        if not charged:
            charge()
        return total, parts

    def _charge(self, server_round: int) -> None:
        """Record the round's Skellam event for every scheduled client of the round."""
        assert self.accountant is not None
        self.accountant.record(
            PrivacyEvent(
                server_round,
                self.plan.mechanism,
                participants=tuple(c.client_id for c in self.replies.selected(server_round)),
                label="securely aggregated noisy sum",
            )
        )

    def _mark_refused(self, server_round: int, secagg: SecAggRound) -> None:
        """Count the devices refused in the setup stage as failed, with why."""
        if secagg.refused:
            by_node = {c.node_id: c.client_id for c in self.replies.selected(server_round)}
            reason = next(iter(secagg.refused.values()))
            self.replies.mark_failed(server_round, [by_node[n] for n in sorted(secagg.refused)], reason)

    def _apply(self, update: np.ndarray) -> ArrayRecord:
        new, offset = {}, 0
        for name, array in self.round_global.items():
            values = array.numpy()
            count = int(values.size)
            step = update[offset : offset + count].reshape(values.shape)
            new[name] = Array(np.asarray(values.astype(np.float64) + step, dtype=values.dtype))
            offset += count
        return ArrayRecord(new)

    def _reply_problem(self, reply: Message) -> str:
        records = reply.content.config_records
        if RECORD_KEY_CONFIGS not in records or Key.MASKED_PARAMETERS not in records[RECORD_KEY_CONFIGS]:
            return "no masked vector"
        metrics = records.get("fitres.metrics")
        if metrics is None:
            return "no mechanism parameters"
        for key in ECHOED:
            if key not in metrics or not math.isclose(
                float(metrics[key]), float(getattr(self.plan, key)), rel_tol=1e-12
            ):
                return f"{key}={metrics.get(key)!r}, expected {getattr(self.plan, key)!r}"
        return ""

    def _discard(self, server_round: int, reason: str, *, charged: bool = False) -> None:
        self._outcome[server_round] = f"discarded: {reason}"
        log(
            WARNING,
            "dp_fedavg_secagg round %d discarded (model unchanged%s): %s",
            server_round,
            "" if charged else ", nothing released",
            reason,
        )

    # ------------------------------------------------------------------ reports

    def round_extras(self, server_round: int) -> dict[str, Any]:
        """Whether the round released a sum (and of how many clients) or was discarded, and why."""
        return {"secure_aggregation": self._outcome.get(server_round, "")}

    def cohort_randomness(self) -> str:
        """The balanced schedule is public."""
        return (
            "public: a balanced schedule drawn from `seed` (each client once per pass over the population); "
            "the server chooses the cohort, so no amplification by sampling is claimed"
        )

    def privacy_summary(self) -> dict[str, Any]:
        """Unit, mechanism, the Skellam plan, SecAgg+ parameters and the trust assumptions."""
        return {
            **super().privacy_summary(),
            "adversary": (
                "the server (honest but curious: runs SecAgg+ as written) and anyone who sees the models; "
                "the clients are honest; see docs/algorithms/distributed_dp.md"
            ),
            "plan": self.plan.to_json(),
            "rounding_beta": self.settings.rounding_beta,
            "k_stddevs": self.settings.k_stddevs,
            "min_survivors": self.survivors,
            "denominator": self.denominator,
            "secagg": {"shares": self.settings.shares, "threshold": self.settings.threshold},
            "planned_max_participations": self.max_participations,
            "sensitivity": "L2 Delta_2, L1 Delta_1 of one client's rounded vector (integer domain), zero-out",
        }


__all__ = ["DPFedAvgSecAggSettings", "DPFedAvgSecAggStrategy"]
