"""The README's first run: DP-FedAvg's quick example, kept as it ran and shown trimmed.

Usage (from the repository root)::

    python -P benchmarks/quick_example.py run     # run it, keep it in docs/benchmarks/quick_example/
    python -P benchmarks/build_docs.py            # the README's block from the kept run

``run`` executes ``python -m fl_app +experiment=quick strategy=dp_fedavg`` into a temporary folder
and keeps, in :data:`KEPT`, what a person saw (``console.txt``: the command's whole output, the
output folder written ``<output dir>``, colours removed) and its ``results.json`` (the run's figures,
its configuration and the code version that ran). ``benchmarks/build_docs.py`` then writes the README's
example (:func:`readme_block`: the command and its output, trimmed) from ``console.txt``, after checking
that the console's last line and ``results.json`` agree. The README's figures therefore always come from
one kept run, as the benchmark tables do; run this again when the code changes what the example prints.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Where the run is kept.
KEPT = ROOT / "docs" / "benchmarks" / "quick_example"
#: The example's command line, as the README shows it.
COMMAND = ("+experiment=quick", "strategy=dp_fedavg")
SHOWN_COMMAND = "$ .venv/bin/python -m fl_app " + " ".join(COMMAND)
_ROUND = re.compile(r"dpfl round (\d+)/(\d+):")
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def run(kept: Path = KEPT) -> int:
    """Run the example and keep its console output and results; the command's exit status."""
    with tempfile.TemporaryDirectory(prefix="dpfl-quick-") as temporary:
        output_dir = Path(temporary) / "run"
        done = subprocess.run(
            [sys.executable, "-m", "fl_app", *COMMAND, f"output_dir={output_dir}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        console = _COLOUR.sub("", done.stdout + done.stderr).replace(str(output_dir), "<output dir>")
        if done.returncode != 0:
            print(console[-3000:], file=sys.stderr)
            return done.returncode
        kept.mkdir(parents=True, exist_ok=True)
        (kept / "console.txt").write_text(console)
        shutil.copy2(output_dir / "results.json", kept / "results.json")
    print(f"kept the quick example in {kept.relative_to(ROOT)}")
    return 0


def trimmed(console: str) -> list[str]:
    """The console's lines a reader needs: no strategy parameter lines; rounds 1, 2, the middle, the last."""
    lines = [line for line in console.splitlines() if line.strip() and "│\t" not in line]
    rounds = [int(match.group(1)) for line in lines if (match := _ROUND.search(line))]
    last = max(rounds, default=0)
    shown = {1, 2, last // 2, last}
    out: list[str] = []
    for line in lines:
        match = _ROUND.search(line)
        if match is None or int(match.group(1)) in shown:
            out.append(line)
        elif out[-1] != "...":
            out.append("...")
    return out


def check_agrees(console: str, results: dict[str, object]) -> None:
    """Raise SystemExit unless the console's last round and final accuracy are the kept results'."""
    final = results["final"]
    assert isinstance(final, dict)
    finished = next((line for line in console.splitlines() if "dpfl: finished" in line), "")
    expected = f"finished {final['rounds']} rounds"
    accuracy = f"final accuracy {final['accuracy']:.4g}"
    if expected not in finished or accuracy not in finished:
        raise SystemExit(
            f"{KEPT.relative_to(ROOT)}: console.txt and results.json are not one run ({expected}, "
            f"{accuracy}; console: {finished!r})"
        )


def readme_block(kept: Path = KEPT) -> list[str]:
    """The README's example: a fenced block with the command and the kept run's output, trimmed."""
    console_file, results_file = kept / "console.txt", kept / "results.json"
    if not console_file.is_file() or not results_file.is_file():
        where = kept.relative_to(ROOT)
        return [f"(not yet run: `python -P benchmarks/quick_example.py run` keeps it in `{where}`)"]
    console = console_file.read_text()
    check_agrees(console, json.loads(results_file.read_text()))
    return ["```", SHOWN_COMMAND, *trimmed(console), "```"]


def main(argv: list[str] | None = None) -> int:
    """Command line: ``run``."""
    args = sys.argv[1:] if argv is None else argv
    if args != ["run"]:
        print("usage: python -P benchmarks/quick_example.py run", file=sys.stderr)
        return 2
    return run()


if __name__ == "__main__":
    raise SystemExit(main())
