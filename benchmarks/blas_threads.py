r"""numpy's BLAS threads on the server's vector work: one thread against OpenBLAS's default, quiet and busy.

Every process of a dpfl environment starts with ``OPENBLAS_NUM_THREADS=1`` (``dpfl_env.py``, unless
the user exported a value). This script measures why, on the server's own numpy work in the shape
the suite and the users run:

* ``norm``: ``np.linalg.norm`` of a vector of ``--dimension`` floats (clipping, one per update);
* ``canaries``: DP-FedAvg's five rounds on constructed replies plus the one-shot canary estimate
  (``privacy.canaries``), the shape of ``tests/test_empirical_privacy.py`` (digits, 20 clients, 10
  per round) with ``--canaries`` canaries.

Each measurement runs in a fresh process with ``OPENBLAS_NUM_THREADS`` set to 1 or to the number of
CPUs (OpenBLAS's default), alternating, ``--repeats`` times, first on an otherwise idle machine
(``quiet``), then with one busy-looping process per CPU beside it (``busy``: what client actors, a
parallel sweep or a test suite do to the server). The table gives the median wall time of each and
the ratio default / one thread.

Usage::

    python -P benchmarks/blas_threads.py --repeats 3 --out docs/benchmarks/blas_threads.md
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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.tables, with or without -P

from benchmarks.tables import markdown_table, replace_generated_block

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- BEGIN GENERATED: blas_threads.py -->", "<!-- END GENERATED -->"
SHAPE = ["dataset=digits", "num_clients=20", "clients_per_round=10", "num_rounds=5", "privacy.epsilon=2"]


def measure_norm(dimension: int, calls: int) -> float:
    """Seconds per ``np.linalg.norm`` of a ``dimension``-float vector (mean of ``calls``)."""
    import numpy as np

    vector = np.random.default_rng(0).standard_normal(dimension)
    start = time.perf_counter()
    for _ in range(calls):
        np.linalg.norm(vector)
    return (time.perf_counter() - start) / calls


def measure_canaries(canaries: int) -> float:
    """Seconds of DP-FedAvg's five constructed rounds and its canary estimate."""
    from fl_app.engine.messages import set_task_identity
    from fl_app.run.harness import random_update_rounds, run_context_for
    from strategies import STRATEGIES

    set_task_identity(run_id=1)  # messages built outside a run

    with tempfile.TemporaryDirectory() as folder:
        run = run_context_for([*SHAPE, "strategy=dp_fedavg", f"privacy.canaries={canaries}"], Path(folder))
        strategy = STRATEGIES.get("dp_fedavg")(run)
        start = time.perf_counter()
        arrays = random_update_rounds(strategy, 5, norm=2.0)
        assert strategy.empirical_privacy(arrays) is not None
        return time.perf_counter() - start


def child(args: argparse.Namespace) -> None:
    """One measurement in this process; prints its seconds as JSON."""
    if args.task == "norm":
        seconds = measure_norm(args.dimension, args.calls)
    else:
        seconds = measure_canaries(args.canaries)
    print(json.dumps({"seconds": seconds}))


def run_child(task: str, threads: int, args: argparse.Namespace) -> float:
    """Seconds measured by a fresh process with ``OPENBLAS_NUM_THREADS=threads``."""
    command = [
        sys.executable,
        "-P",
        __file__,
        "--child",
        task,
        "--dimension",
        str(args.dimension),
        "--calls",
        str(args.calls),
        "--canaries",
        str(args.canaries),
    ]
    environment = {**os.environ, "OPENBLAS_NUM_THREADS": str(threads)}
    done = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=1800, check=True)
    return float(json.loads(done.stdout.strip().splitlines()[-1])["seconds"])


@contextmanager
def busy(processes: int) -> Iterator[None]:
    """``processes`` busy-looping processes while inside (none for 0)."""
    spinners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdout=subprocess.DEVNULL)
        for _ in range(processes)
    ]
    try:
        time.sleep(1.0 if spinners else 0.0)
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait(timeout=30)


def main(argv: list[str] | None = None) -> int:
    """Run the measurements and print (or write) the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", dest="task", choices=["norm", "canaries"], default=None)
    parser.add_argument("--dimension", type=int, default=100_000)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--canaries", type=int, default=800)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.task is not None:
        child(args)
        return 0
    cpus = os.cpu_count() or 1
    load = os.getloadavg()[0]
    rows = []
    for condition, spinners in (("quiet", 0), ("busy", cpus)):
        for task in ("norm", "canaries"):
            times: dict[int, list[float]] = {1: [], cpus: []}
            with busy(spinners):
                for _ in range(args.repeats):
                    for threads in (1, cpus):
                        times[threads].append(run_child(task, threads, args))
            one, default = statistics.median(times[1]), statistics.median(times[cpus])
            rows.append((condition, task, one, default))
            print(f"{condition} {task}: one thread {one:.4g} s, {cpus} threads {default:.4g} s", flush=True)
    what = {
        "norm": f"`np.linalg.norm`, {args.dimension:,} floats (per call, mean of {args.calls})",
        "canaries": f"DP-FedAvg, 5 constructed rounds + canary estimate, {args.canaries} canaries",
    }
    cells = []
    for condition, task, one, default in rows:
        label = "busy (one spinning process per CPU)" if condition == "busy" else "quiet"
        unit, suffix = (1e3, " ms") if task == "norm" else (1.0, " s")
        shown = [f"{one * unit:.3g}{suffix}", f"{default * unit:.3g}{suffix}"]
        cells.append([label, what[task], *shown, f"{default / one:.2g}x"])
    header_cells = ["machine", "task", "one thread", f"{cpus} threads (OpenBLAS default)", "default / one"]
    lines = markdown_table(header_cells, cells)
    header = (
        f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC, {cpus} CPUs, medians of {args.repeats} "
        f"fresh processes each, load average before {load:.2f}\n\n"
    )
    table = header + "\n".join(lines) + "\n"
    print(table)
    if args.out is not None and not replace_generated_block(args.out, table, begin=BEGIN, end=END):
        raise SystemExit(f"{args.out} lacks the markers {BEGIN} / {END}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
