"""DPFL-BNN client: local BNN training with Adam, RR_gamma on every uploaded bit, packed upload.

Liu, Zhang, Song, Letaief, "Binary Federated Learning with Client-Level
Differential Privacy", 2023, Algorithm 1 (client side), Eq. (5)-(6), Definition 3:

1. *Download* (step 5 of the previous round): the client receives the aggregate
   ``W~`` (mean of the noised binary uploads, in [-1, 1]) and merges it into its
   latent weights, ``W^i = beta W~ + (1 - beta) W-bar^i``; the binary weights
   are ``Sign(W^i)``. A client without state (its first round) starts from
   ``W^i = W~`` (round 1: the binary initial model ``W_0^b``, as Algorithm 1
   initialises every local model).
2. *Local training* (Eq. 5, 6): ``local_steps`` Adam steps (batch ``batch-size``,
   learning rate ``lr`` decayed by the server) on the latent weights through the
   straight-through ``Sign`` (:class:`fl_app.learning.models.SignSTE`), each step
   followed by ``clip(W-bar, -1, 1)``.
3. *Noise* (Definition 3): ``RR_gamma`` on every one of the d binary weights
   independently (keep with probability ``1/2 + gamma``), drawn from the
   client's privacy-noise generator (:func:`fl_app.privacy.mechanisms.binary_randomized_response`).
4. *Upload*: the d noised bits packed 8 per byte (:func:`pack_signs`), about
   ``d / 8`` bytes, and nothing else: no training loss, no example count, no
   full-precision value.

The latent weights and the Adam moments persist across rounds in the client's
state (ArrayRecords :data:`BNN_STATE_LATENT` and :data:`BNN_STATE_ADAM`; the node's
``context.state`` on a device, the engine's per-client store in a simulation); they
never reach the strategy.

``evaluate()`` answers the strategy's optional diagnostic (the document's
metric: accuracy of the client's own merged local model on the test split),
in simulation only; its reply is outside the privacy accounting and is
labelled so by the strategy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message, RecordDict
from torch import nn
from torch.nn import functional as F  # noqa: N812 - the conventional name

from clients import register_client
from clients.base import FederatedClient
from fl_app import keys
from fl_app.data.federated import DataSpec, federated_data
from fl_app.learning.optim import Adam, AdamMoments
from fl_app.learning.training import evaluate, to_tensor
from fl_app.privacy.mechanisms import binary_randomized_response
from fl_app.privacy.rng import make_generator

# ---------------------------------------------------------------- the wire format: 8 signs per byte

# ---------------------------------------------------------------- wire protocol: this algorithm's keys
BNN_NOISE = "bnn-noise"  # bool: apply RR_gamma to the uploaded bits (false: the noise-free BNN baseline)
BNN_GAMMA = "bnn-gamma"  # RR_gamma: keep each bit w.p. 1/2 + gamma (only with bnn-noise)
BNN_BETA = "bnn-beta"  # beta: weight of the aggregate in W^i = beta W~ + (1 - beta) W-bar^i
BNN_LOCAL_STEPS = "bnn-local-steps"  # Adam steps per round (0: local-epochs passes over the data)
BNN_ADAM_BETA1 = "bnn-adam-beta1"  # Adam's first-moment coefficient (the document's "momentum")
BNN_ADAM_BETA2 = "bnn-adam-beta2"
BNN_NUM_BITS = "bnn-num-bits"  # d: binary weights per upload (the client checks its model against it)
BNN_EVAL_TEST_SUBSET = "bnn-eval-test-subset"  # local-model diagnostic: test examples (0: all)
BNN_PACKED_SIGNS = "packed-signs"  # ArrayRecord key of the uploaded uint8 bits
BNN_STATE_LATENT = "dpfl-bnn-latent"  # state ArrayRecord: latent weights W-bar^i
BNN_STATE_ADAM = "dpfl-bnn-adam"  # state ArrayRecord: Adam moments and step count
BNN_LOCAL_ACCURACY = "local-model-accuracy"  # metric: the client's own model on the test split


BITORDER = "big"


def packed_length(count: int) -> int:
    """Number of bytes that hold ``count`` packed bits: ``ceil(count / 8)``."""
    if isinstance(count, bool) or int(count) != count or count < 0:
        raise ValueError(f"count must be an integer >= 0, got {count!r}")
    return (int(count) + 7) // 8


def pack_signs(signs: np.ndarray) -> np.ndarray:
    """Pack a vector of ``-1``/``+1`` values into bytes (``+1 -> 1``, ``-1 -> 0``).

    Parameters
    ----------
    signs : np.ndarray
        Values in ``{-1, +1}`` (any numeric dtype, any shape; flattened in C order).

    Returns
    -------
    np.ndarray
        ``uint8`` array of length ``ceil(signs.size / 8)``; unused bits of the last byte are 0.

    Raises
    ------
    ValueError
        If ``signs`` holds a value other than -1 and +1.

    """
    flat = np.asarray(signs).ravel()
    if flat.size and not np.all((flat == 1) | (flat == -1)):
        raise ValueError("signs must contain only -1 and +1")
    return np.packbits(flat > 0, bitorder=BITORDER)


def unpack_signs(packed: np.ndarray, count: int, *, dtype: np.dtype | type = np.float32) -> np.ndarray:
    """Inverse of :func:`pack_signs`: ``count`` values in ``{-1, +1}``.

    Parameters
    ----------
    packed : np.ndarray
        ``uint8`` array of exactly ``ceil(count / 8)`` bytes.
    count : int
        Number of signs packed.
    dtype : numpy dtype
        Dtype of the result.

    Raises
    ------
    ValueError
        If the dtype, the length or the padding bits do not match ``count``.

    """
    data = np.asarray(packed)
    if data.dtype != np.uint8:
        raise ValueError(f"packed signs must be uint8, got {data.dtype}")
    if data.ndim != 1 or data.size != packed_length(count):
        raise ValueError(
            f"packed signs must be a 1-D array of {packed_length(count)} bytes for {count} signs, "
            f"got shape {data.shape}"
        )
    bits = np.unpackbits(data, bitorder=BITORDER)
    if np.any(bits[count:]):
        raise ValueError("padding bits of the packed signs must be zero")
    return np.where(bits[:count] == 1, 1, -1).astype(dtype)


def signs_of(values: np.ndarray) -> np.ndarray:
    """``Sign`` with ties to +1 as ``int8`` (the binarization of :class:`fl_app.learning.models.SignSTE`)."""
    return np.where(np.asarray(values) >= 0, 1, -1).astype(np.int8)


def flatten_arrays(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """Concatenate arrays (each flattened in C order) into one vector."""
    if not arrays:
        return np.zeros(0)
    return np.concatenate([np.asarray(a).ravel() for a in arrays])


def split_vector(vector: np.ndarray, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """Inverse of :func:`flatten_arrays`: cut ``vector`` into arrays of ``shapes``."""
    flat = np.asarray(vector).ravel()
    sizes = [int(np.prod(shape, dtype=np.int64)) for shape in shapes]
    if sum(sizes) != flat.size:
        raise ValueError(f"vector has {flat.size} entries, the shapes need {sum(sizes)}")
    out, start = [], 0
    for shape, size in zip(shapes, sizes, strict=True):
        out.append(flat[start : start + size].reshape(shape))
        start += size
    return out


STATE_STEP = "__step__"


def merge_latent(
    received: dict[str, np.ndarray], latent: dict[str, np.ndarray] | None, beta: float
) -> dict[str, np.ndarray]:
    """``W^i = beta W~ + (1 - beta) W-bar^i`` clipped to [-1, 1] (Algorithm 1, step 5).

    Without previous latent weights (``latent=None``) the result is ``W~`` itself.
    """
    out = {}
    for name, aggregate in received.items():
        aggregate = np.asarray(aggregate, dtype=np.float32)
        merged = aggregate if latent is None else beta * aggregate + (1.0 - beta) * latent[name]
        out[name] = np.clip(merged, -1.0, 1.0).astype(np.float32)
    return out


@register_client("dpfl_bnn")
class DPFLBNNClient(FederatedClient):
    """Trains its BNN with Adam, randomizes every binary weight, uploads packed bits."""

    keeps_state = True  # the latent weights and Adam moments, never sent

    def local_sgd(self) -> None:
        """Adam on the latent weights of its own model (:meth:`train`): no standard local SGD."""
        return None

    # ------------------------------------------------------------------ state

    def _latent_state(self) -> dict[str, np.ndarray] | None:
        state = self.state
        if BNN_STATE_LATENT not in state.array_records:
            return None
        record = state.array_records[BNN_STATE_LATENT]
        return {name: record[name].numpy().astype(np.float32) for name in record}

    def _received(self) -> dict[str, np.ndarray]:
        return {name: array.numpy() for name, array in self.incoming_arrays().items()}

    def _local_model(self) -> tuple[nn.Module, dict[str, np.ndarray]]:
        """The model holding ``W^i`` (merged latent weights) and the merged arrays."""
        model = self.model_spec().build()
        expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        received = self._received()
        got = {name: tuple(a.shape) for name, a in received.items()}
        if got != expected:
            raise ValueError(f"received arrays {got} do not match the binary model {expected}")
        latent = self._latent_state()
        if latent is not None and {n: a.shape for n, a in latent.items()} != expected:
            raise ValueError("the stored latent weights do not match the model; was the model changed?")
        merged = merge_latent(received, latent, float(self.config[BNN_BETA]))
        model.load_state_dict({name: torch.from_numpy(value) for name, value in merged.items()})
        return model, merged

    def _optimizer(self, model: nn.Module) -> Adam:
        """Adam on the latent weights, resumed from the moments this client kept last round."""
        parameters = list(model.named_parameters())
        optimizer = Adam(
            [p for _, p in parameters],
            lr=float(self.config[keys.LR]),
            betas=(float(self.config[BNN_ADAM_BETA1]), float(self.config[BNN_ADAM_BETA2])),
        )
        state = self.state
        if BNN_STATE_ADAM in state.array_records:
            record = state.array_records[BNN_STATE_ADAM]
            step = float(record[STATE_STEP].numpy())
            optimizer.state = {
                index: AdamMoments(
                    step,
                    torch.from_numpy(record[f"{name}.exp_avg"].numpy().copy()),
                    torch.from_numpy(record[f"{name}.exp_avg_sq"].numpy().copy()),
                )
                for index, (name, _) in enumerate(parameters)
            }
        return optimizer

    def _save_state(self, model: nn.Module, optimizer: Adam) -> None:
        """Keep ``W-bar^i`` and the Adam moments in :attr:`state` (they never leave the client)."""
        parameters = dict(model.named_parameters())
        self.state[BNN_STATE_LATENT] = ArrayRecord(
            {name: Array(p.detach().cpu().numpy().copy()) for name, p in parameters.items()}
        )
        stepped = [optimizer.state[i] for i in range(len(parameters)) if i in optimizer.state]
        if len(stepped) != len(parameters):  # no step taken (no data): nothing to keep
            return
        moments: dict[str, Array] = {STATE_STEP: Array(np.asarray(stepped[0].step, dtype=np.float64))}
        for name, entry in zip(parameters, stepped, strict=True):
            moments[f"{name}.exp_avg"] = Array(entry.exp_avg.detach().cpu().numpy().copy())
            moments[f"{name}.exp_avg_sq"] = Array(entry.exp_avg_sq.detach().cpu().numpy().copy())
        self.state[BNN_STATE_ADAM] = ArrayRecord(moments)

    # ------------------------------------------------------------------ training

    def _train(self, model: nn.Module, optimizer: Adam, x: np.ndarray, y: np.ndarray) -> float:
        """Adam steps on the latent weights, each followed by ``clip(W-bar, -1, 1)`` (Eq. 5, 6)."""
        if len(y) == 0:
            return float("nan")
        batch = int(self.config[keys.BATCH_SIZE])
        steps = int(self.config[BNN_LOCAL_STEPS])
        if steps <= 0:
            steps = int(self.config[keys.LOCAL_EPOCHS]) * -(-len(y) // batch)
        rng = self.generator("data-order")
        inputs, targets = to_tensor(x), torch.from_numpy(np.asarray(y, dtype=np.int64))
        order, position, total = rng.permutation(len(y)), 0, 0.0
        model.train()
        for _ in range(steps):
            if position >= len(order):
                order, position = rng.permutation(len(y)), 0
            index = torch.from_numpy(order[position : position + batch])
            position += batch
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(inputs[index]), targets[index])
            loss.backward()
            optimizer.step()
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.clamp_(-1.0, 1.0)
            total += float(loss.detach())
        return total / steps

    def train(self) -> Message:
        """One round of Algorithm 1 on this client: merge, train, randomize, upload packed bits."""
        data = self.local_data()
        model, _ = self._local_model()
        num_bits, expected = sum(p.numel() for p in model.parameters()), int(self.config[BNN_NUM_BITS])
        if num_bits != expected:
            raise ValueError(f"the model has {num_bits} binary weights, the server expects {expected}")
        optimizer = self._optimizer(model)
        self._train(model, optimizer, data.x, data.y)
        self._save_state(model, optimizer)
        latent = [p.detach().cpu().numpy() for p in model.parameters()]
        signs = signs_of(flatten_arrays(latent))
        if bool(self.config[BNN_NOISE]):
            signs = binary_randomized_response(
                signs=signs, gamma=float(self.config[BNN_GAMMA]), rng=self.noise_generator("bnn-uplink")
            )
        # The reply holds the packed bits and nothing else (no metrics: a training loss
        # would leave the client outside the accounting, and the mean needs no sizes).
        content = RecordDict({keys.ARRAYS: ArrayRecord({BNN_PACKED_SIGNS: Array(pack_signs(signs))})})
        return Message(content=content, reply_to=self.message)

    # ------------------------------------------------------------------ diagnostic

    def evaluate(self) -> Message:
        """The document's metric: this client's merged local model ``Sign(W^i)`` on the evaluation split.

        Simulation only (a device has no test split, and its reply would leave
        outside the privacy accounting). Does not change the client's state.
        """
        if not self.in_simulation:
            raise ValueError("the DPFL-BNN local-model diagnostic runs in simulation only")
        model, _ = self._local_model()
        test = federated_data(DataSpec.from_json(str(self.config[keys.DATA_SPEC]))).evaluation()
        x, y = test.x, test.y
        subset = int(self.config.get(BNN_EVAL_TEST_SUBSET, 0))
        if 0 < subset < len(y):
            rows = np.sort(
                make_generator(
                    seed=int(self.config.get(keys.SEED, 0)), secure=False, purpose="bnn-local-eval-subset"
                ).choice(len(y), size=subset, replace=False)
            )
            x, y = x[rows], y[rows]
        loss, accuracy = evaluate(model, x, y)
        metrics: dict[str, Any] = {
            keys.NUM_EXAMPLES: len(y),
            keys.EVAL_LOSS: loss,
            keys.EVAL_ACCURACY: accuracy,
            BNN_LOCAL_ACCURACY: accuracy,
        }
        return self.reply(metrics=metrics)
