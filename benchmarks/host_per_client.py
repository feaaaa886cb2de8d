r"""The engine's own work per client and round: a round's time minus its training, over its clients.

Runs ``python -m fl_app``'s simulation in this process (``simulation.backend=inline``: the clients run
here, so one clock sees the whole round) and times, inside every round, the local training itself:
each call of :func:`fl_app.learning.training.train_local` (a client trained on its own) and of
:func:`fl_app.engine.vectorised_training.train_vectorised` (a batch of clients trained as one
computation), and the central evaluation (:meth:`fl_app.run.reporter.RoundReporter.evaluate`). The host work
per client is, over rounds 2..R (round 1 pays the imports and the first allocations)::

    (sum of round_s - training - evaluation) / (clients per round * rounds)

``--model logreg`` makes the training negligible, so the figure is the engine's: messages, clients,
data look-ups, generators, sums. Every arm runs interleaved ``--repeats`` times; a line of JSON per run
and a table at the end::

    python -P benchmarks/host_per_client.py [--clients 1000] [--population 10000] [--rounds 6] \\
        [--repeats 3] [--arms packed,plain,...] [--model logreg] [-- extra overrides]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

#: Arm -> the overrides that make it.
ARMS: dict[str, tuple[str, ...]] = {
    "plain": ("simulation.pack_messages=false", "simulation.vectorise=false"),
    "packed": ("simulation.pack_messages=true", "simulation.bulk=false", "simulation.vectorise=false"),
    "packed-vectorised": (
        "simulation.pack_messages=true",
        "simulation.bulk=false",
        "simulation.vectorise=true",
    ),
    "bulk": ("simulation.pack_messages=true", "simulation.bulk=true", "simulation.vectorise=false"),
    "bulk-vectorised": ("simulation.pack_messages=true", "simulation.bulk=true", "simulation.vectorise=true"),
}


class Clock:
    """Seconds spent inside the wrapped functions, by category."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {"training": 0.0, "evaluation": 0.0}

    def wrap(self, function: Callable[..., Any], category: str) -> Callable[..., Any]:
        """``function``, its time added to ``category`` (nested calls are not counted twice)."""
        depth = [0]

        def timed(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    self.seconds[category] += time.perf_counter() - started

        return timed


@contextmanager
def timed_training(clock: Clock) -> Iterator[None]:
    """Wrap the training and evaluation functions everywhere they were imported by name."""
    import clients.base
    from fl_app.engine import bulk_training, vectorised, vectorised_training
    from fl_app.learning import training
    from fl_app.run import reporter

    patches = [
        (training, "train_local", "training"),
        (clients.base, "train_local", "training"),
        (vectorised_training, "train_vectorised", "training"),
        (vectorised, "train_vectorised", "training"),
        (bulk_training, "train_vectorised", "training"),
        (bulk_training, "train_local", "training"),
        (reporter.RoundReporter, "evaluate", "evaluation"),  # the server's evaluation of the round
    ]
    saved = []
    for module, name, category in patches:
        if hasattr(module, name):
            saved.append((module, name, getattr(module, name)))
            setattr(module, name, clock.wrap(getattr(module, name), category))
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def one_run(overrides: list[str], clients: int) -> dict[str, float]:
    """One simulation; the host work per client and its parts (rounds 2..R)."""
    from fl_app.api import run_experiment

    clock = Clock()
    marks: list[dict[str, float]] = []

    with tempfile.TemporaryDirectory() as folder, timed_training(clock):
        import fl_app.run.reporter as reporter

        original = reporter.RoundReporter.record

        def marking(self: Any, server_round: int, *args: Any, **kwargs: Any) -> Any:
            # the round's clock stops inside ``record``, after its training and evaluation
            marks.append({"round": server_round, **clock.seconds})
            return original(self, server_round, *args, **kwargs)

        reporter.RoundReporter.record = marking  # type: ignore[method-assign]
        try:
            results = run_experiment(*overrides, output_dir=Path(folder) / "run")
        finally:
            reporter.RoundReporter.record = original  # type: ignore[method-assign]
    rounds = results["rounds"][1:]
    begin, end = marks[0], marks[-1]  # the clocks as rounds 1 and R stopped
    training = end["training"] - begin["training"]
    evaluation = end["evaluation"] - begin["evaluation"]
    total = sum(float(r["round_s"]) for r in rounds)
    host = total - training - evaluation
    return {
        "round_s": statistics.median(float(r["round_s"]) for r in rounds),
        "training_s_per_round": training / len(rounds),
        "host_us_per_client": 1e6 * host / (clients * len(rounds)),
        "final_accuracy": float(results["final"]["accuracy"]),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the arms interleaved; print a JSON line per run and the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--population", type=int, default=10000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="logreg")
    parser.add_argument("--arms", default="plain,packed,bulk,bulk-vectorised")
    parser.add_argument("extra", nargs="*", help="more overrides (after --)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    common = [
        "strategy=fedavg",
        "dataset=fashion_mnist",
        "partition=iid",
        f"num_clients={args.population}",
        f"clients_per_round={args.clients}",
        f"num_rounds={args.rounds}",
        f"model={args.model}",
        "local_epochs=1",
        "batch_size=32",
        "lr=0.1",
        "evaluation.test_subset=2000",
        "simulation.backend=inline",
        *args.extra,
    ]
    rows: dict[str, list[dict[str, float]]] = {}
    for repeat in range(args.repeats):
        for arm in args.arms.split(","):
            row = one_run([*common, *ARMS[arm]], args.clients)
            rows.setdefault(arm, []).append(row)
            print(json.dumps({"arm": arm, "repeat": repeat, **row}), flush=True)
    print("\n| arm | round (s, median) | training per round (s) | host work per client (us) |")
    print("|---|---|---|---|")
    for arm, runs in rows.items():
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        host = ", ".join(f"{run['host_us_per_client']:.0f}" for run in runs)
        print(
            f"| {arm} | {median['round_s']:.3f} | {median['training_s_per_round']:.3f} | "
            f"{median['host_us_per_client']:.0f} ({host}) |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
