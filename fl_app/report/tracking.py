"""Optional experiment tracking: TensorBoard, MLflow and Weights & Biases, beside the run's own files.

``tracking=tensorboard``, ``tracking=mlflow``, ``tracking=wandb``, or several at once
(``tracking=[tensorboard,mlflow]``); off by default (``tracking=none``). Every tracker gets exactly
what the run's results publish (docs/tracking.md):

* each round's record as ``metrics.csv`` has it (test accuracy and loss of the released global model,
  the accountant's epsilon, bytes, clients, round time and the strategy's per-round fields), the round
  as the step, the initial model as step 0;
* the resolved configuration (TensorBoard: as text; MLflow and W&B: as the run's parameters);
* MLflow and W&B: the final results (``results.json``'s ``final`` and the total epsilon), the status,
  and the run's files (``results.json``, ``metrics.csv``, ``config.yaml``, the plots);
* every tracker, with the final results: when the epsilon is a simulated deployment's, not the run's
  (``strategy.noise_cohort_size``), the sentence that says so (``privacy.total.holds_for``: TensorBoard's
  ``final`` text, an MLflow tag, a W&B summary field).

Statistics outside the guarantee (``privacy.diagnostics``) are never tracked as metrics: they exist
only in ``results.json``'s marked ``outside_guarantee`` block. A run whose cohorts are secret also gives
its trackers no clock time that varies with a round: TensorBoard's events and MLflow's metrics all
carry the moment the tracker was made (before round 1), and W&B, which stamps every row with its own
clock, gets the whole run at its end (:mod:`fl_app.report.tracking_wandb`).

A tracker that fails during a run (a full disk, a locked store) is dropped with one warning line; the
run and its own files go on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from logging import WARNING
from pathlib import Path
from typing import Any, Protocol

from flwr.common import log

from fl_app.config.settings import TrackerSettings, tracker_names
from fl_app.report.tracking_common import TrackedRun, epsilon_holds_for, final_values, scalars

#: The trackers ``tracking`` names (``none``: no tracker).
TRACKERS = ("none", "tensorboard", "mlflow", "wandb")
#: The directory, inside the run's output directory, that TensorBoard's files go to.
TENSORBOARD_DIR = "tensorboard"
#: The package each tracker needs, and how to install it.
PACKAGES = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "mlflow": ("mlflow", "pip install mlflow-skinny (or mlflow, which also has mlflow ui)"),
    "wandb": ("wandb", "pip install wandb"),
}
#: The W&B modes ``tracker.wandb_mode`` accepts.
WANDB_MODES = ("offline", "online")


class RoundTracker(Protocol):
    """Where per-round records and the final results go beside ``metrics.csv``."""

    def log_round(self, record: dict[str, Any]) -> None:
        """Log one round's record (its ``round`` is the step)."""

    def log_results(self, results: dict[str, Any], output_dir: Path) -> None:
        """Log the final results and the run's files (after they are written)."""

    def close(self) -> None:
        """Flush and close."""


def tracker_available(name: str) -> str | None:
    """None when ``tracking=name`` can run here, else what is missing (one sentence)."""
    if name not in PACKAGES:
        return None
    module, install = PACKAGES[name]
    try:
        __import__(module)
    except ImportError:
        return f"needs the {module} package, which is not installed: {install}"
    return None


class TensorBoardTracker:
    """Round records as TensorBoard scalars (one tag per field, the round as the step)."""

    def __init__(self, log_dir: Path, *, config_text: str, constant_wall_time: bool = False) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir))
        #: The wall time every event gets (None: the time it is logged).
        self.wall_time = time.time() if constant_wall_time else None
        self.writer.add_text("config", f"```\n{config_text}\n```", walltime=self.wall_time)

    def log_round(self, record: dict[str, Any]) -> None:
        """Add every finite numeric field of ``record`` at step ``record["round"]``."""
        step = int(record["round"])
        for key, value in scalars(record).items():
            self.writer.add_scalar(key, value, step, walltime=self.wall_time)
        self.writer.flush()

    def log_results(self, results: dict[str, Any], output_dir: Path) -> None:
        """The final results as text (the curves are the rounds' scalars)."""
        lines = [f"{key}: {value:g}" for key, value in final_values(results).items()]
        holds_for = epsilon_holds_for(results)
        lines += [f"privacy.total.holds_for: {holds_for}"] if holds_for else []
        text = "\n".join([f"status: {results.get('status')}", *lines])
        self.writer.add_text("final", f"```\n{text}\n```", walltime=self.wall_time)

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


class Trackers:
    """Several trackers as one; a tracker that raises is dropped with one warning line, the run goes on."""

    def __init__(self, trackers: dict[str, RoundTracker]) -> None:
        self.trackers = dict(trackers)

    def _each(self, method: str, *args: Any) -> None:
        for name, tracker in list(self.trackers.items()):
            try:
                getattr(tracker, method)(*args)
            except Exception as error:  # a tracker's store failed: its run's own files go on
                del self.trackers[name]
                _dropped(name, error)

    def log_round(self, record: dict[str, Any]) -> None:
        """Each tracker's :meth:`RoundTracker.log_round`."""
        self._each("log_round", record)

    def log_results(self, results: dict[str, Any], output_dir: Path) -> None:
        """Each tracker's :meth:`RoundTracker.log_results`."""
        self._each("log_results", results, output_dir)

    def close(self) -> None:
        """Close each tracker."""
        self._each("close")


def _dropped(name: str, error: Exception) -> None:
    """One warning line for a tracker that failed (the run goes on without it)."""
    text = " ".join(str(error).split())[:300]
    log(WARNING, "dpfl: tracking=%s stopped (%s: %s); the run goes on", name, type(error).__name__, text)


def make_tracker(
    name: str | Sequence[str],
    output_dir: Path,
    *,
    config_text: str,
    secret_cohort: bool = False,
    run: TrackedRun | None = None,
) -> RoundTracker | None:
    """The trackers ``tracking=name`` asks for (one name or several, as one), or None for ``none``.

    ``secret_cohort``: the run's cohorts are secret; its trackers get no clock time that varies.
    ``run``: the run's name, configuration and tracker settings (MLflow and W&B need them).
    """
    names = tracker_names(name)
    if not names:
        return None
    unknown = [item for item in names if item not in TRACKERS]
    if unknown:
        raise ValueError(f"unknown tracker {unknown[0]!r} (known: {', '.join(TRACKERS)})")
    run = run or TrackedRun(name=output_dir.name, config={}, settings=TrackerSettings())
    made: dict[str, RoundTracker] = {}
    for item in names:
        try:
            made[item] = _make_one(item, output_dir, config_text, secret_cohort, run)
        except Exception as error:  # an unreachable store: the run and its own files go on
            _dropped(item, error)
    return Trackers(made)


def _make_one(name: str, output_dir: Path, config_text: str, secret: bool, run: TrackedRun) -> RoundTracker:
    if name == "tensorboard":
        return TensorBoardTracker(
            output_dir / TENSORBOARD_DIR, config_text=config_text, constant_wall_time=secret
        )
    if name == "mlflow":
        from fl_app.report.tracking_mlflow import MlflowTracker

        return MlflowTracker(output_dir, run, constant_time=secret)
    from fl_app.report.tracking_wandb import WandbTracker

    return WandbTracker(output_dir, run, at_the_end=secret)
