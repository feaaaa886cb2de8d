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
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from fl_app.config.settings import RunSettings
from fl_app.engine.launch import RAY_START_TIMEOUT_S, import_ray_modules, ray_session_folder, start_ray
from fl_app.engine.orphan_reaper import OwnerWatch, watch_owner
from fl_app.engine.pool import end_prestarted_actors, prestart_actors
from fl_app.run.lifecycle import RunFailed, RunInterrupted, restore_signal_dispositions, stop_requested
from fl_app.run.timeline import mark

#: Longest wait for Ray to start (a busy machine took 12 s; a 2-core one at a load of 15-20 more than Ray's
#: own 30-s limit, which :func:`fl_app.engine.launch.start_ray` lifts to the same), and a little more.
START_TIMEOUT_S = RAY_START_TIMEOUT_S + 30.0
#: What a failure of Ray's start says besides its reason: the backend that needs no Ray.
WITHOUT_RAY = "simulation.backend=processes runs the clients without Ray"


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


#: Environment variable (a test hook): seconds a Ray start waits, once Ray is up, before it reports.
#: It makes "Ray is still starting" last as long as a test needs, without relying on a loaded machine.
INJECT_START_DELAY_ENV = "DPFL_INJECT_RAY_START_DELAY"
#: How often a job waiting for Ray looks for a stop request (SIGINT, SIGTERM, the sweep's stop file).
STOP_POLL_S = 0.2


@dataclass
class _Start:
    """One start of Ray by the session: its arguments, its thread and what the thread reports."""

    args: dict[str, Any]
    actors: ActorPlan | None
    owner: OwnerWatch | None
    thread: threading.Thread | None = None
    #: ``ray.init`` returned (this process is Ray's driver now).
    initialised: bool = False
    #: The start reported: Ray is up and the actors started, or it failed (:attr:`error`).
    started: threading.Event = field(default_factory=threading.Event)
    #: Report at once: skip what is left (the actors' prestart).
    cancel: threading.Event = field(default_factory=threading.Event)
    #: The thread may end (Ray's GCS and raylet die with it).
    release: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class RaySession:
    """One Ray instance per command (module docstring)."""

    def __init__(self) -> None:
        #: Keep Ray running between the jobs of this process (set by ``python -m fl_app``).
        self.keep = False
        #: Jobs of the command still to run here (the next one's actors start when a job ends).
        self.jobs_left = 0
        #: This process ends with the command (``python -m fl_app``, ``dpfl run``): a start still under
        #: way when the session ends is abandoned, not waited for (elsewhere, e.g. a Python caller,
        #: it is waited for and shut down: an abandoned ``ray.init`` whose GCS is gone ends its process
        #: within a minute).
        self.ends_with_process = False
        self._start: _Start | None = None
        self._watch: RayProcessWatch | None = None
        self._abandoned: list[_Start] = []

    def begin(self, init_args: dict[str, Any], actors: ActorPlan | None = None) -> None:
        """Start Ray with ``init_args`` in a background thread (nothing if it is up or starting).

        ``actors``: then start the first run's client actors too (:func:`prestart_actors`). A private
        instance's processes carry a mark and a watchdog ends them if this process dies
        (:func:`~fl_app.engine.orphan_reaper.watch_owner`).
        """
        if self._start is not None:
            return
        self._forget_abandoned()
        import_ray_modules()
        local = init_args.get("address") == "local"
        owner = watch_owner() if local else None  # before the watch: the watchdog is not one of Ray's
        self._watch = RayProcessWatch() if local else None
        start = _Start(dict(init_args), actors, owner)
        start.thread = threading.Thread(target=_own_ray, args=(start,), name="dpfl-ray", daemon=True)
        self._start = start
        start.thread.start()

    def ready(self, init_args: dict[str, Any], actors: ActorPlan | None = None) -> None:
        """Ray is up with ``init_args`` when this returns (waits for :meth:`begin`, or starts it).

        Raises :class:`~fl_app.run.lifecycle.RunInterrupted` when a stop is requested while Ray starts
        (at once: the start is then abandoned by :meth:`end`), :class:`~fl_app.run.lifecycle.RunFailed`
        when Ray did not start.
        """
        if self._start is not None and self._start.args != dict(init_args):
            self.end()  # this job asks for other settings
        if self._start is None:
            self.begin(init_args, actors)
        self._wait()
        if self._watch is not None:
            self._watch.start()

    def _wait(self) -> None:
        start = self._start
        if start is None:
            return
        deadline = time.monotonic() + START_TIMEOUT_S
        while not start.started.wait(STOP_POLL_S):
            # ray.init put its own SIGTERM handler in the kernel (it prints a stack and aborts)
            if start.initialised:
                restore_signal_dispositions()
            signum = stop_requested()
            if signum is not None:
                raise RunInterrupted(signum)
            if time.monotonic() > deadline:
                raise RunFailed(f"Ray did not start within {START_TIMEOUT_S:.0f} s; {WITHOUT_RAY}")
        if start.error is not None:
            signum = stop_requested()  # the group's signal killed Ray's processes: the start failed of it
            if signum is not None:
                raise RunInterrupted(signum) from start.error
            reason = " ".join(str(start.error).split())
            raise RunFailed(f"Ray did not start: {reason}; {WITHOUT_RAY}") from start.error

    def after_job(self) -> None:
        """A job ended: stop Ray unless it is kept for the command's next job (whose actors start now)."""
        self.jobs_left -= 1
        if not self.keep:
            self.end()
        elif self._start is not None and self._start.actors is not None and self.jobs_left > 0:
            with contextlib.suppress(Exception):  # the next run's pool starts its own then
                prestart_actors(self._start.actors.resources, self._start.actors.limit)

    def end(self) -> None:
        """Stop Ray and every process it started.

        In a process that ends with the command (:attr:`ends_with_process`), a start still inside
        ``ray.init`` is not waited for (a stop while Ray starts: 40-50 s on a loaded machine, and a
        start whose processes a group's signal killed fails only after a minute): its processes are
        killed now, and its thread ends with the process.
        """
        start, self._start = self._start, None
        if start is not None and not start.started.is_set():
            if not start.initialised and self.ends_with_process:
                self._abandon(start)
                return
            start.cancel.set()  # skip the actors' prestart, then shut Ray down as usual
            start.started.wait(START_TIMEOUT_S)
        with contextlib.suppress(Exception):
            end_prestarted_actors()
        shutdown_ray(self._watch)
        self._watch = None
        if start is not None:
            start.release.set()
            if start.thread is not None:
                start.thread.join(START_TIMEOUT_S)
            if start.owner is not None:
                start.owner.close()  # the watchdog ends any straggler, then exits

    def _abandon(self, start: _Start) -> None:
        """Kill what a start under way has started so far; its thread ends on its own."""
        start.cancel.set()
        start.release.set()
        self._watch = None
        if start.owner is not None:
            start.owner.quiet()  # this process ended the start: the watchdog needs no line
            start.owner.unmark()
            start.owner.end_now()
        self._abandoned.append(start)
        restore_signal_dispositions()

    def _forget_abandoned(self) -> None:
        """Before a new start: wait for abandoned starts to end (bounded), shut down what they left."""
        for start in self._abandoned:
            if start.thread is not None:
                start.thread.join(START_TIMEOUT_S)
            shutdown_ray()
            if start.owner is not None:
                start.owner.close()
        self._abandoned.clear()


def _own_ray(start: _Start) -> None:
    """Start Ray, then live as long as it: Ray's processes die with the thread that started them.

    Ray starts its GCS and raylet with ``PR_SET_PDEATHSIG`` (fate sharing), which Linux fires
    when the starting *thread* ends, not the process: a thread that returned after ``ray.init``
    killed them (seen: the driver then lost the GCS within a minute).
    """
    try:
        mark("ray_begin")
        start_ray(start.args)
        start.initialised = True
        folder = ray_session_folder()
        if start.owner is not None and folder is not None:
            start.owner.tell_session(folder)  # the watchdog finds the renamed workers by their logs
        mark("ray_init")
        delay = float(os.environ.get(INJECT_START_DELAY_ENV, "") or 0)
        if delay > 0:
            start.cancel.wait(delay)
        if start.actors is not None and not start.cancel.is_set():
            # before the job may build its pool (ready() waits for started): an actor started
            # while the pool starts its own would hold a CPU the pool's actor then waits for
            with contextlib.suppress(Exception):  # the run's pool starts its own then
                prestart_actors(start.actors.resources, start.actors.limit)
                mark("actors_prestarted")
    except BaseException as error:  # handed to the job that waits for it
        start.error = error
    finally:
        start.started.set()
    start.release.wait()


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
