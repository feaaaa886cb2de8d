"""``python -m fl_app [key=value ...]`` and ``python -m fl_app -m key=a,b ...``.

Single runs and Hydra multiruns (jobs run in sequence) of the Flower app as a
local Ray simulation. Before Hydra creates any directory, every job of the
command is composed and validated; a bad value prints one line naming the key,
the value and what is allowed, and the command exits with status 2. In a
multirun, a job that fails is reported and the others still run; the command
then exits with status 1.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fl_app.config.checks import ConfigError
from fl_app.config.compose import CONF_DIR, CONFIG_NAME, compose_config, is_hydra_override, sweep_params
from fl_app.config.settings import RunSettings
from fl_app.engine.hydra import sweep_fixed, sweep_jobs
from fl_app.engine.logs import colour_only_at_a_terminal
from fl_app.run.cluster import jobs_reported, left_no_result
from fl_app.run.lifecycle import (
    STOP_FILE_ENV,
    SWEEP_COMMAND_ENV,
    Outcome,
    RunFailed,
    command_stop_requested,
    sigterm_like_ctrl_c,
    stop_workers_on_signals,
)
from fl_app.run.output_claim import claim_output_dir
from fl_app.run.timeline import mark

# Hydra flags that take a value in the next argument.
_FLAGS_WITH_VALUE = {
    "--config-path",
    "-cp",
    "--config-name",
    "-cn",
    "--config-dir",
    "-cd",
    "--cfg",
    "-c",
    "--package",
    "-p",
    "--info",
    "-i",
    "--experimental-rerun",
}
_INFORMATIONAL = {
    "--help",
    "-h",
    "--hydra-help",
    "--cfg",
    "-c",
    "--info",
    "-i",
    "--version",
    "--shell-completion",
    "-sc",
    "--resolve",
}
_HYDRA_FILES = {".hydra", "main.log", "__main__.log"}


def split_command_line(argv: list[str]) -> tuple[list[str], bool, bool]:
    """Return (overrides, multirun?, informational?) from ``python -m fl_app`` arguments."""
    overrides: list[str] = []
    multirun = informational = False
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("-m", "--multirun"):
            multirun = True
        elif arg in _INFORMATIONAL:
            informational = True
            skip = arg in _FLAGS_WITH_VALUE
        elif arg in _FLAGS_WITH_VALUE:
            skip = True
        elif arg.startswith("-"):
            informational = informational or arg.split("=")[0] in _INFORMATIONAL
        else:
            overrides.append(arg)
    return overrides, multirun, informational


def expand_jobs(overrides: list[str], *, multirun: bool) -> list[list[str]]:
    """The override list of every job the command will run (sweeps expanded, as Hydra will)."""
    if not multirun:
        return [overrides]
    return sweep_jobs(sweep_params(sweep_fixed(overrides)), overrides)


#: Environment variable naming the sweep's state directory (set by :func:`main`, inherited by
#: the processes a parallel launcher such as ``hydra/launcher=joblib`` runs the jobs in).
SWEEP_STATE_ENV = "DPFL_SWEEP_STATE"


class SweepState:
    """Jobs done and jobs failed in this command's sweep, in files every job process appends to.

    Hydra's basic launcher runs the jobs in this process, one after another; a parallel launcher
    (``hydra/launcher=joblib``) runs them in other processes, where this process's variables are not
    seen. So the count, the start time and the failure lines live in a small directory named by
    :data:`SWEEP_STATE_ENV`; each append is one ``write`` of one short line (atomic on a local file
    system).
    """

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @classmethod
    def create(cls, total: int) -> SweepState:
        """A fresh state for ``total`` jobs, named in the environment for the job processes."""
        import os
        import tempfile

        directory = Path(tempfile.mkdtemp(prefix="dpfl-sweep-"))
        (directory / "total").write_text(str(total))
        (directory / "started").write_text(repr(time.time()))
        (directory / "owner").write_text(str(os.getpid()))
        os.environ[SWEEP_STATE_ENV] = str(directory)
        os.environ[STOP_FILE_ENV] = str(directory / "stop")
        return cls(directory)

    @classmethod
    def current(cls) -> SweepState | None:
        """The state :meth:`create` named in the environment (None outside ``python -m fl_app``)."""
        import os

        name = os.environ.get(SWEEP_STATE_ENV)
        return cls(Path(name)) if name and Path(name).is_dir() else None

    def runs_here(self) -> bool:
        """Whether this is the command's own process (a parallel launcher's workers are not)."""
        import os

        owner = self.directory / "owner"
        return not owner.exists() or owner.read_text() == str(os.getpid())

    @property
    def stop_file(self) -> Path:
        """The file whose presence stops every job (:data:`fl_app.run.lifecycle.STOP_FILE_ENV`)."""
        return self.directory / "stop"

    def _append(self, name: str, line: str) -> None:
        with (self.directory / name).open("a") as handle:
            handle.write(" ".join(line.split()) + "\n")

    def _lines(self, name: str) -> list[str]:
        path = self.directory / name
        return path.read_text().splitlines() if path.exists() else []

    def record_failure(self, line: str) -> None:
        """Remember a failed job's one-line report (printed again at the end)."""
        self._append("failed", line)

    def failures(self) -> list[str]:
        """Every failed job's line, in the order they failed."""
        return self._lines("failed")

    def job_finished(self) -> str | None:
        """Count one finished job; the progress line to print (None outside a sweep)."""
        from fl_app.run.text import format_duration, interactive, progress_bar

        self._append("done", "1")
        total = int((self.directory / "total").read_text())
        if total <= 1:
            return None
        done = len(self._lines("done"))
        elapsed = time.time() - float((self.directory / "started").read_text())
        remaining = elapsed / done * max(total - done, 0)
        failed = len(self.failures())
        failed_text = f" ({failed} failed)" if failed else ""
        bar = f"{progress_bar(done, total)} " if interactive() else ""
        return (
            f"dpfl sweep: {done}/{total} jobs done{failed_text}, {bar}"
            f"elapsed {format_duration(elapsed)}, remaining ~{format_duration(remaining)}"
        )

    def _job_file(self, overrides: list[str]) -> Path:
        run_overrides = [item for item in overrides if not is_hydra_override(item)]
        digest = hashlib.sha256(json.dumps(run_overrides).encode()).hexdigest()[:32]
        return self.directory / "jobs" / f"{digest}.pickle"

    def keep_swept(self, keys: list[str]) -> None:
        """Remember the keys the sweep varies (its jobs' tracker names show their values)."""
        (self.directory / "swept").write_text(json.dumps(keys))

    def swept(self) -> list[str]:
        """The keys :meth:`keep_swept` remembered (none outside a sweep)."""
        path = self.directory / "swept"
        return list(json.loads(path.read_text())) if path.is_file() else []

    def keep_config(self, overrides: list[str], cfg: DictConfig, settings: RunSettings) -> None:
        """Keep a job's composed configuration and its validated settings for the job itself."""
        path = self._job_file(overrides)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(pickle.dumps((cfg, settings)))

    def composed(self, overrides: list[str]) -> tuple[DictConfig, RunSettings] | None:
        """The configuration :func:`preflight` composed for the job of ``overrides``, and its settings.

        Read from the state directory, so that a job run by a parallel launcher in another process
        gets it too. None for a job the preflight did not see.
        """
        path = self._job_file(overrides)
        return pickle.loads(path.read_bytes()) if path.is_file() else None  # written by keep_config

    def note_sweep_dir(self, directory: Path) -> None:
        """Remember the sweep's directory (named in the line that says how to continue the sweep)."""
        (self.directory / "sweep_dir").write_text(str(directory))

    def sweep_dir(self) -> Path | None:
        """The directory :meth:`note_sweep_dir` remembered (None before the first job)."""
        path = self.directory / "sweep_dir"
        return Path(path.read_text()) if path.exists() else None

    def jobs_done(self) -> tuple[int, int]:
        """Jobs finished so far and jobs in the sweep."""
        return len(self._lines("done")), int((self.directory / "total").read_text())

    def remove(self) -> None:
        """Delete the state directory."""
        shutil.rmtree(self.directory, ignore_errors=True)


def preflight(argv: list[str], *, on_valid: Callable[[RunSettings, int], None] | None = None) -> list[str]:
    """Compose and validate every job; return one error line per bad job.

    Each job's configuration is kept for the job itself (:meth:`SweepState.composed`): composed and
    validated once. When every job is valid, ``on_valid`` is called with the first job's
    configuration and the number of jobs (``python -m fl_app`` begins starting Ray then,
    :func:`begin_ray_early`): nothing starts before the whole command is known to be valid.
    """
    overrides, multirun, informational = split_command_line(argv)
    if informational:
        return []
    try:
        jobs = expand_jobs(overrides, multirun=multirun)
    except (HydraException, OmegaConfBaseException, ValueError) as error:
        return [_one_line(error)]
    from fl_app.run.cluster import launcher_error

    if (launcher := launcher_error(overrides, multirun=multirun)) is not None:
        return [str(launcher)]
    from fl_app.config.validation import validate_config  # torch, Flower and every strategy: 2-3 s

    state = SweepState.create(len(jobs) if multirun else 1)
    if multirun:
        from fl_app.run.sweep_names import swept_keys

        state.keep_swept(swept_keys([[o for o in job if not is_hydra_override(o)] for job in jobs]))
    errors: list[str] = []
    first: RunSettings | None = None
    for job in jobs:
        try:
            cfg = compose_config(job)
            settings = validate_config(cfg)
            state.keep_config(job, cfg, settings)
            first = settings if first is None else first
        except (HydraException, OmegaConfBaseException, ValueError) as error:
            prefix = f"[{' '.join(job)}] " if multirun and len(jobs) > 1 else ""
            errors.append(prefix + _one_line(error))
    if not errors and first is not None and on_valid is not None:
        on_valid(first, len(jobs))
    return errors


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text.replace(
        "Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.", ""
    ).strip()


@hydra.main(config_path=str(CONF_DIR), config_name=CONFIG_NAME, version_base="1.3")
def _job(_: DictConfig) -> str | None:
    """One Hydra job, then the sweep's progress line; returns the job's output directory (None: none).

    A job is done when its results are written (a failed run's too): not when a signal stopped it, its
    directory was refused, or it raised before writing them. The directory returned is what a launcher
    that runs the job elsewhere (submitit) reports the job's results by.
    """
    finished = True
    try:
        finished = _run_job()
        return str(_JOB_DIRS[-1]) if _JOB_DIRS else None
    except SystemExit as exit_:
        finished = exit_.code in (0, None)
        raise
    except KeyboardInterrupt:
        finished = False
        raise
    finally:
        state = SweepState.current()
        line = state.job_finished() if state is not None and finished else None
        if line is not None:
            print(line, file=sys.stderr, flush=True)


#: Exit statuses of a run stopped by SIGINT or SIGTERM.
INTERRUPTED_EXIT_CODES = (128 + 2, 128 + 15)


def continue_sweep_line(argv: list[str], state: SweepState | None) -> str:
    """How to continue a stopped sweep: the same command into the same sweep directory."""
    if state is None:
        return ""
    directory = state.sweep_dir()
    if directory is None:
        return ""
    done, total = state.jobs_done()
    kept = [arg for arg in argv if not arg.startswith("hydra.sweep.dir=")]
    command = " ".join(["python -m fl_app", *kept, f"hydra.sweep.dir={directory}"])
    return (
        f"dpfl sweep: stopped with {done} of {total} jobs done; continue it (completed jobs are "
        f"skipped, the stopped one resumes) with: {command}"
    )


def _say_how_to_continue(state: SweepState | None) -> None:
    """Print :func:`continue_sweep_line` for this command (nothing outside a sweep)."""
    line = continue_sweep_line(sys.argv[1:], state)
    if line:
        print(line, file=sys.stderr, flush=True)


def _run_job() -> bool:
    """Simulate the job with the configuration the preflight composed and validated.

    Returns whether the job is done (False: a parallel sweep was stopped before or during it).
    """
    job = _current_job()
    if command_stop_requested() is not None:  # a parallel sweep stopped: no job starts any more
        _discard_if_empty(job.output_dir)
        return False
    settled = _settle_job(job)
    _JOB_DIRS.append(job.output_dir)
    if not settled:  # a sweep run again into its directory: this job was done before
        return True
    return _simulate_job(job)


#: The output directories of the jobs this process settled (the last: the current job's).
_JOB_DIRS: list[Path] = []


@dataclass
class _Job:
    """The Hydra job :func:`_run_job` runs, as it settles what to run and where.

    Attributes
    ----------
    overrides : list[str]
        The job's overrides (a resumed sweep's plan may replace them).
    hydra_dir : Path
        Hydra's output directory of the job (removed when the job refuses to start and it is empty).
    output_dir : Path
        Where the run writes: ``hydra_dir``, or the configuration's ``output_dir``.
    cfg : DictConfig or None
        The composed configuration (None: a job the preflight did not see, composed by the job).
    settings : RunSettings or None
        Its validated settings (None with ``cfg``).
    multirun : bool
        Whether the job is one of a Hydra multirun (a sweep).
    state : SweepState or None
        The command's sweep state (None outside ``python -m fl_app``).

    """

    overrides: list[str]
    hydra_dir: Path
    output_dir: Path
    cfg: DictConfig | None
    settings: RunSettings | None
    multirun: bool
    state: SweepState | None


def _current_job() -> _Job:
    """The running Hydra job, with what the preflight kept for it; notes a sweep's directory.

    Returns
    -------
    _Job
        The job, its output directory still Hydra's.

    """
    hydra_cfg = HydraConfig.get()
    overrides = list(hydra_cfg.overrides.task)
    output_dir = Path(hydra_cfg.runtime.output_dir)
    state = SweepState.current()
    kept = state.composed(overrides) if state is not None else None
    cfg, settings = kept if kept is not None else (None, None)
    multirun = str(hydra_cfg.mode) == "RunMode.MULTIRUN"
    if multirun and state is not None:
        state.note_sweep_dir(Path(hydra_cfg.sweep.dir).expanduser().resolve())
    return _Job(
        overrides=overrides,
        hydra_dir=output_dir,
        output_dir=output_dir,
        cfg=cfg,
        settings=settings,
        multirun=multirun,
        state=state,
    )


def _settle_job(job: _Job) -> bool:
    """Compose the job if the preflight did not, follow a resumed sweep's plan, check the output directory.

    Parameters
    ----------
    job : _Job
        The job; its configuration, settings, overrides and output directory are settled in place.

    Returns
    -------
    bool
        Whether to run it (False: a sweep run again skips a job it completed before).

    Raises
    ------
    SystemExit
        With status 2 (one ``error:`` line) for a configuration or output directory it refuses.

    """
    from fl_app.config.validation import check_output_dir, validate_config

    try:
        if job.cfg is None or job.settings is None:  # a job the preflight did not see (a launcher of its own)
            job.cfg = compose_config(job.overrides)
            job.settings = validate_config(job.cfg)
        if job.cfg.output_dir is not None:
            job.output_dir = Path(job.cfg.output_dir).expanduser().resolve()
        if job.multirun and not _follow_sweep_plan(job):
            return False
        # checked now, not only in the preflight: an earlier job of the sweep may have written there
        # (and Hydra's run directory, hydra.run.dir=..., may name an old one)
        check_output_dir(OmegaConf.merge(job.cfg, {"output_dir": str(job.output_dir)}))
    except ValueError as error:
        _refuse_job(job, error)
    return True


def _follow_sweep_plan(job: _Job) -> bool:
    """Apply :func:`fl_app.run.sweep_resume.plan_sweep_job` to a sweep's job (a sweep run again continues).

    Parameters
    ----------
    job : _Job
        A multirun's job, composed; a resumed job's configuration, settings and overrides are replaced.

    Returns
    -------
    bool
        Whether to run it (False: the plan skips it).

    """
    from fl_app.run.sweep_resume import plan_sweep_job

    job_cfg = OmegaConf.merge(job.cfg, {"output_dir": str(job.output_dir)})
    plan = plan_sweep_job(job_cfg, job.overrides, job.output_dir)
    if plan.note:
        print(f"dpfl sweep: job {HydraConfig.get().job.num}: {plan.note}", file=sys.stderr, flush=True)
    if plan.action == "skip":
        return False
    if plan.cfg is not None and plan.settings is not None:
        job.cfg, job.settings, job.overrides = plan.cfg, plan.settings, list(plan.overrides)
    return True


def _refuse_job(job: _Job, error: Exception) -> NoReturn:
    """Print ``error: <error>`` and exit with status 2, leaving no empty Hydra directory behind.

    Parameters
    ----------
    job : _Job
        The job that does not start.
    error : Exception
        Why (a bad configuration, an output directory another run holds or wrote).

    """
    _discard_if_empty(job.hydra_dir)
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)


def _simulate_job(job: _Job) -> bool:
    """Run the settled job in its claimed output directory and report how it ended.

    Parameters
    ----------
    job : _Job
        The job, settled by :func:`_settle_job`.

    Returns
    -------
    bool
        Whether the job is done: its results are written (a failed run's too), or it was skipped.

    Raises
    ------
    SystemExit
        Status 2 when the output directory is refused; outside a sweep, the failed or interrupted
        run's status (an interrupted run ends a sweep too).

    """
    from fl_app.engine.simulation import run_in_simulation

    try:
        with claim_output_dir(job.output_dir, resume=job.settings.resume is not None):
            _RUNS_BEGUN.append(job.output_dir)
            outcome = run_in_simulation(tracked_as(job), job.overrides, job.output_dir)
    except ConfigError as error:  # another run holds the directory, or wrote there meanwhile
        _refuse_job(job, error)
    except RunFailed as error:
        _job_failed(job, error, f"results in {job.output_dir}", exit_code=1)
        return True
    except Exception as error:
        _job_failed(job, _one_line(error), _write_traceback(job.output_dir), exit_code=1)
        return (job.output_dir / "results.json").is_file()  # done only when its results are written
    return _outcome_done(job, outcome)


def tracked_as(job: _Job) -> RunSettings:
    """The job's settings; a sweep's job named in the trackers by its number and swept values."""
    from fl_app.run.sweep_names import named_in_sweep

    assert job.settings is not None
    if not job.multirun:
        return job.settings
    swept = job.state.swept() if job.state is not None else []
    return named_in_sweep(job.settings, job.overrides, swept, HydraConfig.get().job.num)


def _write_traceback(output_dir: Path) -> str:
    """Write the exception being handled to ``error.txt`` in ``output_dir``; say where it went.

    Parameters
    ----------
    output_dir : Path
        The run's output directory (created if missing).

    Returns
    -------
    str
        ``traceback in <path>``, or ``no traceback written: <why>`` (a full disk: no half-written
        ``error.txt``).

    """
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        (output_dir / "error.txt").write_text(traceback.format_exc())
        return f"traceback in {output_dir / 'error.txt'}"
    except OSError as unwritable:  # a full disk: no half-written error.txt
        (output_dir / "error.txt").unlink(missing_ok=True)
        return f"no traceback written: {unwritable.strerror or unwritable}"


def _job_failed(job: _Job, reason: object, where: str, *, exit_code: int) -> None:
    """Report a failed job (``error: job failed (...)``), remember it for the sweep's summary.

    Parameters
    ----------
    job : _Job
        The failed job.
    reason : object
        Why it failed (formatted into the line).
    where : str
        Where its results or its traceback are (the line's ``[...]``).
    exit_code : int
        The command's exit status outside a sweep (a sweep goes on with its next job).

    """
    line = f"job failed ({' '.join(job.overrides) or 'defaults'}): {reason} [{where}]"
    print(f"error: {line}", file=sys.stderr)
    _record_failure(line)
    if not job.multirun:
        sys.exit(exit_code)


def _outcome_done(job: _Job, outcome: Outcome) -> bool:
    """Turn the run's outcome into the job's report, its exit status and whether it is done.

    Parameters
    ----------
    job : _Job
        The job that ran.
    outcome : Outcome
        How its run ended.

    Returns
    -------
    bool
        Whether the job is done (False: a parallel launcher's worker whose run was interrupted).

    """
    if outcome.exit_code and outcome.status.startswith("completed"):  # a client never contributed
        _job_failed(job, outcome.reason, f"results in {job.output_dir}", exit_code=outcome.exit_code)
        return True
    if outcome.status == "interrupted":  # the run's last line said why, where and how to continue
        if job.multirun and job.state is not None and not job.state.runs_here():
            # a parallel launcher's worker: its SystemExit would make the launcher kill the other
            # workers while they write their results; the command's process reports the stop
            return False
        sys.exit(outcome.exit_code)  # ends a multirun too
    return True


def _record_failure(line: str) -> None:
    state = SweepState.current()
    if state is not None:
        state.record_failure(line)


def _discard_if_empty(directory: Path) -> None:
    """Remove a job directory that holds nothing but Hydra's own files."""
    if directory.is_dir() and {p.name for p in directory.iterdir()} <= _HYDRA_FILES:
        shutil.rmtree(directory, ignore_errors=True)


def run_dir_overrides(argv: list[str], state: SweepState | None) -> list[str]:
    """For a single run into ``output_dir`` (or ``resume=``): Hydra's run directory is that directory.

    Hydra otherwise created ``outputs/<date>/<time>-<strategy>/.hydra`` in the current directory for
    every run, also one that wrote elsewhere; and with ``hydra.output_subdir=null`` it writes no
    ``.hydra`` folder into the run's. Nothing when the command sets either key itself.
    """
    overrides, multirun, informational = split_command_line(argv)
    chosen = any(o.startswith(("hydra.run.dir=", "hydra.output_subdir=")) for o in overrides)
    kept = (
        state.composed(overrides) if state is not None and not (multirun or informational or chosen) else None
    )
    if kept is None or kept[1].output_dir is None:
        return []
    directory = str(Path(kept[1].output_dir).expanduser().resolve())
    if any(character in directory for character in "'\\$"):  # not a plain quoted Hydra value
        return []
    return [f"hydra.run.dir='{directory}'", "hydra.output_subdir=null"]


def parallel_launcher(argv: list[str]) -> bool:
    """Whether the command's jobs run in a parallel launcher's worker processes (not Hydra's basic)."""
    overrides, multirun, _ = split_command_line(argv)
    launchers = [item.split("=", 1)[1] for item in overrides if item.startswith("hydra/launcher=")]
    return multirun and any(name != "basic" for name in launchers)


def begin_ray_early(argv: list[str]) -> Callable[[RunSettings, int], None] | None:
    """What starts Ray in the background for this process's jobs, and keeps it for all of them.

    Only when Hydra's basic launcher runs the jobs here, one after another (a parallel launcher runs
    them in worker processes, each with its own Ray). Returns the :func:`preflight` callback that
    begins the start, with the first job's settings and its client actors, once every job is valid:
    Ray's 2.5-3 s and the actors' start then pass while Hydra sets the job up and the ServerApp
    loads its data. A job that asks for other settings starts it again (:mod:`fl_app.engine.ray_session`).
    """
    from fl_app.engine.ray_session import SESSION, ActorPlan, ray_init_args

    _, _, informational = split_command_line(argv)
    if informational or parallel_launcher(argv):
        return None

    def begin(first: RunSettings, jobs: int) -> None:
        SESSION.keep = True
        SESSION.jobs_left = jobs
        if first.simulation.uses_ray:  # an inline or processes run needs no Ray (a later job may start it)
            print(f"dpfl: {starting_ray_text(first)}", file=sys.stderr, flush=True)
            SESSION.begin(ray_init_args(first), ActorPlan.of(first))

    return begin


def starting_ray_text(settings: RunSettings) -> str:
    """What the command says when it begins starting Ray (the first lines of a run come after it)."""
    if settings.simulation.ray_address:
        return f"joining the Ray cluster at {settings.simulation.ray_address} ..."
    return (
        "starting Ray (a private instance for this command: a few seconds, up to a minute on a busy "
        "machine), then the clients and the data ..."
    )


#: The output directories of the runs this process began (a stop before the first: nothing ran).
_RUNS_BEGUN: list[Path] = []


def interrupted_line(signum: int, *, run_began: bool, doing: str = "") -> str:
    """The line for Ctrl-C or SIGTERM outside a run: before it, between a sweep's jobs, in parallel sweeps.

    ``doing``: what the command was doing when a stop before the run came (said in brackets).
    """
    name = signal.Signals(signum).name
    if not run_began:
        during = f" ({doing})" if doing else ""
        return f"dpfl: stopped by {name} before the run began{during}: nothing ran, nothing to resume"
    how = "interrupted (a second Ctrl-C stops at once)"
    if signum != signal.SIGINT:
        how = f"stopped by {name} (a second one stops at once)"
    return (
        f"dpfl: {how}: a run continues from its last checkpoint with "
        "python -m fl_app resume=<its output directory>"
    )


def stopped_before_the_runs(stop: KeyboardInterrupt) -> int:
    """Ctrl-C or SIGTERM while the command checked its jobs: one line, Ray and the sweep state ended.

    The line names what was abandoned (the notes the stop gathered on its way: a text conversion's).
    Returns the command's exit status (128 + the signal's number).
    """
    from fl_app.engine.ray_session import SESSION

    signum = getattr(stop, "signum", signal.SIGINT)
    doing = "; ".join(getattr(stop, "__notes__", ()))
    print(interrupted_line(signum, run_began=False, doing=doing), file=sys.stderr, flush=True)
    SESSION.end()
    SESSION.keep, SESSION.jobs_left = False, 0
    state = SweepState.current()
    if state is not None:
        state.remove()
    return 128 + signum


def exit_now(code: int | str | None) -> None:
    """End the process with ``code`` once the command is done, without the interpreter's teardown.

    Everything is written and closed and Ray is stopped by then; tearing down the imported modules
    (torch, Ray's core worker, ...) took 1.3-1.5 s more (measured, benchmarks/startup.py). The exit
    handlers still run and the log handlers are flushed. When other threads or child processes are
    still alive (a parallel launcher's workers), the interpreter's own exit runs instead: it is the
    one that tells them to stop.
    """
    import atexit
    import multiprocessing
    import os
    import threading

    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    if others or multiprocessing.active_children():
        sys.exit(code)
    if isinstance(code, str):
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()  # CPython's own exit handlers, run as at a normal exit
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code or 0)


def main() -> int:
    """Entry point: preflight, then Hydra."""
    # Flower's logger has its own console handler; Hydra also puts one on the
    # root logger. Without this every Flower line would print twice.
    logging.getLogger("flwr").propagate = False
    colour_only_at_a_terminal()
    # Flower's LinkState imports alembic, which logs one "setup plugin" line per plugin at INFO;
    # Hydra's console handler would print them (7 lines before every run).
    logging.getLogger("alembic").setLevel(logging.WARNING)
    from fl_app.engine.ray_session import SESSION

    mark("imports")
    with sigterm_like_ctrl_c():  # a stop while the jobs are checked (a data set's conversion): one line
        try:
            errors = preflight(sys.argv[1:], on_valid=begin_ray_early(sys.argv[1:]))
        except KeyboardInterrupt as stop:  # (a repeat within the grace period is still this stop)
            return stopped_before_the_runs(stop)
    mark("preflight")
    state = SweepState.current()
    try:
        if errors:
            for line in errors:
                print(f"error: {line}", file=sys.stderr, flush=True)
            return 2
        try:
            if state is not None and parallel_launcher(sys.argv[1:]):
                os.environ[SWEEP_COMMAND_ENV] = str(os.getpid())  # the workers leave stops to this process
                with stop_workers_on_signals(state.stop_file) as received, jobs_reported(sys.argv[1:], state):
                    _job()
                if received:  # the workers stopped their jobs; none is running any more
                    print(f"dpfl: sweep stopped by {signal.Signals(received[0]).name}", file=sys.stderr)
                    _say_how_to_continue(state)
                    return 128 + received[0]
            else:
                sys.argv += run_dir_overrides(sys.argv[1:], state)  # no stray Hydra folder
                with sigterm_like_ctrl_c():
                    _job()
        except KeyboardInterrupt as stop:  # Ctrl-C or SIGTERM between two jobs, a second Ctrl-C in a
            # run, or either while a parallel launcher's workers run the jobs
            signum = getattr(stop, "signum", signal.SIGINT)
            # a sweep's line says how to continue it; a parallel launcher's workers ran its runs
            began = bool(_RUNS_BEGUN) or split_command_line(sys.argv[1:])[1]
            print(interrupted_line(signum, run_began=began), file=sys.stderr, flush=True)
            _say_how_to_continue(state)
            return 128 + signum
        except SystemExit as exit_:
            if exit_.code in INTERRUPTED_EXIT_CODES:
                _say_how_to_continue(state)
            raise
        failed = state.failures() if state is not None else []
        if failed:
            print(f"{len(failed)} job(s) failed:", file=sys.stderr)
            for line in failed:
                print(f"  {line}", file=sys.stderr)
            if left_no_result(failed):  # a killed job resumes from its checkpoint when the sweep is run again
                _say_how_to_continue(state)
            return 1
        return 0
    finally:
        SESSION.end()
        SESSION.keep, SESSION.jobs_left = False, 0
        if state is not None:
            state.remove()
        mark("exit")


if __name__ == "__main__":
    from fl_app.engine.ray_session import SESSION

    SESSION.ends_with_process = True  # a Ray start under way when the command ends is not waited for
    try:
        exit_code: int | str | None = main()
    except SystemExit as exit_:
        exit_code = exit_.code
    exit_now(exit_code)
