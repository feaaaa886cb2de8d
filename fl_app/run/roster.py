"""The roster: which clients the federation has, in a reproducible order.

Simulated node ids are random on every run (``os.urandom``), so sampling node
ids with a seeded generator would not repeat. Before the first round the server
asks every node once (a ``query`` message) for its partition id (simulation) and
the size of its data set; clients are then ordered by partition id (by node id
on devices) and sampled by that order. The sizes serve NbAFL (m, the smallest
local data set) and KD-DP (grouping by size).

Under the deployment engine (``flwr run . <connection>``) every SuperNode is one
client: ``num_clients`` must equal the number of connected SuperNodes. The
server waits up to ``simulation.timeout`` seconds for missing ones and stops
at once when there are more. A device reports no partition id
(:attr:`ClientInfo.device`), which is how the server knows it runs on real
devices (see :func:`on_devices`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from logging import INFO

from flwr.app import ConfigRecord, Message, MessageType, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from fl_app import keys
from fl_app.run.lifecycle import RunFailed

ROSTER_POLL_S = 1.0
#: The first of those intervals, doubled up to :data:`ROSTER_POLL_S` (a simulation registers its
#: nodes within milliseconds: a whole second's wait was most of its roster time).
FIRST_POLL_S = 0.02
#: In a simulation the nodes are not devices that may never come: the engine registers them as it
#: starts, in a thread beside the ServerApp's. The roster waits for them at least this long, whatever
#: ``simulation.timeout`` (a deadline for the clients' replies) says: with a deadline of milliseconds
#: a loaded machine made the run fail with "0 SuperNodes connected" before the engine was up.
SIMULATED_REGISTRATION_S = 120.0


#: A simulation registers all its nodes at once as it starts: once their number has not changed for
#: this long, no more are coming (``flwr run`` with ``num-supernodes`` below ``num_clients`` waited an
#: hour, ``simulation.timeout``, for nodes that did not exist).
SIMULATED_SETTLE_S = 5.0


class RosterError(RunFailed):
    """The federation does not match the configuration (the run fails before its first round)."""


class _SimulatedCount:
    """Refuses, once it stopped changing, a simulation's node count below ``expected``."""

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.count, self.since = -1, time.monotonic()

    def check(self, count: int) -> None:
        now = time.monotonic()
        if count != self.count:
            self.count, self.since = count, now
        elif 0 < count < self.expected and now - self.since >= SIMULATED_SETTLE_S:
            raise RosterError(
                f"num_clients={self.expected}, but the simulation has {count} SuperNodes (num-supernodes="
                f"{count}); set num_clients={count}, or run flwr run with --federation-config "
                f"'num-supernodes={self.expected}'"
            )


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
    device : bool
        True for a real device (a SuperNode without a ``partition-id``: it
        loads its own data from ``node_config["data-path"]``).

    """

    client_id: int
    node_id: int
    num_examples: int
    device: bool = False


def on_devices(roster: list[ClientInfo]) -> bool:
    """Whether the federation has real devices (not simulated nodes)."""
    return any(info.device for info in roster)


def discover_roster(
    grid: Grid,
    *,
    expected: int,
    config: ConfigRecord,
    timeout: float,
    simulated: Callable[[], Mapping[int, tuple[int, int]] | None] | None = None,
) -> list[ClientInfo]:
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
        Seconds to wait for nodes to connect and to answer (in a simulation, the wait for the engine
        to register its nodes is at least :data:`SIMULATED_REGISTRATION_S`).
    simulated : callable, optional
        In a simulation: returns node id -> (partition id, data set size), known to the server (the
        engine numbered the nodes; the server holds the same split), or None before the engine has
        registered them all. Then no node is asked: at 10,000 nodes the queries took 7 s of
        start-up and grew with N. Used only once it names exactly the connected nodes (waited for
        up to :data:`SIMULATED_WAIT_S`; the nodes are queried otherwise).

    Raises
    ------
    RosterError
        When the federation has a different number of nodes (a simulation's: as soon as its number
        stops changing, :data:`SIMULATED_SETTLE_S`), or nodes fail.

    """
    nodes = _wait_for_nodes(grid, expected, timeout, simulated=simulated is not None)
    _check_not_too_many(nodes, expected)
    known = _simulated_nodes(simulated, nodes) if simulated is not None else None
    if known is not None:
        return _checked(_simulated_roster(known, nodes))
    replies = _query_roster(grid, nodes, config, timeout)
    roster = [_client_info(reply) for reply in replies]
    roster.sort(key=lambda info: info.client_id)
    return _checked(roster)


def _wait_for_nodes(grid: Grid, expected: int, timeout: float, *, simulated: bool) -> list[int]:
    """Poll the grid until ``expected`` nodes are connected; return their sorted node ids.

    Parameters
    ----------
    grid : Grid
        The run's grid.
    expected : int
        ``num_clients`` of the configuration.
    timeout : float
        Seconds to wait (in a simulation at least :data:`SIMULATED_REGISTRATION_S`).
    simulated : bool
        Whether the run is a simulation (its node count is also refused once it stops changing).

    Returns
    -------
    list[int]
        The connected nodes' ids, sorted (at least ``expected`` of them).

    Raises
    ------
    RosterError
        Fewer nodes at the deadline, or a simulation whose node count settled below ``expected``.

    """
    wait = timeout if not simulated else max(timeout, SIMULATED_REGISTRATION_S)
    deadline = time.monotonic() + wait
    reported = -1
    poll = FIRST_POLL_S
    registered = _SimulatedCount(expected) if simulated else None
    while len(nodes := sorted(grid.get_node_ids())) < expected:
        if registered is not None:
            registered.check(len(nodes))
        if time.monotonic() > deadline:
            raise RosterError(
                f"num_clients={expected}, but only {len(nodes)} SuperNodes connected within "
                f"{wait:.0f} s (simulation.timeout); start the missing SuperNodes or set "
                f"num_clients={len(nodes)}"
            )
        # said only once the wait is noticeable: a simulation's nodes are all there within milliseconds
        if len(nodes) != reported and poll >= ROSTER_POLL_S:
            _log_waiting(len(nodes), expected, deadline)
            reported = len(nodes)
        time.sleep(poll)
        poll = min(2 * poll, ROSTER_POLL_S)
    return nodes


def _log_waiting(connected: int, expected: int, deadline: float) -> None:
    """Log how many nodes are connected and how long the roster still waits.

    Parameters
    ----------
    connected, expected : int
        Nodes connected now, and ``num_clients``.
    deadline : float
        ``time.monotonic()`` at which the wait gives up.

    """
    log(
        INFO,
        "Waiting for SuperNodes: %d of %d (num_clients) connected; giving up in %.0f s",
        connected,
        expected,
        deadline - time.monotonic(),
    )


def _check_not_too_many(nodes: list[int], expected: int) -> None:
    """Refuse a federation with more nodes than ``num_clients``.

    Parameters
    ----------
    nodes : list[int]
        The connected nodes' ids.
    expected : int
        ``num_clients`` of the configuration.

    Raises
    ------
    RosterError
        More than ``expected`` nodes.

    """
    if len(nodes) > expected:
        raise RosterError(
            f"num_clients={expected}, but the federation has {len(nodes)} SuperNodes; set "
            f"num_clients={len(nodes)}, or stop SuperNodes (deployment) or set num-supernodes "
            f"(simulation) to {expected}"
        )


def _simulated_roster(known: Mapping[int, tuple[int, int]], nodes: list[int]) -> list[ClientInfo]:
    """The simulated clients, from the engine's numbering, ordered by partition id.

    Parameters
    ----------
    known : Mapping[int, tuple[int, int]]
        Node id -> (partition id, data set size), naming exactly ``nodes``.
    nodes : list[int]
        The connected nodes' ids, sorted.

    Returns
    -------
    list[ClientInfo]
        One per node, sorted by client id (the partition id).

    """
    roster = [ClientInfo(known[node][0], node, known[node][1]) for node in nodes]
    return sorted(roster, key=lambda info: info.client_id)


def _query_roster(grid: Grid, nodes: list[int], config: ConfigRecord, timeout: float) -> list[Message]:
    """Ask every node for its identity (a roster ``query`` message); return the replies.

    Parameters
    ----------
    grid : Grid
        The run's grid.
    nodes : list[int]
        The nodes to ask.
    config : ConfigRecord
        Sent with the query.
    timeout : float
        Seconds to wait for the replies.

    Returns
    -------
    list[Message]
        One reply per node, none of them an error.

    Raises
    ------
    RosterError
        When a node answers with an error or does not answer in time.

    """
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
    return replies


def _client_info(reply: Message) -> ClientInfo:
    """One client, from its reply to the roster query.

    Parameters
    ----------
    reply : Message
        The node's reply: its partition id (negative on a device) and data set size.

    Returns
    -------
    ClientInfo
        Identified by the partition id, or by the node id on a device.

    """
    metrics = reply.content.metric_records[keys.METRICS]
    partition = int(metrics[keys.PARTITION_ID])
    node = int(reply.metadata.src_node_id)
    return ClientInfo(
        partition if partition >= 0 else node,
        node,
        int(metrics[keys.NUM_EXAMPLES]),
        device=partition < 0,
    )


#: Longest wait for the simulation engine's node numbering once all nodes are connected (it is
#: recorded right after the last node is registered).
SIMULATED_WAIT_S = 10.0


def _simulated_nodes(
    simulated: Callable[[], Mapping[int, tuple[int, int]] | None], nodes: list[int]
) -> Mapping[int, tuple[int, int]] | None:
    """``simulated()`` once it names exactly ``nodes`` (None if it does not within the wait)."""
    deadline = time.monotonic() + SIMULATED_WAIT_S
    while True:
        known = simulated()
        if known is not None and set(known) == set(nodes):
            return known
        if time.monotonic() > deadline:
            return None
        time.sleep(FIRST_POLL_S)


def _checked(roster: list[ClientInfo]) -> list[ClientInfo]:
    """The roster, once its client ids are known to be distinct (and logged)."""
    if len({info.client_id for info in roster}) != len(roster):
        raise RosterError("two clients reported the same partition id")
    log(
        INFO,
        "Roster: %d %s, local data sizes %d..%d",
        len(roster),
        "devices" if on_devices(roster) else "simulated clients",
        min(i.num_examples for i in roster),
        max(i.num_examples for i in roster),
    )
    return roster
