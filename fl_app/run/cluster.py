"""Sweeps on a cluster scheduler: Hydra's launchers, checked before anything starts, and their jobs' ends.

``python -m fl_app -m ... hydra/launcher=submitit_slurm`` submits every job of a sweep to Slurm through
Hydra's submitit launcher plugin (``hydra-submitit-launcher``); ``hydra/launcher=submitit_local`` runs
the same code path on this machine (each job in its own process, all at once). The command waits for the
jobs; each job writes its run into its directory of the sweep as with any launcher, and its console
output goes to ``<sweep dir>/.submitit/<job id>/<job id>_0_log.err`` (docs/cluster.md). The command
prints one line per job as it collects it, with how its run ended (:func:`job_end_line`); Ctrl-C stops
every job through the sweep's stop file (the local jobs run in sessions of their own:
:func:`fl_app.engine.hydra.submitit_jobs_reported`).

This module checks ``hydra/launcher=`` with the rest of the command (:func:`launcher_error`: a name no
installed plugin provides, or Slurm's launcher where Slurm's commands are missing, is one line) and
reports a submitit job that left no result (killed, out of memory, past its time limit) as a failed job
of the sweep with its log file, instead of Hydra's traceback (:func:`jobs_reported`). Running the same
command again into the same ``hydra.sweep.dir`` continues the sweep (:mod:`fl_app.run.sweep_resume`): the
completed jobs are skipped, a killed one resumes from its last checkpoint.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from fl_app.config.checks import ConfigError
from fl_app.run.output_claim import read_results

#: The launcher key on the command line.
LAUNCHER_KEY = "hydra/launcher"
#: Hydra's submitit launchers (``hydra-submitit-launcher``).
SUBMITIT_LAUNCHERS = ("submitit_local", "submitit_slurm")
#: Slurm's commands that the submitit Slurm launcher runs.
SLURM_COMMANDS = ("sbatch", "srun")
#: The words of a failure line that mark a job that left no result (:func:`jobs_reported`).
NO_RESULT = "ended without a result"


class FailureLog(Protocol):
    """Where a sweep's failed jobs are kept (``fl_app.__main__.SweepState``)."""

    def record_failure(self, line: str) -> None:
        """Keep one failed job's line."""

    def failures(self) -> list[str]:
        """Every failed job's line so far."""

    def note_sweep_dir(self, directory: Path) -> None:
        """Remember the sweep's directory (named in the line that says how to continue the sweep)."""


def chosen_launcher(overrides: Sequence[str]) -> str | None:
    """The launcher ``hydra/launcher=NAME`` chooses (the last one given), or None."""
    names = [item.split("=", 1)[1] for item in overrides if item.split("=", 1)[0] == LAUNCHER_KEY]
    return names[-1] if names else None


def launcher_error(overrides: Sequence[str], *, multirun: bool) -> ConfigError | None:
    """Why the command's ``hydra/launcher=`` cannot run here (None: it can, or none is chosen).

    The name must be a launcher Hydra finds (its own ``basic`` or an installed plugin's); the submitit
    launchers only run a sweep (``-m``); ``submitit_slurm`` needs Slurm's ``sbatch`` and ``srun``.
    """
    name = chosen_launcher(overrides)
    if name is None:
        return None
    from fl_app.engine.hydra import launcher_names

    known = launcher_names()
    if name not in known:
        return ConfigError(LAUNCHER_KEY, name, f"must be one of {', '.join(known)} (docs/cluster.md)")
    if name in SUBMITIT_LAUNCHERS and not multirun:
        return ConfigError(
            LAUNCHER_KEY, name, "launches the jobs of a sweep: add -m (python -m fl_app -m ...)"
        )
    missing = [command for command in SLURM_COMMANDS if shutil.which(command) is None]
    if name == "submitit_slurm" and missing:
        return ConfigError(
            LAUNCHER_KEY,
            name,
            f"needs Slurm's {' and '.join(missing)} on PATH, not found on this machine: run the command "
            "on the cluster's login node, or hydra/launcher=submitit_local to run the same path here",
        )
    return None


@contextmanager
def jobs_reported(argv: Sequence[str], log: FailureLog | None) -> Iterator[None]:
    """While a submitit launcher waits: each job's end is one line, a job that left no result a failure.

    ``log`` keeps the failures for the sweep's summary (a job that failed in its run recorded its own
    line already when it could reach ``log``'s files; it is not counted twice). Outside a submitit
    launcher this does nothing.
    """
    if chosen_launcher(argv) not in SUBMITIT_LAUNCHERS:
        yield
        return
    from fl_app.engine.hydra import submitit_jobs_reported

    def failed(line: str, sweep_dir: Path | None) -> None:
        print(f"error: {line}", file=sys.stderr, flush=True)
        if log is not None and line not in log.failures():
            log.record_failure(line)
            if sweep_dir is not None:  # the jobs note it where they reach this process's files, not on nodes
                log.note_sweep_dir(sweep_dir)

    def done(name: str, log_file: Path, output_dir: Any) -> None:
        print(f"dpfl sweep: {job_end_line(name, log_file, output_dir)}", file=sys.stderr, flush=True)

    with submitit_jobs_reported(failed, done):
        yield


def job_end_line(name: str, log_file: Path, output_dir: Any) -> str:
    """How a submitit job that returned ended: its status and results, as its run's results.json says.

    ``output_dir``: what the job returned (its output directory; None: it ran no run, the sweep having
    been stopped before it began). An interrupted job's line says after which round; the sweep's last
    line says how to continue it.
    """
    log = f"its log: {log_file}"
    if not isinstance(output_dir, str):
        return f"job {name} ran nothing: the sweep was stopped before it began ({log})"
    results = read_results(Path(output_dir))
    if results is None:
        return f"job {name} ended without results in {output_dir} ({log})"
    status = str(results.get("status"))
    after = (results.get("stopped") or {}).get("after_round")
    when = f" after round {after}" if status in ("interrupted", "failed") and after is not None else ""
    return f"job {name} {status}{when}: results in {output_dir} ({log})"


def left_no_result(failures: Sequence[str]) -> bool:
    """Whether any of a sweep's failure lines is a job that left no result (one to continue)."""
    return any(NO_RESULT in line for line in failures)
