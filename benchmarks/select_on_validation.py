r"""Choose each arm's settings per budget on the validation split (never the test split).

A tuning sweep runs every candidate setting of an arm with ``evaluation.split=validation``: the
server evaluates on rows of the training split that belong to no client, and the test split is not
read. This script reads such sweeps (``fl_app.report.sweep.load_runs``), scores every run whose every
round ran by the mean validation accuracy of its last ``--last`` evaluated rounds (the model a user
would ship, less noisy than the last round alone), and for every (arm, epsilon) picks the best
candidate. Arms are told apart by strategy and by any setting outside the grid (two arms of one
strategy, such as KD-DP and federated DP-SGD, are two tables). It prints
one markdown table per arm (every candidate's score, the choice in bold), the overrides of each
choice (to run it again with ``evaluation.split=test``), and the grid's size and compute time.

Choosing on data of the same distribution as the clients' is still a release: the validation rows
stand for a held-out population; had they been clients' data, the choice itself would cost privacy
that no epsilon here counts (Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential
Privacy", ICLR 2022).

Usage::

    python benchmarks/select_on_validation.py /tmp/tune/sweep/dp_fedavg /tmp/tune/sweep/dp_fedavg_e5 \
        --out docs/benchmarks/cross_device/tuning.md
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.tables import COMPLETED
from fl_app.report.sweep import Run, load_runs

#: The keys a tuning grid varies (shown per candidate); anything else must be equal within an arm.
GRID_KEYS = (
    "num_rounds",
    "local_epochs",
    "lr",
    "strategy.server_lr",
    "strategy.server_momentum",
    "strategy.clip",
)


def score(run: Run, *, last: int) -> float:
    """Mean validation accuracy of the last ``last`` evaluated rounds."""
    accuracies = [r["accuracy"] for r in run.results["rounds"] if r.get("accuracy") is not None]
    tail = accuracies[-last:]
    return sum(tail) / len(tail)


def candidate(run: Run, keys: Sequence[str]) -> str:
    """The run's grid point, e.g. ``num_rounds=50 local_epochs=3``."""
    settings = run.settings()
    return " ".join(f"{key}={settings.get(key)}" for key in keys)


def _arm_settings(run: Run) -> dict[str, object]:
    """What makes the run's arm: its settings without the grid keys, the budget and per-budget rules."""
    ignored = {*GRID_KEYS, "privacy.epsilon", *run.budget_rules()}
    return {key: value for key, value in run.settings().items() if key not in ignored}


def arms(runs: Sequence[Run]) -> dict[str, list[Run]]:
    """The runs by arm, each named by its strategy and what sets it apart from the strategy's other arms.

    Two arms of one strategy (e.g. KD-DP and federated DP-SGD, both ``strategy=kd_dp``) differ in
    settings outside the grid; their name lists those, e.g. ``kd_dp (strategy.teacher_rounds=0)``.
    """
    groups: dict[str, tuple[dict[str, object], list[Run]]] = {}
    for run in runs:
        settings = _arm_settings(run)
        key = json.dumps(settings, sort_keys=True, default=str)
        groups.setdefault(key, (settings, []))[1].append(run)
    by_strategy: dict[str, list[dict[str, object]]] = defaultdict(list)
    for settings, _ in groups.values():
        by_strategy[str(settings["strategy.name"])].append(settings)
    named: dict[str, list[Run]] = {}
    for settings, members in groups.values():
        siblings = by_strategy[str(settings["strategy.name"])]
        differing = sorted(k for k in settings if len({str(s.get(k)) for s in siblings}) > 1)
        name = str(settings["strategy.name"])
        if differing:
            name += " (" + ", ".join(f"{k}={settings[k]}" for k in differing) + ")"
        named[name] = members
    return named


def _varying(runs: Sequence[Run]) -> list[str]:
    """The grid keys that take more than one value among ``runs``."""
    return [k for k in GRID_KEYS if len({str(run.settings().get(k)) for run in runs}) > 1]


def select(runs: Sequence[Run], *, last: int) -> dict[tuple[str, float], list[tuple[str, float, Run]]]:
    """Per (arm, epsilon): every candidate (the grid keys varying within the arm), its score; best first."""
    table: dict[tuple[str, float], list[tuple[str, float, Run]]] = defaultdict(list)
    swept = _varying(runs)
    for arm, members in arms(runs).items():
        # An arm with one grid point is named by what the sweep varies, not by an empty label.
        keys = _varying(members) or swept
        for run in members:
            epsilon = float(run.config["privacy"]["epsilon"])
            table[(arm, epsilon)].append((candidate(run, keys), score(run, last=last), run))
    return {key: sorted(entries, key=lambda entry: -entry[1]) for key, entries in sorted(table.items())}


def markdown(chosen: dict[tuple[str, float], list[tuple[str, float, Run]]], *, last: int) -> list[str]:
    """One table per arm: candidates as columns, budgets as rows, the choice in bold."""
    lines: list[str] = []
    arms = sorted({arm for arm, _ in chosen})
    for arm in arms:
        keys = [key for key in chosen if key[0] == arm]
        columns = sorted({name for key in keys for name, _, _ in chosen[key]}, key=_numeric_order)
        lines += [
            f"#### {arm}: mean validation accuracy of the last {last} rounds",
            "",
            "| epsilon | " + " | ".join(f"`{c}`" for c in columns) + " |",
            "|---|" + "---|" * len(columns),
        ]
        for key in keys:
            best = chosen[key][0][0]
            scores = {name: value for name, value, _ in chosen[key]}
            cells = [
                "-" if c not in scores else (f"**{scores[c]:.4f}**" if c == best else f"{scores[c]:.4f}")
                for c in columns
            ]
            lines.append(f"| {key[1]:g} | " + " | ".join(cells) + " |")
        lines.append("")
    return lines


def _numeric_order(name: str) -> tuple[tuple[int, float, str], ...]:
    """``num_rounds=30 local_epochs=5`` sorts by 30, then 5 (numbers as numbers, before other values)."""
    order = []
    for part in name.split():
        value = part.partition("=")[2]
        try:
            order.append((0, float(value), ""))
        except ValueError:
            order.append((1, 0.0, value))
    return tuple(order)


def main(argv: Sequence[str] | None = None) -> int:
    """Read the sweeps, refuse runs evaluated on the test split, print (and write) the choice."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweeps", nargs="+", type=Path, help="tuning sweep folders (results.json below)")
    parser.add_argument("--last", type=int, default=10, help="rounds averaged for the score (default 10)")
    parser.add_argument("--out", type=Path, help="also write the markdown here")
    args = parser.parse_args(argv)
    runs: list[Run] = []
    for root in args.sweeps:
        found, problems = load_runs(root)
        for problem in problems:
            print(f"skipped: {problem}", file=sys.stderr)
        runs += found
    unfinished = [run for run in runs if run.results.get("status") not in COMPLETED]
    for run in unfinished:
        print(f"skipped: {run.path}: status {run.results.get('status')}", file=sys.stderr)
    runs = [run for run in runs if run.results.get("status") in COMPLETED]
    tested = [run for run in runs if run.results["final"].get("evaluated_on", "test") != "validation"]
    if tested:
        print(
            f"error: {len(tested)} runs were evaluated on the test split, e.g. {tested[0].path}",
            file=sys.stderr,
        )
        return 2
    if not runs:
        print("error: no runs found", file=sys.stderr)
        return 2
    chosen = select(runs, last=args.last)
    wall = sum(float(run.results["final"].get("wall_s") or 0.0) for run in runs)
    lines = markdown(chosen, last=args.last)
    lines += [
        f"Grid: {len(runs)} runs, {wall / 60:.0f} min of run time (rounds only, start-up excluded).",
        "",
        "| arm | epsilon | chosen | validation score |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {arm} | {eps:g} | `{entries[0][0]}` | {entries[0][1]:.4f} |"
        for (arm, eps), entries in chosen.items()
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
