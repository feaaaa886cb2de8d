"""The name of a sweep's run in MLflow and W&B: unique within the sweep.

A single run is named ``<strategy> (<label>) seed <seed>``; every job of an epsilon sweep would carry
the same name, and MLflow's run list could not tell them apart. A sweep's job is therefore named
``<strategy> (<label>) seed <seed> [job <n>: <its swept values>]``: the job's number (unique within the
sweep) and the values of the keys the sweep varies (:func:`swept_keys`, found when the command's jobs
are expanded, before any runs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fl_app.config.settings import RunSettings


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def swept_keys(jobs: Sequence[Sequence[str]]) -> list[str]:
    """The keys whose values differ between ``jobs`` (each a job's overrides), in command-line order."""
    values: dict[str, set[str]] = {}
    for job in jobs:
        for override in job:
            if "=" in override:
                values.setdefault(_key(override), set()).add(override.split("=", 1)[1])
    counted = {key for key, seen in values.items() if len(seen) > 1}
    counted |= {key for key in values if any(key not in {_key(o) for o in job} for job in jobs)}
    return [key for key in values if key in counted]


def run_name(settings: RunSettings) -> str:
    """A single run's name in the trackers: ``<strategy> (<label>) seed <seed>``."""
    label = f" ({settings.label})" if settings.label else ""
    return f"{settings.strategy}{label} seed {settings.seed}"


def named_in_sweep(
    settings: RunSettings, overrides: Sequence[str], swept: Sequence[str], number: int
) -> RunSettings:
    """``settings`` whose trackers name the run as job ``number`` of a sweep, with its ``swept`` values.

    The name is ``tracker.run_name`` of the typed settings only: the configuration the run publishes,
    and the fingerprint a continued sweep matches its jobs by, stay as composed.
    """
    values = [o.lstrip("+~") for o in overrides if _key(o) in swept and _key(o) != "seed"]
    detail = f"job {number}" + (f": {' '.join(values)}" if values else "")
    name = f"{settings.tracker.run_name or run_name(settings)} [{detail}]"
    return dataclasses.replace(settings, tracker=dataclasses.replace(settings.tracker, run_name=name))
