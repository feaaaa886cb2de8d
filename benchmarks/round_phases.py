"""Where a ``python -m fl_app`` run's time goes, by phase: py-spy's samples of every busy thread, sorted.

Runs ``py-spy record --format raw --subprocesses -- python -m fl_app OVERRIDES`` (py-spy 0.4: ``pip
install py-spy``; it reads the processes' stacks from outside, so neither the GIL nor the run's own
threads bias what it sees) and charges every sample of a busy thread to the phase its stack is in.
Samples of a waiting thread are left out (py-spy's own idle test, and a stack whose innermost frame
is in ``threading``, ``queue`` or ``selectors``: py-spy counts a wait with a timeout as busy), so the
phases add up to the time threads were running, about the command's CPU; ``--nonblocking`` keeps
py-spy from pausing the command at each sample (at 100 per second it slowed rounds by under 10 %); a
thread spinning on a CUDA synchronisation counts as busy in the phase that called it. With
``simulation.backend=ray`` the client actors are subprocesses of Ray's raylet, not of this command,
and are not seen: use ``simulation.backend=inline``.

Usage::

    python -P benchmarks/round_phases.py --json OUT.json -- simulation.backend=inline strategy=fedavg ...

Prints one line per phase (and with ``--top N`` the N frames that decided most samples) and writes
the seconds per phase as JSON. Round times come from the run's ``results.json``, not from here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

Rule = tuple[str, tuple[str | None, frozenset[str] | None]]

#: (phase, rule): a rule is a (file part or None, function names or None) pair and matches a frame
#: when both given parts match. SPECIFIC rules are tried first on every frame of a stack, innermost
#: first (so a model's forward pass inside ``train_local`` is training, inside ``evaluate_global``
#: evaluation); then GENERAL rules, innermost first.
SPECIFIC: tuple[Rule, ...] = (
    ("start-up: imports", ("<frozen importlib._bootstrap", None)),
    ("start-up: data set and partition", ("fl_app/data/", None)),
    ("local training", ("fl_app/engine/vectorised_training.py", None)),
    ("local training", ("fl_app/learning/training.py", frozenset({"train_local", "to_tensor"}))),
    (
        "model <-> message arrays",
        ("fl_app/learning/training.py", frozenset({"model_to_arrays", "state_to_arrays"})),
    ),
    ("model <-> message arrays", ("fl_app/learning/training.py", frozenset({"load_arrays"}))),
    ("central evaluation", ("fl_app/run/reporter.py", frozenset({"evaluate"}))),
    ("central evaluation", ("strategies/base.py", frozenset({"evaluate_global"}))),
    ("per-client terms summed (server or packed message)", ("fl_app/learning/sums.py", None)),
    ("server aggregation", (None, frozenset({"aggregate_train", "aggregate"}))),
    ("message copy (pickle)", ("fl_app/engine/inline.py", frozenset({"isolated"}))),
    ("vectorised cohort preparation", ("fl_app/engine/vectorised.py", None)),
    ("dpfl driver: traffic metering", ("fl_app/engine/metering.py", None)),
    ("dpfl driver: traffic metering", ("fl_app/engine/message_sizes.py", None)),
    ("privacy: accounting, mechanisms", ("fl_app/privacy/", None)),
)
GENERAL: tuple[Rule, ...] = (
    ("client: clipping, noise, reply", ("clients/", None)),
    ("client: ClientApp and records", ("fl_app/client_app.py", None)),
    ("Flower: engine, records, messages", ("flwr/", None)),
    ("dpfl engine (batching, dispatch)", ("fl_app/engine/", None)),
    ("dpfl driver (rounds, reports, accounting)", ("fl_app/", None)),
    ("dpfl driver (rounds, reports, accounting)", ("strategies/", None)),
)
OTHER = "other (torch, numpy, Hydra outside dpfl's frames)"


def _matches(rule: Rule, path: str, name: str) -> bool:
    suffix, names = rule[1]
    return (suffix is None or suffix in path) and (names is None or name in names)


def parse_frame(frame: str) -> tuple[str, str, str]:
    """``"name (path:line)"`` (py-spy's raw format) as (path, name, line)."""
    name, _, where = frame.rpartition(" (")
    path, _, line = where.rstrip(")").rpartition(":")
    return (path or where).replace("\\", "/"), name or frame, line


def phase_of(stack: list[str]) -> tuple[str, str]:
    """The phase of a stack (outermost frame first) and the frame that decided it."""
    frames = [parse_frame(frame) for frame in reversed(stack)]
    for rules in (SPECIFIC, GENERAL):
        for path, name, line in frames:
            for rule in rules:
                if _matches(rule, path, name):
                    return rule[0], f"{'/'.join(path.split('/')[-2:])}:{line} {name}"
    return OTHER, frames[0][1] if frames else "-"


#: Where a thread waits (py-spy counts a thread in a wait with a timeout as busy): samples whose
#: innermost frame is one of these are left out.
WAITS = ("threading.py", "queue.py", "selectors.py", "concurrent/futures/_base.py")


def waiting(stack: list[str]) -> bool:
    """Whether the stack's innermost frame is a wait (a lock, an event, a queue, a selector)."""
    return bool(stack) and parse_frame(stack[-1])[0].endswith(WAITS)


def read_samples(raw: str, rate: int) -> tuple[Counter[str], Counter[tuple[str, str]]]:
    """Seconds per phase and per deciding frame from py-spy's raw output (``stack count`` lines)."""
    by_phase: Counter[str] = Counter()
    by_frame: Counter[tuple[str, str]] = Counter()
    for line in raw.splitlines():
        stack_text, _, count = line.rpartition(" ")
        if not stack_text or not count.isdigit():
            continue
        stack = [f for f in stack_text.split(";") if not f.startswith(("process ", "thread "))]
        if waiting(stack):
            continue
        phase, where = phase_of(stack)
        seconds = int(count) / rate
        by_phase[phase] += seconds
        by_frame[phase, where] += seconds
    return by_phase, by_frame


def main(argv: list[str] | None = None) -> int:
    """Run ``python -m fl_app`` under py-spy and print its busy time by phase."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the phases' seconds here")
    parser.add_argument("--rate", type=int, default=100, help="samples per second")
    parser.add_argument("--top", type=int, default=0, help="also print the N frames that decided most")
    parser.add_argument("overrides", nargs="*", help="python -m fl_app's overrides (after --)")
    args = parser.parse_args(argv)
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        print("error: py-spy is not installed (pip install py-spy)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as scratch:
        raw_path = Path(scratch) / "samples.txt"
        command = [spy, "record", "--format", "raw", "--subprocesses", "--nonblocking"]
        command += ["--rate", str(args.rate)]
        command += ["--output", str(raw_path), "--", sys.executable, "-m", "fl_app", *args.overrides]
        started = time.monotonic()
        code = subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": _path()}).returncode
        wall = time.monotonic() - started
        raw = raw_path.read_text() if raw_path.exists() else ""
    by_phase, by_frame = read_samples(raw, args.rate)
    total = sum(by_phase.values())
    print(f"wall {wall:.2f} s, busy {total:.2f} s (py-spy, {args.rate} samples/s), exit {code}")
    for phase, seconds in by_phase.most_common():
        print(f"  {phase:45s} {seconds:8.3f} s  {100 * seconds / max(total, 1e-9):5.1f} %")
    for (phase, where), seconds in by_frame.most_common(args.top):
        print(f"  {seconds:8.3f} s  {phase[:20]:20s} {where}")
    if args.json is not None:
        row = {"overrides": args.overrides, "wall_s": wall, "busy_s": total, "phases_s": dict(by_phase)}
        args.json.write_text(json.dumps(row, indent=1) + "\n")
    return code


def _path() -> str:
    """PYTHONPATH for the command: this checkout first (``-P`` runs do not add it)."""
    return os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


if __name__ == "__main__":
    sys.exit(main())
