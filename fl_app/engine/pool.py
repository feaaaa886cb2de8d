"""Flower's actor pool, pipelined: each actor holds two messages (flwr 1.41 private APIs).

:func:`install_pipelined_pool` replaces ``RayBackend.build``: every actor of the pool is lent
``PIPELINE_DEPTH`` times. Flower lends an actor to one message at a time; between two messages the
actor waits for the driver to fetch the reply, store it and submit the next (measured: 3 ms per
round trip on 2 busy cores, while the MLP's client work is 1.5 ms). With a second message already
queued at the actor, Ray starts it as soon as the first ends. Actors still run one message at a
time, in order; only the wait is hidden. The same install makes the ClientApp loader Flower ships
with every message a reference to a module function (a few bytes) instead of a closure that
``cloudpickle`` serialises by value on every call, and builds the pool's actors as
:class:`~fl_app.engine.batching.BatchingActor` (several messages per task).

:func:`prestart_actors` starts a run's actors before Flower builds its pool (while the driver is
still validating, or between the jobs of a sweep); the pool then takes them instead of starting its
own. A prestarted actor has served no run: it has only imported what the first message needs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from fl_app.engine.batching import BATCHING_FLAG, Batching, batching_actor_type, ray_batch_sender
from fl_app.engine.workers import record_workers

#: Messages each Ray actor may hold at once (1 is Flower's own behaviour).
PIPELINE_DEPTH = 2


_pool_installed = False
_original_build: Callable[..., None] | None = None
#: Actors :func:`prestart_actors` started, and the resources each holds.
_prestarted: list[Any] = []
_prestarted_resources: dict[str, Any] = {}


def load_dpfl_client_app() -> Any:
    """The dpfl ClientApp (``fl_app.client_app:app``), imported once per process.

    A module-level function: ``cloudpickle`` sends it by reference, so an actor
    call carries its name, not its code.
    """
    from fl_app.client_app import app

    return app


class BalancedSlots(list):  # type: ignore[type-arg]
    """The pool's lendable slots: every actor ``depth`` times; ``pop()`` lends the least busy actor.

    Flower's pool lends ``pool.pop()`` (the last slot) and gives it back with ``append``. With
    several slots per actor that is a stack: when fewer messages are in flight than there are
    slots, the same few slots at the end are lent again and again, and they can all belong to
    one actor, leaving the other idle (half the throughput) and a dead actor unnoticed (a killed
    worker went undetected for a whole run in a test). ``pop()`` therefore lends a slot of the actor
    with the most free slots, ties going round-robin.
    """

    def __init__(self, actors: list[Any], depth: int) -> None:
        if depth < 1:
            raise ValueError(f"pipeline depth must be >= 1, got {depth}")
        super().__init__(actor for _ in range(depth) for actor in actors)
        self._order = list(actors)
        self._next = 0

    def pop(self, index: Any = -1) -> Any:
        """A slot of the least busy actor (``index`` is ignored: any free slot serves)."""
        if not self:
            raise IndexError("pop from an empty pool")
        free = {id(actor): 0 for actor in self._order}
        for actor in self:
            free[id(actor)] = free.get(id(actor), 0) + 1
        most = max(free.values())
        count = len(self._order)
        for step in range(count):
            actor = self._order[(self._next + step) % count]
            if free[id(actor)] == most:
                self._next = (self._next + step + 1) % count
                self.remove(actor)
                return actor
        return super().pop(index)  # an actor appended from outside the order


def pipeline_pool(pool: Any, depth: int) -> None:
    """Turn a freshly built ``BasicActorPool`` into one that lends each actor ``depth`` times.

    ``num_actors`` becomes the number of slots: Flower starts one worker thread per
    ``num_workers`` (= ``pool.num_actors``), and each thread keeps one message in flight.
    Terminating ends each actor once, quietly (``ray.kill``).
    """
    actors = list(dict.fromkeys(pool.pool))
    pool.pool = BalancedSlots(actors, depth)
    pool.num_actors = len(pool.pool)

    def terminate_all_actors() -> None:
        # Flower's ``actor.terminate.remote()`` makes every actor log a WARNING ("Manually
        # terminating ClientAppActor") that Ray forwards to the console at the end of every run;
        # the run is over, so end them quietly.
        import ray

        for actor in actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)

    pool.terminate_all_actors = terminate_all_actors


def prestart_actors(client_resources: dict[str, Any], limit: int | None = None) -> None:
    """Start the next run's client actors now (as many as its pool will hold; Ray must be up).

    Starting an actor is a new worker process that imports Flower, dpfl and torch: 2-3 s before the
    first reply (measured, benchmarks/startup.py), which the driver otherwise waits out after it
    has built the pool. Actors started for other resources are ended first.
    """
    from flwr.simulation.ray_transport.ray_actor import pool_size_from_resources

    if _prestarted and _prestarted_resources != client_resources:
        end_prestarted_actors()
    count = pool_size_from_resources(client_resources)
    if limit is not None:
        count = min(count, limit)
    actor_type = batching_actor_type()
    while len(_prestarted) < count:
        _prestarted.append(actor_type.options(**client_resources).remote())
    _prestarted_resources.clear()
    _prestarted_resources.update(client_resources)


def end_prestarted_actors() -> None:
    """End the actors :func:`prestart_actors` started that no pool took."""
    if not _prestarted:  # none (an inline command never imports Ray)
        _prestarted_resources.clear()
        return
    import ray

    for actor in _prestarted:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)
    _prestarted.clear()
    _prestarted_resources.clear()


@contextlib.contextmanager
def prestarted_actors_first(client_resources: dict[str, Any]) -> Any:
    """While Flower builds a pool for ``client_resources``, it takes the prestarted actors first."""
    from flwr.simulation.ray_transport.ray_actor import BasicActorPool

    if not _prestarted or _prestarted_resources != client_resources:
        end_prestarted_actors()
        yield
        return
    original = BasicActorPool.add_actors_to_pool

    def add_actors_to_pool(pool: Any, num_actors: int) -> None:
        for _ in range(num_actors):
            pool.pool.append(_prestarted.pop() if _prestarted else pool.create_actor_fn())
        pool.num_actors += num_actors

    BasicActorPool.add_actors_to_pool = add_actors_to_pool
    try:
        yield
    finally:
        BasicActorPool.add_actors_to_pool = original
        end_prestarted_actors()  # more than the pool holds


def install_pipelined_pool(depth: int = PIPELINE_DEPTH) -> None:
    """Let each actor of the Ray backend's pool hold ``depth`` messages (idempotent; module docstring)."""
    global _pool_installed, _original_build
    if _pool_installed:
        return
    from flwr.server.superlink.fleet.vce.backend import raybackend
    from flwr.server.superlink.fleet.vce.backend.raybackend import RayBackend

    original_build = _original_build = RayBackend.build

    def build(self: Any, app_fn: Callable[[], Any]) -> None:
        if loads_dpfl_client_app(app_fn):
            app_fn = load_dpfl_client_app
        raybackend.ClientAppActor = batching_actor_type()  # the actor class Flower's build creates
        with prestarted_actors_first(self.client_resources):
            original_build(self, app_fn)
        record_workers("ray", self.pool.num_actors)  # the actors, before pipelining lends each `depth` times
        pipeline_pool(self.pool, depth)
        batching = Batching(None, slots=self.pool.num_actors)
        batching.send = ray_batch_sender(self, stopped=batching.stopped)
        setattr(self, BATCHING_FLAG, batching)

    RayBackend.build = build
    _pool_installed = True


def loads_dpfl_client_app(app_fn: Callable[[], Any]) -> bool:
    """Whether Flower's loader returns dpfl's ClientApp (then a by-reference loader replaces it)."""
    try:
        return app_fn() is load_dpfl_client_app()
    except Exception:  # Flower's loader reports its own errors later
        return False


def standalone_actor_pool(*, batching: bool, depth: int, client_cpus: float = 1.0) -> Any:
    """Flower's ``BasicActorPool`` outside an engine run, as full as Ray allows (benchmarks/overhead.py).

    ``batching``: its actors are :class:`~fl_app.engine.batching.BatchingActor` (``run_batch``), else
    Flower's ``ClientAppActor``; ``depth`` > 1: each actor is lent that many times (:func:`pipeline_pool`).
    Ray must be running.
    """
    from flwr.simulation.ray_transport.ray_actor import BasicActorPool, ClientAppActor

    actor_type = batching_actor_type() if batching else ClientAppActor
    pool = BasicActorPool(
        actor_type=actor_type, client_resources={"num_cpus": client_cpus, "num_gpus": 0.0}, actor_kwargs={}
    )
    pool.add_actors_to_pool(pool.actors_capacity)
    if depth > 1:
        pipeline_pool(pool, depth)
    return pool
