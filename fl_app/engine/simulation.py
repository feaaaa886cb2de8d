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
cluster that ``ray start`` left running on this machine. The instance belongs to
:data:`fl_app.engine.ray_session.SESSION`: a sweep's jobs share it. ``simulation.backend=inline`` and
``processes`` start no Ray at all: the clients run in this process (:mod:`fl_app.engine.inline`) or
in worker processes forked from it (:mod:`fl_app.engine.processes`).
"""

from __future__ import annotations

import contextlib
import secrets
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from flwr.app import Context, RecordDict

from fl_app.config.compose import overrides_to_run_config
from fl_app.config.settings import RunSettings
from fl_app.engine.launch import run_simulation_engine
from fl_app.engine.ray_session import SESSION, ActorPlan, client_resources, ray_init_args
from fl_app.run.lifecycle import (
    Outcome,
    RunFailed,
    RunInterrupted,
    reinstall_handlers,
    restore_signal_dispositions,
    stop_on_signals,
    stop_requested,
    take_outcome,
)
from fl_app.run.results import write_unstarted_results
from fl_app.run.timeline import mark
from fl_app.server_app import server_app_for

PROJECT_ROOT: Path = Path(__file__).resolve().parents[2]
CLIENT_APP = "fl_app.client_app:app"


def backend_config(settings: RunSettings) -> dict[str, Any]:
    """Ray backend settings from the ``simulation`` group."""
    return {"client_resources": client_resources(settings), "init_args": ray_init_args(settings)}


def run_in_simulation(settings: RunSettings, overrides: Sequence[str], output_dir: Path) -> Outcome:
    """Run the configured experiment as a local simulation; results go to ``output_dir``.

    SIGINT and SIGTERM stop the run (:mod:`fl_app.run.lifecycle`). Returns how the run ended;
    raises :class:`~fl_app.run.lifecycle.RunFailed` when it failed.
    """
    context = Context(
        run_id=secrets.randbits(63),
        node_id=0,
        node_config={},
        state=RecordDict(),
        run_config=overrides_to_run_config(list(overrides), str(output_dir)),
    )
    backend = backend_config(settings)
    uses_ray = settings.simulation.uses_ray
    outcome: Outcome | None = None
    with stop_on_signals():
        try:
            mark("job")
            if uses_ray:
                actors = ActorPlan(backend["client_resources"], settings.simulation.max_concurrent_clients)
                try:
                    SESSION.ready(backend["init_args"], actors)
                except RunInterrupted as stop:  # while Ray was starting: nothing ran
                    return stopped_before_the_run(settings, output_dir, stop, "while Ray was starting")
                reinstall_handlers()  # if a library replaced the stop handlers (ray.init does on this thread)
                mark("ray_started")
            run_simulation_engine(
                num_supernodes=settings.num_clients,
                server_app=server_app_for(settings),
                client_app_attr=CLIENT_APP,
                app_dir=str(PROJECT_ROOT),
                server_app_context=context,
                backend_config=backend,
                max_actors=settings.simulation.max_concurrent_clients,
                messages_per_task=settings.simulation.messages_per_task,
                keep_ray=True,  # SESSION shuts Ray down (and puts back the SIGTERM handler it resets)
                backend=settings.simulation.backend,
            )
            outcome = take_outcome()
        finally:
            restore_signal_dispositions()  # Flower's Ray backend may have shut Ray down (it resets SIGTERM)
            mark("engine_done")
            if not uses_ray:
                SESSION.jobs_left -= 1  # nothing of Ray's to keep or end
            elif outcome is not None and outcome.status.startswith("completed"):
                SESSION.after_job()  # kept for the sweep's next job when SESSION.keep
            else:  # a failed or stopped run may leave Ray unwell: the next job starts a fresh one
                SESSION.end()
            mark("ray_stopped")
    if outcome is None:  # the ServerApp refused the configuration or ended without a run
        signum = stop_requested()
        if signum is not None:
            return stopped_before_the_run(
                settings, output_dir, RunInterrupted(signum), "before the ServerApp ran"
            )
        raise RunFailed("the run ended without results (see run.log)")
    if outcome.status == "failed":
        raise RunFailed(outcome.reason)
    return outcome


def stopped_before_the_run(
    settings: RunSettings, output_dir: Path, stop: RunInterrupted, when: str
) -> Outcome:
    """A stop before the ServerApp began: a ``results.json`` saying nothing ran, one line, the outcome.

    The folder then holds no round: a new run into it reuses it, and ``resume=`` says there is nothing
    to continue. A full disk leaves the folder as it was (a new run accepts it too).
    """
    reason = f"{stop} {when}"
    with contextlib.suppress(OSError):
        write_unstarted_results(output_dir, settings, status=stop.status, reason=reason)
    print(
        f"dpfl: run {stop.status} before its first round: {reason}; results in {output_dir}; nothing to "
        "resume (no round completed)",
        file=sys.stderr,
        flush=True,
    )
    return Outcome(stop.status, stop.exit_code, reason, str(output_dir))
