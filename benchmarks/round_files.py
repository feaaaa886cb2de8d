"""Which of dpfl's files one training round runs, from ``play`` to the accountant's event.

A reader who follows one round of an algorithm must open every file whose code the round runs. This
script runs a short simulation in this process (``simulation.backend=inline``: the clients run here,
so one profiler sees server and clients), records every function call made in dpfl's own packages
(``fl_app``, ``strategies``, ``clients``) between the entry of :func:`fl_app.run.server.play` (set-up
excluded) and the first privacy event the round records (``PrivacyAccountant.record``, for a
private algorithm) or the end of its ``aggregate_train`` (a non-private one), and prints the files
with their line counts.

Usage::

    python benchmarks/round_files.py strategy=dp_fedavg        # the default
    python benchmarks/round_files.py strategy=fedavg --list    # and each file

Counted as ``files`` (distinct paths) and ``lines`` (their total length in lines).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = tuple(str(ROOT / name) + "/" for name in ("fl_app", "strategies", "clients"))
SMALL = (
    "dataset=digits",
    "num_clients=6",
    "clients_per_round=3",
    "num_rounds=1",
    "batch_size=16",
    "simulation.backend=inline",
)


class RoundTracer:
    """A profile function that records dpfl's files called between ``play`` and the round's end."""

    def __init__(self) -> None:
        self.active = False
        self.done = False
        self.files: set[str] = set()

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        """Record the called function's file while the round runs (``sys.setprofile``'s signature)."""
        if event != "call" or self.done:
            return
        code = frame.f_code
        path = code.co_filename
        if not path.startswith(PACKAGES):
            return
        if not self.active:
            if code.co_name == "play" and path.endswith(("fl_app/run.py", "fl_app/run/server.py")):
                self.active = True
            else:
                return
        self.files.add(path)
        if code.co_name == "record" and path.endswith("accountant.py"):
            self.done = True

    def end_of_aggregation(self, frame: Any, event: str, arg: Any) -> None:
        """Stop at the return of ``aggregate_train`` (a strategy without an accountant)."""
        if event == "return" and self.active and frame.f_code.co_name == "aggregate_train":
            self.done = True


def main(argv: list[str] | None = None) -> int:
    """Run one round under the tracer; print the count (and the files with ``--list``)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", default=["strategy=dp_fedavg"])
    parser.add_argument("--list", action="store_true", help="print each file and its lines")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from fl_app.api import run_experiment

    tracer = RoundTracer()

    def profile(frame: Any, event: str, arg: Any) -> None:
        tracer(frame, event, arg)
        tracer.end_of_aggregation(frame, event, arg)

    with tempfile.TemporaryDirectory() as folder:
        sys.setprofile(profile)
        threading.setprofile(profile)
        try:
            run_experiment(*SMALL, *args.overrides, output_dir=Path(folder) / "run")
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
    files = sorted(tracer.files)
    lines = {path: len(Path(path).read_text(encoding="utf-8").splitlines()) for path in files}
    if args.list:
        for path in files:
            print(f"{lines[path]:6d}  {Path(path).relative_to(ROOT)}")
    print(f"{' '.join(args.overrides)}: files={len(files)} lines={sum(lines.values())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
