"""Sweep launchers on a two-node Ray cluster: 8 small jobs, sequential and parallel (docs/deploy.md).

Usage::

    python benchmarks/parallel_sweep.py [--out /tmp/bench_sweep]

Runs the same 8 jobs (digits, 6 clients, 3 per round, 3 rounds, seeds 1-8) four times and prints
one JSON line per sweep (wall time, number of results, final accuracy per job):

1. ``sequential``: Hydra's basic launcher, a private Ray instance per job (``simulation.num_cpus=2``);
2. ``parallel_cluster``: the joblib launcher, 2 jobs at a time, every job joining a two-node cluster
   (``ray.cluster_utils.Cluster``, one CPU per node, both on this machine);
3. ``parallel_cluster_shared``: as 2, each job limited to one client actor
   (``simulation.max_concurrent_clients=1``), so the two jobs share the two CPUs instead of queueing;
4. ``sequential_cluster``: the basic launcher on the same cluster.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOBS = [
    "dataset=digits",
    "num_clients=6",
    "clients_per_round=3",
    "num_rounds=3",
    "batch_size=16",
    "lr=0.2",
    "local_epochs=1",
    "seed=1,2,3,4,5,6,7,8",
]


def sweep(out: Path, name: str, extra: list[str]) -> dict[str, object]:
    """Run the 8 jobs with ``extra`` overrides; return wall time and results."""
    directory = out / name
    started = time.time()
    process = subprocess.run(
        [sys.executable, "-m", "fl_app", "-m", *JOBS, *extra, f"hydra.sweep.dir={directory}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    results = [json.loads(f.read_text()) for f in sorted(directory.glob("*/results.json"))]
    summary = {
        "name": name,
        "returncode": process.returncode,
        "wall_s": round(time.time() - started, 1),
        "results": len(results),
        "accuracies": [r["final"]["accuracy"] for r in results],
    }
    print(json.dumps(summary), flush=True)
    return summary


def main() -> None:
    """Run the three sweeps."""
    from ray.cluster_utils import Cluster

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("/tmp/bench_sweep"))
    args = parser.parse_args()
    sweep(args.out, "sequential", ["simulation.num_cpus=2"])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        address = f"simulation.ray_address={cluster.address}"
        parallel = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2", address]
        sweep(args.out, "parallel_cluster", parallel)
        sweep(args.out, "parallel_cluster_shared", [*parallel, "simulation.max_concurrent_clients=1"])
        sweep(args.out, "sequential_cluster", [address])
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
