"""Plot and tabulate the clustering-evaluation benchmark (docs/benchmarks/laplace_eval.md).

MindSpore Federated documentation, "Horizontal Federated-Local Differential
Privacy Inference Result Protection": the document shows that the silhouette
score computed on Laplace-protected inference results follows the same trend as
the one on clear results (``NOT_ENCRYPT``). This script reads the
``results.json`` of runs made with ``+experiment=laplace_eval`` and writes, into
``docs/benchmarks/figures/`` by default:

* ``laplace_eval_silhouette.png``: silhouette per round for every mode, one
  panel per training strategy, with the training loss on a second axis;
* ``laplace_eval_calinski_harabasz.png``: the same for the Calinski-Harabasz index;
* ``laplace_eval_table.md``: the runs (size, failures, accuracy, wall time);
  per run, the per-report epsilon, the Pearson and Spearman correlations of its
  score curves with the clear run's, the correlation of its silhouette with the
  training loss, and the largest difference of its training loss from the
  clear run's (training must not depend on the evaluation); per strategy, the
  smallest epsilon down to which every protected curve follows the clear one
  (Pearson r >= ``FOLLOWS``).

The same text replaces the block between ``<!-- BEGIN GENERATED -->`` and
``<!-- END GENERATED -->`` of the benchmark page (``--page``, default
``<out>/../laplace_eval.md``) when the page has those markers, so that every
number on the page comes from the runs' ``results.json``.

Usage::

    python benchmarks/laplace_eval.py /tmp/bench_laplace_eval/runs [--out docs/benchmarks/figures]
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.tables, with or without -P

from benchmarks.tables import completed_runs, fmt, markdown_table, replace_generated_block

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "figures"
CLEAR = "NOT_ENCRYPT"
BEGIN, END = "<!-- BEGIN GENERATED -->", "<!-- END GENERATED -->"
#: Pearson correlation with the clear curve from which a protected curve is said to follow its trend.
FOLLOWS = 0.9
#: A number for a table cell, ``cell(value, digits=3)``: "null" for None (a clear run's epsilon),
#: "-" for NaN (a correlation that cannot be computed).
cell = partial(fmt, digits=3, missing="null", nan="-")


def load_runs(folder: Path) -> list[dict[str, Any]]:
    """The completed runs ``folder/<name>/results.json`` with a clustering evaluation, and their name."""
    runs = []
    for results in completed_runs(folder):
        path = Path(results["_path"])
        if path.parent != folder or results["privacy"].get("evaluation") is None:
            continue
        results["name"] = path.name
        runs.append(results)
    return runs


def mode_label(results: dict[str, Any]) -> str:
    """``clear`` or ``eps=<per-report epsilon>`` (the epsilon the noise gives, sensitivity 2)."""
    evaluation = results["privacy"]["evaluation"]
    if evaluation["privacy_eval_type"] == CLEAR:
        return "clear (NOT_ENCRYPT)"
    label = f"eps={evaluation['epsilon_per_report']:.6g}"
    if evaluation["sensitivity_configured"] != evaluation["sensitivity_true"]:
        configured, sensitivity = evaluation["laplace_eval_eps"], evaluation["sensitivity_configured"]
        label += f" (configured {configured:.6g}, sensitivity {sensitivity:g})"
    return label


def series(results: dict[str, Any], key: str) -> tuple[np.ndarray, np.ndarray]:
    """Rounds and values of ``rounds[].key`` where it is not null."""
    rows = [(r["round"], r[key]) for r in results["rounds"] if r.get(key) is not None]
    return np.array([r for r, _ in rows]), np.array([v for _, v in rows], dtype=np.float64)


def _correlations(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    if len(a) < 3 or np.std(a) == 0 or np.std(b) == 0:
        return math.nan, math.nan
    return float(stats.pearsonr(a, b).statistic), float(stats.spearmanr(a, b).statistic)


def _aligned(
    first: dict[str, Any], first_key: str, second: dict[str, Any], second_key: str
) -> tuple[np.ndarray, np.ndarray]:
    """Values of two series on the rounds where both exist."""
    a = dict(zip(*series(first, first_key), strict=True))
    b = dict(zip(*series(second, second_key), strict=True))
    common = sorted(set(a) & set(b))
    return np.array([a[r] for r in common]), np.array([b[r] for r in common])


def _paired(results: dict[str, Any], reference: dict[str, Any], key: str) -> tuple[np.ndarray, np.ndarray]:
    return _aligned(results, key, reference, key)


def _epsilon_order(results: dict[str, Any]) -> tuple[int, float]:
    """Sort key: the clear run first, then from the largest per-report epsilon to the smallest."""
    eps = results["privacy"]["evaluation"]["epsilon_per_report"]
    return (0, 0.0) if eps is None else (1, -float(eps))


def table(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run: epsilon, scores and correlations with the clear run of the same strategy."""
    rows = []
    for strategy in sorted({r["strategy"] for r in runs}):
        group = sorted((r for r in runs if r["strategy"] == strategy), key=_epsilon_order)
        clear = next((r for r in group if r["privacy"]["evaluation"]["privacy_eval_type"] == CLEAR), None)
        for results in group:
            evaluation = results["privacy"]["evaluation"]
            _, silhouette = series(results, "silhouette")
            row: dict[str, Any] = {
                "strategy": strategy,
                "run": results["name"],
                "mode": mode_label(results),
                "scale": evaluation["scale"],
                "epsilon_per_report": evaluation["epsilon_per_report"],
                "epsilon_cumulative": evaluation["epsilon_cumulative"],
                "evaluations_per_client": evaluation["max_evaluations_per_client"],
                "rounds": len(results["rounds"]),
                "silhouette_first": float(silhouette[0]) if len(silhouette) else math.nan,
                "silhouette_last": float(silhouette[-1]) if len(silhouette) else math.nan,
                "silhouette_mean": float(np.mean(silhouette)) if len(silhouette) else math.nan,
                "training_epsilon": results["final"]["epsilon"],
                "test_accuracy": results["final"]["accuracy"],
            }
            row["r_silhouette_train_loss"] = _correlations(
                *_aligned(results, "silhouette", results, "train_loss")
            )[0]
            if clear is not None:
                a, b = _paired(results, clear, "silhouette")
                row["pearson_silhouette"], row["spearman_silhouette"] = _correlations(a, b)
                # Round-to-round changes: two curves that merely both rise with training correlate
                # highly; their changes correlate only if the protected one also tracks the clear
                # one's ups and downs.
                row["pearson_silhouette_changes"] = _correlations(np.diff(a), np.diff(b))[0]
                a, b = _paired(results, clear, "calinski_harabasz")
                row["pearson_calinski_harabasz"], row["spearman_calinski_harabasz"] = _correlations(a, b)
                a, b = _paired(results, clear, "train_loss")
                row["max_train_loss_diff"] = float(np.max(np.abs(a - b))) if len(a) else math.nan
            rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    """The benchmark table as Markdown."""
    header = [
        "strategy",
        "mode",
        "scale b",
        "eps per report",
        "eps cumulative",
        "silhouette first / last / mean",
        "Pearson r (Spearman) silhouette vs clear",
        "r of round-to-round changes vs clear",
        "Pearson r (Spearman) CH vs clear",
        "r(silhouette, train loss)",
        "max train-loss diff vs clear",
        "follows the clear trend",
    ]
    lines = []
    for row in rows:
        pearson = row.get("pearson_silhouette", math.nan)
        if row["epsilon_per_report"] is None:
            follows = "(reference)"
        elif math.isnan(pearson):
            follows = "-"
        else:
            follows = "yes" if pearson >= FOLLOWS else "no"
        lines.append(
            [
                row["strategy"],
                row["mode"],
                cell(row["scale"]),
                cell(row["epsilon_per_report"], digits=6),
                cell(row["epsilon_cumulative"], digits=6),
                " / ".join(cell(row[f"silhouette_{which}"]) for which in ("first", "last", "mean")),
                f"{cell(pearson)} ({cell(row.get('spearman_silhouette', math.nan))})",
                cell(row.get("pearson_silhouette_changes", math.nan)),
                f"{cell(row.get('pearson_calinski_harabasz', math.nan))} "
                f"({cell(row.get('spearman_calinski_harabasz', math.nan))})",
                cell(row["r_silhouette_train_loss"]),
                cell(row.get("max_train_loss_diff", math.nan), digits=2),
                follows,
            ]
        )
    return "\n".join(markdown_table(header, lines)) + "\n"


def plot(runs: list[dict[str, Any]], key: str, ylabel: str, path: Path, *, log: bool = False) -> None:
    """Per strategy: ``key`` per round for every mode, with the training loss (top); z-scored (bottom).

    The bottom row standardizes each curve (mean 0, std 1) so that its trend can be compared with the
    clear curve's whatever the noise does to its level and range.
    """
    strategies = sorted({r["strategy"] for r in runs})
    figure, axes = plt.subplots(2, len(strategies), figsize=(6.5 * len(strategies), 8.4), squeeze=False)
    for column, strategy in enumerate(strategies):
        top, bottom = axes[0][column], axes[1][column]
        group = sorted((r for r in runs if r["strategy"] == strategy), key=_epsilon_order)
        noised = sum(r["privacy"]["evaluation"]["privacy_eval_type"] != CLEAR for r in group)
        protected = iter(plt.cm.viridis(np.linspace(0.85, 0.0, max(noised, 1))))
        loss_run = None
        for results in group:
            rounds, values = series(results, key)
            clear = results["privacy"]["evaluation"]["privacy_eval_type"] == CLEAR
            loss_run = results if clear else loss_run
            style = {
                "color": "black" if clear else next(protected),
                "ms": 3,
                "lw": 2 if clear else 1.2,
                "label": mode_label(results),
            }
            top.plot(rounds, values, "o-" if clear else "s--", **style)
            if len(values) > 1 and np.std(values) > 0:
                bottom.plot(
                    rounds, (values - values.mean()) / values.std(), "o-" if clear else "s--", **style
                )
        if log:
            top.set_yscale("log")
        top.set_ylabel(ylabel)
        top.set_title(f"{strategy}: {ylabel} per round")
        bottom.set_ylabel(f"{ylabel}, standardized per curve")
        bottom.set_title(f"{strategy}: trends only (each curve z-scored)")
        for axis, where in ((top, "center right"), (bottom, "lower right")):
            axis.set_xlabel("round")
            axis.legend(fontsize=7, loc=where)
        if loss_run is not None:
            right = top.twinx()
            rounds, values = series(loss_run, "train_loss")
            right.plot(rounds, values, ":", color="tab:red", lw=1.5, label="training loss (clear run)")
            right.set_ylabel("training loss (clients' mean)", color="tab:red")
            right.legend(loc="upper center", fontsize=7)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _seconds(value: Any) -> str:
    return "-" if value is None else f"{float(value):.0f} s"


def runs_table(runs: list[dict[str, Any]]) -> str:
    """The runs as Markdown: size, failures, final accuracy and wall time, from ``results.json``."""
    header = [
        "run",
        "strategy",
        "mode",
        "rounds",
        "clients evaluated per round",
        "vectors per round (mean)",
        "failed train / evaluation replies",
        "final accuracy",
        "training epsilon",
        "wall time",
    ]
    rows = []
    for results in sorted(runs, key=lambda r: (r["strategy"], _epsilon_order(r))):
        rounds = results["rounds"]
        _, reports = series(results, "cluster_eval_reports")
        _, clients = series(results, "cluster_eval_clients")
        train_failures = sum(int(r.get("failures") or 0) for r in rounds)
        eval_failures = sum(int(r.get("cluster_eval_failures") or 0) for r in rounds)
        final = results["final"]
        rows.append(
            [
                results["name"],
                results["strategy"],
                mode_label(results),
                len(rounds),
                cell(float(np.max(clients)) if len(clients) else math.nan),
                cell(float(np.mean(reports)) if len(reports) else math.nan, digits=4),
                f"{train_failures} / {eval_failures}",
                cell(final.get("accuracy")),
                cell(final.get("epsilon")),
                _seconds(final.get("wall_s")),
            ]
        )
    return "\n".join(markdown_table(header, rows)) + "\n"


def follows_down_to(rows: list[dict[str, Any]]) -> str:
    """Per strategy: the smallest epsilon down to which every protected curve follows the clear one."""
    lines = []
    for strategy in sorted({row["strategy"] for row in rows}):
        protected = [
            row
            for row in rows
            if row["strategy"] == strategy
            and row["epsilon_per_report"] is not None
            and not math.isnan(row.get("pearson_silhouette", math.nan))
        ]
        if not protected:
            lines.append(f"* {strategy}: no clear run or no protected run to compare")
            continue
        protected.sort(key=lambda row: -row["epsilon_per_report"])
        lowest = None
        for row in protected:
            if row["pearson_silhouette"] < FOLLOWS:
                break
            lowest = row
        failing = [row for row in protected if row["pearson_silhouette"] < FOLLOWS]
        verdict = (
            f"follows the clear silhouette trend (Pearson r >= {FOLLOWS:g}) at every tested epsilon "
            f"down to {cell(lowest['epsilon_per_report'], digits=6)} "
            f"(r = {cell(lowest['pearson_silhouette'])})"
            if lowest is not None
            else f"does not follow the clear trend (Pearson r >= {FOLLOWS:g}) at any tested epsilon"
        )
        if lowest is not None:
            tracked = [row for row in protected if row["epsilon_per_report"] >= lowest["epsilon_per_report"]]
            verdict += "; round-to-round changes r = " + ", ".join(
                f"{cell(row['pearson_silhouette_changes'])} "
                f"(epsilon {cell(row['epsilon_per_report'], digits=6)})"
                for row in tracked
            )
        if failing:
            verdict += "; not at " + ", ".join(
                f"epsilon {cell(row['epsilon_per_report'], digits=6)} (r = {cell(row['pearson_silhouette'])})"
                for row in failing
            )
        lines.append(f"* {strategy}: {verdict}")
    return "\n".join(lines) + "\n"


def generated(runs: list[dict[str, Any]]) -> str:
    """The whole generated block: runs, scores and correlations, verdicts."""
    rows = table(runs)
    return (
        "Runs (from `results.json`):\n\n"
        + runs_table(runs)
        + "\nScores and correlations with the clear run of the same strategy (Pearson r over the rounds; "
        "Spearman in parentheses; CH = Calinski-Harabasz):\n\n"
        + markdown(rows)
        + "\nVerdict (silhouette, Pearson r against the clear curve):\n\n"
        + follows_down_to(rows)
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Read the runs, write the figures and the table; print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", type=Path, help="folder whose subfolders hold results.json files")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the figures and the table go")
    parser.add_argument(
        "--page",
        type=Path,
        default=None,
        help="page whose generated block is rewritten (default: <out>/../laplace_eval.md)",
    )
    args = parser.parse_args(argv)
    runs = load_runs(args.runs)
    if not runs:
        parser.error(f"no results.json with a clustering evaluation below {args.runs}")
    plot(runs, "silhouette", "silhouette score", args.out / "laplace_eval_silhouette.png")
    plot(
        runs,
        "calinski_harabasz",
        "Calinski-Harabasz index",
        args.out / "laplace_eval_calinski_harabasz.png",
        log=True,
    )
    text = generated(runs)
    (args.out / "laplace_eval_table.md").write_text(text)
    page = args.page if args.page is not None else args.out.parent / "laplace_eval.md"
    print(text)
    if replace_generated_block(page, text, begin=BEGIN, end=END):
        print(f"updated the generated block of {page}", file=sys.stderr)
    elif args.page is not None or page.is_file():
        print(f"{page}: no file or no {BEGIN} ... {END} block; not updated", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
