"""Start-up benchmark: the time a run spends outside its rounds, a sweep's cost per job, populations.

Usage::

    python benchmarks/startup.py breakdown [--repeats 3] [--rounds 10] [--compare LABEL=TREE ...]
                                           [--label after] [--out DIR]
    python benchmarks/startup.py sweep [--jobs 12] [--rounds 5] [--compare LABEL=TREE ...] [--out DIR]
    python benchmarks/startup.py population [--sizes 1000 10000 100000] [--cohorts 100 1000]
                                            [--rounds 5] [--out DIR]
    python benchmarks/startup.py commands [--compare LABEL=TREE ...] [--out DIR]
    python benchmarks/startup.py tables --out DIR      # markdown tables of what the others recorded in DIR

``breakdown`` launches the 10-round cross-device job (FedAvg, Fashion-MNIST, Dirichlet(0.5) over
N = 1000 clients, 100 per round, the MLP, 1 local epoch, batch 32, evaluation on 2,000 test images)
as ``python -m fl_app`` with ``DPFL_TIMELINE`` set (:mod:`fl_app.run.timeline`): the run marks its phase
boundaries (imports, preflight, Ray started, ServerApp started, data loaded, roster, round 1, rounds
done, results written, engine done, Ray stopped, exit) and the benchmark adds the launch and the
process's end. *Outside the rounds* is the whole command's wall time minus the time from round 1's
start to the last round's end. Each ``--compare`` tree (a ``git worktree`` of another commit with
the same marks) runs interleaved with this one: repeat 1 of every tree, then repeat 2, ...; the
table gives each phase's median.

``sweep`` runs a multirun of ``--jobs`` jobs of a small cross-device shape (N = 1000, 100 per round,
``--rounds`` rounds, the MLP; the jobs differ in ``seed``) and compares the command's wall time with
the sum of its jobs' round times (``round_s`` in each job's results.json).

``population`` runs FedAvg on a synthetic task large enough to give every client examples
(``dataset=synthetic``, 8x8 inputs, IID split, 5 examples per client) at each population size and
cohort size, and records start-up (launch until round 1), the median round time of rounds 2..R and
the peak memory of all the run's processes (summed PSS, sampled every 2 s).

``commands`` times the README's main job and the quick examples (whole command, wall clock).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.overhead import MEMORY_SAMPLE_S, tree_pss, wait_for_ray_exit  # noqa: E402

CROSS_DEVICE = [
    "strategy=fedavg",
    "dataset=fashion_mnist",
    "partition=dirichlet",
    "num_clients=1000",
    "clients_per_round=100",
    "model=mlp",
    "local_epochs=1",
    "batch_size=32",
    "evaluation.test_subset=2000",
]
#: Phase boundaries in the order a run reaches them (``launch`` and ``end`` are the benchmark's).
PHASES = [
    ("launch", "imports", "interpreter and imports"),
    ("imports", "preflight", "compose and validate the jobs"),
    ("preflight", "job", "Hydra's job set-up"),
    ("job", "ray_started", "start Ray"),
    ("ray_started", "server_app", "engine and ServerApp start"),
    ("server_app", "data", "load the data and the split"),
    ("data", "roster", "actors start, roster query"),
    ("roster", "round_1", "strategy, evaluation set, round 0"),
    ("rounds_done", "results_written", "results, plots, model"),
    ("results_written", "engine_done", "engine stop"),
    ("engine_done", "ray_stopped", "Ray shutdown"),
    ("ray_stopped", "exit", "after the run"),
    ("exit", "end", "interpreter exit"),
]


def launch(
    command: list[str], *, cwd: Path, timeline: Path | None = None, sample_memory: bool = False
) -> dict[str, Any]:
    """Run ``command``; return its wall time, peak memory, timeline marks and the phases they bound."""
    env = dict(os.environ)
    if timeline is not None:
        timeline.unlink(missing_ok=True)
        env["DPFL_TIMELINE"] = str(timeline)
    env["PYTHONPATH"] = str(cwd)
    started = time.time()
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0
    if sample_memory:
        root = psutil.Process(process.pid)
        while process.poll() is None:
            try:
                peak = max(peak, tree_pss(root))
            except psutil.NoSuchProcess:
                break
            try:
                process.wait(MEMORY_SAMPLE_S)  # wakes at the exit: the end time stays exact
            except subprocess.TimeoutExpired:
                continue
    _, stderr = process.communicate(timeout=7200)
    ended = time.time()
    wait_for_ray_exit()
    marks: dict[str, float] = {"launch": started, "end": ended}
    if timeline is not None and timeline.exists():
        for line in timeline.read_text().splitlines():
            record = json.loads(line)
            marks.setdefault(record["phase"], record["t"])  # the first time a phase is reached
    if process.returncode != 0:
        tail = stderr.decode(errors="replace").strip().splitlines()[-3:]
        raise RuntimeError(f"failed ({process.returncode}): {' '.join(command)}: {' | '.join(tail)}")
    reached = [(start, end, name) for start, end, name in PHASES if start in marks and end in marks]
    phases = {name: marks[end] - marks[start] for start, end, name in reached}
    return {"wall_s": ended - started, "marks": marks, "phases": phases, "peak_memory_gb": peak / 1e9}


def rounds_of(run_dir: Path) -> list[float]:
    """Each round's ``round_s`` from a run's results.json (none for a secret cohort, which withholds them)."""
    results = json.loads((run_dir / "results.json").read_text())
    return [float(r["round_s"]) for r in results["rounds"] if r.get("round_s") is not None]


def trees(args: argparse.Namespace) -> list[tuple[str, Path]]:
    """The checkout of this script (``--label``) and the ``--compare`` ones, in that order."""
    pairs = [(args.label, ROOT)]
    for item in args.compare:
        label, _, path = item.partition("=")
        pairs.append((label, Path(path).resolve()))
    return pairs


def breakdown(args: argparse.Namespace) -> None:
    """The 10-round cross-device job, phase by phase, every tree interleaved."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in trees(args)}
    for repeat in range(args.repeats):
        for label, tree in trees(args):
            run_dir = Path(tempfile.mkdtemp(prefix=f"dpfl-startup-{label}-"))
            command = [sys.executable, "-m", "fl_app", *CROSS_DEVICE, f"num_rounds={args.rounds}"]
            command.append(f"output_dir={run_dir}")
            result = launch(command, cwd=tree, timeline=run_dir.with_suffix(".timeline"))
            marks = result["marks"]
            result["rounds_s"] = marks["rounds_done"] - marks["round_1"]
            result["outside_s"] = result["wall_s"] - result["rounds_s"]
            runs[label].append(result)
            print(
                f"{label} repeat {repeat + 1}: whole {result['wall_s']:.1f} s, "
                f"rounds {result['rounds_s']:.1f} s, outside {result['outside_s']:.1f} s",
                flush=True,
            )
    (out / "breakdown.json").write_text(json.dumps(runs, indent=1))
    print(breakdown_table(runs))


def breakdown_table(runs: dict[str, list[dict[str, Any]]]) -> str:
    """Median seconds per phase, one column per tree."""
    labels = list(runs)
    lines = [f"| phase | {' | '.join(labels)} |", f"|---|{'---|' * len(labels)}"]
    for _, _, name in PHASES:
        cells = []
        for label in labels:
            values = [r["phases"][name] for r in runs[label] if name in r["phases"]]
            cells.append(f"{statistics.median(values):.2f}" if values else "-")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    for key, name in (
        ("outside_s", "**outside the rounds**"),
        ("rounds_s", "rounds"),
        ("wall_s", "whole command"),
    ):
        cells = [f"{statistics.median(r[key] for r in runs[label]):.2f}" for label in labels]
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines)


def sweep(args: argparse.Namespace) -> None:
    """A multirun of ``--jobs`` small jobs: whole command against the sum of the jobs' rounds."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for repeat in range(args.repeats):
        for label, tree in trees(args):
            sweep_dir = Path(tempfile.mkdtemp(prefix=f"dpfl-sweep-bench-{label}-"))
            seeds = ",".join(str(seed) for seed in range(1, args.jobs + 1))
            command = [
                sys.executable, "-m", "fl_app", "-m", *CROSS_DEVICE, f"num_rounds={args.rounds}",
                f"seed={seeds}", f"hydra.sweep.dir={sweep_dir}",
            ]  # fmt: skip
            result = launch(command, cwd=tree)
            rounds = sum(
                sum(rounds_of(job)) for job in sweep_dir.iterdir() if (job / "results.json").exists()
            )
            jobs = sum(1 for job in sweep_dir.iterdir() if (job / "results.json").exists())
            row = {
                "label": label,
                "repeat": repeat + 1,
                "jobs": jobs,
                "wall_s": result["wall_s"],
                "rounds_s": rounds,
            }
            rows.append(row)
            print(
                f"{label} repeat {repeat + 1}: {jobs} jobs, whole {row['wall_s']:.1f} s, "
                f"rounds {rounds:.1f} s, outside per job {(row['wall_s'] - rounds) / max(jobs, 1):.2f} s",
                flush=True,
            )
    (out / "sweep.json").write_text(json.dumps(rows, indent=1))


def population(args: argparse.Namespace) -> None:
    """Start-up, round time and peak memory by population and cohort size."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in args.sizes:
        for cohort in args.cohorts:
            for label, tree in trees(args):
                run_dir = Path(tempfile.mkdtemp(prefix=f"dpfl-population-{size}-{cohort}-"))
                train = args.examples_per_client * size
                command = [
                    sys.executable, "-m", "fl_app", "strategy=fedavg", "dataset=synthetic", "partition=iid",
                    f"dataset.num_train={int(train / (1 - 0.2)) + 1}", "model=mlp", "local_epochs=1",
                    "batch_size=32", f"num_clients={size}", f"clients_per_round={cohort}",
                    f"num_rounds={args.rounds}", f"output_dir={run_dir}",
                ]  # fmt: skip
                result = launch(
                    command, cwd=tree, timeline=run_dir.with_suffix(".timeline"), sample_memory=True
                )
                marks = result["marks"]
                rounds = rounds_of(run_dir)
                row = {
                    "label": label,
                    "num_clients": size,
                    "clients_per_round": cohort,
                    "startup_s": marks["round_1"] - marks["launch"],
                    "after_s": marks["end"] - marks["rounds_done"],
                    "round_s": statistics.median(rounds[1:]) if len(rounds) > 1 else rounds[0],
                    "first_round_s": rounds[0],
                    "peak_memory_gb": result["peak_memory_gb"],
                    "wall_s": result["wall_s"],
                    "phases": result["phases"],
                }
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "phases"}), flush=True)
                (out / "population.json").write_text(json.dumps(rows, indent=1))


#: The README's main job and quick examples, timed as whole commands.
COMMANDS = {
    "main_job": [],
    "quick_dp_fedavg": ["+experiment=quick", "strategy=dp_fedavg"],
    "quick_fedavg": ["+experiment=quick", "strategy=fedavg"],
}


def commands(args: argparse.Namespace) -> None:
    """Wall time of the main job and the quick examples, every tree interleaved."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    chosen = {name: COMMANDS[name] for name in args.commands} if args.commands else COMMANDS
    for _ in range(args.repeats):
        for name, overrides in chosen.items():
            for label, tree in trees(args):
                run_dir = Path(tempfile.mkdtemp(prefix="dpfl-command-"))
                command = [sys.executable, "-m", "fl_app", *overrides, f"output_dir={run_dir}"]
                result = launch(command, cwd=tree)
                rounds = rounds_of(run_dir)
                row = {
                    "command": name,
                    "label": label,
                    "wall_s": result["wall_s"],
                    "rounds_s": sum(rounds) if rounds else None,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
                (out / "commands.json").write_text(json.dumps(rows, indent=1))


def tables(args: argparse.Namespace) -> None:
    """Markdown tables of the recorded measurements in ``--out`` (the JSON files the others write)."""
    folder = Path(args.out)
    parts = []
    if (folder / "breakdown.json").exists():
        parts.append(breakdown_table(json.loads((folder / "breakdown.json").read_text())))
    if (folder / "sweep.json").exists():
        lines = [
            "| code | jobs | whole command (s) | sum of the jobs' rounds (s) "
            "| outside the rounds, per job (s) |"
        ]
        lines.append("|---|---|---|---|---|")
        for row in json.loads((folder / "sweep.json").read_text()):
            per_job = (row["wall_s"] - row["rounds_s"]) / max(row["jobs"], 1)
            lines.append(
                f"| {row['label']} | {row['jobs']} | {row['wall_s']:.1f} | {row['rounds_s']:.1f} "
                f"| {per_job:.2f} |"
            )
        parts.append("\n".join(lines))
    if (folder / "population.json").exists():
        lines = [
            "| code | N | per round | start-up (s) | round 1 (s) | round, median of 2..R (s) "
            "| after the rounds (s) | peak memory, all processes (GB) |"
        ]
        lines.append("|---|---|---|---|---|---|---|---|")
        for row in json.loads((folder / "population.json").read_text()):
            lines.append(
                f"| {row['label']} | {row['num_clients']:,} | {row['clients_per_round']:,} "
                f"| {row['startup_s']:.1f} "
                f"| {row['first_round_s']:.2f} | {row['round_s']:.3f} | {row['after_s']:.1f} "
                f"| {row['peak_memory_gb']:.2f} |"
            )
        parts.append("\n".join(lines))
    if (folder / "commands.json").exists():
        lines = ["| command | code | whole command (s) | its rounds (s) |", "|---|---|---|---|"]
        for row in json.loads((folder / "commands.json").read_text()):
            rounds = "withheld (secret cohort)" if row["rounds_s"] is None else f"{row['rounds_s']:.1f}"
            lines.append(f"| {row['command']} | {row['label']} | {row['wall_s']:.1f} | {rounds} |")
        parts.append("\n".join(lines))
    print("\n\n".join(parts))


def main() -> None:
    """Parse the command line and run the chosen measurement."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("breakdown", "sweep", "population", "commands", "tables"):
        part = sub.add_parser(name)
        part.add_argument("--out", default=f"/tmp/dpfl-startup/{name}")
        part.add_argument("--label", default="this")
        part.add_argument("--compare", nargs="*", default=[])
        part.add_argument("--repeats", type=int, default=1)
        part.add_argument("--rounds", type=int, default=10 if name == "breakdown" else 5)
        part.add_argument("--jobs", type=int, default=12)
        part.add_argument("--sizes", type=int, nargs="*", default=[1000, 10000, 100000])
        part.add_argument("--cohorts", type=int, nargs="*", default=[100, 1000])
        part.add_argument("--examples-per-client", type=int, default=5)
        part.add_argument("--commands", nargs="*", default=[], choices=sorted(COMMANDS))
    args = parser.parse_args()
    commands_by_name = {
        "breakdown": breakdown,
        "sweep": sweep,
        "population": population,
        "commands": commands,
        "tables": tables,
    }
    commands_by_name[args.command](args)


if __name__ == "__main__":
    main()
