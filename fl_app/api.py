"""The Python API: run an experiment from a notebook or script and get its results.

>>> from fl_app import run_experiment
>>> results = run_experiment("strategy=dp_fedavg", "privacy.epsilon=4", output_dir="runs/dp4")
>>> results["final"]["accuracy"], results["final"]["epsilon"]

The same overrides as ``python -m fl_app`` (Hydra syntax, one string each), composed and validated
by the same functions before anything runs: a bad value raises
:class:`fl_app.config.validation.ConfigError` (its ``key``, ``value`` and ``allowed`` say what is wrong)
and nothing is written. The run is the same Ray-backed Flower simulation; it writes the same files
(``results.json``, plots, model, privacy ledger) into ``output_dir`` and returns the parsed
``results.json`` (its contract: :mod:`fl_app.run.results`). A run that fails raises
:class:`fl_app.run.lifecycle.RunFailed`; an interrupted one (Ctrl-C) returns its partial results with
``status == "interrupted"``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fl_app.config.compose import compose_config, with_values
from fl_app.config.validation import check_output_dir, validate_config
from fl_app.run.output_claim import claim_output_dir
from fl_app.run.results import RESULTS_FILE

#: Where runs go when no ``output_dir`` is given (relative to the working directory).
DEFAULT_ROOT = Path("outputs") / "api"


def run_experiment(*overrides: str, output_dir: str | Path | None = None) -> dict[str, Any]:
    """Run one experiment as a local simulation and return its ``results.json`` as a dict.

    Parameters
    ----------
    *overrides : str
        Hydra overrides, e.g. ``"strategy=dp_fedavg"``, ``"privacy.epsilon=4"``,
        ``"+experiment=compare_cross_device"``.
    output_dir : str or Path, optional
        Where the run's files go; it must not hold an earlier run. Default:
        ``outputs/api/<date>_<time>-<strategy>`` under the working directory.

    Returns
    -------
    dict
        The run's results (``final``, ``rounds``, ``privacy``, ``config``, ``status``), with
        ``output_dir`` added.

    """
    from fl_app.engine.simulation import run_in_simulation

    items = [str(item) for item in overrides]
    if output_dir is not None:
        items.append(f"output_dir={Path(output_dir).expanduser().resolve()}")
    cfg = compose_config(items)
    if cfg.output_dir is None:  # the default directory is named by the composed strategy
        stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
        directory = (DEFAULT_ROOT / f"{stamp}-{cfg.strategy.name}").resolve()
        items.append(f"output_dir={directory}")
        cfg = with_values(cfg, {"output_dir": str(directory)})
    settings = validate_config(cfg)
    check_output_dir(cfg)
    directory = Path(str(settings.output_dir))
    with claim_output_dir(directory, resume=settings.resume is not None):
        run_in_simulation(settings, items, directory)
    results = json.loads((directory / RESULTS_FILE).read_text())
    results["output_dir"] = str(directory)
    return results
