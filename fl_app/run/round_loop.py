"""The round loop: Flower's ``Strategy.start`` with a first round, stop checks and a per-round hook.

The same calls in the same order as ``flwr.serverapp.strategy.Strategy.start`` (configure and
aggregate training, configure and aggregate federated evaluation, central evaluation) on dpfl's
strategy contract (:class:`strategies.contract.Strategy`); a Flower strategy object runs through
the ``flower`` adapter (:mod:`strategies.flower`). In addition the loop can begin after a checkpoint
(``first_round``), stops between rounds when a stop was requested
(:func:`fl_app.run.lifecycle.raise_if_stopped`; the grid also checks while it waits), calls
``after_round`` (evaluate, record, check health, checkpoint) after each round, and hands the grid the
strategy's summand when the round may be packed (:func:`packing_summand`, :mod:`fl_app.engine.packed`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord

from fl_app.run.lifecycle import RunFailed, raise_if_stopped

#: Failure reasons that mean the simulation lost a worker process, not that a client's code failed.
WORKER_LOST_MARKERS = (
    "ActorDiedError",
    "RayActorError",
    "ActorUnavailableError",
    "WorkerCrashedError",
    "The actor is dead",
    "ClientWorkerDiedError",  # a forked client process (simulation.backend=processes)
)


def run_rounds(
    strategy: Any,
    grid: Any,
    arrays: ArrayRecord,
    *,
    first_round: int,
    num_rounds: int,
    timeout: float,
    after_round: Callable[[int, ArrayRecord], Any],
) -> ArrayRecord:
    """Run rounds ``first_round..num_rounds``; return the last global model."""
    for server_round in range(first_round, num_rounds + 1):
        raise_if_stopped()
        messages = strategy.configure_train(server_round, arrays, ConfigRecord(), grid)
        summand = packing_summand(strategy, server_round)
        if summand is None:
            replies = grid.send_and_receive(messages, timeout=timeout)
        else:  # a dpfl grid: it may pack the round's messages (fl_app.engine.packed)
            replies = grid.send_and_receive(messages, timeout=timeout, summand=summand)
        aggregated, _ = strategy.aggregate_train(server_round, replies)
        if aggregated is not None:
            arrays = aggregated
        replies = grid.send_and_receive(
            strategy.configure_evaluate(server_round, arrays, ConfigRecord(), grid), timeout=timeout
        )
        strategy.aggregate_evaluate(server_round, replies)
        after_round(server_round, arrays)
    return arrays


def _worker_kind(reasons: list[str]) -> str:
    """What the lost worker was: a forked client process or a Ray actor."""
    forked = any("ClientWorkerDiedError" in reason for reason in reasons)
    return "client process" if forked else "Ray actor"


def packing_summand(strategy: Any, server_round: int) -> Any:
    """The summand the grid may pack this round with: the strategy's declared sum, where it is safe.

    The strategy's :meth:`~strategies.base.FederatedStrategy.summand`, when the run allows packing
    (``simulation.pack_messages``) and the sum is what the strategy aggregates
    (:func:`aggregates_its_sum`); None otherwise (plain messages; an evaluation stage, a Flower strategy).
    """
    return None if packing_refusal(strategy) is not None else strategy.summand(server_round)


def packing_refusal(strategy: Any) -> str | None:
    """Why ``strategy``'s rounds go as one message per client, in words; None: they may be packed.

    The rule :func:`packing_summand` applies; the run's header reports it (:mod:`fl_app.run.round_path`).
    """
    name = type(strategy).__name__
    run = getattr(strategy, "run", None)
    if getattr(strategy, "summand", None) is None or run is None:
        return f"{name} declares no sum of per-client terms: it reads every reply"
    if not run.settings.simulation.packs_messages:
        return "simulation.pack_messages=false"
    if not aggregates_its_sum(type(strategy)):
        return f"{name} reads every reply: its aggregation is not a sum of per-client terms it declares"
    return None


def aggregates_its_sum(cls: type) -> bool:
    """Whether ``cls`` declares its ``summand`` at or below every class that defines how it aggregates.

    A subclass that changes ``aggregate`` (or ``aggregate_train``) but inherits its parent's summand
    may read more of a reply than the parent's sum holds, so its rounds are never packed; one that
    declares its own summand says that the sum is still all it reads.
    """

    def owner(name: str) -> type | None:
        return next((c for c in cls.__mro__ if name in vars(c)), None)

    declared = owner("summand")
    if declared is None:
        return False
    return all(
        definer is None or issubclass(declared, definer)
        for definer in (owner("aggregate"), owner("aggregate_train"))
    )


def check_round(
    server_round: int,
    *,
    clients: int,
    failures: int,
    reasons: list[str],
    max_failure_fraction: float,
    secret_cohort: bool = False,
) -> None:
    """Stop the run (:class:`RunFailed`) when a round went wrong beyond what a run may absorb.

    A lost simulation worker stops the run at once (the engine does not replace it: every
    later round would silently run with less capacity and more failures); a round in which
    no client replied, or more than ``max_failure_fraction`` of the cohort failed, too. With a
    ``secret_cohort`` the message names no count and no error text (both would tell about it).
    """
    if any(marker in reason for reason in reasons for marker in WORKER_LOST_MARKERS):
        raise RunFailed(
            f"round {server_round}: a simulation worker ({_worker_kind(reasons)}) died; the engine does "
            "not replace it, so the run stops (memory? see run.log)"
        )
    if secret_cohort:
        if clients and failures >= clients:
            raise RunFailed(f"round {server_round}: no client of the (secret) cohort replied")
        if clients and failures / clients > max_failure_fraction:
            raise RunFailed(
                f"round {server_round}: more than simulation.max_failure_fraction={max_failure_fraction:g} "
                "of the (secret) cohort failed"
            )
        return
    if clients and failures >= clients:
        raise RunFailed(f"round {server_round}: none of the {clients} clients replied ({_first(reasons)})")
    if clients and failures / clients > max_failure_fraction:
        raise RunFailed(
            f"round {server_round}: {failures} of {clients} clients failed, more than "
            f"simulation.max_failure_fraction={max_failure_fraction:g} ({_first(reasons)})"
        )


def _first(reasons: list[str]) -> str:
    if not reasons:
        return "no reply in time"
    lines = reasons[0].strip().splitlines() or ["?"]
    return f"first error: {lines[-1][:160]}"
