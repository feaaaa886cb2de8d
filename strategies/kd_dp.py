"""KD-DP: differentially private federated learning with a knowledge-distillation teacher.

Tan, Xu, Wang, Luo, "Differential Privacy Federated Learning Method Based on
Knowledge Distillation" (基于知识蒸馏的差分隐私联邦学习方法), Computer Science
(计算机科学) 51(6A), 2024, 230600002. Only the abstract is available; it gives
the design, not the details. The design as the abstract states it:

1. clients are grouped by data size into "large-data clients" and "general
   clients";
2. a teacher model is trained on the large-data clients' data and labels an
   unlabeled public data set;
3. the pseudo-labelled public set joins federated training as a "special
   client" beside the general clients; all clients' data is protected by DP,
   and because only the special client's labels are private it gets its own
   (the abstract says: larger) budget;
4. the total budget is limited: the federated-training stage's budgets are
   fixed and the pseudo-labelling stage gets what the clients' requirement
   leaves, by parallel composition over the two disjoint groups.

The reading implemented here (every detail the abstract leaves open is a
choice, listed with its reason in ``docs/kd_dp.md``):

* **Grouping** (:func:`group_by_size`): client ``k`` is a large-data client when
  ``n_k >= strategy.large_threshold``, or (``strategy.large_fraction``) when it
  is among the ``ceil(fraction N)`` largest clients (ties: lower id first).
  Data-set sizes come from the roster and are treated as public by the
  platform (they also set FedAvg weights, DP-SGD sampling rates and step
  counts); the grouping therefore costs no budget.
* **Rounds**: rounds ``1..teacher_rounds`` are the teacher stage, rounds
  ``teacher_rounds+1..num_rounds`` the student stage. The platform's round loop
  (``Strategy.start``) runs both; ``rounds[].accuracy`` is the teacher's in the
  first stage and the student's in the second. ``teacher_rounds: 0`` is the
  ablation without knowledge distillation: no grouping, no teacher, no special
  client, every client a general client (federated local DP-SGD at
  ``epsilon_general``), the "traditional" record-level baseline in the same unit.
* **Teacher stage** (large-data clients only): every round, every large-data
  client (or ``teacher_clients_per_round`` of them, seeded) trains the teacher
  with local DP-SGD (:mod:`fl_app.privacy.dp_sgd`: Poisson sampling at rate
  ``q_k``, per-example clipping to ``strategy.clip``, Gaussian noise) and the
  server averages the returned models weighted by their public sizes.
* **Pseudo-labels**: at the start of round ``teacher_rounds + 1`` the server
  labels the public split (``run.data.public_x()``; its true labels are never
  read) with the teacher's argmax: a post-processing of the DP teacher.
* **Special client** (server-side pseudo-client, because the public data lives
  on the server): each pseudo-label is perturbed *once* by k-ary randomized
  response at ``epsilon_special`` (label-DP, replace-one-label); the noisy
  labels are then fixed and the special client trains on them in every student
  round like a client, so its per-label cost is ``epsilon_special`` whatever
  the number of rounds. ``epsilon_special: null`` skips the randomized response.
  Its loss (``special_loss: forward``) is the likelihood of the observed label
  under the known randomized response, ``-log(beta p_y + (1 - beta)/C)``
  (forward loss correction), so the student is not pulled towards the
  flattened noisy label distribution; ``plain`` is cross-entropy on the noisy labels.
* **Student stage**: each round ``clients_per_round`` general clients (seeded,
  uniform without replacement) train the student with local DP-SGD; the server
  averages their models and the special client's, weighted by sizes (the
  special client's size is the public split's). The student
  starts from the teacher (``student_init: teacher``, post-processing) or from the
  run's seeded initial model (``fresh``). Large-data clients do not take part.

Privacy accounting (one unit for the guarantee: **one training example of a
federated client, added or removed**, record-level DP; the server need not be
trusted for it, since every model leaves a device already noised):

* DP-SGD on client ``k``: each step is ``SampledGaussian(z_k, q_k)`` (``Gaussian(z_k)``
  when ``q_k = 1``) in that unit; with ``q_k = min(1, B / n_k)`` (expected batch
  ``B = batch_size``) and ``local_epochs * ceil(n_k / B)`` steps per round, recorded as one
  :class:`~fl_app.privacy.events.PrivacyEvent` per round naming every
  *selected* client (failures and rejected replies included). The client
  schedule is drawn in advance from the run seed (data-independent), so
  ``z_k`` is calibrated (:func:`~fl_app.privacy.calibration.dp_sgd_noise_multiplier`)
  for the number of rounds client ``k`` will actually be selected in:
  ``epsilon_teacher`` for large-data clients, ``epsilon_general`` for general ones.
* Budget split (:func:`~fl_app.privacy.budget.split_kd_dp_budget`):
  ``epsilon_teacher = privacy.epsilon - epsilon_special`` (``privacy.epsilon``
  when ``epsilon_special`` is null), ``epsilon_general`` defaults to
  ``privacy.epsilon``; validation refuses a split beyond the total.
* A large-data client is charged ``epsilon_teacher + epsilon_special``
  (sequential composition, the document's rule). In the record unit this is an
  *upper bound*: the pseudo-labels and everything after them are a
  post-processing of the DP teacher, so the teacher's epsilon alone already
  bounds a large-data client's loss; the ``epsilon_special`` term is charged,
  not needed. (It is a different unit -- one pseudo-label -- and is only added
  as a non-negative surplus, never composed as if it were the same unit.)
* A general client's epsilon is its DP-SGD epsilon (it is touched by nothing else).
* Parallel composition: the groups are disjoint, so the guarantee for every
  client is ``max(large, general)`` (:func:`~fl_app.privacy.budget.grouped_epsilon`);
  :meth:`epsilon` returns it and the platform writes it to ``rounds[].epsilon``.
  ``privacy`` in ``results.json`` lists each group's epsilon, the special
  client's label-DP epsilon (its own unit) and the overall one.

Nothing else leaves a client: DP-SGD clients reply with the model, their size
and an echo of the mechanism parameters (replies whose echo differs from what
was sent, or whose arrays do not match the model, are rejected; their clients
stay charged). Client-side evaluation (``evaluation.federated_fraction > 0``)
is refused: its metrics would be un-noised functions of private data.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from logging import INFO, WARNING
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log
from omegaconf import DictConfig

from clients.kd_dp import STUDENT_STAGE, TEACHER_STAGE, SpecialPseudoClient
from fl_app import keys
from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.budget import GroupedEpsilon, KDDPBudget, grouped_epsilon, split_kd_dp_budget
from fl_app.privacy.calibration import dp_sgd_noise_multiplier
from fl_app.privacy.composition import EpsilonReport
from fl_app.privacy.dp_sgd import dp_sgd_mechanism
from fl_app.privacy.events import PrivacyEvent, RandomizedResponse
from fl_app.roster import ClientInfo
from fl_app.run_context import RunContext
from fl_app.training import load_arrays, model_to_arrays
from fl_app.validation import ConfigError, require_choice, require_int, require_positive, require_range
from strategies import register_strategy
from strategies.base import FederatedStrategy, RecentRounds, mean_arrays

LARGE = "large"
GENERAL = "general"
SPECIAL = "special"
SPECIAL_CLIENT_ID = -1
STUDENT_INITS = ("teacher", "fresh")
SPECIAL_LOSSES = ("forward", "plain")
TEACHER_CLIENT = "kd_dp_teacher"
GENERAL_CLIENT = "kd_dp_general"

RECORD_UNIT = "one training example of a federated client (add or remove one example), record-level DP"
LABEL_UNIT = "one pseudo-label of the public split (replace one label), label-DP"


def teacher_rounds(cfg: DictConfig) -> int:
    """Rounds of the teacher stage: ``strategy.teacher_rounds``, or derived from ``teacher_fraction``.

    With ``teacher_rounds: null`` (the default) the teacher gets ``round(teacher_fraction * num_rounds)``
    rounds, at least 1 and at most ``num_rounds - 1`` (the student needs a round), so the default never
    contradicts ``num_rounds`` (a fraction of 1/3: 5 of 15 rounds as in ``+experiment=kd_dp``).
    """
    settings = cfg.strategy
    if settings.teacher_rounds is not None:
        return int(settings.teacher_rounds)
    rounds = int(cfg.num_rounds)
    return min(max(1, round(float(settings.teacher_fraction) * rounds)), max(rounds - 1, 1))


def group_by_size(
    roster: Sequence[ClientInfo], *, threshold: int | None, fraction: float | None
) -> tuple[list[int], list[int]]:
    """Split the roster into large-data and general clients by data-set size.

    Parameters
    ----------
    roster : Sequence[ClientInfo]
        The federation (sizes are public).
    threshold : int or None
        Large-data clients have at least ``threshold`` examples.
    fraction : float or None
        Large-data clients are the ``ceil(fraction * N)`` largest (ties: lower id first).

    Returns
    -------
    tuple[list[int], list[int]]
        Sorted ids of the large-data clients and of the general clients.

    Raises
    ------
    ValueError
        Unless exactly one of ``threshold``/``fraction`` is given and both groups are non-empty.

    """
    if (threshold is None) == (fraction is None):
        raise ValueError("exactly one of threshold and fraction must be set")
    if threshold is not None:
        large = {c.client_id for c in roster if c.num_examples >= threshold}
    else:
        assert fraction is not None
        if not 0 < fraction < 1:
            raise ValueError(f"fraction must be in (0, 1), got {fraction!r}")
        count = math.ceil(round(fraction * len(roster), 9))  # 0.1 * 30 is 3.0000000000000004
        ordered = sorted(roster, key=lambda c: (-c.num_examples, c.client_id))
        large = {c.client_id for c in ordered[:count]}
    general = sorted(c.client_id for c in roster if c.client_id not in large)
    if not large:
        raise ValueError("no client is a large-data client")
    if not general:
        raise ValueError("every client is a large-data client: no general client is left")
    return sorted(large), general


@dataclass
class GroupPlan:
    """One group's local DP-SGD plan (public constants of the mechanism).

    Attributes
    ----------
    name : str
        ``"large"`` or ``"general"``.
    ids : list[int]
        The group's clients.
    epsilon : float
        Target epsilon of each client's DP-SGD in the record unit.
    sampling_rates : dict[int, float]
        ``q_k = min(1, B / n_k)`` per client (expected batch ``B``).
    steps_per_round : dict[int, int]
        ``local_epochs * ceil(n_k / B)`` per client (``local_epochs`` expected passes).
    participations : dict[int, int]
        Rounds each client is scheduled in.
    noise_multipliers : dict[int, float]
        Calibrated ``z`` per scheduled client.

    """

    name: str
    ids: list[int]
    epsilon: float
    sampling_rates: dict[int, float]
    steps_per_round: dict[int, int]
    participations: dict[int, int] = field(default_factory=dict)
    noise_multipliers: dict[int, float] = field(default_factory=dict)


@register_strategy("kd_dp")
class KDDPStrategy(FederatedStrategy):
    """KD-DP: DP teacher on large-data clients, label-DP special client, DP general clients."""

    client_name = GENERAL_CLIENT
    privacy_unit = RECORD_UNIT
    mechanism_name = (
        "local DP-SGD (per-example clipping, Gaussian noise) on large-data clients (teacher) and "
        "general clients (student); k-ary randomized response on the special client's pseudo-labels"
    )

    def __init__(self, run: RunContext) -> None:
        super().__init__(run)
        cfg, settings = self.cfg, self.cfg.strategy
        self.budget: KDDPBudget = split_kd_dp_budget(
            total=float(cfg.privacy.epsilon),
            epsilon_special=None if settings.epsilon_special is None else float(settings.epsilon_special),
            epsilon_general=None if settings.epsilon_general is None else float(settings.epsilon_general),
        )
        self.teacher_rounds = teacher_rounds(cfg)
        try:
            large, general = [], list(run.client_ids)
            if self.teacher_rounds > 0:
                large, general = group_by_size(
                    run.roster,
                    threshold=None if settings.large_threshold is None else int(settings.large_threshold),
                    fraction=None if settings.large_fraction is None else float(settings.large_fraction),
                )
        except ValueError as error:
            key = (
                "strategy.large_threshold"
                if settings.large_threshold is not None
                else "strategy.large_fraction"
            )
            value = (
                settings.large_threshold if settings.large_threshold is not None else settings.large_fraction
            )
            sizes = sorted(c.num_examples for c in run.roster)
            raise ConfigError(key, value, f"{error} (client sizes {sizes[0]}..{sizes[-1]})") from error
        self.num_rounds = int(cfg.num_rounds)
        self.clip = float(settings.clip)
        self.student_init = str(settings.student_init)
        self.special_loss = str(settings.special_loss)
        self.teacher_per_round = (
            len(large)
            if settings.teacher_clients_per_round is None
            else min(int(settings.teacher_clients_per_round), len(large))
        )
        self.general_per_round = min(run.clients_per_round, len(general))
        self.plans = {
            LARGE: self._plan(LARGE, large, self.budget.teacher),
            GENERAL: self._plan(GENERAL, general, self.budget.general),
        }
        self._schedule = {r: self._draw(r) for r in range(1, self.num_rounds + 1)}
        for server_round, clients in self._schedule.items():
            plan = self.plans[LARGE if self.stage(server_round) == TEACHER_STAGE else GENERAL]
            for client in clients:
                plan.participations[client.client_id] = plan.participations.get(client.client_id, 0) + 1
        for plan in self.plans.values():
            for client, count in plan.participations.items():
                plan.noise_multipliers[client] = dp_sgd_noise_multiplier(
                    epsilon=plan.epsilon,
                    delta=run.delta,
                    sampling_rate=plan.sampling_rates[client],
                    steps=plan.steps_per_round[client] * count,
                )
        method = str(cfg.privacy.accountant)
        self.accountant = PrivacyAccountant(population=run.client_ids, unit=RECORD_UNIT, method=method)
        self.special_accountant = PrivacyAccountant(
            population=[SPECIAL_CLIENT_ID], unit=LABEL_UNIT, method=method
        )
        self.special: SpecialPseudoClient | None = None
        self._round_start: dict[int, ArrayRecord] = RecentRounds()
        self._rejected: dict[int, list[int]] = {}
        self._special_loss: dict[int, float] = {}
        self._epsilon_cache: tuple[tuple[int, int], GroupedEpsilon] | None = None
        for plan in self.plans.values():
            z, q = sorted(plan.noise_multipliers.values()), sorted(plan.sampling_rates.values())
            steps = sorted(plan.steps_per_round.values())
            log(
                INFO,
                "KD-DP %s clients: %d, epsilon %.4g, q in [%s], DP-SGD steps/round in [%s], z in [%s]",
                plan.name,
                len(plan.ids),
                plan.epsilon,
                f"{q[0]:.4g}, {q[-1]:.4g}" if q else "-",
                f"{steps[0]}, {steps[-1]}" if steps else "-",
                f"{z[0]:.4g}, {z[-1]:.4g}" if z else "-",
            )

    # ------------------------------------------------------------------ configuration

    @classmethod
    def validate_config(cls, cfg: DictConfig) -> None:
        """Grouping, stages, budgets (the split must fit in ``privacy.epsilon``), clip, initialisation."""
        settings = cfg.strategy
        threshold, fraction = settings.large_threshold, settings.large_fraction
        if (threshold is None) == (fraction is None):
            raise ConfigError(
                "strategy.large_threshold",
                threshold,
                f"set exactly one of strategy.large_threshold and strategy.large_fraction (got {fraction!r})",
            )
        if threshold is not None:
            require_int("strategy.large_threshold", threshold, minimum=1)
        else:
            require_range("strategy.large_fraction", fraction, 0.0, 1.0, low_open=True, high_open=True)
        rounds = int(cfg.num_rounds)
        if settings.teacher_rounds is None:
            require_range("strategy.teacher_fraction", settings.teacher_fraction, 0.0, 1.0, high_open=True)
        else:
            require_int("strategy.teacher_rounds", settings.teacher_rounds, minimum=0)
        teacher = teacher_rounds(cfg)
        if teacher > 0 and rounds < 2:
            raise ConfigError(
                "num_rounds", rounds, "kd_dp needs >= 2 rounds (teacher stage, then student stage)"
            )
        require_int("strategy.teacher_rounds", teacher, minimum=0, maximum=rounds - 1)
        if teacher == 0 and settings.epsilon_special is not None:
            raise ConfigError(
                "strategy.epsilon_special",
                settings.epsilon_special,
                "must be null with strategy.teacher_rounds=0 (no teacher, no pseudo-labels to protect)",
            )
        if settings.teacher_clients_per_round is not None:
            require_int("strategy.teacher_clients_per_round", settings.teacher_clients_per_round, minimum=1)
        total = float(cfg.privacy.epsilon)
        special, general = settings.epsilon_special, settings.epsilon_general
        if special is not None:
            require_positive("strategy.epsilon_special", special)
            if special >= total:
                raise ConfigError(
                    "strategy.epsilon_special",
                    special,
                    f"must be < privacy.epsilon={total:g}: the teacher's budget privacy.epsilon - "
                    "epsilon_special must stay > 0 (or null: no label noise, the teacher gets the total)",
                )
        if general is not None:
            require_positive("strategy.epsilon_general", general)
            if general > total:
                raise ConfigError(
                    "strategy.epsilon_general",
                    general,
                    f"must be <= privacy.epsilon={total:g} (null: the total)",
                )
        split_kd_dp_budget(
            total=total,
            epsilon_special=None if special is None else float(special),
            epsilon_general=None if general is None else float(general),
        )
        require_positive("strategy.clip", settings.clip)
        require_choice("strategy.student_init", settings.student_init, STUDENT_INITS)
        require_choice("strategy.special_loss", settings.special_loss, SPECIAL_LOSSES)
        if cfg.privacy.budget_scope != "total":
            raise ConfigError(
                "privacy.budget_scope",
                cfg.privacy.budget_scope,
                "kd_dp accounts the whole run: must be total",
            )
        if teacher > 0 and float(cfg.dataset.get("public_fraction", 0.0)) <= 0:
            raise ConfigError(
                "dataset.public_fraction",
                cfg.dataset.get("public_fraction", 0.0),
                "kd_dp needs a public split to pseudo-label: must be > 0",
            )

    def _plan(self, name: str, ids: list[int], epsilon: float) -> GroupPlan:
        """Per client: ``q_k = min(1, B / n_k)`` and ``local_epochs * ceil(n_k / B)`` steps per round."""
        batch, epochs = int(self.cfg.batch_size), int(self.cfg.local_epochs)
        rates, steps = {}, {}
        for client in ids:
            size = self.run.info(client).num_examples
            if size < 1:
                raise ConfigError("num_clients", size, f"client {client} has no examples for DP-SGD")
            rates[client] = min(1.0, batch / size)
            steps[client] = epochs * max(1, math.ceil(size / batch))
        return GroupPlan(name, ids, epsilon, rates, steps)

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

    # ------------------------------------------------------------------ Flower hooks

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Teacher stage: large-data clients. Student stage: pseudo-labels (once), then general clients."""
        stage = self.stage(server_round)
        if stage == STUDENT_STAGE and self.special is None and self.teacher_rounds > 0:
            self._release_pseudo_labels(server_round, arrays)
        clients = self.select_clients(server_round)
        self._selected[server_round] = clients
        sent = self.arrays_for_clients(server_round, arrays)
        self._round_start[server_round] = sent
        plan = self.plans[LARGE if stage == TEACHER_STAGE else GENERAL]
        messages = []
        for client in clients:
            record = self.train_config(server_round, config)
            record[keys.ALGORITHM] = TEACHER_CLIENT if stage == TEACHER_STAGE else GENERAL_CLIENT
            record[keys.KDDP_STAGE] = stage
            record[keys.KDDP_NOISE_MULTIPLIER] = plan.noise_multipliers[client.client_id]
            record[keys.KDDP_SAMPLING_RATE] = plan.sampling_rates[client.client_id]
            record[keys.KDDP_STEPS] = plan.steps_per_round[client.client_id]
            record[keys.KDDP_CLIP] = self.clip
            content = RecordDict({keys.ARRAYS: sent, keys.CONFIG: record})
            messages.append(
                Message(content=content, dst_node_id=client.node_id, message_type=MessageType.TRAIN)
            )
        return messages

    def arrays_for_clients(self, server_round: int, arrays: ArrayRecord) -> ArrayRecord:
        """The student's first round starts from the run's initial model when ``student_init: fresh``."""
        if server_round == self.teacher_rounds + 1 > 1 and self.student_init == "fresh":
            return self.initial_arrays()  # the run's seeded initial model: independent of any data
        return arrays

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
        if self.budget.special is not None:
            self.special_accountant.record(
                PrivacyEvent(
                    server_round,
                    RandomizedResponse(self.budget.special, int(self.run.model_spec.num_classes)),
                    count=1,
                    participants=(SPECIAL_CLIENT_ID,),
                    label="randomized response on every pseudo-label (once; each label is one record)",
                )
            )
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
        valid, _ = self.split_replies(server_round, replies)
        stage = self.stage(server_round)
        plan = self.plans[LARGE if stage == TEACHER_STAGE else GENERAL]
        self._record_dp_sgd(server_round, plan)
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
            model = self.run.model_spec.build()
            load_arrays(model, start)
            loss = self.special.train(
                model,
                epochs=int(self.cfg.local_epochs),
                batch_size=int(self.cfg.batch_size),
                lr=float(self.cfg.lr),
                momentum=float(self.cfg.momentum),
                rng=self.run.randomness.generator("kd-dp-special-data-order", server_round=server_round),
                correction=self.special_loss == "forward",
            )
            self._special_loss[server_round] = loss
            metrics["kd-dp-special-train-loss"] = loss
            records.append(model_to_arrays(model))
            weights.append(float(len(self.special)))
        if not records:
            return None, MetricRecord(metrics)
        return mean_arrays(records, weights), MetricRecord(metrics)

    def _record_dp_sgd(self, server_round: int, plan: GroupPlan) -> None:
        """One event per distinct (z, q, steps), naming every selected client (failures included)."""
        assert self.accountant is not None
        by_mechanism: dict[tuple[float, float, int], list[int]] = {}
        for client in self.selected(server_round):
            c = client.client_id
            key = (plan.noise_multipliers[c], plan.sampling_rates[c], plan.steps_per_round[c])
            by_mechanism.setdefault(key, []).append(c)
        for (multiplier, rate, steps), ids in sorted(by_mechanism.items()):
            self.accountant.record(
                PrivacyEvent(
                    server_round,
                    dp_sgd_mechanism(noise_multiplier=multiplier, sampling_rate=rate),
                    count=steps,
                    participants=tuple(ids),
                    label=f"{plan.name} clients' local DP-SGD ({self.stage(server_round)} stage)",
                )
            )

    def _check_reply(self, info: ClientInfo, reply: Message, plan: GroupPlan, start: ArrayRecord) -> str:
        """Empty when the reply applied the mechanism it was sent and holds a model of the right shape."""
        metrics = reply.content.metric_records.get(keys.METRICS)
        if metrics is None:
            return "no metrics"
        expected = {
            keys.KDDP_NOISE_MULTIPLIER: plan.noise_multipliers[info.client_id],
            keys.KDDP_SAMPLING_RATE: plan.sampling_rates[info.client_id],
            keys.KDDP_STEPS: float(plan.steps_per_round[info.client_id]),
            keys.KDDP_CLIP: self.clip,
        }
        for key, value in expected.items():
            if key not in metrics or not math.isclose(float(metrics[key]), float(value), rel_tol=1e-9):
                return f"{key}={metrics.get(key)!r}, expected {value!r}"
        if keys.ARRAYS not in reply.content.array_records:
            return "no arrays"
        received = reply.content.array_records[keys.ARRAYS]
        if list(received.keys()) != list(start.keys()) or any(
            tuple(received[k].shape) != tuple(start[k].shape) for k in start
        ):
            return "arrays do not match the model"
        return ""

    # ------------------------------------------------------------------ accounting and reporting

    def grouped(self) -> GroupedEpsilon:
        """Each group's worst client (large-data: teacher + special charge) and the overall maximum."""
        assert self.accountant is not None
        state = (len(self.accountant.events), len(self.special_accountant.events))
        if self._epsilon_cache is not None and self._epsilon_cache[0] == state:
            return self._epsilon_cache[1]
        result = grouped_epsilon(
            accountant=self.accountant,
            groups={LARGE: self.plans[LARGE].ids, GENERAL: self.plans[GENERAL].ids},
            delta=self.run.delta,
            charges={LARGE: self.special_epsilon()},
        )
        self._epsilon_cache = (state, result)
        return result

    def special_epsilon(self) -> float:
        """The special client's accounted label-DP epsilon (0 before the labels are released)."""
        return self.special_accountant.epsilon(delta=self.run.delta).epsilon

    def teacher_epsilon(self) -> float:
        """The large-data clients' worst DP-SGD epsilon alone (the post-processing bound)."""
        assert self.accountant is not None
        return max(
            (self.accountant.epsilon(delta=self.run.delta, client=c).epsilon for c in self.plans[LARGE].ids),
            default=0.0,
        )

    def epsilon(self) -> EpsilonReport | None:
        """Overall epsilon: parallel composition (max) of the large-data and general groups."""
        return self.grouped().overall

    def round_extras(self, server_round: int) -> dict[str, Any]:
        """Stage, each group's cumulative epsilon, rejected replies, the special client's loss."""
        grouped = self.grouped()
        return {
            "stage": self.stage(server_round),
            "epsilon_large": grouped.groups[LARGE].epsilon,
            "epsilon_general": grouped.groups[GENERAL].epsilon,
            "epsilon_special": self.special_epsilon(),
            "rejected": len(self._rejected.get(server_round, [])),
            "special_train_loss": self._special_loss.get(server_round),
        }

    def privacy_summary(self) -> dict[str, Any]:
        """Units, budget split (targets), each group's accounted epsilon, the overall one, DP-SGD plans."""
        grouped = self.grouped()
        special = self.special
        return {
            **super().privacy_summary(),
            "guarantee": (
                f"every example of every federated client is ({grouped.overall.epsilon:.4g}, "
                f"{self.run.delta:g})-DP (add or remove one example): parallel composition over the "
                "disjoint large-data and general groups"
            ),
            "units": {
                LARGE: RECORD_UNIT + "; charged teacher DP-SGD + epsilon_special (upper bound: the "
                "pseudo-labels are post-processing of the DP teacher)",
                GENERAL: RECORD_UNIT,
                SPECIAL: LABEL_UNIT + " (not a federated client's data; reported on its own)",
            },
            "budget": {
                "total": self.budget.total,
                "teacher": self.budget.teacher,
                "special": self.budget.special,
                "general": self.budget.general,
                "large_client_total": self.budget.large_client_total,
                "overall": self.budget.overall,
            },
            "epsilon_by_group": {
                LARGE: grouped.groups[LARGE].epsilon,
                "large_teacher_only": self.teacher_epsilon(),
                GENERAL: grouped.groups[GENERAL].epsilon,
                SPECIAL: self.special_epsilon(),
            },
            "epsilon_overall": grouped.overall.epsilon,
            "worst_group": grouped.worst_group,
            "groups": {
                LARGE: {"ids": self.plans[LARGE].ids, "sizes": self._sizes(self.plans[LARGE].ids)},
                GENERAL: {"ids": self.plans[GENERAL].ids, "sizes": self._sizes(self.plans[GENERAL].ids)},
                "rule": (
                    "none: teacher_rounds=0, every client is a general client (federated DP-SGD)"
                    if self.teacher_rounds == 0
                    else f"num_examples >= {self.cfg.strategy.large_threshold}"
                    if self.cfg.strategy.large_threshold is not None
                    else f"largest ceil({self.cfg.strategy.large_fraction} * N) clients"
                ),
            },
            "dp_sgd": {
                name: {
                    "clip": self.clip,
                    "sampling_rates": {str(k): v for k, v in sorted(plan.sampling_rates.items())},
                    "steps_per_round": {str(k): v for k, v in sorted(plan.steps_per_round.items())},
                    "target_epsilon": plan.epsilon,
                    "participations": {str(k): v for k, v in sorted(plan.participations.items())},
                    "noise_multipliers": {str(k): v for k, v in sorted(plan.noise_multipliers.items())},
                }
                for name, plan in self.plans.items()
            },
            "special_client": {
                "runs_on": "server (the public split lives there)",
                "num_examples": None if special is None else len(special),
                "epsilon_per_label": self.budget.special,
                "keep_probability": (
                    None
                    if self.budget.special is None
                    else RandomizedResponse(
                        self.budget.special, int(self.run.model_spec.num_classes)
                    ).keep_probability
                ),
                "label_agreement_with_teacher": None if special is None else special.agreement,
                "ledger": self.special_accountant.state_dict(),
            },
            "stages": {
                "teacher_rounds": self.teacher_rounds,
                "student_rounds": self.num_rounds - self.teacher_rounds,
            },
        }

    def final_extras(self) -> dict[str, Any]:
        """Each group's final epsilon next to the overall one."""
        grouped = self.grouped()
        return {
            "epsilon_large": grouped.groups[LARGE].epsilon,
            "epsilon_general": grouped.groups[GENERAL].epsilon,
            "epsilon_special": self.special_epsilon(),
        }

    def summary(self) -> None:
        """Log the configuration and the grouping."""
        super().summary()
        log(
            INFO,
            "\t└──> KD-DP: %d large-data, %d general clients; budget teacher=%g special=%s general=%g",
            len(self.plans[LARGE].ids),
            len(self.plans[GENERAL].ids),
            self.budget.teacher,
            self.budget.special,
            self.budget.general,
        )

    def _sizes(self, ids: Sequence[int]) -> list[int]:
        return [self.run.info(c).num_examples for c in ids]
