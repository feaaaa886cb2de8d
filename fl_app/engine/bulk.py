"""A worker's share of the cohort trained and summed in bulk: no Flower message, no client per member.

A packed message (:mod:`fl_app.engine.packed`) still runs every member through the ClientApp: a member
message and Context, a client object, its data looked up, its generator built, its reply read. For a
client that does exactly what FedAvg's does (:func:`clients.fedavg.plain_fedavg`: the contract's local
SGD from the train config on the received model, the trained model and its metrics as the reply, no
state) none of that is needed. When the run allows it (``simulation.bulk``) the grid then packs the
round into one message per worker (:func:`fl_app.engine.packed.pack` with several blocks per message,
the :data:`BULK` flag in its packed record), and the worker answers it here (:func:`answer`):

* the members' data gathered from the process's resident data set by their rows;
* their example orders and dropout seeds drawn for all of them at once
  (:func:`fl_app.learning.orders.example_orders`), the orders each would draw on its own;
* the members trained one after another on this process's model (:func:`fl_app.learning.training.train_local`)
  or, with ``simulation.vectorise``, all at once (:func:`fl_app.engine.vectorised_training.train_vectorised`);
* each member's term added to its block's sum as it is trained (the strategy's summand: clipping,
  weights), the blocks of 16 members summed from zero in client order and then added in block order,
  as the server sums plain replies (:func:`fl_app.learning.sums.summed`).

The reply is a packed reply: the partial sum, the members that failed, what their plain replies would
have weighed. With one worker the released model equals the plain messages' bit for bit; with several,
to float tolerance (the workers' totals are added in another association). Privacy: each member's
training and term are what its own client computes (its data, its order, the clipping of its update);
the cohort's split into messages stays on the server, as for packed messages.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fl_app import keys
from fl_app.data.federated import ClientDataset, federated_data_of
from fl_app.engine.message_sizes import result_bytes
from fl_app.engine.messages import raised_in_client_app
from fl_app.engine.packed import BULK, METERING, NODES, PARTITIONS
from fl_app.engine.vectorised_training import ConcatenatedRows
from fl_app.learning.records import config_record
from fl_app.learning.sums import BLOCK, BLOCK_INDEX, PartialSum, Stacked, Summand, summand_of
from fl_app.learning.train_results import TrainResult
from fl_app.learning.training import LocalSGD


def is_bulk(message: Message) -> bool:
    """Whether ``message`` is a share of the cohort to train in bulk."""
    packing = config_record(message.content, keys.PACKED) if message.has_content() else None
    return packing is not None and bool(packing.get(BULK, False))


def answer(message: Message, context: Context) -> Message:
    """Train and sum a share of the cohort without a client per member (module docstring)."""
    packing = config_record(message.content, keys.PACKED)
    config = config_record(message.content, keys.CONFIG)
    summand = summand_of(packing)
    if packing is None or config is None or summand is None:
        raise ValueError("not a bulk message: it needs a config and a packed record naming a summand")
    share = Share(message, packing, config)
    total = share.sum_terms(summand)
    content = RecordDict(total.records())
    content[keys.PACKED_FAILURES] = ConfigRecord(share.failed)
    content[METERING] = MetricRecord(share.weighed)
    return Message(content=content, reply_to=message)


@dataclass(frozen=True)
class Members:
    """A share's members that train: their indices in the share and their examples, one after another."""

    live: list[int]
    xs: ConcatenatedRows
    ys: ConcatenatedRows

    @property
    def sizes(self) -> np.ndarray:
        """Each live member's number of examples."""
        return np.diff(self.ys.ends, prepend=0)

    def data(self, position: int) -> ClientDataset:
        """The examples of the ``position``-th live member."""
        return ClientDataset(self.xs[position], self.ys[position])


class Share:
    """A worker's share of the round's cohort: its members, their data, the model and the SGD."""

    def __init__(self, message: Message, packing: ConfigRecord, config: ConfigRecord) -> None:
        self.global_arrays: ArrayRecord = message.content.array_records[keys.ARRAYS]
        self.config = config
        self.nodes = [int(n) for n in packing[NODES]]  # type: ignore[union-attr]
        self.partitions = [int(p) for p in packing[PARTITIONS]]  # type: ignore[union-attr]
        self.first_block = int(packing[BLOCK_INDEX])  # type: ignore[arg-type]
        self.server_round = int(config.get(keys.SERVER_ROUND, 0))
        self.seed = int(config.get(keys.SEED, 0))
        self.sgd = LocalSGD.from_config(config)
        self.failed: dict[str, list[Any]] = {NODES: [], "codes": [], "reasons": [], "tracebacks": []}
        self.weighed = {"upload-bytes": 0, "upload-array-bytes": 0, "replies": 0}
        self._sizes: dict[int, tuple[int, int]] = {}

    def sum_terms(self, summand: Summand) -> PartialSum:
        """The members' terms summed in blocks of :data:`BLOCK` (client order), the blocks in order.

        A member's block is its position in the share // BLOCK (failed members keep their place), as
        the server assigns a round's cohort to blocks (:func:`fl_app.learning.sums.blocks_of`). Members
        trained one by one add their terms one by one (the plain messages' sums, bit for bit); members
        trained as one computation add their stacked results in chunks of rows (to float tolerance).
        """
        from fl_app.engine.bulk_training import train_one_by_one, train_stacked

        total = PartialSum.zeros_like(self.global_arrays, summand.to_config())
        total.block = self.first_block
        members = self._live_members()
        examples = dict(zip(members.live, members.sizes.tolist(), strict=True))
        stacked = train_stacked(self, members)
        if stacked is not None:
            self._add_stacked(total, summand, members.live, examples, stacked)
            return total
        block, current = None, -1
        for index, state, loss in train_one_by_one(self, members):
            if index // BLOCK != current:
                if block is not None:
                    total.add(block)
                block, current = (
                    PartialSum.zeros_like(self.global_arrays, summand.to_config()),
                    index // BLOCK,
                )
            result = TrainResult(state, {keys.NUM_EXAMPLES: examples[index], keys.TRAIN_LOSS: loss})
            try:
                summand.add_to(
                    block, self.nodes[index], result.checked(self.global_arrays), self.global_arrays
                )
            except Exception as error:  # a malformed result: the member's failure
                self._fail(self.nodes[index], error)
                continue
            self._weigh(result, examples[index])
        if block is not None:
            total.add(block)
        return total

    def _add_stacked(
        self,
        total: PartialSum,
        summand: Summand,
        live: list[int],
        examples: dict[int, int],
        stacked: tuple[dict[str, np.ndarray], np.ndarray],
    ) -> None:
        """The stacked results' terms, each block of the share summed at once, the blocks in order."""
        arrays, losses = stacked
        counts = np.asarray([examples[index] for index in live], dtype=np.int64)
        part = Stacked(
            nodes=[self.nodes[index] for index in live],
            arrays=arrays,
            examples=counts,
            losses=losses,
            blocks=np.asarray(live, dtype=np.int64) // BLOCK,
        )
        summand.add_stacked(total, part, self.global_arrays)
        first = {name: values[0] for name, values in arrays.items()}
        values, rows, members = np.unique(counts, return_index=True, return_counts=True)
        for count, row, number in zip(values, rows, members, strict=True):
            result = TrainResult(first, {keys.NUM_EXAMPLES: int(count), keys.TRAIN_LOSS: float(losses[row])})
            self._weigh(result, int(count), members=int(number))

    def _live_members(self) -> Members:
        """The members that do not fail before training (an injected failure), and their data."""
        from clients.node import INJECT_DELAY_ENV, INJECT_FAILURES_ENV, InjectedFailureError, injected_failure

        delay = float(os.environ.get(INJECT_DELAY_ENV, "0") or 0)
        failing = bool(os.environ.get(INJECT_FAILURES_ENV, ""))
        if self.server_round <= 0 or (delay <= 0 and not failing):
            return self._gathered(list(range(len(self.nodes))))
        live = []
        for index, (node, client) in enumerate(zip(self.nodes, self.partitions, strict=True)):
            if delay > 0:
                time.sleep(delay)
            if failing and injected_failure(client, self.server_round):
                message = f"client {client} fails in round {self.server_round} ({INJECT_FAILURES_ENV})"
                self._fail(node, InjectedFailureError(message))
                continue
            live.append(index)
        return self._gathered(live)

    def _gathered(self, live: list[int]) -> Members:
        """The live members' examples, gathered in one indexing of the process's data set."""
        federated = federated_data_of(str(self.config[keys.DATA_SPEC]))
        rows, sizes = federated.rows_of([self.partitions[index] for index in live])
        ends = np.cumsum(sizes, dtype=np.int64)
        # Indexed as a client's own data is (FederatedData.client): the same memory layout, so the same
        # kernels train it (np.take would give images with C-order strides, which torch's convolutions
        # take on another, slower path than the stored channels-last ones).
        x, y = federated.arrays.x_train[rows], federated.arrays.y_train[rows]
        return Members(live, ConcatenatedRows(x, ends), ConcatenatedRows(y, ends))

    def _fail(self, node: int, error: Exception) -> None:
        """Record a member's failure as the engine reports a plain message's."""
        code, reason = raised_in_client_app(error)
        self.failed[NODES].append(node)
        self.failed["codes"].append(code)
        self.failed["reasons"].append(reason)
        self.failed["tracebacks"].append("".join(traceback.format_exception(error)))

    def _weigh(self, result: TrainResult, examples: int, *, members: int = 1) -> None:
        """Add what ``members`` plain replies like ``result`` would weigh (cached by example count).

        A reply's size changes only with its example count (its loss is a float of fixed size).
        """
        sizes = self._sizes.get(examples)
        if sizes is None:
            sizes = self._sizes[examples] = result_bytes(result)
        self.weighed["upload-bytes"] += sizes[0] * members
        self.weighed["upload-array-bytes"] += sizes[1] * members
        self.weighed["replies"] += members
