"""The cross-device round with the command's torch threads at their default and at one, interleaved.

On a 2-core machine ``python -m fl_app`` runs two Ray client actors of one CPU each (Ray gives each
``OMP_NUM_THREADS=1``) beside the driver, whose torch starts one intra-op thread per core for the
server's evaluation. The test suite spent a third more CPU with three processes of two threads each on
two cores (``docs/benchmarks/suite.md``); this measures whether the command does the same.

Each run is pfl_compare's cross-device FedAvg task (``benchmarks/pfl_compare.py``: N = 1000, 100 per
round, the MLP, 1 epoch, evaluation on 2,000 images after every round). CPU is the whole machine's busy
time over the run (``/proc/stat``: Ray's workers escape ``getrusage``), so the machine must be quiet.

    python -P benchmarks/driver_threads.py --rounds 30 --repeats 2
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

from benchmarks.pfl_compare import dpfl_command, median_after_first  # noqa: E402

#: Settings compared: the command's environment additions.
SETTINGS = {"default threads": {}, "OMP_NUM_THREADS=1": {"OMP_NUM_THREADS": "1"}}


def busy_seconds() -> float:
    """Seconds the machine's CPUs were busy since boot (all but idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def one_run(extra_env: dict[str, str], rounds: int, output: Path) -> dict[str, float]:
    """Run the command once; its wall time, machine CPU, and median round after the first."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | extra_env
    before, started = busy_seconds(), time.monotonic()
    subprocess.run(dpfl_command("fedavg", rounds, output), cwd=ROOT, env=env, check=True, capture_output=True)
    wall, cpu = time.monotonic() - started, busy_seconds() - before
    results = json.loads((output / "results.json").read_text())
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "round_s": median_after_first([r["round_s"] for r in results["rounds"]]),
        "accuracy": results["final"]["accuracy"],
    }


def main(argv: list[str] | None = None) -> int:
    """Alternate the settings ``--repeats`` times; print one row per run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    print("| setting | repeat | command s | machine CPU s | CPU s per round | median round s | accuracy |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as scratch:
        for repeat in range(args.repeats):
            for name, extra in SETTINGS.items():
                run = one_run(extra, args.rounds, Path(scratch) / f"{repeat}-{len(rows[name])}-{name[:3]}")
                rows[name].append(run)
                print(
                    f"| {name} | {repeat + 1} | {run['wall_s']:.1f} | {run['cpu_s']:.1f} | "
                    f"{run['cpu_s'] / args.rounds:.3f} | {run['round_s']:.3f} | {run['accuracy']:.4f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
