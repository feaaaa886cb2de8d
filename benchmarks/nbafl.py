"""Regenerate the NbAFL benchmark figures and tables from the runs' ``results.json`` files.

Wei et al., "Federated Learning with Differential Privacy: Algorithms and
Performance Analysis", IEEE TIFS 15, 2020: the three findings of the
convergence bound (larger epsilon -> lower loss; more clients N -> better
convergence at fixed epsilon; a best number of rounds T at fixed epsilon) and
the best K under K-random scheduling (Remark 5). The runs are Hydra multiruns
(commands in ``docs/benchmarks/nbafl.md``), one sweep directory each under
``--root``::

    {mnist,fashion_mnist}_eps      strategy=nbafl, privacy.epsilon=5,...,100
    {mnist,fashion_mnist}_fedavg   the non-private baseline on the same partition
    mnist_n                        N sweep, m fixed (dataset.public_fraction)
    mnist_n_total                  N sweep, the whole data set split over N
    mnist_t, mnist_t_accountant    T sweep (num_rounds) at a fixed document / accountant epsilon
    mnist_k, mnist_k_accountant    K sweep (strategy.k) at a fixed document / accountant epsilon
    mnist_calibration              strategy.calibration=accountant at small epsilon

Usage::

    python -P benchmarks/nbafl.py --root /tmp/bench_nbafl --out docs/benchmarks/figures

(``-P`` keeps ``benchmarks/`` off ``sys.path``.)

Writes ``nbafl_*.png`` and ``nbafl_tables.md`` into ``--out``; missing sweeps
are skipped.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.tables, with or without -P

from benchmarks.tables import Run, completed_runs, fmt, markdown_table, series


def epsilon_of(run: Run) -> float:
    """The configured (document) epsilon."""
    return float(run["config"]["privacy"]["epsilon"])


def k_of(run: Run) -> int:
    """Clients per round actually scheduled."""
    return int(run["privacy"].get("K", run["rounds"][0]["clients"]))


def plot_curves(
    groups: Sequence[tuple[str, list[Run]]],
    *,
    label: Callable[[Run], str],
    order: Callable[[Run], float],
    baseline: list[Run],
    title: str,
    path: Path,
) -> None:
    """Test loss and accuracy per round, one line per run; the baseline dashed."""
    figure, axes = plt.subplots(len(groups), 2, figsize=(11, 3.8 * len(groups)), squeeze=False)
    for row, (name, runs) in enumerate(groups):
        for run in sorted(runs, key=order):
            for column, key in enumerate(("loss", "accuracy")):
                axes[row][column].plot(*series(run, key), marker=".", label=label(run))
        for run in baseline:
            for column, key in enumerate(("loss", "accuracy")):
                axes[row][column].plot(*series(run, key), "k--", label="FedAvg (non-private)")
        for column, key in enumerate(("test loss", "test accuracy")):
            axis = axes[row][column]
            axis.set_xlabel("round")
            axis.set_ylabel(key)
            axis.set_title(f"{name}: {key}")
            axis.grid(alpha=0.3)
        axes[row][0].legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def plot_final(
    curves: Sequence[tuple[str, list[Run]]],
    *,
    x: Callable[[Run], float],
    xlabel: str,
    title: str,
    path: Path,
) -> None:
    """Final test loss, accuracy and the accountant's epsilon against a swept parameter, one line per sweep.

    The lowest final loss of each line is circled.
    """
    figure, axes = plt.subplots(1, 3, figsize=(15, 3.9))
    for label, runs in curves:
        runs = sorted(runs, key=x)
        xs = [x(r) for r in runs]
        losses = [r["final"]["loss"] for r in runs]
        (line,) = axes[0].plot(xs, losses, "o-", label=label)
        best = min(range(len(runs)), key=lambda i: losses[i])
        axes[0].plot(xs[best], losses[best], "o", markersize=14, fillstyle="none", color=line.get_color())
        axes[1].plot(xs, [r["final"]["accuracy"] for r in runs], "o-", color=line.get_color(), label=label)
        axes[2].plot(xs, [r["final"]["epsilon"] for r in runs], "o-", color=line.get_color(), label=label)
    for axis, name in zip(
        axes, ("final test loss", "final test accuracy", "accountant epsilon (record level)"), strict=True
    ):
        axis.set_xlabel(xlabel)
        axis.set_ylabel(name)
        axis.grid(alpha=0.3)
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def table(runs: list[Run], *, title: str, baseline: list[Run] | None = None) -> str:
    """A markdown table of the runs' settings, epsilons and final metrics (None: ``inf``)."""
    header = [
        "strategy",
        "N",
        "K",
        "T",
        "L",
        "m",
        "epsilon (document)",
        "epsilon (accountant, record)",
        "epsilon (client level)",
        "sigma_U",
        "sigma_D",
        "final loss",
        "final accuracy",
        "wall s",
        "run",
    ]
    rows = []

    def cell(value: object) -> str:
        return fmt(value, missing="inf")

    for run in [*(baseline or []), *runs]:
        privacy, final, config = run["privacy"], run["final"], run["config"]
        private = run["strategy"] == "nbafl"
        rows.append(
            [
                run["strategy"],
                config["num_clients"],
                k_of(run) if private else run["rounds"][0]["clients"],
                config["num_rounds"],
                cell(privacy.get("L")) if private else "-",
                cell(privacy.get("m")) if private else "-",
                cell(epsilon_of(run)) if private else "-",
                cell(final["epsilon"]),
                cell(final.get("epsilon_client_level")) if private else "inf",
                cell(privacy.get("sigma_up")) if private else "-",
                cell(privacy.get("sigma_down")) if private else "-",
                cell(final["loss"]),
                cell(final["accuracy"]),
                f"{final['wall_s']:.0f}",
                Path(run["_path"]).name,
            ]
        )
    return "\n".join([f"### {title}", "", *markdown_table(header, rows)]) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Build every figure and table whose sweep exists under ``--root``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/bench_nbafl"))
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/figures"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tables: list[str] = ["# NbAFL benchmark tables (generated by benchmarks/nbafl.py)\n"]
    written: list[str] = []

    def eps_label(run: Run) -> str:
        return f"epsilon = {epsilon_of(run):g} (accountant {run['final']['epsilon']:.3g})"

    for dataset in ("mnist", "fashion_mnist"):
        runs, baseline = (
            completed_runs(args.root / f"{dataset}_eps"),
            completed_runs(args.root / f"{dataset}_fedavg"),
        )
        if not runs:
            continue
        path = args.out / f"nbafl_{dataset}_epsilon.png"
        plot_curves(
            [(dataset, runs)],
            label=eps_label,
            order=epsilon_of,
            baseline=baseline,
            title=f"NbAFL on {dataset}, N = K = 50, T = 25, delta = 0.01: finding 1 (larger epsilon)",
            path=path,
        )
        written.append(path.name)
        tables.append(
            table(sorted(runs, key=epsilon_of), title=f"{dataset}: epsilon sweep", baseline=baseline)
        )

    groups = [
        (label, runs)
        for label, runs in (
            ("m = 960 fixed (more clients, more data)", completed_runs(args.root / "mnist_n")),
            ("48000 examples split over N (m = 48000/N)", completed_runs(args.root / "mnist_n_total")),
        )
        if runs
    ]
    if groups:
        path = args.out / "nbafl_mnist_clients.png"
        plot_curves(
            groups,
            label=lambda r: f"N = {r['config']['num_clients']} (m = {r['privacy']['m']})",
            order=lambda r: r["config"]["num_clients"],
            baseline=[],
            title="NbAFL on MNIST, epsilon = 60, K = N, T = 25: finding 2 (more clients N)",
            path=path,
        )
        written.append(path.name)
        for label, runs in groups:
            ordered = sorted(runs, key=lambda r: r["config"]["num_clients"])
            tables.append(table(ordered, title=f"N sweep, {label}"))

    for name, xlabel, title, x in (
        (
            "rounds",
            "T (num_rounds)",
            "NbAFL on MNIST, N = K = 50: finding 3 (a best number of rounds T at fixed epsilon)",
            lambda r: float(r["config"]["num_rounds"]),
        ),
        (
            "k",
            "K (clients per round)",
            "NbAFL on MNIST, N = 50, T = 25, K-random scheduling: a best K at fixed epsilon",
            lambda r: float(k_of(r)),
        ),
    ):
        sweep = "mnist_t" if name == "rounds" else "mnist_k"
        curves: list[tuple[str, list[Run]]] = []
        for folder, kind in ((sweep, "classic"), (f"{sweep}_accountant", "accountant")):
            runs = completed_runs(args.root / folder)
            for epsilon in sorted({epsilon_of(r) for r in runs}):
                subset = sorted((r for r in runs if epsilon_of(r) == epsilon), key=x)
                label = (
                    f"document epsilon = {epsilon:g} (classic calibration)"
                    if kind == "classic"
                    else f"accountant epsilon = {epsilon:g} (calibration=accountant)"
                )
                curves.append((label, subset))
                tables.append(table(subset, title=f"{folder}: {label}"))
        if curves:
            path = args.out / f"nbafl_mnist_{name}.png"
            plot_final(curves, x=x, xlabel=xlabel, title=title, path=path)
            written.append(path.name)

    runs = completed_runs(args.root / "mnist_calibration")
    if runs:
        tables.append(table(sorted(runs, key=epsilon_of), title="MNIST: strategy.calibration=accountant"))

    (args.out / "nbafl_tables.md").write_text("\n".join(tables))
    print("wrote", ", ".join([*written, "nbafl_tables.md"]), "to", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
