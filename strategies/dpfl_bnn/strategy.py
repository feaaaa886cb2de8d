"""DPFL-BNN: binary neural networks with randomized response on every uploaded bit.

Liu, Zhang, Song, Letaief, "Binary Federated Learning with Client-Level
Differential Privacy", 2023: Algorithm 1 (server side: steps 4-5), Definition 3
(RR_gamma), Lemma 3 (its Renyi DP), Theorem 1 (gamma for a target
(epsilon, delta) over T rounds). The client side is :mod:`clients.dpfl_bnn`, the
network :class:`fl_app.learning.models.BinaryCNN` (``model=bnn_cnn``).

Each round the selected clients train their BNN locally, apply RR_gamma to each
of the d binary weights independently and upload the d bits packed 8 per byte.
The server unpacks them and broadcasts their mean ``W~ = (1/n) sum_i RR_gamma(W^{b,i})``
in [-1, 1] (Algorithm 1 step 4 writes the sum of the *un-noised* ``W^{b,i}``; the
text and step 2 make clear that the noised bits are aggregated; the mean keeps
``W~`` on the scale of the latent weights that step 5 mixes it into). Test
accuracy is measured with the binarized global model ``Sign(W~)``.

Privacy (local DP: every upload is randomized on the client, the server is not
trusted and there is no secure aggregation), in :mod:`strategies.dpfl_bnn.privacy`: the
headline epsilon charges a participating client d uses of RR_gamma per round
(its data set decides all d bits); the document's Theorem 1 accounting (one use
per round, ``epsilon_per_coordinate``) is kept beside it and is *not* a
guarantee for a client's data set.

gamma is ``strategy.gamma``, or is calibrated from ``privacy.epsilon`` and
``privacy.delta`` over ``num_rounds`` (each client uploads at most once per
round) for the accounting named by ``strategy.calibration`` with
:func:`strategies.dpfl_bnn.privacy.bnn_gamma` (Theorem 1 with the Renyi order
optimised and the order's ``1/delta`` corrected to ``log(1/delta)``). The
default, ``client_level``, calibrates for all d bits of every upload, so the
headline epsilon (the unit the results name) is the requested one;
``per_coordinate`` is the document's reading, kept by name: its client-level
epsilon is orders of magnitude larger (a warning says so).
``strategy.noise=none`` is the noise-free BNN baseline (epsilon null).

The optional local-model diagnostic (``strategy.local_eval_clients > 0``, the
document's metric) reports the accuracy of clients' un-noised local models: it
needs ``privacy.diagnostics=true`` and goes to ``outside_guarantee``, in
simulation only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from clients.dpfl_bnn import (
    BNN_ADAM_BETA1,
    BNN_ADAM_BETA2,
    BNN_BETA,
    BNN_EVAL_TEST_SUBSET,
    BNN_GAMMA,
    BNN_LOCAL_ACCURACY,
    BNN_LOCAL_STEPS,
    BNN_NOISE,
    BNN_NUM_BITS,
    BNN_PACKED_SIGNS,
    packed_length,
    signs_of,
    split_vector,
    unpack_signs,
)
from fl_app import keys
from fl_app.config.checks import ConfigError
from fl_app.config.settings import RunSettings
from fl_app.engine.messages import content_bytes
from fl_app.learning.training import evaluate, load_arrays
from fl_app.privacy.fixed_noise import FixedNoise
from fl_app.run.context import RunContext
from strategies import register_strategy
from strategies.contract import Declaration, QuickExample
from strategies.dpfl_bnn.privacy import CALIBRATIONS, CLIENT_UNIT, BinaryRRLedger, GammaPlan
from strategies.private import PrivateStrategy
from strategies.settings import StrategySettings, between, integer, one_of

NOISES = ("rr", "none")
MODEL_NAME = "bnn_cnn"
MECHANISM = "RR_gamma on each of the d uploaded binary weights independently (DPFL-BNN Definition 3)"


@dataclass(frozen=True)
class DPFLBNNSettings(StrategySettings):
    """``cfg.strategy`` of ``dpfl_bnn`` (``conf/strategy/dpfl_bnn.yaml`` explains each key)."""

    noise: str = one_of(NOISES)
    gamma: float | None = between(0.0, 0.5, high_open=True, optional=True)
    calibration: str = one_of(CALIBRATIONS)
    beta: float = between(0.0, 1.0)
    local_steps: int = integer(minimum=0)
    lr_decay: float = between(0.0, 1.0, low_open=True)
    lr_decay_every: int | None = integer(minimum=1, optional=True)
    adam_beta1: float = between(0.0, 1.0, high_open=True)
    adam_beta2: float = between(0.0, 1.0, high_open=True)
    local_eval_clients: int = integer(minimum=0)
    local_eval_every: int = integer(minimum=1)
    local_eval_test_subset: int | None = integer(minimum=1, optional=True)

    def check(self, run: RunSettings) -> None:
        """A gamma only with noise; a whole-run calibration; diagnostics opted into."""
        if self.gamma is not None and self.noise == "none":
            raise ConfigError("strategy.gamma", self.gamma, "must be null with strategy.noise=none")
        if self.gamma is None and self.noise == "rr" and run.privacy.budget_scope != "total":
            raise ConfigError(
                "privacy.budget_scope",
                run.privacy.budget_scope,
                "must be total: DPFL-BNN calibrates gamma for the whole run (Theorem 1 over num_rounds)",
            )
        if self.local_eval_clients > 0 and self.noise == "rr" and not run.privacy.diagnostics:
            raise ConfigError(
                "strategy.local_eval_clients",
                self.local_eval_clients,
                "must be 0 unless privacy.diagnostics=true: the local-model accuracy is computed from "
                "un-noised local models, outside the guarantee (simulation only)",
            )


def check_binary_model(run: RunSettings) -> None:
    """DPFL-BNN trains its binary network: ``model`` is auto or bnn_cnn."""
    if run.model not in ("auto", MODEL_NAME):
        raise ConfigError("model", run.model, f"dpfl_bnn trains its binary network: auto or {MODEL_NAME}")


@register_strategy("dpfl_bnn")
class DPFLBNNStrategy(PrivateStrategy):
    """Server of DPFL-BNN: unpack, average and broadcast the clients' noised binary weights."""

    declaration = Declaration(
        name="dpfl_bnn",
        paper="Liu, Zhang, Song, Letaief 2023 (DPFL-BNN: binary FL with client-level DP)",
        unit=CLIENT_UNIT,
        mechanism=MECHANISM,
        client="dpfl_bnn",
        settings=DPFLBNNSettings,
        model=lambda run, shape: MODEL_NAME,
        canaries=(
            "uploads randomized-response bits of binary weights: the analogue is a canary bit pattern, "
            "measured by the final binary weights' agreement with it; not built "
            "(see docs/empirical_privacy.md)"
        ),
        release_hint=" (strategy.local_eval_clients runs the document's local-model diagnostic)",
        private=lambda run: run.strategy_settings.noise != "none",
        check=check_binary_model,
        quick=QuickExample(
            overrides=(
                "model=auto",
                "num_clients=100",
                "clients_per_round=100",
                "num_rounds=10",
                "lr=0.1",
                "batch_size=64",
                "partition.alpha=100.0",
                "privacy.epsilon=16.0",
                "strategy.calibration=per_coordinate",
                "strategy.lr_decay_every=4",
            ),
            suite_rounds=3,
            suite_overrides=("clients_per_round=30",),  # 3 rounds of the whole data set took 54 s of CPU
            beats_chance=0.2,
            about=(
                "DPFL-BNN in the document's setting (100 clients, all per round, near-IID), 10 rounds; "
                "budget in the document's reading, epsilon 16 per weight coordinate (not client level: "
                "final.epsilon is)"
            ),
        ),
        comparisons=("comparison",),
        deploy=("model=bnn_cnn", "num_rounds=2"),
        sequences=(
            "it trains its binary CNN (every parameter a +-1 weight sent as randomized-response bits), an "
            "image network: a binary LSTM is not in the paper"
        ),
    )
    settings: DPFLBNNSettings
    ROUND_STATE = (*PrivateStrategy.ROUND_STATE, "_local_accuracy")  # un-noised: never checkpointed

    def __init__(self, run: RunContext, settings: DPFLBNNSettings | None = None) -> None:
        super().__init__(run, settings)
        settings = self.settings
        model = run.model_spec.build()
        parameters = dict(model.named_parameters())
        if list(parameters) != list(model.state_dict()):
            raise ValueError(f"{run.model_spec.name} has state besides its binary weights")
        self.names = list(parameters)
        self.shapes = [tuple(p.shape) for p in parameters.values()]
        self.num_bits = int(sum(p.numel() for p in parameters.values()))
        self.noise = settings.noise == "rr"
        self.rounds = self.run.settings.num_rounds
        self.ledger: BinaryRRLedger | None = None
        if self.noise:
            plan = GammaPlan.make(
                gamma=settings.gamma,
                calibration=settings.calibration,
                epsilon=self.run.settings.privacy.epsilon,
                delta=run.settings.privacy.delta,
                rounds=self.rounds,
                num_bits=self.num_bits,
                method=self.run.settings.privacy.accountant,
            )
            self.ledger = BinaryRRLedger(
                plan=plan,
                num_bits=self.num_bits,
                population=run.client_ids,
                method=self.run.settings.privacy.accountant,
                delta=run.settings.privacy.delta,
            )
            self.accountant = self.ledger.accountant
        else:
            self.privacy_unit = "none"
            self.mechanism_name = "none (noise-free BNN: the binary weights are uploaded as they are)"
        self._round_info: dict[int, dict[str, Any]] = {}
        self._local_accuracy: dict[int, float] = {}
        self._trained: set[int] = set()
        self._log_plan()

    @property
    def gamma(self) -> float | None:
        """RR_gamma's gamma (None: the noise-free baseline)."""
        return None if self.ledger is None else self.ledger.plan.gamma

    def fixed_noise(self) -> FixedNoise | None:
        """``strategy.gamma`` set: the client-level epsilon of the planned rounds (None: calibrated)."""
        if self.settings.gamma is None or self.ledger is None:
            return None
        plan = self.ledger.plan
        return FixedNoise(f"strategy.gamma={plan.gamma:g}", plan.client_level, self.rounds)

    def budget_text(self) -> str:
        """The budget asked for; under ``calibration=per_coordinate`` it is not in the headline unit."""
        text = super().budget_text()
        if self.settings.calibration != "per_coordinate" or self.ledger is None or self.planned_noise():
            return text
        return (
            f"{text} PER WEIGHT COORDINATE (strategy.calibration=per_coordinate, the document's reading); "
            f"client level, the unit above: epsilon {self.ledger.plan.client_level:.6g}"
        )

    def _log_plan(self) -> None:
        if self.ledger is None:
            log(INFO, "DPFL-BNN: noise-free BNN (no RR), d=%d binary weights: not private", self.num_bits)
            return
        plan, target = self.ledger.plan, self.run.settings.privacy.epsilon
        log(
            INFO,
            "DPFL-BNN: gamma=%.6g (flip probability %.6g; %s), d=%d bits per upload; epsilon after %d "
            "participations at delta=%g: client level %.6g (d uses per round); per coordinate (the "
            "document's accounting) %.6g",
            plan.gamma,
            0.5 - plan.gamma,
            plan.source,
            self.num_bits,
            self.rounds,
            self.run.settings.privacy.delta,
            plan.client_level,
            plan.per_coordinate,
        )
        if plan.client_level > target:
            log(
                WARNING,
                "DPFL-BNN: the client-level epsilon (%.6g) exceeds privacy.epsilon=%g; the per-coordinate "
                "epsilon is not a guarantee for a client's data set (see docs/algorithms/dpfl_bnn.md)",
                plan.client_level,
                target,
            )

    def initial_arrays(self) -> ArrayRecord:
        """``W_0^b``: the binarized seeded initial model (Algorithm 1 initialises every model with it)."""
        latent = super().initial_arrays()
        return ArrayRecord(
            {name: Array(signs_of(latent[name].numpy()).astype(np.float32)) for name in latent}
        )

    def learning_rate(self, server_round: int) -> float:
        """``lr * lr_decay ** floor((t - 1) / lr_decay_every)`` (0.1 every 40 rounds in the document)."""
        every = self.settings.lr_decay_every
        if every is None:
            return self.run.settings.lr
        return self.run.settings.lr * self.settings.lr_decay ** ((server_round - 1) // every)

    def extra_train_config(self, server_round: int) -> dict[str, Any]:
        """gamma, beta, local steps, Adam, d and the decayed learning rate."""
        settings = self.settings
        return {
            BNN_NOISE: self.noise,
            BNN_GAMMA: self.gamma if self.gamma is not None else 0.0,
            BNN_BETA: settings.beta,
            BNN_LOCAL_STEPS: settings.local_steps,
            BNN_ADAM_BETA1: settings.adam_beta1,
            BNN_ADAM_BETA2: settings.adam_beta2,
            BNN_NUM_BITS: self.num_bits,
            BNN_EVAL_TEST_SUBSET: settings.local_eval_test_subset or 0,
            keys.LR: self.learning_rate(server_round),
        }

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Unpack the noised bits of every valid upload and broadcast their mean ``W~``."""
        valid, _ = self.replies.split(server_round, replies)
        selected = tuple(c.client_id for c in self.replies.selected(server_round))
        self._trained.update(selected)
        if self.ledger is not None:
            self.ledger.record(server_round, selected)
        total = np.zeros(self.num_bits, dtype=np.float64)
        sizes: list[int] = []
        malformed: list[int] = []
        for info, reply in valid:
            try:
                record = reply.content.array_records[keys.ARRAYS]
                if list(record.keys()) != [BNN_PACKED_SIGNS]:
                    raise ValueError(f"expected only {BNN_PACKED_SIGNS!r}, got {list(record.keys())}")
                total += unpack_signs(record[BNN_PACKED_SIGNS].numpy(), self.num_bits, dtype=np.float64)
            except (KeyError, ValueError) as error:
                log(
                    WARNING,
                    "train round %d: client %d sent a malformed upload: %s",
                    server_round,
                    info.client_id,
                    error,
                )
                malformed.append(info.client_id)
                continue
            sizes.append(content_bytes(reply))
        if malformed:
            self.replies.mark_failed(server_round, malformed, "malformed upload")
        self._round_info[server_round] = {
            "uploads_aggregated": len(sizes),
            "upload_bytes_per_client": float(np.mean(sizes)) if sizes else None,
        }
        if not sizes:
            return None, None
        mean = (total / len(sizes)).astype(np.float32)
        arrays = ArrayRecord(
            {
                name: Array(np.ascontiguousarray(part))
                for name, part in zip(self.names, split_vector(mean, self.shapes), strict=True)
            }
        )
        return arrays, MetricRecord({"uploads-aggregated": len(sizes)})

    def evaluate_global(self, arrays: ArrayRecord, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
        """Loss and accuracy of the binarized global model ``Sign(W~)``."""
        model = self.run.model_spec.build()
        load_arrays(model, self.arrays_for_evaluation(arrays))
        with torch.no_grad():
            return evaluate(model, x, y)

    def arrays_for_evaluation(self, arrays: ArrayRecord) -> ArrayRecord:
        """The binary global model ``Sign(W~)`` (what evaluation stages send to clients)."""
        return ArrayRecord(
            {name: Array(signs_of(arrays[name].numpy()).astype(np.float32)) for name in arrays}
        )

    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The document's metric (optional diagnostic): clients' own merged models on the test split."""
        count = self.settings.local_eval_clients
        due = server_round % self.settings.local_eval_every == 0 or server_round == self.rounds
        if count <= 0 or not due:
            return []
        pool = sorted(self._trained) or self.run.client_ids
        rng = self.run.randomness.generator("bnn-local-eval-sampling", server_round=server_round)
        chosen = sorted(rng.choice(len(pool), size=min(count, len(pool)), replace=False))
        clients = [self.run.info(pool[i]) for i in chosen]
        content = RecordDict({keys.ARRAYS: arrays, keys.CONFIG: self.train_config(server_round, config)})
        return [
            Message(content=content, dst_node_id=c.node_id, message_type=MessageType.EVALUATE)
            for c in clients
        ]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Unweighted mean over clients of their local-model test accuracy (the document averages clients)."""
        valid, _ = self.replies.split(server_round, replies, stage="evaluate")
        values = [float(m.content.metric_records[keys.METRICS][BNN_LOCAL_ACCURACY]) for _, m in valid]
        if not values:
            return None
        self._local_accuracy[server_round] = float(np.mean(values))
        return MetricRecord({BNN_LOCAL_ACCURACY: self._local_accuracy[server_round]})

    def epsilon_per_coordinate(self) -> float | None:
        """The document's per-coordinate epsilon of the worst client (None: not private)."""
        return None if self.ledger is None else self.ledger.epsilon_per_coordinate()

    def round_extras(self, server_round: int) -> dict[str, Any]:
        """Per-coordinate epsilon (labelled) and upload size."""
        return {
            "epsilon_per_coordinate": self.epsilon_per_coordinate(),
            **self._round_info.get(server_round, {"uploads_aggregated": 0, "upload_bytes_per_client": None}),
        }

    def diagnostics(self, server_round: int) -> dict[str, Any]:
        """The local-model diagnostic (un-noised local models: outside the guarantee)."""
        if server_round not in self._local_accuracy:
            return {}
        return {"local_model_accuracy": self._local_accuracy[server_round]}

    def privacy_summary(self) -> dict[str, Any]:
        """Both accountings side by side, gamma and where it came from."""
        summary = super().privacy_summary()
        summary.update(
            {
                "noise": "rr" if self.noise else "none",
                "bits_per_upload": self.num_bits,
                "beta": self.settings.beta,
                "trust_model": "local DP: the server sees every client's noised bits (no secure aggregation)"
                if self.noise
                else "none: the server sees every client's binary weights as they are",
            }
        )
        if self.ledger is not None:
            summary.update(
                self.ledger.summary(target_epsilon=self.run.settings.privacy.epsilon, rounds=self.rounds)
            )
        if self.settings.local_eval_clients > 0:
            summary["diagnostics_outside_accounting"] = (
                "outside_guarantee.rounds[].local_model_accuracy: clients report the test accuracy of "
                "their own un-noised model (simulation-only measurement of the document's metric; not "
                "covered by epsilon)"
            )
        return summary

    def final_extras(self) -> dict[str, Any]:
        """Per-coordinate epsilon, upload size against float32, last local-model accuracy."""
        measured = [
            info["upload_bytes_per_client"]
            for info in self._round_info.values()
            if info.get("upload_bytes_per_client") is not None
        ]
        extras: dict[str, Any] = {
            "epsilon_per_coordinate": self.epsilon_per_coordinate(),
            "bits_per_upload": self.num_bits,
            "packed_bytes_per_upload": packed_length(self.num_bits),
            "float32_bytes_same_model": 4 * self.num_bits,
            "upload_bytes_per_client": float(np.mean(measured)) if measured else None,
        }
        return extras
