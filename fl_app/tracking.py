"""Optional experiment tracking: every round's record, as ``metrics.csv`` has it, in TensorBoard.

``tracking=tensorboard`` writes the run's curves to ``<output dir>/tensorboard`` with TensorBoard's
own writer (``torch.utils.tensorboard``; the ``tensorboard`` package must be installed). Look at one
run or a whole sweep with::

    tensorboard --logdir outputs/          # or multirun/<date>/<time>: one curve per job

What is logged is exactly the numeric fields of each round's record in ``metrics.csv`` (test accuracy
and loss of the released global model, the accountant's epsilon, bytes, clients, round time and the
strategy's per-round fields), with the round as the step, plus the initial model as step 0 and the
resolved configuration as text. It therefore releases nothing that the run's results do not already
release: statistics outside the guarantee (``privacy.diagnostics``) are never tracked. Off by default
(``tracking=none``).

TensorBoard stores a wall time with every event. With a secret cohort a round's duration follows its
cohort's size, so every event of such a run carries the same wall time, the moment the writer was
made (before round 1): TensorBoard's "relative" and "wall" axes then say nothing, the step axis
everything.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Protocol

#: The values of the ``tracking`` key.
TRACKERS = ("none", "tensorboard")
#: The directory, inside the run's output directory, that TensorBoard's files go to.
TENSORBOARD_DIR = "tensorboard"


class RoundTracker(Protocol):
    """Where per-round records go beside ``metrics.csv``."""

    def log_round(self, record: dict[str, Any]) -> None:
        """Log one round's record (its ``round`` is the step)."""

    def close(self) -> None:
        """Flush and close."""


def tracker_available(name: str) -> str | None:
    """None when ``tracking=name`` can run here, else what is missing (one sentence)."""
    if name != "tensorboard":
        return None
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return "needs the tensorboard package, which is not installed: pip install tensorboard"
    return None


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The finite numeric fields of a round record, without ``round`` (booleans are not numbers)."""
    values: dict[str, float] = {}
    for key, value in record.items():
        if key == "round" or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(float(value)):
            values[key] = float(value)
    return values


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

    def close(self) -> None:
        """Flush and close the event file."""
        self.writer.close()


def make_tracker(
    name: str, output_dir: Path, *, config_text: str, secret_cohort: bool = False
) -> RoundTracker | None:
    """The tracker ``tracking=name`` asks for, or None for ``none``.

    ``secret_cohort``: the run's cohorts are secret; its events carry no wall time that varies.
    """
    if name == "none":
        return None
    if name == "tensorboard":
        return TensorBoardTracker(
            output_dir / TENSORBOARD_DIR, config_text=config_text, constant_wall_time=secret_cohort
        )
    raise ValueError(f"unknown tracker {name!r} (known: {', '.join(TRACKERS)})")
