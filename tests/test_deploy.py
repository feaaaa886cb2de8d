"""Deployment: the same ClientApp on "devices" behind a real SuperLink (``pytest -k deploy``).

The integration tests start one federation: a real SuperLink and two SuperNodes on 127.0.0.1 with
TLS and SuperNode authentication, as a real deployment runs (free ports, a private ``FLWR_HOME`` per
process in ``tmp_path``, each SuperNode with its own ``.npz`` data file), submit one round of an
algorithm per client class (:func:`device_algorithms`, less :data:`ANSWERED_IN_PROCESS`; two rounds
where a device carries state from round to round or the rounds differ, :func:`deployed_rounds`) and three
jobs that must fail, with
``flwr run`` (all at once: the SuperLink's launch gate runs at most as many ServerApps at once as the
machine has cores, the others wait at the SuperLink; a SuperNode runs one ClientApp process per
message), and check each run's
``results.json``; a SuperNode with an unregistered key and one without TLS are refused. A wait for a
run fails at once, naming the process, when the SuperLink, a SuperNode or the SuperLink's SuperExec
died (a test kills the SuperExec of a second deployment to see it). Every
process is started in its own process group by ``scripts/local_deployment.py`` and stopped
(children included) when the module's tests are done, also on failure. (The insecure mode,
``dpfl deploy start`` without ``--secure``, differs only in the flags the same script passes.)

The SuperNodes run with a guard (``sitecustomize`` on their ``PYTHONPATH``)
that makes ``fl_app.data.sources.load_dataset`` and ``fl_app.config.compose.compose_config``
raise in every ClientApp: on a real device neither the server's data set nor
Hydra is there, so an algorithm that needs them on a device fails here too.

The other tests are quick unit tests of the platform's device path, and every client class answering
on devices in this process (:class:`DeviceGrid`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
from conftest import make_context, make_message, settings_of, spec_config
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from fl_app import keys
from fl_app.config.compose import compose_config
from fl_app.data.federated import DataSpec, federated_data
from fl_app.engine.messages import over_the_wire, restored_context, stored_context
from fl_app.engine.simulation import backend_config
from fl_app.run.results import COHORT_FIELDS
from fl_app.run.roster import ClientInfo, RosterError, discover_roster, on_devices
from fl_app.run.server import make_run_context, noise_source, with_secure_noise
from strategies import STRATEGIES
from strategies.arrays import flat_vector

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"

#: The data every deployment test uses: digits, split IID over two devices (every ClientApp process
#: costs 2-3 s of CPU here: two devices instead of three took a third off the module).
DATA = ["dataset=digits", "partition=iid", "num_clients=2"]
#: Small settings for one round with both devices.
COMMON = [
    *DATA,
    "clients_per_round=2",
    "num_rounds=1",
    "lr=0.2",
    "batch_size=16",
    "local_epochs=1",
    "simulation.timeout=1800",  # a safety limit: on a loaded machine the runs queue at the SuperNodes
]


def deployed_rounds(name: str) -> int:
    """The rounds an algorithm is deployed for: two where its declaration's ``deploy`` asks for them.

    A client that keeps state (DPFL-BNN's latent weights and optimiser, SCAFFOLD's control variate) must
    ask for two, so that its devices carry the state from one round to the next
    (:func:`test_a_client_that_keeps_state_is_deployed_for_two_rounds`); KD-DP's second round is the
    student stage. For the others a device's work is the same in every round (what changes is server
    state, which the simulation tests cover), and each further round costs two ClientApp processes.
    """
    return 2 if "num_rounds=2" in STRATEGIES.get(name).declaration.deploy else 1


#: What an algorithm needs beyond COMMON on two clients.
#: The algorithms this module deploys: every registered one whose rounds run on two SuperNodes (a
#: declaration's ``min_clients`` above 2, e.g. distributed DP's sum of at least 3, is deployed by a test of
#: its own: tests/test_deploy_secagg.py); each with the settings its declaration asks for (``deploy``).


def device_algorithms() -> list[str]:
    """One algorithm per client class that runs on two devices: what a device runs is its client.

    Algorithms that share a client (DP-FedAvg, adaptive clipping, DP-FTRL, banded MF and FedAvg all
    answer with the ``fedavg`` client) differ only in the ServerApp, which is the simulation's own
    (tested there, per algorithm); deploying each of them repeated the same device path (5 of 12 runs,
    about 40 % of the module's time). Per client the private algorithm first (its server switches to
    OS-entropy noise once it sees devices), then by name.
    """
    chosen: dict[str, str] = {}
    for name in sorted(STRATEGIES.names(), key=lambda n: (STRATEGIES.get(n).declaration.unit == "none", n)):
        declaration = STRATEGIES.get(name).declaration
        if declaration.min_clients <= 2:
            chosen.setdefault(declaration.client, name)
    return sorted(chosen.values())


def test_a_client_that_keeps_state_is_deployed_for_two_rounds() -> None:
    """Every algorithm whose client keeps state between rounds deploys for two (the state is exercised)."""
    from clients import CLIENTS

    stateful = [
        n for n in STRATEGIES.names() if CLIENTS.get(STRATEGIES.get(n).declaration.client).keeps_state
    ]
    assert stateful and all(deployed_rounds(name) == 2 for name in stateful), stateful


#: Client classes whose device path is FederatedClient's (its data file, OS-entropy noise) plus a
#: transform of the trained model before the upload, with no state between rounds and nothing sent
#: to the device beyond the model and the config: each answers on a device Context in this process
#: (:func:`test_each_client_class_answers_on_a_device_without_the_servers_data_or_hydra`) instead of
#: in a deployed run of its own (a ServerApp and four ClientApp processes each: the module took 348 s
#: of machine CPU alone with both deployed, 299 s without). The deployed runs keep FederatedClient's
#: own device path (``fedavg``, ``flower``), the state kept in a node's context (:func:`deployed_rounds`)
#: and data sent to devices (PrivateKT's samples).
ANSWERED_IN_PROCESS = ("fedavg_ldp", "nbafl")
DEPLOYED = [name for name in device_algorithms() if name not in ANSWERED_IN_PROCESS]
#: The federation's mode: TLS and SuperNode authentication.
MODE = "secure"
RUN_DEADLINE_S = 1800.0  # a safety limit only: a dead process the runs need fails a test at once
LOG_TIMEOUT_S = 60.0  # `flwr log --show` prints what the run logged so far and returns
STATUS_POLL_S = 30.0  # `flwr ls` costs a second of CPU; results.json is checked every second

#: The end of a ``sitecustomize.py`` that changes a module in the processes a test starts: it calls
#: ``PATCHES[name](module)`` as soon as module ``name`` has run. The text before it defines ``PATCHES``
#: (module name -> function of the module).
AFTER_IMPORT = """
import importlib.abc
import importlib.machinery
import sys


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            PATCHES[fullname](module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _AfterImport())
"""

#: What a device refuses: module -> its functions that must not run in a ClientApp (the server's data
#: set, Hydra), by :data:`GUARD` in the deployed SuperNodes and :func:`refused_as_on_a_device` here.
DEVICE_REFUSES = {"fl_app.data.sources": ("load_dataset",), "fl_app.config.compose": ("compose_config",)}
#: The error a refused function raises (``name``: module.function).
REFUSAL = "{name} called on a device (no shared disk, no Hydra on devices)"

GUARD = (
    f'''"""dpfl deployment test: a device has neither the server's data set nor Hydra."""
GUARDED = {DEVICE_REFUSES!r}
REFUSAL = {REFUSAL!r}


def _refuse(name):
    def refuse(*args, **kwargs):
        raise RuntimeError(REFUSAL.format(name=name))

    return refuse


def _guard(module):
    for attr in GUARDED[module.__name__]:
        setattr(module, attr, _refuse(f"{{module.__name__}}.{{attr}}"))


PATCHES = dict.fromkeys(GUARDED, _guard)
'''
    + AFTER_IMPORT
)


def _load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


local_deployment = _load_script("local_deployment")
make_device_data = _load_script("make_device_data")


# ------------------------------------------------------------------------------ integration


@dataclass
class Submission:
    """One ``flwr run`` submitted to a deployment."""

    name: str
    run_id: int
    output_dir: Path
    overrides: list[str]


@dataclass
class Federation:
    """A running local deployment and the ``flwr`` CLI environment that reaches it."""

    mode: str
    root: Path
    app: Path
    deployment: Any
    cli_env: dict[str, str]
    submissions: dict[str, Submission] = field(default_factory=dict)

    def flwr(self, *args: str) -> str:
        return local_deployment.flwr(list(args), env=self.cli_env)

    def submit(self, name: str, overrides: list[str]) -> Submission:
        output_dir = self.root / "results" / name
        run_config = f"overrides={json.dumps(shlex.join(overrides))} output-dir={json.dumps(str(output_dir))}"
        answer = local_deployment.json_output(
            self.flwr(
                "run",
                str(self.app),
                self.deployment.connection,
                "--run-config",
                run_config,
                "--format",
                "json",
            )
        )
        assert answer["success"], answer
        return Submission(name, int(answer["run-id"]), output_dir, overrides)

    def status(self, run_id: int) -> str:
        answer = local_deployment.json_output(
            self.flwr("ls", self.deployment.connection, "--run-id", str(run_id), "--format", "json")
        )
        return str(answer["runs"][0]["status"])

    def log(self, run_id: int) -> str:
        return local_deployment.flwr(
            ["log", str(run_id), self.deployment.connection, "--show"],
            env=self.cli_env,
            timeout=LOG_TIMEOUT_S,
        )

    def wait(self, submission: Submission) -> tuple[str, dict[str, Any] | None]:
        """Wait until the run finished; return its status and results.json (None if absent).

        Fails at once, naming it, when a process the run needs died (the SuperLink, a SuperNode,
        the SuperLink's SuperExec): the run could never finish, and waiting for
        :data:`RUN_DEADLINE_S` would only hold up the rest of the suite.
        """
        results = submission.output_dir / "results.json"
        deadline = time.monotonic() + RUN_DEADLINE_S
        next_poll = 0.0
        while time.monotonic() < deadline:
            if results.is_file():
                return "finished:completed", json.loads(results.read_text())
            problems = self.deployment.problems()
            if problems:
                what = f"{submission.name} (run {submission.run_id})"
                pytest.fail(f"{what} can never finish: " + "; ".join(problems))
            if time.monotonic() >= next_poll:
                status = self.status(submission.run_id)
                if status.startswith("finished"):
                    return status, json.loads(results.read_text()) if results.is_file() else None
                next_poll = time.monotonic() + STATUS_POLL_S
            time.sleep(1.0)
        with_log = self.log(submission.run_id)
        self.flwr("stop", str(submission.run_id), self.deployment.connection)
        pytest.fail(f"{submission.name}: not finished in {RUN_DEADLINE_S:.0f} s\n{with_log[-4000:]}")

    def processes_alive(self) -> list[str]:
        return [p.name for p in self.deployment.running()]


def algorithm_overrides(name: str) -> list[str]:
    """The overrides of the deployment run of algorithm ``name``."""
    return [*COMMON, f"strategy={name}", *STRATEGIES.get(name).declaration.deploy]


@pytest.fixture(scope="module")
def device_files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """One data file per device, made with scripts/make_device_data.py."""
    return make_device_data.write_device_files(tmp_path_factory.mktemp("devices"), DATA)


@pytest.fixture(scope="module")
def staged_app(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The app as `flwr run` submits it, staged once (each `flwr run .` would list all of .venv)."""
    return local_deployment.stage_app(ROOT, tmp_path_factory.mktemp("app") / "dpfl")


def test_the_staged_app_is_the_fab_flwr_run_builds_from_the_project(staged_app: Path, tmp_path: Path) -> None:
    """... and a SuperLink installs it: Flower's FAB manifest is unquoted CSV, so one file of the
    project whose path holds a comma (a Hydra job folder kept in docs/) made every deployed
    ServerApp fail before its first line (``ValueError`` in ``flwr.cli.install._verify_hashes``)."""
    from fl_app.engine.tooling import build_fab, install_fab

    fab = build_fab(staged_app)
    assert fab == build_fab(ROOT)
    assert not (staged_app / ".venv").exists() and (staged_app / "pyproject.toml").is_file()
    installed = install_fab(fab, tmp_path / "installed")
    assert (installed / "fl_app" / "server_app.py").is_file()
    assert (installed / "conf" / "config.yaml").is_file() and (installed / "strategies").is_dir()
    shipped = {path.relative_to(installed).parts[0] for path in installed.rglob("*")}
    assert not shipped & {"docs", "benchmarks", "tests", "BENCHMARKS.md"}  # pyproject's fab-exclude


@pytest.fixture(scope="module")
def federation(
    tmp_path_factory: pytest.TempPathFactory,
    device_files: list[Path],
    staged_app: Path,
) -> Iterator[Federation]:
    """A SuperLink and two SuperNodes, with TLS and SuperNode authentication."""
    mode = MODE
    root = tmp_path_factory.mktemp(f"deploy-{mode}")
    guard = root / "device-guard"
    guard.mkdir()
    (guard / "sitecustomize.py").write_text(GUARD)
    python_path = os.pathsep.join(filter(None, [str(guard), os.environ.get("PYTHONPATH", "")]))
    cli_env = {**os.environ, "FLWR_HOME": str(root / "cli-home")}
    deployment = local_deployment.start(
        root / "federation",
        data_files=device_files,
        secure=True,
        port=local_deployment.free_port(),
        connection=f"dpfl-test-{mode}",
        cli_env=cli_env,
        supernode_env={"PYTHONPATH": python_path},
        die_with_parent=True,
    )
    federation = Federation(mode, root, staged_app, deployment, cli_env)
    try:
        yield federation
    finally:
        deployment.stop()
        left = federation.processes_alive()
        assert not left, f"still running after stop: {left}"


@pytest.fixture(scope="module")
def submitted(federation: Federation) -> dict[str, Submission]:
    """Every algorithm and the three bad jobs, submitted at once."""
    jobs = {name: algorithm_overrides(name) for name in DEPLOYED}
    jobs["too-few-clients"] = [*algorithm_overrides("fedavg"), "num_clients=1", "clients_per_round=1"]
    jobs["too-many-clients"] = [*algorithm_overrides("fedavg"), "num_clients=3", "simulation.timeout=4"]
    jobs["bad-value"] = [*algorithm_overrides("fedavg"), "privacy.epsilon=-1"]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(federation.submit, name, overrides) for name, overrides in jobs.items()}
        federation.submissions = {name: future.result() for name, future in futures.items()}
    return federation.submissions


@pytest.mark.deploy
@pytest.mark.parametrize("algorithm", DEPLOYED)
def test_deploy_each_algorithm(
    federation: Federation, submitted: dict[str, Submission], algorithm: str
) -> None:
    submission = submitted[algorithm]
    status, results = federation.wait(submission)
    if results is None:
        run_log = federation.log(submission.run_id)[-4000:]
        pytest.fail(f"{algorithm} ({federation.mode}): {status}, no results.json\n{run_log}")
    context = f"{algorithm} ({federation.mode}), run {submission.run_id}"
    assert results["status"] == "completed", context
    rounds = deployed_rounds(algorithm)
    assert [r["round"] for r in results["rounds"]] == list(range(1, rounds + 1)), context
    assert results["final"]["rounds"] == rounds, context
    # Every selected device answered: a client error (e.g. a device reaching for the
    # server's data set) is a failure here, not a silently smaller round.
    if "secret" in results["privacy"]["randomness"]["cohort"]:
        # secret Poisson cohorts: no per-round count is published (status completed: no failure)
        assert all(not set(COHORT_FIELDS) & set(r) for r in results["rounds"]), (context, results["rounds"])
    else:
        assert all(r["failures"] == 0 and r["clients"] >= 1 for r in results["rounds"]), (
            context,
            results["rounds"],
        )
    assert math.isfinite(results["final"]["accuracy"]), context
    # The server saw devices and switched its own noise to OS entropy.
    assert results["config"]["privacy"]["secure_rng"] is True, context
    assert results["config"]["privacy"]["noise_seed"] is None, context
    if results["privacy"]["unit"] != "none":
        epsilon = results["final"]["epsilon"]
        assert epsilon is not None, (context, results["final"])
        assert math.isfinite(epsilon), (context, results["final"])
        assert epsilon > 0, (context, results["final"])
        assert all(r["epsilon"] is not None for r in results["rounds"]), context
    run_log = (submission.output_dir / "run.log").read_text()
    assert "Roster: 2 devices" in run_log, context


@pytest.mark.deploy
def test_deploy_num_clients_must_match_the_supernodes(
    federation: Federation, submitted: dict[str, Submission]
) -> None:
    expected = {
        "too-few-clients": "num_clients=1, but the federation has 2 SuperNodes",
        "too-many-clients": "num_clients=3, but only 2 SuperNodes connected within 4 s",
        # a bad value ends the run as failed (flwr ls), with the one-line reason in its log
        "bad-value": "invalid configuration, nothing was run: privacy.epsilon=-1",
    }
    for name, message in expected.items():
        submission = submitted[name]
        status, results = federation.wait(submission)
        assert results is None, name
        assert status == "finished:failed", name
        assert message in federation.log(submission.run_id), name


@pytest.mark.deploy
def test_deploy_refuses_unregistered_and_plaintext_supernodes(
    federation: Federation, device_files: list[Path], submitted: dict[str, Submission]
) -> None:
    deployment = federation.deployment
    intruder_key = federation.root / "intruder"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ecdsa", "-b", "384", "-N", "", "-f", str(intruder_key)], check=True
    )
    common = [
        local_deployment.executable("flower-supernode"),
        "--superlink",
        deployment.address,
        "--max-retries",
        "1",
        "--node-config",
        f'data-path="{device_files[0]}"',
    ]
    attempts = {
        "unregistered": [
            "--root-certificates",
            str(deployment.certificates / "ca.crt"),
            "--auth-supernode-private-key",
            str(intruder_key),
        ],
        "plaintext": ["--insecure"],
    }
    intruders = []
    try:
        for name, extra in attempts.items():
            home = federation.root / name
            intruders.append(
                local_deployment.spawn(
                    name,
                    [*common, *extra, "--port", str(local_deployment.free_port())],
                    cwd=home,
                    env={**os.environ, "FLWR_HOME": str(home / "flwr-home")},
                    log=home / "supernode.log",
                    die_with_parent=True,
                )
            )
        deadline = time.monotonic() + 120
        while any(p.alive() for p in intruders) and time.monotonic() < deadline:
            time.sleep(0.5)
        for intruder in intruders:
            assert not intruder.alive(), f"{intruder.name} SuperNode still running"
            assert "Failed to initialize the connection to the SuperLink" in intruder.log_tail(60), (
                intruder.name
            )
    finally:
        local_deployment.stop_processes(intruders)
    nodes = local_deployment.json_output(
        federation.flwr("supernode", "list", deployment.connection, "--format", "json")
    )
    online = sorted(int(n["node-id"]) for n in nodes["nodes"] if n["status"] == "online")
    assert online == sorted(deployment.node_ids)


@pytest.mark.deploy
def test_a_dead_superexec_fails_a_waiting_test_within_a_minute_naming_it(
    tmp_path: Path, device_files: list[Path], staged_app: Path
) -> None:
    """Without the SuperExec no ServerApp starts: the wait must end in seconds, not RUN_DEADLINE_S."""
    cli_env = {**os.environ, "FLWR_HOME": str(tmp_path / "cli-home")}
    deployment = local_deployment.start(
        tmp_path / "federation",
        data_files=device_files,
        secure=False,
        port=local_deployment.free_port(),
        connection="dpfl-test-no-superexec",
        cli_env=cli_env,
        die_with_parent=True,
    )
    try:
        superlink = deployment.processes[0]
        deadline = time.monotonic() + 60
        while not local_deployment.superexec_pids(superlink.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        superexecs = local_deployment.superexec_pids(superlink.pid)
        assert superexecs, "the SuperLink started no flower-superexec"
        assert deployment.problems() == []
        for pid in superexecs:
            os.kill(pid, 9)
        federation = Federation("insecure", tmp_path, staged_app, deployment, cli_env)
        submission = federation.submit("fedavg", algorithm_overrides("fedavg"))
        started = time.monotonic()
        with pytest.raises(pytest.fail.Exception, match=r"flower-superexec .* is not running"):
            federation.wait(submission)
        assert time.monotonic() - started < 60
    finally:
        deployment.stop()
    assert deployment.running() == []


# ------------------------------------------------------------------------------ unit tests


@pytest.mark.subprocess
def test_device_guard_refuses_the_servers_data_set(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(GUARD)
    probe = (
        "from fl_app.data.sources import load_dataset; "
        "load_dataset({'name': 'digits', 'test_fraction': 0.2}, seed=0)"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    guarded = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=False
    )
    assert guarded.returncode != 0
    assert "called on a device" in guarded.stderr


def _device_file(tmp_path: Path, rows: int = 12, shape: tuple[int, ...] = (8, 8)) -> Path:
    rng = np.random.default_rng(0)
    path = tmp_path / "device.npz"
    np.savez(
        path, x=rng.integers(0, 17, size=(rows, *shape), dtype=np.uint8), y=rng.integers(0, 10, size=rows)
    )
    return path


def test_device_client_draws_noise_from_os_entropy(tmp_path: Path) -> None:
    from clients.base import FederatedClient

    config = spec_config(DATA)  # the server asks for seeded noise (secure-rng false, noise-seed 42)
    assert config[keys.SECURE_RNG] is False
    assert keys.NOISE_SEED in config
    device = make_context(partition_id=None, node_config={keys.NODE_DATA_PATH: str(_device_file(tmp_path))})
    simulated = make_context(partition_id=0, num_partitions=3)

    def draws(context: Any) -> list[np.ndarray]:
        return [
            FederatedClient(make_message(config), context).noise_generator("uplink-noise").normal(size=4)
            for _ in range(2)
        ]

    first, second = draws(device)
    assert FederatedClient(make_message(config), device).noise_source.secure
    assert not np.allclose(first, second)  # fresh OS entropy every time, whatever the seed says
    first, second = draws(simulated)
    assert not FederatedClient(make_message(config), simulated).noise_source.secure
    assert np.array_equal(first, second)  # the simulation stays reproducible


@pytest.mark.subprocess
def test_a_devices_roster_answer_does_not_import_torch(tmp_path: Path) -> None:
    """The roster query's ClientApp process reads the data file's size and replies, without torch."""
    path = _device_file(tmp_path, rows=11)
    probe = f"""
import sys
from flwr.app import ConfigRecord, Context, Message, RecordDict
from fl_app import keys
from fl_app.client_app import roster
from fl_app.engine.messages import set_task_identity
set_task_identity(run_id=1, node_id=5)
context = Context(run_id=1, node_id=5, node_config={{keys.NODE_DATA_PATH: {str(path)!r}}}, state=RecordDict(),
                  run_config={{}})
content = RecordDict({{keys.CONFIG: ConfigRecord({{keys.SEED: 1}})}})
query = Message(content, dst_node_id=5, message_type="query.roster")
reply = roster(query, context)
print(reply.content.metric_records[keys.METRICS][keys.NUM_EXAMPLES], "torch" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.split() == ["11", "False"], out.stderr[-2000:]


def test_device_client_reads_its_own_data_file(tmp_path: Path) -> None:
    from clients.base import FederatedClient

    path = _device_file(tmp_path, rows=17)
    context = make_context(partition_id=None, node_config={keys.NODE_DATA_PATH: str(path)})
    query = make_message({keys.DATA_SPEC: "not used on a device", keys.SEED: 1})
    reply = FederatedClient(query, context).describe()
    metrics = reply.content.metric_records[keys.METRICS]
    assert metrics[keys.PARTITION_ID] == -1
    assert metrics[keys.NUM_EXAMPLES] == 17
    data = FederatedClient(make_message(spec_config(DATA)), context).local_data()
    assert data.x.shape == (17, 1, 8, 8)
    assert data.y.dtype == np.int64


def test_device_client_without_data_path_says_how_to_start_it() -> None:
    from clients.base import FederatedClient

    client = FederatedClient(make_message(spec_config(DATA)), make_context(partition_id=None))
    with pytest.raises(ValueError, match="--node-config 'data-path="):
        client.local_data()


def test_device_data_must_fit_the_servers_model(tmp_path: Path) -> None:
    from clients.base import FederatedClient

    path = _device_file(tmp_path, shape=(28, 28))
    client = FederatedClient(
        make_message(spec_config(DATA)),  # the server's model takes digits' 8x8 images
        make_context(partition_id=None, node_config={keys.NODE_DATA_PATH: str(path)}),
    )
    with pytest.raises(ValueError, match=r"shape \(1, 28, 28\), but the server's model takes \(1, 8, 8\)"):
        client.local_data()


class _Grid:
    """The part of Flower's Grid the roster uses, answered by fake nodes."""

    def __init__(self, answers: dict[int, tuple[int, int]]) -> None:
        self.answers = answers  # node id -> (partition id, num examples)

    def get_node_ids(self) -> list[int]:
        return list(self.answers)

    def send_and_receive(self, messages: list[Message], timeout: float) -> list[Message]:
        replies = []
        for message in messages:
            partition, size = self.answers[message.metadata.dst_node_id]
            content = RecordDict(
                {keys.METRICS: MetricRecord({keys.PARTITION_ID: partition, keys.NUM_EXAMPLES: size})}
            )
            replies.append(Message(content=content, reply_to=message))  # from dst_node_id
        return replies


def test_roster_marks_devices_and_orders_them_by_node_id() -> None:
    grid = _Grid({907: (-1, 30), 15: (-1, 40), 311: (-1, 50)})
    roster = discover_roster(grid, expected=3, config=ConfigRecord({}), timeout=5)  # type: ignore[arg-type]
    assert [(c.client_id, c.node_id, c.num_examples) for c in roster] == [
        (15, 15, 40),
        (311, 311, 50),
        (907, 907, 30),
    ]
    assert on_devices(roster)
    simulated = discover_roster(
        _Grid({907: (1, 30), 15: (0, 40)}),
        expected=2,
        config=ConfigRecord({}),
        timeout=5,  # type: ignore[arg-type]
    )
    assert [c.client_id for c in simulated] == [0, 1]
    assert not on_devices(simulated)
    assert not on_devices([ClientInfo(0, 1000, 5)])


def test_a_simulation_roster_asks_no_node_once_the_engine_numbered_them_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The simulation engine numbers its nodes and the server holds the same split: the roster is
    # built without a query (10,000 queries took 7 s). It must equal what the nodes would answer;
    # a numbering that does not name exactly the connected nodes (not yet recorded, or an earlier
    # run's) is waited for, then the nodes are asked as before.
    answers = {907: (1, 30), 15: (0, 40), 311: (2, 50)}
    asked = _Grid(answers)
    queried = discover_roster(asked, expected=3, config=ConfigRecord({}), timeout=5)  # type: ignore[arg-type]

    class Silent(_Grid):
        def send_and_receive(self, messages: list[Message], timeout: float) -> list[Message]:
            raise AssertionError("a simulated roster asked the nodes")

    calls = iter([None, {15: (0, 40)}, dict(answers)])  # recorded a moment after the nodes connected
    known = discover_roster(
        Silent(answers),  # type: ignore[arg-type]
        expected=3,
        config=ConfigRecord({}),
        timeout=5,
        simulated=lambda: next(calls),
    )
    assert known == queried
    assert not on_devices(known)
    monkeypatch.setattr("fl_app.run.roster.SIMULATED_WAIT_S", 0.1)
    stale = discover_roster(
        _Grid(answers),  # type: ignore[arg-type]
        expected=3,
        config=ConfigRecord({}),
        timeout=5,
        simulated=lambda: {1: (0, 40), 2: (1, 30), 3: (2, 50)},  # an earlier run's node ids
    )
    assert stale == queried


def test_a_simulations_nodes_are_waited_for_whatever_the_reply_deadline() -> None:
    """``simulation.timeout`` is a deadline for replies: with 1 ms a loaded machine failed a simulation
    ("0 SuperNodes connected") because the engine registers its nodes a moment after the ServerApp
    starts. A simulation waits for them; a deployment's devices still get only the deadline."""
    answers = {15: (0, 40), 311: (1, 50)}

    class Registering(_Grid):
        polls = 0

        def get_node_ids(self) -> list[int]:
            self.polls += 1
            return list(self.answers) if self.polls > 5 else []

    simulated = discover_roster(
        Registering(answers),  # type: ignore[arg-type]
        expected=2,
        config=ConfigRecord({}),
        timeout=0.001,
        simulated=lambda: dict(answers),
    )
    assert [(c.client_id, c.node_id) for c in simulated] == [(0, 15), (1, 311)]
    with pytest.raises(RosterError, match="num_clients=2, but only 0 SuperNodes connected"):
        discover_roster(Registering(answers), expected=2, config=ConfigRecord({}), timeout=0.001)  # type: ignore[arg-type]


def test_roster_rejects_a_federation_of_another_size(monkeypatch: pytest.MonkeyPatch) -> None:
    grid = _Grid({1: (-1, 5), 2: (-1, 5), 3: (-1, 5)})
    with pytest.raises(RosterError, match="num_clients=2, but the federation has 3 SuperNodes"):
        discover_roster(grid, expected=2, config=ConfigRecord({}), timeout=5)  # type: ignore[arg-type]
    monkeypatch.setattr("fl_app.run.roster.ROSTER_POLL_S", 0.05)
    started = time.monotonic()
    with pytest.raises(RosterError, match="num_clients=4, but only 3 SuperNodes connected within 0 s"):
        discover_roster(grid, expected=4, config=ConfigRecord({}), timeout=0.3)  # type: ignore[arg-type]
    assert time.monotonic() - started < 5


def test_server_noise_is_secure_once_devices_are_seen() -> None:
    settings = settings_of([*DATA, "strategy=dp_fedavg", "privacy.noise_seed=7"])
    assert not noise_source(settings).secure
    forced = with_secure_noise(settings)
    assert forced.privacy.secure_rng is True
    assert forced.privacy.noise_seed is None
    assert noise_source(forced).secure
    assert forced.config["privacy"]["secure_rng"] is True  # and the published echo says so
    assert forced.strategy == settings.strategy
    assert forced.strategy_settings is settings.strategy_settings
    assert forced.num_clients == settings.num_clients


def _device_strategy(
    name: str, overrides: list[str], tmp_path: Path, *, roster: list[ClientInfo] | None = None
) -> Any:
    """A strategy as the SuperLink builds it for real devices (three, unless ``roster`` names them)."""
    from fl_app.learning.model_spec import ModelSpec

    settings = settings_of([*DATA, f"strategy={name}", *overrides])
    data = federated_data(settings.data)
    if roster is None:
        roster = [ClientInfo(node, node, 60, device=True) for node in (7001, 7002, 7003)]
    model_spec = ModelSpec(
        STRATEGIES.get(name).declaration.model_name(settings, data.input_shape),
        data.input_shape,
        data.num_classes,
    )
    run = make_run_context(settings, roster=roster, data=data, model_spec=model_spec, output_dir=tmp_path)
    return STRATEGIES.get(name)(run)


def test_device_server_cohorts_and_noise_never_repeat_across_runs(tmp_path: Path) -> None:
    """Two deployments with one config (even one naming a noise seed): fresh cohorts and server noise."""
    from conftest import reply_to
    from flwr.app import Array, ArrayRecord

    def cohorts_and_noise(name: str, overrides: list[str]) -> tuple[list[list[int]], np.ndarray]:
        strategy = _device_strategy(name, ["privacy.noise_seed=7", "num_rounds=12", *overrides], tmp_path)
        assert strategy.run.noise.secure and strategy.run.settings.privacy.noise_seed is None
        drawn = [[c.client_id for c in strategy.select_clients(t)] for t in range(1, 13)]
        start = strategy.initial_arrays()
        start = ArrayRecord({k: Array(np.zeros_like(v.numpy())) for k, v in start.items()})
        messages = list(strategy.configure_train(1, start, ConfigRecord(), grid=None))
        arrays, _ = strategy.aggregate_train(1, [reply_to(m, arrays=start) for m in messages])
        return drawn, np.concatenate([arrays[k].numpy().ravel() for k in arrays])

    # DP-FedAvg: the Poisson cohort (amplification) and the central noise.
    first = cohorts_and_noise("dp_fedavg", ["clients_per_round=1"])
    second = cohorts_and_noise("dp_fedavg", ["clients_per_round=1"])
    assert first[0] != second[0]
    assert not np.allclose(first[1], second[1])
    # NbAFL: the downlink noise of the server.
    first = cohorts_and_noise("nbafl", ["clients_per_round=3", "strategy.sigma_down=0.5"])
    second = cohorts_and_noise("nbafl", ["clients_per_round=3", "strategy.sigma_down=0.5"])
    assert np.std(first[1]) > 0.25
    assert not np.allclose(first[1], second[1])


def _refusing(name: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(REFUSAL.format(name=name))

    return refuse


@contextlib.contextmanager
def refused_as_on_a_device() -> Iterator[None]:
    """:data:`GUARD` here: every binding of :data:`DEVICE_REFUSES`, in every loaded module, refuses.

    (The deployed guard replaces them as their modules load, before any other module binds them.)
    """
    guarded = {
        id(getattr(module, attr)): _refusing(f"{name}.{attr}")
        for name, attrs in DEVICE_REFUSES.items()
        for module in [importlib.import_module(name)]
        for attr in attrs
    }
    swapped = []
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            if id(value) in guarded and callable(value):
                swapped.append((namespace, attr, value))
                namespace[attr] = guarded[id(value)]
    try:
        yield
    finally:
        for namespace, attr, value in swapped:
            namespace[attr] = value


class DeviceGrid:
    """Devices answered in this process as a deployment answers them.

    Each node is a device (its ``data-path`` file, no partition id); every message and reply crosses
    Flower's wire format, the node's Context is stored and read back as Flower's protobuf between
    messages (a SuperNode keeps it while its ClientApp processes come and go), and the ClientApp's
    ``train`` runs under :func:`refused_as_on_a_device`. ``answered`` keeps each (message, reply).
    """

    def __init__(self, files: list[Path], first_node: int = 7001) -> None:
        self.stored = {
            first_node + i: stored_context(
                make_context(
                    partition_id=None, node_id=first_node + i, node_config={keys.NODE_DATA_PATH: str(f)}
                )
            )
            for i, f in enumerate(files)
        }
        self.answered: list[tuple[Message, Message]] = []

    def roster(self) -> list[ClientInfo]:
        """The devices as the roster query finds them (client id = node id)."""
        from fl_app.client_app import roster

        found = []
        for node, stored in self.stored.items():
            query = make_message({keys.SEED: 1}, message_type="query.roster", node_id=node)
            reply = roster(query, restored_context(stored))
            size = int(reply.content.metric_records[keys.METRICS][keys.NUM_EXAMPLES])
            found.append(ClientInfo(node, node, size, device=True))
        return found

    def answer(self, message: Message) -> Message:
        """One message, on its device; the Context it leaves is stored."""
        from fl_app.client_app import train
        from fl_app.data import federated

        node = int(message.metadata.dst_node_id)
        context = restored_context(self.stored[node])
        federated._cached.cache_clear()  # a ClientApp process starts without the server's split
        with refused_as_on_a_device():
            reply = train(over_the_wire(message), context)
        self.stored[node] = stored_context(context)
        return over_the_wire(reply)

    def send_and_receive(
        self, messages: Iterable[Message], timeout: float | None = None, summand: Any = None
    ) -> list[Message]:
        """Every message answered on its device (one per client: a deployment sends no packed messages)."""
        replies = []
        for message in messages:
            reply = self.answer(message)
            self.answered.append((message, reply))
            replies.append(reply)
        return replies


def _uploads(reply: Message) -> tuple[int, str]:
    """The size and SHA-256 of the bytes of every array a reply uploads."""
    data = b"".join(a.data for record in reply.content.array_records.values() for a in record.values())
    return len(data), hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("algorithm", device_algorithms())
def test_each_client_class_answers_on_a_device_without_the_servers_data_or_hydra(
    algorithm: str, device_files: list[Path], tmp_path: Path
) -> None:
    """Every client class (one algorithm each, with its deployment's settings) trains on two devices.

    Through the real round loop and strategy (built as the SuperLink builds it for devices), each
    message answered on a :class:`DeviceGrid`; the algorithms of :data:`ANSWERED_IN_PROCESS` are
    deployed by nothing else. A client whose upload is noised on the device (local or distributed DP,
    record-level DP-SGD) draws that noise from OS entropy: the same message answered again uploads
    something else (PrivateKT's 2 labels here come out the same with probability about 0.73: up to 40
    answers; a seeded generator gives the same upload every time).
    """
    from fl_app.run.round_loop import run_rounds

    grid = DeviceGrid(device_files)
    overrides = [o for o in algorithm_overrides(algorithm)[len(DATA) :] if not o.startswith("strategy=")]
    strategy = _device_strategy(algorithm, overrides, tmp_path, roster=grid.roster())
    rounds = strategy.run.settings.num_rounds
    assert rounds == deployed_rounds(algorithm)
    final = run_rounds(
        strategy,
        grid,
        strategy.initial_arrays(),
        first_round=1,
        num_rounds=rounds,
        timeout=60.0,
        after_round=lambda server_round, arrays: None,
    )
    errors = [reply.error.reason for _, reply in grid.answered if reply.has_error()]
    assert not errors, (algorithm, errors)
    assert {int(m.metadata.dst_node_id) for m, _ in grid.answered} == set(grid.stored)
    assert np.isfinite(flat_vector(final)).all()
    unit = STRATEGIES.get(algorithm).declaration.unit
    if unit != "none" and "central DP" not in unit:
        message, reply = next((m, r) for m, r in grid.answered if r.content.array_records)
        first = _uploads(reply)
        for _ in range(40):
            again = _uploads(grid.answer(message))
            assert again[0] == first[0], (algorithm, "another upload size")
            if again != first:
                break
        assert again != first, f"{algorithm}: one upload 41 times on a device (noise not from OS entropy)"


def test_device_files_hold_exactly_the_simulation_partitions(tmp_path: Path) -> None:
    paths = make_device_data.write_device_files(tmp_path, DATA)
    data = federated_data(DataSpec.from_config(compose_config(DATA)))
    assert [p.name for p in paths] == ["device0.npz", "device1.npz"]
    for index, path in enumerate(paths):
        with np.load(path) as archive:
            assert np.array_equal(archive["x"], data.client(index).x)
            assert np.array_equal(archive["y"], data.client(index).y)


def test_make_device_data_rejects_bad_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert make_device_data.main([str(tmp_path / "out"), "num_clients=0"]) == 2
    assert "num_clients=0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_make_certs_makes_a_ca_a_loopback_server_certificate_and_node_keys(tmp_path: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key

    out = tmp_path / "certs"
    subprocess.run(["bash", str(SCRIPTS / "make_certs.sh"), str(out), "2", "DNS:server.lan"], check=True)
    server = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", "server.lan"} <= set(names.get_values_for_type(x509.DNSName))
    assert "127.0.0.1" in {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    assert server.issuer == ca.subject
    server.verify_directly_issued_by(ca)
    for index in range(2):
        private = load_ssh_private_key((out / f"supernode-{index}").read_bytes(), None)
        public = load_ssh_public_key((out / f"supernode-{index}.pub").read_bytes())
        assert isinstance(private, ec.EllipticCurvePrivateKey)
        assert isinstance(public, ec.EllipticCurvePublicKey)
        assert private.curve.name == "secp384r1"
    again = subprocess.run(
        ["bash", str(SCRIPTS / "make_certs.sh"), str(out)], capture_output=True, check=False
    )
    assert again.returncode == 2  # never overwrites a CA


def test_simulation_joins_an_existing_ray_cluster() -> None:
    joined = backend_config(settings_of(["simulation.ray_address=127.0.0.1:6379", "simulation.num_cpus=2"]))
    assert joined["init_args"]["address"] == "127.0.0.1:6379"
    assert "num_cpus" not in joined["init_args"]  # the cluster decides its resources
    private = backend_config(settings_of(["simulation.num_cpus=2"]))
    assert private["init_args"]["address"] == "local"  # never a cluster `ray start` left running
    assert private["init_args"]["num_cpus"] == 2
