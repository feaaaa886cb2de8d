"""``simulation.backend=processes``: the clients run in worker processes forked from the command.

Ray's client actors are new interpreters: each imports Flower, dpfl and torch (2-3 s of CPU), and
Ray's own GCS, raylet and helper processes take about 6 s more, which a 30-round cross-device command
on two cores pays before its first round (docs/benchmarks/startup.md). The inline backend
(:mod:`fl_app.engine.inline`) pays none of it but trains one client at a time. This backend forks
``simulation.num_cpus / simulation.client_cpus`` worker processes from the command itself, before
the engine starts its threads: each holds everything the command imported and loaded, and starts in
milliseconds. The engine's batched workers (:mod:`fl_app.engine.batching`) hand each batch to an idle
worker over a pipe, pickled as Ray's transport and the inline backend pickle it, and the worker
answers with what an actor answers (:func:`~fl_app.engine.batching.run_jobs`: the same ClientApp
calls, replies, error replies and Context updates).

Forking a process that runs threads is safe only for what the child does not share with them; the
workers are therefore forked from the main thread before the engine starts (the command then runs
no other thread that uses torch, Flower or logging), and a worker does nothing but run batches.
A worker that dies (killed, out of memory) fails its batch's messages with
:class:`ClientWorkerDiedError`, which stops the run as a dead Ray actor does
(:func:`fl_app.run.round_loop.check_round`: a run that silently went on with fewer workers would run
slower and fail more); every worker is ended when the run ends. Generators are never
inherited state that two workers could share: a client's noise comes from generators derived per
message, or from fresh OS entropy (:mod:`fl_app.privacy.rng`).

Linux only (macOS's system frameworks are not safe to fork), and not for ``simulation.client_gpus``
(CUDA cannot be used in a forked child) nor a Ray cluster (``simulation.ray_address``): configuration
validation refuses each.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import signal
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from queue import Queue
from typing import Any

from fl_app.engine.batching import (
    STOP_POLL_S,
    AbandonedBatchError,
    Job,
    Outcome,
    run_jobs,
    warm_up_client_process,
)
from fl_app.engine.inline import InlineBackend, standing_in_for_ray, transport_bytes, transport_loads
from fl_app.engine.messages import client_app_error
from fl_app.engine.pool import load_dpfl_client_app, loads_dpfl_client_app

#: Seconds a worker may take to exit when the run ends before it is killed.
EXIT_WAIT_S = 2.0


class ClientWorkerDiedError(RuntimeError):
    """A worker process ended while it held a batch (its messages get error replies)."""


class Worker:
    """One forked worker process and the parent's end of its pipe."""

    def __init__(self, threads: int, siblings: list[Connection]) -> None:
        context = multiprocessing.get_context("fork")
        self.connection, child_end = context.Pipe(duplex=True)
        self.process = context.Process(
            target=_serve,
            args=(child_end, threads, [*siblings, self.connection]),
            name="dpfl-client-worker",
            daemon=True,
        )
        gc.freeze()  # the child never scans what it inherits: fewer copied pages
        try:
            self.process.start()
        finally:
            gc.unfreeze()
        child_end.close()

    def run(self, payload: bytes, stopped: Callable[[], bool]) -> list[Outcome]:
        """Send one pickled batch and wait for its outcomes; see :meth:`WorkerPool.run`."""
        try:
            self.connection.send_bytes(payload)
            while not self.connection.poll(STOP_POLL_S):
                if stopped():
                    raise AbandonedBatchError("the run stopped with a batch at a client worker")
            outcomes: list[Outcome] = transport_loads(self.connection.recv_bytes())
            return outcomes
        except (EOFError, OSError) as error:
            if stopped():
                raise AbandonedBatchError("the run stopped with a batch at a client worker") from error
            self.process.join(EXIT_WAIT_S)
            raise ClientWorkerDiedError(
                f"client worker process {self.process.pid} ended (exit code {self.process.exitcode}) "
                "(a batch sent to it fails)"
            ) from error

    def end(self) -> None:
        """Close the pipe (the worker exits when it reads its end) and make sure the process is gone."""
        with contextlib.suppress(OSError):
            self.connection.close()
        self.process.join(EXIT_WAIT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(EXIT_WAIT_S)


def _serve(connection: Connection, threads: int, parent_ends: list[Connection]) -> None:
    """A worker's whole life: run batches until the parent closes the pipe.

    The parent's ends of every pipe (``parent_ends``: its own and the other workers') are closed
    here, so that a worker reads the end of its pipe when the parent ends. Ctrl-C reaches the whole
    process group: the command stops the run and then ends the workers, so a worker ignores SIGINT
    and takes SIGTERM's default.
    """
    for end in parent_ends:
        end.close()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    import torch

    torch.set_num_threads(threads)
    while True:
        try:
            payload = connection.recv_bytes()
        except (EOFError, OSError):
            return
        app_fn, jobs = transport_loads(payload)
        answer = _answer(app_fn, jobs)
        try:
            connection.send_bytes(answer)
        except OSError:  # the run ended while this batch ran: nobody reads it
            return


def _answer(app_fn: Callable[[], Any], jobs: list[Job]) -> bytes:
    """The batch's outcomes, pickled; an outcome that cannot be pickled fails its batch's messages."""
    outcomes = run_jobs(app_fn, jobs)
    try:
        return transport_bytes(outcomes)
    except Exception as ex:
        code, reason = client_app_error(ex)
        return transport_bytes([("error", code, reason, traceback.format_exc()) for _ in jobs])


class WorkerPool:
    """The run's forked workers; an engine thread borrows an idle one for each batch."""

    def __init__(self, count: int, threads: int) -> None:
        if count < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {count}")
        self.threads = threads
        self.workers: list[Worker] = []
        warm_up_client_process()  # imported once here, inherited by every worker
        for _ in range(count):
            self.workers.append(Worker(threads, self._parent_ends()))
        self._idle: Queue[Worker] = Queue()
        for worker in self.workers:
            self._idle.put(worker)

    def __len__(self) -> int:
        return len(self.workers)

    def _parent_ends(self) -> list[Connection]:
        return [worker.connection for worker in self.workers]

    def run(self, app_fn: Callable[[], Any], jobs: list[Job], stopped: Callable[[], bool]) -> list[Outcome]:
        """The outcomes of ``jobs`` from an idle worker (waits for one).

        Raises :class:`~fl_app.engine.batching.AbandonedBatchError` when ``stopped()`` turns true
        first, and :class:`ClientWorkerDiedError` when the worker ended during the batch (it goes back
        to the pool dead: every later batch it gets fails the same way, and the run stops).
        """
        payload = transport_bytes((app_fn, jobs))
        worker = self._idle.get()
        try:
            return worker.run(payload, stopped)
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        """End every worker."""
        for worker in self.workers:
            worker.end()


class ProcessBackend(InlineBackend):
    """Flower's simulation ``Backend`` interface, answered by the forked workers of :attr:`pool`.

    :func:`process_backend` makes a subclass whose ``pool`` is the run's :class:`WorkerPool`; the
    engine starts one worker thread per worker process.
    """

    pool: WorkerPool
    kind = "processes"

    def build(self, app_fn: Callable[[], Any]) -> None:
        """As the inline backend's, with dpfl's ClientApp loader by reference (it travels with each batch)."""
        super().build(load_dpfl_client_app if loads_dpfl_client_app(app_fn) else app_fn)

    def _run(self, app_fn: Callable[[], Any], jobs: list[Job], stopped: Callable[[], bool]) -> list[Outcome]:
        """The outcomes of ``jobs`` from an idle worker of :attr:`pool`."""
        return self.pool.run(app_fn, jobs, stopped)

    @property
    def num_workers(self) -> int:
        """One engine thread per worker process."""
        return len(self.pool)


def worker_count(*, num_cpus: int | None, client_cpus: float, limit: int | None) -> int:
    """How many workers a run forks: as many clients as fit the CPUs (as Ray's pool sizes itself).

    ``num_cpus``: ``simulation.num_cpus`` (None: the CPUs this process may run on); ``client_cpus``:
    each client's; ``limit``: ``simulation.max_concurrent_clients``. At least one.
    """
    cpus = num_cpus if num_cpus is not None else usable_cpus()
    count = max(1, int(cpus // client_cpus))
    return min(count, limit) if limit is not None else count


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity: a container's or ``taskset``'s share), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no affinity on this platform
        return os.cpu_count() or 1


@contextlib.contextmanager
def process_backend(workers: int, threads: int) -> Iterator[None]:
    """Fork ``workers`` processes now; while the block runs the engine builds a :class:`ProcessBackend`.

    Call it on the thread that runs the engine, before the engine starts (module docstring). The
    workers end with the block.
    """
    pool = WorkerPool(workers, threads)
    backend_type = type("ProcessBackend", (ProcessBackend,), {"pool": pool})
    try:
        with standing_in_for_ray(backend_type):
            yield
    finally:
        pool.close()
