"""The central arms' second edition (banded MF beside DP-FedAvg and DP-FTRL): keep runs, print tables.

Usage (from the repository root)::

    python -P benchmarks/banded_mf.py keep SWEEP [--out docs/benchmarks/banded_mf/runs]
    python -P benchmarks/banded_mf.py losses [--rounds 50 100 200] [--bands 2 4 5 10]
    python -P benchmarks/banded_mf.py auto [--rounds 50 100 200] [--epsilons 1 2 4 8]
    python -P benchmarks/banded_mf.py plot [RUNS] [--out docs/benchmarks/banded_mf/central_arms.png]

``keep`` copies each job's ``results.json`` and Hydra's ``.hydra/config.yaml`` (the arm's per-budget
rules) from a sweep directory into ``--out``, one folder per job (about 25 KB each; the models,
ledgers and logs stay behind), so that ``python -m fl_app.report`` regenerates the table and the plots
from the repository alone. ``losses`` prints the noise reduction of the optimised banded Toeplitz
matrices (``||A C^{-1}||_F^2`` against independent noise, prefix sums); ``auto`` prints the band count
``strategy.bands=auto`` picks in the cross-device shape (N = 1000, 100 per round) and the models' noise
variance of each band count relative to one band (DP-FedAvg's noise); ``plot`` draws the kept runs' arms
on one axis (``fl_app.report`` gives each privacy unit its own panel, and the three arms' units differ
only in the neighbouring relation: a client's data set, central DP), every seed as a dot.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "docs" / "benchmarks" / "banded_mf" / "runs"


def keep(sweep: Path, out: Path) -> int:
    """Copy every job's results.json and .hydra/config.yaml below ``sweep`` into ``out``."""
    from benchmarks import keep_runs

    return keep_runs.main([str(sweep), "--out", str(out)])


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
    """Markdown table: the bands ``strategy.bands=auto`` picks at N = 1000, m = 100, delta 1e-5.

    Each cell also gives the models' total noise variance with those bands relative to one band
    (:func:`~strategies.dp_bandmf.strategy.expected_error`; one band is DP-FedAvg's noise).
    """
    from strategies.dp_bandmf.strategy import choose_bands, expected_error

    print("| rounds T | " + " | ".join(f"epsilon {e:g}" for e in epsilons) + " |")
    print("|---" * (len(epsilons) + 1) + "|")
    for n in rounds:
        cells = []
        for e in epsilons:
            shape = dict(
                epsilon=e, delta=1e-5, num_clients=1000, clients_per_round=100, rounds=n, momentum=0.0
            )
            bands = choose_bands(**shape)
            ratio = expected_error(bands=bands, **shape) / expected_error(bands=1, **shape)
            cells.append(f"{bands} ({ratio:.3f})")
        print(f"| {n} | " + " | ".join(cells) + " |")


def plot(runs_dir: Path, out: Path) -> int:
    """One panel: final test accuracy against epsilon for every arm of the kept runs, seeds as dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fl_app.report import load_runs

    runs, problems = load_runs(runs_dir)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    runs = [run for run in runs if run.completed and run.results["final"].get("epsilon") is not None]
    if problems:
        return 2
    if not runs:
        print(f"error: no completed private runs below {runs_dir}", file=sys.stderr)
        return 2
    by_arm: dict[str, dict[float, list[float]]] = {}
    labels: dict[tuple[str, float], str] = {}
    for run in runs:
        arm = str(run.results["strategy"])
        epsilon = float(run.config["privacy"]["epsilon"])
        by_arm.setdefault(arm, {}).setdefault(epsilon, []).append(float(run.results["final"]["accuracy"]))
        bands = run.results["privacy"].get("bands")
        labels[(arm, epsilon)] = f"T={len(run.results['rounds'])}" + (f", b={bands}" if bands else "")
    figure, axis = plt.subplots(figsize=(7.5, 4.8))
    offsets = {arm: 0.05 * (i - (len(by_arm) - 1) / 2) for i, arm in enumerate(sorted(by_arm))}
    for (arm, budgets), colour in zip(sorted(by_arm.items()), plt.cm.tab10.colors, strict=False):
        epsilons = sorted(budgets)
        shift = [e * (1 + offsets[arm]) for e in epsilons]  # side by side at each budget
        means = [sum(budgets[e]) / len(budgets[e]) for e in epsilons]
        axis.plot(
            shift, means, marker="o", color=colour, label=f"{arm} (mean of {len(budgets[epsilons[0]])} seeds)"
        )
        for x, e in zip(shift, epsilons, strict=True):
            axis.scatter([x] * len(budgets[e]), budgets[e], s=10, color=colour, alpha=0.45)
            axis.annotate(
                labels[(arm, e)],
                (x, min(budgets[e])),
                textcoords="offset points",
                xytext=(0, -11),
                ha="center",
                fontsize=6,
                color=colour,
            )
    budgets = sorted({e for values in by_arm.values() for e in values})
    axis.set_xscale("log")
    axis.set_xticks(budgets, [f"{b:g}" for b in budgets])
    axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axis.set_xlabel("epsilon per client (delta 1e-5; central DP; log scale)")
    axis.set_ylabel("final test accuracy")
    axis.set_title(
        "central-DP arms, one command, one code version\n(dots: seeds; T rounds, b bands)", fontsize=9
    )
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8, loc="lower right")
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)
    plt.close(figure)
    print(f"wrote {out}")
    return 0


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
    drawn = commands.add_parser("plot", help="the kept runs' arms on one axis")
    drawn.add_argument("runs", type=Path, nargs="?", default=RUNS)
    drawn.add_argument("--out", type=Path, default=RUNS.parent / "central_arms.png")
    args = parser.parse_args()
    if args.command == "keep":
        return keep(args.sweep, args.out)
    if args.command == "plot":
        return plot(args.runs, args.out)
    if args.command == "losses":
        losses(args.rounds, args.bands)
    else:
        auto(args.rounds, args.epsilons)
    return 0


if __name__ == "__main__":
    sys.exit(main())
