"""Starting Flower's simulation engine in this process, with dpfl's patches (flwr 1.41 private APIs).

* :func:`run_simulation_engine` wraps ``flwr.simulation.run_simulation._run_simulation``, the
  function ``flwr-simulation`` calls: the public ``run_simulation`` passes an empty run config, and
  dpfl's overrides travel in the run config.
* :func:`start_ray` starts Ray with the arguments Flower's Ray backend would use (which then finds it
  running), so the driver can handle SIGTERM itself, and with start-up timeouts a loaded machine needs
  (:data:`RAY_START_TIMEOUT_S`: Ray's own settings, and its 30-s wait for the raylet to register,
  ``ray._private.services.get_node``, made patient: :func:`raylet_registration_wait`).
* :func:`ray_session_folder`: where the instance this process started keeps its logs (Ray's private
  ``_global_node``), which names its processes to :mod:`fl_app.engine.orphan_reaper`.
* :func:`actor_limit` caps the actor pool (Flower sizes it from the whole Ray cluster).
* :func:`watched_from_the_main_thread`: the engine runs on a helper thread, so that a stop signal's
  handler runs at once on the main thread.
* :func:`~fl_app.engine.inline.inline_backend` runs the clients in this process instead
  (``simulation.backend=inline``), :func:`~fl_app.engine.processes.process_backend` in worker
  processes forked from it (``simulation.backend=processes``);
* :func:`ray_left_running` stops Flower's Ray backend from shutting Ray down when a run ends, so
  that the jobs of a sweep share one Ray instance (:mod:`fl_app.engine.ray_session` owns it).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from fl_app.engine import batching
from fl_app.engine.batching import MAX_BATCH, install_batched_workers
from fl_app.engine.dispatch import forget_node_partitions, install_fast_dispatch
from fl_app.engine.inline import client_threads, inline_backend
from fl_app.engine.pool import install_pipelined_pool
from fl_app.engine.processes import process_backend, worker_count
from fl_app.engine.workers import forget_workers


def install_engine_patches(*, ray: bool = True) -> None:
    """Install the fast dispatcher, batched workers and, with ``ray``, the pipelined actor pool (idempotent).

    An inline run (``ray=False``) leaves Flower's Ray backend alone: importing it imports Ray.
    """
    install_fast_dispatch()
    install_batched_workers()
    if ray:
        install_pipelined_pool()


@contextlib.contextmanager
def actor_limit(limit: int | None) -> Any:
    """Build Flower's actor pool with at most ``limit`` actors (None: as many as the cluster holds).

    Flower sizes the pool from the CPUs of the whole Ray cluster (``pool_size_from_resources``):
    on a cluster shared by the jobs of a parallel sweep, every job would ask for all of it, and the
    jobs would queue for the same actors instead of running side by side.
    """
    if limit is None:
        yield
        return
    from flwr.simulation.ray_transport import ray_actor

    original = ray_actor.pool_size_from_resources

    def capped(client_resources: dict[str, int | float]) -> int:
        return min(original(client_resources), limit)

    ray_actor.pool_size_from_resources = capped
    try:
        yield
    finally:
        ray_actor.pool_size_from_resources = original


@contextlib.contextmanager
def ray_left_running(keep: bool) -> Any:
    """With ``keep``, a run's end ends its client actors but leaves Ray running.

    ``RayBackend.terminate`` (flwr 1.41) ends the pool's actors and then calls ``ray.shutdown``;
    starting Ray again for the next job of a sweep costs 2.5-3 s and stopping it 1.4 s (measured,
    benchmarks/startup.py). The actors are still ended with the run, so no process serves two jobs.
    """
    if not keep:
        yield
        return
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    original = RayBackend.terminate

    def terminate_actors_only(self: Any) -> None:
        if self.pool:
            self.pool.terminate_all_actors()

    RayBackend.terminate = terminate_actors_only
    try:
        yield
    finally:
        RayBackend.terminate = original


@contextlib.contextmanager
def ray_backend(max_actors: int | None, keep_ray: bool) -> Any:
    """Flower's Ray backend with dpfl's pool cap (:func:`actor_limit`) and end (:func:`ray_left_running`)."""
    with actor_limit(max_actors), ray_left_running(keep_ray):
        yield


def run_simulation_engine(
    *,
    num_supernodes: int,
    server_app: Any,
    client_app_attr: str,
    app_dir: str,
    server_app_context: Any,
    backend_config: dict[str, Any],
    max_actors: int | None = None,
    messages_per_task: int = MAX_BATCH,
    keep_ray: bool = False,
    backend: str = "ray",
) -> None:
    """Run a ServerApp and ClientApp in Flower's simulation engine, in this process.

    ``server_app`` is the ServerApp object to run (built for the run's composed configuration);
    ``max_actors`` caps the number of client actors (:func:`actor_limit`); ``messages_per_task``
    is the most messages one Ray task carries to an actor (1: one per task, as Flower sends them);
    ``keep_ray``: Ray stays up when the run ends (:func:`ray_left_running`); ``backend``: ``ray``,
    or no Ray at all: ``inline`` (the clients run in this process, :mod:`fl_app.engine.inline`) or
    ``processes`` (in worker processes forked from it, :mod:`fl_app.engine.processes`).
    """
    from flwr.simulation.run_simulation import _run_simulation
    from flwr.supercore.telemetry import EventType

    if messages_per_task < 1:
        raise ValueError(f"messages_per_task must be >= 1, got {messages_per_task}")
    batching.set_messages_per_task(messages_per_task)
    install_engine_patches(ray=backend == "ray")
    forget_node_partitions()  # this run's engine records its own
    forget_workers()
    with client_backend(backend, backend_config, max_actors, keep_ray):  # forks before the engine's threads
        watched_from_the_main_thread(
            lambda: _run_simulation(
                num_supernodes=num_supernodes,
                exit_event=EventType.PYTHON_API_RUN_SIMULATION_LEAVE,
                server_app=server_app,
                client_app_attr=client_app_attr,
                app_dir=app_dir,
                server_app_context=server_app_context,
                backend_config=backend_config,
            )
        )


def client_backend(
    backend: str, backend_config: dict[str, Any], max_actors: int | None, keep_ray: bool
) -> contextlib.AbstractContextManager[Any]:
    """What the engine builds for ``simulation.backend`` while the returned block runs."""
    if backend == "inline":
        return inline_backend()
    if backend == "processes":
        client_cpus = float(backend_config["client_resources"].get("num_cpus", 1.0))
        workers = worker_count(
            num_cpus=backend_config["init_args"].get("num_cpus"), client_cpus=client_cpus, limit=max_actors
        )
        return process_backend(workers, threads=client_threads(backend_config))
    if backend != "ray":
        raise ValueError(f"unknown simulation backend {backend!r}")
    return ray_backend(max_actors, keep_ray)


#: How long the main thread waits at a time for the engine (:func:`watched_from_the_main_thread`).
WATCH_S = 0.2


def watched_from_the_main_thread(run: Callable[[], None]) -> None:
    """Call ``run`` on a helper thread while the main thread waits in short joins; re-raise its error.

    Flower's engine waits on the main thread in a join without timeout (``vce_api.run_api`` leaving its
    thread pool). A SIGTERM the kernel hands to another of the process's threads then runs its Python
    handler only when the main thread next runs Python: the stop request waited for the whole run (a
    suite run under load: the handler's line came after "finished 4 rounds"). Waiting in joins of
    :data:`WATCH_S` seconds, the main thread runs a pending handler within that time. Called off the main
    thread (a sweep's worker thread), ``run`` runs in place.
    """
    if threading.current_thread() is not threading.main_thread():
        run()
        return
    raised: list[BaseException] = []

    def target() -> None:
        try:
            run()
        except BaseException as error:  # handed to the main thread, as if it had run there
            raised.append(error)

    engine = threading.Thread(target=target, name="dpfl-engine", daemon=True)
    engine.start()
    while engine.is_alive():
        engine.join(WATCH_S)
    if raised:
        raise raised[0]


#: The longest Ray may take to start here (seconds): what a 2-core machine at a load of 15-20 needs
#: (Ray's own defaults: 30 s for the raylet to register, 60 s for a GCS request or a worker to register).
RAY_START_TIMEOUT_S = 300.0
#: Ray's start-up timeouts read from the environment (Ray 2.55; its processes inherit them), in seconds.
RAY_TIMEOUT_VARIABLES = ("RAY_gcs_server_request_timeout_seconds", "RAY_worker_register_timeout_seconds")
#: Seconds between two asks for the raylet's registration while Ray starts.
REGISTRATION_POLL_S = 0.5


def ray_start_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """Ray's start-up timeouts to set: :data:`RAY_START_TIMEOUT_S` for each one ``environ`` leaves unset."""
    value = str(int(RAY_START_TIMEOUT_S))
    return {name: value for name in RAY_TIMEOUT_VARIABLES if not environ.get(name)}


@contextlib.contextmanager
def raylet_registration_wait(timeout_s: float) -> Iterator[None]:
    """While in the block, Ray's start waits up to ``timeout_s`` for the raylet to register (not 30 s).

    ``ray._private.node.Node`` (Ray 2.55) asks ``ray._private.services.get_node`` until it answers and
    gives up after a fixed 30 s ("The current node timed out during startup"), too short on a loaded
    machine. In the block each ask retries for the rest of ``timeout_s`` before it fails.
    """
    from ray._private import services

    original = services.get_node
    deadline = time.monotonic() + timeout_s

    def patient(*args: Any, **kwargs: Any) -> Any:
        while True:
            try:
                return original(*args, **kwargs)
            except RuntimeError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(REGISTRATION_POLL_S)

    services.get_node = patient
    try:
        yield
    finally:
        services.get_node = original


def start_ray(init_args: dict[str, Any]) -> None:
    """Start (or join) Ray exactly as Flower's Ray backend would, before the engine does.

    ``RayBackend.init_ray`` (flwr 1.41) skips ``ray.init`` when Ray is already up; starting it
    here lets the caller keep its own SIGTERM handler (``ray.init`` replaces the driver's with one
    that exits at once when it runs on the main thread; :mod:`fl_app.engine.ray_session` runs it on its
    own). Same arguments as Flower's: the backend's ``init_args``, no dashboard, and this process's
    ``sys.path`` as the workers' ``PYTHONPATH``. Ray's start-up timeouts are :data:`RAY_START_TIMEOUT_S`
    unless the environment sets them (:func:`ray_start_environment`, :func:`raylet_registration_wait`).
    """
    import sys

    import ray

    if ray.is_initialized():
        return
    pythonpath = os.pathsep.join(sys.path)
    if os.environ.get("PYTHONPATH"):
        pythonpath = f"{pythonpath}{os.pathsep}{os.environ['PYTHONPATH']}"
    os.environ["PYTHONPATH"] = pythonpath
    os.environ.update(ray_start_environment(os.environ))
    with raylet_registration_wait(RAY_START_TIMEOUT_S):
        ray.init(
            runtime_env={"env_vars": {"PYTHONPATH": pythonpath}}, **{"include_dashboard": False, **init_args}
        )


def ray_session_folder() -> str | None:
    """The session folder of the Ray instance this process started (its processes' logs), or None."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    try:
        return None if node is None else str(node.get_session_dir_path())
    except Exception:  # a Ray without it: the session is found by its driver's id
        return None


def import_ray_modules() -> None:
    """Import Ray and Flower's Ray transport in this thread, before a background thread uses them.

    Two threads importing the same circularly-importing package at once can deadlock; Python then
    raises in one of them (seen: ``deadlock detected by _ModuleLock('flwr.simulation.ray_transport')``
    when the start thread and the job imported Flower's simulation together). Imported here, the
    start thread only finds them in ``sys.modules``.
    """
    import ray  # noqa: F401
    from flwr.simulation.ray_transport import ray_actor  # noqa: F401
