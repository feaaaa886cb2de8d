"""Issue 58's 2-core goal: the cross-device FedAvg task in pfl-research and in dpfl, interleaved, machine CPU.

The task is ``benchmarks/pfl_compare.py``'s non-private one (Fashion-MNIST, Dirichlet(0.5) over
N = 1000, 100 clients per round, the MLP, one local epoch of batch 32, lr 0.1, evaluation on 2,000
test images after every round; dpfl's own split exported for pfl). Per repeat, in this order:

* ``pfl``: pfl-research 0.6.0, one process, one torch thread (``pfl_compare.py pfl-run``, ``.venv-pfl``);
* ``dpfl-inline``: ``python -m fl_app ... simulation.backend=inline`` from this checkout;
* ``dpfl-inline-before``: the same from ``--before TREE`` (another checkout, e.g. ``git worktree add``),
  only with ``--before``;
* ``dpfl-ray``: the same command with dpfl's defaults (Ray, two client actors here); ``dpfl-ray-before``
  the same from ``--before TREE``;
* ``dpfl-processes``: the same with ``simulation.backend=processes`` (two worker processes forked from
  the command, ``fl_app/engine/processes.py``);
* ``dpfl-<backend>-plain``, ``dpfl-<backend>-cohort`` (``inline``, ``ray``, ``processes``): the dpfl
  commands with one message per client (``simulation.cohort_messages=false``) and with one message per
  16 clients (``true``, ``fl_app/cohort_messages.py``); the default ``auto`` is the latter.

``--arms`` picks some of them (default: all; the ``-before`` arms only with ``--before``);
``--dpfl-overrides`` adds overrides to every dpfl arm, e.g. another strategy whose aggregation is a sum
(``'strategy=nbafl privacy.epsilon=50'``: then leave out ``pfl``, which runs FedAvg).

Each command is timed from outside; its CPU is the machine's busy time over the command from
``/proc/stat`` (Ray's processes escape ``getrusage``), so run it on a quiet machine. The round is the
median of rounds 2..R (dpfl: ``results.json``; pfl: its own ``results.json``). The commands inherit
the caller's environment minus ``OMP_NUM_THREADS`` (a user's shell has none)::

    python -P benchmarks/cross_device_cpu.py [--rounds 30] [--repeats 2] [--before TREE] \
        [--arms A,B] [--out DIR] [--dpfl-overrides 'strategy=... ...']

Prints one JSON line per command and a Markdown table; writes ``rows.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import pfl_compare  # noqa: E402 - the pfl side and the exported split

#: pfl_compare's dpfl command for the non-private configuration (the split it exports is this task's).
TASK = (*pfl_compare.CONFIG_OVERRIDES["fedavg"], *pfl_compare.TASK)


def machine_busy_s() -> float:
    """Seconds the machine's CPUs have been busy since boot (user, nice, system, irq, softirq)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / os.sysconf("SC_CLK_TCK")


def dpfl_command(
    tree: Path,
    rounds: int,
    output: Path,
    backend: str,
    cohort: bool | None = None,
    overrides: Sequence[str] = (),
) -> tuple[list[str], Path]:
    """``python -m fl_app`` on the task from ``tree`` (with this checkout's ``.venv``).

    ``backend``: ``ray`` (the default: no override), ``inline`` or ``processes``;
    ``cohort``: ``simulation.cohort_messages=true`` (True), ``false`` (False), the default (None);
    ``overrides`` follow the task's (e.g. another strategy: ``--dpfl-overrides``).
    """
    extra = [*overrides, *([] if backend == "ray" else [f"simulation.backend={backend}"])]
    extra += [] if cohort is None else [f"simulation.cohort_messages={str(cohort).lower()}"]
    command = [str(pfl_compare.DPFL_PYTHON), "-m", "fl_app", *TASK, f"num_rounds={rounds}", *extra]
    return [*command, f"output_dir={output}"], tree


def pfl_command(data: Path, rounds: int, output: Path) -> tuple[list[str], Path]:
    """pfl-research's run of the task on the exported split."""
    script = str(pfl_compare.SCRIPT)
    command = [str(pfl_compare.PFL_PYTHON), "-P", script, "pfl-run", "--data", str(data)]
    command += ["--config", "fedavg"]
    return [*command, "--rounds", str(rounds), "--output-dir", str(output), "--seed", "43"], ROOT


def summary(arm: str, output: Path) -> tuple[float, float]:
    """Median round after the first and final accuracy of a finished run."""
    if arm == "pfl":
        result = pfl_compare.pfl_run_summary(output)
        rounds, accuracy = list(result["round_s"]), float(result["final_accuracy"])
    else:
        result = json.loads((output / "results.json").read_text())
        rounds, accuracy = [r["round_s"] for r in result["rounds"]], float(result["final"]["accuracy"])
    return statistics.median(rounds[1:]), accuracy


def main() -> int:
    """Run the arms interleaved and print the rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--before", type=Path, help="another checkout to run as dpfl-*-before")
    parser.add_argument("--arms", help="comma-separated arms to run (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "cross_device_cpu")
    parser.add_argument(
        "--dpfl-overrides",
        default="",
        help="overrides after the task's for every dpfl arm, e.g. 'strategy=nbafl privacy.epsilon=50'",
    )
    args = parser.parse_args()
    task = functools.partial(dpfl_command, overrides=shlex.split(args.dpfl_overrides))
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "partition.npz"
    if not data.exists():
        export = [str(pfl_compare.DPFL_PYTHON), "-P", str(pfl_compare.SCRIPT), "export", "--data", str(data)]
        subprocess.run(export, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    arms: dict[str, Callable[[Path], tuple[list[str], Path]]] = {
        "pfl": lambda out: pfl_command(data, args.rounds, out),
        "dpfl-inline": lambda out: task(ROOT, args.rounds, out, backend="inline"),
        "dpfl-processes": lambda out: task(ROOT, args.rounds, out, backend="processes"),
    }
    if args.before is not None:
        before = args.before.resolve()
        arms["dpfl-inline-before"] = lambda out: task(before, args.rounds, out, backend="inline")
    arms["dpfl-ray"] = lambda out: task(ROOT, args.rounds, out, backend="ray")
    if args.before is not None:
        arms["dpfl-ray-before"] = lambda out: task(before, args.rounds, out, backend="ray")
    for backend in ("inline", "ray", "processes"):
        for kind, cohort in (("plain", False), ("cohort", True)):
            arms[f"dpfl-{backend}-{kind}"] = functools.partial(
                task, ROOT, args.rounds, backend=backend, cohort=cohort
            )
    if args.arms:
        wanted = args.arms.split(",")
        unknown = sorted(set(wanted) - set(arms))
        if unknown:
            raise SystemExit(f"--arms: unknown {unknown}; the arms are {sorted(arms)}")
        arms = {name: arms[name] for name in wanted}
    environment = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    rows = []
    for repeat in range(1, args.repeats + 1):
        for arm, make in arms.items():
            output = args.out / f"{arm}-{repeat}-{time.strftime('%H%M%S')}"
            command, cwd = make(output)
            busy, started = machine_busy_s(), time.perf_counter()
            finished = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=environment)
            wall, cpu = time.perf_counter() - started, machine_busy_s() - busy
            if finished.returncode != 0:
                raise SystemExit(f"{arm} failed ({finished.returncode}): {finished.stderr[-2000:]}")
            median, accuracy = summary(arm, output)
            row = {
                "arm": arm,
                "repeat": repeat,
                "command_s": round(wall, 2),
                "machine_cpu_s": round(cpu, 2),
                "median_round_s": round(median, 4),
                "accuracy": accuracy,
                "load_1min": round(os.getloadavg()[0], 2),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    print("\n| arm | repeat | command s | machine CPU s | median round s | final accuracy |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['arm']} | {row['repeat']} | {row['command_s']} | {row['machine_cpu_s']} | "
            f"{row['median_round_s']} | {row['accuracy']:.4f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
