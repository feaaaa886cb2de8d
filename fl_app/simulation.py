"""Run the app as a Ray-backed Flower simulation from Python (``python -m fl_app``).

This starts exactly what ``flwr run .`` starts in a local simulation federation:
the ServerApp ``fl_app.server_app:app`` and the ClientApp
``fl_app.client_app:app`` under Flower's simulation engine, with the Hydra
overrides in the run config. It goes through :mod:`fl_app.flower_engine`, the one adapter to
Flower's private simulation APIs (the public ``run_simulation`` passes an empty
run config). Ray is shut down when the run
ends, also on failure, so nothing is left running.

``simulation.ray_address`` joins an existing Ray cluster (``ray start --head``
on one machine, ``ray start --address=<head>:6379`` on the others) instead of
starting a private instance. Without it the run always starts a private
instance (Ray's ``address="local"``): a bare ``ray.init()`` would join a
cluster that ``ray start`` left running on this machine.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flwr.app import Context, RecordDict
from omegaconf import DictConfig

from fl_app.config import overrides_to_run_config
from fl_app.flower_engine import run_simulation_engine

PROJECT_ROOT: Path = Path(__file__).resolve().parent.parent
SERVER_APP = "fl_app.server_app:app"
CLIENT_APP = "fl_app.client_app:app"


def backend_config(cfg: DictConfig) -> dict[str, Any]:
    """Ray backend settings from the ``simulation`` group."""
    init_args: dict[str, Any] = {"logging_level": "ERROR", "log_to_driver": True}
    if cfg.simulation.ray_address:
        init_args["address"] = str(cfg.simulation.ray_address)
    else:
        init_args["address"] = "local"
        if cfg.simulation.num_cpus is not None:
            init_args["num_cpus"] = int(cfg.simulation.num_cpus)
    return {
        "client_resources": {"num_cpus": float(cfg.simulation.client_cpus), "num_gpus": 0.0},
        "init_args": init_args,
    }


def run_in_simulation(cfg: DictConfig, overrides: Sequence[str], output_dir: Path) -> None:
    """Run the configured experiment as a local simulation; results go to ``output_dir``."""
    context = Context(
        run_id=secrets.randbits(63),
        node_id=0,
        node_config={},
        state=RecordDict(),
        run_config=overrides_to_run_config(list(overrides), str(output_dir)),
    )
    try:
        run_simulation_engine(
            num_supernodes=int(cfg.num_clients),
            server_app_attr=SERVER_APP,
            client_app_attr=CLIENT_APP,
            app_dir=str(PROJECT_ROOT),
            server_app_context=context,
            backend_config=backend_config(cfg),
        )
    finally:
        _shutdown_ray()


def _shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
