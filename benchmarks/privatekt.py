"""Regenerate the PrivateKT benchmark figures and tables from the runs' ``results.json`` files.

Qi, Wu et al., "Differentially private knowledge transfer for federated
learning", Nature Communications 2023 (Algorithm 1, Eq. 2-6, Lemma 1): the
authors' demo in the per-round reading of epsilon, and the equal-budget
comparison with FedAvg+LDP and non-private FedAvg. The runs (commands in
``docs/benchmarks/privatekt.md``) live below ``--root``::

    mnist_per_round/            strategy=privatekt, +experiment=privatekt_demo (30 rounds), MNIST
    mnist_per_round_100/        the same, 100 rounds
    fmnist_per_round/           the same on Fashion-MNIST
    compare/privatekt/<i>/      total epsilon 1, 2, 4, 8 (Hydra multirun)
    compare/fedavg_ldp/<i>/     total epsilon 1, 2, 4, 8 (Hydra multirun)
    compare/fedavg/             non-private FedAvg
    probe_mlp_<targets>_<dropout>/  MNIST per-round probes of the self-training targets

Usage::

    python -P benchmarks/privatekt.py --root /tmp/bench_privatekt --out docs/benchmarks/figures

(``-P`` keeps ``benchmarks/`` off ``sys.path``.)

Writes ``privatekt_curves.png``, ``privatekt_equal_budget.png`` and
``privatekt_tables.md`` into ``--out``; missing runs are skipped.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.tables, with or without -P

from benchmarks.tables import Run, completed_runs, fmt, markdown_table
from fl_app.data.federated import DataSpec, federated_data

PER_ROUND = {
    "MNIST": "mnist_per_round",
    "Fashion-MNIST": "fmnist_per_round",
    "MNIST (100 rounds)": "mnist_per_round_100",
}
METHODS = {"privatekt": "PrivateKT", "fedavg_ldp": "FedAvg+LDP", "fedavg": "FedAvg (non-private)"}
PROBES = ("probe_mlp_soft_0.0", "probe_mlp_hard_0.0", "probe_mlp_soft_0.2")
#: A number for a table cell, ``cell(value, digits)``: ``digits`` decimals below 100 (a column of
#: accuracies lines up: 0.4530), significant digits from 100 on; '-' when missing.
cell = partial(fmt, fixed_below=100)


def load_runs(folder: Path) -> list[Run]:
    """All completed runs (``results.json``) at or below ``folder``, sorted by epsilon."""
    return sorted(completed_runs(folder), key=lambda run: float(run["config"]["privacy"]["epsilon"]))


def evaluated(run: Run) -> list[dict[str, Any]]:
    """The rounds with an accuracy."""
    return [r for r in run["rounds"] if r.get("accuracy") is not None]


def knowledge_accuracy(run: Run, rounds: slice = slice(None)) -> float | None:
    """Share of aggregated KT labels (``rounds[].kt_labels``) equal to the true public labels.

    Evaluation only: the algorithm never reads the public labels; this loads
    them here, from the run's own data spec, to measure how good the
    transferred knowledge was.
    """
    data = federated_data(DataSpec.from_config(run["config"]))
    truth = data.arrays.y_train[data.public_rows]
    hits = [
        truth[np.asarray(r["kt_indices"])] == np.asarray(r["kt_labels"])
        for r in run["rounds"][rounds]
        if r.get("kt_labels")
    ]
    return float(np.mean(np.concatenate(hits))) if hits else None


def rolling_knowledge_accuracy(run: Run, window: int = 10) -> list[tuple[int, float]]:
    """``(round, knowledge accuracy over the last window rounds)`` for the curves (evaluation only)."""
    points = []
    for end in range(window, len(run["rounds"]) + 1):
        value = knowledge_accuracy(run, slice(end - window, end))
        if value is not None:
            points.append((run["rounds"][end - 1]["round"], value))
    return points


def ideal_knowledge_accuracy(run: Run, draws: int = 20_000) -> float | None:
    """Knowledge accuracy if every client predicted every KT sample correctly (Monte Carlo, seed 0).

    The majority vote (``knowledge=argmax``) of ``clients_per_round`` labels,
    each kept with probability beta and otherwise uniform over the C classes
    (Eq. 2), ties broken at random: the best knowledge the randomized
    response lets through at the run's beta, whatever the local models.
    """
    privacy = run["privacy"]
    if "beta" not in privacy:
        return None
    beta, classes = float(privacy["beta"]), int(privacy["num_classes"])
    voters = int(run["rounds"][0].get("clients") or run["config"]["clients_per_round"])
    rng = np.random.default_rng(0)
    truth = rng.random((draws, voters)) < beta
    labels = np.where(truth, 0, rng.integers(0, classes, size=(draws, voters)))
    counts = np.stack([(labels == c).sum(axis=1) for c in range(classes)], axis=1)
    top = counts == counts.max(axis=1, keepdims=True)
    return float(np.mean(top[:, 0] / top.sum(axis=1)))


def failures(run: Run) -> int:
    """Failed client-rounds of the run (accounted, but their reports are missing)."""
    return sum(int(r.get("failures", 0)) for r in run["rounds"])


def best_accuracy(run: Run) -> float:
    """Highest evaluated accuracy of the run."""
    return max(r["accuracy"] for r in evaluated(run))


def best_cell(run: Run | None) -> str:
    """``best accuracy (round)`` of a run for a table cell."""
    if not run or not evaluated(run):
        return "-"
    best = max(evaluated(run), key=lambda r: r["accuracy"])
    return f"{best['accuracy']:.4f} ({best['round']})"


def per_round_section(root: Path) -> tuple[list[str], dict[str, Run]]:
    """Table of the per-round (paper-reading) runs."""
    runs = {name: found[0] for name, folder in PER_ROUND.items() if (found := load_runs(root / folder))}
    header = [
        "data set",
        "model",
        "rounds",
        "clients/round",
        "local epochs",
        "eps per round",
        "final acc.",
        "best acc. (round)",
        "knowledge acc. first / last 20 rounds",
        "ideal knowledge acc.",
        "cumulative eps (accountant)",
        "basic composition",
        "failed client-rounds",
        "wall time",
    ]
    rows = []
    for name, run in runs.items():
        cfg, final, privacy = run["config"], run["final"], run["privacy"]
        local = cfg["strategy"]["local_epochs"] or cfg["local_epochs"]
        best = max(evaluated(run), key=lambda r: r["accuracy"])
        first, last = knowledge_accuracy(run, slice(None, 20)), knowledge_accuracy(run, slice(-20, None))
        rows.append(
            [
                name,
                cfg["model"],
                final["rounds"],
                cfg["clients_per_round"],
                local,
                cell(privacy["epsilon_per_round"], 4),
                f"{final['accuracy']:.4f}",
                f"{best['accuracy']:.4f} ({best['round']})",
                f"{cell(first, 2)} / {cell(last, 2)}",
                cell(ideal_knowledge_accuracy(run), 2),
                cell(privacy["epsilon_cumulative"], 4),
                cell(privacy["epsilon_basic_composition"], 4),
                failures(run),
                f"{final['wall_s'] / 60:.0f} min",
            ]
        )
    return markdown_table(header, rows), runs


def comparison_section(root: Path) -> tuple[list[str], dict[str, list[Run]]]:
    """Equal-budget table: final accuracy per total epsilon and the share of the gap PrivateKT closes."""
    runs = {method: load_runs(root / "compare" / method) for method in METHODS}
    fedavg = runs["fedavg"][0]["final"]["accuracy"] if runs["fedavg"] else None
    by_eps = {
        method: {float(r["config"]["privacy"]["epsilon"]): r for r in runs[method]}
        for method in ("privatekt", "fedavg_ldp")
    }
    header = [
        "total eps",
        "PrivateKT acc.",
        "PrivateKT best acc. (round)",
        "PrivateKT eps spent",
        "eps per label",
        "beta",
        "knowledge acc.",
        "ideal knowledge acc.",
        "FedAvg+LDP acc.",
        "FedAvg+LDP final loss",
        "FedAvg+LDP eps spent",
        "noise multiplier",
        "FedAvg acc.",
        "gap closed",
        "failed client-rounds (PrivateKT / FedAvg+LDP / FedAvg)",
    ]
    rows = []
    for epsilon in sorted(set(by_eps["privatekt"]) | set(by_eps["fedavg_ldp"])):
        kt, ldp = by_eps["privatekt"].get(epsilon), by_eps["fedavg_ldp"].get(epsilon)
        closed = None
        if kt and ldp and fedavg is not None and fedavg > ldp["final"]["accuracy"]:
            gap = fedavg - ldp["final"]["accuracy"]
            closed = (kt["final"]["accuracy"] - ldp["final"]["accuracy"]) / gap
        rows.append(
            [
                f"{epsilon:g}",
                cell(kt and kt["final"]["accuracy"], 4),
                best_cell(kt),
                cell(kt and kt["final"]["epsilon"], 4),
                cell(kt and kt["privacy"]["epsilon_per_label"], 4),
                cell(kt and kt["privacy"]["beta"], 4),
                cell(kt and knowledge_accuracy(kt), 2),
                cell(kt and ideal_knowledge_accuracy(kt), 2),
                cell(ldp and ldp["final"]["accuracy"], 4),
                "-"
                if not ldp
                else "nan (diverged)"
                if ldp["final"]["loss"] is None
                else f"{ldp['final']['loss']:.3f}",
                cell(ldp and ldp["final"]["epsilon"], 4),
                cell(ldp and ldp["privacy"]["noise_multiplier"], 4),
                cell(fedavg, 4),
                "-" if closed is None else f"{100 * closed:.0f}%",
                " / ".join(
                    str(failures(r)) if r else "-"
                    for r in (kt, ldp, runs["fedavg"][0] if runs["fedavg"] else None)
                ),
            ]
        )
    return markdown_table(header, rows), runs


def probe_section(root: Path) -> list[str]:
    """Table of the self-training probes (MNIST, per-round epsilon 5)."""
    header = [
        "run",
        "self-training targets",
        "input dropout",
        "rounds",
        "clients/round",
        "local epochs",
        "test images",
        "final acc.",
        "best acc. (round)",
        "knowledge acc. first / last 10 rounds",
        "wall time",
    ]
    rows = []
    for folder in PROBES:
        found = load_runs(root / folder)
        if not found:
            continue
        run = found[0]
        cfg, strategy = run["config"], run["config"]["strategy"]
        rows.append(
            [
                folder,
                strategy["self_train_targets"],
                strategy.get("self_train_dropout", 0.0),
                run["final"]["rounds"],
                cfg["clients_per_round"],
                strategy["local_epochs"] or cfg["local_epochs"],
                cfg["evaluation"]["test_subset"] or "all",
                f"{run['final']['accuracy']:.4f}",
                best_cell(run),
                " / ".join(
                    cell(knowledge_accuracy(run, part), 2) for part in (slice(None, 10), slice(-10, None))
                ),
                f"{run['final']['wall_s'] / 60:.0f} min",
            ]
        )
    return markdown_table(header, rows)


def plot_curves(runs: dict[str, Run], out: Path) -> None:
    """Accuracy per round of the per-round runs, with the cumulative epsilon."""
    if not runs:
        return
    figure, axes = plt.subplots(1, len(runs), figsize=(5.5 * len(runs), 4), squeeze=False)
    for axis, (name, run) in zip(axes[0], runs.items(), strict=True):
        rounds = evaluated(run)
        axis.plot([r["round"] for r in rounds], [r["accuracy"] for r in rounds], "o-", ms=3, color="tab:blue")
        quality = rolling_knowledge_accuracy(run)
        if quality:
            axis.plot(
                *zip(*quality, strict=True), color="tab:green", lw=1, label="knowledge acc. (10-round mean)"
            )
            axis.legend(loc="lower right", fontsize=8)
        axis.set_xlabel("round")
        axis.set_ylabel("test accuracy", color="tab:blue")
        axis.set_ylim(0, 1)
        twin = axis.twinx()
        twin.plot(
            [r["round"] for r in run["rounds"]], [r["epsilon"] for r in run["rounds"]], "--", color="tab:red"
        )
        twin.set_ylabel("cumulative epsilon, worst client", color="tab:red")
        per_round = run["privacy"]["epsilon_per_round"]
        axis.set_title(f"PrivateKT on {name}, eps {per_round:.3g} per round")
    figure.tight_layout()
    figure.savefig(out / "privatekt_curves.png", dpi=110)
    plt.close(figure)


def plot_comparison(runs: dict[str, list[Run]], out: Path) -> None:
    """Final accuracy against the total per-client epsilon."""
    if not any(runs.values()):
        return
    figure, axis = plt.subplots(figsize=(6, 4))
    for method, label in METHODS.items():
        if method == "fedavg":
            if runs[method]:
                axis.axhline(runs[method][0]["final"]["accuracy"], color="k", ls=":", label=label)
            continue
        points = [(float(r["config"]["privacy"]["epsilon"]), r["final"]["accuracy"]) for r in runs[method]]
        if points:
            axis.plot(*zip(*points, strict=True), "o-", label=label)
    axis.set_xscale("log", base=2)
    axis.set_xlabel("total epsilon per client (delta 1e-5)")
    axis.set_ylabel("final test accuracy")
    axis.set_ylim(0, 1)
    axis.legend()
    axis.set_title("Equal total budget, MNIST")
    figure.tight_layout()
    figure.savefig(out / "privatekt_equal_budget.png", dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    """Read the runs below ``--root``, write figures and tables into ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/bench_privatekt"))
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/figures"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    per_round_lines, per_round_runs = per_round_section(args.root)
    comparison_lines, comparison_runs = comparison_section(args.root)
    plot_curves(per_round_runs, args.out)
    plot_comparison(comparison_runs, args.out)
    text = [
        "<!-- generated by benchmarks/privatekt.py; do not edit -->",
        "",
        "### Per-round budget (the paper's reading)",
        "",
        *per_round_lines,
        "",
        "### Equal total budget per client",
        "",
        *comparison_lines,
        "",
        "### Self-training probes (MNIST, epsilon 5 per round)",
        "",
        *probe_section(args.root),
        "",
    ]
    (args.out / "privatekt_tables.md").write_text("\n".join(text))
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
