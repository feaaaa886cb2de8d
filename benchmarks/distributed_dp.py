"""Distributed DP-FedAvg (SecAgg+) against central DP-FedAvg on the same schedule: accuracy, bytes, time.

Usage (from the repository root)::

    .venv/bin/python -P benchmarks/distributed_dp.py run [--rounds 50] [--epsilons 8,2] [--bits 12,14,16,20]
        [--seeds 1] [--append] [--out docs/benchmarks/distributed_dp] [--write-doc]
    .venv/bin/python -P benchmarks/distributed_dp.py refresh [--out DIR] [--jobs DIR]
    .venv/bin/python -P benchmarks/distributed_dp.py table [--out DIR] [--write-doc]

The shape: Fashion-MNIST, Dirichlet(0.5) over N = 1000 clients, 100 per round on the public balanced
schedule (each client once per pass of 10 rounds), the MLP, 5 local epochs, clip 1, delta 1e-5,
epsilon against the server. For each epsilon it runs, one job after another (no two at once):

* ``central``: ``strategy=dp_fedavg strategy.sampling=balanced``: the server clips and adds Gaussian
  noise calibrated (PLD) for the busiest client's participations; trusted server, no amplification;
* ``central, same noise``: the same with ``strategy.noise_multiplier`` set to the distributed plan's
  noise at 16 bits (the sum's noise std over C), so that only quantization and modular wrap-around
  differ;
* ``secagg b``: ``strategy=dp_fedavg_secagg strategy.bits=b`` for each ``b`` (a plan that cannot fit
  is recorded as infeasible with the validation's message).

Per job it records the final and best test accuracy, the epsilon, the upload bytes per client per
round (``final.upload_bytes_per_client``), the median round time (``rounds[].round_s``, rounds 2..R)
and the whole command's wall time. The runs' folders go to ``--jobs`` (``multirun/distributed_dp``);
``runs.json`` and ``table.md`` go to ``--out``; ``--write-doc``
replaces the generated block of ``docs/benchmarks/distributed_dp.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.tables, with or without -P

from benchmarks.tables import replace_generated_block

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks" / "distributed_dp.md"
BEGIN, END = "<!-- DISTRIBUTED_DP:BEGIN -->", "<!-- DISTRIBUTED_DP:END -->"
SHAPE = [
    "num_clients=1000",
    "clients_per_round=100",
    "local_epochs=5",
    "dataset=fashion_mnist",
    "partition=dirichlet",
    "model=mlp",
]


def run_job(name: str, overrides: list[str], jobs: Path) -> dict[str, Any]:
    """One ``python -m fl_app`` job; its results (or its one-line refusal)."""
    folder = jobs / name
    command = [sys.executable, "-m", "fl_app", *overrides, f"output_dir={folder}"]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=4 * 3600, check=False)
    wall = time.perf_counter() - start
    record: dict[str, Any] = {
        "name": name,
        "command": " ".join(["python -m fl_app", *overrides]),
        "wall_s": wall,
    }
    results_file = folder / "results.json"
    if done.returncode != 0 or not results_file.exists():
        record["error"] = (done.stderr.strip().splitlines() or ["?"])[-1]
        return record
    record.update(summary(json.loads(results_file.read_text())))
    return record


def summary(results: dict[str, Any]) -> dict[str, Any]:
    """What the table needs of one run's ``results.json``."""
    rounds = results["rounds"]
    times = [r["round_s"] for r in rounds[1:] if r.get("round_s") is not None]
    return {
        "accuracy": results["final"]["accuracy"],
        "best": max(r["accuracy"] for r in rounds if r.get("accuracy") is not None),
        "epsilon": results["final"]["epsilon"],
        # every byte a client sent in a round (all SecAgg+ stages), per scheduled client
        "upload_bytes": statistics.mean(r["upload_bytes"] / r["clients"] for r in rounds if r.get("clients")),
        "round_s": statistics.median(times) if times else None,
        "plan": results["privacy"].get("plan"),
        "noise_multiplier": results["privacy"].get("noise_multiplier"),
    }


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every job of the grid, one seed after another; ``--append`` keeps the records already there."""
    out, jobs = Path(args.out), Path(args.jobs)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "runs.json"
    records: list[dict[str, Any]] = (
        json.loads(path.read_text())["runs"] if args.append and path.is_file() else []
    )

    def keep(record: dict[str, Any]) -> None:
        records[:] = [r for r in records if r["name"] != record["name"]] + [record]
        print(json.dumps(record), flush=True)
        path.write_text(json.dumps({"rounds": args.rounds, "runs": records}, indent=1))

    for seed in [int(s) for s in args.seeds.split(",")]:
        for epsilon in [float(e) for e in args.epsilons.split(",")]:
            common = [*SHAPE, f"num_rounds={args.rounds}", f"privacy.epsilon={epsilon:g}", f"seed={seed}"]
            tag = f"eps{epsilon:g}-seed{seed}"
            sixteen = None
            for bits in [int(b) for b in args.bits.split(",")]:
                record = run_job(
                    f"secagg-{tag}-b{bits}",
                    [*common, "strategy=dp_fedavg_secagg", f"strategy.bits={bits}"],
                    jobs,
                )
                record.update(epsilon_target=epsilon, arm="secagg", bits=bits, seed=seed)
                keep(record)
                if bits == 16 and record.get("plan"):
                    sixteen = record["plan"]
            central = [*common, "strategy=dp_fedavg", "strategy.sampling=balanced"]
            record = run_job(f"central-{tag}", central, jobs)
            record.update(epsilon_target=epsilon, arm="central", bits=None, seed=seed)
            keep(record)
            if sixteen is not None:
                z = (
                    math.sqrt(sixteen["survivors"] * sixteen["local_variance"])
                    / sixteen["scale"]
                    / sixteen["clip"]
                )
                record = run_job(
                    f"central-same-noise-{tag}", [*central, f"strategy.noise_multiplier={z:.6g}"], jobs
                )
                record.update(epsilon_target=epsilon, arm="central, same noise", bits=None, seed=seed)
                keep(record)
    return records


def refresh(out: Path, jobs: Path) -> None:
    """Recompute every record of ``runs.json`` from its run's ``results.json`` under ``jobs``."""
    data = json.loads((out / "runs.json").read_text())
    for record in data["runs"]:
        results = jobs / record["name"] / "results.json"
        if "error" not in record and results.is_file():
            record.update(summary(json.loads(results.read_text())))
    (out / "runs.json").write_text(json.dumps(data, indent=1))


def table(records: list[dict[str, Any]], rounds: int) -> str:
    """The markdown table of ``records``: one row per (epsilon, arm, bits), mean ± std over its seeds."""
    lines = [
        f"N = 1000, 100 per round (balanced public schedule), {rounds} rounds, 5 local epochs, MLP, "
        "Fashion-MNIST, delta 1e-5; mean ± std over the seeds listed (test split).",
        "",
        "| target epsilon | arm | bits | final accuracy | best accuracy | seeds | epsilon | noise / C (z) "
        "| upload B/client/round | median round (s) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple[float, str, Any], list[dict[str, Any]]] = {}
    for r in records:
        groups.setdefault((r["epsilon_target"], r["arm"], r["bits"]), []).append(r)
    order = {"secagg": 0, "central": 1, "central, same noise": 2}
    for (epsilon, arm, bits), runs in sorted(
        groups.items(), key=lambda g: (-g[0][0], order[g[0][1]], g[0][2] or 0)
    ):
        head = f"| {epsilon:g} | {arm} | {bits or '-'} "
        done = [r for r in runs if "error" not in r]
        if not done:
            reason = runs[0]["error"].removeprefix("error: ")
            lines.append(f"{head}| infeasible: {reason} | | | | | | |")
            continue
        seeds = ", ".join(str(r.get("seed", 1)) for r in done)
        zs = []
        for r in done:
            plan = r.get("plan")
            zs.append(
                math.sqrt(plan["survivors"] * plan["local_variance"]) / plan["scale"] / plan["clip"]
                if plan
                else r.get("noise_multiplier") or float("nan")
            )
        lines.append(
            f"{head}| {spread([r['accuracy'] for r in done])} | {spread([r['best'] for r in done])} "
            f"| {seeds} "
            f"| {max(r['epsilon'] for r in done):.3f} | {statistics.mean(zs):.4f} "
            f"| {statistics.mean(r['upload_bytes'] for r in done):,.0f} "
            f"| {statistics.median(r['round_s'] for r in done):.2f} |"
        )
    return "\n".join(lines) + "\n"


def spread(values: list[float]) -> str:
    """``mean ± std`` (the std of one value is omitted)."""
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def write(out: Path, write_doc: bool) -> None:
    """``table.md`` from ``runs.json``; with ``write_doc`` also the doc's generated block."""
    data = json.loads((out / "runs.json").read_text())
    text = table(data["runs"], data["rounds"])
    (out / "table.md").write_text(text)
    print(text)
    if write_doc and not replace_generated_block(DOC, text, begin=BEGIN, end=END):
        raise SystemExit(f"{DOC} lacks the markers {BEGIN} / {END}")


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["run", "refresh", "table"])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--epsilons", default="8,2")
    parser.add_argument("--bits", default="12,14,16,20")
    parser.add_argument("--seeds", default="1")
    parser.add_argument(
        "--append", action="store_true", help="keep the records of runs.json (same name: replaced)"
    )
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "distributed_dp"))
    parser.add_argument("--jobs", default=str(ROOT / "multirun" / "distributed_dp"), help="the runs' folders")
    parser.add_argument("--write-doc", action="store_true")
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args)
    elif args.command == "refresh":
        refresh(Path(args.out), Path(args.jobs))
    write(Path(args.out), args.write_doc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
