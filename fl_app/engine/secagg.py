"""Flower's SecAgg+ (flwr 1.41.0) with dpfl's masks: the client mod, message keys, server primitives.

dpfl's distributed-DP strategy (:mod:`strategies.dp_fedavg_secagg`) runs the server side of the
SecAgg+ protocol (Bell, Bonawitz, Gascon, Lepoint, Raykova, CCS 2020) in its own round, with the
same messages as Flower's ``SecAggPlusWorkflow``. What it needs of Flower beyond the public API is
here: the stage and key names, Shamir's secret sharing, the key agreement, the conversion of a
legacy ``FitRes`` into the record layout the mod reads a client's reply in, and the mod's state
and checks.

**Masks.** Flower's ``pseudo_rand_gen`` seeds numpy's ``RandomState`` with 32 bits folded from the
256-bit secret, which lets a curious server recover a survivor's vector when one pairwise mask is
all that hides it (docs/algorithms/distributed_dp.md). :func:`secure_aggregation_mod` is Flower's
``secaggplus_mod`` with one stage replaced: in the collect stage the self mask and the pairwise
masks come from :func:`fl_app.privacy.masks.mask_arrays` (ChaCha20 keyed by HKDF-SHA256 of the
whole secret), and the server removes them with the same function. The setup stage is Flower's,
plus a handshake: the server names the generator (:data:`MASK_GENERATOR_KEY`), a device refuses a
name it does not know, and confirms the one it uses in its reply, so a device running Flower's own
mod (which ignores the key and confirms nothing) is refused by the server instead of uploading
masks the server would remove with the wrong generator. Key sharing and unmasking are Flower's.

Flower's generator stays importable here as ``flower_mask_arrays`` for the test that shows why it is
not used (two secrets that fold to the same 32 bits give the same masks).

The collect stage takes the client's vector as integers in ``[0, 2^b)`` (the distributed-DP
client encodes them itself) and adds the masks mod ``2^b``: no quantization, no weighting (Flower's
quantizer draws from numpy's global generator).

One patch (:func:`share_in_the_callers_thread`, applied on import, so in every process that runs the
ClientApp or the strategy): Flower's Shamir secret sharing (``create_shares``, ``combine_shares``)
opens a thread pool for every secret it splits or joins and maps pycryptodome's ``Shamir`` over the
secret's 16-byte chunks in it. That code is pure Python and holds the GIL, so the threads run one
after another; what the pool adds is starting and joining up to ``cpu_count`` threads per call, two
calls per client and round on the devices and one per client on the server. The patch gives the
module an executor that maps in the caller's thread: the same calls in the same order, the same
shares (their randomness is pycryptodome's ``get_random_bytes`` either way). Measured: the one-round
SecAgg+ audit (tests/test_privacy_end_to_end.py, 1,600 in-process rounds of 2 clients) spent 36 s of
its 110 s in the pools.

The server recombines secrets with :func:`fl_app.privacy.shamir.combine_shares` (exported here as
``combine_shares``): Flower's format and pycryptodome's field, the same bytes out, with the Lagrange
weights computed once per set of share indices instead of once per 16-byte chunk (measured in
docs/benchmarks/shamir_combine.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import flwr.common.secure_aggregation.crypto.shamir as shamir
import numpy as np
from flwr.app import ConfigRecord, Context, Message, MessageType
from flwr.client.mod import secaggplus_mod
from flwr.client.mod.secure_aggregation.secaggplus_mod import SecAggPlusState, check_configs, check_stage
from flwr.common import ndarray_to_bytes, parameters_to_ndarrays
from flwr.common.secure_aggregation.crypto.symmetric_encryption import decrypt, generate_shared_key
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen as flower_mask_arrays
from flwr.common.secure_aggregation.secaggplus_utils import share_keys_plaintext_separate
from flwr.compat.common.recorddict_compat import fitres_to_recorddict, recorddict_to_fitres
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

from fl_app.privacy.masks import MASK_GENERATOR, mask_arrays
from fl_app.privacy.shamir import combine_shares

__all__ = [
    "MASK_GENERATOR",
    "MASK_GENERATOR_KEY",
    "RECORD_KEY_CONFIGS",
    "Key",
    "Stage",
    "bytes_to_private_key",
    "bytes_to_public_key",
    "collect_reply",
    "combine_shares",
    "fitres_to_recorddict",
    "flower_mask_arrays",
    "generate_shared_key",
    "mask_arrays",
    "modular_integers",
    "secure_aggregation_mod",
]

#: Setup-stage key: the mask generator the server asks for, and the one the device confirms.
MASK_GENERATOR_KEY = "dpfl-mask-generator"


class MaskGeneratorMismatchError(ValueError):
    """The server asked for a mask generator this device does not run."""


def secure_aggregation_mod(
    msg: Message, ctxt: Context, call_next: Callable[[Message, Context], Message]
) -> Message:
    """Flower's ``secaggplus_mod`` with dpfl's masks and the generator handshake (module docstring)."""
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, ctxt)
    configs = msg.content.config_records[RECORD_KEY_CONFIGS]
    stage = configs.get(Key.STAGE)
    if stage == Stage.SETUP:
        asked = configs.get(MASK_GENERATOR_KEY)
        if asked != MASK_GENERATOR:
            raise MaskGeneratorMismatchError(
                f"the server asks for SecAgg+ masks from {asked!r}; this device draws them from "
                f"{MASK_GENERATOR!r}: not taking part"
            )
        reply = secaggplus_mod(msg, ctxt, call_next)
        reply.content.config_records[RECORD_KEY_CONFIGS][MASK_GENERATOR_KEY] = MASK_GENERATOR
        return reply
    if stage == Stage.COLLECT_MASKED_VECTORS:
        return _collect_stage(msg, ctxt, call_next)
    return secaggplus_mod(msg, ctxt, call_next)


def _collect_stage(msg: Message, ctxt: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """The collect stage: the client's reply, its integer vector masked mod ``2^b`` (as Flower's mod does)."""
    state = SecAggPlusState(**ctxt.state.config_records.get(RECORD_KEY_STATE, ConfigRecord({})))
    configs = msg.content.config_records[RECORD_KEY_CONFIGS]
    check_stage(state.current_stage, configs)
    state.current_stage = cast(str, configs.pop(Key.STAGE))
    check_configs(state.current_stage, configs)
    neighbours = _store_shares(state, configs)
    reply = collect_reply(
        msg, call_next(msg, ctxt), lambda vectors: masked_vectors(state, vectors, neighbours)
    )
    ctxt.state.config_records[RECORD_KEY_STATE] = ConfigRecord(state.to_dict())
    return reply


def collect_reply(
    msg: Message, client_reply: Message, mask: Callable[[list[np.ndarray]], list[np.ndarray]]
) -> Message:
    """The collect stage's reply to ``msg``: the client's vectors masked by ``mask``.

    ``client_reply`` is the client's reply in the ``FitRes`` layout; the masked vectors go in the
    record the server reads, and the client's arrays are not sent.
    """
    content = client_reply.content
    vectors = parameters_to_ndarrays(recorddict_to_fitres(content, keep_input=True).parameters)
    masked = mask(vectors)
    for record in content.array_records.values():
        record.clear()
    content.config_records[RECORD_KEY_CONFIGS] = ConfigRecord(
        {Key.MASKED_PARAMETERS: [ndarray_to_bytes(a) for a in masked]}, False
    )
    return Message(content, reply_to=msg)


def _store_shares(state: SecAggPlusState, configs: ConfigRecord) -> list[int]:
    """Decrypt the neighbours' shares forwarded to this node; return the neighbours that sent them."""
    ciphertexts = cast(list[bytes], configs[Key.CIPHERTEXT_LIST])
    sources = cast(list[int], configs[Key.SOURCE_LIST])
    if len(ciphertexts) + 1 < state.threshold:
        raise ValueError("Not enough available neighbour clients.")
    for source, ciphertext in zip(sources, ciphertexts, strict=True):
        actual, destination, seed_share, key_share = share_keys_plaintext_separate(
            decrypt(state.ss2_dict[source], ciphertext)
        )
        if actual != source or destination != state.nid:
            raise ValueError(
                f"Node {state.nid}: a share from {actual} to {destination} arrived as {source}'s"
            )
        state.rd_seed_share_dict[source] = seed_share
        state.sk1_share_dict[source] = key_share
    return list(sources)


def masked_vectors(
    state: SecAggPlusState, vectors: list[np.ndarray], neighbours: Iterable[int]
) -> list[np.ndarray]:
    """``vectors`` (integers in ``[0, 2^b)``) plus the self mask and the pairwise masks, mod ``2^b``.

    The pairwise mask with a neighbour of smaller id is added, with a larger id subtracted (Flower's
    convention, which the server's unmasking follows).
    """
    modulus = int(state.mod_range)
    total = modular_integers(vectors, modulus)
    shapes = [a.shape for a in total]
    total = [t + m for t, m in zip(total, mask_arrays(state.rd_seed, modulus, shapes), strict=True)]
    private = bytes_to_private_key(state.sk1)  # parsed once, not per neighbour (about 0.2 ms each)
    for other in neighbours:
        shared = generate_shared_key(private, bytes_to_public_key(state.public_keys_dict[other][0]))
        sign = 1 if state.nid > other else -1
        total = [t + sign * m for t, m in zip(total, mask_arrays(shared, modulus, shapes), strict=True)]
    return [np.mod(t, modulus) for t in total]


def modular_integers(vectors: list[np.ndarray], modulus: int) -> list[np.ndarray]:
    """``vectors`` as int64 arrays; :class:`ValueError` unless all are integers in ``[0, modulus)``."""
    total = []
    for vector in vectors:
        values = np.asarray(vector)
        if not np.all(np.isfinite(values)) or np.any(values != np.round(values)):
            raise ValueError("secure aggregation sums integers: the client's vector is not integral")
        values = values.astype(np.int64)
        if values.size and (values.min() < 0 or values.max() >= modulus):
            raise ValueError(f"secure aggregation sums integers in [0, {modulus}): the vector is outside")
        total.append(values)
    return total


class InlineExecutor:
    """A ``ThreadPoolExecutor`` stand-in whose ``map`` runs every call in the caller's thread, in order."""

    def __init__(self, max_workers: int | None = None) -> None:
        self.max_workers = max_workers

    def __enter__(self) -> InlineExecutor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def map(self, function: Callable[..., Any], *iterables: Iterable[Any]) -> Iterator[Any]:
        """``function`` over the items, as ``Executor.map`` yields them (results in order)."""
        return iter([function(*items) for items in zip(*iterables, strict=False)])


def share_in_the_callers_thread() -> None:
    """Make Flower's Shamir secret sharing run without a thread pool per call (idempotent)."""
    if getattr(shamir, "ThreadPoolExecutor", None) is not None:
        shamir.ThreadPoolExecutor = InlineExecutor


share_in_the_callers_thread()
