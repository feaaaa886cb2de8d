"""SecAgg+ masks from the whole key: the generator's cost, and the distributed arm before/after.

Usage (from the repository root)::

    .venv/bin/python -P benchmarks/secagg_masks.py generator [--dim 131072] [--repeats 50]
    git worktree add /tmp/before <commit>   # the code before the change
    .venv/bin/python -P benchmarks/secagg_masks.py round --tree /tmp/before [--rounds 20] [--pairs 2]
    .venv/bin/python -P benchmarks/secagg_masks.py protocol --tree /tmp/before [--rounds 3] [--pairs 3]

``generator`` times one mask of ``dim`` coordinates mod 2^16 from Flower's ``pseudo_rand_gen`` (numpy's
``RandomState`` seeded with 32 bits) and from dpfl's :func:`fl_app.privacy.masks.mask_arrays`
(HKDF-SHA256 + ChaCha20), interleaved, in this process.

``round`` runs the distributed arm of the cross-device comparison (Fashion-MNIST, Dirichlet(0.5),
N = 1000, 100 per round, the MLP, 5 local epochs, 16 bits, epsilon 8, seed 1) for ``--rounds``
rounds, alternately from ``--tree`` (before) and from this checkout (after), ``--pairs`` times, one
job at a time, and prints each job's median round time (rounds 2..R), final accuracy and epsilon.
Each job's own code: the command runs with the tree as its working directory and first on
``PYTHONPATH`` (Ray's workers inherit it).

``protocol`` runs the same round in one process, without Ray: the strategy's four SecAgg+ stages and
every client's real ClientApp called in turn (1 local epoch, so that the protocol weighs more), and
prints the CPU time of each round (``time.process_time`` with one torch/BLAS thread: what this process
spent, whatever else the machine runs), before and after, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPE = [
    "strategy=dp_fedavg_secagg",
    "strategy.bits=16",
    "num_clients=1000",
    "clients_per_round=100",
    "local_epochs=5",
    "dataset=fashion_mnist",
    "partition=dirichlet",
    "model=mlp",
    "privacy.epsilon=8",
    "seed=1",
]


def generator(args: argparse.Namespace) -> None:
    """Flower's generator against dpfl's, interleaved."""
    sys.path.insert(0, str(ROOT))
    from fl_app.engine.secagg import flower_mask_arrays
    from fl_app.privacy.masks import mask_arrays

    secret, shapes = bytes(range(44)), [(args.dim,)]
    times: dict[str, list[float]] = {"flower": [], "dpfl": []}
    for _ in range(args.repeats):
        for name, function in (("flower", flower_mask_arrays), ("dpfl", mask_arrays)):
            start = time.perf_counter()
            function(secret, 1 << 16, shapes)
            times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        print(f"{name}: median {statistics.median(values) * 1e3:.3f} ms per mask of {args.dim} coordinates")


def one_job(tree: Path, label: str, rounds: int, jobs: Path) -> dict[str, object]:
    """One run from ``tree``; what its results say."""
    folder = jobs / f"{label}-{time.strftime('%H%M%S')}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "fl_app", *SHAPE, f"num_rounds={rounds}", f"output_dir={folder}"]
    start = time.perf_counter()
    subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, timeout=4 * 3600, check=True)
    results = json.loads((folder / "results.json").read_text())
    times = [r["round_s"] for r in results["rounds"][1:]]
    return {
        "code": label,
        "median_round_s": round(statistics.median(times), 3),
        "accuracy": results["final"]["accuracy"],
        "epsilon": results["final"]["epsilon"],
        "outcomes": sorted({r["secure_aggregation"] for r in results["rounds"]}),
        "wall_s": round(time.perf_counter() - start, 1),
    }


def round_time(args: argparse.Namespace) -> None:
    """Before and after, interleaved."""
    jobs = Path(args.jobs)
    jobs.mkdir(parents=True, exist_ok=True)
    for _ in range(args.pairs):
        for tree, label in ((Path(args.tree), "before"), (ROOT, "after")):
            print(json.dumps(one_job(tree, label, args.rounds, jobs)), flush=True)


#: One process: the strategy and every client's ClientApp, ``rounds`` rounds; CPU seconds per round.
PROTOCOL = """
import json, sys, tempfile, time
from pathlib import Path
from flwr.app import ConfigRecord, Context, RecordDict
from fl_app.client_app import train
from fl_app.engine.messages import task_identity
from fl_app.run.harness import run_context_for
from strategies import STRATEGIES

overrides, rounds = json.loads(sys.argv[1]), int(sys.argv[2])
run = run_context_for(overrides, Path(tempfile.mkdtemp()))
strategy = STRATEGIES.get("dp_fedavg_secagg")(run)
contexts = {}

class Grid:
    def send_and_receive(self, messages, timeout=None):
        replies = []
        for message in messages:
            node = int(message.metadata.dst_node_id)
            context = contexts.setdefault(node, Context(
                run_id=1, node_id=node, state=RecordDict(), run_config={},
                node_config={"partition-id": node - 1000, "num-partitions": len(run.roster)}))
            replies.append(train(message, context))
        return replies

arrays, grid, times = strategy.initial_arrays(), Grid(), []
identity = task_identity(run_id=1)
identity.__enter__()
for t in range(1, rounds + 1):
    start = time.process_time()
    replies = grid.send_and_receive(list(strategy.configure_train(t, arrays, ConfigRecord(), grid)))
    new, _ = strategy.aggregate_train(t, replies)
    times.append(time.process_time() - start)
    arrays = new or arrays
print(json.dumps(times))
"""


def protocol(args: argparse.Namespace) -> None:
    """CPU time of in-process rounds, before and after, interleaved."""
    overrides = [*SHAPE, "local_epochs=1", f"num_rounds={max(args.rounds, 10)}"]
    overrides = [o for o in overrides if o != "local_epochs=5"]
    for _ in range(args.pairs):
        for tree, label in ((Path(args.tree), "before"), (ROOT, "after")):
            env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
            command = [sys.executable, "-c", PROTOCOL, json.dumps(overrides), str(args.rounds)]
            done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=False)
            if done.returncode:
                raise SystemExit(f"{label}: {done.stderr.strip()[-2000:]}")
            times = json.loads(done.stdout.strip().splitlines()[-1])
            print(json.dumps({"code": label, "cpu_s_per_round": [round(t, 2) for t in times]}), flush=True)


def main() -> None:
    """Parse the command line and run the chosen measurement."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["generator", "round", "protocol"])
    parser.add_argument("--dim", type=int, default=131072)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--tree", default="/tmp/before")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--jobs", default=str(ROOT / "multirun" / "secagg_masks"))
    args = parser.parse_args()
    {"generator": generator, "round": round_time, "protocol": protocol}[args.command](args)


if __name__ == "__main__":
    main()
