r"""The cost of ``dataset=hf`` with ``partition=natural``: load, convert, partition; then from the cache.

Builds, locally, a FEMNIST-shaped Hugging Face data set (``--rows`` 28x28 grayscale PIL images,
62 classes, ``--users`` writer ids of unequal sizes) saved with ``save_to_disk``, then measures, each
in a fresh process (so that its peak resident memory is its own):

* ``first run``: :func:`fl_app.data.federated.build_federated_data` of the natural partition
  (``--clients`` users as clients): ``datasets.load_from_disk``, the PNG decoding and conversion to
  arrays, the id codes, the test users held out, the split, writing the dpfl cache;
* ``from the cache``: the same call in a new process (what every Ray worker and every later run does);
* ``grouping``: dpfl's numpy grouping (:func:`fl_app.data.natural.group_rows`) against flwr-datasets'
  ``NaturalIdPartitioner`` (one ``load_partition`` per user) on the same id column.

Usage::

    python -P benchmarks/hf_loader.py --out docs/benchmarks/hf_loader.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.tables, with or without -P

from benchmarks.tables import markdown_table, replace_generated_block

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- BEGIN GENERATED: hf_loader.py -->", "<!-- END GENERATED -->"


def build(folder: Path, *, rows: int, users: int, seed: int) -> float:
    """Save a FEMNIST-shaped data set in ``folder``; return the seconds it took."""
    import datasets
    import numpy as np
    from PIL import Image

    started = time.perf_counter()
    rng = np.random.default_rng(seed)
    sizes = rng.multinomial(rows - users, rng.dirichlet(np.ones(users))) + 1  # unequal, at least 1
    writers = np.repeat([f"f{u:04d}_{u % 100:02d}" for u in range(users)], sizes)
    images = rng.integers(0, 256, size=(rows, 28, 28), dtype=np.uint8)
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "writer_id": datasets.Value("string"),
            "character": datasets.ClassLabel(num_classes=62),
        }
    )
    datasets.disable_progress_bars()
    data = datasets.Dataset.from_dict(
        {
            "image": [Image.fromarray(image) for image in images],
            "writer_id": writers.tolist(),
            "character": rng.integers(0, 62, size=rows).tolist(),
        },
        features=features,
    )
    data.save_to_disk(str(folder))
    return time.perf_counter() - started


def peak_rss_mb() -> float:
    """The peak resident memory of the process (``VmHWM``: reset at exec, unlike ``ru_maxrss``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def measure(folder: str, clients: int) -> dict[str, float]:
    """One ``build_federated_data`` of the natural partition in this process (the child's work)."""
    started = time.perf_counter()
    from fl_app.data.federated import DataSpec, build_federated_data

    spec = DataSpec(
        {"name": "hf", "path": folder, "label_column": "character"},
        {"name": "natural", "column": "writer_id"},
        clients,
        0,
    )
    data = build_federated_data(spec)
    wall = time.perf_counter() - started
    return {
        "wall_s": wall,
        "peak_rss_mb": peak_rss_mb(),
        "train_rows": float(len(data.arrays.y_train)),
        "client_rows": float(sum(data.client_sizes())),
        "clients": float(len(data.client_rows)),
    }


def grouping(folder: str) -> dict[str, float]:
    """Seconds of dpfl's grouping and of ``NaturalIdPartitioner`` over the saved id column."""
    import datasets
    import numpy as np
    from flwr_datasets.partitioner import NaturalIdPartitioner

    from fl_app.data.natural import group_rows

    ids = datasets.load_from_disk(folder).select_columns(["writer_id"])
    values = ids.with_format("arrow")[:]["writer_id"].to_numpy(zero_copy_only=False)
    started = time.perf_counter()
    _, codes = np.unique(values.astype(str), return_inverse=True)
    ours = group_rows(codes)[1]
    numpy_s = time.perf_counter() - started
    started = time.perf_counter()
    partitioner = NaturalIdPartitioner(partition_by="writer_id")
    partitioner.dataset = ids
    theirs = [len(partitioner.load_partition(i)) for i in range(partitioner.num_partitions)]
    flwr_s = time.perf_counter() - started
    assert sorted(theirs) == sorted(len(r) for r in ours)
    return {"numpy_s": numpy_s, "flwr_s": flwr_s, "users": float(len(ours))}


def child(kind: str, folder: str, clients: int, home: str) -> dict[str, float]:
    """Run ``kind`` in a fresh interpreter with the dpfl cache in ``home``."""
    env = {**os.environ, "DPFL_DATA_HOME": home, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-P", __file__, "--child", kind, "--folder", folder, "--clients", str(clients)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    """Build the data set, measure in child processes, print (and write) the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--users", type=int, default=3_500)
    parser.add_argument("--clients", type=int, default=1_000)
    parser.add_argument("--out", type=Path, help="write the table into this page's generated block")
    parser.add_argument("--child", choices=("measure", "grouping"), help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = measure(args.folder, args.clients) if args.child == "measure" else grouping(args.folder)
        print(json.dumps(result))
        return
    with tempfile.TemporaryDirectory(prefix="dpfl-hf-bench-") as tmp:
        folder, home = str(Path(tmp) / "femnist_like"), str(Path(tmp) / "dpfl")
        build_s = build(Path(folder), rows=args.rows, users=args.users, seed=0)
        first = child("measure", folder, args.clients, home)
        cached = child("measure", folder, args.clients, home)
        groups = child("grouping", folder, args.clients, home)
        cache_mb = sum(p.stat().st_size for p in Path(home).rglob("*.npz")) / 2**20
    rows = [
        ["first run: load, convert, partition", f"{first['wall_s']:.2f}", f"{first['peak_rss_mb']:.0f}"],
        ["second run: from the dpfl cache", f"{cached['wall_s']:.2f}", f"{cached['peak_rss_mb']:.0f}"],
        ["grouping by user: numpy (dpfl)", f"{groups['numpy_s']:.3f}", ""],
        ["grouping by user: flwr-datasets NaturalIdPartitioner", f"{groups['flwr_s']:.3f}", ""],
    ]
    lines = [
        f"{args.rows:,} rows (28x28 grayscale PNG), {args.users:,} users, natural partition with "
        f"{args.clients:,} clients ({int(first['client_rows']):,} client rows of "
        f"{int(first['train_rows']):,} training rows); building and saving the data set took "
        f"{build_s:.1f} s (not counted); the dpfl "
        f"cache holds {cache_mb:.0f} MB; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, Python {platform.python_version()}.",
        "",
        *markdown_table(["step", "wall (s)", "peak RSS of the process (MB)"], rows),
    ]
    print("\n".join(lines))
    if args.out is not None:
        replace_generated_block(args.out, lines, begin=BEGIN, end=END)


if __name__ == "__main__":
    main()
