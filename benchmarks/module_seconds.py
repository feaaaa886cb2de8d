"""Seconds of each test module in a whole-suite run, for ordering the modules (``tests/module_seconds.json``).

Usage (from the repository root)::

    .venv/bin/python -m pytest -q -p no:cacheprovider --junitxml=/tmp/suite.xml
    python -P benchmarks/module_seconds.py /tmp/suite.xml [--out tests/module_seconds.json]

Sums the durations JUnit records per test (set-up, call and teardown) by module. ``tests/conftest.py``
hands the modules to the pytest-xdist processes longest first (each module runs whole in one
process, ``--dist loadscope``), so that no long module starts last and runs alone at the end of the
suite; a module missing from the file is placed by the median. The order changes how the suite packs
onto the cores, never what a test checks: regenerate after a module grew or shrank a lot.
"""

from __future__ import annotations

import argparse
import collections
import json
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "module_seconds.json"


def module_seconds(junit_xml: Path) -> dict[str, float]:
    """``{"tests/test_x.py": seconds}``, summed over the module's test cases, longest first."""
    totals: collections.Counter[str] = collections.Counter()
    for case in ElementTree.parse(junit_xml).iter("testcase"):
        module = "tests/" + case.get("classname", "").split(".")[-1] + ".py"
        totals[module] += float(case.get("time", 0.0))
    return {module: round(seconds, 1) for module, seconds in totals.most_common()}


def main() -> None:
    """Write the module seconds of a JUnit XML file (the command line in the module docstring)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("junit_xml", type=Path)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    args.out.write_text(json.dumps(module_seconds(args.junit_xml), indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
