"""Shared fixtures: real Flower Messages and Contexts, run contexts, short simulations."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

#: One OpenMP (torch intra-op) thread in every test process and every process it starts (``python -m
#: fl_app``, Ray's workers, SuperNodes), unless the caller chose a number: the suite runs three
#: processes on two cores, and torch's default of one thread per core in each made them spin against
#: each other (the fast tier: 399 s of CPU and 205 s wall with the default, 267 s and 138 s with one
#: thread; docs/benchmarks/suite.md). Set before anything imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np
import pytest
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Error,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)

import fl_app  # noqa: F401  (process set-up first)
from fl_app import keys
from fl_app.config.compose import compose_config
from fl_app.config.settings import RunSettings
from fl_app.data.federated import federated_data
from fl_app.engine.messages import task_identity as engine_task_identity
from fl_app.learning.model_spec import ModelSpec
from fl_app.run.context import RunContext
from fl_app.run.harness import run_context_for
from strategies import STRATEGIES

#: Small, fast settings for simulations in tests (digits data, few clients, one client actor: a
#: second one costs each run about 3.5 s of CPU for 3 clients of digits; the tests named in
#: TWO_ACTORS run as many as the CPUs allow).
FAST = [
    "dataset=digits",
    "num_clients=6",
    "clients_per_round=3",
    "num_rounds=2",
    "lr=0.2",
    "batch_size=16",
    "local_epochs=1",
    "simulation.client_cpus=1",
    "simulation.max_concurrent_clients=1",
]
#: Appended to FAST where a test needs two client actors (concurrency, a worker to kill, two nodes).
TWO_ACTORS = "simulation.max_concurrent_clients=null"
#: Appended where what a test checks does not depend on where the clients run (resume, sweeps, failure
#: reports): they run in the command's own process, so the run starts no Ray instance and no client
#: actor (a tiny run: about 6 s of CPU instead of 14). test_flower_engine.py checks that both backends
#: give the golden rounds; the tests of Ray's start, stop and signals keep Ray.
INLINE = "simulation.backend=inline"


#: Fixtures that start (or join) a Ray-backed simulation: a test using one is marked ``simulation``,
#: so ``pytest -m "not simulation and not deploy and not audit"`` is the quick layer.
SIMULATION_FIXTURES = frozenset({"simulate", "ray_instance", "session_ray", "shared_simulation"})


#: Markers of the tests the fast tier (``pytest -m "not slow"``) leaves out: each is marked ``slow`` too.
SLOW_MARKERS = ("simulation", "audit", "deploy", "subprocess")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark the tests that use a :data:`SIMULATION_FIXTURES` fixture ``simulation``; the slow ones ``slow``.

    ``slow``: a real simulation, an end-to-end audit, a deployment or a test that runs the command in a
    subprocess (:data:`SLOW_MARKERS`). ``pytest -m "not slow"`` is the fast tier for the inner loop
    (docs/contributing/testing.md); CI runs everything.
    """
    for item in items:
        if SIMULATION_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.simulation)
        if any(item.get_closest_marker(name) for name in SLOW_MARKERS):
            item.add_marker(pytest.mark.slow)
    items[:] = longest_modules_first(items, json.loads(MODULE_SECONDS.read_text()))


#: Seconds of each test module in a measured whole-suite run (benchmarks/module_seconds.py writes it).
MODULE_SECONDS = Path(__file__).with_name("module_seconds.json")


def longest_modules_first(items: Sequence[pytest.Item], seconds: dict[str, float]) -> list[pytest.Item]:
    """The tests, module by module, the modules longest first (``seconds``; an unknown module: the median).

    With ``--dist loadscope --no-loadscope-reorder`` (``pyproject.toml``) pytest-xdist hands whole modules
    to its processes in this order, so no long module starts last and runs alone at the end of the
    suite (xdist's own order, by number of tests, started the 280-s quick examples at 457 s and the
    115-s SecAgg+ deployment at 580 s of a 762-s run). Within a module the order is kept.
    """
    median = statistics.median(seconds.values()) if seconds else 0.0
    first: dict[str, int] = {}  # each module's first position: modules of equal seconds stay apart
    for index, item in enumerate(items):
        first.setdefault(_module_of(item), index)
    return sorted(items, key=lambda item: (-seconds.get(_module_of(item), median), first[_module_of(item)]))


def _module_of(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


@pytest.fixture(scope="session", autouse=True)
def disk_caches_of_the_test_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The partition and calibration caches of this test run, not the user's.

    (:mod:`fl_app.data.partition_cache`, :mod:`fl_app.privacy.calibration_cache`.) One folder for
    all pytest-xdist workers of the run (the parent of their base temporary folders), so a split or
    a calibration is computed once per run; every process the tests start inherits it. pytest
    removes it with the run's other temporary folders.
    """
    from fl_app.data import partition_cache
    from fl_app.privacy import calibration_cache

    base = tmp_path_factory.getbasetemp()
    folder = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    variables = {partition_cache.CACHE_ENV: "partitions", calibration_cache.CACHE_ENV: "calibrations"}
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update({name: str(folder / child) for name, child in variables.items()})
    yield folder
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True)
def no_sweep_state_left() -> Iterator[None]:
    """Remove the sweep state a test's ``preflight`` call created (``python -m fl_app`` removes its own).

    Without it each such test left a ``dpfl-sweep-*`` folder in the temporary directory and the
    variable naming it in this process's environment.
    """
    import shutil

    from fl_app.__main__ import SWEEP_STATE_ENV

    saved = os.environ.get(SWEEP_STATE_ENV)
    yield
    created = os.environ.get(SWEEP_STATE_ENV)
    if created and created != saved:
        shutil.rmtree(created, ignore_errors=True)
    if saved is None:
        os.environ.pop(SWEEP_STATE_ENV, None)
    else:
        os.environ[SWEEP_STATE_ENV] = saved


@pytest.fixture(autouse=True)
def no_stop_request_left() -> Iterator[None]:
    """Clear the process's stop request after each test: one a test made (a signal it raised) would
    otherwise decide what a later test in the same worker sees (its signal number, an early stop)."""
    from fl_app.run import lifecycle

    yield
    lifecycle.clear_stop()


@pytest.fixture(autouse=True)
def task_identity() -> Iterator[None]:
    """Give this process a Flower task identity (as the simulation does) so Messages can be built."""
    with engine_task_identity(run_id=77):
        yield


def make_context(
    partition_id: int | None = 0,
    num_partitions: int = 6,
    node_id: int = 1001,
    node_config: dict[str, Any] | None = None,
) -> Context:
    """A node Context as the simulation builds it (or a device's, with ``partition_id=None``)."""
    config: dict[str, Any] = dict(node_config or {})
    if partition_id is not None:
        config.update({keys.NODE_PARTITION_ID: partition_id, keys.NODE_NUM_PARTITIONS: num_partitions})
    return Context(run_id=77, node_id=node_id, node_config=config, state=RecordDict(), run_config={})


def make_message(
    config: dict[str, Any],
    arrays: ArrayRecord | None = None,
    *,
    message_type: str = MessageType.TRAIN,
    node_id: int = 1001,
) -> Message:
    """A server-to-client instruction Message carrying ``arrays`` and ``config``."""
    content = RecordDict({keys.CONFIG: ConfigRecord(config)})
    if arrays is not None:
        content[keys.ARRAYS] = arrays
    return Message(content=content, dst_node_id=node_id, message_type=message_type)


def reply_to(
    message: Message,
    *,
    arrays: ArrayRecord | None = None,
    metrics: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> Message:
    """A client's reply to ``message`` (as the ClientApp would return it)."""
    content = RecordDict()
    if arrays is not None:
        content[keys.ARRAYS] = arrays
    content[keys.METRICS] = MetricRecord(metrics or {})
    for name, record in (extra or {}).items():
        content[name] = record
    return Message(content=content, reply_to=message)


def error_reply(message: Message, reason: str = "client crashed") -> Message:
    """A failed client's reply."""
    return Message(Error(code=0, reason=reason), reply_to=message)


def count_vectorised_trainings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list that grows by one for every message whose training is taken from its vectorised cohort
    (:func:`fl_app.engine.vectorised.served_training` serving a client's ``train_locally``)."""
    import clients.base
    from fl_app.engine.vectorised import served_training

    counted: list[int] = []

    def counting(message: Any, sgd: Any) -> Any:
        served = served_training(message, sgd)
        if served is not None:
            counted.append(1)
        return served

    monkeypatch.setattr(clients.base, "served_training", counting)
    return counted


def build_run_context(overrides: Sequence[str], tmp_path: Path) -> RunContext:
    """A RunContext for strategy tests: composed config, real data, a synthetic roster.

    Node ids are ``1000 + partition id`` and sizes are the real partition sizes
    (:func:`fl_app.run.harness.run_context_for`).
    """
    return run_context_for(overrides, tmp_path)


def client_for(message: Message, context: Context) -> Any:
    """The client object the ClientApp would build for ``message``."""
    from fl_app.client_app import client_for as lookup

    return lookup(message, context)


@pytest.fixture
def simulate(tmp_path: Path, session_ray: SessionRay) -> Callable[..., dict[str, Any]]:
    """Run a real simulation in-process; return its results.json.

    A Ray-backed run joins this test process's Ray instance (:class:`SessionRay`, started by the
    first run that needs it), or starts its own with ``private_ray=True`` (as ``python -m fl_app``
    does: its actors then inherit this process's environment, e.g. a fault injection a test sets); an
    inline run (:data:`INLINE`) needs none. The returned dict also has ``_output_dir``: the run's
    output directory.
    """

    def run(overrides: Sequence[str], name: str = "run", *, private_ray: bool = False) -> dict[str, Any]:
        return simulate_in_process(overrides, tmp_path / name, None if private_ray else session_ray.address)

    return run


def simulate_in_process(
    overrides: Sequence[str], output: Path, address: str | Callable[[], str] | None
) -> dict[str, Any]:
    """Validate and run one simulation on the Ray instance at ``address``; return its results.json.

    Flower starts the run's client actors on that instance and ends them when the run ends; the
    test fails if any process the run started is still there :data:`REAP_WAIT_S` later. With no
    ``address`` the run starts and stops a Ray of its own, as the command line does; a callable
    ``address`` is called only by a run on Ray (an inline run never starts one).
    """
    import dataclasses
    from unittest import mock

    from fl_app.config.validation import validate_config
    from fl_app.engine import simulation

    settings = validate_config(compose_config(list(overrides)))
    if callable(address):
        address = address() if settings.simulation.uses_ray else None
    before = ray_process_ids()
    private = simulation.backend_config

    def joined(settings: Any) -> dict[str, Any]:
        # Ray's settings as with simulation.ray_address=<address>; the run's own configuration is
        # untouched (results and config.yaml are those of a run on a private Ray)
        on_cluster = dataclasses.replace(settings.simulation, ray_address=address)
        return private(dataclasses.replace(settings, simulation=on_cluster))

    with mock.patch.object(simulation, "backend_config", joined if address else private):
        simulation.run_in_simulation(settings, list(overrides), output)
    wait_until(lambda: ray_process_ids() <= before, timeout=REAP_WAIT_S)
    assert ray_process_ids() <= before, "Ray processes still running after the simulation returned"
    results = json.loads((output / "results.json").read_text())
    results["_output_dir"] = str(output)
    return results


#: Seconds a finished run's client actors may take to exit.
REAP_WAIT_S = 10.0


def wait_until(condition: Callable[[], bool], *, timeout: float, interval: float = 0.2) -> None:
    """Poll ``condition`` until it holds or ``timeout`` seconds passed (the caller asserts it after)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(interval)


class SessionRay:
    """One Ray instance (two CPUs) per test process, which the in-process simulations join.

    Started by the first caller of :meth:`address` (a test process whose tests run inline or need no
    Ray never starts one: its GCS, raylet and helper processes take about 6 s of CPU, from
    ``benchmarks/process_cpu.py``'s counts over the suite). Starting Ray costs each
    simulation about 3 s (measured: a 2-round digits run took 10.3 s with its own Ray, 7.0 s joining
    a running one, with identical results); the client actors are still started and ended per run,
    by Flower.
    """

    def __init__(self) -> None:
        self.cluster: Any = None
        self.before: set[int] = set()

    def address(self) -> str:
        """The instance's address; starts it on the first call."""
        if self.cluster is None:
            from ray.cluster_utils import Cluster

            self.before = ray_process_ids()
            self.cluster = Cluster(
                initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False}
            )
        return str(self.cluster.address)

    def stop(self) -> None:
        """Stop the instance if it was started; none of its processes may be left."""
        if self.cluster is None:
            return
        self.cluster.shutdown()
        wait_until(lambda: ray_process_ids() <= self.before, timeout=REAP_WAIT_S)
        left = ray_process_ids() - self.before
        assert not left, f"processes of the test session's Ray instance are still running: {sorted(left)}"


@pytest.fixture(scope="session")
def session_ray() -> Iterator[SessionRay]:
    """This test process's :class:`SessionRay`, stopped at the end of the session."""
    instance = SessionRay()
    try:
        yield instance
    finally:
        instance.stop()


@pytest.fixture(scope="session")
def ray_instance(session_ray: SessionRay) -> str:
    """The address of this test process's Ray instance (:class:`SessionRay`), started now."""
    return session_ray.address()


#: Set in this test process and inherited by every process it starts (Ray's GCS, raylet and workers,
#: ``python -m fl_app`` subprocesses and theirs): tells this process's Ray processes from those of a
#: parallel test worker (pytest-xdist) or of anything else running on the machine.
TEST_PROCESS_KEY = "DPFL_TEST_PROCESS"
os.environ[TEST_PROCESS_KEY] = str(os.getpid())


def ray_process_ids() -> set[int]:
    """Pids of every running Ray process (actors, raylet, GCS, workers) started from this test process.

    A process counts if it is a Ray process and inherited this test process's :data:`TEST_PROCESS_KEY`
    (a Ray process that outlived its driver, re-parented to init, still carries it), or if its parent
    did: the raylet starts its dashboard and runtime-env agents with an environment of their own.
    """
    import psutil

    mine = os.environ[TEST_PROCESS_KEY]
    found = set()
    for process in psutil.process_iter(["name", "cmdline", "status"]):
        try:
            if process.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            parts = [process.info["name"] or "", *(process.info["cmdline"] or [])[:3]]
            if not any(part.startswith("ray::") or "/ray/" in part for part in parts):
                continue
            parent = process.parent()
            if process.environ().get(TEST_PROCESS_KEY) == mine or (
                parent is not None and parent.environ().get(TEST_PROCESS_KEY) == mine
            ):
                found.add(process.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.fixture(scope="session")
def shared_simulation(
    tmp_path_factory: pytest.TempPathFactory, session_ray: SessionRay
) -> Callable[..., dict[str, Any]]:
    """Like :func:`simulate`, but runs each distinct override list once per session.

    For tests that only read a run's results and files: several tests can check one simulation.
    Each call returns a fresh copy of the results.
    """
    import copy

    cache: dict[tuple[str, ...], dict[str, Any]] = {}

    def run(overrides: Sequence[str]) -> dict[str, Any]:
        key = tuple(overrides)
        if key not in cache:
            cache[key] = simulate_in_process(
                overrides, tmp_path_factory.mktemp("shared-run"), session_ray.address
            )
        return copy.deepcopy(cache[key])

    return run


#: Runs several tests read (see :func:`shared_simulation`).
FEDAVG_RUN = [
    *[item for item in FAST if not item.startswith("num_rounds=")],
    "num_rounds=3",
    "strategy=fedavg",
]
DP_FEDAVG_RUN = [*FAST, "strategy=dp_fedavg", "privacy.epsilon=8", "simulation.num_cpus=2"]


def settings_of(overrides: Sequence[str]) -> RunSettings:
    """The typed settings of ``overrides``, read as validation reads them (no data or output checks)."""
    from fl_app.config.validation import typed_settings

    return typed_settings(compose_config(list(overrides)))


def spec_config(overrides: Sequence[str]) -> dict[str, Any]:
    """The base train-config keys a strategy would send (for client tests)."""
    settings = settings_of(overrides)
    spec = settings.data
    data = federated_data(spec)
    model_spec = ModelSpec(
        STRATEGIES.get(settings.strategy).declaration.model_name(settings, data.input_shape),
        data.input_shape,
        data.num_classes,
    )
    return {
        keys.SERVER_ROUND: 1,
        keys.DATA_SPEC: spec.to_json(),
        keys.MODEL_SPEC: model_spec.to_json(),
        keys.LOCAL_EPOCHS: 1,
        keys.BATCH_SIZE: 16,
        keys.LR: 0.1,
        keys.MOMENTUM: 0.0,
        keys.SEED: settings.seed,
        keys.SECURE_RNG: False,
        keys.NOISE_SEED: settings.seed,
    }


def dense_lower_toeplitz(coefficients: Sequence[float], n: int) -> np.ndarray:
    """The dense ``n x n`` lower-triangular Toeplitz matrix of ``coefficients`` (truncated to n).

    The tests' independent oracle for banded matrix factorization (the code under test never
    builds this matrix).
    """
    matrix = np.zeros((n, n))
    for lag, value in enumerate(list(coefficients)[:n]):
        matrix += float(value) * np.eye(n, k=-lag)
    return matrix


def numpy_close(a: ArrayRecord, b: ArrayRecord, **kwargs: Any) -> bool:
    """Whether two ArrayRecords hold the same keys and (nearly) the same values."""
    return list(a.keys()) == list(b.keys()) and all(
        np.allclose(a[k].numpy(), b[k].numpy(), **kwargs) for k in a
    )


class InProcessGrid:
    """A grid that answers every message at once through the real ClientApp, one Context per node.

    For strategies that exchange several messages within a round (SecAgg+): ``send_and_receive``
    runs :func:`fl_app.client_app.train` on each message with its node's persistent Context
    (node ``1000 + i`` is partition ``i``, as :func:`build_run_context` numbers them). A node in
    ``offline`` never answers; a node in ``fails_at`` answers with an error reply from that stage
    on (``{node: stage}``, stage as in the ``secaggplus_configs`` record). ``sent`` keeps every
    message and reply, in order, for inspection. A node in ``flower_mod`` runs Flower's own
    ``secaggplus_mod`` (masks from 32-bit seeds) instead of dpfl's, as a device with plain Flower would.
    """

    def __init__(
        self,
        num_partitions: int,
        *,
        offline: Sequence[int] = (),
        fails_at: dict[int, str] | None = None,
        flower_mod: Sequence[int] = (),
    ):
        self.num_partitions = num_partitions
        self.offline = set(offline)
        self.flower_mod = set(flower_mod)
        self.fails_at = dict(fails_at or {})
        self.contexts: dict[int, Context] = {}
        self.sent: list[tuple[Message, Message | None]] = []

    def context(self, node_id: int) -> Context:
        if node_id not in self.contexts:
            self.contexts[node_id] = make_context(
                partition_id=node_id - 1000, num_partitions=self.num_partitions, node_id=node_id
            )
        return self.contexts[node_id]

    def send_and_receive(self, messages: Iterable[Message], timeout: float | None = None) -> list[Message]:
        from fl_app.engine.secagg import RECORD_KEY_CONFIGS, Key, Stage

        replies = []
        for message in messages:
            node = int(message.metadata.dst_node_id)
            if node in self.offline:
                self.sent.append((message, None))
                continue
            configs = message.content.config_records.get(RECORD_KEY_CONFIGS)
            stage = str(configs[Key.STAGE]) if configs is not None else ""
            failing = node in self.fails_at and Stage.all().index(stage) >= Stage.all().index(
                self.fails_at[node]
            )
            if failing:
                reply = error_reply(message, f"node {node} dropped out")
            else:
                reply = self.answer(message, self.context(node), plain_flower=node in self.flower_mod)
            self.sent.append((message, reply))
            replies.append(reply)
        return replies

    @staticmethod
    def answer(message: Message, context: Context, *, plain_flower: bool) -> Message:
        """The node's reply (an error reply when its app raises, as Flower's ClientApp runner sends)."""
        from flwr.client.mod import secaggplus_mod

        from fl_app.client_app import client_for, train

        try:
            if plain_flower:
                return secaggplus_mod(message, context, lambda inner, node: client_for(inner, node).train())
            return train(message, context)
        except Exception as error:
            return error_reply(message, f"{type(error).__name__}: {error}")
