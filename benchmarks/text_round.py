"""The word LSTM's round at 100 clients: the per-client loop against the vectorised cohort trainer.

100 clients drawn (seeded) from a corpus of Stack Overflow's shape (``benchmarks/text_memory.py
generate``: heavy-tailed users, at most 256 sentences each), the word LSTM (4,050,748 parameters), one
local epoch of batch 16 at lr 0.5 (the DP-FTRL paper's client settings), one torch thread. The loop is
``train_local`` per client; the cohort is one ``train_vectorised`` (``torch.func``: the LSTM runs
unrolled, position by position, so that ``vmap`` batches it). Interleaved, ``--repeats`` times each;
wall time and this process's CPU time per round, and the largest difference between the two trainers'
parameters (they compute the same thing to float rounding).

Usage::

    python -P benchmarks/text_round.py /tmp/so_shape --repeats 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def cohort(folder: Path, clients: int, seed: int) -> tuple[list, list, object]:
    """The sentences (inputs, targets) of ``clients`` seeded clients and the model spec."""
    import numpy as np

    from fl_app.data.text import build_text_data
    from fl_app.learning.model_spec import ModelSpec

    options = {
        "name": "stackoverflow",
        "path": str(folder),
        "split": "train",
        "test_fraction": 0.2,
        "text_column": "tokens",
        "level": "word",
        "vocab_size": 10000,
        "sequence_length": 20,
        "max_sequences_per_user": 256,
        "accuracy_without_oov": True,
    }
    data = build_text_data(
        options, {"column": "client_id"}, num_clients=342_477, seed=0, validation_fraction=0
    )
    picked = np.random.default_rng(seed).choice(len(data.client_users), size=clients, replace=False)
    parts = [data.client(int(c)) for c in picked]
    spec = ModelSpec("word_lstm", (20,), data.num_classes, data.uncounted_targets)
    return [np.asarray(p.x) for p in parts], [np.asarray(p.y) for p in parts], spec


def loop_round(model, xs, ys, start, orders) -> tuple[list, float, float]:
    """Each client from ``start`` with ``train_local``; their parameters, wall and CPU seconds."""
    import torch

    from fl_app.learning.training import train_local

    wall, cpu = time.perf_counter(), time.process_time()
    params = []
    for x, y, order in zip(xs, ys, orders, strict=True):
        with torch.no_grad():
            for name, value in model.named_parameters():
                value.copy_(start[name])
        train_local(model, x, y, epochs=1, batch_size=16, lr=0.5, order=order)
        params.append({n: v.detach().clone() for n, v in model.named_parameters()})
    return params, time.perf_counter() - wall, time.process_time() - cpu


def cohort_round(model, xs, ys, start, orders) -> tuple[object, float, float]:
    """The cohort as one ``train_vectorised``; its result, wall and CPU seconds."""
    from fl_app.engine.vectorised_training import plan_batches, train_vectorised

    wall, cpu = time.perf_counter(), time.process_time()
    plan = plan_batches([len(y) for y in ys], [[o[0]] for o in orders], epochs=1, batch_size=16)
    result = train_vectorised(model, start, xs, ys, plan, lr=0.5)
    return result, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    """Interleave the two trainers; print one JSON line per round and a summary."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    import numpy as np
    import torch

    torch.set_num_threads(1)
    xs, ys, spec = cohort(args.folder, args.clients, seed=1)
    torch.manual_seed(0)
    model = spec.build()
    start = {n: v.detach().clone() for n, v in model.named_parameters()}
    rng = np.random.default_rng(2)
    orders = [rng.permutation(len(y))[None] for y in ys]
    sentences = sum(len(y) for y in ys)
    times: dict[str, list[tuple[float, float]]] = {"loop": [], "cohort": []}
    for repeat in range(args.repeats):
        loop_params, wall, cpu = loop_round(model, xs, ys, start, orders)
        times["loop"].append((wall, cpu))
        print(json.dumps({"repeat": repeat, "trainer": "loop", "wall_s": wall, "cpu_s": cpu}), flush=True)
        result, wall, cpu = cohort_round(model, xs, ys, start, orders)
        times["cohort"].append((wall, cpu))
        print(json.dumps({"repeat": repeat, "trainer": "cohort", "wall_s": wall, "cpu_s": cpu}), flush=True)
    gap = max(
        float((result.client(i)[n] - loop_params[i][n]).abs().max()) for i in range(len(xs)) for n in start
    )
    summary = {
        "clients": len(xs),
        "sentences": sentences,
        "largest_client": max(len(y) for y in ys),
        "loop_wall_s": min(w for w, _ in times["loop"]),
        "cohort_wall_s": min(w for w, _ in times["cohort"]),
        "loop_cpu_s": min(c for _, c in times["loop"]),
        "cohort_cpu_s": min(c for _, c in times["cohort"]),
        "largest_parameter_difference": gap,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
