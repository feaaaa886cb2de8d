"""``tracking=wandb``: the run as a Weights & Biases run, offline by default (``wandb sync`` later).

The run's files go to ``<output dir>/wandb/offline-run-<time>-<id>/`` (``tracker.wandb_mode=offline``,
the default: nothing leaves the machine until ``wandb sync <that folder>``); ``tracker.wandb_mode=online``
sends them as the run goes (a W&B account, ``wandb login``). The project is ``tracker.experiment``.

A W&B run gets the resolved configuration as its config, each round's record as a row of its history
(the round as the step), and at the end ``final.*``, ``privacy.total.epsilon`` (with
``privacy.total.holds_for`` when it is a simulated deployment's) and the status in its summary, the
plots as images and the run's files. W&B collects nothing else: no console output, no system metrics,
no git state or code.

W&B stamps every history row with its own clock (``_runtime``, seconds since the run began), which
would tell each round's duration. A run whose cohorts are secret therefore gives W&B the whole run at
its end, every row stamped (``_timestamp``) with the moment the tracker was made: its rows' times then
follow the end of the run, not its rounds. A resumed run continues its W&B run's id (kept in
``<output dir>/wandb_run.json``).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from fl_app.report.tracking_common import RUN_FILES, TrackedRun, epsilon_holds_for, final_values, scalars

#: The file, in the run's output directory, that names its W&B run (for a resumed run).
RUN_ID_FILE = "wandb_run.json"
#: The plots logged as images (those present).
PLOTS = ("accuracy_loss.png", "epsilon.png")


class WandbTracker:
    """One dpfl run as one W&B run."""

    def __init__(self, output_dir: Path, run: TrackedRun, *, at_the_end: bool = False) -> None:
        import wandb  # noqa: F401  (fails here, before round 1, when it cannot)

        self.output_dir = output_dir
        self.info = run
        self.at_the_end = at_the_end
        #: The time every row of a run given at its end is stamped with.
        self.stamp = time.time()
        self.pending: list[tuple[int, dict[str, float]]] = []
        self.last_step = 0
        self.run: Any = None
        if not at_the_end:
            self._start()

    def _start(self) -> None:
        import wandb

        path = self.output_dir / RUN_ID_FILE
        kept = json.loads(path.read_text()) if self.info.resumed and path.is_file() else {}
        settings = wandb.Settings(
            console="off",
            silent=True,
            x_disable_stats=True,
            x_disable_meta=True,
            x_disable_machine_info=True,
            disable_git=True,
            save_code=False,
        )
        self.run = wandb.init(
            project=self.info.settings.experiment,
            name=self.info.name,
            dir=str(self.output_dir),
            mode=self.info.settings.wandb_mode,
            config=self.info.config,
            id=kept.get("run_id"),  # None: a new run's id
            resume="allow" if kept else None,
            settings=settings,
            reinit="finish_previous",
        )
        path.write_text(json.dumps({"run_id": self.run.id, "project": self.info.settings.experiment}) + "\n")

    def log_round(self, record: dict[str, Any]) -> None:
        """The round's finite numbers as a history row at step ``round`` (kept for the end, see above)."""
        step = int(record["round"])
        self.last_step = max(self.last_step, step)
        if self.at_the_end:
            self.pending.append((step, scalars(record)))
        else:
            self.run.log(scalars(record), step=step)

    def log_results(self, results: dict[str, Any], output_dir: Path) -> None:
        """The rounds kept for the end, the final results (summary), the plots and files; the run ends."""
        import wandb

        if self.run is None:
            self._start()
            for step, row in self.pending:
                self.run.log({**row, "_timestamp": self.stamp}, step=step)
        images = {f"plots/{name.removesuffix('.png')}": output_dir / name for name in PLOTS}
        present = {key: wandb.Image(str(path)) for key, path in images.items() if path.is_file()}
        if present:
            extra = {"_timestamp": self.stamp} if self.at_the_end else {}
            self.run.log({**present, **extra}, step=self.last_step)
        self.run.summary.update({**final_values(results), "status": str(results.get("status"))})
        if epsilon_holds_for(results):
            self.run.summary["privacy.total.holds_for"] = epsilon_holds_for(results)
        for name in RUN_FILES:  # the run's folder of files: W&B keeps (and syncs) what is in it at the end
            if (output_dir / name).is_file():
                shutil.copyfile(output_dir / name, Path(self.run.dir) / name)
        self.run.finish(exit_code=1 if results.get("status") in ("failed", "interrupted") else 0)
        self.run = False  # finished

    def close(self) -> None:
        """End a W&B run that :meth:`log_results` did not (a run that ended without results)."""
        if self.run:
            self.run.finish(exit_code=1)
            self.run = False
