"""KD-DP against its ablation in the document's population, seed by seed.

Usage (from the repository root)::

    python -P benchmarks/kd_dp_regime.py [--runs docs/benchmarks/kd_dp] [--doc docs/benchmarks/kd_dp.md]

Reads the runs kept below ``--runs`` (``regime/runs``, ``regime_skew/runs``, ``regime_full/runs``,
``regime_tuned/runs``: ``+experiment=kd_dp_regime`` jobs kept with ``benchmarks/keep_runs.py``; a run's
``label`` (``label=tuned``: settings chosen on the validation split) makes it an arm of its own, compared
with the ablation of the same label) and writes one table between
the ``kd_dp/regime_pairs`` markers of ``--doc``: for every population (share of the rows the 5
large-data clients hold), budget and arm, the final test accuracy of each seed, the accuracy at the
end of the teacher stage (round ``teacher_rounds``: the DP teacher, trained on the large-data clients
alone), and the difference to the ablation of the same seed. Without ``--doc`` it prints the table.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tables import completed_runs, markdown_table, replace_generated_block

ROOT = Path(__file__).resolve().parents[1]
BEGIN = "<!-- BEGIN GENERATED: kd_dp/regime_pairs.md -->"
END = "<!-- END GENERATED -->"
#: The ablation of an arm: federated DP-SGD with KD-DP's own cohort size (10 of 100 per round).
ABLATION = "federated DP-SGD"


def arm_name(config: dict) -> str:
    """The arm of a kept run, from its composed config."""
    strategy = config["strategy"]
    if strategy["teacher_rounds"] == 0:
        cohort = config["clients_per_round"]
        return ABLATION if cohort == 10 else f"{ABLATION}, {cohort} per round"
    if strategy["epsilon_special"] is None:
        return "KD-DP, no label noise"
    return "KD-DP, epsilon/2 on labels"


#: (large share, epsilon, arm, label) -> seed -> (final accuracy, accuracy at the teacher stage's end).
Found = dict[tuple[float, float, str, str], dict[int, tuple[float, float | None]]]


def display(arm: str, label: str) -> str:
    """The table's name of an arm: a labelled run (``label=tuned``) is an arm of its own."""
    return f"{arm}, {label}" if label else arm


def load(runs: Path) -> Found:
    """(large share, epsilon, arm, label) -> seed -> (final accuracy, accuracy at the teacher stage's end)."""
    found: Found = defaultdict(dict)
    for results in completed_runs(runs):
        folder = Path(results["_path"]).relative_to(runs).parts[0]
        if not folder.startswith("regime"):
            continue
        config = results["config"]
        teacher_rounds = config["strategy"]["teacher_rounds"]
        accuracy = {r["round"]: r["accuracy"] for r in results["rounds"]}
        share, epsilon = config["partition"]["large_share"], config["privacy"]["epsilon"]
        key = (share, epsilon, arm_name(config), config.get("label") or "")
        found[key][config["seed"]] = (results["final"]["accuracy"], accuracy.get(teacher_rounds))
    return found


def table(found: Found) -> list[str]:
    """The Markdown lines: one row per population, budget and arm.

    Each arm is compared with the ablation of its own label (a tuned arm with the tuned ablation).
    """
    rows = []
    for share, epsilon, arm, label in sorted(found, key=lambda k: (k[0], k[1], display(k[2], k[3]))):
        seeds = found[(share, epsilon, arm, label)]
        ablation = found.get((share, epsilon, ABLATION, label), {})
        finals = [seeds[s][0] for s in sorted(seeds)]
        teacher = [seeds[s][1] for s in sorted(seeds) if seeds[s][1] is not None]
        gaps = [seeds[s][0] - ablation[s][0] for s in sorted(seeds) if s in ablation]
        rows.append(
            [
                f"{share:g}",
                f"{epsilon:g}",
                display(arm, label),
                " / ".join(f"{a:.3f}" for a in finals),
                f"{sum(finals) / len(finals):.3f}",
                " / ".join(f"{a:.3f}" for a in teacher) if teacher else "-",
                "-" if arm == ABLATION else " / ".join(f"{g:+.3f}" for g in gaps),
                "-" if arm == ABLATION or not gaps else f"{sum(g > 0 for g in gaps)} of {len(gaps)}",
            ]
        )
    header = [
        "large clients' share",
        "epsilon",
        "arm",
        "final accuracy, seeds 1 / 2 / 3",
        "mean",
        "teacher (end of its stage)",
        "minus ablation, per seed",
        "ahead in",
    ]
    return markdown_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    """Command line: print the table or write it into the page."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=Path, default=ROOT / "docs" / "benchmarks" / "kd_dp")
    parser.add_argument("--doc", type=Path, default=None, help="write the table into this page")
    args = parser.parse_args(argv)
    found = load(args.runs)
    if not found:
        print(f"error: no kept regime runs below {args.runs}", file=sys.stderr)
        return 2
    lines = table(found)
    if args.doc is None:
        print("\n".join(lines))
        return 0
    if not replace_generated_block(args.doc, lines, begin=BEGIN, end=END):
        print(f"error: {args.doc} lacks the markers {BEGIN} ... {END}", file=sys.stderr)
        return 2
    print(f"wrote the table into {args.doc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
