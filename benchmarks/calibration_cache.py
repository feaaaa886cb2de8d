"""CPU seconds of DP-FedAvg's noise calibration in a fresh process: searched, and read from the disk cache.

Each row is one process (``--one``): the accounting imported and one PLD evaluation made first
(every run pays that: a warm-up on other arguments), then ``dp_fedavg_noise_multiplier`` timed with
``time.process_time``. Per repeat and shape, in this order: the search with the cache off, the
search filling an empty cache, and a process reading that answer (it checks it with one evaluation
of the accountant). Shapes: the cross-device task's (q = 0.1) at 30, 100 and 1000 rounds, epsilon 8,
delta 1e-5, PLD (dpfl's default accountant)::

    python -P benchmarks/calibration_cache.py [--repeats 3]

Prints one JSON line per process and a Markdown table of medians.
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

ROOT = Path(__file__).resolve().parents[1]
SHAPES = (30, 100, 1000)
TARGET = {"epsilon": 8.0, "delta": 1e-5, "sampling_rate": 0.1, "method": "pld"}


def one(rounds: int) -> dict[str, float]:
    """Time one calibration in this process (after the warm-up); its seconds and answer."""
    from fl_app.privacy.calibration import dp_fedavg_noise_multiplier, gaussian_epsilon

    gaussian_epsilon(noise_multiplier=3.0, sampling_rate=0.05, rounds=7, delta=1e-5, method="pld")
    started = time.process_time()
    answer = dp_fedavg_noise_multiplier(**TARGET, rounds=rounds)
    return {"cpu_s": time.process_time() - started, "noise_multiplier": answer}


def run(rounds: int, cache: str) -> dict[str, float]:
    """:func:`one` in a fresh interpreter with ``DPFL_CALIBRATION_CACHE=cache``."""
    environment = {**os.environ, "DPFL_CALIBRATION_CACHE": cache}
    command = [sys.executable, "-P", str(Path(__file__).resolve()), "--one", str(rounds)]
    finished = subprocess.run(command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300)
    if finished.returncode != 0:
        raise SystemExit(finished.stderr[-2000:])
    return json.loads(finished.stdout.splitlines()[-1])


def main() -> int:
    """Run the three arms per shape and repeat; print the rows and the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        sys.path.insert(0, str(ROOT))
        print(json.dumps(one(args.one)))
        return 0
    rows = []
    for repeat in range(1, args.repeats + 1):
        with tempfile.TemporaryDirectory() as folder:
            for rounds in SHAPES:
                for arm, cache in (
                    ("search, cache off", "off"),
                    ("search, stored", folder),
                    ("read", folder),
                ):
                    row = {"repeat": repeat, "rounds": rounds, "arm": arm, **run(rounds, cache)}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print("\n| rounds | arm | CPU s (median) | noise multiplier |\n|---|---|---|---|")
    for rounds in SHAPES:
        for arm in ("search, cache off", "search, stored", "read"):
            mine = [r for r in rows if r["rounds"] == rounds and r["arm"] == arm]
            answers = {r["noise_multiplier"] for r in mine}
            median = statistics.median(r["cpu_s"] for r in mine)
            print(f"| {rounds} | {arm} | {median:.3f} | {', '.join(f'{a:.6f}' for a in sorted(answers))} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
