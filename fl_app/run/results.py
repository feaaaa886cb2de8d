"""The results contract: what every run writes into its output directory.

``results.json`` (read by other tools; keep these names)::

    {
      "schema": 1,
      "status": "completed" | "completed_with_failures" | "failed" | "interrupted",
      "code": {"package": str|null, "commit": str|null, "dirty": bool|null},  # fl_app.run.code_version
      "strategy": str, "dataset": str, "partition": str,
      "client": str,  # what one client's data is: one user's (partition=natural) or a drawn share
      "config": {...resolved configuration...},
      "initial": {"accuracy": float, "loss": float},
      "rounds": [{"round": int, "accuracy": float|null, "loss": float|null,
                  "epsilon": float|null, "upload_bytes": int, "download_bytes": int,
                  "clients": int, "failures": int, "wall_s": float, "round_s": float, ...}],
      "final": {"accuracy": float, "loss": float, "best_accuracy": float, "best_round": int,
                "epsilon": float|null,
                "epsilon_training": float|null, "delta": float, "wall_s": float, "rounds": int,
                "chance_accuracy": float, "diverged": bool, ...},
      "privacy": {"unit": str, "mechanism": str, "accountant": str,
                  "randomness": {"source": "seeded"|"os_entropy", "noise_seed": int|null,
                                 "cohort": str, "note": str, ...},
                  "total": {"epsilon": float|null, "unit": str, "per_stage": {...}, ...}, ...},
      "engine": {"messages": "per_client"|"packed"|"bulk", "why": str, "vectorised": bool,
                 "vectorised_why": str, "backend": "ray"|"processes"|"inline"|"devices",
                 "workers": int|null},  # how the rounds ran (fl_app.run.round_path)
      "stopped": {"reason": str, "after_round": int, "resume": str, ...},  # only if it stopped early
      "outside_guarantee": {...}      # only with privacy.diagnostics=true, never on devices
    }

* ``status``: see :mod:`fl_app.run.lifecycle`. A run that stopped early (``failed``,
  ``interrupted``) still writes its results up to its last completed round, the
  privacy ledger of every round whose noise was released, and ``private_server_state.pkl``
  for ``resume=``.
  A run that ended before its first round (a stop while Ray started or the data loaded) writes a
  ``results.json`` with no rounds, ``final`` ``{"rounds": 0}``, ``privacy``
  ``{"released": "nothing: no round ran"}`` and ``stopped`` (:func:`write_unstarted_results`), and
  ``run.log`` if its ServerApp had begun.

* ``epsilon`` is the cumulative epsilon of the worst client at ``privacy.delta``
  after that round, covering *everything* the run released about a client
  (training and any evaluation stage; ``epsilon_training`` is the training
  stage alone, other stages name their own fields): the smallest of the sound bounds the accountant computed,
  which are also given (``epsilon_rdp``, ``epsilon_pld`` with
  ``privacy.accountant=pld``, ``epsilon_basic`` for pure-epsilon mechanisms;
  ``epsilon_method`` names the one used). ``null`` means *no finite guarantee* (epsilon = infinity):
  a non-private run, or a mechanism configured without noise. The file is
  strict JSON (no ``Infinity``/``NaN`` tokens).
* ``accuracy``/``loss``: the global model on the server's test split (on the validation split
  with ``evaluation.split=validation``; ``final.evaluated_on`` names it);
  ``null`` in rounds skipped by ``evaluation.every``.
* ``upload_bytes``/``download_bytes``: serialised size of that round's train
  messages, summed over clients (``*_array_bytes``: raw array data only).
* ``wall_s``: seconds since the run started (its first log line; over all sessions of a resumed
  run); ``round_s``: this round's duration. ``final.wall_s`` is what the run's last line says.
* ``final.chance_accuracy``: the accuracy of always predicting the evaluation split's most
  frequent label; ``final.diverged``: the final loss is not finite or more than
  :data:`~fl_app.run.lifecycle.DIVERGENCE_FACTOR` times the initial model's (the run's last line warns).
* With a secret cohort (DP-FedAvg's and adaptive clipping's Poisson sampling, whose amplification
  needs the cohort hidden from model observers) the rounds hold none of :data:`COHORT_FIELDS`
  (bytes, ``clients``, ``failures``, ``wall_s``, ``round_s``): each is a function of the secret
  coins. They go to ``outside_guarantee`` (``secret_cohort_clients``, ...) with
  ``privacy.diagnostics=true``; ``final`` then has no ``failures`` and no byte size, and
  ``outside_guarantee.final`` has ``secret_cohort_upload_bytes_per_client`` (a successful train
  reply's mean size, rounded to 1 kB) and ``secret_cohort_download_bytes_per_client``;
  ``privacy.total.not_covered`` names what still depends on the cohorts (the total wall time, the
  status). ``run.log`` withholds the rounds' durations and the lines about failed clients.
* ``privacy.randomness``: whether the privacy noise and secret cohorts were
  seeded (reproducible from the published configuration: the epsilon then
  describes a deployment where they are secret) or drawn from OS entropy.
* ``outside_guarantee``: statistics computed from un-noised client data
  (e.g. DP-FedAvg's update norms), which no epsilon covers. Written only with
  ``privacy.diagnostics=true`` in a simulation, never on real devices, never
  in ``rounds``, ``metrics.csv`` or ``run.log``.

Also written: ``metrics.csv`` and ``rounds.jsonl`` (one row / JSON line per round, appended as
the run goes),
``accuracy_loss.png``, ``epsilon.png``, ``final_model.npz`` (arrays plus the
model spec), ``config.yaml``, ``run.log`` and, for a private run (one with an accountant),
``privacy_ledger.json`` (the accountant's events), with a stage's own ledger beside it (a DP text
vocabulary's ``privacy_ledger_vocabulary.json``, whose release ``privacy.vocabulary`` describes).
"""

from __future__ import annotations

import copy
import csv
import io
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord

from fl_app.config.settings import RunSettings
from fl_app.data.federated import describe_client
from fl_app.learning.model_spec import ModelSpec
from fl_app.privacy.accountant import LEDGER_FILE
from fl_app.report.tracking import RoundTracker
from fl_app.run.code_version import code_version
from fl_app.run.files import UndatedFiles, write_atomically, writing
from fl_app.run.lifecycle import diverged

if TYPE_CHECKING:
    from matplotlib.axes import Axes

SCHEMA_VERSION = 1
#: Per-round fields that are functions of the round's cohort. With a secret cohort (amplification by
#: sampling) they are not published: they go to ``outside_guarantee`` as ``secret_cohort_<field>``.
COHORT_FIELDS = (
    "upload_bytes",
    "download_bytes",
    "upload_array_bytes",
    "download_array_bytes",
    "clients",
    "failures",
    "wall_s",
    "round_s",
    "evaluate_upload_bytes",
    "evaluate_download_bytes",
)
OUTSIDE_GUARANTEE_NOTE = (
    "NOT covered by any epsilon of this run: computed from un-noised client data (simulation-only "
    "diagnostics, privacy.diagnostics=true); do not publish them with the model"
)
RESULTS_FILE = "results.json"
METRICS_FILE = "metrics.csv"
#: One JSON line per round, appended as the run goes (a checkpoint counts them, see RunRecorder.state).
ROUNDS_FILE = "rounds.jsonl"
MODEL_FILE = "final_model.npz"


def json_safe(value: Any) -> Any:
    """Convert numpy scalars/arrays and non-finite floats (to ``None``) for strict JSON."""
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, np.ndarray):
        return [json_safe(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: Path, data: Any, *, files: UndatedFiles | None = None) -> None:
    """Write strict JSON atomically (temporary file, then rename; ``files``: as they rewrite it)."""
    text = (json.dumps(json_safe(data), indent=2, allow_nan=False) + "\n").encode()
    if files is None:
        write_atomically(path, text)
    else:
        files.rewrite(path, text)


def save_model(path: Path, arrays: ArrayRecord, spec: ModelSpec) -> None:
    """Save the final global model: its arrays and the spec to rebuild it."""
    payload = {name: array.numpy() for name, array in arrays.items()}
    np.savez(path, __model_spec__=np.array(spec.to_json()), **payload)


def load_model_arrays(path: Path) -> tuple[ModelSpec, dict[str, np.ndarray]]:
    """Read a file written by :func:`save_model`."""
    with np.load(path) as archive:
        spec = ModelSpec.from_json(str(archive["__model_spec__"]))
        arrays = {name: archive[name] for name in archive.files if name != "__model_spec__"}
    return spec, arrays


def chance_accuracy(labels: np.ndarray, uncounted: tuple[int, ...] | None = None) -> float:
    """The accuracy of always predicting the most frequent label (the chance level of a split).

    Next-token targets (``uncounted``: the targets accuracy leaves out): the unigram baseline, always
    predicting the most frequent counted target.
    """
    if uncounted is not None:
        from fl_app.learning.sequence import NextToken

        return NextToken(tuple(uncounted)).baseline_accuracy(labels)
    counts = np.bincount(np.asarray(labels, dtype=np.int64))
    return float(counts.max() / counts.sum()) if counts.size else 0.0


def _csv_row(row: dict[str, Any], columns: list[str]) -> dict[str, Any]:
    return {k: ("" if row.get(k) is None else row.get(k)) for k in columns}


class RunRecorder:
    """Collects per-round records and writes the run's files."""

    def __init__(
        self,
        output_dir: Path,
        settings: RunSettings,
        *,
        diagnostics: bool = False,
        tracker: RoundTracker | None = None,
        secret_cohort: bool = False,
    ) -> None:
        self.output_dir = output_dir
        #: The files the rounds write; with a secret cohort all created before round 1 (UndatedFiles).
        self.files = UndatedFiles(active=secret_cohort)
        self.settings = settings
        self.tracker = tracker  # gets exactly the rounds' records (fl_app.report.tracking)
        self.rounds: list[dict[str, Any]] = []
        self.initial: dict[str, Any] = {}
        self.diagnostics = diagnostics
        self.outside: list[dict[str, Any]] = []
        #: The run's statistics outside the guarantee (``outside_guarantee.final``).
        self.outside_final: dict[str, Any] = {}
        self.stopped: dict[str, Any] | None = None
        #: How the rounds ran (``engine``: :mod:`fl_app.run.round_path`), once the run has begun.
        self.engine: dict[str, Any] | None = None
        #: Failed train replies over the run (published as ``final.failures`` unless the cohorts are secret).
        self.failures = 0
        self._columns: list[str] = []  # metrics.csv's header
        #: Read when the run starts, not when it ends (code edited during a long run is not what ran);
        #: cached per process, whose modules were imported once.
        self.code = code_version()
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "config.yaml").write_text(settings.to_yaml())

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of the results so far.

        The rounds' records are in ``rounds.jsonl`` (appended as the run goes); the checkpoint keeps
        their number only, so that its size does not grow with the rounds.
        """
        return {
            "rounds_recorded": len(self.rounds),
            "initial": dict(self.initial),
            "outside": list(self.outside),
            "failures": self.failures,
        }

    def restore(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state` (a resumed run)."""
        if "rounds" in state:  # a checkpoint of an earlier version kept the records themselves
            self.rounds = list(state["rounds"])
        else:
            lines = (self.output_dir / ROUNDS_FILE).read_text().splitlines()
            self.rounds = [json.loads(line) for line in lines[: int(state["rounds_recorded"])]]
        self.initial, self.outside = dict(state["initial"]), list(state["outside"])
        self.failures = int(state.get("failures", 0))
        # both files may hold a round recorded after the checkpoint's: back to the checkpoint's
        text = "".join(json.dumps(row, allow_nan=False) + "\n" for row in self.rounds)
        self.files.cut_back(self.output_dir / ROUNDS_FILE, text.encode())
        self._rewrite_metrics(cut_back=True)

    def prepare_files(self) -> None:
        """Before round 1: create the files the rounds append to and rewrite (secret cohort: see files)."""
        self.files.prepare(self.output_dir / ROUNDS_FILE)  # appended, and rewritten by a resume
        self.files.prepare(self.output_dir / METRICS_FILE)

    def add_initial(self, values: dict[str, Any]) -> None:
        """The initial model's evaluation (round 0)."""
        self.initial = dict(values)
        if self.tracker is not None:
            self.tracker.log_round({"round": 0, **self.initial})

    def add_round(self, record: dict[str, Any]) -> None:
        """Append one round to the records and to ``metrics.csv``; hand it to the tracker.

        ``metrics.csv`` gets one appended row per round (rewriting it whole every round made a long
        run's writes grow with the square of its rounds); it is rewritten only when a round brings a
        new column, and after a resume (:meth:`restore`).
        """
        self.rounds.append(json_safe(record))
        if self.tracker is not None:
            self.tracker.log_round(self.rounds[-1])
        row = self.rounds[-1]
        journal = self.output_dir / ROUNDS_FILE
        self.files.appendable(journal)
        with writing(journal), journal.open("a") as stream:
            stream.write(json.dumps(row, allow_nan=False) + "\n")
        path = self.output_dir / METRICS_FILE
        if self._columns and set(row) <= set(self._columns):
            with writing(path), path.open("a", newline="") as stream:
                csv.DictWriter(stream, fieldnames=self._columns).writerow(_csv_row(row, self._columns))
            return
        self._rewrite_metrics()

    def _rewrite_metrics(self, *, cut_back: bool = False) -> None:
        columns: list[str] = []
        for row in self.rounds:
            columns += [key for key in row if key not in columns]
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=columns)
        writer.writeheader()
        for row in self.rounds:
            writer.writerow(_csv_row(row, columns))
        write = self.files.cut_back if cut_back else self.files.rewrite
        write(self.output_dir / METRICS_FILE, text.getvalue().encode())
        self._columns = columns

    def add_diagnostics(self, server_round: int, values: dict[str, Any]) -> None:
        """Keep a round's statistics outside the guarantee (dropped unless ``diagnostics``)."""
        if self.diagnostics and values:
            self.outside.append(json_safe({"round": server_round, **values}))

    def add_final_diagnostics(self, values: dict[str, Any]) -> None:
        """Keep the run's statistics outside the guarantee (dropped unless ``diagnostics``)."""
        if self.diagnostics:
            self.outside_final.update(json_safe(values))

    def finalize(
        self,
        *,
        strategy: str,
        status: str = "completed",
        privacy: dict[str, Any],
        final_extras: dict[str, Any],
        arrays: ArrayRecord | None,
        model_spec: ModelSpec,
        ledger: dict[str, Any] | None,
        wall_s: float,
    ) -> dict[str, Any]:
        """Write results.json, the plots, the model and the privacy ledger; return the results."""
        results = {
            "schema": SCHEMA_VERSION,
            "status": status,
            "code": self.code,
            "strategy": strategy,
            "dataset": self.settings.dataset,
            "partition": describe_partition(self.settings.data.partition),
            "client": describe_client(self.settings.data),
            "config": copy.deepcopy(dict(self.settings.config)),
            "initial": self.initial,
            "rounds": self.rounds,
            "final": self._final_summary(final_extras, wall_s=wall_s),
            "privacy": privacy,
        }
        if self.engine is not None:
            results["engine"] = self.engine
        if self.stopped is not None:
            results["stopped"] = self.stopped
        if self.diagnostics:
            results["outside_guarantee"] = {"note": OUTSIDE_GUARANTEE_NOTE, "rounds": self.outside}
            if self.outside_final:
                results["outside_guarantee"]["final"] = self.outside_final
        if arrays is not None:
            save_model(self.output_dir / MODEL_FILE, arrays, model_spec)
        if ledger is not None:
            write_json(self.output_dir / LEDGER_FILE, ledger)
        self.plot(unit=str(privacy.get("unit", "client")), status=status)
        write_json(self.output_dir / RESULTS_FILE, results)
        if self.tracker is not None:
            self.tracker.log_results(results, self.output_dir)
            self.tracker.close()
        return results

    def _final_summary(self, final_extras: dict[str, Any], *, wall_s: float) -> dict[str, Any]:
        """results.json's ``final``: the last evaluation, the best round, the epsilon spent, divergence."""
        evaluated = [r for r in self.rounds if r.get("accuracy") is not None]
        last = self.rounds[-1] if self.rounds else {}
        best = max(evaluated, key=lambda r: r["accuracy"]) if evaluated else None
        final = {
            "accuracy": evaluated[-1]["accuracy"] if evaluated else None,
            "loss": evaluated[-1]["loss"] if evaluated else None,
            "evaluated_on": self.settings.evaluation.split,
            # read on the evaluation split: a description of the curve, not a model to pick (picking
            # the best round by test accuracy would tune on the test split)
            "best_accuracy": best["accuracy"] if best else None,
            "best_round": best["round"] if best else None,
            "epsilon": last.get("epsilon"),
            "delta": self.settings.privacy.delta,
            "wall_s": wall_s,
            "rounds": len(self.rounds),
            **final_extras,
        }
        # an evaluated round without a loss had a NaN or infinite one (strict JSON holds neither)
        final_loss = math.nan if evaluated and final["loss"] is None else final["loss"]
        final["diverged"] = diverged(self.initial.get("loss"), final_loss)
        return final

    def plot(self, *, unit: str = "client", status: str = "completed") -> None:
        """accuracy_loss.png and epsilon.png from the rounds so far.

        Round 0 is the initial model; rounds are integers; an epsilon plot names its unit and
        shows the configured budget (``privacy.epsilon``) as a line when it is a total budget.
        A non-private run's epsilon.png says so instead of drawing empty axes.
        """
        import matplotlib

        matplotlib.use("Agg")
        self._plot_accuracy_loss(status)
        self._plot_epsilon(unit)

    def _plot_accuracy_loss(self, status: str) -> None:
        """accuracy_loss.png: accuracy and loss of every evaluated round, round 0 the initial model."""
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator

        evaluated = [r for r in self.rounds if r.get("accuracy") is not None]
        points = [(0, self.initial)] if self.initial.get("accuracy") is not None else []
        points += [(r["round"], r) for r in evaluated]
        figure, left = plt.subplots(figsize=(6.4, 4))
        rounds = [t for t, _ in points]
        accuracy = left.plot(rounds, [r["accuracy"] for _, r in points], "o-", color="tab:blue", ms=3)
        left.set_xlabel("round (0: initial model)")
        left.set_ylabel("test accuracy", color="tab:blue")
        left.xaxis.set_major_locator(MaxNLocator(integer=True))
        right = left.twinx()
        loss = right.plot(rounds, [r["loss"] for _, r in points], "s--", color="tab:red", ms=3)
        right.set_ylabel("test loss", color="tab:red")
        left.legend(accuracy + loss, ["accuracy", "loss"], loc="center right", fontsize=8)
        suffix = "" if status == "completed" else f" ({status})"
        left.set_title(f"{self.settings.strategy} on {self.settings.dataset}{suffix}")
        figure.tight_layout()
        figure.savefig(self.output_dir / "accuracy_loss.png", dpi=110)
        plt.close(figure)

    def _plot_epsilon(self, unit: str) -> None:
        """epsilon.png: the cumulative epsilon of every round, or a note that the run is not private."""
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(6.4, 4))
        private = [r for r in self.rounds if r.get("epsilon") is not None]
        if private:
            self._draw_epsilon(axis, private, unit)
        else:
            axis.set_axis_off()
            axis.text(
                0.5,
                0.5,
                f"{self.settings.strategy}: not private\n(no finite epsilon: nothing to plot)",
                ha="center",
                va="center",
                transform=axis.transAxes,
            )
        figure.tight_layout()
        figure.savefig(self.output_dir / "epsilon.png", dpi=110)
        plt.close(figure)

    def _draw_epsilon(self, axis: Axes, private: list[dict[str, Any]], unit: str) -> None:
        """The epsilon curves (headline and secondary accountants) and the total budget, on ``axis``."""
        from matplotlib.ticker import MaxNLocator

        delta = self.settings.privacy.delta
        spent = [r["epsilon"] for r in private]
        axis.plot([r["round"] for r in private], spent, "o-", ms=3, label=f"spent per {short_unit(unit)}")
        for key, label in SECONDARY_EPSILONS.items():
            values = [r.get(key) for r in private]
            if all(v is not None for v in values):
                axis.plot([r["round"] for r in private], values, "^:", ms=3, label=label)
        if self.settings.privacy.budget_scope == "total":
            target = self.settings.privacy.epsilon
            axis.axhline(target, color="tab:gray", ls="--", lw=1, label=f"privacy.epsilon = {target:g}")
        axis.set_xlabel("round")
        axis.set_ylabel(f"cumulative epsilon (delta = {delta:g})")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        legend_at = "lower right"
        if max(spent) > 50 * self.settings.privacy.epsilon:
            axis.set_yscale("log")  # a headline epsilon far above a target stated in another unit
            legend_at = "center right"
        else:
            axis.set_ylim(bottom=0)
        axis.legend(fontsize=8, loc=legend_at)
        axis.set_title(f"{self.settings.strategy}: privacy spent per {short_unit(unit)}", fontsize=10)


#: Per-round epsilons in a second unit that a strategy may calibrate for, plotted beside the headline.
SECONDARY_EPSILONS = {"epsilon_per_coordinate": "spent per weight coordinate (the document's unit)"}


def short_unit(unit: str) -> str:
    """The privacy unit's noun: the first of the known nouns in the unit's text.

    ``one client's entire data set`` -> ``client``; ``one training example of a federated client`` ->
    ``example``.
    """
    text = unit.lower().split("(")[0]
    nouns = ("client", "record", "report", "example", "label", "coordinate")
    found = [(text.find(word), word) for word in nouns]
    found = [(index, word) for index, word in found if index >= 0]
    return min(found)[1] if found else unit.split("(")[0].strip() or "unit"


def describe_partition(partition: Mapping[str, Any]) -> str:
    """Short text such as ``dirichlet(alpha=0.5)`` or ``iid`` (``partition``: the partition group)."""
    options = {
        k: v for k, v in partition.items() if k not in ("name", "min_partition_size", "self_balancing")
    }
    inner = ", ".join(f"{k}={v}" for k, v in options.items())
    return f"{partition['name']}({inner})" if inner else str(partition["name"])


def write_unstarted_results(output_dir: Path, settings: RunSettings, *, status: str, reason: str) -> None:
    """``results.json`` of a run that ended before its first round: nothing ran, nothing was released.

    The same required fields as a run's (a report lists it as ended before its first round), no rounds,
    and ``stopped`` saying why; a new run into ``output_dir`` reuses the folder.
    """
    write_json(
        output_dir / RESULTS_FILE,
        {
            "schema": SCHEMA_VERSION,
            "status": status,
            "code": code_version(),
            "strategy": settings.strategy,
            "dataset": settings.dataset,
            "partition": describe_partition(settings.data.partition),
            "config": copy.deepcopy(dict(settings.config)),
            "rounds": [],
            "final": {"rounds": 0},
            "privacy": {"released": "nothing: no round ran"},
            "stopped": {"reason": reason, "after_round": 0},
        },
    )
