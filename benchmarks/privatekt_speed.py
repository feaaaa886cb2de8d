"""PrivateKT demo round on CPU: what the work costs in plain PyTorch, which levers help, and the simulation.

Usage::

    python benchmarks/privatekt_speed.py levers [--data-dir DIR] [--out DIR]
    python benchmarks/privatekt_speed.py round [--data-dir DIR] [--rounds 4] [--out DIR] [--extra k=v ...]
    python benchmarks/privatekt_speed.py tables [--out DIR]

The shape is ``+experiment=privatekt_demo`` on MNIST: 40 clients per round, each training the
authors' CNN (``privatekt_cnn``, 1.68 M parameters, dropout 0.2) for 5 epochs of batch 32 on its 600
images, then predicting its K = 2 KT samples; the server fine-tunes on the buffer (4 full-batch steps),
predicts the 12,000-image public split twice (the self-training draw after fine-tuning, the next round's
KT draw after self-training), self-trains 38 steps of batch 32 and evaluates the 10,000 test images.

``levers`` times, each in a fresh subprocess (so that thread settings and compiled code do not leak),
one client's local training (5 epochs x 600 real images) and the server's inference over the public
split, under each lever: torch threads (1 or 2), memory layout (contiguous or channels-last),
``torch.compile`` (training only) and the inference batch size.

``round`` measures the same round three ways, back to back in the same minutes:

1. *plain, 2 processes*: 2 worker processes with 1 thread each (what the simulation runs: 2 Ray actors of
   one CPU) train 20 clients each with a bare PyTorch loop (``torch.optim.SGD``, no Flower, no Ray, no
   dpfl), then this process (2 threads) does the server's work with the same bare calls, at the
   inference batch the simulation's server uses (``fl_app.learning.training.EVAL_BATCH``);
2. the same with the levers ``levers`` found helpful (``--plain-channels-last``);
3. the simulation: ``python -m fl_app +experiment=privatekt_demo num_rounds=R`` (median ``round_s`` of
   rounds 2..R).

The ratio simulation / plain is what Flower, Ray and dpfl add to a round whose cost is the CNN.

``tables`` prints the Markdown tables of ``levers.json`` and ``round.json`` in ``--out`` (the recorded
measurements of docs/benchmarks/privatekt.md are in docs/benchmarks/privatekt_speed/).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DEMO = ["+experiment=privatekt_demo"]
CLIENTS_PER_ROUND = 40
EPOCHS = 5
BATCH = 32
LR = 0.05
SELF_TRAIN = 1200
SERVER_STEPS = 4
BUFFER_ROWS = 50


def demo_data(data_dir: str | None) -> Any:
    """The demo's federated data (equal-size Dirichlet partition, 20 % public split)."""
    from fl_app.config.compose import compose_config
    from fl_app.data.federated import DataSpec, federated_data
    from fl_app.data.sources import DataNotFoundError

    overrides = [*DEMO] + ([f"dataset.data_dir={data_dir}"] if data_dir else [])
    try:
        return federated_data(DataSpec.from_config(compose_config(overrides)))
    except DataNotFoundError as error:
        raise SystemExit(f"{error} (--data-dir)") from None


LAYOUTS = ("contiguous", "channels_last", "channels_last_input")


def build_model(layout: str) -> Any:
    """The authors' CNN; ``channels_last``: its weights in channels-last layout as well as its input."""
    import torch

    from fl_app.learning.models import PrivateKTCNN

    model = PrivateKTCNN((1, 28, 28), 10)
    return model.to(memory_format=torch.channels_last) if layout == "channels_last" else model


def as_input(x: Any, layout: str) -> Any:
    """A float tensor of images: channels-last unless ``layout`` is contiguous."""
    import torch

    from fl_app.learning.training import to_tensor

    tensor = to_tensor(x)
    return tensor if layout == "contiguous" else tensor.contiguous(memory_format=torch.channels_last)


def train_plain(model: Any, x: Any, y: Any, *, epochs: int, seed: int) -> None:
    """Bare mini-batch SGD (torch.optim.SGD), a fresh permutation per epoch."""
    import torch
    from torch.nn.functional import cross_entropy

    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y), BATCH):
            index = order[start : start + BATCH]
            optimizer.zero_grad(set_to_none=True)
            cross_entropy(model(x[index]), y[index]).backward()
            optimizer.step()


def predict_plain(model: Any, x: Any, batch: int) -> Any:
    """Softmax outputs in batches, no autograd."""
    import torch

    model.eval()
    with torch.inference_mode():
        return torch.cat([torch.softmax(model(x[i : i + batch]), dim=1) for i in range(0, len(x), batch)])


# ------------------------------------------------------------------------------------------- levers


def lever_child(spec: dict[str, Any]) -> dict[str, Any]:
    """One lever measurement (run in a fresh process): seconds for the named piece of work."""
    import torch

    torch.set_num_threads(int(spec["threads"]))
    data = demo_data(spec.get("data_dir"))
    layout = str(spec["layout"])
    model = build_model(layout)
    if spec["work"] == "train":
        part = data.client(0)
        x, y = as_input(part.x, layout), torch.as_tensor(part.y, dtype=torch.int64)
        if spec["compile"]:
            model = torch.compile(model)
        started = time.perf_counter()
        train_plain(model, x[:BATCH], y[:BATCH], epochs=1, seed=0)  # warm-up (compilation)
        warm = time.perf_counter() - started
        started = time.perf_counter()
        train_plain(model, x, y, epochs=EPOCHS, seed=1)
        return {"seconds": time.perf_counter() - started, "warm_up_s": warm, "rows": len(y)}
    public = as_input(data.public_x(), layout)
    predict_plain(model, public[:256], int(spec["batch"]))
    started = time.perf_counter()
    predict_plain(model, public, int(spec["batch"]))
    return {"seconds": time.perf_counter() - started, "rows": len(public)}


def run_child(mode: str, spec: dict[str, Any]) -> dict[str, Any]:
    """Run ``mode`` with ``spec`` in a fresh interpreter with the thread variables set."""
    environment = {**os.environ, "OMP_NUM_THREADS": str(spec.get("threads", 1))}
    done = subprocess.run(
        [sys.executable, "-P", __file__, mode, json.dumps(spec)],
        capture_output=True,
        text=True,
        env=environment,
        cwd=ROOT,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{mode} {spec} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def levers(args: argparse.Namespace) -> None:
    """Time one client's training and the public-split inference under each lever."""
    rows = []
    training = [
        {"threads": t, "layout": layout, "compile": k}
        for t in (1, 2)
        for layout in LAYOUTS
        for k in (False, True)
        if not (k and (t == 2 or layout != "contiguous"))
    ]
    for spec in training:
        result = run_child("_child", {**spec, "work": "train", "data_dir": args.data_dir})
        rows.append({**spec, "work": f"client training ({EPOCHS} epochs)", **result})
        print(json.dumps(rows[-1]), flush=True)
    for threads in (1, 2):
        for layout in LAYOUTS:
            for batch in (256, 1024, 4096):
                spec = {"threads": threads, "layout": layout, "compile": False, "batch": batch}
                result = run_child("_child", {**spec, "work": "predict", "data_dir": args.data_dir})
                rows.append({**spec, "work": "public-split inference", **result})
                print(json.dumps(rows[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "levers.json").write_text(json.dumps(rows, indent=2))
    print(levers_table(rows))


def levers_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of the lever measurements."""
    lines = [
        "| work | threads | layout | torch.compile | inference batch | seconds | images/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        images = row["rows"] * (EPOCHS if row["work"].startswith("client") else 1)
        lines.append(
            f"| {row['work']} | {row['threads']} | {row['layout']}"
            f" | {'yes' if row['compile'] else 'no'} | {row.get('batch', '-')} | {row['seconds']:.2f}"
            f" | {images / row['seconds']:.0f} |"
        )
    return "\n".join(lines)


# -------------------------------------------------------------------------------------------- round


def worker_child(spec: dict[str, Any]) -> dict[str, Any]:
    """Train the given clients one after another with one thread (one simulated actor's share)."""
    import torch

    torch.set_num_threads(1)
    data = demo_data(spec.get("data_dir"))
    layout = str(spec["layout"])
    started = time.perf_counter()
    for client in spec["clients"]:
        part = data.client(int(client))
        model = build_model(layout)
        x, y = as_input(part.x, layout), torch.as_tensor(part.y, dtype=torch.int64)
        train_plain(model, x, y, epochs=EPOCHS, seed=int(client))
        predict_plain(model, x[:2], 2)
    return {"seconds": time.perf_counter() - started}


def plain_round(data_dir: str | None, layout: str) -> dict[str, float]:
    """One demo round in plain PyTorch: 2 single-thread workers for the clients, then the server."""
    import torch
    from torch.nn.functional import cross_entropy

    from fl_app.learning.training import EVAL_BATCH  # the inference batch the simulation's server uses

    clients = list(range(CLIENTS_PER_ROUND))
    started = time.perf_counter()
    specs = [
        {"clients": clients[i::2], "layout": layout, "data_dir": data_dir, "threads": 1} for i in range(2)
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:  # the two workers run at the same time
        outputs = list(pool.map(lambda spec: run_child("_worker", spec), specs))
    client_s = time.perf_counter() - started  # includes the workers' interpreter and data start-up
    client_work_s = max(o["seconds"] for o in outputs)
    torch.set_num_threads(2)
    data = demo_data(data_dir)
    model = build_model(layout)
    public = as_input(data.public_x(), layout)
    x_test = as_input(data.test().x, layout)
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    model.train()
    rows = torch.randint(len(public), (BUFFER_ROWS,), generator=generator)
    targets = torch.randint(10, (BUFFER_ROWS,), generator=generator)
    for _ in range(SERVER_STEPS):
        optimizer.zero_grad(set_to_none=True)
        cross_entropy(model(public[rows]), targets).backward()
        optimizer.step()
    probabilities = predict_plain(model, public, EVAL_BATCH)
    chosen = torch.multinomial(torch.ones(len(public)), SELF_TRAIN, generator=generator)
    model.train()
    for start in range(0, SELF_TRAIN, BATCH):
        index = chosen[start : start + BATCH]
        optimizer.zero_grad(set_to_none=True)
        cross_entropy(model(public[index]), probabilities[index]).backward()
        optimizer.step()
    predict_plain(model, public, EVAL_BATCH)
    predict_plain(model, x_test, EVAL_BATCH)
    server_s = time.perf_counter() - started
    return {
        "client_phase_s": client_s,
        "client_work_s": client_work_s,
        "server_s": server_s,
        "round_s": client_work_s + server_s,
    }


def simulate(data_dir: str | None, rounds: int, out: Path, extra: list[str]) -> dict[str, Any]:
    """The demo in the simulation for ``rounds`` rounds: median round time of rounds 2..R."""
    run_dir = out / "simulation"
    command = [
        sys.executable,
        "-m",
        "fl_app",
        *DEMO,
        f"num_rounds={rounds}",
        f"hydra.run.dir={run_dir}",
        *([f"dataset.data_dir={data_dir}"] if data_dir else []),
        *extra,
    ]
    started = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - started
    results = json.loads((run_dir / "results.json").read_text())
    times = [r["round_s"] for r in results["rounds"]]
    return {
        "command": "python -m fl_app " + " ".join(command[3:]),
        "round_s": statistics.median(times[1:]),
        "round_times": times,
        "wall_s": wall,
        "accuracy": results["final"]["accuracy"],
    }


def round_benchmark(args: argparse.Namespace) -> None:
    """Plain round (contiguous and channels-last) and the simulation, back to back."""
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {
        f"plain_{layout}": plain_round(args.data_dir, layout) for layout in args.layouts
    }
    print(json.dumps(summary), flush=True)
    summary["simulation"] = simulate(args.data_dir, args.rounds, args.out, args.extra)
    for layout in args.layouts:
        key = f"plain_{layout}"
        summary[f"ratio_to_{key}"] = summary["simulation"]["round_s"] / summary[key]["round_s"]
    (args.out / "round.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))


def round_table(summary: dict[str, Any]) -> str:
    """Markdown table of a ``round`` measurement."""
    simulation = summary["simulation"]
    lines = [
        "| round of the demo | clients (2 workers) | server | round | simulation / plain |",
        "|---|---|---|---|---|",
    ]
    for key, plain in summary.items():
        if key.startswith("plain_"):
            layout = key.removeprefix("plain_")
            lines.append(
                f"| plain PyTorch ({layout}) | {plain['client_work_s']:.1f} s | {plain['server_s']:.1f} s"
                f" | {plain['round_s']:.1f} s | - |"
            )
    ratios = [value for key, value in summary.items() if key.startswith("ratio_to_")]
    times = ", ".join(f"{t:.0f}" for t in simulation["round_times"])
    lines.append(
        f"| simulation (median of rounds 2..{len(simulation['round_times'])}; all: {times} s) | - | - "
        f"| {simulation['round_s']:.1f} s | {', '.join(f'{r:.2f}' for r in ratios)} |"
    )
    return "\n".join(lines)


def tables(args: argparse.Namespace) -> None:
    """Print the tables of the measurements recorded in ``--out``."""
    levers_file, round_file = args.out / "levers.json", args.out / "round.json"
    if not levers_file.is_file() and not round_file.is_file():
        raise SystemExit(f"--out {args.out}: neither levers.json nor round.json")
    if levers_file.is_file():
        print(levers_table(json.loads(levers_file.read_text())) + "\n")
    if round_file.is_file():
        print(round_table(json.loads(round_file.read_text())))


def main() -> None:
    """Command-line entry point."""
    if len(sys.argv) == 3 and sys.argv[1] in ("_child", "_worker"):
        import fl_app  # noqa: F401  (process set-up)

        spec = json.loads(sys.argv[2])
        print(json.dumps(lever_child(spec) if sys.argv[1] == "_child" else worker_child(spec)))
        return
    main_with(sys.argv[1:])


def main_with(argv: list[str]) -> None:
    """Parse ``argv`` (without the program name) and run the subcommand."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("levers", "round", "tables"):
        command = commands.add_parser(name)
        command.add_argument("--data-dir", default=None, help="MNIST folder (default: the project's search)")
        command.add_argument("--out", type=Path, default=Path("/tmp/bench_privatekt_speed"))
        if name == "round":
            command.add_argument("--rounds", type=int, default=4)
            command.add_argument(
                "--layouts", nargs="+", choices=LAYOUTS, default=["contiguous", "channels_last"]
            )
            command.add_argument("--extra", nargs="*", default=[], help="extra overrides for the simulation")
    args = parser.parse_args(argv)
    import fl_app  # noqa: F401  (process set-up)

    if args.command != "tables":
        demo_data(args.data_dir)  # a missing data set: one line here, before any worker starts
    {"levers": levers, "round": round_benchmark, "tables": tables}[args.command](args)


if __name__ == "__main__":
    main()
