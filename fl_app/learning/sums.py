"""What a strategy whose aggregation is a sum of per-client terms needs from each reply.

FedAvg averages ``sum_k n_k w_k / sum_k n_k``; DP-FedAvg and its adaptive, FTRL and banded-MF
relatives add noise to ``sum_k clip(w_k - w_t, C)``; FedAvg+LDP and NbAFL average the clients'
locally noised uploads, ``sum_k u_k / K``. Such a strategy names its per-client term, a
:class:`Summand` (:meth:`strategies.base.FederatedStrategy.summand`); a simulation that packs
several clients into one message (``simulation.pack_messages``, :mod:`fl_app.engine.packed`) names
it in each packed message's record (:data:`fl_app.keys.REPLY_SUM`) and applies the summand to
each member's train result where the member ran and returns one :class:`PartialSum` per message,
which the strategy adds up instead of the replies. The server sees the sum over a message's
members, a function of what it would have received; every step a client's privacy depends on
(local training, clipping on the client, local noise) still runs per member with the member's
generators.

A summand is a pure function of a reply's arrays and metrics (a
:class:`~fl_app.learning.train_results.TrainResult`: the reply decoded, or a member's result before encoding)
and the round's global arrays, in float64; the same function runs on the server for plain replies
(:func:`summed`), in the same blocks of the cohort and the same order, so both paths give the same
sum bit for bit.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord

from fl_app import keys
from fl_app.learning.records import metric_record
from fl_app.learning.train_results import TrainResult
from fl_app.learning.training import array_values, state_to_arrays
from fl_app.privacy.mechanisms import global_l2_norm

#: The reply record holding a message's partial sum (arrays: the summed terms in float64).
PARTIAL_SUM = "partial-sum"
#: The reply record holding the partial sum's scalars and per-member lists.
PARTIAL_SUM_METRICS = "partial-sum-metrics"
#: The reply record naming the summand whose terms the partial sum holds.
PARTIAL_SUM_SUMMAND = "partial-sum-summand"
#: Name prefix of the reply records holding the summed terms of the clients' other records.
PARTIAL_SUM_RECORD = "partial-sum:"
#: Clients per block of a summed aggregation (:func:`summed`; a packed message holds one block).
BLOCK = 16
#: Metric key: the block of the cohort a partial sum holds.
BLOCK_INDEX = "block"
#: Metric key: the node ids whose terms a partial sum holds, in the order they were added.
MEMBERS = "members"


@dataclass
class PartialSum:
    """The float64 sum of some clients' terms: arrays by name, scalars, and per-member values.

    ``per_member`` keeps values the strategy needs one per client (e.g. update norms for adaptive
    clipping's count and the diagnostics), in the order of :attr:`members`; ``extra`` sums the
    clients' other array records by record name (a summand that reads them: :class:`WeightedModel`).
    """

    arrays: dict[str, np.ndarray]
    scalars: dict[str, float] = field(default_factory=dict)
    per_member: dict[str, list[float]] = field(default_factory=dict)
    members: list[int] = field(default_factory=list)
    #: The summand whose terms these are (:meth:`Summand.to_config`; checked by :func:`summed`).
    summand: str = ""
    #: The block of the round's cohort these terms belong to (:func:`blocks_of`).
    block: int = 0
    extra: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)

    @classmethod
    def zeros_like(cls, like: ArrayRecord, summand: str = "") -> PartialSum:
        """An empty sum of ``summand``'s terms shaped like the model ``like``."""
        return cls({name: np.zeros(like[name].shape, dtype=np.float64) for name in like}, summand=summand)

    def add_member(
        self, node_id: int, scalars: Mapping[str, float], per_member: Mapping[str, float] | None = None
    ) -> None:
        """Count one client whose arrays were added (:meth:`Summand.add_to`): its scalars and values."""
        for name, value in scalars.items():
            self.scalars[name] = self.scalars.get(name, 0.0) + float(value)
        for name, value in (per_member or {}).items():
            self.per_member.setdefault(name, []).append(float(value))
        self.members.append(int(node_id))

    def add_record(self, record: str, values: Mapping[str, np.ndarray], weight: float = 1.0) -> None:
        """Add ``weight`` times one client's array record ``record`` (float64; zeros before the first)."""
        total = self.extra.setdefault(record, {})
        for name, array in values.items():
            term = np.asarray(array).astype(np.float64) * weight
            if name in total:
                total[name] += term
            else:
                total[name] = term

    def add(self, other: PartialSum) -> None:
        """Add another partial sum (its members after this one's)."""
        for name, values in other.arrays.items():
            self.arrays[name] += values
        for record, values in other.extra.items():
            self.add_record(record, values)
        for name, value in other.scalars.items():
            self.scalars[name] = self.scalars.get(name, 0.0) + float(value)
        for name, values in other.per_member.items():
            self.per_member.setdefault(name, []).extend(values)
        self.members.extend(other.members)

    def records(self) -> dict[str, Any]:
        """The records a packed message's reply carries: the arrays, the numbers, the summand's name."""
        metrics: dict[str, Any] = {f"scalar:{name}": value for name, value in self.scalars.items()}
        metrics.update({f"member:{name}": list(values) for name, values in self.per_member.items()})
        metrics[MEMBERS] = list(self.members)
        metrics[BLOCK_INDEX] = int(self.block)
        records = {
            PARTIAL_SUM: state_to_arrays(self.arrays),  # Array(values) byte for byte, one copy
            PARTIAL_SUM_METRICS: MetricRecord(metrics),
            PARTIAL_SUM_SUMMAND: ConfigRecord({keys.REPLY_SUM: self.summand}),
        }
        for record, values in self.extra.items():
            records[f"{PARTIAL_SUM_RECORD}{record}"] = state_to_arrays(values)
        return records

    @staticmethod
    def members_of(reply: Message) -> list[int]:
        """The node ids whose terms a packed message's reply holds (without reading its arrays)."""
        return [int(v) for v in _sum_metrics(reply)[MEMBERS]]  # type: ignore[union-attr]

    @classmethod
    def of_reply(cls, reply: Message) -> PartialSum:
        """The partial sum a packed message's reply carries."""
        arrays = reply.content.array_records[PARTIAL_SUM]
        metrics = reply.content.metric_records[PARTIAL_SUM_METRICS]
        result = cls({name: np.array(array_values(arrays[name]), dtype=np.float64) for name in arrays})
        for key, value in metrics.items():
            kind, _, name = str(key).partition(":")
            if kind == "scalar":
                result.scalars[name] = float(value)  # type: ignore[arg-type]
            elif kind == "member":
                result.per_member[name] = [float(v) for v in value]  # type: ignore[union-attr]
        result.members = [int(v) for v in metrics[MEMBERS]]  # type: ignore[union-attr]
        result.summand = str(reply.content.config_records[PARTIAL_SUM_SUMMAND][keys.REPLY_SUM])
        result.block = int(metrics[BLOCK_INDEX])  # type: ignore[arg-type]
        for name, record in reply.content.array_records.items():
            if name.startswith(PARTIAL_SUM_RECORD):
                result.extra[name[len(PARTIAL_SUM_RECORD) :]] = {
                    key: np.array(array_values(record[key]), dtype=np.float64) for key in record
                }
        return result

    @staticmethod
    def block_of(reply: Message) -> int:
        """The block of the cohort a packed message's reply holds."""
        return int(_sum_metrics(reply)[BLOCK_INDEX])  # type: ignore[arg-type]


def _sum_metrics(reply: Message) -> MetricRecord:
    """A packed reply's :data:`PARTIAL_SUM_METRICS` record, in one lookup.

    Flower's ``content.metric_records`` builds a view of every record on each access (about 15 us),
    and the server reads it once per member of every packed reply.
    """
    record = metric_record(reply.content, PARTIAL_SUM_METRICS)
    if record is None:
        raise KeyError(f"a packed reply without its {PARTIAL_SUM_METRICS!r} metric record")
    return record


def is_partial_sum(reply: Message) -> bool:
    """Whether ``reply`` answers a packed message (it carries a :class:`PartialSum`)."""
    return reply.has_content() and PARTIAL_SUM in reply.content


@dataclass(frozen=True)
class Stacked:
    """Several clients' train results stacked: each array ``[clients, *shape]``, their examples and losses.

    ``blocks``: each row's block of the round's cohort (:func:`blocks_of`), non-decreasing.
    """

    nodes: list[int]
    arrays: dict[str, np.ndarray]
    examples: np.ndarray
    losses: np.ndarray
    blocks: np.ndarray


#: Bytes of float64 rows :func:`float64_chunks` converts at a time (about a core's L2 cache).
CHUNK_BYTES = 2 << 20


def float64_chunks(arrays: Mapping[str, np.ndarray]) -> Iterator[tuple[slice, dict[str, np.ndarray]]]:
    """Rows of stacked ``arrays`` (``[rows, *shape]`` each) in float64, about :data:`CHUNK_BYTES` at a time.

    Yields each chunk's rows and the arrays' rows converted into buffers that are reused for the
    next chunk (read them before the next one is yielded; a caller may change them in place). A
    converted copy of the whole stack would be written to memory and read back; a chunk stays in
    the cache.
    """
    if not arrays:
        return
    rows = len(next(iter(arrays.values())))
    width = sum(int(np.prod(values.shape[1:])) for values in arrays.values())
    step = max(1, CHUNK_BYTES // (8 * max(width, 1)))
    buffers = {name: np.empty((min(step, rows), *values.shape[1:])) for name, values in arrays.items()}
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        chunk = {name: buffers[name][: stop - start] for name in arrays}
        for name, values in arrays.items():
            np.copyto(chunk[name], values[start:stop])
        yield slice(start, stop), chunk


class Summand:
    """A per-client term of a summed aggregation; subclasses set :attr:`name` and :meth:`add_to`."""

    name: ClassVar[str] = ""

    def parameters(self) -> dict[str, Any]:
        """What the term depends on besides the reply (sent with it in a packed message)."""
        return {}

    def add_to(
        self, total: PartialSum, node_id: int, result: TrainResult, global_arrays: ArrayRecord
    ) -> None:
        """Add the client's terms to ``total``; ``ValueError`` for a malformed result (nothing added).

        ``result`` is the client's reply, decoded (:meth:`TrainResult.of_reply`), or its train result
        before encoding (a packed message's member), its arrays shaped like ``global_arrays``.
        """
        raise NotImplementedError

    def add_stacked(self, total: PartialSum, stacked: Stacked, global_arrays: ArrayRecord) -> None:
        """Add the terms of several clients whose results are stacked (one row per client, in order).

        The same terms as :meth:`add_to` per client, summed in float64 a cache-sized chunk of rows at
        a time (:func:`float64_chunks`; equal to the per-client sums to float tolerance). The default
        adds them one by one, each block of the cohort from zero.
        """
        for block in np.unique(stacked.blocks):
            part = PartialSum.zeros_like(global_arrays, total.summand)
            for row in np.flatnonzero(stacked.blocks == block):
                arrays = {name: values[row] for name, values in stacked.arrays.items()}
                metrics = {
                    keys.NUM_EXAMPLES: int(stacked.examples[row]),
                    keys.TRAIN_LOSS: float(stacked.losses[row]),
                }
                self.add_to(part, stacked.nodes[row], TrainResult(arrays, metrics), global_arrays)
            total.add(part)

    def to_config(self) -> str:
        """The summand as a packed record's :data:`fl_app.keys.REPLY_SUM` value."""
        return json.dumps({"name": self.name, **self.parameters()}, sort_keys=True)


class WeightedModel(Summand):
    """FedAvg's term: the client's model times its weight (examples, or 1), the weight, its examples' loss.

    The average is ``arrays / weight`` (McMahan et al. 2017, Algorithm 1). The client's other array
    records are weighted and summed too (:attr:`PartialSum.extra`: SCAFFOLD's control variates).
    """

    name = "weighted_model"

    def __init__(self, *, weighting: str) -> None:
        if weighting not in ("num_examples", "uniform"):
            raise ValueError(f"weighting={weighting!r}: expected num_examples or uniform")
        self.weighting = weighting

    def parameters(self) -> dict[str, Any]:
        """The weighting."""
        return {"weighting": self.weighting}

    def add_to(
        self, total: PartialSum, node_id: int, result: TrainResult, global_arrays: ArrayRecord
    ) -> None:
        """``weight * w_k`` in float64 (``w_k.astype(float64) * weight``), weight, ``n_k``, ``n_k loss_k``.

        The train loss is averaged over the examples whatever the weighting (the mean loss of the
        round's training examples).
        """
        examples = result.metric(keys.NUM_EXAMPLES)
        loss = result.metric(keys.TRAIN_LOSS)
        weight = 1.0 if self.weighting == "uniform" else examples
        for name, values in result.arrays.items():
            total.arrays[name] += values.astype(np.float64) * weight
        for record, values in result.records.items():
            total.add_record(record, values, weight)
        total.add_member(node_id, {"weight": weight, "examples": examples, "example_loss": examples * loss})

    def add_stacked(self, total: PartialSum, stacked: Stacked, global_arrays: ArrayRecord) -> None:
        """``sum_k weight_k w_k`` as one product per array, and the scalars' sums."""
        examples = stacked.examples.astype(np.float64)
        weights = np.ones_like(examples) if self.weighting == "uniform" else examples
        for rows, chunk in float64_chunks(stacked.arrays):
            for name, values in chunk.items():
                total.arrays[name] += np.tensordot(weights[rows], values, axes=1)
        _add_members(
            total, stacked.nodes, weight=weights, examples=examples, example_loss=examples * stacked.losses
        )


class ClippedUpdate(Summand):
    """Central DP's term: the update ``w_k - w_t`` clipped to L2 norm ``clip``, and its norm before.

    :func:`fl_app.privacy.mechanisms.clip_l2`'s arithmetic (the whole update scaled by
    ``min(1, C / ||u||)``, the norm by :func:`~fl_app.privacy.mechanisms.global_l2_norm`); the norm is
    un-noised and stays on the server (diagnostics, adaptive clipping's noised count).
    """

    name = "clipped_update"

    def __init__(self, *, clip: float) -> None:
        if not clip > 0:
            raise ValueError(f"clip={clip!r}: expected a positive number")
        self.clip = float(clip)
        self._start: tuple[int, dict[str, np.ndarray]] | None = None

    def parameters(self) -> dict[str, Any]:
        """The clipping bound."""
        return {"clip": self.clip}

    def start(self, global_arrays: ArrayRecord) -> dict[str, np.ndarray]:
        """The global model in float64 (converted once per model)."""
        if self._start is None or self._start[0] != id(global_arrays):
            values = {name: array_values(global_arrays[name]).astype(np.float64) for name in global_arrays}
            self._start = (id(global_arrays), values)
        return self._start[1]

    def add_to(
        self, total: PartialSum, node_id: int, result: TrainResult, global_arrays: ArrayRecord
    ) -> None:
        """The clipped update in float64 and the norm before clipping."""
        start = self.start(global_arrays)
        update = {name: values.astype(np.float64) - start[name] for name, values in result.arrays.items()}
        norm = global_l2_norm(list(update.values()))
        scale = min(1.0, self.clip / norm) if norm > 0 else 1.0
        for name, values in update.items():
            total.arrays[name] += values * scale
        total.add_member(node_id, {}, {"norm": norm})

    def add_stacked(self, total: PartialSum, stacked: Stacked, global_arrays: ArrayRecord) -> None:
        """Every row's update, its norm over all arrays, ``min(1, C / norm)``, the scaled updates' sum."""
        start = self.start(global_arrays)
        norms = []
        for _, updates in float64_chunks(stacked.arrays):
            for name, update in updates.items():
                update -= start[name]
            squares = sum(np.square(u).reshape(len(u), -1).sum(axis=1) for u in updates.values())
            chunk_norms = np.sqrt(np.asarray(squares, dtype=np.float64))
            safe = np.where(chunk_norms > 0, chunk_norms, 1.0)
            scales = np.where(chunk_norms > 0, np.minimum(1.0, self.clip / safe), 1.0)
            for name, update in updates.items():
                total.arrays[name] += np.tensordot(scales, update, axes=1)
            norms.append(chunk_norms)
        _add_members(
            total, stacked.nodes, norm=np.concatenate(norms) if norms else np.zeros(0), per_member=True
        )


class Upload(Summand):
    """Local DP's term: the client's upload as it came (already clipped and noised on the client).

    FedAvg+LDP's noisy update and NbAFL's noised model: the server's uniform mean is
    ``arrays / len(members)``. The client's own steps (clipping, its local noise) ran before the
    upload, so the term adds nothing and removes nothing.
    """

    name = "upload"

    def add_to(
        self, total: PartialSum, node_id: int, result: TrainResult, global_arrays: ArrayRecord
    ) -> None:
        """The upload in float64; the member counted among the sum's members."""
        for name, values in result.arrays.items():
            total.arrays[name] += values
        total.add_member(node_id, {})


SUMMANDS: dict[str, type[Summand]] = {cls.name: cls for cls in (WeightedModel, ClippedUpdate, Upload)}


def _add_members(
    total: PartialSum, nodes: list[int], *, per_member: bool = False, **values: np.ndarray
) -> None:
    """Count ``nodes`` as members of ``total``: ``values`` summed into its scalars, or kept per member."""
    for name, column in values.items():
        if per_member:
            total.per_member.setdefault(name, []).extend(float(v) for v in column)
        else:
            total.scalars[name] = total.scalars.get(name, 0.0) + float(np.sum(column))
    total.members.extend(int(node) for node in nodes)


def summand_of(config: Mapping[str, Any] | ConfigRecord | None) -> Summand | None:
    """The summand a cohort record names (None: it names none)."""
    if config is None or keys.REPLY_SUM not in config:
        return None
    spec = dict(json.loads(str(config[keys.REPLY_SUM])))
    name = spec.pop("name")
    if name not in SUMMANDS:
        raise ValueError(f"{keys.REPLY_SUM}={name!r}: not one of {sorted(SUMMANDS)}")
    return SUMMANDS[name](**spec)


def blocks_of(node_ids: Iterable[int]) -> dict[int, int]:
    """Each node's block: its position among ``node_ids`` (the round's cohort in client order) // BLOCK."""
    return {int(node): position // BLOCK for position, node in enumerate(node_ids)}


def summed(
    replies: Iterable[tuple[int, Message]],
    summand: Summand,
    global_arrays: ArrayRecord,
    *,
    blocks: Mapping[int, int],
) -> PartialSum:
    """The sum of ``summand``'s terms over ``(node id, reply)`` pairs, plain replies and partial sums.

    Always associated the same way: each block of the cohort (``blocks``, :func:`blocks_of`) summed
    from zero in the order given (client order), then the block sums added in block order. A cohort
    message is one block, summed where its members ran in the same order with the same arithmetic, so
    the result is the same bit for bit whichever way the replies came, and whatever the number of
    processes. Raises ``ValueError`` for a partial sum of another summand's terms (e.g. another
    clipping bound: the sum would not have the sensitivity the accounting assumes).
    """
    expected = summand.to_config()
    sums: dict[int, PartialSum] = {}
    read: set[int] = set()  # the partial sums read (one reply stands for each of its members)
    for node_id, reply in replies:
        if id(reply) in read:
            continue
        if is_partial_sum(reply):
            read.add(id(reply))
            block = PartialSum.block_of(reply)
            if block not in sums:
                sums[block] = PartialSum.of_reply(reply)
                if sums[block].summand != expected:
                    raise ValueError(f"a partial sum of {sums[block].summand}, where {expected} was sent")
            continue
        block = blocks[int(node_id)]
        if block not in sums:
            sums[block] = PartialSum.zeros_like(global_arrays, expected)
        summand.add_to(sums[block], node_id, TrainResult.of_reply(reply, global_arrays), global_arrays)
    total = PartialSum.zeros_like(global_arrays, expected)
    for block in sorted(sums):
        total.add(sums[block])
    return total
