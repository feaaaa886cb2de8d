"""KD-DP: differentially private federated learning with a knowledge-distillation teacher.

Tan, Xu, Wang, Luo, "Differential Privacy Federated Learning Method Based on
Knowledge Distillation" (基于知识蒸馏的差分隐私联邦学习方法), Computer Science
(计算机科学) 51(6A), 2024, 230600002. Only the abstract is available; it gives
the design (1-4 below), not the details. Every detail it leaves open is a choice,
listed with its reason in ``docs/algorithms/kd_dp.md``.

1. Clients are grouped by (public) data size into large-data and general clients
   (:func:`group_by_size`: ``n_k >= strategy.large_threshold``, or the
   ``ceil(strategy.large_fraction N)`` largest).
2. Teacher stage, rounds ``1..teacher_rounds``: the large-data clients train the
   teacher with local DP-SGD (:mod:`fl_app.privacy.dp_sgd`); the server averages
   their models weighted by size. At round ``teacher_rounds + 1`` the teacher's
   argmax labels the public split (post-processing of the DP teacher).
3. The special client (the pseudo-labelled public split, on the server) has each
   label perturbed once by k-ary randomized response at ``epsilon_special``
   (label-DP) and trains on the fixed noisy labels in every student round, with
   the forward-corrected loss ``-log(beta p_y + (1 - beta)/C)`` (``special_loss``).
4. Student stage: ``clients_per_round`` general clients (seeded) train the
   student (from the teacher or from the run's initial model, ``student_init``)
   with local DP-SGD; the server averages them and the special client's model.

Accounting (:mod:`strategies.kd_dp.privacy`): one unit, one training example of a federated
client; the budget split ``epsilon_teacher = privacy.epsilon - epsilon_special``; each
client's DP-SGD calibrated for the rounds of the seeded schedule it takes part in; a
large-data client charged ``epsilon_teacher + epsilon_special``; the run's epsilon the
larger of the two disjoint groups'. Replies whose echoed mechanism or arrays differ from
what was sent are rejected (their clients stay charged); federated evaluation is refused.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from clients.kd_dp import (
    KDDP_CLIP,
    KDDP_NOISE_MULTIPLIER,
    KDDP_SAMPLING_RATE,
    KDDP_STAGE,
    KDDP_STEPS,
    STUDENT_STAGE,
    TEACHER_STAGE,
    SpecialPseudoClient,
)
from fl_app import keys
from fl_app.config.checks import ConfigError, require_int
from fl_app.config.settings import RunSettings
from fl_app.learning.train_results import arrays_mismatch
from fl_app.learning.training import load_arrays
from fl_app.privacy.composition import EpsilonReport
from fl_app.run.context import RunContext
from fl_app.run.roster import ClientInfo
from strategies import register_strategy
from strategies.arrays import mean_arrays
from strategies.base import RecentRounds
from strategies.contract import Declaration, QuickExample
from strategies.kd_dp.privacy import (
    GENERAL,
    LARGE,
    RECORD_UNIT,
    DPSGDGroupPlan,
    KDDPBudget,
    KDDPLedger,
    group_by_size,
    split_kd_dp_budget,
)
from strategies.private import PrivateStrategy
from strategies.replies import echo_mismatch
from strategies.settings import StrategySettings, between, integer, one_of, positive

STUDENT_INITS = ("teacher", "fresh")
SPECIAL_LOSSES = ("forward", "plain")
TEACHER_CLIENT = "kd_dp_teacher"
GENERAL_CLIENT = "kd_dp_general"


@dataclass(frozen=True)
class KDDPSettings(StrategySettings):
    """``cfg.strategy`` of ``kd_dp`` (``conf/strategy/kd_dp.yaml`` explains each key)."""

    large_threshold: int | None = integer(minimum=1, optional=True)
    large_fraction: float | None = between(0.0, 1.0, low_open=True, high_open=True, optional=True)
    teacher_rounds: int | None = integer(minimum=0, optional=True)
    teacher_fraction: float = between(0.0, 1.0, high_open=True)
    teacher_clients_per_round: int | None = integer(minimum=1, optional=True)
    epsilon_special: float | None = positive(optional=True)
    epsilon_general: float | None = positive(optional=True)
    clip: float = positive()
    student_init: str = one_of(STUDENT_INITS)
    special_loss: str = one_of(SPECIAL_LOSSES)

    budget_scopes = ("total",)  # the budget split is for the whole run

    def stage_rounds(self, num_rounds: int) -> int:
        """``teacher_rounds``, else ``round(teacher_fraction * num_rounds)`` in ``[1, num_rounds - 1]``."""
        if self.teacher_rounds is not None:
            return self.teacher_rounds
        return min(max(1, round(self.teacher_fraction * num_rounds)), max(num_rounds - 1, 1))

    def budget(self, total: float) -> KDDPBudget:
        """The budget split of ``privacy.epsilon = total`` (raises ``ValueError`` beyond the total)."""
        return split_kd_dp_budget(
            total=total, epsilon_special=self.epsilon_special, epsilon_general=self.epsilon_general
        )

    def check(self, run: RunSettings) -> None:
        """Grouping, stages, the budget split (within ``privacy.epsilon``), a public split to label."""
        if (self.large_threshold is None) == (self.large_fraction is None):
            raise ConfigError(
                "strategy.large_threshold",
                self.large_threshold,
                "set exactly one of strategy.large_threshold and strategy.large_fraction "
                f"(got {self.large_fraction!r})",
            )
        rounds = run.num_rounds
        teacher = self.stage_rounds(rounds)
        if teacher > 0 and rounds < 2:
            raise ConfigError(
                "num_rounds", rounds, "kd_dp needs >= 2 rounds (teacher stage, then student stage)"
            )
        require_int("strategy.teacher_rounds", teacher, minimum=0, maximum=rounds - 1)
        if teacher == 0 and self.epsilon_special is not None:
            raise ConfigError(
                "strategy.epsilon_special",
                self.epsilon_special,
                "must be null with strategy.teacher_rounds=0 (no teacher, no pseudo-labels to protect)",
            )
        total = run.privacy.epsilon
        if self.epsilon_special is not None and self.epsilon_special >= total:
            raise ConfigError(
                "strategy.epsilon_special",
                self.epsilon_special,
                f"must be < privacy.epsilon={total:g}: the teacher's budget privacy.epsilon - "
                "epsilon_special must stay > 0 (or null: no label noise, the teacher gets the total)",
            )
        if self.epsilon_general is not None and self.epsilon_general > total:
            raise ConfigError(
                "strategy.epsilon_general",
                self.epsilon_general,
                f"must be <= privacy.epsilon={total:g} (null: the total)",
            )
        self.budget(total)
        if teacher > 0 and float(run.data.dataset.get("public_fraction", 0.0)) <= 0:
            raise ConfigError(
                "dataset.public_fraction",
                run.data.dataset.get("public_fraction", 0.0),
                "kd_dp needs a public split to pseudo-label: must be > 0",
            )


@register_strategy("kd_dp")
class KDDPStrategy(PrivateStrategy):
    """KD-DP: DP teacher on large-data clients, label-DP special client, DP general clients."""

    declaration = Declaration(
        name="kd_dp",
        paper="Tan, Xu, Wang, Luo, Computer Science 51(6A), 2024 (KD-DP)",
        unit=RECORD_UNIT,
        mechanism=(
            "local DP-SGD (per-example clipping, Gaussian noise) on large-data clients (teacher) and "
            "general clients (student); k-ary randomized response on the special client's pseudo-labels"
        ),
        client=GENERAL_CLIENT,
        settings=KDDPSettings,
        canaries=(
            "releases per training example (DP-SGD): the analogue is a canary record, not a canary "
            "client's update (see docs/empirical_privacy.md)"
        ),
        quick=QuickExample(
            overrides=(
                "num_clients=20",
                "clients_per_round=5",
                "num_rounds=10",
                "batch_size=64",
                "lr=0.4",
                "privacy.epsilon=4.0",
                "strategy.large_fraction=0.25",
                "strategy.epsilon_special=2.0",
            ),
            suite_rounds=4,
            beats_chance=0.15,
            about="KD-DP at epsilon 4 per training example (record level, delta 1e-5)",
        ),
        comparisons=("comparison", "record_level"),
        deploy=("strategy.teacher_rounds=1", "num_rounds=2"),
        sequences=(
            "its special client releases one pseudo-label per public example by k-ary randomized response "
            "over the classes, and its students learn from those labels; a text example has a next token "
            "at every position (its DP-SGD itself takes next-token networks: fl_app/privacy/dp_sgd.py)"
        ),
    )
    settings: KDDPSettings

    #: RDP whatever ``privacy.accountant`` says: a PLD per distinct client (q, steps) costs about a second
    #: each (14 s to build the 20-client quick example, against 2 s; minutes at N = 1000).
    ACCOUNTANT_METHOD = "rdp"

    def __init__(self, run: RunContext, settings: KDDPSettings | None = None) -> None:
        super().__init__(run, settings)
        settings = self.settings
        self.num_rounds = self.run.settings.num_rounds
        self.budget: KDDPBudget = settings.budget(self.run.settings.privacy.epsilon)
        self.teacher_rounds = settings.stage_rounds(self.num_rounds)
        large, general = self._groups()
        self.teacher_per_round = min(settings.teacher_clients_per_round or len(large), len(large))
        self.general_per_round = min(run.clients_per_round, len(general))
        self.plans = {
            LARGE: self._plan(LARGE, large, self.budget.teacher),
            GENERAL: self._plan(GENERAL, general, self.budget.general),
        }
        self._schedule = {r: self._draw(r) for r in range(1, self.num_rounds + 1)}
        for name, plan in self.plans.items():
            stage = TEACHER_STAGE if name == LARGE else STUDENT_STAGE
            cohorts = [clients for r, clients in self._schedule.items() if self.stage(r) == stage]
            plan.calibrate(
                Counter(c.client_id for clients in cohorts for c in clients),
                delta=run.settings.privacy.delta,
                method=self.ACCOUNTANT_METHOD,
            )
        self.ledger = KDDPLedger(
            plans=self.plans,
            population=run.client_ids,
            budget=self.budget,
            num_classes=int(run.model_spec.num_classes),
            method=self.ACCOUNTANT_METHOD,
            delta=run.settings.privacy.delta,
        )
        self.accountant = self.ledger.accountant
        self.special: SpecialPseudoClient | None = None
        self._round_start: dict[int, ArrayRecord] = RecentRounds()
        self._rejected: dict[int, list[int]] = {}
        self._special_loss: dict[int, float] = {}
        for plan in self.plans.values():
            log(INFO, "KD-DP %s", plan.describe())

    def _groups(self) -> tuple[list[int], list[int]]:
        """Large-data and general client ids (no grouping without a teacher stage)."""
        if self.teacher_rounds == 0:
            return [], list(self.run.client_ids)
        threshold, fraction = self.settings.large_threshold, self.settings.large_fraction
        sizes = {c.client_id: c.num_examples for c in self.run.roster}
        try:
            return group_by_size(sizes, threshold=threshold, fraction=fraction)
        except ValueError as error:
            key = "strategy.large_threshold" if threshold is not None else "strategy.large_fraction"
            span = f"client sizes {min(sizes.values())}..{max(sizes.values())}"
            raise ConfigError(key, threshold or fraction, f"{error} ({span})") from error

    def _plan(self, name: str, ids: list[int], epsilon: float) -> DPSGDGroupPlan:
        """The group's local DP-SGD plan from its clients' public sizes."""
        try:
            return DPSGDGroupPlan.for_sizes(
                name,
                {client: self.run.info(client).num_examples for client in ids},
                epsilon=epsilon,
                batch_size=self.run.settings.batch_size,
                local_epochs=self.run.settings.local_epochs,
            )
        except ValueError as error:
            raise ConfigError("num_clients", self.run.num_clients, str(error)) from error

    def stage(self, server_round: int) -> str:
        """``"teacher"`` for rounds ``1..teacher_rounds``, ``"student"`` after."""
        return TEACHER_STAGE if server_round <= self.teacher_rounds else STUDENT_STAGE

    def _draw(self, server_round: int) -> list[ClientInfo]:
        if self.stage(server_round) == TEACHER_STAGE:
            ids, count, purpose = self.plans[LARGE].ids, self.teacher_per_round, "kd-dp-teacher-sampling"
        else:
            ids, count, purpose = self.plans[GENERAL].ids, self.general_per_round, "client-sampling"
        if count >= len(ids):
            return [self.run.info(c) for c in ids]
        rng = self.run.randomness.generator(purpose, server_round=server_round)
        chosen = rng.choice(len(ids), size=count, replace=False)
        return [self.run.info(ids[i]) for i in sorted(chosen)]

    def select_clients(self, server_round: int) -> list[ClientInfo]:
        """The precomputed, seeded schedule (data-independent; the calibration relies on it)."""
        return list(self._schedule[server_round])

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Teacher stage: large-data clients. Student stage: pseudo-labels (once), then general clients."""
        stage = self.stage(server_round)
        if stage == STUDENT_STAGE and self.special is None and self.teacher_rounds > 0:
            self._release_pseudo_labels(server_round, arrays)
        clients = self.select_clients(server_round)
        self.replies.record_selected(server_round, clients)
        sent = self.records_for_clients(server_round, arrays)[keys.ARRAYS]
        self._round_start[server_round] = sent
        plan = self.plans[LARGE if stage == TEACHER_STAGE else GENERAL]
        messages = []
        for client in clients:
            record = self.train_config(server_round, config)
            record[keys.ALGORITHM] = TEACHER_CLIENT if stage == TEACHER_STAGE else GENERAL_CLIENT
            record[KDDP_STAGE] = stage
            for key, value in self._mechanism(plan, client.client_id).items():
                record[key] = value
            content = RecordDict({keys.ARRAYS: sent, keys.CONFIG: record})
            messages.append(
                Message(content=content, dst_node_id=client.node_id, message_type=MessageType.TRAIN)
            )
        return messages

    def records_for_clients(self, server_round: int, arrays: ArrayRecord) -> dict[str, ArrayRecord]:
        """The student's first round starts from the run's initial model when ``student_init: fresh``."""
        if server_round == self.teacher_rounds + 1 > 1 and self.settings.student_init == "fresh":
            return {keys.ARRAYS: self.initial_arrays()}  # seeded, independent of any data
        return {keys.ARRAYS: arrays}

    def _release_pseudo_labels(self, server_round: int, teacher_arrays: ArrayRecord) -> None:
        """Label the public split with the DP teacher; randomized response once per label."""
        teacher = self.run.model_spec.build()
        load_arrays(teacher, teacher_arrays)
        self.special = SpecialPseudoClient.from_teacher(
            teacher,
            self.run.data.public_x(),
            epsilon=self.budget.special,
            num_classes=int(self.run.model_spec.num_classes),
            rng=self.run.noise.generator("kd-dp-pseudo-label-rr", server_round=server_round),
        )
        self.ledger.record_pseudo_labels(server_round)
        log(
            INFO,
            "KD-DP: %d public examples pseudo-labelled by the DP teacher; %.1f%% of the labels kept "
            "their value after randomized response (epsilon_special=%s)",
            len(self.special),
            100.0 * self.special.agreement,
            self.budget.special,
        )

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Charge every selected client, check the replies, average (plus the special client's model)."""
        valid, _ = self.replies.split(server_round, replies)
        stage = self.stage(server_round)
        plan = self.plans[LARGE if stage == TEACHER_STAGE else GENERAL]
        selected = [c.client_id for c in self.replies.selected(server_round)]  # failures are charged too
        self.ledger.record_dp_sgd(server_round, plan.name, selected, stage=stage)
        start = self._round_start[server_round]
        records: list[ArrayRecord] = []
        weights: list[float] = []
        rejected = []
        for info, reply in valid:
            reason = self._check_reply(info, reply, plan, start)
            if reason:
                rejected.append(info.client_id)
                log(
                    WARNING,
                    "KD-DP round %d: reply of client %d rejected: %s",
                    server_round,
                    info.client_id,
                    reason,
                )
                continue
            records.append(reply.content.array_records[keys.ARRAYS])
            weights.append(float(info.num_examples))
        self._rejected[server_round] = rejected
        metrics: dict[str, float] = {"kd-dp-accepted": float(len(records))}
        if stage == STUDENT_STAGE and self.special is not None:
            rng = self.run.randomness.generator("kd-dp-special-data-order", server_round=server_round)
            forward = self.settings.special_loss == "forward"
            spec = self.run.model_spec
            run = self.run.settings
            sgd = {
                "local_epochs": run.local_epochs,
                "batch_size": run.batch_size,
                "lr": run.lr,
                "momentum": run.momentum,
            }
            arrays, loss = self.special.train_from(spec, start, sgd=sgd, rng=rng, correction=forward)
            self._special_loss[server_round] = metrics["kd-dp-special-train-loss"] = loss
            records.append(arrays)
            weights.append(float(len(self.special)))
        if not records:
            return None, MetricRecord(metrics)
        return mean_arrays(records, weights), MetricRecord(metrics)

    def _mechanism(self, plan: DPSGDGroupPlan, client: int) -> dict[str, float | int]:
        """The DP-SGD parameters sent to ``client``, which its reply must echo."""
        return {
            KDDP_NOISE_MULTIPLIER: plan.noise_multipliers[client],
            KDDP_SAMPLING_RATE: plan.sampling_rates[client],
            KDDP_STEPS: plan.steps_per_round[client],
            KDDP_CLIP: self.settings.clip,
        }

    def _check_reply(self, info: ClientInfo, reply: Message, plan: DPSGDGroupPlan, start: ArrayRecord) -> str:
        """Empty when the reply applied the mechanism it was sent and holds a model of the right shape."""
        return echo_mismatch(reply, self._mechanism(plan, info.client_id)) or arrays_mismatch(reply, start)

    def epsilon(self) -> EpsilonReport | None:
        """Overall epsilon: parallel composition (max) of the large-data and general groups."""
        return self.ledger.grouped().overall

    def round_extras(self, server_round: int) -> dict[str, Any]:
        """Stage, each group's cumulative epsilon, rejected replies, the special client's loss."""
        return {
            "stage": self.stage(server_round),
            **self.ledger.epsilons(),
            "rejected": len(self._rejected.get(server_round, [])),
            "special_train_loss": self._special_loss.get(server_round),
        }

    def privacy_summary(self) -> dict[str, Any]:
        """The ledger's summary, the groups and their rule, the special client, the stages."""
        report = self.ledger.summary(clip=self.settings.clip)
        label_noise = report.pop("special_label_noise")
        rule = (
            "none: teacher_rounds=0, every client is a general client (federated DP-SGD)"
            if self.teacher_rounds == 0
            else f"num_examples >= {self.settings.large_threshold}"
            if self.settings.large_threshold is not None
            else f"largest ceil({self.settings.large_fraction} * N) clients"
        )
        sizes = {name: [self.run.info(c).num_examples for c in plan.ids] for name, plan in self.plans.items()}
        return {
            **super().privacy_summary(),
            **report,
            "groups": {name: {"ids": plan.ids, "sizes": sizes[name]} for name, plan in self.plans.items()}
            | {"rule": rule},
            "special_client": {
                "runs_on": "server (the public split lives there)",
                "num_examples": None if self.special is None else len(self.special),
                "epsilon_per_label": label_noise["epsilon_per_label"],
                "keep_probability": label_noise["keep_probability"],
                "label_agreement_with_teacher": None if self.special is None else self.special.agreement,
                "ledger": label_noise["ledger"],
            },
            "stages": {
                "teacher_rounds": self.teacher_rounds,
                "student_rounds": self.num_rounds - self.teacher_rounds,
            },
        }

    def final_extras(self) -> dict[str, Any]:
        """Each group's final epsilon next to the overall one."""
        return self.ledger.epsilons()

    def budget_text(self) -> str:
        """The budget asked for, and its split over the groups."""
        large, general, budget = len(self.plans[LARGE].ids), len(self.plans[GENERAL].ids), self.budget
        return (
            f"{super().budget_text()}; {large} large-data and {general} general clients, budget "
            f"teacher={budget.teacher:g} special={budget.special} general={budget.general:g}"
        )
