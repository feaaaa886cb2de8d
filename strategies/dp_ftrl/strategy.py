"""DP-FTRL: tree-aggregated noise on prefix sums of clipped updates, no sampling amplification.

Kairouz, McMahan, Song, Thakkar, Thakurta, Xu, "Practical and Private (Deep)
Learning without Sampling or Shuffling", ICML 2021 (Algorithm 1 and its
federated form, Section 5; TreeRestart and momentum as in the paper). The
cohorts follow a public, seeded schedule: each epoch is a fresh random
permutation of the N clients cut into ``b = N // m`` cohorts of exactly
``m = clients_per_round`` clients, so a client takes part at most once per
epoch (the ``N - bm`` left over sit the epoch out). Each round t:

1. the scheduled cohort trains the current model ``w_t`` locally and returns
   its models; the server clips each update ``Delta_k = w_k - w_t`` to norm C
   (``strategy.clip``) and adds their sum ``s_t`` to the stream;
2. online tree aggregation (Dwork et al. 2010; Chan, Shi, Song 2011): at leaf
   ``i`` of the current tree the node ``[i - lowbit(i) + 1, i]`` gets fresh
   noise ``N(0, z^2 C^2 I)``, and the noisy prefix sum ``S~_i = sum_{j <= i} s_j +``
   (the noise of the at most ``ceil(log2(i + 1))`` nodes covering ``[1, i]``) is released;
3. FTRL with momentum (FTRLM; the paper's reference implementation):
   ``M_i = beta M_{i-1} + S~_i / m``, ``w_{t+1} = w_0 + eta M_i`` with ``w_0`` the model at
   the tree's start, eta = ``strategy.server_lr``, beta = ``strategy.server_momentum``.
   With beta = 0 this is ``w_{t+1} = w_0 + eta S~_i / m``; without noise it is FedAvg
   with server SGD (``w_{t+1} = w_t + eta s_t / m``), and with beta > 0 server SGD
   with heavy-ball momentum.

``strategy.restart``: ``epoch`` (TreeRestart, default) starts a new tree, with
``w_0`` the current model and the momentum reset (as the reference
implementation), at each epoch; ``none`` keeps one tree of ``num_rounds``
leaves (Algorithm 1 as printed).

Privacy: unit = one client's entire data set, central DP, zero-out
neighbours (the client's data replaced by data whose clipped updates are zero;
the public schedule is the same for both). No amplification is claimed: the
cohort schedule may be known to anyone. Each noisy node is the Gaussian
mechanism with noise ``z C``; a client in ``n_u`` leaves of node u changes it
by at most ``n_u C``, so everything released is the Gaussian mechanism with
sensitivity ``C sqrt(S)``, ``S = sum_u n_u^2`` (Appendix D; adaptively chosen
updates are covered there and by Denisov et al. 2022 for one and
Choquette-Choo et al. 2023 for several participations). Accounting:

* ``restart=epoch``: a client is in at most one leaf of each tree, so each of
  its rounds is one ``TreeAggregation(z, steps of that tree)`` event (dp-accounting's
  ``SingleEpochTreeAggregationDpEvent``, depth ``ceil(log2(steps + 1))``),
  composed over the trees it takes part in (charged in the round it takes part);
* ``restart=none``: a client may be in several leaves of the one tree; its S is
  computed exactly from its scheduled leaves and charged as it accrues: each
  round adds ``Gaussian(z / sqrt(dS))`` with dS the growth of S that round
  (:func:`strategies.dp_ftrl.privacy.tree_sensitivity_increments`), which
  composes (RDP and PLD alike) to the Gaussian with ``z / sqrt(S)``.

Events name every *scheduled* client, failures included. Unless
``strategy.noise_multiplier`` is set, z is the smallest for which the worst
client of the schedule ends at most at ``privacy.epsilon``.

Released: the models (post-processing of the noisy prefix sums) and the public
schedule. The clients' train losses and update norms stay on the server.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, MetricRecord
from flwr.common import log

from fl_app.learning.sums import ClippedUpdate
from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.calibration import noise_multiplier_for_histories
from fl_app.privacy.canaries import worst_client_patterns
from fl_app.privacy.composition import History, compose_epsilon
from fl_app.privacy.events import Gaussian, Mechanism, PrivacyEvent, TreeAggregation
from fl_app.privacy.fixed_noise import FixedNoise
from fl_app.privacy.mechanisms import gaussian_mechanism, tree_prefix_nodes
from fl_app.run.context import RunContext
from fl_app.run.roster import ClientInfo
from strategies import register_strategy
from strategies.base import Replies
from strategies.contract import Declaration, QuickExample
from strategies.dp_ftrl.privacy import tree_sensitivity_increments
from strategies.private import PrivateStrategy
from strategies.settings import StrategySettings, between, one_of, positive

RESTARTS = ("epoch", "none")


@dataclass(frozen=True)
class DPFTRLSettings(StrategySettings):
    """``cfg.strategy`` of ``dp_ftrl`` (``conf/strategy/dp_ftrl.yaml`` explains each key)."""

    clip: float = positive()
    noise_multiplier: float | None = positive(optional=True)
    server_lr: float = positive()
    server_momentum: float = between(0.0, 1.0, high_open=True)
    restart: str = one_of(RESTARTS)

    budget_scopes = ("total",)  # calibrated for the whole run


@dataclass(frozen=True)
class TreePosition:
    """Where a round sits: its tree (0-based), its leaf (1-based) and the tree's length."""

    tree: int
    leaf: int
    steps: int


@register_strategy("dp_ftrl")
class DPFTRLStrategy(PrivateStrategy):
    """DP-FTRL(M) with tree aggregation over a public, seeded schedule of fixed-size cohorts."""

    declaration = Declaration(
        name="dp_ftrl",
        paper="Kairouz, McMahan, Song, Thakkar, Thakurta, Xu, ICML 2021 (DP-FTRL, tree aggregation)",
        unit=(
            "one client's entire data set (zero-out: replaced by data whose clipped updates are zero; "
            "public cohort schedule), central DP"
        ),
        mechanism="Gaussian tree aggregation of prefix sums of clipped model updates (no sampling)",
        client="fedavg",  # plain local training: clipping and the tree's noise run on the server
        settings=DPFTRLSettings,
        checkpoint_holds=(
            "DP-FTRL's un-noised running sum of the current tree's clipped updates and the noise of its "
            "open nodes (needed to continue the tree exactly)"
        ),
        canaries=None,
        quick=QuickExample(
            overrides=("num_clients=1000", "clients_per_round=100", "num_rounds=100", "privacy.epsilon=8.0"),
            suite_rounds=15,
            about=(
                "DP-FTRL at epsilon 8 per client (delta 1e-5), cross-device: 1000 clients, 100 per round on"
                " a balanced schedule (each client once per 10 rounds), 100 rounds"
            ),
        ),
        comparisons=("cross_device",),
    )
    settings: DPFTRLSettings

    def __init__(self, run: RunContext, settings: DPFTRLSettings | None = None) -> None:
        super().__init__(run, settings)
        self.num_rounds = self.run.settings.num_rounds
        self.cohort_size = run.clients_per_round
        self.rounds_per_epoch = run.num_clients // self.cohort_size
        self.schedule = self._public_schedule()
        self.method = self.run.settings.privacy.accountant
        self._leaves = self._leaves_by_client()
        worst = self._worst_histories()
        if self.settings.noise_multiplier is not None:
            self.noise_multiplier = self.settings.noise_multiplier
        else:
            self.noise_multiplier = noise_multiplier_for_histories(
                epsilon=self.run.settings.privacy.epsilon,
                delta=run.settings.privacy.delta,
                histories_of=worst,
                method=self.method,
            )
        self.accountant = PrivacyAccountant(
            population=run.client_ids, unit=self.privacy_unit, method=self.method
        )
        self._tree: int | None = None
        self._tree_start: list[np.ndarray] = []
        self._stream_sum: list[np.ndarray] = []
        self._node_noise: dict[int, list[np.ndarray]] = {}
        self._momentum: list[np.ndarray] = []
        log(
            INFO,
            "DP-FTRL: z=%.4f per tree node, clip C=%g, %d rounds per epoch of %d-client cohorts, restart=%s, "
            "at most %d participations per client",
            self.noise_multiplier,
            self.settings.clip,
            self.rounds_per_epoch,
            self.cohort_size,
            self.settings.restart,
            self.max_participations,
        )

    # ------------------------------------------------------------------ schedule

    def _public_schedule(self) -> list[list[int]]:
        """Cohorts (roster indices) of rounds 1..T: per epoch a seeded permutation cut into b cohorts."""
        return self.cohorts.epochs(self.num_rounds, purpose="ftrl-schedule")

    def position(self, server_round: int) -> TreePosition:
        """The tree, leaf and tree length of ``server_round``."""
        if self.settings.restart == "none":
            return TreePosition(0, server_round, self.num_rounds)
        b = self.rounds_per_epoch
        tree = (server_round - 1) // b
        return TreePosition(tree, (server_round - 1) % b + 1, min(b, self.num_rounds - tree * b))

    def cohort(self, server_round: int) -> list[ClientInfo]:
        """The scheduled cohort of ``server_round``."""
        return [self.run.roster[i] for i in self.schedule[server_round - 1]]

    def _leaves_by_client(self) -> dict[int, list[int]]:
        """Client id -> the rounds it is scheduled in."""
        leaves: dict[int, list[int]] = {}
        for server_round in range(1, self.num_rounds + 1):
            for info in self.cohort(server_round):
                leaves.setdefault(info.client_id, []).append(server_round)
        return leaves

    def canary_patterns(self, count: int) -> list[frozenset[int]]:
        """Each canary takes part in the rounds of a worst client of the schedule (the accounted one).

        With ``restart=epoch`` that is once in every tree (at that client's leaf); with ``none``
        the leaves whose squared sensitivity is the largest.
        """
        loads = self._loads()
        top = max(loads.values())
        worst = sorted(client for client, value in loads.items() if value == top)
        return worst_client_patterns(
            self._leaves, worst=worst, count=count, rng=self.run.randomness.generator("canary-pattern")
        )

    @property
    def max_participations(self) -> int:
        """Most rounds any client is scheduled in."""
        return max((len(rounds) for rounds in self._leaves.values()), default=0)

    def _increments(self, client: int) -> list[int]:
        """``restart=none``: the growth of the client's squared sensitivity at each of its rounds."""
        return tree_sensitivity_increments(leaves=self._leaves.get(client, []), steps=self.num_rounds)

    def _mechanisms(self, client: int, z: float) -> list[tuple[int, Mechanism]]:
        """(round, mechanism) charged to ``client`` over the run, for noise multiplier ``z``."""
        rounds = self._leaves.get(client, [])
        if self.settings.restart == "epoch":
            return [(t, TreeAggregation(z, self.position(t).steps)) for t in rounds]
        return [
            (t, Gaussian(z / float(np.sqrt(d))))
            for t, d in zip(rounds, self._increments(client), strict=True)
        ]

    def _loads(self) -> dict[int, float]:
        """Client id -> its total squared sensitivity over the schedule (the worst clients' is largest)."""

        def load(client: int) -> float:
            if self.settings.restart == "epoch":
                return float(
                    sum(TreeAggregation(1.0, self.position(t).steps).depth for t in self._leaves[client])
                )
            return float(sum(self._increments(client)))

        return {client: load(client) for client in self._leaves}

    def fixed_noise(self) -> FixedNoise | None:
        """``strategy.noise_multiplier`` set: the worst client's epsilon over the planned rounds."""
        if self.settings.noise_multiplier is None:
            return None
        delta = self.run.settings.privacy.delta
        histories = self._worst_histories()(self.noise_multiplier)
        reached = max(compose_epsilon(h, delta=delta, method=self.method).epsilon for h in histories)
        setting = f"strategy.noise_multiplier={self.noise_multiplier:g}"
        return FixedNoise(setting, reached, self.num_rounds)

    def _worst_histories(self) -> Callable[[float], list[History]]:
        """``z -> histories`` of the clients with the largest squared sensitivity (the worst ones)."""
        loads = self._loads()
        top = max(loads.values())
        worst = [client for client, value in loads.items() if value == top]
        distinct = {tuple(sorted(repr(m) for _, m in self._mechanisms(c, 1.0))): c for c in worst}

        def histories_of(z: float) -> list[History]:
            return [dict(Counter(m for _, m in self._mechanisms(c, z))) for c in distinct.values()]

        return histories_of

    # ------------------------------------------------------------------ rounds

    def select_clients(self, server_round: int) -> list[ClientInfo]:
        """The public schedule's cohort (no sampling)."""
        return self.cohort(server_round)

    def summand(self, server_round: int) -> ClippedUpdate:
        """Each client's update clipped to the round's bound: the aggregation sums them."""
        return ClippedUpdate(clip=self.settings.clip)

    def aggregate(
        self, server_round: int, replies: Replies
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Add the clipped update sum to the tree, release the noisy prefix sum, FTRL(M) step."""
        global_arrays = self.round_global
        names, current, total, _ = self.clipped_update_sum(
            replies, max_norm=self.settings.clip, server_round=server_round
        )
        where = self.position(server_round)
        if where.tree != self._tree:
            self._start_tree(where.tree, current)
        self._stream_sum = [s + t for s, t in zip(self._stream_sum, total, strict=True)]
        noise = self._prefix_noise(server_round, where.leaf)
        beta, lr, m = self.settings.server_momentum, self.settings.server_lr, float(self.cohort_size)
        self._momentum = [
            beta * v + (s + n) / m for v, s, n in zip(self._momentum, self._stream_sum, noise, strict=True)
        ]
        new = {
            name: Array(np.asarray(w0 + lr * v, dtype=global_arrays[name].numpy().dtype))
            for name, w0, v in zip(names, self._tree_start, self._momentum, strict=True)
        }
        self._record_release(server_round)
        # No train loss (nor anything else computed from the clients' data) in the metrics: they are
        # not noised (the platform's release rule, as DP-FedAvg).
        return ArrayRecord(new), MetricRecord()

    def _start_tree(self, tree: int, current: list[np.ndarray]) -> None:
        """A new tree: ``w_0`` is the current model; stream sum, node noise and momentum reset."""
        self._tree = tree
        self._tree_start = [c.copy() for c in current]
        self._stream_sum = [np.zeros_like(c) for c in current]
        self._momentum = [np.zeros_like(c) for c in current]
        self._node_noise = {}

    def _prefix_noise(self, server_round: int, leaf: int) -> list[np.ndarray]:
        """Draw the node completed at ``leaf`` and return the noise of the prefix ``[1, leaf]``."""
        sigma = self.noise_multiplier * self.settings.clip
        rng = self.run.noise.generator("tree-noise", server_round=server_round)
        self._node_noise[leaf] = [
            gaussian_mechanism(values=np.zeros_like(s), sigma=sigma, rng=rng) for s in self._stream_sum
        ]
        ends = [end for _, end in tree_prefix_nodes(leaf)]
        self._node_noise = {end: self._node_noise[end] for end in ends}
        return [sum(parts) for parts in zip(*(self._node_noise[end] for end in ends), strict=True)]

    def _record_release(self, server_round: int) -> None:
        """Charge the scheduled cohort (failures included) for this round's leaf."""
        assert self.accountant is not None
        groups: dict[Mechanism, list[int]] = {}
        for info in self.cohort(server_round):
            for t, mechanism in self._mechanisms(info.client_id, self.noise_multiplier):
                if t == server_round:
                    groups.setdefault(mechanism, []).append(info.client_id)
        where = self.position(server_round)
        for mechanism, clients in groups.items():
            self.accountant.record(
                PrivacyEvent(
                    server_round,
                    mechanism,
                    participants=tuple(clients),
                    label=f"tree {where.tree + 1} leaf {where.leaf} of {where.steps}",
                )
            )

    # ------------------------------------------------------------------ reporting

    def round_extras(self, server_round: int) -> dict[str, Any]:
        """The round's tree and leaf (public)."""
        where = self.position(server_round)
        return {"tree": where.tree + 1, "tree_leaf": where.leaf}

    def privacy_summary(self) -> dict[str, Any]:
        """Unit, mechanism, accountant, noise, schedule and participation."""
        return {
            **super().privacy_summary(),
            "noise_multiplier": self.noise_multiplier,
            "clip": self.settings.clip,
            "restart": self.settings.restart,
            "schedule": (
                f"public and seeded (seed {self.run.settings.seed}): per epoch a permutation of the "
                f"{self.run.num_clients} clients cut into {self.rounds_per_epoch} cohorts of "
                f"{self.cohort_size}; no sampling amplification"
            ),
            "rounds_per_epoch": self.rounds_per_epoch,
            "max_participations": self.max_participations,
            "neighbouring_relation": "zero-out (REPLACE_SPECIAL)",
            "server_lr": self.settings.server_lr,
            "server_momentum": self.settings.server_momentum,
        }
