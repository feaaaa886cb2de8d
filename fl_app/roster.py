"""The roster: which clients the federation has, in a reproducible order.

Simulated node ids are random on every run (``os.urandom``), so sampling node
ids with a seeded generator would not repeat. Before the first round the server
asks every node once (a ``query`` message) for its partition id (simulation) and
the size of its data set; clients are then ordered by partition id (by node id
on devices) and sampled by that order. The sizes serve NbAFL (m, the smallest
local data set) and KD-DP (grouping by size).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from logging import INFO

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.serverapp import Grid
from flwr.supercore import log

from fl_app import keys

ROSTER_POLL_S = 1.0


class RosterError(RuntimeError):
    """The federation does not match the configuration."""


@dataclass(frozen=True)
class ClientInfo:
    """One client of the federation.

    Attributes
    ----------
    client_id : int
        Stable id used for sampling and accounting (partition id in simulation,
        node id on devices).
    node_id : int
        Flower node id to address messages to.
    num_examples : int
        Size of the client's local training set.

    """

    client_id: int
    node_id: int
    num_examples: int


def discover_roster(grid: Grid, *, expected: int, config: ConfigRecord, timeout: float) -> list[ClientInfo]:
    """Wait for ``expected`` nodes, ask each for its identity, return them ordered.

    Parameters
    ----------
    grid : Grid
        The run's grid.
    expected : int
        ``num_clients`` of the configuration.
    config : ConfigRecord
        Sent with the query (carries the data spec simulated clients need).
    timeout : float
        Seconds to wait for nodes to connect and to answer.

    Raises
    ------
    RosterError
        When the federation has a different number of nodes, or nodes fail.

    """
    deadline = time.monotonic() + timeout
    while len(nodes := sorted(grid.get_node_ids())) < expected:
        if time.monotonic() > deadline:
            raise RosterError(
                f"num_clients={expected}: only {len(nodes)} SuperNodes connected within {timeout:.0f} s"
            )
        log(INFO, "Waiting for SuperNodes: %d of %d connected", len(nodes), expected)
        time.sleep(ROSTER_POLL_S)
    if len(nodes) > expected:
        raise RosterError(
            f"num_clients={expected}, but the federation has {len(nodes)} SuperNodes; set "
            f"num_clients={len(nodes)} or resize the federation (num-supernodes)"
        )
    queries = [
        Message(
            content=RecordDict({keys.CONFIG: config}),
            dst_node_id=node,
            message_type=f"{MessageType.QUERY}.{keys.QUERY_ROSTER}",
        )
        for node in nodes
    ]
    replies = list(grid.send_and_receive(queries, timeout=timeout))
    failed = [r for r in replies if r.has_error()]
    if failed or len(replies) != len(nodes):
        reasons = "; ".join(sorted({r.error.reason.strip().splitlines()[-1] for r in failed}))[:500]
        raise RosterError(
            f"{len(failed) + len(nodes) - len(replies)} of {len(nodes)} clients did not answer the "
            f"roster query: {reasons or 'timeout'}"
        )
    roster = []
    for reply in replies:
        metrics = reply.content.metric_records[keys.METRICS]
        partition = int(metrics[keys.PARTITION_ID])
        node = int(reply.metadata.src_node_id)
        roster.append(
            ClientInfo(partition if partition >= 0 else node, node, int(metrics[keys.NUM_EXAMPLES]))
        )
    roster.sort(key=lambda info: info.client_id)
    if len({info.client_id for info in roster}) != len(roster):
        raise RosterError("two clients reported the same partition id")
    log(
        INFO,
        "Roster: %d clients, local data sizes %d..%d",
        len(roster),
        min(i.num_examples for i in roster),
        max(i.num_examples for i in roster),
    )
    return roster
