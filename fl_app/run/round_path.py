"""How a run's rounds run, and why: the engine's path, in ``run.log``'s header and ``results.json``.

Each part is reported from the rule that makes the choice:

* the train messages: one per client, *packed* (16 clients a message, :mod:`fl_app.engine.packed`)
  or *in bulk* (one message per worker, :mod:`fl_app.engine.bulk`): the round loop's packing rule
  (:func:`fl_app.run.round_loop.packing_refusal`) and the bulk rule (:func:`bulk_refusal`, which
  also gives the grid its bulk shares, ``fl_app.run.server.shares_for``);
* vectorised or not: ``simulation.vectorise`` (:attr:`fl_app.config.settings.SimulationSettings.vectorising`),
  unless the client class trains its own way (:func:`clients.base.own_local_training`);
* the backend and its workers, as the engine built them (:func:`fl_app.engine.workers.built_workers`).

It is a fact about the run, not about its data: it follows from the configuration, the algorithm's
classes and the machine, and is decided before the first round, so a run whose cohorts are secret
publishes it too. What varies by round is not reported: a round of a single client goes as its plain
message (there is nothing to pack), and a client class whose vectorised result goes unused is named
once in the log and trains one by one from then on.
"""

from __future__ import annotations

from dataclasses import dataclass
from logging import INFO
from typing import Any

from flwr.common import log

from fl_app.config.settings import RunSettings
from fl_app.engine.workers import Workers, built_workers
from fl_app.learning.sums import BLOCK
from fl_app.run.lifecycle import stop_requested
from fl_app.run.round_loop import packing_refusal

#: How the train messages go: one per client, packed, in bulk.
PER_CLIENT, PACKED, BULK = "per_client", "packed", "bulk"
#: Longest wait for the engine to build its workers (it does so while the ServerApp prepares).
WORKERS_WAIT_S = 60.0
#: The backend of a deployment: every client is a SuperNode.
DEVICES = "devices"


@dataclass(frozen=True)
class RoundPath:
    """How the run's rounds run: the messages and why, vectorised or not and why, backend, workers."""

    messages: str
    why: str
    vectorised: bool
    vectorised_why: str
    backend: str
    workers: int | None

    def text(self) -> str:
        """The header line's text (after ``dpfl: ``)."""
        messages = {
            PER_CLIENT: "one message per client",
            PACKED: f"packed, {BLOCK} clients a message",
            BULK: "in bulk, at most one message per worker",
        }[self.messages]
        vectorised = "vectorised" if self.vectorised else "not vectorised"
        return f"rounds: {messages} ({self.why}); {vectorised} ({self.vectorised_why}); {self.workers_text()}"

    def workers_text(self) -> str:
        """The backend and its workers in words."""
        if self.backend == DEVICES:
            return "each client on its device"
        workers = Workers(self.backend, self.workers).text() if self.workers is not None else "workers"
        return f"{workers} (simulation.backend={self.backend})"

    def as_dict(self) -> dict[str, Any]:
        """``results.json``'s ``engine``."""
        return {
            "messages": self.messages,
            "why": self.why,
            "vectorised": self.vectorised,
            "vectorised_why": self.vectorised_why,
            "backend": self.backend,
            "workers": self.workers,
        }


def bulk_refusal(settings: RunSettings, client_class: type) -> str | None:
    """Why a packed round of ``client_class``'s clients does not go in bulk, in words; None: it does."""
    from clients.fedavg import fedavg_difference  # torch: only where a run has begun

    simulation = settings.simulation
    if not simulation.sends_bulk:
        return "simulation.bulk=false" if simulation.packs_messages else "simulation.pack_messages=false"
    return fedavg_difference(client_class)


def round_path(
    strategy: Any, settings: RunSettings, client_class: type, *, simulated: bool, bulk_shares: int
) -> RoundPath:
    """The run's path: ``simulated`` (the in-memory grid of a simulation) or on devices.

    ``bulk_shares``: the grid's (the bulk messages a packed round goes as; 0: none). In a simulation
    this waits (bounded, :data:`WORKERS_WAIT_S`) for the engine to have built its workers.
    """
    from clients.base import own_local_training  # torch: only where a run has begun

    if not simulated:
        devices = "real devices: every client is a node of its own"
        return RoundPath(PER_CLIENT, devices, False, "each client trains on its device", DEVICES, None)
    messages, why = _messages(strategy, settings, client_class, bulk_shares)
    vectorised, vectorised_why = settings.simulation.vectorising
    own = own_local_training(client_class)
    if vectorised and own is not None:
        vectorised, vectorised_why = False, own
    workers = built_workers(WORKERS_WAIT_S, stop=lambda: stop_requested() is not None)
    backend = settings.simulation.backend if workers is None else workers.backend
    return RoundPath(
        messages, why, vectorised, vectorised_why, backend, None if workers is None else workers.count
    )


def _messages(strategy: Any, settings: RunSettings, client_class: type, bulk_shares: int) -> tuple[str, str]:
    """How a simulation's train messages go, and why."""
    refusal = packing_refusal(strategy)
    if refusal is not None:
        return PER_CLIENT, refusal
    if bulk_shares > 0:
        return BULK, f"{client_class.__name__} does exactly what FedAvg's client does"
    return PACKED, f"not in bulk: {bulk_refusal(settings, client_class)}"


def announce_round_path(path: RoundPath) -> dict[str, Any]:
    """Log the path (one header line); return ``results.json``'s ``engine``."""
    log(INFO, "dpfl: %s", path.text())
    return path.as_dict()
