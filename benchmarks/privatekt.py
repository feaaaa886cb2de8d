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

and, below ``--demo-root``, the authors' demo as they run it (``+experiment=privatekt_demo``: their
CNN, partition and self-training; one folder per seed)::

    demo_seed<k>/               finished (results.json) or still running / stopped (metrics.csv);
                                config.yaml and metrics.csv are enough (the recorded runs:
                                docs/benchmarks/privatekt_demo/runs/)

Usage::

    python -P benchmarks/privatekt.py --root /tmp/bench_privatekt --out docs/benchmarks/figures
    python -P benchmarks/privatekt.py --demo-root docs/benchmarks/privatekt_demo/runs \
        --out docs/benchmarks/figures

With ``--demo-root`` only the demo reproduction is written: ``privatekt_demo_vs_authors.png`` and its
table, spliced into ``docs/benchmarks/privatekt.md`` between the ``DEMO_BEGIN``/``DEMO_END`` markers.

(``-P`` keeps ``benchmarks/`` off ``sys.path``.)

Writes ``privatekt_curves.png``, ``privatekt_equal_budget.png`` and
``privatekt_tables.md`` into ``--out``; missing runs are skipped.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.tables, with or without -P

import yaml

from benchmarks.tables import Run, completed_runs, fmt, markdown_table, replace_generated_block
from fl_app.data.federated import DataSpec, federated_data
from fl_app.run.results import METRICS_FILE

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

DEMO_PAGE = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "privatekt.md"
#: The authors' log of their demo (taoqi98/PrivateKT, ``Code/main.ipynb``: MNIST, 80 clients, 40 per
#: round, epsilon 5 per round, K = 2, B = 25), every round, as their notebook printed it.
AUTHORS_LOG_FILE = DEMO_PAGE.parent / "privatekt_demo" / "authors_log.json"


def authors_log(path: Path = AUTHORS_LOG_FILE) -> dict[int, float]:
    """The authors' test accuracy after each logged round (round -> accuracy)."""
    recorded = json.loads(path.read_text())["accuracy_after_round"]
    return {int(server_round): float(value) for server_round, value in recorded.items()}


AUTHORS_LOG = authors_log()
DEMO_BEGIN, DEMO_END = "<!-- DEMO_BEGIN (benchmarks/privatekt.py --demo-root) -->", "<!-- DEMO_END -->"


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


@dataclass
class DemoCurve:
    """One seed of the demo: its evaluated rounds, whether it finished, the privacy it spent."""

    seed: int
    planned_rounds: int
    accuracy: dict[int, float] = field(default_factory=dict)
    #: Worst client's cumulative epsilon (accountant) and by basic composition, after each round.
    epsilon: dict[int, float] = field(default_factory=dict)
    epsilon_basic: dict[int, float] = field(default_factory=dict)
    round_s: list[float] = field(default_factory=list)
    finished: bool = False

    @property
    def last_round(self) -> int:
        """The last round that ran."""
        return max(self.epsilon, default=0)


def read_demo_run(folder: Path) -> DemoCurve | None:
    """A demo run's curve: from ``results.json`` if it finished, else from ``metrics.csv`` so far.

    ``metrics.csv`` is written after every round, so a run still going (or stopped, to be continued with
    ``resume=``) is shown up to its last round and marked as such.
    """
    config_file = folder / "config.yaml"
    if not config_file.is_file():
        return None
    config = yaml.safe_load(config_file.read_text())
    curve = DemoCurve(seed=int(config["seed"]), planned_rounds=int(config["num_rounds"]))
    finished = completed_runs(folder)
    if finished:
        rows = finished[0]["rounds"]
        curve.finished = True
    elif (folder / METRICS_FILE).is_file():
        with (folder / METRICS_FILE).open(newline="") as handle:
            rows = [
                {key: value for key, value in row.items() if value != ""} for row in csv.DictReader(handle)
            ]
    else:
        return None
    for row in rows:
        server_round = int(row["round"])
        if row.get("accuracy") is not None:
            curve.accuracy[server_round] = float(row["accuracy"])
        curve.epsilon[server_round] = float(row["epsilon"])
        curve.epsilon_basic[server_round] = float(row["epsilon_basic"])
        curve.round_s.append(float(row["round_s"]))
    return curve


def demo_curves(root: Path) -> list[DemoCurve]:
    """The demo runs ``demo_seed*`` below ``root``, by seed."""
    curves = [curve for folder in sorted(root.glob("demo_seed*")) if (curve := read_demo_run(folder))]
    return sorted(curves, key=lambda curve: curve.seed)


#: The demo table's rows: every this many rounds (the runs evaluate every round; the figure shows all).
TABLE_EVERY = 10


def demo_section(curves: list[DemoCurve]) -> list[str]:
    """The demo runs beside the authors' log every :data:`TABLE_EVERY` rounds, with the epsilon spent."""
    if not curves:
        return []
    checkpoints = [
        r for r in AUTHORS_LOG if r % TABLE_EVERY == 0 and any(r in curve.accuracy for curve in curves)
    ]
    header = [
        "round",
        "authors' log",
        *(f"seed {curve.seed}" for curve in curves),
        "mean (seeds)",
        "mean - authors",
        "cumulative eps, worst client (accountant / basic composition)",
    ]
    rows = []
    for server_round in checkpoints:
        values = [curve.accuracy.get(server_round) for curve in curves]
        reached = [value for value in values if value is not None]
        mean = statistics.fmean(reached)
        spent = [curve for curve in curves if server_round in curve.epsilon]  # non-empty: it was evaluated
        rows.append(
            [
                server_round,
                f"{AUTHORS_LOG[server_round]:.3f}",
                *(cell(value, 3) for value in values),
                f"{mean:.3f} ({len(reached)})",
                f"{mean - AUTHORS_LOG[server_round]:+.3f}",
                f"{fmt(max(c.epsilon[server_round] for c in spent))} / "
                f"{fmt(max(c.epsilon_basic[server_round] for c in spent))}",
            ]
        )
    lines = markdown_table(header, rows)
    lines.append("")
    for curve in curves:
        state = "finished" if curve.finished else "not finished (a stopped run continues with resume=)"
        lines.append(
            f"- seed {curve.seed}: {curve.last_round} of {curve.planned_rounds} rounds, {state}; "
            f"median round {statistics.median(curve.round_s):.0f} s"
        )
    return lines


def plot_demo(curves: list[DemoCurve], out: Path) -> None:
    """Our seeds' test accuracy beside the authors' log, with the cumulative epsilon."""
    if not curves:
        return
    figure, axis = plt.subplots(figsize=(7, 4.2))
    rounds = sorted(AUTHORS_LOG)
    authors = [AUTHORS_LOG[r] for r in rounds]
    axis.plot(rounds, authors, "k-", lw=0.8, label="authors' log (Keras), every round")
    for curve in curves:
        points = sorted(curve.accuracy.items())
        if not points:  # a run that has not evaluated yet (an empty plot() would drop the axis' ticks)
            continue
        reached = "" if curve.finished else f", to round {curve.last_round}"
        style = "o-" if len(points) <= 20 else "-"  # a run evaluated every round: a line
        axis.plot(*zip(*points, strict=True), style, ms=4, lw=1.2, label=f"dpfl, seed {curve.seed}{reached}")
    last = max(curve.last_round for curve in curves)
    axis.set_xlim(0, max(last, 100) * 1.05)
    axis.set_ylim(0, 1)
    axis.set_xlabel("round")
    axis.set_ylabel("test accuracy (MNIST, 10,000 images)")
    twin = axis.twinx()
    worst = max(curves, key=lambda curve: curve.last_round)
    twin.plot(
        *zip(*sorted(worst.epsilon.items()), strict=True),
        ":",
        color="tab:red",
        lw=1,
        label=f"cumulative epsilon, worst client (seed {worst.seed}; right axis)",
    )
    twin.set_ylabel("cumulative epsilon, worst client", color="tab:red")
    handles = [*axis.get_legend_handles_labels()[0], *twin.get_legend_handles_labels()[0]]
    axis.legend(handles=handles, loc="lower right", fontsize=8)
    axis.set_title("PrivateKT demo (+experiment=privatekt_demo), epsilon 5 per round", fontsize=10)
    figure.tight_layout()
    figure.savefig(out / "privatekt_demo_vs_authors.png", dpi=110)
    plt.close(figure)


def write_demo(root: Path, out: Path, page: Path) -> int:
    """Figure and table of the demo runs below ``root``; the table spliced into ``page``."""
    curves = demo_curves(root)
    if not curves:
        print(f"--demo-root {root}: no demo_seed* run with config.yaml and metrics.csv", file=sys.stderr)
        return 1
    plot_demo(curves, out)
    lines = [
        "<!-- generated by benchmarks/privatekt.py --demo-root; do not edit -->",
        "",
        *demo_section(curves),
    ]
    print("\n".join(lines))
    if not replace_generated_block(page, [*lines, ""], begin=DEMO_BEGIN, end=DEMO_END):
        print(f"{page}: no file or no {DEMO_BEGIN} ... {DEMO_END} block; not updated", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Read the runs below ``--root``, write figures and tables into ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/bench_privatekt"))
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/figures"))
    parser.add_argument("--demo-root", type=Path, default=None, help="write only the demo reproduction")
    parser.add_argument("--page", type=Path, default=DEMO_PAGE, help="page of the demo's generated block")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.demo_root is not None:
        return write_demo(args.demo_root, args.out, args.page)
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
