"""``simulation.backend=ray`` against ``inline``: the whole command's wall time and the machine's CPU.

Two tasks, each run with both backends, alternating, ``--repeats`` times:

* *small*: the test suite's tiny run (``tests/conftest.py``'s FAST: digits, 6 clients, 3 per round,
  2 rounds, one client actor), where starting Ray and the actor is most of the command;
* *cross-device*: pfl_compare's FedAvg task (``benchmarks/pfl_compare.py``: N = 1000, 100 per round,
  the MLP, 1 epoch, evaluation on 2,000 images after every round), ``--rounds`` rounds, where Ray
  runs two client actors on the two cores and inline runs every client in the driver, one by one.

CPU is the whole machine's busy time over the run (``/proc/stat``: Ray's processes escape
``getrusage``), so the machine must be quiet.

    python -P benchmarks/inline_backend.py --rounds 30 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
#: The caller's environment: importing tests.conftest (for FAST) sets OMP_NUM_THREADS=1 for the tests,
#: which the measured commands must not inherit (it made the inline rows one torch thread's).
CALLER_ENV = dict(os.environ)

from benchmarks.driver_threads import busy_seconds  # noqa: E402
from benchmarks.pfl_compare import dpfl_command, median_after_first  # noqa: E402
from tests.conftest import FAST  # noqa: E402

BACKENDS = ("ray", "inline")
COLUMNS = (
    *("task", "backend", "repeat", "command s", "machine CPU s"),
    *("CPU s per round", "median round s", "accuracy"),
)


def command(task: str, backend: str, rounds: int, output: Path) -> list[str]:
    """The ``python -m fl_app`` command of one run."""
    chosen = f"simulation.backend={backend}"
    if task == "small":
        return [sys.executable, "-m", "fl_app", *FAST, "strategy=fedavg", chosen, f"output_dir={output}"]
    return [*dpfl_command("fedavg", rounds, output), chosen]


def one_run(task: str, backend: str, rounds: int, output: Path) -> dict[str, float]:
    """Run the command once: its wall time, the machine's CPU, its median round and accuracy."""
    before, started = busy_seconds(), time.monotonic()
    subprocess.run(
        command(task, backend, rounds, output), cwd=ROOT, env=CALLER_ENV, check=True, capture_output=True
    )
    wall, cpu = time.monotonic() - started, busy_seconds() - before
    results = json.loads((output / "results.json").read_text())
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "rounds": len(results["rounds"]),
        "round_s": median_after_first([r["round_s"] for r in results["rounds"]]),
        "accuracy": results["final"]["accuracy"],
    }


def main(argv: list[str] | None = None) -> int:
    """Alternate the backends per task ``--repeats`` times; print one row per run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30, help="rounds of the cross-device task")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print(f"| {' | '.join(COLUMNS)} |")
    print("|---" * len(COLUMNS) + "|")
    with tempfile.TemporaryDirectory() as scratch:
        for task in ("small", "cross-device"):
            for repeat in range(args.repeats):
                for backend in BACKENDS:
                    run = one_run(task, backend, args.rounds, Path(scratch) / f"{task}-{repeat}-{backend}")
                    per_round = run["cpu_s"] / run["rounds"]
                    cells = (task, backend, repeat + 1, f"{run['wall_s']:.1f}", f"{run['cpu_s']:.1f}")
                    cells += (f"{per_round:.3f}", f"{run['round_s']:.3f}", f"{run['accuracy']:.4f}")
                    print(f"| {' | '.join(map(str, cells))} |", flush=True)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
