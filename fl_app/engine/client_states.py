"""Each stateful client's records between rounds, kept by the engine of a simulation, by client id.

A client class that declares ``keeps_state`` (:class:`clients.base.FederatedClient`) reads and writes
its :attr:`~clients.base.FederatedClient.state`. On a device that is the node's ``context.state``,
which the SuperNode keeps. In a simulation a node's Context would not do: a packed message runs its
members with fresh Contexts, a resumed run has new node ids, and nothing of the engine's is in the
checkpoint. So the simulation's grid keeps every stateful client's records here, keyed by client id
(:class:`ClientStates`): it carries a client's records in the message it sends the client
(:func:`carry`, records named :data:`PREFIX` + name, and the :data:`CARRIED` marker) and takes the
records the client kept back out of its reply (:meth:`ClientStates.take_from`) before the strategy or
the metering sees it; the checkpoint holds them, so ``resume=`` continues exactly.

Privacy: the records never reach the strategy; they sit in the simulation's server process, as the
clients' data does, and in the server's private checkpoint file (:mod:`fl_app.run.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict

#: Name prefix of a carried state record in a message or reply (``client-state:<name>``).
PREFIX = "client-state:"
#: The ConfigRecord that marks a message whose client's state travels with it.
CARRIED = "client-state"
#: In a packed message's reply, the marker's list of the members whose state it reports.
REPORTED = "clients"


def carried(message: Message) -> bool:
    """Whether the engine carries the receiving client's state in ``message``."""
    return message.has_content() and CARRIED in message.content


def state_of(message: Message, context: Context) -> RecordDict:
    """The client's state: the records carried in ``message`` (a simulation), else ``context.state``."""
    if not carried(message):
        return context.state
    return RecordDict(
        {name[len(PREFIX) :]: record for name, record in message.content.items() if name.startswith(PREFIX)}
    )


def carry(content: RecordDict, records: Mapping[str, Any]) -> RecordDict:
    """``content`` and a client's state ``records`` (the marker too): a message's content of its own."""
    out = RecordDict(dict(content.items()))
    for name, record in records.items():
        out[f"{PREFIX}{name}"] = record
    out[CARRIED] = ConfigRecord()
    return out


def take_records(content: RecordDict, *, prefix: str = PREFIX) -> dict[str, Any]:
    """Remove the records named ``prefix`` + name from ``content``; return them by name."""
    names = [name for name in content if name.startswith(prefix)]
    return {name[len(prefix) :]: content.pop(name) for name in names}


class ClientStates:
    """The stateful clients' records, by client id (the simulation's grid keeps it; see the module doc)."""

    def __init__(self) -> None:
        self.records: dict[int, dict[str, Any]] = {}

    def of(self, client_id: int) -> dict[str, Any]:
        """The records client ``client_id`` kept (empty before its first round)."""
        return self.records.get(int(client_id), {})

    def keep(self, client_id: int, records: Mapping[str, Any]) -> None:
        """Replace client ``client_id``'s records by ``records``."""
        self.records[int(client_id)] = dict(records)

    def take_from(self, reply: Message, client_id: int) -> None:
        """Move the state records of a reply of ``client_id`` into the store (a failure keeps the old)."""
        if reply.has_error() or not reply.has_content():
            return
        if CARRIED in reply.content:
            reply.content.pop(CARRIED)
            self.keep(client_id, take_records(reply.content))

    def take_packed(self, reply: Message) -> None:
        """Move the records a packed message's reply carries for its members (``<client>:<name>``)."""
        if reply.has_error() or not reply.has_content() or CARRIED not in reply.content:
            return
        marker = reply.content.pop(CARRIED)
        by_client: dict[int, dict[str, Any]] = {int(c): {} for c in marker.get(REPORTED, [])}  # type: ignore[union-attr]
        for key, record in take_records(reply.content).items():
            client, _, name = key.partition(":")
            by_client.setdefault(int(client), {})[name] = record
        for client, records in by_client.items():
            self.keep(client, records)

    def clients(self) -> Iterable[int]:
        """The client ids that kept something."""
        return self.records.keys()
