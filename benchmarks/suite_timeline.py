"""When each test module ran in which test process, and each test's CPU: a pytest plugin and its report.

Usage (from the repository root; ``-p`` loads this module as a plugin in every xdist process)::

    rm -rf /tmp/timeline; export DPFL_SUITE_TIMELINE=/tmp/timeline
    .venv/bin/python -m pytest -q -p no:cacheprovider -p benchmarks.suite_timeline
    python -P benchmarks/suite_timeline.py /tmp/timeline [--top 30]

The plugin appends one line per test to ``<folder>/<process>.tsv``: the test's start (Unix time), its
wall seconds, the CPU seconds of the test process itself (``RUSAGE_SELF``, all its threads) and of the
subprocesses it waited for in the meantime (``RUSAGE_CHILDREN``: the commands and deployments a test
runs; processes that are re-parented, Ray's and joblib's workers, are not counted: see
``benchmarks/process_cpu.py`` for those). The report prints, per process, when each module started and
ended (a long module that starts late runs alone at the end of the suite), the CPU per module and the
costliest tests.
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import sys
import time
from pathlib import Path

#: The folder the plugin writes to; unset: the plugin records nothing.
FOLDER_ENV = "DPFL_SUITE_TIMELINE"
_started: dict[str, tuple[float, float, float]] = {}
#: This process's pytest configuration (:func:`pytest_configure`).
_config: list[object] = []


def pytest_configure(config: object) -> None:
    """Keep the configuration (pytest-xdist's controller sees every worker's reports: it records none)."""
    _config[:] = [config]


def _is_controller() -> bool:
    return bool(_config) and _config[0].pluginmanager.has_plugin("dsession")  # type: ignore[attr-defined]


def _cpu() -> tuple[float, float]:
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


def pytest_runtest_logstart(nodeid: str, location: object) -> None:
    """Note the test's start: wall clock and the two CPU counters."""
    if os.environ.get(FOLDER_ENV) and not _is_controller():
        _started[nodeid] = (time.time(), *_cpu())


def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
    """Append the test's line to this process's file."""
    folder = os.environ.get(FOLDER_ENV)
    if not folder or nodeid not in _started:
        return
    start, own, children = _started.pop(nodeid)
    own_now, children_now = _cpu()
    process = os.environ.get("PYTEST_XDIST_WORKER", "main")
    Path(folder).mkdir(parents=True, exist_ok=True)
    fields = (
        f"{start:.3f}",
        f"{time.time() - start:.3f}",
        f"{own_now - own:.3f}",
        f"{children_now - children:.3f}",
    )
    with open(Path(folder) / f"{process}.tsv", "a") as out:
        out.write("\t".join((*fields, nodeid)) + "\n")


def load(folder: Path) -> list[tuple[str, float, float, float, float, str]]:
    """Every recorded test: (process, start, wall, own CPU, children's CPU, node id)."""
    rows = []
    for path in sorted(folder.glob("*.tsv")):
        for line in path.read_text().splitlines():
            start, wall, own, children, nodeid = line.split("\t")
            rows.append((path.stem, float(start), float(wall), float(own), float(children), nodeid))
    return rows


def report(folder: Path, top: int) -> str:
    """The per-process module timeline, the CPU per module and the ``top`` costliest tests."""
    rows = load(folder)
    if not rows:
        return f"nothing recorded in {folder}"
    origin = min(row[1] for row in rows)
    spans: dict[tuple[str, str], list[float]] = {}
    cpu: collections.Counter[str] = collections.Counter()
    waited: collections.Counter[str] = collections.Counter()
    for process, start, wall, own, children, nodeid in rows:
        module = nodeid.split("::")[0]
        span = spans.setdefault((process, module), [start - origin, start - origin + wall])
        span[0], span[1] = min(span[0], start - origin), max(span[1], start - origin + wall)
        cpu[module] += own
        waited[module] += children
    lines = ["process  start    end  module"]
    for (process, module), (begin, end) in sorted(spans.items(), key=lambda item: (item[0][0], item[1][0])):
        lines.append(f"{process:>7} {begin:6.0f} {end:6.0f}  {module}")
    lines += ["", "own CPU  subprocesses  module"]
    for module, seconds in cpu.most_common():
        lines.append(f"{seconds:7.1f} {waited[module]:13.1f}  {module}")
    lines += ["", f"own CPU  subprocesses   wall  test (the {top} costliest)"]
    for _, _, wall, own, children, nodeid in sorted(rows, key=lambda row: -(row[3] + row[4]))[:top]:
        lines.append(f"{own:7.1f} {children:13.1f} {wall:6.1f}  {nodeid}")
    total_own, total_children = sum(row[3] for row in rows), sum(row[4] for row in rows)
    lines += [
        "",
        f"{len(rows)} tests: {total_own:.0f} s in the test processes, {total_children:.0f} s waited for",
    ]
    return "\n".join(lines)


def main() -> None:
    """Print the report of a folder the plugin wrote (the command line in the module docstring)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("folder", type=Path)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    print(report(args.folder, args.top))


if __name__ == "__main__":
    sys.exit(main())
