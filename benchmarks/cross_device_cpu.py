"""The 2-core CPU goal: the cross-device FedAvg task in pfl-research and in dpfl, interleaved, machine CPU.

The task is ``benchmarks/pfl_compare.py``'s non-private one (Fashion-MNIST, Dirichlet(0.5) over
N = 1000, 100 clients per round, the MLP, one local epoch of batch 32, lr 0.1, evaluation on 2,000
test images after every round; dpfl's own split exported for pfl). Per repeat, in this order:

* ``pfl``: pfl-research 0.6.0, one process, one torch thread (``pfl_compare.py pfl-run``, ``.venv-pfl``);
* ``loop``: the tight single-process PyTorch loop, one torch thread (:func:`tight_rounds`: the same
  rounds' work with nothing else, no messages; ``--loop-run``), the floor of the CPU goal;
* ``loop-pair``: two copies of ``loop`` at once, one per core (what two busy cores cost each other on
  this machine: shared caches, memory bandwidth, the host's other guests); its CPU is per copy;
* ``dpfl-inline``: ``python -m fl_app ... simulation.backend=inline`` from this checkout;
* ``dpfl-ray``: the same command with dpfl's defaults (Ray, two client actors here);
* ``dpfl-processes``: the same with ``simulation.backend=processes`` (two worker processes forked from
  the command, ``fl_app/engine/processes.py``);
* ``dpfl-processes-1``: the same with one forked worker (``simulation.num_cpus=1``): dpfl's work on
  one core beside the driver, to set against ``loop`` and ``loop-pair``;
* ``dpfl-<backend>-before`` (``inline``, ``processes``, ``ray``): the same from ``--before TREE`` (another
  checkout, e.g. ``git worktree add``), only with ``--before``;
* ``dpfl-<backend>-plain``, ``-cohort``, ``-bulk``, ``-bulk-vectorised`` (``inline``, ``ray``,
  ``processes``): the dpfl commands with one message per client (``simulation.pack_messages=false``),
  one message per 16 clients (``true``, ``simulation.bulk=false``: ``fl_app/engine/packed.py``), one
  message per worker trained in bulk (``simulation.bulk=true``: ``fl_app/engine/bulk.py``; the default
  ``auto`` for FedAvg), the same vectorised (``simulation.vectorise=true``).

``--rounds`` takes one number or several (``30,100``): every repeat runs every arm at each, and with
two or more the table adds each arm's **CPU per round**, the machine's CPU between the shortest and
the longest run divided by the rounds between them (start-up and the end of a run cancel out), for
the goal of at most 1.6x the loop's.

``--arms`` picks some of them (default: all; the ``-before`` arms only with ``--before``);
``--dpfl-overrides`` adds overrides to every dpfl arm, e.g. another strategy whose aggregation is a sum
(``'strategy=nbafl privacy.epsilon=50'``: then leave out ``pfl``, which runs FedAvg).
``--task-overrides`` changes the task for the loops and the dpfl arms alike (``pfl`` is left out), e.g.
the 1000-client round: ``'num_clients=10000 clients_per_round=1000 partition=iid'``.

Each command is timed from outside; its CPU is the machine's busy time over the command from
``/proc/stat`` (Ray's processes escape ``getrusage``), so run it on a quiet machine. The round is the
median of rounds 2..R (dpfl: ``results.json``; pfl: its own ``results.json``). The commands inherit
the caller's environment minus ``OMP_NUM_THREADS`` (a user's shell has none)::

    python -P benchmarks/cross_device_cpu.py [--rounds 30[,100]] [--repeats 2] [--before TREE] \
        [--arms A,B] [--out DIR] [--dpfl-overrides 'strategy=... ...'] [--task-overrides '...']

Prints one JSON line per command and a Markdown table; writes ``rows.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import pfl_compare  # noqa: E402 - the pfl side and the exported split

#: pfl_compare's dpfl command for the non-private configuration (the split it exports is this task's).
TASK = (*pfl_compare.CONFIG_OVERRIDES["fedavg"], *pfl_compare.TASK)


def machine_busy_s() -> float:
    """Seconds the machine's CPUs have been busy since boot (user, nice, system, irq, softirq)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / os.sysconf("SC_CLK_TCK")


def dpfl_command(
    tree: Path,
    rounds: int,
    output: Path,
    backend: str,
    cohort: str | None = None,
    overrides: Sequence[str] = (),
    task: Sequence[str] = TASK,
) -> tuple[list[str], Path]:
    """``python -m fl_app`` on ``task`` from ``tree`` (with this checkout's ``.venv``).

    ``backend``: ``ray`` (the default: no override), ``inline`` or ``processes``;
    ``cohort``: one of :data:`COHORT` (None: the defaults);
    ``overrides`` follow the task's (e.g. another strategy: ``--dpfl-overrides``).
    """
    extra = [*overrides, *([] if backend == "ray" else [f"simulation.backend={backend}"])]
    extra += [] if cohort is None else list(COHORT[cohort])
    command = [str(pfl_compare.DPFL_PYTHON), "-m", "fl_app", *task, f"num_rounds={rounds}", *extra]
    return [*command, f"output_dir={output}"], tree


def loop_command(rounds: int, output: Path, task_overrides: str = "") -> tuple[list[str], Path]:
    """The tight loop's run of the task (:func:`loop_run` in a process of its own, dpfl's interpreter)."""
    script = str(Path(__file__).resolve())
    command = [str(pfl_compare.DPFL_PYTHON), "-P", script, "--loop-run", str(output), "--rounds", str(rounds)]
    return [*command, "--task-overrides", task_overrides], ROOT


#: How a dpfl arm sends the cohort: one message per client, one per 16 clients (each member still
#: its own client), or bulk (one message per worker, trained without a client per member).
COHORT: dict[str, tuple[str, ...]] = {
    "plain": ("simulation.pack_messages=false",),
    "cohort": ("simulation.pack_messages=true", "simulation.bulk=false"),
    "bulk": ("simulation.pack_messages=true", "simulation.bulk=true"),
    "bulk-vectorised": ("simulation.pack_messages=true", "simulation.bulk=true", "simulation.vectorise=true"),
}


#: Arms that run several copies of one command at once: their CPU is divided by the copies.
COPIES = {"loop-pair": 2}


PAIR_SCRIPT = "{} & first=$!; {} & second=$!; wait $first; a=$?; wait $second; b=$?; exit $((a || b))"
"""Two commands at once; exit 0 only when both exit 0. ``wait PID`` collects a child that has already ended
(``wait -n`` does not: it exits 127 when both ended before it is called)."""


def loop_pair_command(rounds: int, output: Path, task_overrides: str = "") -> tuple[list[str], Path]:
    """Two :func:`loop_command` runs at once (``output`` and ``output``-2); the shell waits for both."""
    first, _ = loop_command(rounds, output, task_overrides)
    second, _ = loop_command(rounds, output.with_name(output.name + "-2"), task_overrides)
    return ["bash", "-c", PAIR_SCRIPT.format(shlex.join(first), shlex.join(second))], ROOT


def loop_run(rounds: int, output: Path, task: Sequence[str] = TASK) -> None:
    """Run the task's rounds as :func:`tight_rounds`, one torch thread; write results.json.

    The results have dpfl's layout (``rounds[i].round_s``, ``final.accuracy``) plus each round's CPU.
    """
    import torch

    torch.set_num_threads(1)
    times, cpu, accuracy = tight_rounds([*task, f"num_rounds={rounds}"])
    output.mkdir(parents=True, exist_ok=True)
    rows = [{"round_s": t, "cpu_s": c} for t, c in zip(times, cpu, strict=True)]
    (output / "results.json").write_text(json.dumps({"rounds": rows, "final": {"accuracy": accuracy}}))


def tight_rounds(overrides: Sequence[str]) -> tuple[list[float], list[float], float]:
    """The task's FedAvg as the tightest single-process PyTorch loop; per-round wall and CPU, final accuracy.

    From dpfl's initial model for the seed, the same work as a dpfl round (the cohort sampled, each
    client's local SGD from the global model on its own examples in a fresh order per epoch, the float64
    weighted average, the evaluation on the test subset) with nothing else: one model whose parameters
    take the global values in place, each client's examples turned into tensors once, plain SGD steps on
    ``torch.autograd.grad``, the sum kept as float64 tensors, one forward pass over the test examples.
    Its cohorts and orders are its own (seeded), not dpfl's.
    """
    import numpy as np
    import overhead
    import torch

    from fl_app.config.compose import compose_config
    from fl_app.data.federated import ClientDataset, DataSpec, federated_data
    from fl_app.learning.model_spec import ModelSpec
    from fl_app.learning.models import resolve_model_name
    from fl_app.learning.training import torch_seed
    from fl_app.privacy.rng import RandomSource

    cfg = compose_config(list(overrides))
    data = federated_data(DataSpec.from_config(cfg))
    spec = ModelSpec(resolve_model_name(str(cfg.model), data.input_shape), data.input_shape, data.num_classes)
    with torch.random.fork_rng():  # dpfl's initial model (strategies.base.FederatedStrategy.initial_arrays)
        torch.manual_seed(torch_seed(RandomSource(seed=int(cfg.seed)).generator("model-init")))
        model = spec.build()
    params = list(model.parameters())
    x_test, y_test = overhead.test_split(cfg, data)
    test_inputs, test_targets = example_tensors(ClientDataset(x_test, y_test))
    tensors: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    sgd = (int(cfg.local_epochs), int(cfg.batch_size), float(cfg.lr))
    sampling = np.random.default_rng(int(cfg.seed))
    orders = torch.Generator().manual_seed(int(cfg.seed))
    times, cpu, accuracy = [], [], float("nan")
    for _ in range(int(cfg.num_rounds)):
        started, cpu_started = time.monotonic(), time.process_time()
        chosen = sampling.choice(int(cfg.num_clients), size=int(cfg.clients_per_round), replace=False)
        start = [p.detach().clone() for p in params]
        sums = [torch.zeros_like(p, dtype=torch.float64) for p in params]
        weight = 0
        for client in sorted(int(c) for c in chosen):
            if client not in tensors:
                tensors[client] = example_tensors(data.client(client))
            tight_client(model, params, start, tensors[client], sgd=sgd, orders=orders, sums=sums)
            weight += len(tensors[client][1])
        with torch.no_grad():
            torch._foreach_copy_(params, [total / weight for total in sums])
            accuracy = float((model(test_inputs).argmax(dim=1) == test_targets).float().mean())
        times.append(time.monotonic() - started)
        cpu.append(time.process_time() - cpu_started)
    return times, cpu, accuracy


def example_tensors(data: Any) -> tuple[Any, Any]:
    """A ``ClientDataset``'s inputs (:func:`fl_app.learning.training.to_tensor`'s) and int64 labels."""
    import numpy as np
    import torch

    from fl_app.learning.training import to_tensor

    return to_tensor(data.x), torch.from_numpy(np.asarray(data.y, dtype=np.int64))


def tight_client(
    model: Any,
    params: Sequence[Any],
    start: Sequence[Any],
    examples: tuple[Any, Any],
    *,
    sgd: tuple[int, int, float],
    orders: Any,
    sums: Sequence[Any],
) -> None:
    """One client in the tight loop: the global values ``start`` into ``model``, local SGD, into ``sums``.

    ``params``: ``list(model.parameters())``, made once by the caller; ``examples``: the client's
    inputs and labels as tensors (:func:`example_tensors`); ``sgd``: epochs, batch size, learning rate;
    ``orders``: the ``torch.Generator`` of the examples' order; ``sums``: float64 tensors (one per
    parameter) that take the number of examples times the result.
    """
    import torch
    from torch.nn import functional as F  # noqa: N812

    (x, y), (epochs, batch, lr) = examples, sgd
    with torch.no_grad():
        torch._foreach_copy_(params, start)
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=orders)
        for first in range(0, len(y), batch):
            index = order[first : first + batch]
            grads = torch.autograd.grad(F.cross_entropy(model(x[index]), y[index]), params)
            with torch.no_grad():
                torch._foreach_add_(params, grads, alpha=-lr)
    with torch.no_grad():
        for total, parameter in zip(sums, params, strict=True):
            total.add_(parameter, alpha=len(y))


def pfl_command(data: Path, rounds: int, output: Path) -> tuple[list[str], Path]:
    """pfl-research's run of the task on the exported split."""
    script = str(pfl_compare.SCRIPT)
    command = [str(pfl_compare.PFL_PYTHON), "-P", script, "pfl-run", "--data", str(data)]
    command += ["--config", "fedavg"]
    return [*command, "--rounds", str(rounds), "--output-dir", str(output), "--seed", "43"], ROOT


def summary(arm: str, output: Path) -> tuple[float, float]:
    """Median round after the first and final accuracy of a finished run."""
    if arm == "pfl":
        result = pfl_compare.pfl_run_summary(output)
        rounds, accuracy = list(result["round_s"]), float(result["final_accuracy"])
    else:
        result = json.loads((output / "results.json").read_text())
        rounds, accuracy = [r["round_s"] for r in result["rounds"]], float(result["final"]["accuracy"])
    return statistics.median(rounds[1:]), accuracy


def main() -> int:
    """Run the arms interleaved and print the rows."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", default="30", help="rounds per run; several: '30,100'")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--before", type=Path, help="another checkout to run as dpfl-*-before")
    parser.add_argument("--arms", help="comma-separated arms to run (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "cross_device_cpu")
    parser.add_argument(
        "--dpfl-overrides",
        default="",
        help="overrides after the task's for every dpfl arm, e.g. 'strategy=nbafl privacy.epsilon=50'",
    )
    parser.add_argument(
        "--task-overrides",
        default="",
        help="overrides after the task's for the loop and every dpfl arm (not pfl), e.g. the 1000-client "
        "round 'num_clients=10000 clients_per_round=1000 partition=iid'",
    )
    parser.add_argument("--loop-run", type=Path, help=argparse.SUPPRESS)  # the loop arm's own process
    args = parser.parse_args()
    try:
        round_counts = sorted({int(part) for part in args.rounds.split(",")})
    except ValueError:
        raise SystemExit(f"--rounds: {args.rounds!r} is not a number or comma-separated numbers") from None
    task = (*TASK, *shlex.split(args.task_overrides))
    if args.loop_run is not None:
        loop_run(round_counts[-1], args.loop_run, task)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    data = args.out / "partition.npz"
    if not data.exists():
        export = [str(pfl_compare.DPFL_PYTHON), "-P", str(pfl_compare.SCRIPT), "export", "--data", str(data)]
        subprocess.run(export, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    arms = all_arms(data, args.before, shlex.split(args.dpfl_overrides), args.task_overrides)
    if args.task_overrides:
        arms.pop("pfl")  # pfl runs the exported task only
    if args.arms:
        wanted = args.arms.split(",")
        unknown = sorted(set(wanted) - set(arms))
        if unknown:
            raise SystemExit(f"--arms: unknown {unknown}; the arms are {sorted(arms)}")
        arms = {name: arms[name] for name in wanted}
    rows = run_rows(arms, round_counts, args.repeats, args.out)
    (args.out / "rows.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(["", *table_lines(rows)]))
    if len(round_counts) > 1:
        print("\n".join(["", *per_round_lines(rows, round_counts[0], round_counts[-1])]))
    return 0


#: Seconds one arm's command may run (a 100-round run takes under a minute here; a hung one ends the run).
COMMAND_LIMIT_S = 1800.0
#: An arm: (rounds, output directory) -> (command, working directory).
Arm = Callable[[int, Path], tuple[list[str], Path]]


def all_arms(
    data: Path, before: Path | None, overrides: Sequence[str], task_overrides: str = ""
) -> dict[str, Arm]:
    """Every arm, by name (``-before`` arms only with ``before``)."""
    overall = (*TASK, *shlex.split(task_overrides))
    task = functools.partial(dpfl_command, overrides=overrides, task=overall)
    arms: dict[str, Arm] = {
        "pfl": lambda rounds, out: pfl_command(data, rounds, out),
        "loop": functools.partial(loop_command, task_overrides=task_overrides),
        "loop-pair": functools.partial(loop_pair_command, task_overrides=task_overrides),
    }
    for backend in ("inline", "processes", "ray"):
        arms[f"dpfl-{backend}"] = functools.partial(task, ROOT, backend=backend)
        if before is not None:
            arms[f"dpfl-{backend}-before"] = functools.partial(task, before.resolve(), backend=backend)
    arms["dpfl-processes-1"] = functools.partial(
        dpfl_command, ROOT, backend="processes", overrides=[*overrides, "simulation.num_cpus=1"], task=overall
    )
    for backend in ("inline", "ray", "processes"):
        for kind in COHORT:
            arms[f"dpfl-{backend}-{kind}"] = functools.partial(task, ROOT, backend=backend, cohort=kind)
    return arms


def run_rows(
    arms: dict[str, Arm], round_counts: Sequence[int], repeats: int, out: Path
) -> list[dict[str, Any]]:
    """Run every arm at every round count, ``repeats`` times, interleaved; one row per command."""
    rows = []
    for repeat in range(1, repeats + 1):
        for rounds in round_counts:
            for arm, make in arms.items():
                output = out / f"{arm}-{rounds}r-{repeat}-{time.strftime('%H%M%S')}"
                command, cwd = make(rounds, output)
                wall, cpu = timed_command(arm, command, cwd)
                cpu /= COPIES.get(arm, 1)
                median, accuracy = summary(arm, output)
                row = {
                    "arm": arm,
                    "repeat": repeat,
                    "rounds": rounds,
                    "command_s": round(wall, 2),
                    "machine_cpu_s": round(cpu, 2),  # per copy (COPIES)
                    "copies": COPIES.get(arm, 1),
                    "median_round_s": round(median, 4),
                    "accuracy": accuracy,
                    "load_1min": round(os.getloadavg()[0], 2),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def timed_command(arm: str, command: list[str], cwd: Path) -> tuple[float, float]:
    """Run one arm's command; its wall seconds and the machine's busy CPU seconds meanwhile.

    ``SystemExit`` with the arm's name when it fails or runs past :data:`COMMAND_LIMIT_S`.
    """
    environment = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # a user's shell has none
    busy, started = machine_busy_s(), time.perf_counter()
    try:
        finished = subprocess.run(
            command, cwd=cwd, capture_output=True, text=True, env=environment, timeout=COMMAND_LIMIT_S
        )
    except subprocess.TimeoutExpired:
        raise SystemExit(f"{arm} ran past {COMMAND_LIMIT_S:.0f} s: stopped") from None
    wall, cpu = time.perf_counter() - started, machine_busy_s() - busy
    if finished.returncode != 0:
        raise SystemExit(f"{arm} failed ({finished.returncode}): {finished.stderr[-2000:]}")
    return wall, cpu


def table_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One Markdown row per command."""
    lines = ["| arm | rounds | repeat | command s | machine CPU s | median round s | final accuracy |"]
    lines.append("|---|---|---|---|---|---|---|")
    for row in rows:
        lines.append(
            f"| {row['arm']} | {row['rounds']} | {row['repeat']} | {row['command_s']} | "
            f"{row['machine_cpu_s']} | {row['median_round_s']} | {row['accuracy']:.4f} |"
        )
    return lines


def per_round_lines(rows: Sequence[dict[str, Any]], fewest: int, most: int) -> list[str]:
    """Each arm's machine CPU per round, per repeat: (CPU at ``most`` - CPU at ``fewest``) / rounds between.

    With a ``loop`` arm, each arm's value is also given as a multiple of the loop's in the same repeat.
    """
    cpu = {(r["arm"], r["repeat"], r["rounds"]): float(r["machine_cpu_s"]) for r in rows}
    per_round = {
        (arm, repeat): (cpu[(arm, repeat, most)] - cpu[(arm, repeat, fewest)]) / (most - fewest)
        for arm, repeat, rounds in cpu
        if rounds == most and (arm, repeat, fewest) in cpu
    }
    header = f"| arm | repeat | machine CPU per round s (rounds {fewest}..{most}) | x loop |"
    lines = [header, "|---|---|---|---|"]
    for (arm, repeat), value in per_round.items():
        loop = per_round.get(("loop", repeat))
        ratio = f"{value / loop:.2f}" if loop else ""
        lines.append(f"| {arm} | {repeat} | {value:.4f} | {ratio} |")
    return lines


if __name__ == "__main__":
    sys.exit(main())
