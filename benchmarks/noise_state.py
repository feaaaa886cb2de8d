"""Correlated noise at the word LSTM's size: the server's peak memory and checkpoint at round R, per arm.

Usage (from the repository root)::

    .venv/bin/python -P benchmarks/noise_state.py [--params 4050748] [--round 400] [--computed 4]
        [--arms bandmf blt] [--tree /work/base-131b590 --tree-params 253172]

Each arm is a strategy in ``so_bandmf``'s schedule (2052 rounds, 342 public groups, server momentum
0.95, epsilon 8 at delta 1e-6; here 342 clients, one a round: the noise does not depend on the
cohort's size), built as a run builds it and driven on constructed replies (no Ray, no training):
every selected client returns the global model, a flat float32 vector of ``--params`` parameters
(the word LSTM's 4,050,748 by default; the strategy sees an array of that size, as from a linear
model of that size). Rounds ``1 .. R - computed`` are only charged to the accountant; the last
``--computed`` rounds run in full (clip, sum, correlated noise, momentum step), then the checkpoint
of round R is written as a run writes it (``fl_app/run/checkpoint.py``). Arms:

* ``bandmf``: ``strategy=dp_bandmf strategy.bands=342`` at the default ``strategy.noise_memory_gib``
  (1 GiB: at 4 M parameters the 341 noise vectors do not fit, so every ``z_s`` is drawn again);
  its state does not depend on the rounds that were only charged;
* ``bandmf-kept``: the same with the 341 vectors kept in memory (``noise_memory_gib=1000``); its
  first computed round replays the recursion from round 1 (as a resumed run does);
* ``bandmf-drawn``: the same with nothing kept (``noise_memory_gib=0``: every ``z_s`` drawn again);
* ``blt``: ``strategy=dp_blt`` (buffers ``auto``), when ``strategies/dp_blt/`` exists;
* ``before``: with ``--tree`` (a checkout of the commit before the keyed noise, e.g. a ``git
  worktree``), that tree's ``dp_bandmf``, whose ``CorrelatedNoise`` keeps and pickles the last 341
  noise vectors in float64: all R rounds computed, at ``--tree-params`` parameters (it cannot hold
  341 x 4 M float64 values, 11 GB, and pickle them on this machine), beside ``bandmf-kept`` and
  ``bandmf-drawn`` at the same size.

Each arm runs in its own process and prints one JSON line: the resident set after setup, its peak
during the computed rounds and during the checkpoint's write (``VmHWM``, reset between phases
through ``/proc/self/clear_refs``), the checkpoint's bytes, and the wall and CPU seconds of each
computed round (the CPU of every thread of the process: the keyed stream draws chunks in threads).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: so_bandmf's schedule (conf/experiment/so_bandmf.yaml), one client a round.
SCHEDULE = [
    "dataset=digits",
    "partition=iid",
    "num_clients=342",
    "clients_per_round=1",
    "num_rounds=2052",
    "privacy.epsilon=8",
    "privacy.delta=1e-6",
    "strategy.server_momentum=0.95",
]
ARMS = {
    "bandmf": ["strategy=dp_bandmf", "strategy.bands=342"],
    "bandmf-kept": ["strategy=dp_bandmf", "strategy.bands=342", "strategy.noise_memory_gib=1000"],
    "bandmf-drawn": ["strategy=dp_bandmf", "strategy.bands=342", "strategy.noise_memory_gib=0"],
    "blt": ["strategy=dp_blt"],
    "before": ["strategy=dp_bandmf", "strategy.bands=342"],
}


def peak_rss_mb() -> float:
    """The process's peak resident set since the last :func:`reset_peak` (``VmHWM``), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    """The current resident set (``VmRSS``), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak() -> None:
    """Start a new peak: ``VmHWM`` back to the current resident set (Linux ``clear_refs`` 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def one(arm: str, params: int, last: int, computed: int) -> dict[str, Any]:
    """Build the arm's strategy, run its rounds up to ``last``, write the checkpoint; the measurements."""
    import numpy as np
    from flwr.app import Array, ArrayRecord, ConfigRecord

    from fl_app.engine.messages import set_task_identity
    from fl_app.run.checkpoint import Checkpoint, save_checkpoint
    from fl_app.run.harness import reply_with, run_context_for
    from strategies import STRATEGIES

    set_task_identity(run_id=1)  # messages built outside a run
    out = Path(tempfile.mkdtemp(prefix="noise_state_"))
    run = run_context_for([*SCHEDULE, *ARMS[arm]], out)
    strategy = STRATEGIES.get(run.settings.strategy)(run)
    current = ArrayRecord({"w": Array(np.zeros(params, dtype=np.float32))})
    first = last - computed + 1
    for server_round in range(1, first):  # charged, not computed
        strategy._record_release(server_round)
    setup_mb = rss_mb()
    reset_peak()
    rounds = []
    for server_round in range(first, last + 1):
        wall, cpu = time.perf_counter(), time.process_time()
        messages = list(strategy.configure_train(server_round, current, ConfigRecord(), grid=None))
        new, _ = strategy.aggregate_train(server_round, [reply_with(m, current) for m in messages])
        current = new if new is not None else current
        rounds.append(
            {"round": server_round, "wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}
        )
    rounds_peak = peak_rss_mb()
    reset_peak()
    checkpoint = Checkpoint(last, run.settings.num_rounds, "incomplete", [], "", current, strategy, {}, 0.0)
    path = save_checkpoint(out, checkpoint, run)
    result = {
        "arm": arm,
        "params": params,
        "round": last,
        "computed": computed,
        "setup_rss_mb": round(setup_mb, 1),
        "rounds_peak_rss_mb": round(rounds_peak, 1),
        "checkpoint_peak_rss_mb": round(peak_rss_mb(), 1),
        "checkpoint_mb": round(path.stat().st_size / 1e6, 2),
        "rounds": [{k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()} for r in rounds],
    }
    path.unlink()
    return result


def launch(arm: str, params: int, last: int, computed: int, tree: Path | None) -> dict[str, Any]:
    """Run :func:`one` in a fresh process (its own peak), from ``tree`` when given; its JSON line."""
    source = tree or ROOT
    command = [
        sys.executable,
        "-P",
        str(Path(__file__).resolve()),
        "one",
        arm,
        str(params),
        str(last),
        str(computed),
    ]
    env = {**os.environ, "PYTHONPATH": str(source)}
    done = subprocess.run(command, cwd=source, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"arm {arm} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Run the arms one after another; print each JSON line, then a markdown table."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "one":
        arm, params, last, computed = argv[1], int(argv[2]), int(argv[3]), int(argv[4])
        print(json.dumps(one(arm, params, last, computed)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=4_050_748)
    parser.add_argument("--round", type=int, default=400)
    parser.add_argument("--computed", type=int, default=4)
    parser.add_argument(
        "--arms", nargs="+", default=["bandmf", "blt"], choices=[a for a in ARMS if a != "before"]
    )
    parser.add_argument("--tree", type=Path, help="a checkout of the commit before: adds the 'before' arm")
    parser.add_argument("--tree-params", type=int, default=253_172)
    args = parser.parse_args(argv)
    runs: list[tuple[str, int, int, Path | None]] = []
    for arm in args.arms:
        if arm == "blt" and not (ROOT / "strategies" / "dp_blt").is_dir():
            print("blt: strategies/dp_blt/ does not exist here: left out", file=sys.stderr)
            continue
        runs.append((arm, args.params, args.computed, None))
    if args.tree is not None:
        runs += [
            ("before", args.tree_params, args.round, args.tree),
            ("bandmf-kept", args.tree_params, args.computed, None),
            ("bandmf-drawn", args.tree_params, args.computed, None),
        ]
    rows = []
    for arm, params, computed, tree in runs:
        result = launch(arm, params, args.round, computed, tree)
        print(json.dumps(result), flush=True)
        rows.append(result)
    print(
        "\n| arm | parameters | round | RSS after setup (MB) | peak in the rounds (MB) | peak writing the "
        "checkpoint (MB) | checkpoint (MB) | last round: wall s / CPU s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        final = r["rounds"][-1]
        print(
            f"| {r['arm']} | {r['params']:,} | {r['round']} | {r['setup_rss_mb']:,.0f} | "
            f"{r['rounds_peak_rss_mb']:,.0f} | {r['checkpoint_peak_rss_mb']:,.0f} | "
            f"{r['checkpoint_mb']:,.1f} | "
            f"{final['wall_s']:.2f} / {final['cpu_s']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
