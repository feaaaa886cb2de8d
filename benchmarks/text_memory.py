"""Stack Overflow's scale on this machine: peak memory of the population, a round's cohort, the evaluation.

A generated corpus of the real shape (:func:`fl_app.data.synthetic_text.write_token_corpus`): 342,477
training users with heavy-tailed (log-normal) numbers of sentences, 396.6 on average before the cap as
TFF's Stack Overflow train split (135,818,730 sentences), each user's first 256 kept (the DP-FTRL and
matrix-factorization papers' cap); 204,088 test users with 81.3 sentences on average (16,586,035); the
10,004-token vocabulary, sequences of 20. Then, each phase in a fresh process (its own peak resident
set, ``ru_maxrss``):

* ``imports``: torch and the text data modules;
* ``population``: the federated view of all 342,477 users (``num_clients=342477``);
* ``cohort``: and 100 random clients' sentences read from disk as the ``int64`` tensors training uses;
* ``evaluation``: and a seeded sample of 10,000 test sentences (``evaluation.test_subset``);
* ``round``: and the word LSTM trained on the 100 clients (one epoch, batch 16), one after another.

Usage::

    python -P benchmarks/text_memory.py generate /tmp/so_shape
    python -P benchmarks/text_memory.py measure /tmp/so_shape
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = ("imports", "population", "cohort", "evaluation", "round")
#: TFF's Stack Overflow (tff.simulation.datasets.stackoverflow): train and test users and sentences.
TRAIN_USERS, TRAIN_SENTENCES = 342_477, 135_818_730
TEST_USERS, TEST_SENTENCES = 204_088, 16_586_035


def generate(folder: Path) -> None:
    """Write the corpus of the real shape; print its counts and sizes."""
    from fl_app.data.synthetic_text import write_token_corpus

    started = time.perf_counter()
    counts = write_token_corpus(
        folder,
        users=TRAIN_USERS,
        test_users=TEST_USERS,
        mean_sentences=TRAIN_SENTENCES / TRAIN_USERS,
        cap=256,
        seed=0,
        test_mean_sentences=TEST_SENTENCES / TEST_USERS,
    )
    sizes = {p.name: p.stat().st_size for p in folder.iterdir()}
    print(json.dumps({"seconds": round(time.perf_counter() - started, 1), **counts, "bytes": sizes}))


def phase(folder: Path, name: str) -> dict[str, float]:
    """Run the phases up to ``name`` in this process; its peak resident set."""
    import numpy as np
    import torch

    from fl_app.data.text import build_text_data

    torch.set_num_threads(1)
    result: dict[str, float] = {}
    if name == "imports":
        return result
    options = {
        "name": "stackoverflow",
        "path": str(folder),
        "split": "train",
        "test_split": None,
        "test_fraction": 0.2,
        "text_column": "tokens",
        "target_column": None,
        "level": "word",
        "vocab_size": 10000,
        "vocabulary": None,
        "sequence_length": 20,
        "max_sequences_per_user": 256,
        "accuracy_without_oov": True,
    }
    data = build_text_data(
        options, {"column": "client_id"}, num_clients=TRAIN_USERS, seed=0, validation_fraction=0
    )
    result["clients"] = len(data.client_users)
    if name == "population":
        return result
    rng = np.random.default_rng(1)
    cohort = rng.choice(TRAIN_USERS, size=100, replace=False)
    held = [
        (torch.from_numpy(np.asarray(d.x, dtype=np.int64)), torch.from_numpy(np.asarray(d.y, dtype=np.int64)))
        for d in (data.client(int(c)) for c in cohort)
    ]
    result["cohort_sentences"] = sum(len(x) for x, _ in held)
    if name == "cohort":
        return result
    test = data.test()
    rows = np.sort(rng.choice(len(test.y), size=10_000, replace=False))
    sample = (np.asarray(test.x[rows], dtype=np.int64), np.asarray(test.y[rows], dtype=np.int64))
    result["evaluation_sentences"] = len(sample[0])
    if name == "evaluation":
        return result
    from fl_app.learning.model_spec import ModelSpec
    from fl_app.learning.training import train_local

    model = ModelSpec("word_lstm", (20,), data.num_classes, data.uncounted_targets).build()
    started = time.perf_counter()
    for x, y in held:
        train_local(
            model, x.numpy(), y.numpy(), epochs=1, batch_size=16, lr=0.5, rng=np.random.default_rng(0)
        )
    result["round_seconds"] = round(time.perf_counter() - started, 1)
    return result


def measure(folder: Path) -> None:
    """Each phase in a fresh process; print one JSON line per phase and a markdown table."""
    rows = []
    for name in PHASES:
        out = subprocess.run(
            [sys.executable, "-P", __file__, "phase", str(folder), name],
            check=True, capture_output=True, text=True,
        ).stdout.strip().splitlines()[-1]  # fmt: skip
        row = {"phase": name, **json.loads(out)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    print(
        "\n| phase | peak resident set (MiB) | at its end: anonymous / mapped file pages (MiB) "
        "| what it holds |\n|---|---|---|---|"
    )
    shown = ("phase", "peak_mib", "rssanon_mib", "rssfile_mib")
    for row in rows:
        extra = ", ".join(f"{k} {v}" for k, v in row.items() if k not in shown)
        resident = f"{row.get('rssanon_mib', 0):.0f} / {row.get('rssfile_mib', 0):.0f}"
        print(f"| {row['phase']} | {row['peak_mib']:.0f} | {resident} | {extra} |")


def main() -> None:
    """``generate``, ``measure`` or (in the subprocesses) ``phase``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=("generate", "measure", "phase"))
    parser.add_argument("folder", type=Path)
    parser.add_argument("name", nargs="?", choices=PHASES)
    args = parser.parse_args()
    if args.command == "generate":
        generate(args.folder)
    elif args.command == "measure":
        measure(args.folder)
    else:
        result = phase(args.folder, args.name)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        print(json.dumps({**result, "peak_mib": round(peak, 1), **resident_now()}))


def resident_now() -> dict[str, float]:
    """The resident set now, split as Linux counts it: anonymous memory and mapped file pages (MiB)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            fields[f"{key.lower()}_mib"] = round(int(value.split()[0]) / 1024, 1)
    return fields


if __name__ == "__main__":
    main()
