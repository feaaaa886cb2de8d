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
import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from fl_app.bits import packed_length
from fl_app.privacy.calibration import binary_rr_epsilon, bnn_gamma, bnn_gamma_theorem1
from fl_app.privacy.events import BinaryRandomizedResponse

Run = dict[str, Any]
DATASETS = {"mnist": "MNIST", "fashion_mnist": "Fashion-MNIST"}
PARTITIONS = {100: "IID (alpha = 100)", 1: "non-IID (alpha = 1)"}
GAMMAS = (0.1, 0.2, 0.3, 0.4)
DELTA = 1e-5
GOAL = 30.0  # the goal: the upload at least 30x smaller than float32 FedAvg
BEGIN, END = "<!-- BEGIN dpfl_bnn_tables.md -->", "<!-- END dpfl_bnn_tables.md -->"
MNIST_BITS = 144 + 2304 + 784 * 100 + 1000  # BinaryCNN on 28x28 images, 10 classes


def load(root: Path, name: str) -> Run | None:
    """The completed run in ``root / name``, or None."""
    path = root / name / "results.json"
    if not path.is_file():
        return None
    run = json.loads(path.read_text())
    return run if run.get("status") == "completed" else None


def variants() -> list[tuple[str, str]]:
    """(run-name suffix, label) of the noise-free BNN and each gamma."""
    return [("noisefree", "BNN (no noise)")] + [(f"g{g}", f"gamma = {g}") for g in GAMMAS]


def accuracy_figure(root: Path, out: Path) -> bool:
    """Test accuracy of Sign(W~) per round: one panel per data set and partition."""
    figure, axes = plt.subplots(2, 2, figsize=(11, 8), sharex=True)
    found = False
    for row, dataset in enumerate(DATASETS):
        for col, alpha in enumerate(PARTITIONS):
            axis = axes[row][col]
            for suffix, label in variants():
                run = load(root, f"{dataset}_a{alpha}_{suffix}")
                if run is None:
                    continue
                found = True
                rounds = [0] + [r["round"] for r in run["rounds"] if r["accuracy"] is not None]
                accuracy = [run["initial"]["accuracy"]] + [
                    r["accuracy"] for r in run["rounds"] if r["accuracy"] is not None
                ]
                axis.plot(
                    rounds, accuracy, marker="o", ms=3, label=label, ls="--" if suffix == "noisefree" else "-"
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


def final_figure(root: Path, out: Path) -> bool:
    """Final accuracy against gamma (the noise-free BNN as a horizontal line)."""
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    found = False
    for col, dataset in enumerate(DATASETS):
        axis = axes[col]
        for alpha, color in zip(PARTITIONS, ("tab:blue", "tab:orange"), strict=True):
            points = [(g, load(root, f"{dataset}_a{alpha}_g{g}")) for g in GAMMAS]
            points = [(g, r["final"]["accuracy"]) for g, r in points if r is not None]
            if points:
                found = True
                axis.plot(
                    *zip(*points, strict=True), "o-", color=color, label=f"DPFL-BNN, {PARTITIONS[alpha]}"
                )
            baseline = load(root, f"{dataset}_a{alpha}_noisefree")
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


def _fmt(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}g}"


def results_table(root: Path) -> list[str]:
    """One row per run: accuracies, both epsilons, upload bytes."""
    lines = [
        "| data set | partition | variant | T | lr | final acc. Sign(W~) | best acc. "
        "| local-model acc. (diagnostic) | epsilon client level | epsilon per coordinate "
        "| upload B/client/round | failed uploads | wall |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for dataset in DATASETS:
        for alpha in PARTITIONS:
            for suffix, label in variants():
                run = load(root, f"{dataset}_a{alpha}_{suffix}")
                if run is None:
                    continue
                accuracies = [r["accuracy"] for r in run["rounds"] if r["accuracy"] is not None]
                final = run["final"]
                epsilon = final["epsilon"]
                cells = [
                    DATASETS[dataset],
                    PARTITIONS[alpha],
                    label,
                    str(run["config"]["num_rounds"]),
                    f"{run['config']['lr']:g}",
                    _fmt(final["accuracy"]),
                    _fmt(max(accuracies)),
                    _fmt(local_model_accuracy(run)),
                    "null (not private)" if epsilon is None else _fmt(epsilon, 6),
                    _fmt(final.get("epsilon_per_coordinate")),
                    _fmt(final.get("upload_bytes_per_client"), 6),
                    str(sum(r["failures"] for r in run["rounds"])),
                    f"{final['wall_s'] / 60:.0f} min",
                ]
                lines.append("| " + " | ".join(cells) + " |")
    return lines


def local_model_accuracy(run: dict[str, Any]) -> float | None:
    """The last local-model diagnostic: ``outside_guarantee`` (older results: ``final``)."""
    outside = [r for r in run.get("outside_guarantee", {}).get("rounds", []) if "local_model_accuracy" in r]
    if outside:
        return outside[-1]["local_model_accuracy"]
    return run["final"].get("local_model_accuracy")


def comparison_table(root: Path) -> list[str]:
    """Per data set and partition: each gamma's final accuracy minus the noise-free BNN's (Fig. 3, 4)."""
    lines = [
        "| data set | partition | BNN (no noise) | "
        + " | ".join(f"gamma = {g}: acc. (minus BNN)" for g in GAMMAS)
        + " | best variant |",
        "|---" * (4 + len(GAMMAS)) + "|",
    ]
    for dataset in DATASETS:
        for alpha in PARTITIONS:
            runs = {suffix: load(root, f"{dataset}_a{alpha}_{suffix}") for suffix, _ in variants()}
            if all(r is None for r in runs.values()):
                continue
            accuracy = {k: r["final"]["accuracy"] for k, r in runs.items() if r is not None}
            base = accuracy.get("noisefree")
            cells = [DATASETS[dataset], PARTITIONS[alpha], _fmt(base) if base is not None else "not run"]
            for g in GAMMAS:
                value = accuracy.get(f"g{g}")
                if value is None:
                    cells.append("not run")
                elif base is None:
                    cells.append(_fmt(value))
                else:
                    cells.append(f"{_fmt(value)} ({value - base:+.3f})")
            best = max(accuracy, key=accuracy.get)
            cells.append(dict(variants())[best] + ("" if len(accuracy) == 5 else " (of the runs done)"))
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def upload_table(root: Path) -> list[str]:
    """Measured bytes of one client's train reply: DPFL-BNN against float32 FedAvg."""
    bnn = [
        r["final"]["upload_bytes_per_client"]
        for dataset in DATASETS
        for alpha in PARTITIONS
        for suffix, _ in variants()
        if (r := load(root, f"{dataset}_a{alpha}_{suffix}")) is not None
    ]
    if not bnn:
        return []
    per_client = sorted(set(bnn))
    size = per_client[0]
    ratios: list[tuple[str, float]] = []
    lines = [
        "| upload of one client per round | bytes (measured message) | ratio to DPFL-BNN |",
        "|---|---|---|",
        f"| DPFL-BNN, d = {MNIST_BITS} packed bits (payload {packed_length(MNIST_BITS)} B) | "
        f"{', '.join(f'{b:.0f}' for b in per_client)} | 1 |",
    ]
    for name, label in (
        ("fedavg_float32_bnn_cnn", "FedAvg, float32, the same network (bnn_cnn latent weights)"),
        ("fedavg_float32_cnn", "FedAvg, float32, the platform's CNN (model=cnn)"),
    ):
        run = load(root, name)
        if run is None:
            continue
        record = run["rounds"][0]
        fedavg = record["upload_bytes"] / record["clients"]
        lines.append(f"| {label} | {fedavg:.0f} | {fedavg / size:.1f}x |")
        ratios.append((label, fedavg / max(per_client)))
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
    lines = [
        "| gamma | flip prob. | epsilon of one bit (pure) | "
        + " | ".join(f"per coordinate, T = {t}" for t in rounds)
        + " | "
        + " | ".join(f"client level, T = {t} (d = {bits})" for t in rounds)
        + " |",
        "|---" * (3 + 2 * len(rounds)) + "|",
    ]
    for gamma in GAMMAS:
        per_bit = BinaryRandomizedResponse(gamma).pure_epsilon
        coordinate = [binary_rr_epsilon(gamma=gamma, delta=DELTA, rounds=t) for t in rounds]
        client = [binary_rr_epsilon(gamma=gamma, delta=DELTA, rounds=t, bits_per_round=bits) for t in rounds]
        lines.append(
            f"| {gamma} | {0.5 - gamma:.1f} | {per_bit:.4f} | "
            + " | ".join(f"{e:.4g}" for e in coordinate)
            + " | "
            + " | ".join(f"{e:.4g}" for e in client)
            + " |"
        )
    return lines


def calibration_table(epsilons: tuple[float, ...] = (1.0, 4.0, 8.0), rounds: int = 100) -> list[str]:
    """Gamma for a target epsilon: Theorem 1's fixed order vs optimised, per coordinate vs client level."""
    lines = [
        f"| epsilon (delta = {DELTA:g}, T = {rounds}) | "
        "gamma, Theorem 1 (order 1 + 2 log(1/delta)/epsilon) | "
        "gamma, per coordinate (optimised order) | gamma, client level (d = "
        f"{MNIST_BITS}) | flip prob. at client level |",
        "|---|---|---|---|---|",
    ]
    for epsilon in epsilons:
        theorem = bnn_gamma_theorem1(epsilon=epsilon, delta=DELTA, rounds=rounds)
        coordinate = bnn_gamma(epsilon=epsilon, delta=DELTA, rounds=rounds)
        client = bnn_gamma(epsilon=epsilon, delta=DELTA, rounds=rounds, bits_per_round=MNIST_BITS)
        lines.append(
            f"| {epsilon:g} | {theorem:.4f} | {coordinate:.4f} | {client:.3g} | {0.5 - client:.6f} |"
        )
    return lines


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
    accuracy_figure(args.root, args.out)
    final_figure(args.root, args.out)
    sections = [
        ("Runs", results_table(args.root)),
        ("Final accuracy against the noise-free BNN", comparison_table(args.root)),
        ("Upload size", upload_table(args.root)),
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
    if page.is_file():
        update_page(page, text[1:])
    return 0


def update_page(page: Path, lines: list[str]) -> None:
    """Replace the block between the BEGIN/END markers of ``page`` with the generated tables."""
    content = page.read_text()
    if BEGIN not in content or END not in content:
        return
    head, rest = content.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    block = "\n".join([BEGIN, "<!-- generated by benchmarks/dpfl_bnn.py; do not edit -->", *lines, "", END])
    page.write_text(head + block + tail)
    print(f"updated the generated block of {page}")


if __name__ == "__main__":
    raise SystemExit(main())
