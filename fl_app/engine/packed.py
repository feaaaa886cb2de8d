"""A round's train messages packed several clients to a message, each answered with a partial sum.

**Contract.** A strategy whose aggregation is a sum of per-client terms declares the term
(:meth:`strategies.base.FederatedStrategy.summand`, a :class:`fl_app.learning.sums.Summand`) and
reads its round through ``replies.sum``, which takes plain replies and partial sums alike. When the run
allows it (``simulation.pack_messages``) and the strategy aggregates nothing but that sum
(:func:`fl_app.run.round_loop.packing_summand`), the round loop hands the summand to the simulation's
grid (:class:`fl_app.engine.metering.MeteredGrid`), which sends the round's N train messages (one
content: the model, the strategy's records and the config) as N / 16 *packed messages* instead
(:func:`pack`): each carries the content once, the node ids and partition ids of its members (a block
of the cohort in client order), the summand (the :data:`fl_app.keys.PACKED` record) and, for a client
that keeps state, each member's state (:mod:`fl_app.engine.client_states`). The ClientApp answers one
(:func:`answer`) by running every member's client on the member's own plain message and Context,
exactly as it would run the plain message, applying the summand to each result and adding it to a
:class:`~fl_app.learning.sums.PartialSum`. A client whose reply is its train result encoded hands
over the result before encoding (:class:`~fl_app.learning.train_results.TrainResult`): the same
numbers without copying the model into message arrays and reading it back. The reply carries that
sum, the members it holds, the members that failed (code, reason, traceback), the members' kept
states and what the members' plain replies would have weighed on the wire; :func:`unpack` turns the
failures into the error replies the plain messages would have had. Strategies that read every reply
(PrivateKT, KD-DP, DPFL-BNN, the Laplace evaluation, SecAgg+) declare no summand and are sent their
plain messages.

**Privacy.** Each member runs as its own client: its data, its ``"data-order"`` generator, its noise
generators (seeded by the member's id), every step its privacy depends on. What reaches the strategy
is the sum over a message's members of what each member's reply would have contributed, a function of
the replies it receives today (post-processing: no guarantee changes). How the cohort is split into
messages depends on the cohort, which a Poisson-sampled run keeps secret: the split, the members per
message and the messages' sizes stay on the server, as the cohort itself does (none of it is
recorded; a member's failure is logged as a plain client's, through the engine seam, so ``run.log``
withholds it with a secret cohort; the round's bytes are metered per member). Only a simulation packs:
on real devices every client is its own node.

**Results** equal the plain messages' bit for bit: the same terms, summed in float64 in the same
blocks and order (:func:`fl_app.learning.sums.summed`), whatever the number of client processes
(``tests/test_packed.py``).
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

from flwr.app import ArrayRecord, ConfigRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.common import MessageType

from fl_app import keys
from fl_app.engine.client_states import CARRIED, PREFIX, REPORTED, ClientStates, carried, carry, state_of
from fl_app.engine.message_sizes import array_payload_bytes, message_bytes, result_bytes
from fl_app.engine.messages import (
    Broadcast,
    log_client_error,
    member_message,
    raised_in_client_app,
    set_message_id,
)
from fl_app.learning.records import config_record
from fl_app.learning.sums import BLOCK, BLOCK_INDEX, PartialSum, Summand, summand_of
from fl_app.learning.train_results import TrainResult

#: Records a packed message adds to its members' content (what a member's plain message does not hold).
PACKING_RECORDS = frozenset({keys.PACKED, CARRIED})
#: The packed record's keys: the members' node ids and partition ids.
NODES = "nodes"
PARTITIONS = "partitions"
#: The packed record's flag of a share of the cohort trained in bulk (:mod:`fl_app.engine.bulk`).
BULK = "bulk"
#: The reply record with what the members' plain replies would have weighed (metering).
METERING = "packed-metering"

#: Runs one member's plain message through the ClientApp's train path; returns its reply or its train
#: result before encoding, and the state it kept (None: a client that keeps none;
#: :func:`fl_app.client_app.train_outcome`).
MemberRunner = Callable[[Message, Context], tuple[Message | TrainResult, RecordDict | None]]


@dataclass(frozen=True)
class PackedMessage:
    """A packed message and the plain messages it stands for (in the order its members run)."""

    message: Message
    members: Sequence[Message]


def packable(messages: Sequence[Message]) -> bool:
    """Whether ``messages`` can be packed: train messages sharing one content (model, config, records)."""
    if len(messages) < 2:
        return False
    if isinstance(messages, Broadcast):
        content = messages.content
        if messages.message_type != MessageType.TRAIN:
            return False
    else:
        content = messages[0].content
        if any(m.metadata.message_type != MessageType.TRAIN or m.content is not content for m in messages):
            return False
    return (
        keys.ARRAYS in content.array_records
        and config_record(content, keys.CONFIG) is not None
        and not any(name in PACKING_RECORDS or name.startswith(PREFIX) for name in content)
    )


def pack(
    messages: Sequence[Message],
    *,
    partitions: dict[int, int],
    summand: Summand,
    states: ClientStates | None = None,
    shares: int = 0,
) -> list[PackedMessage]:
    """``messages`` as packed messages: in client order, one per block of ``BLOCK`` clients.

    ``shares`` > 0: as that many bulk messages instead (:mod:`fl_app.engine.bulk`), each a run of
    whole blocks of the cohort in client order (the members of one worker's share).

    ``partitions`` maps each node to its partition id, the client id of a simulated node (the
    engine's numbering); ``summand`` is the strategy's per-client term, which the members' replies
    go through; ``states``: the stateful clients' records, carried for each member (None: the client
    keeps none). Each packed message goes to its first member's node and holds the block the
    server sums its plain replies in (:func:`fl_app.learning.sums.blocks_of`), so both give the same sum.
    """
    same = messages if isinstance(messages, Broadcast) else None
    ordered = sorted(same.node_ids if same else messages, key=lambda m: partitions[_node(m)])
    blocks = -(-len(ordered) // BLOCK)
    per_message = max(1, -(-blocks // shares)) if shares > 0 else 1
    packed = []
    for first in range(0, blocks, per_message):
        share = ordered[first * BLOCK : (first + per_message) * BLOCK]
        nodes = [_node(m) for m in share]
        members = same.to(nodes) if same else share
        content = RecordDict(
            {
                **dict((same.content if same else share[0].content).items()),  # model, config, records
                keys.PACKED: ConfigRecord(
                    {
                        NODES: nodes,
                        PARTITIONS: [partitions[n] for n in nodes],
                        BLOCK_INDEX: first,
                        keys.REPLY_SUM: summand.to_config(),
                        BULK: shares > 0,
                    }
                ),
            }
        )
        if states is not None:
            for node in nodes:
                records = states.of(partitions[node])
                content = carry(content, {f"{partitions[node]}:{name}": r for name, r in records.items()})
        message = Message(content=content, dst_node_id=nodes[0], message_type=MessageType.TRAIN)
        packed.append(PackedMessage(message, members))
    return packed


def _node(member: Message | int) -> int:
    """A member's node: its message's destination, or the node id itself."""
    return member if isinstance(member, int) else int(member.metadata.dst_node_id)


def unpack(
    replies: Sequence[Message], packed: Sequence[PackedMessage], pushed_ids: Sequence[str]
) -> list[Message]:
    """The replies a strategy sees: each packed reply, and an error reply per member that failed.

    ``pushed_ids`` are the ids the grid gave ``packed``'s messages (same order). A packed message
    that failed as a whole (its actor died) fails each member with its error; one that got no reply
    leaves its members unanswered (they did not reply in time).
    """
    by_id = dict(zip(pushed_ids, packed, strict=True))
    out: list[Message] = []
    for reply in replies:
        packed_message = by_id.get(reply.metadata.reply_to_message_id)
        if packed_message is None:
            out.append(reply)
        elif reply.has_error():
            out.extend(_error_reply(m, reply.error.code, reply.error.reason) for m in packed_message.members)
        else:
            out.append(reply)
            out.extend(_member_failures(reply, packed_message.members))
    return out


def _error_reply(member: Message, code: int, reason: str) -> Message:
    reply = Message(Error(code=code, reason=reason), reply_to=member)
    set_message_id(reply, str(uuid4()))
    return reply


def _member_failures(reply: Message, members: Sequence[Message]) -> list[Message]:
    """Error replies for the members a packed reply lists as failed.

    Their errors and tracebacks are logged as the engine logs a failing client's (withheld from
    ``run.log`` with a secret cohort: :func:`fl_app.engine.messages.log_client_error`).
    """
    failures = reply.content.config_records.get(keys.PACKED_FAILURES)
    if failures is None or not list(failures.get(NODES, [])):  # type: ignore[arg-type]
        return []
    by_node = {int(m.metadata.dst_node_id): m for m in members}
    errors = []
    for node, code, reason, trace in zip(
        failures[NODES], failures["codes"], failures["reasons"], failures["tracebacks"], strict=True
    ):
        log_client_error(str(reason), str(trace))
        errors.append(_error_reply(by_node[int(node)], int(code), str(reason)))
    return errors


def metered(reply: Message) -> tuple[int, int, int] | None:
    """What a packed reply's members' plain replies would have weighed: bytes, array bytes, replies."""
    if not reply.has_content() or METERING not in reply.content:
        return None
    record = reply.content.metric_records[METERING]
    return int(record["upload-bytes"]), int(record["upload-array-bytes"]), int(record["replies"])  # type: ignore[arg-type]


def answer(
    message: Message,
    context: Context,
    run_member: MemberRunner,
    together: Callable[[list[tuple[Message, Context]]], AbstractContextManager[Any]] = lambda jobs: (
        nullcontext()
    ),
) -> Message:
    """Run each member of a packed message as its own client; reply with the partial sum (module doc).

    ``run_member`` runs a member's plain message (the ClientApp's train path); ``together`` trains
    the members' plain messages as one computation first where the config asks for it
    (:func:`fl_app.client_app.trained_vectorised`).
    """
    packing = config_record(message.content, keys.PACKED)
    summand = summand_of(packing)
    if packing is None or summand is None:
        raise ValueError("not a packed message: it needs a config and a packed record naming a summand")
    jobs = member_jobs(message, context)
    global_arrays: ArrayRecord = message.content.array_records[keys.ARRAYS]
    total = PartialSum.zeros_like(global_arrays, summand.to_config())
    total.block = int(packing[BLOCK_INDEX])  # type: ignore[arg-type]
    failed: dict[str, list[Any]] = {NODES: [], "codes": [], "reasons": [], "tracebacks": []}
    weighed = [0, 0, 0]
    kept: dict[str, Any] = {}
    reported: list[int] = []
    with together(jobs):
        for (member, member_ctx), partition in zip(jobs, packing[PARTITIONS], strict=True):  # type: ignore[call-overload]
            node = int(member.metadata.dst_node_id)
            try:
                outcome, state = run_member(member, member_ctx)
                result, sizes = _read(outcome, global_arrays)
                summand.add_to(total, node, result, global_arrays)
            except Exception as error:  # the member's failure, as its plain message's error reply
                _record_failure(failed, node, error)
                continue
            if state is not None:
                kept.update({f"{int(partition)}:{name}": record for name, record in state.items()})
                reported.append(int(partition))
            weighed = [weighed[0] + sizes[0], weighed[1] + sizes[1], weighed[2] + 1]
    content = RecordDict(total.records())
    if carried(message):
        content = carry(content, kept)
        content[CARRIED] = ConfigRecord({REPORTED: reported})
    content[keys.PACKED_FAILURES] = ConfigRecord(failed)
    content[METERING] = MetricRecord(
        {"upload-bytes": weighed[0], "upload-array-bytes": weighed[1], "replies": weighed[2]}
    )
    return Message(content=content, reply_to=message)


def member_jobs(message: Message, context: Context) -> list[tuple[Message, Context]]:
    """A packed message's members as the plain messages and Contexts they run on, in order.

    Each member's message carries the packed message's model and config (one record for all) and an
    id of its own, ``<packed message id>/<node id>``: the same every time it is built, so the
    engine's batch hook can train the members of all of a batch's packed messages as one computation
    (:func:`fl_app.client_app.trained_vectorised`) before each message is answered.
    """
    packing = config_record(message.content, keys.PACKED)
    config = config_record(message.content, keys.CONFIG)
    if packing is None or config is None:
        raise ValueError("not a packed message: it needs a config and a packed record naming a summand")
    plain = RecordDict(
        {
            name: record
            for name, record in message.content.items()
            if name not in PACKING_RECORDS and not name.startswith(PREFIX)
        }
    )
    states = state_of(message, context) if carried(message) else None
    jobs = []
    for node, partition in zip(packing[NODES], packing[PARTITIONS], strict=True):  # type: ignore[call-overload]
        content = plain
        if states is not None:
            prefix = f"{int(partition)}:"
            content = carry(plain, {n[len(prefix) :]: r for n, r in states.items() if n.startswith(prefix)})
        jobs.append(
            (
                member_message(
                    message, node_id=node, message_id=f"{message.metadata.message_id}/{node}", content=content
                ),
                member_context(context, node_id=node, partition=partition),
            )
        )
    return jobs


def _read(outcome: Message | TrainResult, like: ArrayRecord) -> tuple[TrainResult, tuple[int, int]]:
    """A member's train result (``ValueError`` unless shaped like ``like``) and what its reply weighs.

    A result before encoding is weighed as the reply :meth:`TrainResult.content` would make
    (:func:`fl_app.engine.message_sizes.result_bytes`, exact); a reply as it is.
    """
    if isinstance(outcome, TrainResult):
        return outcome.checked(like), result_bytes(outcome)
    return TrainResult.of_reply(outcome, like), (message_bytes(outcome), array_payload_bytes(outcome))


def member_context(context: Context, *, node_id: int, partition: int) -> Context:
    """The Context a member's node has in the simulation: its partition, and no state.

    A client's state is carried in its message (:mod:`fl_app.engine.client_states`).
    """
    return Context(
        run_id=context.run_id,
        node_id=int(node_id),
        node_config={**dict(context.node_config), keys.NODE_PARTITION_ID: int(partition)},
        state=RecordDict(),
        run_config=context.run_config,
    )


def _record_failure(failed: dict[str, list[Any]], node: int, error: Exception) -> None:
    code, reason = raised_in_client_app(error)  # as the engine reports a plain message's
    failed[NODES].append(node)
    failed["codes"].append(code)
    failed["reasons"].append(reason)
    failed["tracebacks"].append(traceback.format_exc())
