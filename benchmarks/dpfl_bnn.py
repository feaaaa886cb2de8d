"""Regenerate the DPFL-BNN benchmark figures and tables from the runs' ``results.json`` files.

Liu, Zhang, Song, Letaief, "Binary Federated Learning with Client-Level
Differential Privacy", 2023, Section IV (Fig. 3, Fig. 4): test accuracy of
DPFL-BNN for gamma in {0.1, 0.2, 0.3, 0.4} and of the noise-free BNN on MNIST and
Fashion-MNIST, IID (Dirichlet alpha = 100) and non-IID (alpha = 1); the epsilon
of each gamma under the two accountings (Theorem 1's per-coordinate one and the
client-level one, d uses of RR_gamma per upload); the upload size against float32
FedAvg. The runs (commands in ``docs/benchmarks/dpfl_bnn.md``) are one output
directory each under ``--root``::

    {mnist,fashion_mnist}_a{100,1}_g{0.1,0.2,0.3,0.4}   strategy.gamma
    {mnist,fashion_mnist}_a{100,1}_noisefree            strategy.noise=none
    fedavg_float32_bnn_cnn, fedavg_float32_cnn          one FedAvg round (message sizes)

Usage::

    python benchmarks/dpfl_bnn.py --root /tmp/bench_dpfl_bnn/runs --out docs/benchmarks/figures

Writes ``dpfl_bnn_accuracy.png``, ``dpfl_bnn_final.png`` and ``dpfl_bnn_tables.md``
into ``--out``, and copies the tables into the marked block of ``docs/benchmarks/dpfl_bnn.md``
(``--page``; the page next to ``--out``), so no number there is typed by hand; missing runs are
skipped. Epsilons of the privacy table come from
:mod:`fl_app.privacy.calibration` (the accountant's composition).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.tables, with or without -P

from benchmarks.tables import Run, completed_runs, fmt, markdown_table, replace_generated_block, series
from clients.dpfl_bnn import packed_length
from fl_app.privacy.events import BinaryRandomizedResponse
from strategies.dpfl_bnn.privacy import binary_rr_epsilon, bnn_gamma, bnn_gamma_theorem1

DATASETS = {"mnist": "MNIST", "fashion_mnist": "Fashion-MNIST"}
PARTITIONS = {100: "IID (alpha = 100)", 1: "non-IID (alpha = 1)"}
GAMMAS = (0.1, 0.2, 0.3, 0.4)
DELTA = 1e-5
GOAL = 30.0  # the goal: the upload at least 30x smaller than float32 FedAvg
BEGIN, END = "<!-- BEGIN dpfl_bnn_tables.md -->", "<!-- END dpfl_bnn_tables.md -->"
MNIST_BITS = 144 + 2304 + 784 * 100 + 1000  # BinaryCNN on 28x28 images, 10 classes


def load_runs(root: Path) -> dict[str, Run]:
    """The completed runs ``root/<name>/results.json`` by ``<name>`` (runs deeper down are not read)."""
    return {Path(run["_path"]).name: run for run in completed_runs(root) if Path(run["_path"]).parent == root}


def variants() -> list[tuple[str, str]]:
    """(run-name suffix, label) of the noise-free BNN and each gamma."""
    return [("noisefree", "BNN (no noise)")] + [(f"g{g}", f"gamma = {g}") for g in GAMMAS]


def accuracy_figure(runs: dict[str, Run], out: Path) -> bool:
    """Test accuracy of Sign(W~) per round: one panel per data set and partition."""
    figure, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    found = False
    for row, dataset in enumerate(DATASETS):
        for col, alpha in enumerate(PARTITIONS):
            axis = axes[row][col]
            for suffix, label in variants():
                run = runs.get(f"{dataset}_a{alpha}_{suffix}")
                if run is None:
                    continue
                found = True
                axis.plot(
                    *series(run, "accuracy"),
                    marker="o",
                    ms=3,
                    label=label,
                    ls="--" if suffix == "noisefree" else "-",
                )
            axis.set_title(f"{DATASETS[dataset]}, {PARTITIONS[alpha]}")
            axis.set_xlabel("round")
            axis.set_ylabel("test accuracy of Sign(W~)")
            axis.set_ylim(0, 1)
            axis.grid(alpha=0.3)
            if axis.get_legend_handles_labels()[0]:
                axis.legend(fontsize=8)
    figure.suptitle("DPFL-BNN: 100 clients, all in every round (scaled-down runs)")
    figure.tight_layout()
    if found:
        figure.savefig(out / "dpfl_bnn_accuracy.png", dpi=110)
    plt.close(figure)
    return found


def final_figure(runs: dict[str, Run], out: Path) -> bool:
    """Final accuracy against gamma (the noise-free BNN as a horizontal line)."""
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    found = False
    for col, dataset in enumerate(DATASETS):
        axis = axes[col]
        for alpha, color in zip(PARTITIONS, ("tab:blue", "tab:orange"), strict=True):
            points = [(g, runs.get(f"{dataset}_a{alpha}_g{g}")) for g in GAMMAS]
            points = [(g, r["final"]["accuracy"]) for g, r in points if r is not None]
            if points:
                found = True
                axis.plot(
                    *zip(*points, strict=True), "o-", color=color, label=f"DPFL-BNN, {PARTITIONS[alpha]}"
                )
            baseline = runs.get(f"{dataset}_a{alpha}_noisefree")
            if baseline is not None:
                axis.axhline(baseline["final"]["accuracy"], color=color, ls="--", label="BNN (no noise)")
        axis.set_title(DATASETS[dataset])
        axis.set_xlabel("gamma (keep probability 1/2 + gamma)")
        axis.set_ylabel("final test accuracy of Sign(W~)")
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    figure.tight_layout()
    if found:
        figure.savefig(out / "dpfl_bnn_final.png", dpi=110)
    plt.close(figure)
    return found


def results_table(runs: dict[str, Run]) -> list[str]:
    """One row per run: accuracies, both epsilons, upload bytes."""
    header = [
        "data set",
        "partition",
        "variant",
        "T",
        "lr",
        "final acc. Sign(W~)",
        "best acc.",
        "local-model acc. (diagnostic)",
        "epsilon client level",
        "epsilon per coordinate",
        "upload B/client/round",
        "failed uploads",
        "wall",
    ]
    rows = []
    for dataset in DATASETS:
        for alpha in PARTITIONS:
            for suffix, label in variants():
                run = runs.get(f"{dataset}_a{alpha}_{suffix}")
                if run is None:
                    continue
                accuracies = [r["accuracy"] for r in run["rounds"] if r["accuracy"] is not None]
                final = run["final"]
                epsilon = final["epsilon"]
                rows.append(
                    [
                        DATASETS[dataset],
                        PARTITIONS[alpha],
                        label,
                        run["config"]["num_rounds"],
                        f"{run['config']['lr']:g}",
                        fmt(final["accuracy"]),
                        fmt(max(accuracies)),
                        fmt(local_model_accuracy(run)),
                        "null (not private)" if epsilon is None else fmt(epsilon, 6),
                        fmt(final.get("epsilon_per_coordinate")),
                        fmt(final.get("upload_bytes_per_client"), 6),
                        sum(r["failures"] for r in run["rounds"]),
                        f"{final['wall_s'] / 60:.0f} min",
                    ]
                )
    return markdown_table(header, rows)


def local_model_accuracy(run: Run) -> float | None:
    """The last local-model diagnostic: ``outside_guarantee`` (older results: ``final``)."""
    outside = [r for r in run.get("outside_guarantee", {}).get("rounds", []) if "local_model_accuracy" in r]
    if outside:
        return outside[-1]["local_model_accuracy"]
    return run["final"].get("local_model_accuracy")


def comparison_table(runs: dict[str, Run]) -> list[str]:
    """Per data set and partition: each gamma's final accuracy minus the noise-free BNN's (Fig. 3, 4)."""
    header = [
        "data set",
        "partition",
        "BNN (no noise)",
        *(f"gamma = {g}: acc. (minus BNN)" for g in GAMMAS),
        "best variant",
    ]
    rows = []
    for dataset in DATASETS:
        for alpha in PARTITIONS:
            accuracy = {
                suffix: run["final"]["accuracy"]
                for suffix, _ in variants()
                if (run := runs.get(f"{dataset}_a{alpha}_{suffix}")) is not None
            }
            if not accuracy:
                continue
            base = accuracy.get("noisefree")
            cells = [DATASETS[dataset], PARTITIONS[alpha], fmt(base, missing="not run")]
            for g in GAMMAS:
                value = accuracy.get(f"g{g}")
                if value is None:
                    cells.append("not run")
                elif base is None:
                    cells.append(fmt(value))
                else:
                    cells.append(f"{fmt(value)} ({value - base:+.3f})")
            best = max(accuracy, key=accuracy.get)
            cells.append(dict(variants())[best] + ("" if len(accuracy) == 5 else " (of the runs done)"))
            rows.append(cells)
    return markdown_table(header, rows)


def upload_table(runs: dict[str, Run]) -> list[str]:
    """Measured bytes of one client's train reply: DPFL-BNN against float32 FedAvg."""
    bnn = [
        r["final"]["upload_bytes_per_client"]
        for dataset in DATASETS
        for alpha in PARTITIONS
        for suffix, _ in variants()
        if (r := runs.get(f"{dataset}_a{alpha}_{suffix}")) is not None
    ]
    if not bnn:
        return []
    per_client = sorted(set(bnn))
    size = per_client[0]
    ratios: list[tuple[str, float]] = []
    rows = [
        [
            f"DPFL-BNN, d = {MNIST_BITS} packed bits (payload {packed_length(MNIST_BITS)} B)",
            ", ".join(f"{b:.0f}" for b in per_client),
            1,
        ]
    ]
    for name, label in (
        ("fedavg_float32_bnn_cnn", "FedAvg, float32, the same network (bnn_cnn latent weights)"),
        ("fedavg_float32_cnn", "FedAvg, float32, the platform's CNN (model=cnn)"),
    ):
        run = runs.get(name)
        if run is None:
            continue
        record = run["rounds"][0]
        fedavg = record["upload_bytes"] / record["clients"]
        rows.append([label, f"{fedavg:.0f}", f"{fedavg / size:.1f}x"])
        ratios.append((label, fedavg / max(per_client)))
    lines = markdown_table(
        ["upload of one client per round", "bytes (measured message)", "ratio to DPFL-BNN"], rows
    )
    if ratios:
        lines.append("")
        for label, ratio in ratios:
            verdict = "met" if ratio >= GOAL else "NOT met"
            lines.append(
                f"- Goal (upload at least {GOAL:g}x smaller than float32 FedAvg) against {label}: "
                f"**{verdict}**, {ratio:.1f}x (largest measured DPFL-BNN upload)."
            )
        payload = 4 * MNIST_BITS / packed_length(MNIST_BITS)
        lines.append(
            f"- Payload alone (float32 4d bytes against ceil(d/8) bytes): {payload:.1f}x; the rest is "
            "Flower's fixed framing of the message."
        )
    return lines


def privacy_table(rounds: tuple[int, ...] = (10, 100), bits: int = MNIST_BITS) -> list[str]:
    """Epsilon of each gamma under both accountings (the accountant's RDP composition)."""
    header = [
        "gamma",
        "flip prob.",
        "epsilon of one bit (pure)",
        *(f"per coordinate, T = {t}" for t in rounds),
        *(f"client level, T = {t} (d = {bits})" for t in rounds),
    ]
    rows = []
    for gamma in GAMMAS:
        per_bit = BinaryRandomizedResponse(gamma).pure_epsilon
        coordinate = [binary_rr_epsilon(gamma=gamma, delta=DELTA, rounds=t) for t in rounds]
        client = [binary_rr_epsilon(gamma=gamma, delta=DELTA, rounds=t, bits_per_round=bits) for t in rounds]
        rows.append(
            [gamma, f"{0.5 - gamma:.1f}", f"{per_bit:.4f}", *(f"{e:.4g}" for e in coordinate + client)]
        )
    return markdown_table(header, rows)


def calibration_table(epsilons: tuple[float, ...] = (1.0, 4.0, 8.0), rounds: int = 100) -> list[str]:
    """Gamma for a target epsilon: Theorem 1's fixed order vs optimised, per coordinate vs client level."""
    header = [
        f"epsilon (delta = {DELTA:g}, T = {rounds})",
        "gamma, Theorem 1 (order 1 + 2 log(1/delta)/epsilon)",
        "gamma, per coordinate (optimised order)",
        f"gamma, client level (d = {MNIST_BITS})",
        "flip prob. at client level",
    ]
    rows = []
    for epsilon in epsilons:
        theorem = bnn_gamma_theorem1(epsilon=epsilon, delta=DELTA, rounds=rounds)
        coordinate = bnn_gamma(epsilon=epsilon, delta=DELTA, rounds=rounds)
        client = bnn_gamma(epsilon=epsilon, delta=DELTA, rounds=rounds, bits_per_round=MNIST_BITS)
        rows.append(
            [f"{epsilon:g}", f"{theorem:.4f}", f"{coordinate:.4f}", f"{client:.3g}", f"{0.5 - client:.6f}"]
        )
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    """Write the figures and ``dpfl_bnn_tables.md``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--root", type=Path, default=Path("/tmp/bench_dpfl_bnn/runs"))
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks/figures"))
    parser.add_argument(
        "--page",
        type=Path,
        default=None,
        help="page whose generated block (between the BEGIN/END markers) is replaced by the tables "
        "(default: dpfl_bnn.md next to --out, if it exists)",
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    runs = load_runs(args.root)
    accuracy_figure(runs, args.out)
    final_figure(runs, args.out)
    sections = [
        ("Runs", results_table(runs)),
        ("Final accuracy against the noise-free BNN", comparison_table(runs)),
        ("Upload size", upload_table(runs)),
        ("Epsilon of each gamma, both accountings", privacy_table()),
        ("gamma for a target epsilon", calibration_table()),
    ]
    text = ["<!-- generated by benchmarks/dpfl_bnn.py; do not edit -->"]
    for title, lines in sections:
        if lines:
            text += ["", f"### {title}", "", *lines]
    (args.out / "dpfl_bnn_tables.md").write_text("\n".join(text) + "\n")
    print("\n".join(text))
    page = args.page if args.page is not None else args.out.parent / "dpfl_bnn.md"
    if replace_generated_block(page, [*text, "", ""], begin=BEGIN, end=END):  # a blank line before END
        print(f"updated the generated block of {page}")
    elif args.page is not None or page.is_file():
        print(f"{page}: no file or no {BEGIN} ... {END} block; not updated", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
