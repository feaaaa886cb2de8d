r"""A DP-FedAvg round with the cohort trained as one computation, torch and numpy only.

Usage::

    python -P benchmarks/cohort_round.py --device cuda --population 10000 --cohort 1000 \\
        --models mlp,cnn --rounds 5 [--paths cohort,loop] [--json OUT]

What one round of DP-FedAvg (fixed clipping, Gaussian noise on the sum; McMahan et al. 2018) does
once the engine trains a cohort with ``train_vectorised`` (fl_app/engine/vectorised_training.py), timed
by phase on one device:

* **sample**: ``--cohort`` clients of the ``--population`` drawn without replacement (a seeded
  ``numpy`` generator; the benchmark's, not a secret one);
* **plan** and **train**: each client's orders from its own generator (``plan_from_generators``), its examples
  (``uint8``; ``--data host``: moved to the device each round, ``device``: kept there from the start)
  gathered and turned into floats, and the cohort's local
  training from the global model (``--paths``: ``cohort`` = ``train_vectorised``, ``loop`` = the
  per-client loop of ``benchmarks/cohort_training.py``);
* **aggregate**: per-client updates, each clipped to L2 norm ``--clip``, summed, Gaussian noise of
  standard deviation ``--noise-multiplier * clip`` added (a ``torch.Generator`` on the device), the
  mean applied to the global model with server learning rate 1;
* **evaluate**: accuracy of the new global model on ``--test`` examples, one batched forward pass.

The data are random (Fashion-MNIST-shaped 1x28x28 ``uint8`` images, 10 classes; client sizes
``1 + Multinomial(population * 59, Dirichlet(1))``): the numbers are time, not learning (that the
vectorised path learns what the loop learns is tested against ``train_local`` in
``tests/test_vectorised_training.py``). The first round is a warm-up and is not reported. This is the
round the engine would run, not the engine: no Flower messages, no Ray, no accountant.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # before site-packages: a library installs a package named benchmarks

if __name__ == "__main__":
    from benchmarks.cohort_training import forbid_imports

    forbid_imports()

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.cohort_training import BATCH, CLASSES, INPUT_SHAPE, LR, train_loop  # noqa: E402
from fl_app.engine.vectorised_training import plan_from_generators, stack_params, train_vectorised  # noqa: E402
from fl_app.learning.models import build_model  # noqa: E402

PHASES = ("sample", "plan", "train", "aggregate", "evaluate")


def population(size: int, rng: np.random.Generator) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per client, random ``uint8`` images and labels; sizes ``1 + Multinomial(size * 59, Dirichlet(1))``."""
    sizes = 1 + rng.multinomial(size * 59, rng.dirichlet(np.ones(size)))
    pixels = rng.integers(0, 256, (int(sizes.sum()), *INPUT_SHAPE), dtype=np.uint8)
    labels = rng.integers(0, CLASSES, int(sizes.sum()))
    cuts = np.cumsum(sizes)[:-1]
    return np.split(pixels, cuts), np.split(labels, cuts)


def aggregate(
    global_params: dict[str, torch.Tensor],
    trained: dict[str, torch.Tensor],
    *,
    clip: float,
    noise_multiplier: float,
    generator: torch.Generator,
) -> dict[str, torch.Tensor]:
    """DP-FedAvg's release: clipped updates summed, Gaussian noise added, the mean applied."""
    names = list(global_params)
    deltas = [trained[n] - global_params[n].unsqueeze(0) for n in names]
    cohort = deltas[0].shape[0]
    squares = sum(d.reshape(cohort, -1).pow(2).sum(dim=1) for d in deltas)
    scale = torch.clamp(clip / torch.sqrt(squares).clamp_min(1e-12), max=1.0)
    new = {}
    for name, delta in zip(names, deltas, strict=True):
        total = (delta * scale.view(-1, *([1] * (delta.dim() - 1)))).sum(dim=0)
        noise = torch.randn(total.shape, generator=generator, device=total.device)
        new[name] = global_params[name] + (total + noise_multiplier * clip * noise) / cohort
    return new


def evaluate(
    model: torch.nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
) -> float:
    """Accuracy of ``params`` on ``(x, y)`` (one forward pass)."""
    with torch.no_grad():
        logits = torch.func.functional_call(model, params, (x,))
        return float((logits.argmax(dim=1) == y).float().mean())


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that the clock measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_rounds(model_name: str, path: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """``args.rounds + 1`` rounds on one path (the first a warm-up); per phase, seconds per round."""
    data_rng = np.random.default_rng([args.seed, args.population])
    xs, ys = population(args.population, data_rng)
    if args.data == "device":  # the population's examples stay on the device from round to round
        xs = list(torch.from_numpy(np.concatenate(xs)).to(device).split([len(y) for y in ys]))
        ys = list(torch.from_numpy(np.concatenate(ys)).to(device).split([len(y) for y in ys]))
    test_rng = np.random.default_rng([args.seed, 1])
    test_x = torch.from_numpy(test_rng.integers(0, 256, (args.test, *INPUT_SHAPE), dtype=np.uint8)).to(device)
    test_x = test_x.float().div_(255.0)
    test_y = torch.from_numpy(test_rng.integers(0, CLASSES, args.test)).to(device)
    torch.manual_seed(args.seed)  # the initial weights (a script, not library code)
    model = build_model(model_name, INPUT_SHAPE, CLASSES).to(device)
    params = stack_params(model)
    cohort_rng = np.random.default_rng([args.seed, 2])
    noise = torch.Generator(device=device).manual_seed(args.seed)
    times: dict[str, list[float]] = {phase: [] for phase in (*PHASES, "round")}
    accuracy = float("nan")
    for round_index in range(args.rounds + 1):
        clock = PhaseClock(device)
        members = np.sort(cohort_rng.choice(args.population, args.cohort, replace=False))
        cx, cy = [xs[m] for m in members], [ys[m] for m in members]
        clock.mark("sample")
        trained = train(model, params, cx, cy, members, round_index, path, args, device, clock)
        params = aggregate(
            params, trained, clip=args.clip, noise_multiplier=args.noise_multiplier, generator=noise
        )
        clock.mark("aggregate")
        accuracy = evaluate(model, params, test_x, test_y)
        clock.mark("evaluate")
        if round_index > 0:
            for phase, seconds in clock.seconds.items():
                times[phase].append(seconds)
            times["round"].append(sum(clock.seconds.values()))
        print(f"  {model_name} {path} cohort={args.cohort} round {round_index}: {clock.seconds}", flush=True)
    if args.profile:
        profile_round(model, params, xs, ys, cohort_rng, path, args, device)
    return {
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "model": model_name,
        "path": path,
        "population": args.population,
        "cohort": args.cohort,
        "epochs": args.epochs,
        "data": args.data,
        "rounds": args.rounds,
        "median_s": {phase: statistics.median(values) for phase, values in times.items()},
        "times": times,
        "final_accuracy_random_labels": accuracy,
    }


def train(
    model: torch.nn.Module,
    params: dict[str, torch.Tensor],
    xs: Sequence[np.ndarray],
    ys: Sequence[np.ndarray],
    members: np.ndarray,
    round_index: int,
    path: str,
    args: argparse.Namespace,
    device: torch.device,
    clock: PhaseClock | None = None,
) -> dict[str, torch.Tensor]:
    """The cohort's trained parameters stacked ``[cohort, *shape]`` (``path``: cohort or loop).

    ``clock`` marks "plan" (the clients' generators and, for the cohort, their batches) and "train".
    """
    clock = clock or PhaseClock(device)
    generators = [np.random.default_rng([args.seed, round_index, int(m)]) for m in members]
    if path == "cohort":
        sizes = np.array([len(y) for y in ys])
        plan = plan_from_generators(generators, sizes, epochs=args.epochs, batch_size=BATCH)
        clock.mark("plan")
        trained = train_vectorised(model, params, xs, ys, plan, lr=LR, device=device).params
        clock.mark("train")
        return trained
    clock.mark("plan")
    floats = [np.asarray(x.cpu() if isinstance(x, torch.Tensor) else x, np.float32) / 255.0 for x in xs]
    ys = [y.cpu().numpy() if isinstance(y, torch.Tensor) else y for y in ys]
    results = train_loop(
        model, params, floats, ys, epochs=args.epochs, momentum=0.0, mu=0.0, seed=args.seed, device=device
    )
    names = [n for n, _ in model.named_parameters()]
    trained = {n: torch.stack([client[i] for client in results]) for i, n in enumerate(names)}
    clock.mark("train")
    return trained


def profile_round(
    model: torch.nn.Module,
    params: dict[str, torch.Tensor],
    xs: Sequence[Any],
    ys: Sequence[Any],
    cohort_rng: np.random.Generator,
    path: str,
    args: argparse.Namespace,
    device: torch.device,
) -> None:
    """One more round's training under ``torch.profiler``: the 25 operations with the most own CPU time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    members = np.sort(cohort_rng.choice(args.population, args.cohort, replace=False))
    with profile(activities=activities) as profiler:
        train(
            model, params, [xs[m] for m in members], [ys[m] for m in members], members, 99, path, args, device
        )
        synchronize(device)
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)


def compile_steps() -> None:
    """Make ``train_vectorised`` compile its step function (``torch.compile``, symbolic cohort width).

    An experiment for the per-step dispatch cost measured on the GPU (about 3.7 ms of Python per step
    of a 1000-client MLP cohort): not a library option; the first round pays the compilation.
    """
    from fl_app.engine import vectorised_training as cohort_training

    plain = cohort_training._step_function
    made: dict[tuple[int, float], Any] = {}  # one compiled step per model (rounds reuse it)

    def compiled(model: Any, reference: Any, flat_x: Any, proximal_mu: float, *, record: bool) -> Any:
        step_fn, layers, activations = plain(model, reference, flat_x, proximal_mu, record=record)
        key = (id(model), float(proximal_mu))
        if key not in made:
            made[key] = torch.compile(step_fn, dynamic=True)
        return made[key], layers, activations

    cohort_training._step_function = compiled


class PhaseClock:
    """Seconds between marks, the device's queued work included."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}
        synchronize(device)
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        """Close ``phase`` now."""
        synchronize(self.device)
        now = time.perf_counter()
        self.seconds[phase] = now - self._last
        self._last = now


def csv_list(kind: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """An argparse type: a comma-separated list of ``kind``."""
    return lambda text: [kind(part) for part in text.split(",") if part]


def main(argv: Sequence[str] | None = None) -> None:
    """Parse the arguments, run every model and path, print a table (``--json``: the rows)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--population", type=int, default=10_000)
    parser.add_argument("--cohort", type=int, default=1000)
    parser.add_argument("--models", type=csv_list(str), default=["mlp"])
    parser.add_argument("--paths", type=csv_list(str), default=["cohort"])
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument(
        "--data", choices=("host", "device"), default="device",
        help="where the population's uint8 examples are kept (device: moved once, before the rounds)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--test", type=int, default=10_000)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--noise-multiplier", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="profile one more round's training")
    parser.add_argument(
        "--compile", action="store_true",
        help="an experiment: each step's vmap(grad(loss)) through torch.compile(dynamic=True)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if args.compile:
        compile_steps()
    rows = [run_rounds(m, p, args, device) for m in args.models for p in args.paths]
    for row in rows:
        row["compiled"] = bool(args.compile)
    print(
        "| device | threads | model | path | data | population | cohort | epochs | sample s | plan s "
        "| train s | aggregate s | evaluate s | round s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        m = r["median_s"]
        print(
            f"| {r['device_name']} | {r['threads']} | {r['model']} | {r['path']} | {r['data']} "
            f"| {r['population']} | {r['cohort']} | {r['epochs']} | {m['sample']:.4f} | {m['plan']:.4f} "
            f"| {m['train']:.4f} "
            f"| {m['aggregate']:.4f} | {m['evaluate']:.4f} | {m['round']:.4f} |"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps({"argv": sys.argv, "torch": torch.__version__, "rows": rows}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
