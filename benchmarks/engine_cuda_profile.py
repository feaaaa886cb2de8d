"""What the GPU does during a ``python -m fl_app`` run: its kernels and copies, from torch's profiler.

Runs the command in this process (``fl_app.__main__.main``, as ``python -m fl_app`` does) under
``torch.profiler`` with CUDA activity only (every kernel and memory copy the run queued, with the
device's own timings; no CPU operator events, which a 1000-client round would make by the million),
then prints and writes (``--json``) the device time by kind (kernels, host-to-device and
device-to-host copies, memsets), the 15 kernels that took longest, and the run's
median round from its ``results.json``. Written when a 1000-client cohort trained in the engine waited
0.37 s per round on the GPU where the torch-only benchmark trained one in milliseconds.

    python -P benchmarks/engine_cuda_profile.py --json out.json -- <overrides of python -m fl_app>

``--pageable`` moves a trained cohort to the host as before the pinned-memory copy
(``VectorisedResult.to`` with plain ``Tensor.to``): the two variants in one call, for a ratio on one machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile


def _kind(name: str) -> str:
    lowered = name.lower()
    if "memcpy" in lowered and "dtoh" in lowered:
        return "copy device to host"
    if "memcpy" in lowered and "htod" in lowered:
        return "copy host to device"
    if "memcpy" in lowered:
        return "copy other"
    if "memset" in lowered:
        return "memset"
    return "kernels"


def _median_round(output_dir: Path) -> float | None:
    try:
        results = json.loads((output_dir / "results.json").read_text())
    except OSError:
        return None
    times = [r["round_s"] for r in results["rounds"] if r.get("round_s") is not None]
    return statistics.median(times[1:] or times) if times else None


def _use_pageable_copies() -> None:
    from fl_app.engine.vectorised_training import VectorisedResult

    def to(self: Any, device: Any) -> Any:
        return VectorisedResult(params={n: v.to(device) for n, v in self.params.items()}, losses=self.losses)

    VectorisedResult.to = to  # type: ignore[method-assign]


def main() -> int:
    """Run the command under the profiler; print and write the summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--pageable", action="store_true")
    parser.add_argument("overrides", nargs="+")
    args = parser.parse_args()
    if args.pageable:
        _use_pageable_copies()
    output_dir = next(Path(o.split("=", 1)[1]) for o in args.overrides if o.startswith("output_dir="))
    import fl_app.__main__ as entry

    sys.argv = ["fl_app", *args.overrides]
    started = time.perf_counter()
    code: Any = 0
    # without a GPU (a dry run here) the CPU's operators stand in, so that the script can be checked
    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        try:
            code = entry.main()  # what `python -m fl_app` runs, but for its exit_now (os._exit)
        except SystemExit as stop:
            code = stop.code
    wall = time.perf_counter() - started
    by_kind: dict[str, dict[str, float]] = {}
    kernels: list[tuple[float, int, str]] = []
    for average in prof.key_averages():
        device_us = float(
            getattr(
                average,
                "self_device_time_total" if activity == ProfilerActivity.CUDA else "self_cpu_time_total",
                0,
            )
            or 0.0
        )
        if device_us <= 0:
            continue
        kind = _kind(average.key)
        totals = by_kind.setdefault(kind, {"seconds": 0.0, "count": 0})
        totals["seconds"] += device_us / 1e6
        totals["count"] += int(average.count)
        if kind == "kernels":
            kernels.append((device_us / 1e6, int(average.count), average.key[:120]))
    summary = {
        "variant": "pageable" if args.pageable else "pinned",
        "exit": code,
        "wall_s": round(wall, 2),
        "median_round_s": _median_round(output_dir),
        "device_s_by_kind": {
            k: {"seconds": round(v["seconds"], 4), "count": v["count"]} for k, v in by_kind.items()
        },
        "top_kernels": [
            {"seconds": round(s, 4), "count": c, "name": n} for s, c, n in sorted(kernels, reverse=True)[:15]
        ],
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    args.json.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
