"""Keep a sweep's runs in the repository in compact form: one folder per job, config and metrics.

Usage (from the repository root)::

    python -P benchmarks/keep_runs.py SWEEP --out docs/benchmarks/<page>/runs

Copies each job's ``results.json`` (every round's metrics, the final ones, the privacy report and
the composed config) and Hydra's ``.hydra/config.yaml`` (the arm's rules as written) from a sweep
directory into ``--out``, about 25 KB per job: the models, ledgers and logs stay behind. ``python -m
fl_app.report <out>`` then regenerates the page's table and plots from the repository alone.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path


def keep_runs(sweep: Path, out: Path) -> int:
    """Copy every job's results.json and .hydra/config.yaml below ``sweep`` into ``out``.

    Returns the number of jobs kept. A job folder's name keeps Hydra's override list with ``+``
    instead of ``,``: Flower's FAB manifest (the app ``flwr run`` submits) is unquoted CSV and
    cannot hold a path with a comma.
    """
    jobs = sorted(path.parent for path in sweep.rglob("results.json"))
    for job in jobs:
        target = out / job.name.replace(",", "+")
        (target / ".hydra").mkdir(parents=True, exist_ok=True)
        shutil.copy2(job / "results.json", target / "results.json")
        saved = job / ".hydra" / "config.yaml"
        if saved.is_file():
            shutil.copy2(saved, target / ".hydra" / "config.yaml")
    return len(jobs)


def main(argv: list[str] | None = None) -> int:
    """Command line: keep the runs of one sweep."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path, help="a Hydra sweep directory (hydra.sweep.dir)")
    parser.add_argument("--out", type=Path, required=True, help="where to keep the runs")
    args = parser.parse_args(argv)
    kept = keep_runs(args.sweep, args.out)
    if not kept:
        print(f"error: no results.json below {args.sweep}", file=sys.stderr)
        return 2
    print(f"kept {kept} runs in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
