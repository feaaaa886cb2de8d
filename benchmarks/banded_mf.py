"""The central arms' second edition (banded MF beside DP-FedAvg and DP-FTRL): keep runs, print tables.

Usage (from the repository root)::

    python -P benchmarks/banded_mf.py keep SWEEP [--out docs/benchmarks/banded_mf/runs]
    python -P benchmarks/banded_mf.py losses [--rounds 50 100 200] [--bands 2 4 5 10]
    python -P benchmarks/banded_mf.py auto [--rounds 50 100 200] [--epsilons 1 2 4 8]

``keep`` copies each job's ``results.json`` and Hydra's ``.hydra/config.yaml`` (the arm's per-budget
rules) from a sweep directory into ``--out``, one folder per job (about 25 KB each; the models,
ledgers and logs stay behind), so that ``python -m fl_app.report`` regenerates the table and the plots
from the repository alone. ``losses`` prints the noise reduction of the optimised banded Toeplitz
matrices (``||A C^{-1}||_F^2`` against independent noise, prefix sums); ``auto`` prints the band count
``strategy.bands=auto`` picks in the cross-device shape (N = 1000, 100 per round).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "benchmarks" / "banded_mf" / "runs"


def keep(sweep: Path, out: Path) -> int:
    """Copy every job's results.json and .hydra/config.yaml below ``sweep`` into ``out``."""
    jobs = sorted(path.parent for path in sweep.rglob("results.json"))
    if not jobs:
        print(f"error: no results.json below {sweep}", file=sys.stderr)
        return 2
    for job in jobs:
        target = out / job.name
        (target / ".hydra").mkdir(parents=True, exist_ok=True)
        shutil.copy2(job / "results.json", target / "results.json")
        saved = job / ".hydra" / "config.yaml"
        if saved.is_file():
            shutil.copy2(saved, target / ".hydra" / "config.yaml")
    print(f"kept {len(jobs)} runs in {out}")
    return 0


def losses(rounds: list[int], bands: list[int]) -> None:
    """Markdown table: loss of the optimised matrix relative to independent noise."""
    from strategies.dp_bandmf.factorization import optimal_banded_toeplitz

    print("| rounds T | " + " | ".join(f"{b} bands" for b in bands) + " |")
    print("|---" * (len(bands) + 1) + "|")
    for n in rounds:
        cells = []
        for b in bands:
            matrix = optimal_banded_toeplitz(rounds=n, bands=b)
            cells.append(f"{matrix.loss / matrix.identity_loss:.3f}")
        print(f"| {n} | " + " | ".join(cells) + " |")


def auto(rounds: list[int], epsilons: list[float]) -> None:
    """Markdown table: the bands ``strategy.bands=auto`` picks at N = 1000, m = 100, delta 1e-5."""
    from strategies.dp_bandmf.strategy import choose_bands

    print("| rounds T | " + " | ".join(f"epsilon {e:g}" for e in epsilons) + " |")
    print("|---" * (len(epsilons) + 1) + "|")
    for n in rounds:
        picks = [
            choose_bands(
                epsilon=e, delta=1e-5, num_clients=1000, clients_per_round=100, rounds=n, momentum=0.0
            )
            for e in epsilons
        ]
        print(f"| {n} | " + " | ".join(str(b) for b in picks) + " |")


def main() -> int:
    """Parse the command line and run one subcommand."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    kept = commands.add_parser("keep", help="copy a sweep's results.json files into the repository")
    kept.add_argument("sweep", type=Path)
    kept.add_argument("--out", type=Path, default=RUNS)
    table = commands.add_parser("losses", help="the matrices' noise reduction")
    table.add_argument("--rounds", type=int, nargs="+", default=[50, 100, 200])
    table.add_argument("--bands", type=int, nargs="+", default=[2, 4, 5, 10])
    picks = commands.add_parser("auto", help="what strategy.bands=auto picks")
    picks.add_argument("--rounds", type=int, nargs="+", default=[50, 100, 200])
    picks.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    args = parser.parse_args()
    if args.command == "keep":
        return keep(args.sweep, args.out)
    if args.command == "losses":
        losses(args.rounds, args.bands)
    else:
        auto(args.rounds, args.epsilons)
    return 0


if __name__ == "__main__":
    sys.exit(main())
