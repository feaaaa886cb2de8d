"""Continue a sweep: what a job does when its directory already holds an earlier attempt of it.

Running a sweep again into the directory it used (``hydra.sweep.dir=DIR``) continues it: a job
whose earlier attempt completed is skipped, one that stopped after a round (interrupted, failed, or
killed: its checkpoint is there) is resumed from its checkpoint, and one that stopped before its
first round is started again (nothing of it was worth keeping). A job's directory is matched to
the job by the configuration's fingerprint (:mod:`fl_app.config.fingerprint`), so a directory that holds
another configuration (the sweep's command changed) is refused, not overwritten.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from fl_app.config.checks import ConfigError
from fl_app.config.fingerprint import config_fingerprint
from fl_app.config.overrides import override_key
from fl_app.config.settings import RunSettings
from fl_app.run.checkpoint import read_header, state_path
from fl_app.run.lifecycle import COMPLETED_STATUSES
from fl_app.run.output_claim import RUN_FILES, earlier_run_files


@dataclass(frozen=True)
class JobPlan:
    """What a sweep's job does: ``run`` (afresh), ``skip`` or ``resume`` (with ``cfg`` and ``overrides``)."""

    action: str
    note: str = ""
    cfg: DictConfig | None = None
    overrides: tuple[str, ...] = ()
    settings: RunSettings | None = None


def plan_sweep_job(cfg: DictConfig, overrides: list[str], directory: Path) -> JobPlan:
    """Decide how the job of ``cfg`` continues the earlier attempt in ``directory``, if any.

    Raises
    ------
    ConfigError
        ``directory`` holds a run of another configuration, or an unreadable checkpoint.

    """
    if not earlier_run_files(directory):
        return JobPlan("run")
    results = _read_results(directory)
    if results is not None and results.get("status") in COMPLETED_STATUSES:
        earlier = OmegaConf.create(results.get("config", {}))
        if config_fingerprint(earlier) != config_fingerprint(cfg):
            raise _other_run(directory)
        return JobPlan("skip", f"already {results['status']} in {directory}")
    if state_path(directory).exists():
        try:
            header = read_header(directory)
        except ValueError as error:
            raise ConfigError("hydra.sweep.dir", str(directory.parent), str(error)) from None
        from fl_app.config.compose import compose_config
        from fl_app.config.validation import typed_settings, validate_config

        same = header["fingerprint"] == typed_settings(cfg).fingerprint(ignore=("num_rounds",))
        if not same or header["num_rounds"] != cfg.num_rounds:
            raise _other_run(directory)

        kept = [o for o in overrides if override_key(o).startswith(("simulation.", "hydra."))]
        resume = [f"resume={directory}", *kept]
        resumed = compose_config(resume)
        settings = validate_config(resumed)
        done = header["completed_round"]
        note = f"resuming after round {done} in {directory}"
        if done >= header["num_rounds"]:  # stopped after its last round, before its results were written
            note = f"all {done} rounds done in {directory}, its results not written: writing them"
        return JobPlan("resume", note, resumed, tuple(resume), settings)
    # stopped before its first round: nothing to continue, nothing worth keeping
    for name in RUN_FILES:
        (directory / name).unlink(missing_ok=True)
    status = results.get("status") if results else "killed"
    note = f"the earlier attempt in {directory} ended before its first round ({status}): run again"
    return JobPlan("run", note)


def _read_results(directory: Path) -> dict | None:
    path = directory / "results.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _other_run(directory: Path) -> ConfigError:
    return ConfigError(
        "hydra.sweep.dir",
        str(directory.parent),
        f"job directory {directory.name} holds a run of another configuration (the sweep's command "
        "changed?): continue a sweep with the same command, or choose a new hydra.sweep.dir",
    )
