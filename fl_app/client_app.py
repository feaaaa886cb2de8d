"""The Flower ClientApp (``fl_app.client_app:app``): thin wiring to the client registry.

The train/evaluate config names the client class (``algorithm``); the roster
query is answered by :class:`clients.node.NodeClient`, which needs no torch (a
device's roster query process never imports it: the client classes, and torch with
them, are imported with the first train or evaluate message). No Hydra, no shared
disk: everything arrives in the message or lives in the node's context. Messages of the SecAgg+
protocol go through :func:`fl_app.engine.secagg.secure_aggregation_mod` (Flower's ``secaggplus_mod``
with masks from the whole agreed key; :func:`train`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from flwr.app import Context, Message, RecordDict
from flwr.clientapp import ClientApp

from clients import CLIENTS
from clients.node import NodeClient
from fl_app import keys
from fl_app.engine.client_states import carried, carry
from fl_app.engine.secagg import RECORD_KEY_CONFIGS, secure_aggregation_mod
from fl_app.learning.records import config_record

if TYPE_CHECKING:
    from clients.base import FederatedClient
    from fl_app.learning.train_results import TrainResult

app = ClientApp()


def warm_up() -> None:
    """Import every client class, and torch with them, before the first message.

    Called when a simulation actor starts (:mod:`fl_app.engine.batching`), where it overlaps with
    the driver's set-up instead of delaying round 1 by about a second. Devices do not call it.
    """
    CLIENTS.names()


def trained_vectorised(jobs: Sequence[tuple[Message, Context]]) -> AbstractContextManager[int]:
    """Train an actor batch's vectorisable train messages as one computation first (the engine's hook).

    :func:`fl_app.engine.vectorised.trained_vectorised`, imported here, with torch, only when a batch
    runs (a device's roster answer imports no torch).
    """
    from fl_app.engine.vectorised import trained_vectorised as train_together

    def plain_client(message: Message, context: Context) -> FederatedClient | None:
        # a SecAgg+ stage message reaches the client only through the protocol's mod
        if config_record(message.content, RECORD_KEY_CONFIGS) is not None:
            return None
        if config_record(message.content, keys.PACKED) is not None:
            return None  # its members are in the batch's jobs (_with_members)
        from clients.base import trains_by_the_contract

        client = client_for(message, context)
        return client if trains_by_the_contract(client) else None

    return train_together(_with_members(jobs), plain_client)


def _with_members(jobs: Sequence[tuple[Message, Context]]) -> list[tuple[Message, Context]]:
    """The batch's jobs and, after each packed message, its members' plain messages and Contexts.

    So the members of all of a batch's packed messages train as one computation (``simulation.vectorise``),
    not 16 at a time; each packed message's answer then finds its members trained. A packed message
    whose members cannot be read is left to its answer, which reports the error.
    """
    expanded: list[tuple[Message, Context]] = []
    for message, context in jobs:
        expanded.append((message, context))
        config = config_record(message.content, keys.CONFIG)
        vectorised = config is not None and bool(config.get(keys.VECTORISE, False))
        if vectorised and config_record(message.content, keys.PACKED) is not None:
            from fl_app.engine import bulk
            from fl_app.engine.packed import member_jobs

            if bulk.is_bulk(message):
                continue  # a bulk share trains its members itself

            with contextlib.suppress(Exception):
                expanded.extend(member_jobs(message, context))
    return expanded


def client_for(message: Message, context: Context) -> FederatedClient:
    """Instantiate the client class the message's config names."""
    config = config_record(message.content, keys.CONFIG)
    if config is None:
        raise KeyError(f"the message has no {keys.CONFIG!r} config record")
    return CLIENTS.get(str(config[keys.ALGORITHM]))(message, context)


@app.train()
def train(message: Message, context: Context) -> Message:
    """One round of local work for the configured algorithm.

    A message of the SecAgg+ protocol (it carries Flower's ``secaggplus_configs`` record) goes
    through :func:`~fl_app.engine.secagg.secure_aggregation_mod`, which answers the protocol's stages
    itself and calls the configured client in the stage that collects the masked vectors. A cohort
    message (a simulation's round sent as a few messages) runs each member's client on the member's
    plain message and answers with the partial sum (:func:`fl_app.engine.packed.answer`).
    """
    if config_record(message.content, RECORD_KEY_CONFIGS) is not None:
        return secure_aggregation_mod(message, context, lambda inner, node: client_for(inner, node).train())
    if config_record(message.content, keys.PACKED) is not None:
        from fl_app.engine import bulk
        from fl_app.engine.packed import answer

        if bulk.is_bulk(message):
            return bulk.answer(message, context)

        return answer(
            message, context, lambda member, node: train_outcome(client_for(member, node)), trained_vectorised
        )
    client = client_for(message, context)
    outcome, state = train_outcome(client)
    reply = outcome if isinstance(outcome, Message) else Message(content=outcome.content(), reply_to=message)
    if state is not None:
        reply.content = carry(reply.content, state)
    return reply


def train_outcome(client: FederatedClient) -> tuple[Message | TrainResult, RecordDict | None]:
    """Run a client's training: its train result before encoding (or its own reply), and its state.

    The result before encoding when :meth:`~clients.base.FederatedClient.train` is the contract's
    (a packed message's member hands it to the strategy's summand without an encoding round trip);
    the state the client kept when the engine carries it (:mod:`fl_app.engine.client_states`), else None.
    Raises ``RuntimeError`` for a client that writes to its node's Context without declaring
    ``keeps_state`` (its records would be lost in a packed round and on ``resume=``).
    """
    from clients.base import FederatedClient

    before = len(client.context.state)
    result = client.train_result() if type(client).train is FederatedClient.train else None
    outcome: Message | TrainResult = result if result is not None else client.train()
    if not type(client).keeps_state and len(client.context.state) != before:
        raise RuntimeError(
            f"{type(client).__name__} wrote to its Context's state: declare keeps_state = True and keep "
            "records in self.state (the engine keeps them per client, across rounds and resume=)"
        )
    kept = client.state if type(client).keeps_state and carried(client.message) else None
    return outcome, kept


@app.evaluate()
def evaluate(message: Message, context: Context) -> Message:
    """Evaluation for the configured algorithm (a stateful client's state goes back with the reply)."""
    client = client_for(message, context)
    reply = client.evaluate()
    if type(client).keeps_state and carried(message):
        reply.content = carry(reply.content, client.state)
    return reply


@app.query(keys.QUERY_ROSTER)
def roster(message: Message, context: Context) -> Message:
    """Report this client's partition id and data set size."""
    return NodeClient(message, context).describe()
