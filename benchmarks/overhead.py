"""Platform overhead benchmark: Flower + Ray round time vs plain PyTorch, start-up time, peak memory.

Usage::

    python benchmarks/overhead.py measure [--clients 100 1000] [--rounds 8] [--out DIR]
    python benchmarks/overhead.py section --main-job DIR --overhead DIR [--write docs/benchmarks/platform.md]

``section`` writes the BENCHMARKS.md section from the files of the runs (the main job's
``results.json`` and ``summary.json`` of ``measure``) and the FedAvg curve figure.

For each federation size N it

1. launches ``python -m fl_app strategy=fedavg num_clients=N ...`` (FedAvg on Fashion-MNIST, Dirichlet
   0.5, 10 clients per round, ``simulation.client_cpus=1``) and samples, every 0.25 s, the proportional
   set size (PSS, shared pages counted once) of the launched process and all its descendants (driver,
   Ray's GCS and raylet, workers): the peak of that sum is the run's peak memory;
2. reads the start-up time (launch until round 1 starts, from the run log) and the steady-state round
   time (median ``round_s`` of rounds 3..R from ``results.json``);
3. replays, in this one plain process (no Flower, no Ray), exactly the same rounds: the same clients'
   partitions, the same local training (epochs, batch size, learning rate), the same weighted averaging and
   the same test evaluation, back to back, and takes the median time of rounds 3..R.

The ratio simulation/plain is what Flower and Ray add per round. All numbers of one invocation come from
the same machine in the same minutes; compare them as ratios. Prints a Markdown table and writes
``summary.json`` into ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import psutil
import torch

import fl_app  # noqa: F401  (process set-up)
from fl_app.config import compose_config
from fl_app.data.federated import DataSpec, federated_data
from fl_app.models import ModelSpec, resolve_model_name
from fl_app.privacy.rng import RandomSource
from fl_app.training import evaluate, load_arrays, model_to_arrays, train_local

COMMON = [
    "strategy=fedavg",
    "dataset=fashion_mnist",
    "partition=dirichlet",
    "clients_per_round=10",
    "simulation.client_cpus=1",
]


def tree_pss(root: psutil.Process) -> int:
    """Sum of PSS (bytes) of ``root`` and all its descendants."""
    total = 0
    for process in [root, *root.children(recursive=True)]:
        try:
            total += process.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


def run_simulation(clients: int, rounds: int, out: Path) -> dict[str, float]:
    """Launch one simulation, sample its memory, return start-up, round time and peak memory."""
    run_dir = out / f"sim_{clients}"
    command = [
        sys.executable,
        "-m",
        "fl_app",
        *COMMON,
        f"num_clients={clients}",
        f"num_rounds={rounds}",
        f"hydra.run.dir={run_dir}",
    ]
    launched = time.time()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    root = psutil.Process(process.pid)
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            try:
                peak = max(peak, tree_pss(root))
            except psutil.NoSuchProcess:
                return
            stop.wait(0.25)

    sampler = threading.Thread(target=sample)
    sampler.start()
    process.wait()
    stop.set()
    sampler.join()
    if process.returncode != 0:
        raise RuntimeError(f"simulation failed: {' '.join(command)}")
    results = json.loads((run_dir / "results.json").read_text())
    log = (run_dir / "run.log").read_text()
    first_round = re.search(r"^(\S+ \S+) INFO \[ROUND 1/", log, flags=re.M)
    assert first_round is not None
    round_one = datetime.strptime(first_round.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    round_times = [r["round_s"] for r in results["rounds"][2:]]
    return {
        "startup_s": round_one - launched,
        "round_s": float(np.median(round_times)),
        "peak_memory_gb": peak / 1e9,
        "final_accuracy": results["final"]["accuracy"],
    }


def run_plain(clients: int, rounds: int) -> float:
    """The same rounds in this process: sampled clients' local training, averaging, test evaluation."""
    cfg = compose_config([*COMMON, f"num_clients={clients}", f"num_rounds={rounds}"])
    data = federated_data(DataSpec.from_config(cfg))
    spec = ModelSpec(resolve_model_name("auto", data.input_shape), data.input_shape, data.num_classes)
    randomness = RandomSource(seed=int(cfg.seed))
    model = spec.build()
    test = data.test()
    times = []
    for server_round in range(1, rounds + 1):
        started = time.monotonic()
        rng = randomness.generator("client-sampling", server_round=server_round)
        chosen = sorted(rng.choice(clients, size=int(cfg.clients_per_round), replace=False))
        global_arrays = model_to_arrays(model)
        states, weights = [], []
        for client in chosen:
            local = spec.build()
            load_arrays(local, global_arrays)
            part = data.client(int(client))
            train_local(
                local,
                part.x,
                part.y,
                epochs=int(cfg.local_epochs),
                batch_size=int(cfg.batch_size),
                lr=float(cfg.lr),
                rng=np.random.default_rng([server_round, int(client)]),
            )
            states.append({k: v.detach().numpy().astype(np.float64) for k, v in local.state_dict().items()})
            weights.append(len(part))
        factors = np.asarray(weights) / np.sum(weights)
        averaged = {k: sum(f * s[k] for f, s in zip(factors, states, strict=True)) for k in states[0]}
        model.load_state_dict({k: torch.from_numpy(v.astype(np.float32)) for k, v in averaged.items()})
        evaluate(model, test.x, test.y)
        times.append(time.monotonic() - started)
    return float(np.median(times[2:]))


def measure(args: argparse.Namespace) -> None:
    """Run the overhead benchmark and print a Markdown table."""
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for clients in args.clients:
        simulated = run_simulation(clients, args.rounds, args.out)
        plain = run_plain(clients, args.rounds)
        rows.append(
            {
                "clients": clients,
                **simulated,
                "plain_round_s": plain,
                "round_ratio": simulated["round_s"] / plain,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=2))
    print(overhead_table(rows))


def overhead_table(rows: list[dict]) -> str:
    """Markdown table of the overhead measurements."""
    lines = [
        "| clients | start-up (s) | round, simulation (s) | round, plain PyTorch (s) | ratio | "
        "peak memory, all processes (GB) |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['clients']} | {row['startup_s']:.1f} | {row['round_s']:.2f} | "
            f"{row['plain_round_s']:.2f} | {row['round_ratio']:.2f} | {row['peak_memory_gb']:.2f} |"
        )
    return "\n".join(lines)


def goal_lines(rows: list[dict]) -> str:
    """One line per goal and federation size: met or not, with the measured value."""
    goals = (
        ("round_ratio", 1.5, "round-time ratio", ""),
        ("startup_s", 20.0, "start-up", " s"),
        ("peak_memory_gb", 3.0, "peak memory", " GB"),
    )
    lines = []
    for key, limit, name, unit in goals:
        for row in rows:
            verdict = "met" if row[key] <= limit else "**not met**"
            lines.append(
                f"- {name} <= {limit:g}{unit}, {row['clients']} clients: {row[key]:.2f}{unit}, {verdict}"
            )
    return "\n".join(lines)


def section(args: argparse.Namespace) -> None:
    """Write the platform section of BENCHMARKS.md from the run files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads((args.main_job / "results.json").read_text())
    rounds = results["rounds"]
    accuracy = [r["accuracy"] for r in rounds]
    first = next((r["round"] for r in rounds if r["accuracy"] >= 0.8), None)
    figures = args.write.parent / "figures"
    figures.mkdir(parents=True, exist_ok=True)
    figure, axis = plt.subplots(figsize=(6, 3.6))
    axis.plot([0] + [r["round"] for r in rounds], [results["initial"]["accuracy"], *accuracy], "o-", ms=3)
    axis.axhline(0.8, ls="--", color="grey")
    axis.set_xlabel("round")
    axis.set_ylabel("test accuracy")
    axis.set_title("python -m fl_app (FedAvg, Fashion-MNIST, Dirichlet 0.5, 100 clients)")
    figure.tight_layout()
    figure.savefig(figures / "platform_fedavg_curve.png", dpi=110)
    plt.close(figure)
    curve = " | ".join(f"{r['round']}: {r['accuracy']:.3f}" for r in rounds)
    overhead = json.loads((args.overhead / "summary.json").read_text())
    clients = " ".join(str(r["clients"]) for r in overhead)
    text = f"""# Platform: the main job and the simulation overhead

Generated by `python benchmarks/overhead.py section --main-job {args.main_job} --overhead {args.overhead}`
from the files of the runs below.

## FedAvg on Fashion-MNIST (the main job)

```bash
{args.main_job_command or f"python -m fl_app hydra.run.dir={args.main_job}"}
```

Defaults: FedAvg, Fashion-MNIST (20% held back as the public split), Dirichlet(0.5) over 100 clients,
10 clients per round, 30 rounds, 2 local epochs, batch 32, SGD lr {results["config"]["lr"]}.
Test accuracy first reached 80% in round **{first}**; final accuracy **{accuracy[-1]:.4f}**, best
{max(accuracy):.4f}; wall time {results["final"]["wall_s"]:.0f} s.

![FedAvg curve](figures/platform_fedavg_curve.png)

Accuracy per round: {curve}

## Overhead of Flower + Ray against plain PyTorch

```bash
python benchmarks/overhead.py measure --clients {clients} --out {args.overhead}
```

FedAvg on Fashion-MNIST, 10 clients per round, `simulation.client_cpus=1` (2 concurrent clients on this
2-core machine). *round, simulation* is the median `round_s` of rounds 3..R (training messages,
aggregation and test evaluation); *round, plain PyTorch* is the same clients' local training, the same
averaging and the same test evaluation back to back in one process (no Flower, no Ray). *start-up* is from
launching `python -m fl_app` until round 1 starts (imports, data, Ray, roster query). *peak memory* is the
peak of the summed PSS of the launched process and all its descendants (Ray GCS, raylet, workers).
Goals: ratio <= 1.5, start-up <= 20 s, peak memory <= 3 GB.

{overhead_table(overhead)}

{goal_lines(overhead)}
"""
    args.write.write_text(text)
    print(f"wrote {args.write}")


def main() -> None:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("measure")
    run.add_argument("--clients", type=int, nargs="+", default=[100, 1000])
    run.add_argument("--rounds", type=int, default=8)
    run.add_argument("--out", type=Path, default=Path("/tmp/bench_platform/overhead"))
    write = commands.add_parser("section")
    write.add_argument("--main-job", type=Path, required=True)
    write.add_argument("--overhead", type=Path, required=True)
    write.add_argument(
        "--main-job-command",
        default=None,
        help="the command that made --main-job, if not `python -m fl_app hydra.run.dir=<main-job>`",
    )
    write.add_argument("--write", type=Path, default=Path("docs/benchmarks/platform.md"))
    args = parser.parse_args()
    (measure if args.command == "measure" else section)(args)


if __name__ == "__main__":
    main()
