"""Regenerate the KD-DP benchmark figures and tables from the runs' ``results.json`` files.

Tan, Xu, Wang, Luo, "Differential Privacy Federated Learning Method Based on
Knowledge Distillation", Computer Science 51(6A), 2024: the claim that KD-DP
(teacher on the large-data clients, pseudo-labelled public split as a special
client) is more accurate than traditional DP federated learning at the same
total budget. The runs (commands in ``docs/benchmarks/kd_dp.md``) live in one
folder per data set, method and epsilon under ``--root``::

    <dataset>/<method>_eps<epsilon>/results.json

with ``<method>`` one of :data:`METHODS`. Usage::

    python benchmarks/kd_dp.py --root /tmp/bench_kd_dp/runs --out docs/benchmarks/figures \
        --doc docs/benchmarks/kd_dp.md

Writes ``kd_dp_accuracy_<dataset>.png`` (final accuracy against epsilon),
``kd_dp_rounds_<dataset>.png`` (accuracy per round, KD-DP's two stages) and
``kd_dp_tables.md`` into ``--out`` (and, with ``--doc``, the same tables between the
``GENERATED`` markers of that page); missing runs are left out.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.tables, with or without -P

from benchmarks.tables import Run, completed_runs, fmt, markdown_table, replace_generated_block, series

#: Folder prefix -> label, in table order.
METHODS: dict[str, str] = {
    "kd_dp": "KD-DP (epsilon_special = epsilon/2)",
    "kd_dp_pp": "KD-DP (epsilon_special = null)",
    "fed_dp_sgd": "federated DP-SGD (kd_dp, teacher_rounds=0)",
    "dp_fedavg": "DP-FedAvg",
    "nbafl": "NbAFL",
}
UNITS: dict[str, str] = {
    "kd_dp": "record",
    "kd_dp_pp": "record",
    "fed_dp_sgd": "record",
    "dp_fedavg": "client",
    "nbafl": "record (modelling assumption)",
}
FOLDER = re.compile(r"^(?P<method>[a-z_]+)_eps(?P<epsilon>[0-9.]+)$")
BEGIN, END = "<!-- BEGIN GENERATED: figures/kd_dp_tables.md -->", "<!-- END GENERATED -->"


def load_runs(root: Path) -> dict[str, dict[str, dict[float, Run]]]:
    """``{dataset: {method: {epsilon: results}}}`` for every completed run ``root/<dataset>/<folder>``.

    ``<folder>`` is ``<method>_eps<epsilon>`` with ``<method>`` one of :data:`METHODS`; other folders are
    not runs of this benchmark.
    """
    runs: dict[str, dict[str, dict[float, Run]]] = {}
    for result in completed_runs(root):
        path = Path(result["_path"])
        match = FOLDER.match(path.name)
        if path.parent.parent != root or match is None or match["method"] not in METHODS:
            continue
        by_epsilon = runs.setdefault(path.parent.name, {}).setdefault(match["method"], {})
        by_epsilon[float(match["epsilon"])] = result
    return runs


def _best(run: Run) -> float:
    return max(r["accuracy"] for r in run["rounds"] if r.get("accuracy") is not None)


def method_epsilon_table(
    title: str,
    methods: dict[str, dict[float, Run]],
    cell: Callable[[str, Run], str],
    *,
    names: Sequence[str] = tuple(METHODS),
    with_unit: bool = False,
) -> list[str]:
    """Markdown: one row per method of ``names`` that ran, one column per epsilon any of them ran at.

    ``cell(method, run)`` formats one run; a missing run is ``-``.
    """
    ran = [m for m in names if m in methods]
    epsilons = sorted({e for m in ran for e in methods[m]})
    header = ["method", *(["unit"] if with_unit else []), *(f"epsilon = {e:g}" for e in epsilons)]
    rows = [
        [
            METHODS[method],
            *([UNITS[method]] if with_unit else []),
            *("-" if methods[method].get(e) is None else cell(method, methods[method][e]) for e in epsilons),
        ]
        for method in ran
    ]
    return [title, "", *markdown_table(header, rows)]


def accuracy_table(dataset: str, methods: dict[str, dict[float, Run]]) -> list[str]:
    """Markdown: final accuracy (and the reported epsilon) per method and epsilon."""
    return method_epsilon_table(
        f"**{dataset}**: final test accuracy (reported epsilon at delta = 1e-5)",
        methods,
        lambda _, run: f"{run['final']['accuracy']:.4f} ({fmt(run['final']['epsilon'], 3)})",
        with_unit=True,
    )


#: The "traditional" DP-FL baselines KD-DP's document names, and the same-unit ablation.
TRADITIONAL = ("dp_fedavg", "nbafl")
ABLATION = "fed_dp_sgd"


def _versus(run: Run, others: list[Run]) -> list[str]:
    """Cells: the best other final accuracy, KD-DP's margin over it, whether KD-DP is ahead."""
    if not others:
        return ["-", "-", "not run"]
    best = max(other["final"]["accuracy"] for other in others)
    margin = run["final"]["accuracy"] - best
    return [f"{best:.4f}", f"{margin:+.4f}", "yes" if margin > 0 else "no"]


def claim_table(dataset: str, methods: dict[str, dict[float, Run]]) -> list[str]:
    """Markdown: KD-DP's final accuracy against the traditional baselines at each total epsilon."""
    header = [
        "epsilon",
        "KD-DP final acc.",
        "best of DP-FedAvg, NbAFL (final)",
        "margin",
        "KD-DP ahead",
        "their best acc. in any round",
        "federated DP-SGD, same unit (final)",
        "margin",
        "KD-DP ahead",
    ]
    rows = []
    for epsilon, run in sorted(methods.get("kd_dp", {}).items()):
        named = [methods[m][epsilon] for m in TRADITIONAL if epsilon in methods.get(m, {})]
        ablation = [methods[ABLATION][epsilon]] if epsilon in methods.get(ABLATION, {}) else []
        best_any = f"{max(_best(b) for b in named):.4f}" if named else "-"
        rows.append(
            [
                f"{epsilon:g}",
                f"{run['final']['accuracy']:.4f}",
                *_versus(run, named),
                best_any,
                *_versus(run, ablation),
            ]
        )
    title = f"**{dataset}**: the claim (KD-DP more accurate than traditional DP-FL at equal total epsilon)"
    return [title, "", *markdown_table(header, rows)]


def _global_noise_cell(method: str, run: Run) -> str:
    privacy = run["privacy"]
    if method == "dp_fedavg":
        std = privacy["noise_multiplier"] * privacy["clip"] / privacy["denominator"]
    else:
        std = (privacy["sigma_up"] ** 2 / privacy["K"] + privacy.get("sigma_down", 0.0) ** 2) ** 0.5
    return f"z = {fmt(privacy['noise_multiplier'], 3)}, std {fmt(std, 3)}"


def baseline_noise_table(dataset: str, methods: dict[str, dict[float, Run]]) -> list[str]:
    """Markdown: the baselines' noise multipliers and the noise std per coordinate of the new global model.

    DP-FedAvg: ``z C / denominator`` (central Gaussian on the sum of clipped updates, divided by the
    expected number of clients). NbAFL: ``sigma_U / sqrt(K)`` (uniform average of K noisy uploads;
    ``sigma_D`` added when non-zero).
    """
    return method_epsilon_table(
        f"**{dataset}**: baselines' noise: multiplier z (std / sensitivity) and std per coordinate of "
        "the new global model",
        methods,
        _global_noise_cell,
        names=TRADITIONAL,
    )


def cpu_table(dataset: str, methods: dict[str, dict[float, Run]]) -> list[str]:
    """Markdown: CPU seconds of every process of each run (from ``<run>.cpu.json``) and its wall time."""
    return method_epsilon_table(
        f"**{dataset}**: CPU seconds (all processes of the run) / wall minutes",
        methods,
        lambda _, run: f"{fmt(run.get('_cpu_s'), 3)} / {run['final']['wall_s'] / 60:.1f}",
    )


def kd_dp_detail_table(dataset: str, methods: dict[str, dict[float, Run]]) -> list[str]:
    """Markdown: KD-DP's stages and each group's epsilon."""
    header = [
        "run",
        "epsilon",
        "teacher acc. (end of stage)",
        "final acc.",
        "best acc.",
        "label agreement",
        "eps large (teacher only)",
        "eps general",
        "eps special",
        "overall",
        "CPU s",
    ]
    rows = []
    for method in ("kd_dp", "kd_dp_pp", "fed_dp_sgd"):
        for epsilon, run in sorted(methods.get(method, {}).items()):
            privacy = run["privacy"]
            teacher_rounds = privacy["stages"]["teacher_rounds"]
            teacher_accuracy = run["rounds"][teacher_rounds - 1]["accuracy"] if teacher_rounds > 0 else None
            groups = privacy["epsilon_by_group"]
            special = privacy["special_client"]
            rows.append(
                [
                    method,
                    f"{epsilon:g}",
                    fmt(teacher_accuracy, 4),
                    f"{run['final']['accuracy']:.4f}",
                    f"{_best(run):.4f}",
                    fmt(special["label_agreement_with_teacher"], 3),
                    f"{fmt(groups['large'], 3)} ({fmt(groups['large_teacher_only'], 3)})",
                    fmt(groups["general"], 3),
                    fmt(groups["special"], 3),
                    fmt(privacy["epsilon_overall"], 3),
                    fmt(run.get("_cpu_s"), 3),
                ]
            )
    return [f"**{dataset}**: KD-DP runs in detail", "", *markdown_table(header, rows)]


def plot_accuracy(dataset: str, methods: dict[str, dict[float, Run]], out: Path) -> Path:
    """Final accuracy against the total epsilon, one line per method."""
    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    for method, label in METHODS.items():
        by_eps = methods.get(method)
        if not by_eps:
            continue
        epsilons = sorted(by_eps)
        axis.plot(epsilons, [by_eps[e]["final"]["accuracy"] for e in epsilons], marker="o", label=f"{label}")
    axis.set_xscale("log", base=2)
    axis.set_xlabel("total epsilon (delta = 1e-5)")
    axis.set_ylabel("final test accuracy")
    axis.set_title(f"KD-DP vs baselines, {dataset}")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    path = out / f"kd_dp_accuracy_{dataset}.png"
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def plot_rounds(dataset: str, methods: dict[str, dict[float, Run]], out: Path) -> Path:
    """Accuracy per round of the KD-DP runs and of federated DP-SGD (dashed)."""
    figure, axis = plt.subplots(figsize=(6.4, 4.2))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    epsilons = sorted({e for m in ("kd_dp", "fed_dp_sgd") for e in methods.get(m, {})})
    for i, epsilon in enumerate(epsilons):
        for method, style in (("kd_dp", "-"), ("kd_dp_pp", ":"), ("fed_dp_sgd", "--")):
            run = methods.get(method, {}).get(epsilon)
            if run is None:
                continue
            axis.plot(
                *series(run, "accuracy"),
                style,
                color=colours[i % len(colours)],
                label=f"{method}, eps={epsilon:g}",
            )
    teacher_rounds = next(
        (
            run["privacy"]["stages"]["teacher_rounds"]
            for run in methods.get("kd_dp", {}).values()
            if run["privacy"]["stages"]["teacher_rounds"] > 0
        ),
        None,
    )
    if teacher_rounds is not None:
        axis.axvline(teacher_rounds + 0.5, color="grey", lw=0.8)
        axis.text(teacher_rounds + 0.6, 0.05, "student stage", fontsize=7, color="grey")
    axis.set_xlabel("round")
    axis.set_ylabel("test accuracy")
    axis.set_title(f"KD-DP (solid: eps_special = eps/2; dotted: null) vs federated DP-SGD, {dataset}")
    axis.title.set_fontsize(8)
    axis.grid(alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=6, ncol=2)
    path = out / f"kd_dp_rounds_{dataset}.png"
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> int:
    """Read the runs below ``--root``, write figures and tables into ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/bench_kd_dp/runs"))
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/figures"))
    parser.add_argument(
        "--doc",
        type=Path,
        default=None,
        help="also copy the tables into this Markdown file, between its GENERATED markers",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = load_runs(args.root)
    for dataset in runs.values():
        for by_eps in dataset.values():
            for run in by_eps.values():
                cpu = Path(run["_path"]).with_suffix(".cpu.json")
                try:
                    run["_cpu_s"] = json.loads(cpu.read_text()).get("cpu_s")
                except (OSError, ValueError):  # not measured, or still being written
                    run["_cpu_s"] = None
    lines = ["# KD-DP benchmark tables (generated by benchmarks/kd_dp.py)", ""]
    for dataset, methods in sorted(runs.items(), key=lambda item: (item[0] != "mnist", item[0])):
        lines += [
            *accuracy_table(dataset, methods),
            "",
            *claim_table(dataset, methods),
            "",
            *kd_dp_detail_table(dataset, methods),
            "",
            *baseline_noise_table(dataset, methods),
            "",
            *cpu_table(dataset, methods),
            "",
        ]
        for path in (plot_accuracy(dataset, methods, args.out), plot_rounds(dataset, methods, args.out)):
            print(f"wrote {path}")
    table = args.out / "kd_dp_tables.md"
    table.write_text("\n".join(lines) + "\n")
    print(f"wrote {table}")
    if args.doc is not None:
        if not replace_generated_block(args.doc, lines[2:], begin=BEGIN, end=END):
            print(f"{args.doc}: no file or no {BEGIN} ... {END} block; not updated", file=sys.stderr)
            return 1
        print(f"updated {args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
