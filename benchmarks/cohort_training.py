r"""A cohort's local training: the per-client loop against one vectorised computation.

Usage::

    OMP_NUM_THREADS=1 python -P benchmarks/cohort_training.py --device cpu --clients 100 \\
        --models mlp,cnn --epochs 1,5 --repeats 3 [--schedules prefix,pad,bucket] [--chunks 0,128] \\
        [--json OUT]

The shape is the cross-device one: Fashion-MNIST-like inputs (random 1x28x28 images in [0, 1], 10
classes), ``--clients`` clients of about ``--mean-size`` (60) examples each, the sizes
``1 + Multinomial(clients * (mean - 1), Dirichlet(alpha))`` (``--alpha`` 1: a few clients hold
several hundred examples, many a handful), batch 32, lr 0.1 (``--momentum``, ``--mu``: 0), every
client starting from the same global model.

Two paths train the same clients on the same per-client example orders (each client's own
``numpy.random.Generator`` draws one permutation per epoch, as ``fl_app.learning.training.train_local``):

* ``loop``: one model, and per client the global parameters copied in and ``train_local``'s loop
  (``fl_app.learning.training`` imports Flower, so the loop is re-implemented here: per-epoch permutation,
  batches in that order, ``F.cross_entropy``, the single-tensor SGD update of ``fl_app.learning.optim.SGD``);
* ``cohort``: :func:`fl_app.engine.vectorised_training.plan_from_generators` then
  ``fl_app.engine.vectorised_training.train_vectorised`` (per ``--schedules`` and ``--chunks``; 0: the whole
  cohort at once).

Per repeat the paths run interleaved (loop, then each cohort variant); the table reports medians of
the seconds of local training per round (including turning each client's examples into tensors,
drawing the orders and, for the cohort, the plan), the speed-up loop / cohort and the largest
absolute difference between the two paths' trained parameters. The timed code is torch and numpy
only: this script imports nothing else (``fl_app`` without Flower, Ray or Hydra; checked at start:
importing one of them raises), so it runs unchanged on a CUDA machine that has only torch and numpy.
"""

from __future__ import annotations

import argparse
import importlib.abc
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

#: Packages this benchmark must run without (a GPU machine may have only torch and numpy).
FORBIDDEN = ("flwr", "ray", "hydra", "omegaconf")


class _Forbid(importlib.abc.MetaPathFinder):
    """Makes importing a :data:`FORBIDDEN` package fail, as on a machine that lacks it."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        """Raise ``ImportError`` for a forbidden package; let the usual finders find every other."""
        if fullname.split(".")[0] in FORBIDDEN:
            raise ImportError(f"benchmarks/cohort_training.py must not import {fullname}")
        return None


def forbid_imports() -> None:
    """Make :data:`FORBIDDEN` packages unimportable (exit if one is already imported)."""
    already = sorted(name for name in sys.modules if name.split(".")[0] in FORBIDDEN)
    if already:
        raise SystemExit(f"already imported before the benchmark started: {already}")
    sys.meta_path.insert(0, _Forbid())


if __name__ == "__main__":  # run as a script: before anything below is imported
    forbid_imports()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402, N812

from fl_app.engine.vectorised_training import (  # noqa: E402
    activation_numel,
    auto_chunk,
    plan_from_generators,
    stack_params,
    train_vectorised,
)
from fl_app.learning.models import build_model  # noqa: E402

INPUT_SHAPE = (1, 28, 28)
CLASSES = 10
BATCH = 32
LR = 0.1


def client_sizes(clients: int, mean: float, alpha: float, rng: np.random.Generator) -> np.ndarray:
    """``1 + Multinomial(clients * (mean - 1), Dirichlet(alpha))``: every client has an example."""
    shares = rng.dirichlet(np.full(clients, alpha))
    return 1 + rng.multinomial(round(clients * (mean - 1)), shares)


def cohort_data(sizes: np.ndarray, rng: np.random.Generator) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Random float images in [0, 1] and labels, per client."""
    xs = [rng.random((int(n), *INPUT_SHAPE), dtype=np.float32) for n in sizes]
    ys = [rng.integers(0, CLASSES, int(n)) for n in sizes]
    return xs, ys


def order_generators(clients: int, seed: int) -> list[np.random.Generator]:
    """One generator per client (what each client's ``train_local`` would draw its orders from)."""
    return [np.random.default_rng([seed, client]) for client in range(clients)]


def train_loop(
    model: nn.Module,
    global_params: dict[str, torch.Tensor],
    xs: Sequence[np.ndarray],
    ys: Sequence[np.ndarray],
    *,
    epochs: int,
    momentum: float,
    mu: float,
    seed: int,
    device: torch.device,
) -> list[list[torch.Tensor]]:
    """Every client in turn: ``train_local``'s loop (torch-only re-implementation); trained parameters."""
    params = list(model.parameters())
    reference = [global_params[name] for name, _ in model.named_parameters()]
    results = []
    for rng, x, y in zip(order_generators(len(xs), seed), xs, ys, strict=True):
        with torch.no_grad():
            for parameter, value in zip(params, reference, strict=True):
                parameter.copy_(value)
        buffers: list[torch.Tensor | None] = [None] * len(params)
        inputs = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(device)
        targets = torch.from_numpy(np.asarray(y, dtype=np.int64)).to(device)
        model.train()
        for _ in range(epochs):
            order = torch.from_numpy(rng.permutation(len(y))).to(device)
            for start in range(0, len(y), BATCH):
                index = order[start : start + BATCH]
                for parameter in params:
                    parameter.grad = None
                loss = F.cross_entropy(model(inputs[index]), targets[index])
                if mu > 0:
                    prox = sum(torch.sum((p - r) ** 2) for p, r in zip(params, reference, strict=True))
                    loss = loss + 0.5 * mu * prox
                loss.backward()
                with torch.no_grad():
                    for i, parameter in enumerate(params):
                        step = parameter.grad
                        if momentum != 0:
                            if buffers[i] is None:
                                buffers[i] = step.detach().clone()
                            else:
                                buffers[i].mul_(momentum).add_(step, alpha=1)
                            step = buffers[i]
                        parameter.add_(step, alpha=-LR)
        results.append([p.detach().clone() for p in params])
    return results


def loop_sensitivity(
    reference: list[list[torch.Tensor]],
    model: nn.Module,
    global_params: dict[str, torch.Tensor],
    xs: Sequence[np.ndarray],
    ys: Sequence[np.ndarray],
    epochs: int,
    args: argparse.Namespace,
    device: torch.device,
) -> float:
    """How far the loop itself ends from ``reference`` when its start is perturbed by 1e-7 (relative).

    The scale of float rounding's effect on this training: what "max abs diff" is compared to. ReLU and
    max-pool kinks and unstable steps (random labels, lr 0.1) amplify a last-bit difference.
    """
    generator = torch.Generator().manual_seed(args.seed)
    perturbed = {
        name: value * (1 + 1e-7 * torch.randn(value.shape, generator=generator).to(value.device))
        for name, value in global_params.items()
    }
    other = train_loop(
        model, perturbed, xs, ys, epochs=epochs, momentum=args.momentum, mu=args.mu, seed=args.seed,
        device=device,
    )  # fmt: skip
    return max(
        float((mine - theirs).abs().max())
        for client, client_other in zip(reference, other, strict=True)
        for mine, theirs in zip(client, client_other, strict=True)
    )


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that the clock measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Seconds ``fn`` takes (device work included) and its result."""
    synchronize(device)
    start = time.perf_counter()
    result = fn()
    synchronize(device)
    return time.perf_counter() - start, result


def run_case(
    model_name: str, clients: int, epochs: int, args: argparse.Namespace, device: torch.device
) -> list[dict[str, Any]]:
    """Time the loop and every cohort variant on one shape, interleaved; one row per cohort variant."""
    data_rng = np.random.default_rng([args.seed, clients])
    sizes = client_sizes(clients, args.mean_size, args.alpha, data_rng)
    xs, ys = cohort_data(sizes, data_rng)
    model = build_model(model_name, INPUT_SHAPE, CLASSES).to(device)
    global_params = stack_params(model)
    variants = [(schedule, chunk) for schedule in args.schedules for chunk in args.chunks]

    def loop() -> list[list[torch.Tensor]]:
        return train_loop(
            model, global_params, xs, ys, epochs=epochs, momentum=args.momentum, mu=args.mu,
            seed=args.seed, device=device,
        )  # fmt: skip

    def cohort(schedule: str, chunk: int | str) -> Any:
        def run() -> Any:
            plan = plan_from_generators(
                order_generators(clients, args.seed), sizes, epochs=epochs, batch_size=BATCH
            )
            return train_vectorised(
                model, global_params, xs, ys, plan, lr=LR, momentum=args.momentum, proximal_mu=args.mu,
                device=device, chunk=None if chunk == "all" else chunk, schedule=schedule,  # type: ignore[arg-type]
            )  # fmt: skip

        return run

    # Warm-up (first vmap and allocator use), and the difference between the paths.
    warm = min(clients, 8)
    train_vectorised(
        model, global_params, xs[:warm], ys[:warm],
        plan_from_generators(order_generators(warm, 0), sizes[:warm], epochs=1, batch_size=BATCH),
        lr=LR, device=device,
    )  # fmt: skip
    loop_times: list[float] = []
    cohort_times: dict[tuple[str, int | str], list[float]] = {v: [] for v in variants}
    peaks: dict[tuple[str, int | str], int] = {}
    differences: dict[tuple[str, int | str], float] = {}
    for repeat in range(args.repeats):
        seconds, reference = timed(loop, device)
        loop_times.append(seconds)
        if repeat == 0:
            first_reference = reference
        for variant in variants:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            seconds, result = timed(cohort(*variant), device)
            cohort_times[variant].append(seconds)
            if device.type == "cuda":
                peaks[variant] = torch.cuda.max_memory_allocated(device)
            if repeat == 0:
                differences[variant] = max(
                    float((result.params[name][c] - reference[c][i]).abs().max())
                    for c in range(clients)
                    for i, (name, _) in enumerate(model.named_parameters())
                )
        print(
            f"  {model_name} clients={clients} epochs={epochs} repeat {repeat + 1}/{args.repeats}", flush=True
        )
    sensitivity = None
    if args.sensitivity:
        sensitivity = loop_sensitivity(first_reference, model, global_params, xs, ys, epochs, args, device)
    loop_s = statistics.median(loop_times)
    steps = int(sum(epochs * -(-int(n) // BATCH) for n in sizes))
    longest = int(epochs * -(-int(sizes.max()) // BATCH))
    rows = []
    for variant in variants:
        cohort_s = statistics.median(cohort_times[variant])
        schedule, chunk = variant
        rows.append(
            {
                "device": device.type,
                "threads": torch.get_num_threads(),
                "model": model_name,
                "parameters": sum(p.numel() for p in model.parameters()),
                "clients": clients,
                "epochs": epochs,
                "examples": int(sizes.sum()),
                "max_size": int(sizes.max()),
                "client_steps": steps,
                "longest_client_steps": longest,
                "schedule": schedule,
                "chunk": clients if chunk == "all" else chunk,
                "auto_chunk": auto_chunk_of(model, device),
                "loop_s": loop_s,
                "cohort_s": cohort_s,
                "speedup": loop_s / cohort_s,
                "max_abs_diff": differences[variant],
                "loop_sensitivity": sensitivity,
                "loop_times": loop_times,
                "cohort_times": cohort_times[variant],
                "peak_device_bytes": peaks.get(variant),
            }
        )
    return rows


def auto_chunk_of(model: nn.Module, device: torch.device) -> int:
    """What ``chunk="auto"`` picks for ``model`` at batch :data:`BATCH` on ``device``."""
    params = stack_params(model)
    activations = activation_numel(model, params, torch.zeros((1, *INPUT_SHAPE), device=device))
    return auto_chunk(sum(p.numel() for p in params.values()), activations, BATCH, device)


def max_rss_bytes() -> int:
    """Peak resident memory of this process (Linux reports kibibytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def chunk_label(row: dict[str, Any]) -> str:
    """The chunk column: a number, or ``auto (N)`` with the number ``auto`` chose."""
    return f"auto ({row['auto_chunk']})" if row["chunk"] == "auto" else str(row["chunk"])


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| device | threads | model | clients | epochs | client-steps (longest) | schedule | chunk "
        "| loop s | cohort s | speed-up | max abs diff | loop's own (start +-1e-7) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['device']} | {r['threads']} | {r['model']} | {r['clients']} | {r['epochs']} "
            f"| {r['client_steps']} ({r['longest_client_steps']}) | {r['schedule']} "
            f"| {chunk_label(r)} "
            f"| {r['loop_s']:.3g} | {r['cohort_s']:.3g} | {r['speedup']:.2f}x | {r['max_abs_diff']:.1e} "
            f"| {'-' if r['loop_sensitivity'] is None else format(r['loop_sensitivity'], '.1e')} |"
        )
    return "\n".join(lines)


def chunk_value(text: str) -> int | str:
    """A ``--chunks`` entry: ``auto``, ``all`` or a number of clients."""
    return text if text in ("auto", "all") else int(text)


def csv_list(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """An argparse type: a comma-separated list of ``kind``."""
    return lambda text: [kind(part) for part in text.split(",") if part]


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the arguments, run every case, print the table (and write the rows with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--clients", type=csv_list(int), default=[100, 1000])
    parser.add_argument("--models", type=csv_list(str), default=["mlp", "cnn"])
    parser.add_argument("--epochs", type=csv_list(int), default=[1, 5])
    parser.add_argument("--schedules", type=csv_list(str), default=["prefix"])
    parser.add_argument(
        "--chunks", type=csv_list(chunk_value), default=["auto"], help="clients per chunk, auto or all"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mean-size", type=float, default=60.0)
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--mu", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    parser.add_argument(
        "--no-sensitivity", dest="sensitivity", action="store_false",
        help="skip the extra loop run from a start perturbed by 1e-7",
    )  # fmt: skip
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads:
        torch.set_num_threads(int(threads))
    torch.manual_seed(args.seed)  # the models' initial weights (a script, not library code)
    header = (
        f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
        f"load average before {os.getloadavg()[0]:.2f}"
        + (f", {torch.cuda.get_device_name(device)}" if device.type == "cuda" else "")
    )
    print(header, flush=True)
    rows: list[dict[str, Any]] = []
    for model_name in args.models:
        for clients in args.clients:
            for epochs in args.epochs:
                rows += run_case(model_name, clients, epochs, args, device)
    print(markdown(rows))
    print(f"process peak RSS {max_rss_bytes() / 2**30:.2f} GiB, load average after {os.getloadavg()[0]:.2f}")
    forbidden = sorted(name for name in sys.modules if name.split(".")[0] in FORBIDDEN)
    if forbidden:
        raise SystemExit(f"imported {forbidden}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "header": header,
            "argv": sys.argv,
            "load_average_after": os.getloadavg()[0],
            "max_rss_bytes": max_rss_bytes(),
        }
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
