"""``python -m fl_app.report <dir> [--out DIR]``: one table and one set of plots for many runs.

Reads every ``results.json`` below ``<dir>`` (a multirun directory, or a tree of them), groups the runs
that differ only in their seed, and writes into ``<dir>`` (or ``--out``):

* ``report.csv`` and ``report.md``: one row per group: algorithm (with the runs' ``label``, if set:
  ``dp_fedavg (untuned)``), data set, partition, the settings
  that vary across the runs (every configuration key with more than one value, e.g. ``strategy.k`` in
  a sweep over K), target and reported cumulative epsilon, delta, final accuracy as mean +- standard
  deviation over seeds (the standard deviation only with at least two seeds), upload bytes per client
  per round, wall time, number of seeds. ``report.md`` has one table per privacy unit, under a
  heading naming it (epsilons in different units are not comparable); a run whose epsilon is a
  simulated deployment's (``strategy.noise_cohort_size``) has its own table and plot panel, whose
  heading says that the epsilon holds for that deployment, not for the run's model;
* ``accuracy_vs_epsilon.png`` (final accuracy against the reported cumulative epsilon, one line per
  arm: algorithm, data set and varying settings but the budget, never joining two configurations;
  settings an arm's conf chooses per budget (``${per_budget:...}``, read from Hydra's saved
  ``.hydra/config.yaml``) are its rule, so its budgets are one line;
  non-private runs as dashed horizontal references), ``accuracy_vs_round.png`` (mean over seeds) and
  ``accuracy_vs_upload.png`` (accuracy against cumulative upload bytes per client);
* with canaries (``privacy.canaries``): the ``empirical_epsilon`` columns (the estimate, its interval,
  the number of canaries) and ``empirical_vs_claimed.png`` (estimate against claim, with the diagonal).

A directory without results is refused (exit status 2). A results file that cannot be read or lacks
the contract's fields is reported on stderr and in ``report.md``, never skipped silently; the report is
still written for the others and the command exits with status 1.
"""

from __future__ import annotations

import argparse
import csv
import html
import json
import math
import sys
import textwrap
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from omegaconf import OmegaConf

from fl_app.config.fingerprint import canonical_number
from fl_app.config.settings import cohort_size
from fl_app.report.tracking_common import flatten
from fl_app.run.code_version import describe as describe_code
from fl_app.run.lifecycle import (  # keeps COMPLETED unless --all
    COMPLETED_STATUSES,
    DIVERGENCE_FACTOR,
    diverged,
)

REQUIRED_FIELDS = ("strategy", "dataset", "config", "rounds", "final", "privacy")
#: Files that mark a directory as a run's (a job directory without results.json is reported missing).
RUN_MARKERS = (".hydra", "run.log")
#: Keys that never make two runs different experiments: the seed, run-local paths, and where and how a
#: run executes or what it logs (results are the same on a cluster, on GPUs, with fewer concurrent
#: clients, in Ray's actors or another backend, in bulk or one message per client, or with a tracker;
#: a run made before such a key existed lacks it).
IGNORED_KEYS = {
    "seed",
    "output_dir",
    "resume",
    "privacy.noise_seed",
    "simulation.ray_address",
    "simulation.timeout",
    "simulation.client_gpus",
    "simulation.max_concurrent_clients",
    "simulation.messages_per_task",
    "simulation.backend",
    "simulation.vectorise",
    "simulation.pack_messages",
    "simulation.bulk",
    "tracking",
    "tracker.mlflow_uri",
    "tracker.experiment",
    "tracker.wandb_mode",
}
COLUMNS = (
    "algorithm",
    "status",
    "dataset",
    "partition",
    "settings",
    "clients",
    "rounds",
    "epsilon_target",
    "epsilon",
    "epsilon_unit",
    "empirical_epsilon",
    "empirical_low",
    "empirical_high",
    "canaries",
    "delta",
    "evaluated_on",
    "accuracy_mean",
    "accuracy_std",
    "chance_accuracy",
    "diverged",
    "seeds",
    "upload_bytes_per_client_round",
    "wall_s",
    "runs",
)


def epsilon_unit(results: dict[str, Any]) -> str:
    """The run's privacy unit, saying so when a client is one user (``partition=natural``).

    A user-level epsilon and an epsilon per drawn share of rows are not the same unit: their rows go
    into separate tables. Nor is an epsilon that holds for a simulated deployment, not for the run's
    model (``privacy.total.holds_for``), nor one that rests on an assumption the user declared (a text
    vocabulary declared public, ``privacy.vocabulary.assumption``): the unit then says so.
    """
    unit = str(results["privacy"].get("unit", ""))
    if unit and unit != "none" and str(results.get("client", "")).startswith("one user"):
        unit = f"{unit}; a client is one user (partition=natural)"
    holds_for = results["privacy"].get("total", {}).get("holds_for")
    unit = f"{unit}; {holds_for}" if holds_for else unit
    assumption = (results["privacy"].get("vocabulary") or {}).get("assumption")
    return f"{unit}; ASSUMED: {assumption}" if assumption else unit


@dataclass
class Run:
    """One run's results.json, with where it came from."""

    path: Path
    results: dict[str, Any]

    @property
    def config(self) -> dict[str, Any]:
        """The run's resolved configuration."""
        return self.results["config"]

    @property
    def status(self) -> str:
        """How the run ended (``completed``, ``completed_with_failures``, ``interrupted``, ``failed``)."""
        return str(self.results.get("status", "completed"))

    @property
    def completed(self) -> bool:
        """Whether the run ran all its rounds."""
        return self.status in COMPLETED_STATUSES

    @property
    def diverged(self) -> bool:
        """Whether the run diverged (``final.diverged``; for older results: the same rule on its losses)."""
        final = self.results["final"]
        if "diverged" in final:
            return bool(final["diverged"])
        return diverged(self.results.get("initial", {}).get("loss"), final.get("loss"))

    def settings(self) -> dict[str, Any]:
        """The flat configuration without the seed and run-local paths.

        A run made before ``evaluation.split`` existed was evaluated on the test split; the validation
        fraction matters only with ``split=validation``.
        """
        flat = {k: v for k, v in flatten(self.config).items() if k not in IGNORED_KEYS}
        flat.setdefault("evaluation.split", "test")
        flat.setdefault("label", None)  # runs made before ``label`` existed have none
        if flat["evaluation.split"] == "test":
            flat.pop("evaluation.validation_fraction", None)
        return flat

    def group_key(self) -> str:
        """Everything that defines the experiment except the seed (and run-local paths), spelling aside."""
        return json.dumps(canonical(self.settings()), sort_keys=True, default=str)

    def budget_rules(self) -> list[str]:
        """Keys the run's configuration sets per privacy budget (``${per_budget:...}``).

        Read from the configuration Hydra saved beside the results (``.hydra/config.yaml``, not
        resolved); a run without it has none. Runs of one arm that differ only in these keys and the
        budget are one line in the plots: the arm's rule, not different configurations.
        """
        saved = self.path.parent / ".hydra" / "config.yaml"
        if not saved.is_file():
            return []
        try:
            raw = OmegaConf.to_container(OmegaConf.load(saved), resolve=False)
        except Exception:  # an unreadable file only means no rules are known
            return []
        if not isinstance(raw, dict):
            return []
        return sorted(k for k, v in flatten(raw).items() if isinstance(v, str) and "${per_budget:" in v)

    def upload_per_client_round(self) -> float | None:
        """Mean over rounds of the round's upload bytes divided by its number of clients.

        A run with secret cohorts publishes no per-round counts, nor a size measured on its cohorts:
        ``final.upload_bytes_per_client`` where a results file has one, else None (unknown).
        """
        values = [v for v in (self.round_upload_per_client(r) for r in self.results["rounds"]) if v]
        return float(np.mean(values)) if values else None

    def round_upload_per_client(self, record: dict[str, Any]) -> float | None:
        """One round's upload bytes per participating client (None: unknown)."""
        if record.get("clients") and record.get("upload_bytes") is not None:
            return float(record["upload_bytes"]) / float(record["clients"])
        per_client = self.results["final"].get("upload_bytes_per_client")
        return None if per_client is None else float(per_client)


def canonical(flat: dict[str, Any]) -> dict[str, Any]:
    """Flat settings with one spelling per value, as the run reads them.

    Numbers are floats (``8`` and ``8.0`` are one epsilon), ``clients_per_round`` the count it gives
    (``0.3`` of 100 clients is ``30``).
    """
    out = {key: canonical_number(value) for key, value in flat.items()}
    per_round, clients = flat.get("clients_per_round"), flat.get("num_clients")
    if isinstance(per_round, int | float) and isinstance(clients, int) and not isinstance(per_round, bool):
        out["clients_per_round"] = float(cohort_size(per_round, clients))
    return out


def ended_before_round_one(results: Any) -> bool:
    """Whether a results.json is that of a run that failed or was interrupted before any round."""
    return (
        isinstance(results, dict)
        and results.get("status") in ("failed", "interrupted")
        and not results.get("rounds")
    )


def missing_runs(root: Path) -> list[str]:
    """One line per run directory below ``root`` without a results.json (killed, or still running).

    (Runs that failed or were interrupted before their first round are listed by :func:`read_runs`.)
    A sweep's directory (Hydra's ``multirun.yaml``) also says how many jobs it has no directory for.
    """
    lines = []
    candidates = {
        p.parent for marker in RUN_MARKERS for p in root.rglob(marker) if ".hydra" not in p.parent.parts
    }
    for directory in sorted(candidates):
        if directory == root and (directory / "multirun.yaml").exists():
            continue
        if not (directory / "results.json").exists() and not (directory / "multirun.yaml").exists():
            lines.append(f"{directory}: no results.json (killed, or still running?)")
    for sweep in sorted(root.rglob("multirun.yaml")):
        expected = sweep_size(sweep)
        started = sum(1 for p in sweep.parent.iterdir() if p.is_dir() and (p / ".hydra").is_dir())
        if expected is not None and started < expected:
            lines.append(
                f"{sweep.parent}: {expected - started} of the sweep's {expected} jobs never started "
                "(run the sweep again into this directory to continue it)"
            )
    return lines


def sweep_size(multirun_yaml: Path) -> int | None:
    """The number of jobs of the sweep Hydra's ``multirun.yaml`` describes (None: cannot tell)."""
    try:
        from fl_app.engine.hydra import sweep_jobs

        saved = OmegaConf.load(multirun_yaml)
        preset = [f"{key}={value}" for key, value in (saved.hydra.sweeper.get("params") or {}).items()]
        return len(sweep_jobs(preset, [str(o) for o in saved.hydra.overrides.task]))
    except Exception:  # a sweep of another version of the app, or of a plug-in not installed here
        return None


class RunsBelow(NamedTuple):
    """What :func:`read_runs` found below a directory."""

    runs: list[Run]
    #: One line per results.json that could not be used.
    problems: list[str]
    #: One line per run that failed or was interrupted before its first round (nothing to summarise).
    ended_early: list[str]


def load_runs(root: Path) -> tuple[list[Run], list[str]]:
    """All readable runs below ``root`` and one problem line per unreadable file."""
    found = read_runs(root)
    return found.runs, found.problems


def read_runs(root: Path) -> RunsBelow:
    """:func:`load_runs`, and the runs that ended before their first round, each file read once."""
    runs: list[Run] = []
    problems: list[str] = []
    ended_early: list[str] = []
    for path in sorted(root.rglob("results.json")):
        try:
            results = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            problems.append(f"{path}: unreadable ({' '.join(str(error).split())})")
            continue
        missing = [f for f in REQUIRED_FIELDS if f not in results] if isinstance(results, dict) else ["all"]
        if missing:
            problems.append(f"{path}: missing fields {', '.join(missing)}")
            continue
        if not results["rounds"] or "accuracy" not in results["final"]:
            if ended_before_round_one(results):
                ended_early.append(f"{path.parent}: {results['status']} before its first round")
            else:
                problems.append(f"{path}: no rounds or no final accuracy")
            continue
        runs.append(Run(path, results))
    return RunsBelow(runs, problems, ended_early)


def summarise(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """One row per group of runs that differ only in their seed."""
    groups: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        groups[run.group_key()].append(run)
    varying = varying_keys([members[0] for members in groups.values()])
    rows = [group_row(members, varying) for members in groups.values()]
    rows.sort(
        key=lambda r: (
            r["dataset"],
            r["algorithm"],
            r["arm_settings"],  # an arm's budgets in order, whatever it chooses per budget
            r["epsilon"] is None,
            r["epsilon"] if r["epsilon"] is not None else math.inf,
        )
    )
    return rows


def group_row(members: Sequence[Run], varying: Sequence[str]) -> dict[str, Any]:
    """The summary row of one group of runs that differ only in their seed.

    ``varying``: the settings that differ between the groups (shown in the ``settings`` column).
    """
    first = members[0].results
    own = members[0].settings()
    accuracies = [
        float(m.results["final"]["accuracy"]) for m in members if m.results["final"]["accuracy"] is not None
    ]
    epsilons = [m.results["final"]["epsilon"] for m in members]
    finite = [float(e) for e in epsilons if e is not None]
    uploads = [u for u in (m.upload_per_client_round() for m in members) if u is not None]
    empirical = [m.results["privacy"].get("empirical_epsilon") for m in members]
    estimates = [e for e in empirical if e]
    private = bool(finite) and len(finite) == len(epsilons)
    per_budget = members[0].budget_rules()
    shown = [k for k in varying if k in own and k != "label"]  # the label is in the algorithm column
    statuses = [m.status for m in members]
    chances = [m.results["final"].get("chance_accuracy") for m in members]
    return {
        "algorithm": first["strategy"] + (f" ({own['label']})" if own["label"] else ""),
        "status": status_text(statuses),
        "dataset": first["dataset"],
        "partition": first.get("partition", ""),
        "settings": ", ".join(f"{k}={own[k]}" for k in shown),
        # the arm: its settings but those it chooses per budget (one line in the plots)
        "arm_settings": ", ".join(f"{k}={own[k]}" for k in shown if k not in per_budget),
        "per_budget": ", ".join(k for k in per_budget if k in varying),
        "clients": first["config"].get("num_clients"),
        "rounds": len(first["rounds"]),
        "epsilon_target": first["config"].get("privacy", {}).get("epsilon") if private else None,
        "epsilon": max(finite) if private else None,
        "epsilon_unit": epsilon_unit(first),
        # the largest estimate over seeds, with its interval: compared with the largest claim
        **_largest_estimate(estimates),
        "delta": first["final"].get("delta"),
        "evaluated_on": first["final"].get("evaluated_on", "test"),
        "accuracy_mean": float(np.mean(accuracies)) if accuracies else None,
        "accuracy_std": float(np.std(accuracies, ddof=1)) if len(accuracies) > 1 else None,
        "chance_accuracy": float(np.mean(chances)) if None not in chances else None,
        "diverged": sum(m.diverged for m in members),
        "seeds": len({m.config.get("seed") for m in members}),
        "upload_bytes_per_client_round": float(np.mean(uploads)) if uploads else None,
        "wall_s": float(np.mean([m.results["final"].get("wall_s") or 0.0 for m in members])),
        "runs": [str(m.path.parent) for m in members],
    }


def status_text(statuses: Sequence[str]) -> str:
    """``completed`` when every run of a group has that status, else ``2 completed, 1 interrupted``."""
    if len(set(statuses)) == 1:
        return statuses[0]
    return ", ".join(f"{statuses.count(status)} {status}" for status in dict.fromkeys(statuses))


#: Keys shown in their own columns (or implied by the algorithm), never as a varying setting.
SHOWN_KEYS = {"strategy.name", "privacy.epsilon", "dataset.name", "partition.name", "num_clients"}


def varying_keys(runs: Sequence[Run]) -> list[str]:
    """Configuration keys whose value differs between the given runs (one run per group).

    A ``strategy.*`` key counts only when it differs between runs of the same algorithm (each
    algorithm has its own settings; comparing PrivateKT's K with nothing is not a variation);
    other keys count when any two runs differ, a key missing from a run counting as a value.
    """
    settings = [canonical(run.settings()) for run in runs]
    keys = sorted({k for flat in settings for k in flat} - SHOWN_KEYS)
    varying = []
    for key in keys:
        if key.startswith("strategy."):
            by_algorithm: dict[Any, set[str]] = defaultdict(set)
            for flat in settings:
                if key in flat:
                    by_algorithm[flat.get("strategy.name")].add(json.dumps(flat[key], default=str))
            if any(len(values) > 1 for values in by_algorithm.values()):
                varying.append(key)
        elif len({json.dumps(flat.get(key, "<unset>"), default=str) for flat in settings}) > 1:
            varying.append(key)
    return varying


def _largest_estimate(estimates: Sequence[dict[str, Any]]) -> dict[str, Any]:
    if not estimates:
        return {"empirical_epsilon": None, "empirical_low": None, "empirical_high": None, "canaries": None}
    top = max(estimates, key=lambda e: e["epsilon"])
    return {
        "empirical_epsilon": top["epsilon"],
        "empirical_low": top["low"],
        "empirical_high": top["high"],
        "canaries": top["canaries"],
    }


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def code_versions_line(runs: Sequence[Run]) -> str | None:
    """One sentence naming the runs' code versions (``code`` in results.json: :mod:`fl_app.run.code_version`).

    None when no run recorded one (results written before the field existed): the report then says
    nothing rather than "unknown" for every row.
    """
    recorded = [run.results.get("code") for run in runs]
    if not any(recorded):
        return None
    counts = Counter(describe_code(version) for version in recorded if version)
    unrecorded = sum(1 for version in recorded if not version)
    if len(counts) == 1 and not unrecorded:
        return f"Code: every run on {next(iter(counts))}."
    parts = [f"{name} ({count} runs)" for name, count in counts.most_common()]
    text = f"Code: {len(counts)} versions: {', '.join(parts)}"
    return text + (f"; {unrecorded} runs without a record." if unrecorded else ".")


def write_tables(
    rows: Sequence[dict[str, Any]],
    problems: Sequence[str],
    out: Path,
    *,
    left_out: Sequence[str] = (),
    missing: Sequence[str] = (),
    code_line: str | None = None,
    plots: Sequence[str] = (),
) -> None:
    """``report.csv``, ``report.md`` and ``report.html``: the tables, the notes, the plots.

    The notes list the runs left out and the jobs without results; ``plots`` are the image files
    written beside the report, shown under the tables.
    """
    with (out / "report.csv").open("w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=COLUMNS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: (";".join(row[k]) if k == "runs" else row[k]) for k in COLUMNS})
    lines: list[str] = []
    canaries = any(row["empirical_epsilon"] is not None for row in rows)
    for unit, members in _by_unit(rows).items():
        lines += ([""] if lines else []) + [f"### Privacy unit: {unit}", ""]
        lines += _table_lines(members, canaries=canaries)
    notes = _notes(rows, problems, left_out=left_out, missing=missing, code_line=code_line)
    for title, items in notes:
        lines += ["", title] if not items else ["", title, "", *(f"- {item}" for item in items)]
    if plots:
        lines += ["", "### Plots"]
        for name in plots:
            lines += ["", f"![{PLOT_CAPTIONS.get(name, name)}]({name})"]
    (out / "report.md").write_text("\n".join(lines) + "\n")
    write_html(rows, out, notes=notes, plots=plots, canaries=canaries)


#: What each plot shows (its caption in report.md and report.html).
PLOT_CAPTIONS = {
    "accuracy_vs_epsilon.png": "final accuracy against epsilon, per algorithm (the privacy-utility curve)",
    "epsilon_vs_round.png": "epsilon spent against rounds",
    "accuracy_vs_round.png": "accuracy against rounds per arm, mean and range over seeds",
    "accuracy_vs_upload.png": "accuracy against cumulative upload per client",
    "empirical_vs_claimed.png": "empirical epsilon from canaries against the accountant's",
}


def _by_unit(rows: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """The rows by privacy unit (one table each: epsilons in different units are not comparable)."""
    units: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        units[row["epsilon_unit"] or "none (not private)"].append(row)
    return units


def _notes(
    rows: Sequence[dict[str, Any]],
    problems: Sequence[str],
    *,
    left_out: Sequence[str],
    missing: Sequence[str],
    code_line: str | None,
) -> list[tuple[str, list[str]]]:
    """The report's notes under its tables: ``(sentence or title, listed items)``."""
    notes: list[tuple[str, list[str]]] = []
    chance = {row["dataset"]: row["chance_accuracy"] for row in rows if row["chance_accuracy"] is not None}
    if chance:
        levels = ", ".join(f"{name} {value:.3f}" for name, value in sorted(chance.items()))
        notes.append((f"Chance level (the evaluation split's most frequent label): {levels}.", []))
    if code_line:
        notes.append((code_line, []))
    if left_out:
        notes.append(("Runs left out (not completed; `--all` includes them):", list(left_out)))
    if missing:
        notes.append(("Jobs without results:", list(missing)))
    if problems:
        notes.append(("Results files that could not be used:", list(problems)))
    return notes


def write_html(
    rows: Sequence[dict[str, Any]],
    out: Path,
    *,
    notes: Sequence[tuple[str, list[str]]],
    plots: Sequence[str],
    canaries: bool,
) -> None:
    """``report.html``: report.md's tables, notes and plots as one page (the images beside it)."""
    body = ["<h1>dpfl report</h1>"]
    for unit, members in _by_unit(rows).items():
        header, cells = _table_cells(members, canaries=canaries)
        body.append(f"<h3>Privacy unit: {html.escape(unit)}</h3>")
        body.append("<table>\n<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in header) + "</tr>")
        body += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in cells]
        body.append("</table>")
    for title, items in notes:
        body.append(f"<p>{html.escape(title)}</p>")
        if items:
            body.append("<ul>" + "".join(f"<li>{html.escape(item)}</li>" for item in items) + "</ul>")
    if plots:
        body.append("<h3>Plots</h3>")
    for name in plots:
        caption = html.escape(PLOT_CAPTIONS.get(name, name))
        body.append(
            f'<figure><img src="{html.escape(name)}" alt="{caption}">'
            f"<figcaption>{caption}</figcaption></figure>"
        )
    page = HTML_PAGE.format(body="\n".join(body))
    (out / "report.html").write_text(page)


HTML_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>dpfl report</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; font-size: 0.9em; }}
th, td {{ border: 1px solid #bbb; padding: 0.25em 0.5em; text-align: left; }}
th {{ background: #eee; }}
img {{ max-width: 100%; }}
figcaption {{ font-size: 0.9em; color: #444; }}
</style>
</head>
<body>
{body}
</body>
</html>
"""


def _table_lines(rows: Sequence[dict[str, Any]], *, canaries: bool) -> list[str]:
    """One Markdown table of rows in one privacy unit (the heading above it names the unit)."""
    header, cells = _table_cells(rows, canaries=canaries)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in cells]


def _table_cells(rows: Sequence[dict[str, Any]], *, canaries: bool) -> tuple[list[str], list[list[str]]]:
    """The header and the cells of one table of rows in one privacy unit (Markdown and HTML alike).

    The empirical epsilon column appears only when some run of the report has canaries.
    """
    header = ["algorithm", "data set", "partition", "settings", "N", "T", "target epsilon"]
    header += ["epsilon (cumulative)"]
    header += ["empirical epsilon (95% interval; canaries)"] if canaries else []
    header += ["delta", "final accuracy (mean ± std)", "seeds", "upload B/client/round", "wall time (s)"]
    header += ["status"]
    table = []
    for row in rows:
        accuracy = "-" if row["accuracy_mean"] is None else f"{row['accuracy_mean']:.4f}"
        if row["accuracy_mean"] is not None and row["accuracy_std"] is not None:
            accuracy += f" ± {row['accuracy_std']:.4f}"
        if row["accuracy_mean"] is not None and row["evaluated_on"] != "test":
            accuracy += f" ({row['evaluated_on']})"  # a tuning run: not a test accuracy
        if row["diverged"]:
            accuracy += f" ⚠ {row['diverged']} of {len(row['runs'])} diverged"
        upload = (
            "-"
            if row["upload_bytes_per_client_round"] is None
            else f"{row['upload_bytes_per_client_round']:,.0f}"
        )
        cells = [
            row["algorithm"],
            row["dataset"],
            row["partition"],
            row["settings"] or "-",
            str(row["clients"]),
            str(row["rounds"]),
            _fmt(row["epsilon_target"]),
            "∞ (not private)" if row["epsilon"] is None else _fmt(row["epsilon"]),
        ]
        if canaries:
            cells.append(_empirical_cell(row))
        cells += [
            _fmt(row["delta"]),
            accuracy,
            str(row["seeds"]),
            upload,
            f"{row['wall_s']:.0f}",
            row["status"],
        ]
        table.append(cells)
    return header, table


def _empirical_cell(row: dict[str, Any]) -> str:
    if row["empirical_epsilon"] is None:
        return "-"
    interval = f"{row['empirical_low']:.3g}..{row['empirical_high']:.3g}"
    return f"{row['empirical_epsilon']:.3g} ({interval}; {row['canaries']})"


def _label(row: dict[str, Any]) -> str:
    """One arm: algorithm, data set and its varying settings (the budget is never one of them).

    Settings the arm's configuration chooses per budget (``${per_budget:...}``) are named as such, not
    by value: one arm's rule is one line.
    """
    parts = [row["dataset"]]
    if row["arm_settings"]:
        parts.append(row["arm_settings"])
    if row["per_budget"]:
        parts.append(f"{row['per_budget']} per budget")
    return f"{row['algorithm']} ({', '.join(parts)})"


def plot_accuracy_vs_epsilon(rows: Sequence[dict[str, Any]], out: Path) -> bool:
    """Final accuracy against reported cumulative epsilon: one panel per privacy unit.

    Epsilons of different units (a client's data, one record, one report) are not comparable, so
    each unit has its own panel and axis; inside a panel one line per arm (algorithm, data set,
    varying settings), non-private runs as dashed horizontal references in every panel, and the
    chance level of each data set as a dotted line.
    """
    units = list(dict.fromkeys(r["epsilon_unit"] for r in rows if r["epsilon"] is not None))
    if not units:  # no private run: no curve to draw (the table has the accuracies)
        return False
    figure, axes = plt.subplots(1, len(units), figsize=(7 * len(units), 4.5), squeeze=False, sharey=True)
    references = [r for r in rows if r["epsilon"] is None and r["accuracy_mean"] is not None]
    colours = {
        label: colour
        for label, colour in zip(sorted({_label(r) for r in rows}), plt.cm.tab10.colors * 5, strict=False)
    }
    for axis, unit in zip(axes.flat, units, strict=True):
        lines: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for row in rows:
            if (
                row["epsilon"] is not None
                and row["accuracy_mean"] is not None
                and row["epsilon_unit"] == unit
            ):
                lines[_label(row)].append(row)
        for label, members in sorted(lines.items()):
            private = sorted(members, key=lambda r: r["epsilon"])
            axis.errorbar(
                [r["epsilon"] for r in private],
                [r["accuracy_mean"] for r in private],
                yerr=[r["accuracy_std"] or 0.0 for r in private],
                marker="o",
                ms=4,
                capsize=3,
                label=label,
                color=colours[label],
            )
        for row in references:
            label = _label(row)
            axis.axhline(row["accuracy_mean"], ls="--", color=colours[label], label=f"{label}, not private")
        for dataset, chance in sorted(_chance_levels(rows).items()):
            axis.axhline(chance, ls=":", lw=1, color="black", label=f"chance level ({dataset})")
        if lines:
            axis.set_xscale("log")
            shown = [r for members in lines.values() for r in members]
            budgets = sorted({float(f"{r['epsilon']:.2g}") for r in shown})  # 0.9999 and 1.0 share a tick
            if budgets and len(budgets) <= 12:  # plain numbers at the measured budgets, not 2 x 10^0
                axis.set_xticks(budgets, [f"{b:.3g}" for b in budgets])
                axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        # the unit is the panel's title (wrapped to the panel), the axis says what is measured in it
        axis.set_xlabel("reported cumulative epsilon per unit (worst case; log scale)")
        axis.set_title(textwrap.fill(f"privacy unit: {unit or 'none'}", width=75), fontsize=9)
        axis.set_ylabel("final test accuracy (mean ± std over seeds)")
        axis.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.15), ncol=1, frameon=False)
        axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(out / "accuracy_vs_epsilon.png", dpi=120, bbox_inches="tight")
    plt.close(figure)
    return True


def _chance_levels(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """The chance level of each data set in ``rows`` (those whose results say it)."""
    return {r["dataset"]: r["chance_accuracy"] for r in rows if r.get("chance_accuracy") is not None}


def plot_empirical_vs_claimed(rows: Sequence[dict[str, Any]], out: Path) -> bool:
    """``empirical_vs_claimed.png``: canary estimate (with interval) against the accountant's epsilon.

    Points below the diagonal are what a correct mechanism gives; above it, the code releases
    more than the accountant says. Written only when some run has canaries.
    """
    shown = [r for r in rows if r["empirical_epsilon"] is not None and r["epsilon"] is not None]
    if not shown:
        return False
    figure, axis = plt.subplots(figsize=(6.4, 4.8))
    for algorithm in sorted({r["algorithm"] for r in shown}):
        members = [r for r in shown if r["algorithm"] == algorithm]
        claims = np.array([r["epsilon"] for r in members])
        estimates = np.array([r["empirical_epsilon"] for r in members])
        errors = np.array(
            [
                estimates - [r["empirical_low"] for r in members],
                [r["empirical_high"] for r in members] - estimates,
            ]
        )
        axis.errorbar(
            claims, estimates, yerr=np.maximum(errors, 0), fmt="o", ms=4, capsize=3, label=algorithm
        )
    top = max(max(r["epsilon"] for r in shown), max(r["empirical_high"] for r in shown)) * 1.1
    axis.plot([0, top], [0, top], color="tab:gray", ls="--", lw=1, label="estimate = claim")
    axis.set_xlim(0, top)
    axis.set_ylim(0, top)
    axis.set_xlabel("accountant's epsilon (worst client)")
    axis.set_ylabel("empirical epsilon from canaries (95% interval)")
    axis.set_title("empirical privacy estimate against the claim", fontsize=10)
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out / "empirical_vs_claimed.png", dpi=120)
    plt.close(figure)
    return True


class SeedCurve(NamedTuple):
    """A group's curve over its seeds: the x values, the mean, the lowest and highest seed, the seeds."""

    x: np.ndarray
    mean: np.ndarray
    low: np.ndarray
    high: np.ndarray
    seeds: int


def _seed_curves(row: dict[str, Any], runs_by_dir: dict[str, Run], x_of: str) -> SeedCurve | None:
    """The group's accuracy against rounds (round 0: the initial model) or cumulative upload per client.

    Runs of different lengths are cut to the shortest (every point is a mean over the same seeds).
    """
    curves = []
    for directory in row["runs"]:
        run = runs_by_dir[directory]
        rounds = run.results["rounds"]
        if x_of == "round":
            points = [(0.0, run.results.get("initial", {}).get("accuracy"))]
            points += [(float(r["round"]), r.get("accuracy")) for r in rounds]
        else:
            uploads = [run.round_upload_per_client(r) for r in rounds]
            if None in uploads or not any(uploads):  # a secret cohort's run publishes no sizes
                continue
            points = list(zip(np.cumsum(uploads), [r.get("accuracy") for r in rounds], strict=True))
        points = [(x, y) for x, y in points if y is not None]
        if points:
            curves.append(points)
    if not curves:
        return None
    length = min(len(curve) for curve in curves)
    xs = np.mean([[p[0] for p in curve[:length]] for curve in curves], axis=0)
    ys = np.array([[p[1] for p in curve[:length]] for curve in curves])
    return SeedCurve(xs, ys.mean(axis=0), ys.min(axis=0), ys.max(axis=0), len(curves))


def short_title(row: dict[str, Any], *, datasets: int, width: int = 42) -> str:
    """A panel's title: the algorithm, the data set when the report has several, the arm's settings.

    At most two lines of ``width`` characters (the table has every setting in full).
    """
    parts = [row["algorithm"]] + ([row["dataset"]] if datasets > 1 else [])
    per_budget = f"{row['per_budget']} per budget" if row["per_budget"] else ""
    settings = "; ".join(part for part in (row["arm_settings"], per_budget) if part)
    first = textwrap.shorten(" · ".join(parts), width=width, placeholder="…")
    if not settings:
        return first
    return first + "\n" + textwrap.shorten(settings, width=width, placeholder="…")


def _arms(rows: Sequence[dict[str, Any]]) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]]]:
    """The private arms (one panel each, their budgets inside) and the non-private groups (references)."""
    arms: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        if row["epsilon"] is not None:
            arms[_label(row)].append(row)
    references = [row for row in rows if row["epsilon"] is None]
    if not arms:  # only non-private runs: one panel each
        return {_label(row): [row] for row in references}, []
    return arms, references


def plot_curves(rows: Sequence[dict[str, Any]], runs: Iterable[Run], out: Path) -> list[str]:
    """``accuracy_vs_round.png`` and ``accuracy_vs_upload.png``: accuracy over a run, per arm.

    One panel per arm (algorithm, data set, settings), one line per budget inside it (darker = larger
    epsilon): the mean over seeds, with a band from the lowest to the highest seed; the non-private
    runs of the same data set as a dashed grey reference in every panel. Rounds are whole numbers,
    round 0 the initial model. ``accuracy_vs_upload.png`` is left out when no run publishes its upload
    sizes (a secret cohort's do not). Returns the names of the files written.
    """
    runs_by_dir = {str(run.path.parent): run for run in runs}
    arms, references = _arms(rows)
    datasets = len({row["dataset"] for row in rows})
    budgets = sorted({row["epsilon"] for row in rows if row["epsilon"] is not None})
    budget_colours = dict(
        zip(budgets, plt.cm.plasma(np.linspace(0.85, 0.05, max(len(budgets), 1))), strict=False)
    )
    written = []
    for x_of, name, xlabel in (
        ("round", "accuracy_vs_round.png", "round (0: the initial model)"),
        ("upload", "accuracy_vs_upload.png", "cumulative upload bytes per client (log scale)"),
    ):
        curves = {id(row): _seed_curves(row, runs_by_dir, x_of) for row in [*rows]}
        shown = {label: members for label, members in arms.items() if any(curves[id(m)] for m in members)}
        if not shown:
            continue
        columns = min(3, len(shown))
        figure, axes = plt.subplots(
            math.ceil(len(shown) / columns),
            columns,
            figsize=(4.4 * columns, 3.4 * math.ceil(len(shown) / columns)),
            squeeze=False,
            sharey=True,
        )
        for axis, members in zip(axes.flat, [shown[label] for label in sorted(shown)], strict=False):
            _curve_panel(axis, members, references, curves, budget_colours)
            axis.set_title(short_title(members[0], datasets=datasets), fontsize=8)
            axis.set_xlabel(xlabel, fontsize=8)
            if x_of == "upload":
                _byte_axis(axis)
            else:
                axis.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
                axis.margins(x=0.02)
        for axis in axes.flat[len(shown) :]:
            axis.set_visible(False)
        for axis in axes[:, 0]:
            axis.set_ylabel("test accuracy", fontsize=8)
        seeds = sorted({c.seeds for c in curves.values() if c is not None})
        how = "one run per line" if seeds == [1] else "mean over seeds; band: lowest to highest seed"
        figure.suptitle(how, fontsize=8)
        figure.tight_layout()
        figure.savefig(out / name, dpi=110)
        plt.close(figure)
        written.append(name)
    return written


def _curve_panel(
    axis: Any,
    members: Sequence[dict[str, Any]],
    references: Sequence[dict[str, Any]],
    curves: dict[int, SeedCurve | None],
    budget_colours: dict[float, Any],
) -> None:
    """One arm's budgets (mean and band over seeds), the non-private references and the chance level.

    ``budget_colours``: one colour per budget, the same in every panel (lighter = smaller epsilon).
    """
    members = sorted(members, key=lambda r: r["epsilon"] if r["epsilon"] is not None else math.inf)
    for row in members:
        shade = budget_colours.get(row["epsilon"], "tab:blue")
        curve = curves[id(row)]
        if curve is None:
            continue
        budget = "not private" if row["epsilon"] is None else f"ε = {row['epsilon']:.3g}"
        marker = "o" if len(curve.x) <= 30 else None  # a short run's points, a 1-round run's too
        axis.plot(curve.x, curve.mean, lw=1.3, marker=marker, ms=2.5, color=shade, label=budget)
        if curve.seeds > 1:
            axis.fill_between(curve.x, curve.low, curve.high, color=shade, alpha=0.2, lw=0)
    for row in references:
        curve = curves[id(row)]
        if curve is not None and row["dataset"] == members[0]["dataset"]:
            axis.plot(
                curve.x, curve.mean, lw=1, ls="--", color="tab:gray", label=f"{row['algorithm']}, not private"
            )
    chance = _chance_levels(members).get(members[0]["dataset"])
    if chance is not None:
        axis.axhline(chance, ls=":", lw=1, color="black", label="chance level")
    axis.tick_params(labelsize=7)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=6)


def plot_epsilon_vs_round(rows: Sequence[dict[str, Any]], runs: Iterable[Run], out: Path) -> bool:
    """``epsilon_vs_round.png``: the cumulative epsilon the accountant reports after each round.

    One panel per privacy unit, one line per private group (an arm at one budget; the worst seed),
    a colour and a line style per arm (arms whose schedules coincide stay visible), each budget
    written at its lines' end. Not written when no run is private.
    """
    runs_by_dir = {str(run.path.parent): run for run in runs}
    private = [row for row in rows if row["epsilon"] is not None]
    if not private:
        return False
    units = list(dict.fromkeys(row["epsilon_unit"] for row in private))
    figure, axes = plt.subplots(1, len(units), figsize=(6.4 * len(units), 4), squeeze=False)
    labels = sorted({_label(row) for row in private})
    styles = {
        label: {"color": colour, "ls": ls, "marker": marker}
        for label, colour, ls, marker in zip(
            labels,
            plt.cm.tab10.colors * 5,
            ["-", "--", ":", "-."] * 12,
            ["o", "s", "^", "D"] * 12,
            strict=False,
        )
    }
    datasets = len({row["dataset"] for row in rows})
    for axis, unit in zip(axes.flat, units, strict=True):
        members = [row for row in private if row["epsilon_unit"] == unit]
        _epsilon_panel(axis, members, runs_by_dir, styles, datasets)
        title = textwrap.shorten(f"privacy unit: {unit}", width=200, placeholder="…")
        axis.set_title(textwrap.fill(title, width=70), fontsize=8)
    figure.tight_layout()
    figure.savefig(out / "epsilon_vs_round.png", dpi=110)
    plt.close(figure)
    return True


def _epsilon_panel(
    axis: Any,
    members: Sequence[dict[str, Any]],
    runs_by_dir: dict[str, Run],
    styles: dict[str, dict[str, Any]],
    datasets: int,
) -> None:
    """One privacy unit's epsilon schedules: a line per group, the budgets at the lines' ends."""
    log = max(row["epsilon"] for row in members) > 20 * min(row["epsilon"] for row in members)
    ends: dict[tuple[int, str], float] = {}
    named: set[str] = set()
    for row in sorted(members, key=lambda r: (_label(r), r["epsilon"])):
        spent = [point for point in _worst_epsilons(row, runs_by_dir) if not log or point[1] > 0]
        if not spent:
            continue
        style = dict(styles[_label(row)])
        style["marker"] = style["marker"] if len(spent) <= 30 else None
        name = short_title(row, datasets=datasets, width=60).replace("\n", ", ")
        label = None if _label(row) in named else name
        named.add(_label(row))
        axis.plot(*zip(*spent, strict=True), ms=3, lw=1.3, alpha=0.85, label=label, **style)
        ends[(spent[-1][0], f"{row['epsilon']:.3g}")] = spent[-1][1]
    for (last, budget), value in ends.items():  # coinciding ends: one label
        axis.annotate(
            f"ε = {budget}", (last, value), textcoords="offset points", xytext=(5, 0), fontsize=7, va="center"
        )
    axis.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    axis.set_xlim(right=max(last for last, _ in ends) * 1.13 if ends else None)
    axis.set_xlabel("round", fontsize=8)
    axis.set_ylabel(f"cumulative epsilon (delta = {members[0]['delta']:g})", fontsize=8)
    if log:
        axis.set_yscale("log")
    else:
        axis.set_ylim(bottom=0)
    axis.tick_params(labelsize=7)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7, loc="upper left")


def _worst_epsilons(row: dict[str, Any], runs_by_dir: dict[str, Run]) -> list[tuple[int, float]]:
    """``(round, epsilon)`` of a group, the largest epsilon over its seeds in each round they all have."""
    series = []
    for directory in row["runs"]:
        rounds = runs_by_dir[directory].results["rounds"]
        series.append({r["round"]: r["epsilon"] for r in rounds if r.get("epsilon") is not None})
    common = sorted(set.intersection(*(set(s) for s in series))) if series else []
    spent = [(step, max(s[step] for s in series)) for step in common]
    return [(0, 0.0), *spent] if spent else []  # nothing is spent before round 1


def _byte_axis(axis: Any) -> None:
    """A log-scale axis of byte counts with a few labels that never overlap (1 kB, 2 kB, 5 kB, ...).

    Matplotlib labels minor ticks when the data span less than a decade or two: in small panels
    those labels ran into each other. Here: decades only over a wide span, 1-2-5 steps otherwise.
    """
    axis.set_xscale("log")
    low, high = axis.get_xlim()
    span = math.log10(high / low) if low > 0 and high > low else 0.0
    subs = (1.0,) if span > 1.5 else (1.0, 2.0, 5.0)
    axis.xaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=subs, numticks=8))
    axis.xaxis.set_major_formatter(matplotlib.ticker.EngFormatter(unit="B", places=0))
    axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m fl_app.report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("directory", type=Path, help="a multirun or output directory")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: the directory)")
    parser.add_argument(
        "--all",
        action="store_true",
        help="include interrupted and failed runs (default: completed runs only; the others are listed)",
    )
    args = parser.parse_args(argv)
    if not args.directory.is_dir():
        print(f"error: {args.directory} is not a directory", file=sys.stderr)
        return 2
    runs, problems, ended_early = read_runs(args.directory)
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    left_out = [] if args.all else [f"{run.path.parent}: {run.status}" for run in runs if not run.completed]
    runs = runs if args.all else [run for run in runs if run.completed]
    missing = [*missing_runs(args.directory), *ended_early]
    for line in [*left_out, *missing]:
        print(f"note: left out: {line}", file=sys.stderr)
    if not runs:
        print(
            f"error: no usable results.json below {args.directory}"
            f"{' of a completed run (--all includes the others)' if left_out else ''}; run "
            "`python -m fl_app -m ...` first (each job writes one)",
            file=sys.stderr,
        )
        return 2
    out = args.out or args.directory
    out.mkdir(parents=True, exist_ok=True)
    rows = summarise(runs)
    for row in rows:
        if row["diverged"]:
            print(
                f"warning: {_label(row)} at epsilon {_fmt(row['epsilon'])}: {row['diverged']} of "
                f"{len(row['runs'])} runs diverged (final loss above {DIVERGENCE_FACTOR:g}x the initial)",
                file=sys.stderr,
            )
    plots = ["accuracy_vs_epsilon.png"] if plot_accuracy_vs_epsilon(rows, out) else []
    plots += ["epsilon_vs_round.png"] if plot_epsilon_vs_round(rows, runs, out) else []
    plots += plot_curves(rows, runs, out)
    plots += ["empirical_vs_claimed.png"] if plot_empirical_vs_claimed(rows, out) else []
    code_line = code_versions_line(runs)
    write_tables(rows, problems, out, left_out=left_out, missing=missing, code_line=code_line, plots=plots)
    print(f"{len(runs)} runs in {len(rows)} groups -> {out / 'report.md'}, {out / 'report.html'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
