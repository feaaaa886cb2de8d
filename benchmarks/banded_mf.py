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
on one axis (``fl_app.report.sweep`` gives each privacy unit its own panel, and the central arms' units
differ only in the neighbouring relation: a client's data set, central DP), every seed as a dot, the
runs' code versions in the title.
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


Arm = tuple[str, str]


def group_arms(
    runs: list,
) -> tuple[dict[Arm, dict[float, list[float]]], dict[tuple[str, str, float], str], list[float]]:
    """The completed runs' final accuracies by arm and budget, their annotations, and the reference.

    An arm is a strategy and its label (``label=untuned``: settings fixed before validation was seen,
    ``""`` for the tuned row); a run without epsilon (non-private FedAvg) is the reference. An
    annotation is the run's rounds ``T``, with banded MF's bands ``b`` and DP-BLT's buffers ``d``.
    """
    by_arm: dict[Arm, dict[float, list[float]]] = {}
    labels: dict[tuple[str, str, float], str] = {}
    reference: list[float] = []
    for run in (r for r in runs if r.completed):
        accuracy = float(run.results["final"]["accuracy"])
        if run.results["final"].get("epsilon") is None:
            reference.append(accuracy)
            continue
        arm = (str(run.results["strategy"]), str(run.config.get("label") or ""))
        epsilon = float(run.config["privacy"]["epsilon"])
        by_arm.setdefault(arm, {}).setdefault(epsilon, []).append(accuracy)
        bands = run.results["privacy"].get("bands")
        buffers = run.results["privacy"].get("strategy_matrix", {}).get("buffers")  # DP-BLT's
        labels[(*arm, epsilon)] = (
            f"T={len(run.results['rounds'])}"
            + (f", b={bands}" if bands else "")
            + (f", d={buffers}" if buffers is not None else "")
        )
    return by_arm, labels, reference


#: The block of docs/benchmarks/cross_device.md that :func:`gaps_table` writes.
GAPS_BEGIN = "<!-- BEGIN GENERATED: cross_device/central_gaps.md -->"
GAPS_END = "<!-- END GENERATED -->"


def _mean(values: list[float]) -> float:
    # the float sum, as fl_app.report.sweep's means: statistics.mean (exact) rounds 0.8075 the other way
    return sum(values) / len(values)


def gaps_table(
    by_arm: dict[Arm, dict[float, list[float]]], *, against: tuple[str, ...] = ("dp_bandmf", "dp_blt")
) -> list[str]:
    """Markdown lines: each central arm's tuned and untuned mean per budget, and ``against`` beside them.

    Columns per budget: the tuned row's mean over seeds, the untuned row's, what the tuning bought
    (tuned minus untuned, points), and for each arm of ``against`` that has a tuned row, its tuned
    mean minus this arm's tuned row (points).
    """
    from benchmarks.tables import markdown_table

    references = {name: by_arm[(name, "")] for name in against if (name, "") in by_arm}
    rows = []
    for strategy in sorted({strategy for strategy, _ in by_arm}):
        tuned, untuned = by_arm.get((strategy, ""), {}), by_arm.get((strategy, "untuned"), {})
        for epsilon in sorted(set(tuned) | set(untuned)):
            a, b = tuned.get(epsilon), untuned.get(epsilon)
            rows.append(
                [
                    strategy,
                    f"{epsilon:g}",
                    f"{_mean(a):.3f} ({len(a)})" if a else "-",
                    f"{_mean(b):.3f} ({len(b)})" if b else "-",
                    f"{100 * (_mean(a) - _mean(b)):+.1f}" if a and b else "-",
                    *(
                        "-"
                        if strategy == name or not a or epsilon not in reference
                        else f"{100 * (_mean(reference[epsilon]) - _mean(a)):+.1f}"
                        for name, reference in references.items()
                    ),
                ]
            )
    header = [
        "arm",
        "epsilon",
        "tuned (seeds)",
        "untuned (seeds)",
        "tuning bought (points)",
        *(f"{name} minus this arm (points)" for name in references),
    ]
    return markdown_table(header, rows)


def write_gaps(runs_dir: Path, page: Path) -> int:
    """Write :func:`gaps_table` of the kept runs into ``page``'s generated block."""
    from benchmarks.tables import replace_generated_block
    from fl_app.report.sweep import load_runs

    runs, problems = load_runs(runs_dir)
    by_arm, _, _ = group_arms(runs)
    if problems or not by_arm:
        print(f"error: no completed private runs below {runs_dir}", file=sys.stderr)
        return 2
    if not replace_generated_block(page, gaps_table(by_arm), begin=GAPS_BEGIN, end=GAPS_END):
        print(f"error: {page} lacks the markers {GAPS_BEGIN} ... {GAPS_END}", file=sys.stderr)
        return 2
    return 0


def code_versions(runs: list) -> str:
    """The completed runs' code versions in words: ``code a53bc25`` or ``code a53bc25 (99 runs), ...``."""
    from collections import Counter

    from fl_app.run.code_version import describe

    counts = Counter(describe(run.results.get("code")) for run in runs if run.completed)
    if len(counts) == 1:
        return f"code {next(iter(counts))}"
    return "code " + ", ".join(f"{name} ({count} runs)" for name, count in counts.most_common())


def plot(runs_dir: Path, out: Path) -> int:
    """One panel: final test accuracy against epsilon for every arm of the kept runs, seeds as dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fl_app.report.sweep import load_runs

    runs, problems = load_runs(runs_dir)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    if problems:
        return 2
    by_arm, labels, reference = group_arms(runs)
    if not by_arm:
        print(f"error: no completed private runs below {runs_dir}", file=sys.stderr)
        return 2
    figure, axis = plt.subplots(figsize=(11, 5.4))
    strategies = sorted({strategy for strategy, _ in by_arm})
    colours = dict(zip(strategies, plt.cm.tab10.colors, strict=False))
    offsets = {arm: 0.04 * (i - (len(by_arm) - 1) / 2) for i, arm in enumerate(sorted(by_arm))}
    for arm, budgets in sorted(by_arm.items()):
        strategy, label = arm
        colour = colours[strategy]
        epsilons = sorted(budgets)
        shift = [e * (1 + offsets[arm]) for e in epsilons]  # side by side at each budget
        means = [sum(budgets[e]) / len(budgets[e]) for e in epsilons]
        name = f"{strategy} ({label})" if label else strategy
        axis.plot(
            shift,
            means,
            marker="o",
            color=colour,
            linestyle="--" if label else "-",
            markerfacecolor="white" if label else colour,
            label=f"{name} (mean of {len(budgets[epsilons[0]])} seeds)",
        )
        for x, e in zip(shift, epsilons, strict=True):
            axis.scatter([x] * len(budgets[e]), budgets[e], s=10, color=colour, alpha=0.45)
            if label:  # the untuned rows share one rule (the title says which); only the tuned ones differ
                continue
            axis.annotate(
                labels[(*arm, e)],
                (x, min(budgets[e])),
                textcoords="offset points",
                xytext=(0, -11),
                ha="center",
                fontsize=6,
                color=colour,
            )
    if reference:
        mean = sum(reference) / len(reference)
        axis.axhline(mean, color="black", linestyle=":", linewidth=1)
        axis.annotate(
            f"non-private FedAvg {mean:.3f} (mean of {len(reference)} seeds)",
            (0.01, mean),
            xycoords=("axes fraction", "data"),
            textcoords="offset points",
            xytext=(0, 3),
            fontsize=7,
        )
    budgets = sorted({e for values in by_arm.values() for e in values})
    axis.set_xscale("log")
    axis.set_xticks(budgets, [f"{b:g}" for b in budgets])
    axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axis.set_xlabel("epsilon per client (delta 1e-5; central DP; log scale)")
    axis.set_ylabel("final test accuracy")
    dashed = " dashed: untuned;" if any(label for _, label in by_arm) else ""
    keys = " T rounds" + "".join(
        text
        for mark, text in ((", b=", ", b bands"), (", d=", ", d BLT buffers"))
        if any(mark in note for note in labels.values())
    )
    axis.set_title(f"central-DP arms, {code_versions(runs)}\n(dots: seeds;{dashed}{keys})", fontsize=9)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))  # outside: no point hidden
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
