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
* ``laplace_eval_table.md``: per run, the per-report epsilon, the Pearson and
  Spearman correlations of its score curves with the clear run's, the
  correlation of its silhouette with the training loss, and the largest
  difference of its training loss from the clear run's (training must not
  depend on the evaluation).

Usage::

    python benchmarks/laplace_eval.py /tmp/bench_laplace_eval/runs [--out docs/benchmarks/figures]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

# `python benchmarks/laplace_eval.py` puts benchmarks/ first on sys.path, where platform.py (the
# platform benchmark) would shadow the standard library's `platform` that numpy imports.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from scipy import stats

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks" / "figures"
CLEAR = "NOT_ENCRYPT"
#: Pearson correlation with the clear curve from which a protected curve is said to follow its trend.
FOLLOWS = 0.9


def load_runs(folder: Path) -> list[dict[str, Any]]:
    """Every ``results.json`` below ``folder`` that has a clustering evaluation, with its run name."""
    runs = []
    for path in sorted(folder.glob("*/results.json")):
        results = json.loads(path.read_text())
        evaluation = results.get("privacy", {}).get("evaluation")
        if evaluation is None:
            continue
        results["name"] = path.parent.name
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


def _epsilon_order(results: dict[str, Any]) -> float:
    eps = results["privacy"]["evaluation"]["epsilon_per_report"]
    return math.inf if eps is None else -float(eps)


def table(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per run: epsilon, scores and correlations with the clear run of the same strategy."""
    rows = []
    for strategy in sorted({r["strategy"] for r in runs}):
        group = sorted((r for r in runs if r["strategy"] == strategy), key=_epsilon_order, reverse=True)
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
                a, b = _paired(results, clear, "calinski_harabasz")
                row["pearson_calinski_harabasz"], row["spearman_calinski_harabasz"] = _correlations(a, b)
                a, b = _paired(results, clear, "train_loss")
                row["max_train_loss_diff"] = float(np.max(np.abs(a - b))) if len(a) else math.nan
            rows.append(row)
    return rows


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "null"
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.{digits}g}"
    return str(value)


def markdown(rows: list[dict[str, Any]]) -> str:
    """The benchmark table as Markdown."""
    header = (
        "| strategy | mode | scale b | eps per report | eps cumulative | silhouette first / last / mean "
        "| Pearson r (Spearman) silhouette vs clear | Pearson r (Spearman) CH vs clear "
        "| r(silhouette, train loss) | max train-loss diff vs clear | follows the clear trend |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
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
            f"| {row['strategy']} | {row['mode']} | {_fmt(row['scale'])} "
            f"| {_fmt(row['epsilon_per_report'], 6)} | {_fmt(row['epsilon_cumulative'], 6)} "
            f"| {_fmt(row['silhouette_first'])} / {_fmt(row['silhouette_last'])} "
            f"/ {_fmt(row['silhouette_mean'])} "
            f"| {_fmt(pearson)} ({_fmt(row.get('spearman_silhouette', math.nan))}) "
            f"| {_fmt(row.get('pearson_calinski_harabasz', math.nan))} "
            f"({_fmt(row.get('spearman_calinski_harabasz', math.nan))}) "
            f"| {_fmt(row['r_silhouette_train_loss'])} | {_fmt(row.get('max_train_loss_diff', math.nan), 2)} "
            f"| {follows} |"
        )
    return header + "\n".join(lines) + "\n"


def plot(runs: list[dict[str, Any]], key: str, ylabel: str, path: Path, *, log: bool = False) -> None:
    """One panel per strategy: ``key`` per round for every mode, training loss on the right axis."""
    strategies = sorted({r["strategy"] for r in runs})
    figure, axes = plt.subplots(1, len(strategies), figsize=(6.5 * len(strategies), 4.6), squeeze=False)
    for axis, strategy in zip(axes[0], strategies, strict=True):
        group = sorted((r for r in runs if r["strategy"] == strategy), key=_epsilon_order, reverse=True)
        colors = plt.cm.viridis(np.linspace(0.0, 0.85, max(len(group) - 1, 1)))
        protected = iter(colors)
        loss_run = None
        for results in group:
            rounds, values = series(results, key)
            clear = results["privacy"]["evaluation"]["privacy_eval_type"] == CLEAR
            if clear:
                loss_run = results
            axis.plot(
                rounds,
                values,
                "o-" if clear else "s--",
                color="black" if clear else next(protected),
                ms=3,
                lw=2 if clear else 1.2,
                label=mode_label(results),
            )
        if log:
            axis.set_yscale("log")
        axis.set_xlabel("round")
        axis.set_ylabel(ylabel)
        axis.set_title(f"{strategy}: {ylabel} per round")
        if loss_run is not None:
            right = axis.twinx()
            rounds, values = series(loss_run, "train_loss")
            right.plot(rounds, values, ":", color="tab:red", lw=1.5, label="training loss")
            right.set_ylabel("training loss (clients' mean)", color="tab:red")
            right.legend(loc="upper center", fontsize=7)
        axis.legend(fontsize=7, loc="best")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> int:
    """Read the runs, write the figures and the table; print the table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("runs", type=Path, help="folder whose subfolders hold results.json files")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where the figures and the table go")
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
    text = markdown(table(runs))
    (args.out / "laplace_eval_table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
