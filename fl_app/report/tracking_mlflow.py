"""``tracking=mlflow``: the run as an MLflow run, through MLflow's client API (``mlflow-skinny`` suffices).

The store is ``tracker.mlflow_uri``; by default ``MLFLOW_TRACKING_URI``, else MLflow's own default, the
SQLite file ``mlflow.db`` in the directory the command runs in, with the artifacts beside it in
``mlartifacts``: every run and every sweep started there goes to one store, and ``mlflow ui`` in that
directory shows them all (the full ``mlflow`` package; ``mlflow-skinny`` has no UI). A new SQLite store
takes MLflow 5-10 s to create (its schema migrations), once. Writes to a local store are serialised
with a lock file beside it, so the parallel jobs of a sweep share it safely.

An MLflow run gets the resolved configuration as its parameters (dotted keys), each round's record as
metrics (the round as the step), and at the end ``final.*`` and ``privacy.total.epsilon`` as metrics,
the status, unit and mechanism (and ``privacy.total.holds_for``, when the epsilon is a simulated
deployment's) as tags, and the run's files as artifacts. With a secret cohort every
metric carries one timestamp, the moment the tracker was made, and the rounds' metrics are written to
the store when the run ends, not as they come: a file store creates a metric's file when the metric is
first logged (``epsilon`` at round 1), and its creation time would date that round. A resumed run
continues its MLflow run (its id is kept in ``<output dir>/mlflow_run.json``).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from fl_app.report.tracking_common import (
    RUN_FILES,
    TrackedRun,
    epsilon_holds_for,
    final_values,
    flatten,
    scalars,
)

#: The file, in the run's output directory, that names its MLflow run (for a resumed run).
RUN_ID_FILE = "mlflow_run.json"
#: MLflow's limits: parameters and metrics per ``log_batch`` call, characters of a parameter's value.
MAX_PARAMS, MAX_METRICS, MAX_VALUE = 100, 1000, 6000
#: A run's status in MLflow, by dpfl's.
MLFLOW_STATUS = {"failed": "FAILED", "interrupted": "KILLED"}


def default_uri() -> str:
    """``MLFLOW_TRACKING_URI`` when set, else MLflow's own default: ``mlflow.db`` in the current directory.

    The directory's path is made absolute when the run starts, so a sweep's jobs share the store of
    the directory the sweep was started from.
    """
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd().resolve() / 'mlflow.db'}"


def store_of(uri: str | None) -> tuple[str, Path | None, str | None]:
    """The tracking URI, the lock file of a local store (None: a server), and a new experiment's artifacts.

    A SQLite store's artifacts go to ``mlartifacts`` beside its file.
    """
    uri = uri or default_uri()
    parsed = urlparse(uri)
    if parsed.scheme == "sqlite":  # sqlite:///relative.db or sqlite:////absolute.db
        database = Path(uri.removeprefix("sqlite:///"))
        database.parent.mkdir(parents=True, exist_ok=True)
        return uri, Path(f"{database}.lock"), _artifacts(database.parent)
    if parsed.scheme in ("", "file"):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it to use a folder
        folder = Path(parsed.path)
        folder.mkdir(parents=True, exist_ok=True)
        return uri, folder / ".dpfl.lock", None
    return uri, None, None


def _artifacts(directory: Path) -> str:
    return (directory.resolve() / "mlartifacts").as_uri()


def param_text(value: Any) -> str:
    """A configuration value as an MLflow parameter (JSON for what is not a string; MLflow's length)."""
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:MAX_VALUE]


class MlflowTracker:
    """One dpfl run as one MLflow run."""

    def __init__(self, output_dir: Path, run: TrackedRun, *, constant_time: bool = False) -> None:
        from mlflow.tracking import MlflowClient

        self.output_dir = output_dir
        self.uri, self.lock_file, artifacts = store_of(run.settings.mlflow_uri)
        #: The timestamp (ms) of every metric, or None: the time it is logged.
        self.time_ms = int(time.time() * 1000) if constant_time else None
        #: The rounds' metrics (key, value, timestamp, step) kept for the run's end (a secret cohort's run).
        self.pending: list[tuple[str, float, int, int]] = []
        self.finished = False
        # MLflow announces a new store's tables at INFO, and SQLAlchemy warns about MLflow's own code
        logging.getLogger("mlflow").setLevel(logging.WARNING)
        with self._locked(), warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            self.client = MlflowClient(tracking_uri=self.uri)
            experiment = self._experiment(run.settings.experiment, artifacts)
            self.run_id = self._continued(run) or self._created(experiment, run)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Hold the local store's lock file (nothing for a tracking server)."""
        if self.lock_file is None:
            yield
            return
        self.lock_file.parent.mkdir(parents=True, exist_ok=True)
        with self.lock_file.open("a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _experiment(self, name: str, artifacts: str | None) -> str:
        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return str(found.experiment_id)
        return str(self.client.create_experiment(name, artifact_location=artifacts))

    def _continued(self, run: TrackedRun) -> str | None:
        """The MLflow run of the run this one resumes (None: a new run, or another store)."""
        path = self.output_dir / RUN_ID_FILE
        if not run.resumed or not path.is_file():
            return None
        kept = json.loads(path.read_text())
        if kept.get("tracking_uri") != self.uri:
            return None
        self.client.update_run(kept["run_id"], status="RUNNING")
        return str(kept["run_id"])

    def _created(self, experiment: str, run: TrackedRun) -> str:
        from mlflow.entities import Param

        self.output_dir.mkdir(parents=True, exist_ok=True)
        tags = {"dpfl.output_dir": str(self.output_dir)}
        created = self.client.create_run(experiment, start_time=self.time_ms, tags=tags, run_name=run.name)
        run_id = str(created.info.run_id)
        params = [Param(key, param_text(value)) for key, value in sorted(flatten(run.config).items())]
        for start in range(0, len(params), MAX_PARAMS):
            self.client.log_batch(run_id, params=params[start : start + MAX_PARAMS])
        text = json.dumps({"tracking_uri": self.uri, "run_id": run_id})
        (self.output_dir / RUN_ID_FILE).write_text(text + "\n")
        return run_id

    def _metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        stamp = self.time_ms if self.time_ms is not None else int(time.time() * 1000)
        metrics = [Metric(key, value, stamp, step) for key, value in values.items()]
        with self._locked():
            for start in range(0, len(metrics), MAX_METRICS):
                self.client.log_batch(self.run_id, metrics=metrics[start : start + MAX_METRICS])

    def log_round(self, record: dict[str, Any]) -> None:
        """The round's finite numbers as metrics at step ``round`` (a secret cohort's: at the run's end)."""
        if self.time_ms is not None:
            stamp, step = self.time_ms, int(record["round"])
            self.pending += [(key, value, stamp, step) for key, value in scalars(record).items()]
            return
        self._metrics(scalars(record), int(record["round"]))

    def log_results(self, results: dict[str, Any], output_dir: Path) -> None:
        """The rounds' metrics kept so far, the final numbers, tags, the run's files; the run ends."""
        from mlflow.entities import Metric

        pending, self.pending = [Metric(*row) for row in self.pending], []
        with self._locked():
            for start in range(0, len(pending), MAX_METRICS):
                self.client.log_batch(self.run_id, metrics=pending[start : start + MAX_METRICS])
        self._metrics(final_values(results), len(results.get("rounds", [])))
        privacy = results.get("privacy", {})
        tags = {
            "dpfl.status": str(results.get("status")),
            "dpfl.strategy": str(results.get("strategy")),
            "dpfl.privacy.unit": str(privacy.get("unit", "")),
            "dpfl.privacy.mechanism": str(privacy.get("mechanism", "")),
        }
        if epsilon_holds_for(results):
            tags["dpfl.privacy.holds_for"] = str(epsilon_holds_for(results))
        with self._locked():
            for key, value in tags.items():
                self.client.set_tag(self.run_id, key, value[:MAX_VALUE])
            for name in RUN_FILES:
                if (output_dir / name).is_file():
                    self.client.log_artifact(self.run_id, str(output_dir / name))
            status = MLFLOW_STATUS.get(str(results.get("status")), "FINISHED")
            self.client.set_terminated(self.run_id, status=status)
        self.finished = True

    def close(self) -> None:
        """Nothing more to write (:meth:`log_results` ended the run)."""
