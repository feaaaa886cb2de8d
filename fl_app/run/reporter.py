"""After every round: check it, evaluate, meter, record, checkpoint and log (the round loop's hook).

:class:`RoundReporter` is what :func:`fl_app.run.round_loop.run_rounds` calls after each round (and the
run once before round 1). Its parts, each one job: :class:`RoundClock` (wall time over the run's
sessions), :class:`TrafficTotals` (a secret cohort's bytes, as sizes per client), :class:`ClientTally`
(who never contributed), :class:`Checkpointer` (the ledgers and the server's private state after a
completed round) and the results' :class:`~fl_app.run.results.RunRecorder`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from logging import INFO
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, MetricRecord
from flwr.common import log

from fl_app.engine.client_states import ClientStates
from fl_app.engine.metering import MeteredGrid
from fl_app.run.checkpoint import (
    CHECKPOINT_FILE,
    FILE_MODE,
    Checkpoint,
    CheckpointWriter,
    rng_states,
    save_checkpoint,
)
from fl_app.run.log import withheld_from_file
from fl_app.run.results import RunRecorder, write_json
from fl_app.run.round_loop import check_round
from fl_app.run.text import accuracy_text, epsilon_text, fmt, format_duration, interactive, progress_bar
from strategies.contract import Strategy
from strategies.reporting import RoundReport

#: A client selected for at least this many rounds that failed in every one of them never contributed:
#: the run then exits with status 1 (its results are written, ``completed_with_failures``).
SILENT_ROUNDS = 2


class RoundClock:
    """Wall time of a run over its sessions (a resumed run adds its earlier sessions' time)."""

    def __init__(self, started: float | None = None) -> None:
        #: When this session began (the run's first log line): ``wall_s`` counts from there.
        self.started = time.monotonic() if started is None else started
        self.last = time.monotonic()
        self.earlier_s = 0.0
        self.durations: list[float] = []

    def elapsed(self) -> float:
        """Seconds the run has taken so far (over all its sessions)."""
        return self.earlier_s + time.monotonic() - self.started

    def lap(self) -> float:
        """Seconds since the last lap (a round's duration); starts the next one."""
        now = time.monotonic()
        duration, self.last = now - self.last, now
        return duration

    def remaining(self, done: int, total: int) -> float:
        """The rounds left times the mean round so far."""
        return float(np.mean(self.durations)) * (total - done) if self.durations else 0.0


class TrafficTotals:
    """Bytes and messages of train rounds summed over a run, for sizes per client (:meth:`per_client`).

    The sizes are means over the secret cohorts' messages and replies, so they go to the
    diagnostics only: a mean over every reply would tell the share of failed clients, and even a
    mean over the successful replies can follow who replied (a reply's metrics, such as its example
    count, take more or fewer bytes).
    """

    #: Per-client sizes are rounded to this many bytes: a reply's serialised size can differ by a few
    #: bytes between clients (its metrics), and a published size must not depend on who replied.
    ROUNDING = 1000

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def add(self, traffic: dict[str, float]) -> None:
        """Add one round's counters (:meth:`fl_app.engine.metering.MeteredGrid.take`)."""
        for key in ("train_ok_upload_bytes", "train_ok_replies", "train_download_bytes", "train_messages"):
            self.totals[key] = self.totals.get(key, 0.0) + float(traffic.get(key, 0.0))

    def per_client(self) -> dict[str, int | None]:
        """``upload_bytes_per_client`` / ``download_bytes_per_client``: a train reply's and message's size.

        The upload is the mean over the replies that arrived with content (failed clients' error
        replies are neither summed nor counted); the download, over the train messages sent.
        """

        def size(total: str, count: str) -> int | None:
            if not self.totals.get(count):
                return None
            mean = self.totals[total] / self.totals[count]
            return int(round(mean / self.ROUNDING) * self.ROUNDING)

        return {
            "upload_bytes_per_client": size("train_ok_upload_bytes", "train_ok_replies"),
            "download_bytes_per_client": size("train_download_bytes", "train_messages"),
        }


class ClientTally:
    """Per client: the rounds it was selected for and failed in (never published)."""

    def __init__(self) -> None:
        #: Client id -> rounds it was selected for / failed in, over this session's rounds (a resumed
        #: run counts from its resume on).
        self.selected: Counter[int] = Counter()
        self.failed: Counter[int] = Counter()

    def tally(self, selected: Sequence[int], failed: Sequence[int]) -> None:
        """Count a round for each selected client, and a failure for each failed one."""
        self.selected.update(selected)
        self.failed.update(set(failed).intersection(selected))  # at most one failure a round

    def never_contributed(self) -> list[int]:
        """Clients selected in :data:`SILENT_ROUNDS` rounds or more that failed in every one of them."""
        silent = (
            c for c, rounds in self.selected.items() if rounds >= SILENT_ROUNDS and self.failed[c] == rounds
        )
        return sorted(silent)


class Checkpointer:
    """Writes the privacy ledgers and the checkpoint of each completed round (both atomically)."""

    def __init__(
        self,
        strategy: Strategy,
        recorder: RunRecorder,
        clock: RoundClock,
        *,
        num_rounds: int,
        overrides: Sequence[str] = (),
        fingerprint: str = "",
        client_states: ClientStates | None = None,
    ) -> None:
        self.strategy, self.recorder, self.clock = strategy, recorder, clock
        self.num_rounds = num_rounds
        self.overrides = list(overrides)
        self.fingerprint = fingerprint
        self.client_states = client_states
        #: Why the run can never be resumed (then no checkpoint, the server's private state, is written).
        self.not_resumable: str | None = None
        self.writer = CheckpointWriter(recorder.files)

    def save(self, server_round: int, arrays: ArrayRecord) -> None:
        """The ledgers, then the checkpoint of ``server_round`` (a run that can be resumed).

        The checkpoint is written while the next round runs
        (:class:`~fl_app.run.checkpoint.CheckpointWriter`).
        """
        run = self.strategy.run
        for name, ledger in self.strategy.ledgers().items():
            write_json(run.output_dir / name, ledger, files=self.recorder.files)
        if self.not_resumable is not None:
            return
        checkpoint = Checkpoint(
            completed_round=server_round,
            num_rounds=self.num_rounds,
            status="incomplete" if server_round < self.num_rounds else "completed",
            overrides=self.overrides,
            fingerprint=self.fingerprint,
            arrays=arrays,
            strategy=self.strategy,
            recorder=self.recorder.state(),
            elapsed_s=self.clock.elapsed(),
            rng=rng_states(),
            client_states=self.client_states,
        )
        save_checkpoint(run.output_dir, checkpoint, run, writer=self.writer)

    def prepare_files(self) -> None:
        """Before round 1: the ledgers' and the checkpoint's spares (a secret cohort's run: see files)."""
        output_dir, files = self.strategy.run.output_dir, self.recorder.files
        for name in self.strategy.ledgers():
            files.prepare(output_dir / name)
        if self.not_resumable is None:
            files.prepare(output_dir / CHECKPOINT_FILE, mode=FILE_MODE)

    def settle(self) -> None:
        """Wait until the last checkpoint is written (``WriteFailed``: it could not be)."""
        self.writer.settle()


class RoundReporter:
    """The round loop's hook: check, evaluate, meter, record, checkpoint and log each round."""

    def __init__(
        self,
        strategy: Strategy,
        grid: MeteredGrid,
        recorder: RunRecorder,
        x_test: np.ndarray,
        y_test: np.ndarray,
        *,
        num_rounds: int,
        every: int,
        max_failure_fraction: float = 1.0,
        overrides: list[str] | None = None,
        fingerprint: str = "",
        started: float | None = None,
    ) -> None:
        self.strategy, self.grid, self.recorder = strategy, grid, recorder
        self.x_test, self.y_test = x_test, y_test
        self.num_rounds, self.every = num_rounds, every
        self.max_failure_fraction = max_failure_fraction
        self.clock = RoundClock(started)
        self.checkpointer = Checkpointer(
            strategy,
            recorder,
            self.clock,
            num_rounds=num_rounds,
            overrides=overrides or [],
            fingerprint=fingerprint,
            client_states=getattr(grid, "client_states", None),
        )
        self.completed_round = 0
        self.last_arrays: ArrayRecord | None = None
        #: Bytes and messages of the rounds whose cohort is secret (per-client sizes in ``final``).
        self.secret_traffic = TrafficTotals()
        self.clients = ClientTally()

    def elapsed(self) -> float:
        """Seconds the run has taken so far (over all its sessions)."""
        return self.clock.elapsed()

    def resume_after(self, completed_round: int, arrays: ArrayRecord, *, elapsed_s: float) -> None:
        """Continue counting after a checkpoint of ``completed_round``."""
        self.completed_round, self.last_arrays = completed_round, arrays
        self.clock.earlier_s = elapsed_s
        self.grid.take()
        self.clock.lap()

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Called before round 1 (round 0), then after every round (by the round loop)."""
        if server_round == 0:
            return self.initial(arrays)
        self.checkpointer.settle()  # the last round's checkpoint written before this round counts
        report = self.strategy.report_round(server_round)
        self.check(server_round, report)
        loss, accuracy = self.evaluate(server_round, arrays)
        record = self.record(server_round, report, loss=loss, accuracy=accuracy)
        self.completed_round, self.last_arrays = server_round, arrays
        self.checkpointer.save(server_round, arrays)
        self.log_round(server_round, record, secret_cohort=report.secret_cohort)
        metrics = (("accuracy", accuracy), ("loss", loss), ("epsilon", record["epsilon"]))
        return MetricRecord({k: float(v) for k, v in metrics if v is not None})

    def initial(self, arrays: ArrayRecord) -> MetricRecord:
        """Round 0: the initial model's accuracy and loss."""
        loss, accuracy = self.strategy.evaluate_global(arrays, self.x_test, self.y_test)
        self.recorder.add_initial({"accuracy": accuracy, "loss": loss})
        self.grid.take()
        self.clock.lap()
        self.last_arrays = arrays
        return MetricRecord({"accuracy": accuracy, "loss": loss})

    def check(self, server_round: int, report: RoundReport) -> None:
        """The failure rule: a round that breaks it is neither recorded nor checkpointed (it is repeated)."""
        check_round(
            server_round,
            clients=report.clients,
            failures=len(report.failures),
            reasons=list(report.failure_reasons),
            max_failure_fraction=self.max_failure_fraction,
            secret_cohort=report.secret_cohort,
        )

    def evaluate(self, server_round: int, arrays: ArrayRecord) -> tuple[float | None, float | None]:
        """Loss and accuracy of the global model, every ``evaluation.every`` rounds and at the last."""
        if server_round % self.every == 0 or server_round == self.num_rounds:
            return self.strategy.evaluate_global(arrays, self.x_test, self.y_test)
        return None, None

    def record(
        self, server_round: int, report: RoundReport, *, loss: float | None, accuracy: float | None
    ) -> dict[str, Any]:
        """The round's record, and its diagnostics (outside the guarantee).

        What depends on a secret cohort goes to the diagnostics only.
        """
        traffic = self.grid.take()
        round_s = self.clock.lap()
        self.clock.durations.append(round_s)
        record: dict[str, Any] = {"round": server_round, "accuracy": accuracy, "loss": loss}
        record.update(report.privacy_fields())
        cohort = cohort_fields(traffic, report, wall_s=self.clock.elapsed(), round_s=round_s)
        diagnostics = dict(report.diagnostics)
        self.recorder.failures += len(report.failures)
        self.clients.tally(report.selected, report.failures)
        if report.secret_cohort:
            # A secret cohort's size, failures, bytes and duration would tell model observers about
            # the coins amplification by sampling rests on: outside the guarantee only.
            self.secret_traffic.add(traffic)
            diagnostics = {f"secret_cohort_{key}": value for key, value in cohort.items()} | diagnostics
        else:
            record.update(cohort)
        record.update(report.extras)
        self.recorder.add_round(record)
        self.recorder.add_diagnostics(server_round, diagnostics)
        return record

    def log_round(self, server_round: int, record: dict[str, Any], *, secret_cohort: bool) -> None:
        """The round's line; with a secret cohort run.log gets it without the timing (it tells the size)."""
        total = self.num_rounds
        line = (
            f"dpfl round {server_round}/{total}: "
            f"{progress_bar(server_round, total) + ' ' if interactive() else ''}"
            f"accuracy {accuracy_text(record['accuracy'], record['loss'])}, loss {fmt(record['loss'])}, "
            f"{epsilon_text(record['epsilon'], self.strategy.run.settings.privacy.delta)}"
        )
        remaining = self.clock.remaining(server_round, total)
        timing = f" | elapsed {format_duration(self.elapsed())}, remaining ~{format_duration(remaining)}"
        log(INFO, "%s", line + timing, extra=withheld_from_file(line if secret_cohort else None))


def cohort_fields(
    traffic: dict[str, float], report: RoundReport, *, wall_s: float, round_s: float
) -> dict[str, Any]:
    """A round's fields that are functions of its cohort: bytes, clients, failures, times."""
    fields: dict[str, Any] = {
        "upload_bytes": int(traffic.get("train_upload_bytes", 0)),
        "download_bytes": int(traffic.get("train_download_bytes", 0)),
        "upload_array_bytes": int(traffic.get("train_upload_array_bytes", 0)),
        "download_array_bytes": int(traffic.get("train_download_array_bytes", 0)),
        "clients": report.clients,
        "failures": len(report.failures),
        "wall_s": wall_s,
        "round_s": round_s,
    }
    if traffic.get("evaluate_messages"):
        fields["evaluate_upload_bytes"] = int(traffic.get("evaluate_upload_bytes", 0))
        fields["evaluate_download_bytes"] = int(traffic.get("evaluate_download_bytes", 0))
    return fields
