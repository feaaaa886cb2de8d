"""``simulation.backend=inline``: the clients run in the command's own process (flwr 1.41 private APIs).

Flower's simulation engine always builds a ``RayBackend`` (``vce_api.start_vce`` imports it by name
when the run starts). :func:`inline_backend` puts :class:`InlineBackend` under that name for the
run: no Ray instance, no client actors. The engine's batched workers (:mod:`fl_app.engine.batching`)
send each batch to :func:`~fl_app.engine.batching.run_jobs` in this process instead of to an actor,
one batch at a time: the same ClientApp calls, replies, error replies and Context updates as on an
actor. Each batch is pickled and unpickled first, as Ray's transport does, so a client never holds
the engine's own Message or Context objects (a ClientApp that changed one, or raised half-way
through changing its Context, would otherwise change what the engine stores).

What it saves: starting and stopping a private Ray instance (its GCS, raylet and five helper
processes) and every client actor (a new Python process that imports Flower, dpfl and torch): a
2-round run of the tests' size took 6 s of CPU and 6 s of wall time instead of 14 and 14, a 30-round
cross-device command half the CPU (docs/benchmarks/inline_backend.md). What it costs: one client at a
time, on ``simulation.client_cpus`` torch threads of this process (as an actor gets); a Ctrl-C waits
for the batch under way (at most ``simulation.messages_per_task`` messages).
"""

from __future__ import annotations

import contextlib
import copyreg
import io
import pickle
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

from fl_app.engine.batching import (
    BATCHING_FLAG,
    AbandonedBatchError,
    Batching,
    Job,
    Outcome,
    run_jobs,
)
from fl_app.engine.workers import record_workers


def _reduce_memoryview(view: memoryview) -> tuple[Any, ...]:
    # Flower's Array keeps the chunks it was inflated from as memoryviews (what Ray's pickler sends
    # as buffers); the copy holds the same bytes
    return memoryview, (view.tobytes(),)


def transport_bytes(value: Any) -> bytes:
    """``value`` pickled as Ray's transport pickles it (memoryviews as the bytes they show)."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table, memoryview: _reduce_memoryview}
    pickler.dump(value)
    return buffer.getvalue()


def transport_loads(data: bytes) -> Any:
    """What :func:`transport_bytes` pickled."""
    return pickle.loads(data)


def isolated(jobs: list[Job]) -> list[Job]:
    """A copy of ``jobs`` made as Ray's transport makes one (pickle; shared objects stay shared)."""
    copied: list[Job] = transport_loads(transport_bytes(jobs))
    return copied


def client_threads(backend_config: dict[str, Any]) -> int:
    """A client's torch threads: ``simulation.client_cpus`` (``client_resources``), at least 1."""
    resources = backend_config.get("client_resources") or {}
    return max(1, int(float(resources.get("num_cpus", 1))))


class InlineBackend:
    """Flower's simulation ``Backend`` interface, answered in this process by one worker thread.

    :attr:`num_workers` is 1, so the engine starts one worker thread: one client at a time.

    ``process_message`` (Flower's one-message path) is never reached: :meth:`build` marks the
    backend for dpfl's batched workers (``BATCHING_FLAG``), which call :attr:`Batching.send`.
    """

    #: ``simulation.backend``'s name for it (:mod:`fl_app.engine.workers`).
    kind = "inline"

    def __init__(self, backend_config: dict[str, Any]) -> None:
        self.backend_config = backend_config
        self.app_fn: Callable[[], Any] | None = None
        #: torch threads while a batch runs: ``simulation.client_cpus``, as a Ray actor gets (at least 1)
        self.threads = client_threads(backend_config)

    def build(self, app_fn: Callable[[], Any]) -> None:
        """Keep the ClientApp loader and give the batched workers a sender (one slot per worker)."""
        self.app_fn = app_fn
        batching = Batching(None, slots=self.num_workers)
        batching.send = self._sender(batching)
        setattr(self, BATCHING_FLAG, batching)
        record_workers(self.kind, self.num_workers)

    def _sender(self, batching: Batching) -> Callable[[list[Job]], list[Outcome]]:
        def send(jobs: list[Job]) -> list[Outcome]:
            if batching.stopped():
                raise AbandonedBatchError(f"the run stopped with {len(jobs)} messages queued")
            assert self.app_fn is not None, "build() runs before the first message"
            return self._run(self.app_fn, jobs, batching.stopped)

        return send

    def _run(self, app_fn: Callable[[], Any], jobs: list[Job], stopped: Callable[[], bool]) -> list[Outcome]:
        """The outcomes of ``jobs``: run here, on copies made as Ray's transport makes them."""
        with torch_threads(self.threads):
            return run_jobs(app_fn, isolated(jobs))

    @property
    def num_workers(self) -> int:
        """One worker thread: clients run one after another."""
        return 1

    def is_worker_idle(self) -> bool:
        """Flower's hook for its own worker; the batched workers do not ask."""
        return True

    def terminate(self) -> None:
        """Nothing to end: no process was started."""

    def process_message(self, message: Any, context: Any) -> tuple[Any, Any]:
        """Flower's one-message path; dpfl's batched workers never take it."""
        raise RuntimeError("the inline backend runs messages through dpfl's batched workers only")


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """While the block runs, torch uses ``count`` intra-op threads (then as many as before).

    The clients share this process with the engine's and the driver's threads: on 2 cores, torch's
    default of one thread per core made the cross-device round 0.78 s against 0.49 s with one
    (docs/benchmarks/inline_backend.md).
    """
    import torch

    before = torch.get_num_threads()
    if before == count:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


#: The module ``vce_api.start_vce`` takes ``RayBackend`` from (flwr 1.41); importing it imports Ray.
RAY_BACKEND_MODULE = "flwr.server.superlink.fleet.vce.backend.raybackend"


@contextlib.contextmanager
def inline_backend() -> Iterator[None]:
    """While the block runs, the simulation engine builds an :class:`InlineBackend` instead of Ray's."""
    with standing_in_for_ray(InlineBackend):
        yield


@contextlib.contextmanager
def standing_in_for_ray(backend_type: type) -> Iterator[None]:
    """While the block runs, the simulation engine builds a ``backend_type`` instead of Ray's backend.

    When Flower's Ray backend module is not imported yet, a stand-in module holding only
    ``RayBackend = backend_type`` takes its name for the block, so a run without Ray never imports
    Ray (0.4 s of CPU at every start); it is removed afterwards, and a later Ray run imports the real one.
    """
    original = sys.modules.get(RAY_BACKEND_MODULE)
    if original is None:
        stand_in = types.ModuleType(RAY_BACKEND_MODULE, "dpfl's stand-in for Flower's Ray backend")
        stand_in.RayBackend = backend_type  # type: ignore[attr-defined]
        sys.modules[RAY_BACKEND_MODULE] = stand_in
        try:
            yield
        finally:
            if sys.modules.get(RAY_BACKEND_MODULE) is stand_in:
                del sys.modules[RAY_BACKEND_MODULE]
        return
    ray_backend = original.RayBackend
    original.RayBackend = backend_type  # type: ignore[attr-defined]
    try:
        yield
    finally:
        original.RayBackend = ray_backend  # type: ignore[attr-defined]
