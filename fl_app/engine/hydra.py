"""Hydra's non-public APIs (hydra-core 1.3.8; ``tests/test_config.py`` pins it).

dpfl composes a job's configuration itself, before Hydra creates any directory, so that a bad value
is one line and nothing is written. What it needs beyond Hydra's public API:

* :func:`compose_fresh`: a composition from ``conf/`` that also works inside a running
  ``@hydra.main`` job (Hydra's global state is set aside and put back:
  ``hydra.initialize.get_gh_backup`` / ``restore_gh_from_backup``, ``GlobalHydra.clear``);
* :func:`sweep_jobs`: the override list of every job of a multirun, as Hydra's basic sweeper
  makes them (``hydra._internal.core_plugins.basic_sweeper.BasicSweeper.split_arguments``);
* :func:`submitit_jobs_reported`: a job of Hydra's submitit launcher that left no result is one line
  (``submitit.core.core.Job.results`` is wrapped while the launcher waits), and ``submitit_local``
  starts each job in a session of its own (``submitit.local.local.start_controller``), so a Ctrl-C
  reaches the command only, which stops its jobs through their stop file.

A Hydra upgrade must revisit this module; nothing else in dpfl imports Hydra's internals
(``tests/test_repository.py``).
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.initialize import get_gh_backup, restore_gh_from_backup
from omegaconf import DictConfig

#: The Hydra release whose non-public APIs this module was written against.
HYDRA_VERSION = "1.3.8"


def hydra_version() -> str:
    """The installed Hydra release."""
    return str(hydra.__version__)


def compose_fresh(
    config_dir: Path, config_name: str, overrides: Sequence[str], *, with_hydra: bool = False
) -> DictConfig:
    """Compose ``config_name`` from ``config_dir`` with ``overrides`` (unresolved, as Hydra returns it).

    Inside a ``python -m fl_app`` job Hydra is already initialised: its state is set aside, the
    configuration composed afresh, and the state put back. ``with_hydra`` keeps the ``hydra`` node
    (its sweeper parameters, for :func:`sweep_jobs`).
    """
    backup = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            return compose(config_name=config_name, overrides=list(overrides), return_hydra_config=with_hydra)
    finally:
        restore_gh_from_backup(backup)


def sweep_jobs(preset: Sequence[str], command_line: Sequence[str]) -> list[list[str]]:
    """The override list of every job of a multirun, in the order Hydra's basic sweeper runs them.

    ``preset`` are the composed ``hydra.sweeper.params`` as ``key=a,b`` strings, ``command_line`` the
    command's overrides; as in Hydra's ``BasicSweeper``, the preset comes first and the command line
    wins for the same key.
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    parsed = parser.parse_overrides(list(preset)) + parser.parse_overrides(list(command_line))
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def sweep_fixed(command_line: Sequence[str]) -> list[str]:
    """The overrides of ``command_line`` that are not sweeps (``key=a,b``, ranges, choices)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(command_line))
    return [item.input_line for item in parsed if not item.is_sweep_override() and item.input_line]


def launcher_names() -> list[str]:
    """The names ``hydra/launcher=`` accepts here: Hydra's own and those of the installed launcher plugins.

    Read from Hydra's config store, which Hydra's own configs and the plugins fill when they are
    imported and discovered.
    """
    import hydra.conf  # noqa: F401  (registers Hydra's own launcher, basic)
    from hydra.core.config_store import ConfigStore
    from hydra.core.plugins import Plugins

    Plugins.instance()  # discovers the installed plugins, which register their launchers
    return sorted(name.removesuffix(".yaml") for name in ConfigStore.instance().list("hydra/launcher"))


@contextmanager
def submitit_jobs_reported(
    failed: Callable[[str, Path | None], None], done: Callable[[str, Path, Any], None]
) -> Iterator[None]:
    """While in the block, a submitit launcher's job that ends without a result is one line, not a traceback.

    Hydra's submitit launcher (``hydra-submitit-launcher`` 1.2.0) waits for each job with
    ``submitit.Job.results``, which raises when the job left no result (killed by the scheduler or by
    ``kill -9``, out of memory, past its time limit) or raised; Hydra then printed the whole traceback
    and the sweep's other results were not waited for. In the block, such a job is reported with
    ``failed(line, sweep_dir)`` (its number, overrides, what submitit saw, its log file; the sweep's
    directory, None if unreadable) and the launcher goes on with the next job; a job that returned is
    reported with ``done(name, log, value)`` (its number and overrides, its log file, what the job's
    function returned).

    ``submitit_local`` starts each job in a session of its own (:func:`_in_own_session`): a Ctrl-C in
    the terminal then reaches the command only, whose stop file stops the jobs, and no longer submitit's
    controller, which printed a traceback and killed its job while the job wrote its results.
    """
    from hydra.core.utils import JobReturn, JobStatus
    from submitit.core.core import Job
    from submitit.core.utils import UncompletedJobError
    from submitit.local import local

    original, start_controller = Job.results, local.start_controller

    def results(job: Job) -> list[JobReturn]:
        try:
            returned = original(job)
        except UncompletedJobError as error:
            failed(_job_failure(job, error), _sweep_dir(job))
            placeholder = JobReturn()
            placeholder.status, placeholder.return_value = JobStatus.COMPLETED, None
            return [placeholder]
        first = returned[0] if returned else None
        value = first.return_value if first is not None and first.status == JobStatus.COMPLETED else None
        done(_job_name(job), Path(job.paths.stderr), value)
        return returned

    Job.results = results  # type: ignore[method-assign]
    local.start_controller = _in_own_session(start_controller)
    try:
        yield
    finally:
        Job.results = original  # type: ignore[method-assign]
        local.start_controller = start_controller


class _SessionOfItsOwn:
    """``subprocess`` as submitit's ``start_controller`` sees it: its ``Popen`` starts a new session."""

    def __getattr__(self, name: str) -> Any:
        return getattr(subprocess, name)

    @staticmethod
    def Popen(*args: Any, **kwargs: Any) -> subprocess.Popen[Any]:  # noqa: N802 (subprocess's name)
        """``subprocess.Popen`` in a session (and process group) of its own."""
        return subprocess.Popen(*args, **{**kwargs, "start_new_session": True})


def _in_own_session(start_controller: Callable[..., Any]) -> Callable[..., Any]:
    """``start_controller`` of submitit 1.5.4, its controller process in a session of its own.

    In the command's process group, the controller (``python -m submitit.local._local``) and its job
    get the terminal's Ctrl-C: the controller raises ``KeyboardInterrupt`` (a traceback on the command's
    console), then sends its job SIGINT and, a second later, SIGKILL, while the job writes its results.
    In a session of their own they get no signal from the terminal; the command's stop file
    (:data:`fl_app.run.lifecycle.STOP_FILE_ENV`, in their environment) stops the job's run.
    """
    from submitit.local import local

    def started(*args: Any, **kwargs: Any) -> Any:
        local.subprocess = _SessionOfItsOwn()  # type: ignore[assignment]
        try:
            return start_controller(*args, **kwargs)
        finally:
            local.subprocess = subprocess

    return started


def _sweep_dir(job: Any) -> Path | None:
    """The sweep directory of a submitit job the Hydra launcher submitted (None if unreadable)."""
    try:
        return Path(str(job.submission().function.config.hydra.sweep.dir)).expanduser().resolve()
    except Exception:  # an unreadable submission file: the line to continue names no directory
        return None


def _job_name(job: Any) -> str:
    """``<number> (<overrides>)`` of a job the Hydra launcher submitted (its job id if unreadable)."""
    try:
        overrides, _, number = job.submission().args[:3]
    except Exception:  # an unreadable submission file: the scheduler's id still names it
        return f"id {job.job_id}"
    return f"{number} ({' '.join(overrides) or 'defaults'})"


def _job_failure(job: Any, error: Exception) -> str:
    """The one line for a job that left no result: what submitit says, without the log it quotes."""
    from submitit.core.utils import FailedJobError

    if isinstance(error, FailedJobError):
        what = "raised in its process"
    else:
        state = str(job.state)
        what = f"ended without a result (killed, out of memory or out of time?; scheduler state {state})"
    return f"job {_job_name(job)} {what} [its log: {job.paths.stderr}]"
