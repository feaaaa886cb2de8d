"""DPFL-BNN: binary neural networks with randomized response on every uploaded bit.

Liu, Zhang, Song, Letaief, "Binary Federated Learning with Client-Level
Differential Privacy", 2023: Algorithm 1 (server side: steps 4-5), Definition 3
(RR_gamma), Lemma 3 (its Renyi DP), Theorem 1 (gamma for a target
(epsilon, delta) over T rounds). The client side is :mod:`clients.dpfl_bnn`, the
network :class:`fl_app.models.BinaryCNN` (``model=bnn_cnn``).

Each round the selected clients train their BNN locally, apply RR_gamma to each
of the d binary weights independently and upload the d bits packed 8 per byte.
The server unpacks them and broadcasts their mean ``W~ = (1/n) sum_i RR_gamma(W^{b,i})``
in [-1, 1] (Algorithm 1 step 4 writes the sum of the *un-noised* ``W^{b,i}``; the
text and step 2 make clear that the noised bits are aggregated; the mean keeps
``W~`` on the scale of the latent weights that step 5 mixes it into). Test
accuracy is measured with the binarized global model ``Sign(W~)``.

Privacy (local DP: every upload is randomized on the client, the server is not
trusted and there is no secure aggregation). Two accountings are kept side by
side, each by its own :class:`~fl_app.privacy.accountant.PrivacyAccountant`:

* **client level** (the headline ``epsilon``): one upload applies RR_gamma to d
  bits, all of which one client's data set determines, so a participating
  client is charged d uses of ``BinaryRandomizedResponse(gamma)`` per round
  (composition over the d coordinates and over the rounds);
* **per coordinate** (the document's Theorem 1, reported as
  ``epsilon_per_coordinate``): one use per round, i.e. the guarantee of one
  weight coordinate seen in isolation. It is *not* a guarantee for a client's
  data set.

gamma is ``strategy.gamma``, or is calibrated from ``privacy.epsilon`` and
``privacy.delta`` over ``num_rounds`` (each client uploads at most once per
round) for the accounting named by ``strategy.calibration`` with
:func:`fl_app.privacy.calibration.bnn_gamma` (Theorem 1 with the Renyi order
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
from logging import INFO, WARNING
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log
from omegaconf import DictConfig

from fl_app import keys
from fl_app.bits import packed_length, signs_of, split_vector, unpack_signs
from fl_app.metering import content_bytes
from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.calibration import binary_rr_epsilon, bnn_gamma, bnn_gamma_theorem1
from fl_app.privacy.events import BinaryRandomizedResponse, PrivacyEvent
from fl_app.run_context import RunContext
from fl_app.training import evaluate, load_arrays
from fl_app.validation import ConfigError, require_choice, require_int, require_range
from strategies import register_strategy
from strategies.base import FederatedStrategy

NOISES = ("rr", "none")
CALIBRATIONS = ("per_coordinate", "client_level")
MODEL_NAME = "bnn_cnn"

CLIENT_UNIT = (
    "one client's entire data set, replaced by any other data set (client-level local DP: "
    "every upload is randomized on the client; the server is not trusted)"
)
COORDINATE_UNIT = (
    "one coordinate (binary weight) of one client's upload, seen in isolation (the document's "
    "Theorem 1 accounting; NOT a client-level guarantee)"
)
MECHANISM = "RR_gamma on each of the d uploaded binary weights independently (DPFL-BNN Definition 3)"


@register_strategy("dpfl_bnn")
class DPFLBNNStrategy(FederatedStrategy):
    """Server of DPFL-BNN: unpack, average and broadcast the clients' noised binary weights."""

    client_name = "dpfl_bnn"
    release_hint = " (strategy.local_eval_clients runs the document's local-model diagnostic)"
    resumable = False
    resumable_note = (
        "cannot be resumed: each client keeps its latent weights and Adam moments in its own state "
        "(never sent), which a new simulation starts afresh"
    )
    privacy_unit = CLIENT_UNIT
    mechanism_name = MECHANISM

    def __init__(self, run: RunContext) -> None:
        super().__init__(run)
        settings = self.cfg.strategy
        model = run.model_spec.build()
        parameters = dict(model.named_parameters())
        if list(parameters) != list(model.state_dict()):
            raise ValueError(f"{run.model_spec.name} has state besides its binary weights")
        self.names = list(parameters)
        self.shapes = [tuple(p.shape) for p in parameters.values()]
        self.num_bits = int(sum(p.numel() for p in parameters.values()))
        self.beta = float(settings.beta)
        self.noise = str(settings.noise) == "rr"
        self.calibration = str(settings.calibration)
        self.rounds = int(self.cfg.num_rounds)
        delta = run.delta
        method = str(self.cfg.privacy.accountant)
        target = float(self.cfg.privacy.epsilon)
        self.gamma: float | None = None
        self.gamma_source = "none (noise-free BNN)"
        self.coordinate_accountant: PrivacyAccountant | None = None
        self.planned: dict[str, float] = {}
        if self.noise:
            if settings.gamma is not None:
                self.gamma = float(settings.gamma)
                self.gamma_source = "strategy.gamma"
            else:
                bits = 1 if self.calibration == "per_coordinate" else self.num_bits
                self.gamma = bnn_gamma(epsilon=target, delta=delta, rounds=self.rounds, bits_per_round=bits)
                self.gamma_source = (
                    f"calibrated: privacy.epsilon={target:g} at delta={delta:g} after "
                    f"num_rounds={self.rounds} for the {self.calibration.replace('_', '-')} accounting"
                )
            self.accountant = PrivacyAccountant(population=run.client_ids, unit=CLIENT_UNIT, method=method)
            self.coordinate_accountant = PrivacyAccountant(
                population=run.client_ids, unit=COORDINATE_UNIT, method=method
            )
            self.planned = {
                "client_level": binary_rr_epsilon(
                    gamma=self.gamma,
                    delta=delta,
                    rounds=self.rounds,
                    bits_per_round=self.num_bits,
                    method=method,
                ),
                "per_coordinate": binary_rr_epsilon(
                    gamma=self.gamma, delta=delta, rounds=self.rounds, method=method
                ),
            }
        else:
            self.privacy_unit = "none"
            self.mechanism_name = "none (noise-free BNN: the binary weights are uploaded as they are)"
        self._round_info: dict[int, dict[str, Any]] = {}
        self._local_accuracy: dict[int, float] = {}
        self._trained: set[int] = set()
        self._log_plan(target)

    def budget_text(self) -> str:
        """The budget asked for; under ``calibration=per_coordinate`` it is not in the headline unit."""
        text = super().budget_text()
        if self.calibration != "per_coordinate" or not self.planned:
            return text
        return (
            f"{text} PER WEIGHT COORDINATE (strategy.calibration=per_coordinate, the document's reading); "
            f"client level, the unit above: epsilon {self.planned['client_level']:.6g}"
        )

    def _log_plan(self, target: float) -> None:
        if not self.noise or self.gamma is None:
            log(INFO, "DPFL-BNN: noise-free BNN (no RR), d=%d binary weights: not private", self.num_bits)
            return
        log(
            INFO,
            "DPFL-BNN: gamma=%.6g (flip probability %.6g; %s), d=%d bits per upload",
            self.gamma,
            0.5 - self.gamma,
            self.gamma_source,
            self.num_bits,
        )
        log(
            INFO,
            "DPFL-BNN: epsilon after %d participations at delta=%g: client level %.6g "
            "(d=%d uses per round); per coordinate (the document's accounting) %.6g",
            self.rounds,
            self.run.delta,
            self.planned["client_level"],
            self.num_bits,
            self.planned["per_coordinate"],
        )
        if self.planned["client_level"] > target:
            log(
                WARNING,
                "DPFL-BNN: the client-level epsilon (%.6g) exceeds privacy.epsilon=%g; the per-coordinate "
                "epsilon is not a guarantee for a client's data set (see docs/dpfl_bnn.md)",
                self.planned["client_level"],
                target,
            )

    # ------------------------------------------------------------------ configuration

    @classmethod
    def is_private(cls, cfg: DictConfig) -> bool:
        """Private unless ``strategy.noise=none``."""
        return str(cfg.strategy.noise) != "none"

    @classmethod
    def validate_config(cls, cfg: DictConfig) -> None:
        """Check the model, ``strategy.*`` and the settings DPFL-BNN cannot honour."""
        settings = cfg.strategy
        if cfg.model not in ("auto", MODEL_NAME):
            raise ConfigError(
                "model", cfg.model, f"strategy=dpfl_bnn trains its binary network: auto or {MODEL_NAME}"
            )
        noise = require_choice("strategy.noise", settings.noise, NOISES)
        if settings.gamma is not None:
            if noise == "none":
                raise ConfigError("strategy.gamma", settings.gamma, "must be null with strategy.noise=none")
            require_range("strategy.gamma", settings.gamma, 0.0, 0.5, high_open=True)
        elif noise == "rr" and cfg.privacy.budget_scope != "total":
            raise ConfigError(
                "privacy.budget_scope",
                cfg.privacy.budget_scope,
                "must be total: DPFL-BNN calibrates gamma for the whole run (Theorem 1 over num_rounds)",
            )
        require_choice("strategy.calibration", settings.calibration, CALIBRATIONS)
        require_range("strategy.beta", settings.beta, 0.0, 1.0)
        require_int("strategy.local_steps", settings.local_steps, minimum=0)
        require_range("strategy.lr_decay", settings.lr_decay, 0.0, 1.0, low_open=True)
        if settings.lr_decay_every is not None:
            require_int("strategy.lr_decay_every", settings.lr_decay_every, minimum=1)
        require_range("strategy.adam_beta1", settings.adam_beta1, 0.0, 1.0, high_open=True)
        require_range("strategy.adam_beta2", settings.adam_beta2, 0.0, 1.0, high_open=True)
        local_eval = require_int("strategy.local_eval_clients", settings.local_eval_clients, minimum=0)
        if local_eval > 0 and noise == "rr" and not cfg.privacy.get("diagnostics", False):
            raise ConfigError(
                "strategy.local_eval_clients",
                settings.local_eval_clients,
                "must be 0 unless privacy.diagnostics=true: the local-model accuracy is computed from "
                "un-noised local models, outside the guarantee (simulation only)",
            )
        require_int("strategy.local_eval_every", settings.local_eval_every, minimum=1)
        if settings.local_eval_test_subset is not None:
            require_int("strategy.local_eval_test_subset", settings.local_eval_test_subset, minimum=1)

    @classmethod
    def resolve_model(cls, cfg: DictConfig, input_shape: tuple[int, ...]) -> str:
        """Always the binary CNN (``model=auto`` or ``model=bnn_cnn``)."""
        return MODEL_NAME

    def initial_arrays(self) -> ArrayRecord:
        """``W_0^b``: the binarized seeded initial model (Algorithm 1 initialises every model with it)."""
        latent = super().initial_arrays()
        return ArrayRecord(
            {name: Array(signs_of(latent[name].numpy()).astype(np.float32)) for name in latent}
        )

    def learning_rate(self, server_round: int) -> float:
        """``lr * lr_decay ** floor((t - 1) / lr_decay_every)`` (0.1 every 40 rounds in the document)."""
        every = self.cfg.strategy.lr_decay_every
        if every is None:
            return float(self.cfg.lr)
        return float(self.cfg.lr) * float(self.cfg.strategy.lr_decay) ** ((server_round - 1) // int(every))

    def extra_train_config(self, server_round: int) -> dict[str, Any]:
        """gamma, beta, local steps, Adam, d and the decayed learning rate."""
        settings = self.cfg.strategy
        subset = settings.local_eval_test_subset
        return {
            keys.BNN_NOISE: self.noise,
            keys.BNN_GAMMA: float(self.gamma) if self.gamma is not None else 0.0,
            keys.BNN_BETA: self.beta,
            keys.BNN_LOCAL_STEPS: int(settings.local_steps),
            keys.BNN_ADAM_BETA1: float(settings.adam_beta1),
            keys.BNN_ADAM_BETA2: float(settings.adam_beta2),
            keys.BNN_NUM_BITS: self.num_bits,
            keys.BNN_EVAL_TEST_SUBSET: 0 if subset is None else int(subset),
            keys.LR: self.learning_rate(server_round),
        }

    # ------------------------------------------------------------------ aggregation

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Unpack the noised bits of every valid upload and broadcast their mean ``W~``."""
        valid, _ = self.split_replies(server_round, replies)
        selected = tuple(c.client_id for c in self.selected(server_round))
        self._trained.update(selected)
        self._record_uploads(server_round, selected)
        total = np.zeros(self.num_bits, dtype=np.float64)
        sizes: list[int] = []
        malformed: list[int] = []
        for info, reply in valid:
            try:
                record = reply.content.array_records[keys.ARRAYS]
                if list(record.keys()) != [keys.BNN_PACKED_SIGNS]:
                    raise ValueError(f"expected only {keys.BNN_PACKED_SIGNS!r}, got {list(record.keys())}")
                total += unpack_signs(record[keys.BNN_PACKED_SIGNS].numpy(), self.num_bits, dtype=np.float64)
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
            self._failed[server_round] = sorted(set(self._failed.get(server_round, [])) | set(malformed))
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

    def _record_uploads(self, server_round: int, selected: tuple[int, ...]) -> None:
        """One event per accounting naming every selected client (failures included)."""
        if self.accountant is None or self.gamma is None or not selected:
            return
        mechanism = BinaryRandomizedResponse(self.gamma)
        self.accountant.record(
            PrivacyEvent(
                server_round,
                mechanism,
                count=self.num_bits,
                participants=selected,
                label="uplink: RR_gamma on the d bits of one upload (client level)",
            )
        )
        assert self.coordinate_accountant is not None
        self.coordinate_accountant.record(
            PrivacyEvent(
                server_round,
                mechanism,
                count=1,
                participants=selected,
                label="uplink: RR_gamma on one coordinate (the document's per-coordinate accounting)",
            )
        )

    # ------------------------------------------------------------------ evaluation

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
        settings = self.cfg.strategy
        count = int(settings.local_eval_clients)
        due = server_round % int(settings.local_eval_every) == 0 or server_round == self.rounds
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
        valid, _ = self.split_replies(server_round, replies, stage="evaluate")
        values = [float(m.content.metric_records[keys.METRICS][keys.BNN_LOCAL_ACCURACY]) for _, m in valid]
        if not values:
            return None
        self._local_accuracy[server_round] = float(np.mean(values))
        return MetricRecord({keys.BNN_LOCAL_ACCURACY: self._local_accuracy[server_round]})

    # ------------------------------------------------------------------ reporting

    def epsilon_per_coordinate(self) -> float | None:
        """The document's per-coordinate epsilon of the worst client (None: not private)."""
        if self.coordinate_accountant is None:
            return None
        return self.coordinate_accountant.epsilon(delta=self.run.delta).epsilon

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
        delta = self.run.delta
        summary.update(
            {
                "noise": "rr" if self.noise else "none",
                "bits_per_upload": self.num_bits,
                "beta": self.beta,
                "trust_model": "local DP: the server sees every client's noised bits (no secure aggregation)"
                if self.noise
                else "none: the server sees every client's binary weights as they are",
            }
        )
        if self.noise and self.gamma is not None:
            client = self.epsilon()
            summary.update(
                {
                    "gamma": self.gamma,
                    "flip_probability": 0.5 - self.gamma,
                    "gamma_source": self.gamma_source,
                    "epsilon_per_bit": BinaryRandomizedResponse(self.gamma).pure_epsilon,
                    "gamma_theorem1_at_privacy_epsilon": bnn_gamma_theorem1(
                        epsilon=float(self.cfg.privacy.epsilon), delta=delta, rounds=self.rounds
                    ),
                    "client_level": {
                        "unit": CLIENT_UNIT,
                        "uses_per_round": self.num_bits,
                        "epsilon": None if client is None else client.epsilon,
                        "epsilon_if_every_round": self.planned["client_level"],
                        "delta": delta,
                    },
                    "per_coordinate": {
                        "unit": COORDINATE_UNIT,
                        "uses_per_round": 1,
                        "epsilon": self.epsilon_per_coordinate(),
                        "epsilon_if_every_round": self.planned["per_coordinate"],
                        "delta": delta,
                        "note": "a client's data set determines all d coordinates of each upload, so this "
                        "bounds what one coordinate reveals, not what the upload reveals about the client",
                    },
                }
            )
        if int(self.cfg.strategy.local_eval_clients) > 0:
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
