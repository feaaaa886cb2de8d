"""The Ray instance of one ``python -m fl_app`` command: started early, kept for every job of a sweep.

Starting a private Ray instance costs 2.5-3 s and stopping it 1.4 s (measured with
``benchmarks/startup.py``), which every job of a sweep used to pay. :data:`SESSION` therefore

* begins starting Ray in a background thread as soon as the command's jobs are validated
  (:meth:`RaySession.begin`), while this process goes on with Hydra's job set-up and its imports;
* hands the instance to each job (:meth:`RaySession.ready`), starting it there if nothing began it,
  and starting it again only when a job asks for other settings (``simulation.num_cpus``,
  ``simulation.ray_address``);
* stops it when the command ends (:meth:`RaySession.end`), or after each job unless
  :attr:`RaySession.keep` is set (only ``python -m fl_app``'s own process sets it; jobs a parallel
  launcher runs in worker processes, the Python API and the tests stop Ray after each run).

Each job still gets its own client actors (Flower starts them with the run and
:func:`fl_app.engine.launch.ray_left_running` ends them with it), so no process serves two jobs.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import dataclass
from typing import Any

import psutil

from fl_app.engine.launch import import_ray_modules, start_ray
from fl_app.engine.pool import end_prestarted_actors, prestart_actors
from fl_app.lifecycle import RunFailed, restore_signal_dispositions
from fl_app.run_settings import RunSettings
from fl_app.timeline import mark

#: Longest wait for Ray to start (a busy machine took 12 s; Ray's own timeouts are longer).
START_TIMEOUT_S = 120.0


def client_resources(settings: RunSettings) -> dict[str, Any]:
    """The Ray resources each client actor of a run holds."""
    simulation = settings.simulation
    return {"num_cpus": simulation.client_cpus, "num_gpus": simulation.client_gpus}


def ray_init_args(settings: RunSettings) -> dict[str, Any]:
    """``ray.init``'s arguments for a run (Flower's Ray backend gets the same as its ``init_args``)."""
    simulation = settings.simulation
    init_args: dict[str, Any] = {"logging_level": "ERROR", "log_to_driver": True}
    if simulation.ray_address:
        init_args["address"] = simulation.ray_address
    else:
        init_args["address"] = "local"
        if simulation.num_cpus is not None:
            init_args["num_cpus"] = simulation.num_cpus
    return init_args


@dataclass(frozen=True)
class ActorPlan:
    """The client actors a run's pool will hold: each one's resources, and at most ``limit`` of them."""

    resources: dict[str, Any]
    limit: int | None = None

    @classmethod
    def of(cls, settings: RunSettings) -> ActorPlan:
        """The plan of a run's settings (``simulation.client_cpus``, ...)."""
        return cls(client_resources(settings), settings.simulation.max_concurrent_clients)


class RaySession:
    """One Ray instance per command (module docstring)."""

    def __init__(self) -> None:
        #: Keep Ray running between the jobs of this process (set by ``python -m fl_app``).
        self.keep = False
        #: Jobs of the command still to run here (the next one's actors start when a job ends).
        self.jobs_left = 0
        self._args: dict[str, Any] | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._watch: RayProcessWatch | None = None
        self._started = threading.Event()
        self._release = threading.Event()
        self._actors: ActorPlan | None = None

    def begin(self, init_args: dict[str, Any], actors: ActorPlan | None = None) -> None:
        """Start Ray with ``init_args`` in a background thread (nothing if it is up or starting).

        ``actors``: then start the first run's client actors too (:func:`prestart_actors`).
        """
        if self._args is not None:
            return
        import_ray_modules()
        self._args = dict(init_args)
        self._actors = actors
        self._watch = RayProcessWatch() if init_args.get("address") == "local" else None
        self._started.clear()
        self._release.clear()
        self._thread = threading.Thread(
            target=self._own_ray, args=(self._args,), name="dpfl-ray", daemon=True
        )
        self._thread.start()

    def _own_ray(self, init_args: dict[str, Any]) -> None:
        """Start Ray, then live as long as it: Ray's processes die with the thread that started them.

        Ray starts its GCS and raylet with ``PR_SET_PDEATHSIG`` (fate sharing), which Linux fires
        when the starting *thread* ends, not the process: a thread that returned after ``ray.init``
        killed them (seen: the driver then lost the GCS within a minute).
        """
        try:
            mark("ray_begin")
            start_ray(init_args)
            mark("ray_init")
            if self._actors is not None:
                # before the job may build its pool (ready() waits for _started): an actor started
                # while the pool starts its own would hold a CPU the pool's actor then waits for
                with contextlib.suppress(Exception):  # the run's pool starts its own then
                    prestart_actors(self._actors.resources, self._actors.limit)
                    mark("actors_prestarted")
        except BaseException as error:  # handed to the job that waits for it
            self._error = error
        finally:
            self._started.set()
        self._release.wait()

    def ready(self, init_args: dict[str, Any], actors: ActorPlan | None = None) -> None:
        """Ray is up with ``init_args`` when this returns (waits for :meth:`begin`, or starts it).

        Raises :class:`~fl_app.lifecycle.RunFailed` when Ray did not start.
        """
        if self._args is not None and self._args != dict(init_args):
            self.end()  # this job asks for other settings
        if self._args is None:
            self.begin(init_args, actors)
        self._wait()
        if self._watch is not None:
            self._watch.start()

    def _wait(self) -> None:
        if self._thread is not None and not self._started.wait(START_TIMEOUT_S):
            raise RunFailed(f"Ray did not start within {START_TIMEOUT_S:.0f} s")
        if self._error is not None:
            error, self._error = self._error, None
            self._args = None
            raise RunFailed(f"Ray did not start: {' '.join(str(error).split())}") from error

    def after_job(self) -> None:
        """A job ended: stop Ray unless it is kept for the command's next job (whose actors start now)."""
        self.jobs_left -= 1
        if not self.keep:
            self.end()
        elif self._actors is not None and self.jobs_left > 0:
            with contextlib.suppress(Exception):  # the next run's pool starts its own then
                prestart_actors(self._actors.resources, self._actors.limit)

    def end(self) -> None:
        """Stop Ray and every process it started (waits for a start under way)."""
        if self._thread is not None:
            self._started.wait(START_TIMEOUT_S)
        with contextlib.suppress(Exception):
            end_prestarted_actors()
        shutdown_ray(self._watch)
        self._release.set()
        if self._thread is not None:
            self._thread.join(START_TIMEOUT_S)
        self._args = self._thread = self._watch = None
        self._error = None


#: The session of this process.
SESSION = RaySession()


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
        """Begin sampling (call once Ray is up; again: nothing)."""
        if self._thread.is_alive() or self._stop.is_set():
            return
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

    def processes(self, *, stop: bool = True) -> list[psutil.Process]:
        """The Ray processes seen, after a last look; ``stop``: stop sampling."""
        self._sample()
        if stop:
            self._stop.set()
        return list(self._seen.values())


def _is_ray_process(process: psutil.Process) -> bool:
    try:
        return any("ray" in part for part in [process.name(), *process.cmdline()[:3]])
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


#: The command line of Ray's autoscaler monitor (a private instance starts one; it scales nothing here).
AUTOSCALER_MONITOR = "autoscaler/_private/monitor.py"


def end_autoscaler_monitor(watch: RayProcessWatch) -> None:
    """Kill the private instance's autoscaler monitor before ``ray.shutdown``.

    ``ray.shutdown`` asks each of its processes to exit and waits up to 1 s for each; the monitor
    always used the whole second (measured: 1.00 s of a 1.35 s shutdown, every other process
    0.01-0.03 s). It holds no state a run needs.
    """
    monitors = [p for p in watch.processes(stop=False) if _runs(p, AUTOSCALER_MONITOR)]
    for process in monitors:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(monitors, timeout=REAP_TIMEOUT_S)


def _runs(process: psutil.Process, script: str) -> bool:
    try:
        return any(script in part for part in process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


def shutdown_ray(watch: RayProcessWatch | None = None) -> None:
    """Shut Ray down; with a ``watch``, also end every Ray process it saw that is still running.

    psutil checks a process's start time before signalling it, so a reused pid is never hit.
    """
    ray = sys.modules.get("ray")  # None: this process never imported Ray (an inline command)
    if ray is not None and ray.is_initialized():
        if watch is not None:
            end_autoscaler_monitor(watch)
        ray.shutdown()
    restore_signal_dispositions()  # ray.shutdown (ours or Flower's) resets SIGTERM to its default action
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
