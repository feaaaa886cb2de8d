"""The test suite's wall time and CPU use, per number of pytest-xdist processes (``-n``).

Usage (from the repository root)::

    python -P benchmarks/suite_time.py run --workers 2 3 [--repeats 1] [--out docs/benchmarks/suite]
    python -P benchmarks/suite_time.py table [--out docs/benchmarks/suite] [--write-doc]

``run`` runs ``python -m pytest -q -p no:cacheprovider -n N`` once per worker count and repeat,
interleaved (2, 3, 2, 3, ...), and appends to ``<out>/runs.json`` one record per run: the command, its
wall time, the CPU time (user + system) of the whole process tree as the kernel accounts it to the
pytest process (``RUSAGE_CHILDREN``: every descendant that was waited for: the workers, their
simulations' Ray processes, the deployment tests' SuperLinks and SuperNodes), the share of the two
cores that was busy (CPU over wall over cores), the pytest summary line, and the machine's load average
before the run (a run beside other work is marked as such). ``table`` prints them as markdown, or with
``--write-doc`` writes them into ``docs/benchmarks/suite.md`` between its generated markers.

The suite's budget is 10 minutes on a quiet 2-core machine (the developers' guide); a timing is only
comparable with runs of the same session on the same machine: compare the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.tables import markdown_table, replace_generated_block  # noqa: E402

OUT = ROOT / "docs" / "benchmarks" / "suite"
DOC = ROOT / "docs" / "benchmarks" / "suite.md"
BEGIN, END = "<!-- BEGIN GENERATED: suite/runs.json -->", "<!-- END GENERATED -->"
#: The longest a run may take before it is stopped (CI gives the whole job 90 minutes).
RUN_TIMEOUT_S = 3600


def summary_line(output: str) -> str:
    """Pytest's last line (``800 passed, 2 skipped in 888.03s``), without the ``=`` frame."""
    lines = [line.strip("= ").strip() for line in output.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def run_once(workers: int) -> dict[str, Any]:
    """Run the whole suite once with ``workers`` processes; what it cost."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(workers)]
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    process = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, check=False
    )
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    cores = os.cpu_count() or 1
    return {
        "workers": workers,
        "command": " ".join(["python", *command[1:]]),
        "wall_s": round(wall, 1),
        "cpu_s": round(cpu, 1),
        "busy_share": round(cpu / wall / cores, 3),
        "cores": cores,
        "load_before": round(load, 2),
        "returncode": process.returncode,
        "summary": summary_line(process.stdout),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def run(workers: list[int], repeats: int, out: Path) -> int:
    """Run the suite for every worker count, interleaved, and append the records to ``out/runs.json``."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / "runs.json"
    records = json.loads(path.read_text()) if path.is_file() else []
    for _ in range(repeats):
        for count in workers:
            record = run_once(count)
            records.append(record)
            path.write_text(json.dumps(records, indent=1) + "\n")
            print(
                f"-n {count}: {record['wall_s']:.0f} s wall, {record['cpu_s']:.0f} s CPU "
                f"({record['busy_share']:.0%} of the cores), {record['summary']}"
            )
    return 0


def table(records: list[dict[str, Any]]) -> list[str]:
    """One row per run, in the order they ran."""
    rows = [
        [
            r["date"],
            f"`-n {r['workers']}`",
            f"{r['wall_s']:.0f} s ({r['wall_s'] / 60:.1f} min)",
            f"{r['cpu_s']:.0f} s",
            f"{r['busy_share']:.0%}",
            f"{r['load_before']:.1f}" + ("" if r["load_before"] < 0.5 else " (not quiet)"),
            r["summary"],
        ]
        for r in records
    ]
    header = ["date", "workers", "wall", "CPU (user + system)", "cores busy", "load before", "pytest"]
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    """Command line: ``run`` or ``table``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    ran = commands.add_parser("run", help="run the suite per worker count")
    ran.add_argument("--workers", type=int, nargs="+", default=[2, 3])
    ran.add_argument("--repeats", type=int, default=1)
    ran.add_argument("--out", type=Path, default=OUT)
    shown = commands.add_parser("table", help="the recorded runs as markdown")
    shown.add_argument("--out", type=Path, default=OUT)
    shown.add_argument("--write-doc", action="store_true", help=f"write the table into {DOC.name}")
    args = parser.parse_args(argv)
    if args.command == "run":
        if any(count < 1 for count in args.workers) or args.repeats < 1:
            print("error: --workers and --repeats must be at least 1", file=sys.stderr)
            return 2
        return run(args.workers, args.repeats, args.out)
    path = args.out / "runs.json"
    if not path.is_file():
        print(
            f"error: {path} is missing: run `python -P benchmarks/suite_time.py run` first", file=sys.stderr
        )
        return 2
    lines = table(json.loads(path.read_text()))
    if not args.write_doc:
        print("\n".join(lines))
        return 0
    if not replace_generated_block(DOC, lines, begin=BEGIN, end=END):
        print(f"error: {DOC} lacks the markers {BEGIN} ... {END}", file=sys.stderr)
        return 2
    print(f"wrote the table into {DOC}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
