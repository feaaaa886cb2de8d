"""What every tracker is given: the run's name and configuration, its numbers, its files.

Shared by :mod:`fl_app.report.tracking` and the trackers it makes (:mod:`fl_app.report.tracking_mlflow`,
:mod:`fl_app.report.tracking_wandb`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fl_app.config.settings import TrackerSettings

#: The run's files that MLflow and W&B keep with the run (those present).
RUN_FILES = ("results.json", "metrics.csv", "config.yaml", "accuracy_loss.png", "epsilon.png")


@dataclass(frozen=True)
class TrackedRun:
    """What a tracker names the run by and records as its parameters.

    Attributes
    ----------
    name : str
        The run's name in MLflow and W&B (``<strategy> (<label>) seed <seed>``).
    config : dict
        The resolved configuration (parameters, flattened to dotted keys).
    settings : TrackerSettings
        Where MLflow and W&B write.
    resumed : bool
        The run continues an earlier one from its checkpoint (MLflow and W&B continue its run).

    """

    name: str
    config: dict[str, Any]
    settings: TrackerSettings
    resumed: bool = False


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The finite numeric fields of a round record, without ``round`` (booleans are not numbers)."""
    values: dict[str, float] = {}
    for key, value in record.items():
        if key == "round" or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(float(value)):
            values[key] = float(value)
    return values


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}`` (lists and other values as they are)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def epsilon_holds_for(results: dict[str, Any]) -> str | None:
    """Whose epsilon the run's is when not its own (``privacy.total.holds_for``; None: the run's own).

    A run that simulates a larger deployment (``strategy.noise_cohort_size``) says that its epsilon
    holds for that deployment, not for its model; every tracker records the sentence with the epsilon.
    """
    holds_for = results.get("privacy", {}).get("total", {}).get("holds_for")
    return str(holds_for) if holds_for else None


def final_values(results: dict[str, Any]) -> dict[str, float]:
    """The numbers a tracker keeps as the run's final results: ``final``'s, and the total epsilon.

    Only what ``results.json`` publishes as results: never ``outside_guarantee``.
    """
    values = {f"final.{key}": value for key, value in scalars(results.get("final", {})).items()}
    total = results.get("privacy", {}).get("total", {}).get("epsilon")
    if isinstance(total, int | float) and math.isfinite(total):
        values["privacy.total.epsilon"] = float(total)
    return values
