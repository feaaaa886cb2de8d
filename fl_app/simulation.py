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

import contextlib
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flwr.app import Context, RecordDict
from omegaconf import DictConfig

from fl_app.config import overrides_to_run_config
from fl_app.flower_engine import run_simulation_engine, start_ray
from fl_app.lifecycle import (
    Outcome,
    RunFailed,
    reinstall_handlers,
    stop_on_signals,
    stop_requested,
    take_outcome,
)

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


def run_in_simulation(cfg: DictConfig, overrides: Sequence[str], output_dir: Path) -> Outcome:
    """Run the configured experiment as a local simulation; results go to ``output_dir``.

    SIGINT and SIGTERM stop the run (:mod:`fl_app.lifecycle`). Returns how the run ended;
    raises :class:`~fl_app.lifecycle.RunFailed` when it failed.
    """
    context = Context(
        run_id=secrets.randbits(63),
        node_id=0,
        node_config={},
        state=RecordDict(),
        run_config=overrides_to_run_config(list(overrides), str(output_dir)),
    )
    backend = backend_config(cfg)
    own_ray = not cfg.simulation.ray_address
    before = _child_pids()
    with stop_on_signals():
        try:
            start_ray(backend["init_args"])
            reinstall_handlers()  # ray.init replaced the SIGTERM handler
            run_simulation_engine(
                num_supernodes=int(cfg.num_clients),
                server_app_attr=SERVER_APP,
                client_app_attr=CLIENT_APP,
                app_dir=str(PROJECT_ROOT),
                server_app_context=context,
                backend_config=backend,
            )
        finally:
            shutdown_ray(reap_children=own_ray, keep=before)
    outcome = take_outcome()
    if outcome is None:  # the ServerApp refused the configuration or ended without a run
        signum = stop_requested()
        if signum is not None:
            return Outcome("interrupted", 128 + signum, "stopped before the run began", str(output_dir))
        raise RunFailed("the run ended without results (see run.log)")
    if outcome.status == "failed":
        raise RunFailed(outcome.reason)
    return outcome


#: Seconds to wait for Ray's processes to exit after ``ray.shutdown`` before killing them.
REAP_TIMEOUT_S = 3.0


def _child_pids() -> set[int]:
    import psutil

    return {child.pid for child in psutil.Process().children(recursive=True)}


def _is_ray_process(process: Any) -> bool:
    import psutil

    try:
        return any("ray" in part for part in [process.name(), *process.cmdline()[:3]])
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def shutdown_ray(*, reap_children: bool, keep: set[int] = frozenset()) -> None:  # type: ignore[assignment]
    """Shut Ray down; with ``reap_children``, also end the Ray processes this one started.

    ``ray.shutdown`` stops the raylet and GCS, but actor processes notice only later (seen: 2-20 s);
    a run that started its own Ray instance leaves nothing behind when it returns. Processes in
    ``keep`` (children that existed before Ray started) are left alone.
    """
    import psutil
    import ray

    children = []
    if reap_children:
        children = [
            child
            for child in psutil.Process().children(recursive=True)
            if child.pid not in keep and _is_ray_process(child)
        ]
    if ray.is_initialized():
        ray.shutdown()
    if not children:
        return
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.terminate()
    _, alive = psutil.wait_procs(children, timeout=REAP_TIMEOUT_S)
    for child in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()
    psutil.wait_procs(alive, timeout=REAP_TIMEOUT_S)
