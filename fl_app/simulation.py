"""Run the app as a Ray-backed Flower simulation from Python (``python -m fl_app``).

This starts exactly what ``flwr run .`` starts in a local simulation federation:
the ServerApp ``fl_app.server_app:app`` and the ClientApp
``fl_app.client_app:app`` under Flower's simulation engine, with the Hydra
overrides in the run config. It goes through :mod:`fl_app.engine`, the one seam to
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
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil
from flwr.app import Context, RecordDict
from omegaconf import DictConfig

from fl_app.config import overrides_to_run_config
from fl_app.engine.launch import run_simulation_engine, start_ray
from fl_app.lifecycle import (
    Outcome,
    RunFailed,
    reinstall_handlers,
    stop_on_signals,
    stop_requested,
    take_outcome,
)
from fl_app.run_settings import RunSettings
from fl_app.server_app import server_app_for

PROJECT_ROOT: Path = Path(__file__).resolve().parent.parent
CLIENT_APP = "fl_app.client_app:app"


def backend_config(cfg: DictConfig) -> dict[str, Any]:
    """Ray backend settings from the ``simulation`` group."""
    simulation = RunSettings.from_config(cfg).simulation
    init_args: dict[str, Any] = {"logging_level": "ERROR", "log_to_driver": True}
    if simulation.ray_address:
        init_args["address"] = simulation.ray_address
    else:
        init_args["address"] = "local"
        if simulation.num_cpus is not None:
            init_args["num_cpus"] = simulation.num_cpus
    return {
        "client_resources": {"num_cpus": simulation.client_cpus, "num_gpus": simulation.client_gpus},
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
    settings = RunSettings.from_config(cfg)
    backend = backend_config(cfg)
    watch = RayProcessWatch() if not settings.simulation.ray_address else None
    with stop_on_signals():
        try:
            start_ray(backend["init_args"])
            reinstall_handlers()  # ray.init replaced the SIGTERM handler
            if watch is not None:
                watch.start()
            run_simulation_engine(
                num_supernodes=settings.num_clients,
                server_app=server_app_for(cfg),
                client_app_attr=CLIENT_APP,
                app_dir=str(PROJECT_ROOT),
                server_app_context=context,
                backend_config=backend,
                max_actors=settings.simulation.max_concurrent_clients,
                messages_per_task=settings.simulation.messages_per_task,
            )
        finally:
            shutdown_ray(watch)
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
#: How often the watch looks at this process's descendants.
WATCH_INTERVAL_S = 0.5
#: The longest interval between two looks, reached while no new Ray process appears.
WATCH_MAX_INTERVAL_S = 8.0


class RayProcessWatch:
    """Remembers every Ray process this process starts while a simulation runs.

    Flower's Ray backend calls ``ray.shutdown`` when the run ends. That stops the raylet and
    GCS, but the actor processes outlive them for 2-3 s (measured), re-parented to init:
    after the shutdown they are no longer this process's descendants. A daemon thread
    therefore samples the descendants every :data:`WATCH_INTERVAL_S` while the run is up
    (actors live for the whole run), and :func:`shutdown_ray` ends whichever of them are
    still alive. Processes that existed before the watch started are never touched.
    """

    def __init__(self) -> None:
        self._before = {child.pid for child in psutil.Process().children(recursive=True)}
        self._seen: dict[int, psutil.Process] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample_until_stopped, name="dpfl-ray-watch", daemon=True)

    def start(self) -> None:
        """Begin sampling (call once Ray is up)."""
        self._sample()
        self._thread.start()

    def _sample(self) -> None:
        for child in psutil.Process().children(recursive=True):
            if child.pid not in self._before and child.pid not in self._seen and _is_ray_process(child):
                self._seen[child.pid] = child

    def _sample_until_stopped(self) -> None:
        # Actors start with the run and live as long as it: once no new process has appeared for a
        # while, look less often (each look scans /proc: 3 % of a core at every 0.5 s).
        interval = WATCH_INTERVAL_S
        while not self._stop.wait(interval):
            known = len(self._seen)
            self._sample()
            grew = len(self._seen) > known
            interval = WATCH_INTERVAL_S if grew else min(2 * interval, WATCH_MAX_INTERVAL_S)

    def processes(self) -> list[psutil.Process]:
        """Stop sampling (after a last look) and return the Ray processes seen."""
        self._sample()
        self._stop.set()
        return list(self._seen.values())


def _is_ray_process(process: psutil.Process) -> bool:
    try:
        return any("ray" in part for part in [process.name(), *process.cmdline()[:3]])
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def shutdown_ray(watch: RayProcessWatch | None = None) -> None:
    """Shut Ray down; with a ``watch``, also end every Ray process it saw that is still running.

    psutil checks a process's start time before signalling it, so a reused pid is never hit.
    """
    import ray

    if ray.is_initialized():
        ray.shutdown()
    if watch is None:
        return
    processes = [p for p in watch.processes() if p.is_running()]
    for process in processes:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.terminate()
    _, alive = psutil.wait_procs(processes, timeout=REAP_TIMEOUT_S)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=REAP_TIMEOUT_S)
