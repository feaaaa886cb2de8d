"""Start and stop a local dpfl deployment: one SuperLink and N SuperNodes on this machine.

Usage::

    python scripts/local_deployment.py start [--secure] [--supernodes N] [--port P] [--dir DIR]
                                             [--connection NAME] [key=value ...]
    python scripts/local_deployment.py status [--dir DIR]
    python scripts/local_deployment.py stop [--dir DIR]
    python scripts/local_deployment.py stage TARGET
    python scripts/local_deployment.py stop-flwr-superlink
    python scripts/local_deployment.py gate [--slots K] [--dir DIR]

``start`` does what docs/deploy.md does by hand: it writes one data file per
SuperNode (``scripts/make_device_data.py`` with the given Hydra overrides,
default ``dataset=digits partition=iid num_clients=N``), starts a SuperLink on
127.0.0.1:P (default 9092) and N SuperNodes, each in its own process group,
working directory and ``FLWR_HOME`` below DIR (default
``~/.cache/dpfl/local-deployment``), and adds the connection NAME (default
``dpfl-local``) to the Flower configuration of this user (``$FLWR_HOME/config.toml``,
default ``~/.flwr/config.toml``). With ``--secure`` it also makes a CA, a
server certificate and SuperNode keys (``scripts/make_certs.sh``), starts the
SuperLink with TLS and SuperNode authentication and registers every
SuperNode's public key before the SuperNode starts. Then::

    flwr run . dpfl-local --stream --run-config 'overrides="dataset=digits partition=iid num_clients=3"'

``stop`` ends every process ``start`` started (and their children), by process
id. ``stage`` copies the app without its ``.venv`` (:func:`stage_app`): ``flwr run TARGET``
then submits the same FAB without first listing the 50,000 files of the environment (7 s of CPU
per submission). ``start`` puts a launch gate before the SuperLink's ``flwr-serverapp``
(:func:`write_serverapp_gate`: at most K ServerApp processes at once, so that runs submitted
together on a busy machine wait at the SuperLink instead of starting a storm of processes);
``gate`` writes it for a SuperLink started by hand. The module is also what
``tests/test_deploy.py`` uses.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

SCRIPTS_DIR = Path(__file__).resolve().parent
DEFAULT_DIR = Path.home() / ".cache" / "dpfl" / "local-deployment"
DEFAULT_PORT = 9092
DEFAULT_CONNECTION = "dpfl-local"
STATE_FILE = "state.json"
STARTUP_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 15.0
#: The line a SuperNode logs once the SuperLink accepted it.
SUPERNODE_READY = "SuperNode ID:"


class DeploymentError(RuntimeError):
    """A process of the deployment did not start; the message quotes its log."""


# ---------------------------------------------------------------------------- processes


def executable(name: str) -> str:
    """Path of a console script of this Python environment (e.g. ``flower-superlink``)."""
    local = Path(sys.executable).parent / name
    if local.is_file():
        return str(local)
    found = shutil.which(name)
    if found is None:
        raise DeploymentError(f"{name} not found: install dpfl (pip install -e .) in this environment")
    return found


def environment_with_scripts(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with this Python environment's script directory first on ``PATH``.

    The SuperLink and SuperNode start further Flower executables
    (``flower-superexec``, ``flwr-serverapp``, ``flwr-clientapp``) by name, so a
    virtual environment that was not activated (as in CI) must still be found.
    """
    scripts = str(Path(sys.executable).parent)
    path = env.get("PATH", os.defpath)
    return {**env, "PATH": os.pathsep.join([scripts, path]) if path else scripts}


#: ServerApp processes a SuperLink of this module runs at once (default: the machine's cores, at
#: least 2); further runs wait at the SuperLink, pending, until one finishes.
SERVERAPP_SLOTS = max(2, os.cpu_count() or 2)
#: Exit status of a launch the gate turned away (EX_TEMPFAIL: try again later).
GATE_BUSY_EXIT = 75
GATE_TEMPLATE = """#!{python} -I
\"\"\"dpfl's launch gate for flwr-serverapp (written by scripts/local_deployment.py).

The SuperLink's SuperExec starts one flwr-serverapp per run it hands out; a process that has not
reported within Flower's heartbeat interval (30 s) loses the run to a new process, and on a busy
machine each new process slows the next (a ServerApp storm). This gate runs at most {slots}
ServerApps at once: it takes a free slot (an flock held for the ServerApp's lifetime, released by
the kernel when it exits) and becomes the real flwr-serverapp, or exits at once without loading
anything, which leaves the run pending at the SuperLink until a slot is free.
\"\"\"
import fcntl
import os
import sys

REAL = {real!r}
for slot in range({slots}):
    fd = os.open(os.path.join({slots_dir!r}, f"slot-{{slot}}"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        continue
    os.set_inheritable(fd, True)
    os.execv(REAL, [REAL, *sys.argv[1:]])
sys.stderr.write("dpfl gate: {slots} ServerApps running; the run stays pending at the SuperLink\\n")
sys.exit({busy})
"""


def write_serverapp_gate(directory: Path, *, slots: int = SERVERAPP_SLOTS, real: str | None = None) -> Path:
    """Write the ``flwr-serverapp`` launch gate into ``directory/bin``; return that folder.

    Put the folder first on the SuperLink's ``PATH`` (its SuperExec starts ``flwr-serverapp`` by
    name): then at most ``slots`` ServerApp processes exist at any time, however late they are for
    their heartbeat and however many runs are submitted (see :data:`GATE_TEMPLATE`). ``real``:
    the program the gate becomes (default: this environment's ``flwr-serverapp``).
    """
    if slots < 1:
        raise DeploymentError(f"serverapp slots must be >= 1, got {slots}")
    bin_dir = directory / "bin"
    slots_dir = directory / "serverapp-slots"
    bin_dir.mkdir(parents=True, exist_ok=True)
    slots_dir.mkdir(parents=True, exist_ok=True)
    gate = bin_dir / "flwr-serverapp"
    gate.write_text(
        GATE_TEMPLATE.format(
            python=sys.executable,
            real=real or executable("flwr-serverapp"),
            slots=slots,
            slots_dir=str(slots_dir),
            busy=GATE_BUSY_EXIT,
        )
    )
    gate.chmod(0o755)
    return bin_dir


#: Tries to start a SuperNode on a fresh free port when the one picked was taken before it bound it.
PORT_ATTEMPTS = 3
PORT_IN_USE = "address already in use"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def _start_time(pid: int) -> float | None:
    """The start time of ``pid`` (None when it does not exist): guards against pid reuse."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def descendants(pid: int) -> list[int]:
    """All living descendants of ``pid`` (also those that started their own session)."""
    try:
        return [child.pid for child in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def runs_program(command: Sequence[str], name: str) -> bool:
    """Whether the command line ``command`` runs the console script ``name`` (directly or by python)."""
    return any(Path(part).name == name for part in command[:2])


def superexec_pids(superlink_pid: int) -> list[int]:
    """The ``flower-superexec`` processes the SuperLink ``superlink_pid`` started."""
    found = []
    for pid in descendants(superlink_pid):
        try:
            command = psutil.Process(pid).cmdline()
        except psutil.Error:
            continue
        if runs_program(command, "flower-superexec"):
            found.append(pid)
    return found


@dataclass
class Process:
    """One process the deployment started (the leader of its own process group)."""

    name: str
    pid: int
    start_time: float | None
    log: str

    def alive(self) -> bool:
        """Whether the process still runs (and is still the one started)."""
        return _running(self.pid, self.start_time)

    def log_tail(self, lines: int = 25) -> str:
        """The last lines of the process's log."""
        try:
            text = Path(self.log).read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the parent dies (Linux ``PR_SET_PDEATHSIG``)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def spawn(
    name: str,
    argv: Sequence[str],
    *,
    cwd: Path,
    env: Mapping[str, str],
    log: Path,
    die_with_parent: bool = False,
    path_first: Path | None = None,
) -> Process:
    """Start ``argv`` in a new session (its own process group), output into ``log``.

    ``path_first``: a folder put before everything else on the process's ``PATH`` (the gate).

    ``die_with_parent`` (tests): the process gets SIGTERM if this process dies
    without stopping it (e.g. a killed test run), so nothing is left behind.
    """
    cwd.mkdir(parents=True, exist_ok=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    environment = environment_with_scripts(env)
    if path_first is not None:
        environment["PATH"] = os.pathsep.join([str(path_first), environment["PATH"]])
    with log.open("ab") as out:
        child = subprocess.Popen(
            list(argv),
            cwd=cwd,
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent if die_with_parent else None,
        )
    return Process(name, child.pid, _start_time(child.pid), str(log))


def stop_processes(processes: Sequence[Process], timeout: float = STOP_TIMEOUT_S) -> list[str]:
    """SIGTERM each process's group and descendants, SIGKILL what is left; return what needed a kill.

    Only processes this deployment started (checked by pid and start time) and
    their descendants are signalled.
    """
    targets: dict[int, float | None] = {}
    for process in processes:
        if not process.alive():
            continue
        targets[process.pid] = process.start_time
        for pid in descendants(process.pid):
            targets.setdefault(pid, _start_time(pid))
    for process in processes:
        if process.pid in targets:
            _signal_group(process.pid, signal.SIGTERM)
    for pid, started in targets.items():
        if _start_time(pid) == started:
            _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_running(pid, s) for pid, s in targets.items()):
        time.sleep(0.2)
        _reap(targets)
    killed = []
    for pid, started in targets.items():
        if _running(pid, started):
            killed.append(str(pid))
            _signal(pid, signal.SIGKILL)
    _reap(targets)
    return killed


def _running(pid: int, started: float | None) -> bool:
    """Whether ``pid`` is the process that started at ``started`` and has not exited."""
    try:
        process = psutil.Process(pid)
        return process.create_time() == started and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _reap(targets: Mapping[int, float | None]) -> None:
    for pid in targets:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def wait_for_port(host: str, port: int, process: Process, timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Wait until ``host:port`` accepts connections (raise if ``process`` dies first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.alive():
            raise DeploymentError(f"{process.name} exited:\n{process.log_tail()}")
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.settimeout(1.0)
            if probe.connect_ex((host, port)) == 0:
                return
        time.sleep(0.3)
    raise DeploymentError(f"{process.name} did not listen on {host}:{port} in {timeout:.0f} s")


def wait_for_log(process: Process, text: str, timeout: float = STARTUP_TIMEOUT_S) -> None:
    """Wait until ``text`` appears in the process's log (raise if it dies first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if text in Path(process.log).read_text(errors="replace"):
                return
        except OSError:
            pass
        if not process.alive():
            raise DeploymentError(f"{process.name} exited:\n{process.log_tail()}")
        time.sleep(0.3)
    raise DeploymentError(
        f"{process.name}: no {text!r} in its log within {timeout:.0f} s:\n{process.log_tail()}"
    )


# ---------------------------------------------------------------------------- the flwr CLI


def flwr_home(env: Mapping[str, str] | None = None) -> Path:
    """The Flower home the ``flwr`` CLI uses (``$FLWR_HOME``, default ``~/.flwr``)."""
    value = (env if env is not None else os.environ).get("FLWR_HOME")
    return Path(value) if value else Path.home() / ".flwr"


def write_connection(home: Path, name: str, address: str, *, root_certificates: Path | None) -> Path:
    """Add (or replace) the SuperLink connection ``name`` in ``home/config.toml``."""
    import tomli_w

    from fl_app.engine.tooling import default_flower_config

    path = home / "config.toml"
    text = path.read_text() if path.is_file() else default_flower_config()
    config: dict[str, Any] = tomllib.loads(text)
    connection: dict[str, Any] = {"address": address}
    if root_certificates is None:
        connection["insecure"] = True
    else:
        connection["root-certificates"] = str(root_certificates.resolve())
    config.setdefault("superlink", {})[name] = connection
    home.mkdir(parents=True, exist_ok=True)
    path.write_text(tomli_w.dumps(config))
    return path


def flwr(args: Sequence[str], *, env: Mapping[str, str], timeout: float = 600.0) -> str:
    """Run one ``flwr`` CLI command from a neutral directory; return its stdout (raise on failure).

    ``timeout`` is a safety limit: on a busy machine one ``flwr run`` (building
    the FAB and starting the run) has taken more than two minutes.
    """
    result = subprocess.run(
        [executable("flwr"), *args],
        cwd=Path(env.get("FLWR_HOME", str(Path.home()))).expanduser(),
        env=environment_with_scripts(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if result.returncode != 0:
        raise DeploymentError(
            f"flwr {' '.join(args)} failed ({result.returncode}):\n{result.stdout}{result.stderr}"
        )
    return result.stdout


def json_output(text: str) -> dict[str, Any]:
    """The JSON object in a ``flwr ... --format json`` output (ignoring lines printed before it)."""
    return json.loads(text[text.index("{") :])


# ---------------------------------------------------------------------------- the deployment


@dataclass
class LocalDeployment:
    """A SuperLink and SuperNodes on this machine, described by ``directory/state.json``."""

    directory: Path
    secure: bool
    port: int
    connection: str
    host: str = "127.0.0.1"
    processes: list[Process] = field(default_factory=list)
    node_ids: list[int] = field(default_factory=list)

    @property
    def address(self) -> str:
        """The SuperLink's address (Fleet, Control and Runtime API)."""
        return f"{self.host}:{self.port}"

    @property
    def certificates(self) -> Path:
        """Where the CA, server certificate and SuperNode keys are."""
        return self.directory / "certificates"

    def save(self) -> None:
        """Write ``state.json``."""
        state = asdict(self)
        state["directory"] = str(self.directory)
        (self.directory / STATE_FILE).write_text(json.dumps(state, indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path) -> LocalDeployment | None:
        """The deployment recorded in ``directory`` (None when there is none)."""
        path = directory / STATE_FILE
        if not path.is_file():
            return None
        state = json.loads(path.read_text())
        state["directory"] = Path(state["directory"])
        state["processes"] = [Process(**p) for p in state["processes"]]
        return cls(**state)

    def running(self) -> list[Process]:
        """The processes still alive."""
        return [p for p in self.processes if p.alive()]

    def problems(self) -> list[str]:
        """What is dead that a run needs: a process of :attr:`processes`, or the SuperExec.

        The SuperLink starts a ``flower-superexec`` that launches every ServerApp: without it a
        submitted run stays pending for ever. Each problem is one line with the log's last line.
        """
        found = []
        for process in self.processes:
            if not process.alive():
                last = process.log_tail(1) or "(empty log)"
                found.append(f"{process.name} (pid {process.pid}) is not running; its log ends: {last}")
        superlink = next((p for p in self.processes if p.name == "superlink"), None)
        if superlink is not None and superlink.alive() and not superexec_pids(superlink.pid):
            found.append(
                f"the SuperLink's flower-superexec (which launches every ServerApp) is not running "
                f"(SuperLink pid {superlink.pid})"
            )
        return found

    def stop(self) -> list[str]:
        """Stop every process (children included); return the ids that needed SIGKILL."""
        killed = stop_processes(self.processes)
        self.save()
        return killed


def make_certificates(directory: Path, num_supernodes: int) -> None:
    """Run ``scripts/make_certs.sh`` (CA, server certificate for 127.0.0.1/localhost, node keys)."""
    result = subprocess.run(
        ["bash", str(SCRIPTS_DIR / "make_certs.sh"), str(directory), str(num_supernodes)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        raise DeploymentError(f"make_certs.sh failed:\n{result.stdout}{result.stderr}")


def start(
    directory: Path,
    *,
    data_files: Sequence[Path],
    secure: bool,
    port: int,
    connection: str = DEFAULT_CONNECTION,
    cli_env: Mapping[str, str] | None = None,
    supernode_ports: Sequence[int] | None = None,
    supernode_env: Mapping[str, str] | None = None,
    die_with_parent: bool = False,
    serverapp_slots: int | None = SERVERAPP_SLOTS,
) -> LocalDeployment:
    """Start a SuperLink and one SuperNode per data file; stop everything again on failure.

    Parameters
    ----------
    directory : Path
        Working directories, Flower homes, logs, certificates and ``state.json``.
    data_files : Sequence[Path]
        One ``.npz`` file (or IDX folder) per SuperNode (``data-path`` of its node config).
    secure : bool
        TLS and SuperNode authentication (else ``--insecure``).
    port : int
        The SuperLink's port on 127.0.0.1.
    connection : str
        Name of the connection written into the ``flwr`` CLI's configuration.
    cli_env : Mapping[str, str], optional
        Environment of the ``flwr`` CLI (its ``FLWR_HOME`` gets the connection).
    supernode_ports : Sequence[int], optional
        Runtime API ports of the SuperNodes (default: free ports).
    supernode_env : Mapping[str, str], optional
        Extra environment variables of the SuperNodes (and so of their ClientApps).
    die_with_parent : bool
        Stop the SuperLink and SuperNodes when this process dies (tests).
    serverapp_slots : int or None
        ServerApp processes that may exist at once (:func:`write_serverapp_gate`); None starts
        the SuperLink without the gate (Flower's own launch policy: one process per hand-out).

    """
    directory = directory.resolve()
    directory.mkdir(parents=True, exist_ok=True)
    cli_env = dict(os.environ if cli_env is None else cli_env)
    deployment = LocalDeployment(directory, secure, port, connection)
    certificates = deployment.certificates
    if secure and not (certificates / "ca.key").is_file():
        make_certificates(certificates, len(data_files))
    missing = [
        i for i in range(len(data_files)) if secure and not (certificates / f"supernode-{i}").is_file()
    ]
    if missing:
        raise DeploymentError(
            f"{certificates} has no key for SuperNode {missing[0]}: remove it to make new ones"
        )
    write_connection(
        flwr_home(cli_env),
        connection,
        deployment.address,
        root_certificates=certificates / "ca.crt" if secure else None,
    )
    try:
        superlink_args = [executable("flower-superlink"), "--host", deployment.host, "--port", str(port)]
        if secure:
            superlink_args += [
                "--ssl-ca-certfile",
                str(certificates / "ca.crt"),
                "--ssl-certfile",
                str(certificates / "server.pem"),
                "--ssl-keyfile",
                str(certificates / "server.key"),
                "--enable-supernode-auth",
            ]
        else:
            superlink_args.append("--insecure")
        superlink = spawn(
            "superlink",
            superlink_args,
            cwd=directory / "superlink",
            env={**os.environ, "FLWR_HOME": str(directory / "superlink" / "flwr-home")},
            log=directory / "logs" / "superlink.log",
            die_with_parent=die_with_parent,
            path_first=(
                None
                if serverapp_slots is None
                else write_serverapp_gate(directory / "superlink", slots=serverapp_slots)
            ),
        )
        deployment.processes.append(superlink)
        deployment.save()
        wait_for_port(deployment.host, port, superlink)
        if secure:
            for index in range(len(data_files)):
                output = flwr(
                    [
                        "supernode",
                        "register",
                        str(certificates / f"supernode-{index}.pub"),
                        connection,
                        "--format",
                        "json",
                    ],
                    env=cli_env,
                )
                deployment.node_ids.append(int(json_output(output)["node-id"]))
        fixed_ports = bool(supernode_ports)
        ports = list(supernode_ports) if supernode_ports else [free_port() for _ in data_files]

        def start_supernode(index: int) -> Process:
            node_dir = directory / f"supernode-{index}"
            args = [
                executable("flower-supernode"),
                "--superlink",
                deployment.address,
                "--port",
                str(ports[index]),
                "--node-config",
                f'data-path="{Path(data_files[index]).resolve()}"',
            ]
            if secure:
                args += [
                    "--root-certificates",
                    str(certificates / "ca.crt"),
                    "--auth-supernode-private-key",
                    str(certificates / f"supernode-{index}"),
                ]
            else:
                args.append("--insecure")
            return spawn(
                f"supernode-{index}",
                args,
                cwd=node_dir,
                env={**os.environ, **(supernode_env or {}), "FLWR_HOME": str(node_dir / "flwr-home")},
                log=directory / "logs" / f"supernode-{index}.log",
                die_with_parent=die_with_parent,
            )

        for index in range(len(data_files)):
            deployment.processes.append(start_supernode(index))
            deployment.save()
        for index in range(len(data_files)):
            for attempt in range(PORT_ATTEMPTS):
                node = deployment.processes[1 + index]
                try:
                    wait_for_log(node, SUPERNODE_READY)
                    break
                except DeploymentError:
                    # a free port can be taken between free_port() and the SuperNode binding it
                    # (another process on the machine): try another one
                    if fixed_ports or attempt == PORT_ATTEMPTS - 1 or PORT_IN_USE not in node.log_tail():
                        raise
                    ports[index] = free_port()
                    deployment.processes[1 + index] = start_supernode(index)
                    deployment.save()
    except BaseException:
        deployment.stop()
        raise
    deployment.save()
    return deployment


# ---------------------------------------------------------------------------- command line


def stage_app(root: Path, target: Path) -> Path:
    """Copy the Flower app at ``root`` (the files its ``.gitignore`` keeps) into ``target``; return it.

    ``flwr run DIR`` builds the app's FAB from DIR by listing *every* file below it and only then
    dropping what ``.gitignore`` excludes (flwr 1.41, ``flwr.cli.utils.collect_files``): with the
    virtual environment inside the project (``.venv``, about 50,000 files) each ``flwr run .``
    costs 7 s of CPU before it submits anything. This copy skips ignored folders without entering
    them, so ``flwr run <target>`` submits the same FAB, byte for byte (tested), at once. Stage
    again after changing the code.
    """
    import pathspec

    root = root.resolve()
    ignore_file = root / ".gitignore"
    patterns = ignore_file.read_text().splitlines() if ignore_file.is_file() else []
    ignored = pathspec.GitIgnoreSpec.from_lines([*patterns, "/.git/"])
    if target.exists():
        shutil.rmtree(target)
    for folder, subfolders, files in os.walk(root, followlinks=False):
        relative = Path(folder).relative_to(root)
        subfolders[:] = [
            name
            for name in subfolders
            if not (Path(folder) / name).is_symlink()
            and not ignored.match_file(f"{(relative / name).as_posix()}/")
        ]
        for name in files:
            source = Path(folder) / name
            path = (relative / name).as_posix()
            if source.is_symlink() or ignored.match_file(path):
                continue
            destination = target / path
            destination.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination)
    return target


def local_superlinks(home: Path) -> list[psutil.Process]:
    """The SuperLinks ``flwr run`` started for this user with Flower home ``home``.

    Matched by owner (this user only: on a shared machine another user's SuperLink is never
    touched), by program and by the state database below ``home`` that Flower gives the SuperLink
    it starts (``flower-superlink ... --database <home>/local-superlink/state.db``).
    """
    database = str(home / "local-superlink" / "state.db")
    found = []
    for process in psutil.process_iter(["pid", "uids", "cmdline"]):
        try:
            uids, command = process.info["uids"], process.info["cmdline"] or []
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if uids is None or uids.real != os.getuid() or not command:
            continue
        if not runs_program(command, "flower-superlink"):
            continue
        if "--database" in command and command[command.index("--database") + 1 :][:1] == [database]:
            found.append(process)
    return found


def stop_local_superlink(home: Path) -> str:
    """Stop the SuperLinks :func:`local_superlinks` finds and their children, by process id."""
    links = local_superlinks(home)
    if not links:
        return f"no local SuperLink running for FLWR_HOME={home}"
    processes = [Process("superlink", link.pid, _start_time(link.pid), "") for link in links]
    killed = stop_processes(processes)
    pids = " ".join(str(link.pid) for link in links)
    return f"stopped SuperLink {pids} and its simulations (FLWR_HOME={home})" + (
        f"; killed {', '.join(killed)}" if killed else ""
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    begin = commands.add_parser("start", help="start a SuperLink and SuperNodes")
    begin.add_argument("--secure", action="store_true", help="TLS and SuperNode authentication")
    begin.add_argument("--supernodes", type=int, default=3, help="number of SuperNodes (default 3)")
    begin.add_argument(
        "--port", type=int, default=DEFAULT_PORT, help=f"SuperLink port (default {DEFAULT_PORT})"
    )
    begin.add_argument("--connection", default=DEFAULT_CONNECTION, help="name of the flwr connection")
    begin.add_argument("overrides", nargs="*", help="Hydra overrides for the device data files")
    for command in ("status", "stop"):
        commands.add_parser(command, help=f"{command} the deployment")
    commands.add_parser(
        "stop-flwr-superlink", help="stop the background SuperLink `flwr run .` started (this user's, by pid)"
    )
    gate = commands.add_parser(
        "gate", help="write the flwr-serverapp launch gate for a SuperLink you start yourself"
    )
    gate.add_argument(
        "--slots", type=int, default=SERVERAPP_SLOTS, help=f"ServerApps at once (default {SERVERAPP_SLOTS})"
    )
    stage = commands.add_parser("stage", help="copy the app without its .venv, for a fast `flwr run <copy>`")
    stage.add_argument("target", type=Path, help="folder to (re)write")
    for sub in commands.choices.values():
        sub.add_argument(
            "--dir", type=Path, default=DEFAULT_DIR, help=f"state folder (default {DEFAULT_DIR})"
        )
    return parser


def main(argv: Sequence[str]) -> int:
    """Command line entry point."""
    args = _parser().parse_args(argv)
    if args.command == "gate":
        if args.slots < 1:
            print(f"error: --slots must be >= 1, got {args.slots}", file=sys.stderr)
            return 2
        bin_dir = write_serverapp_gate(args.dir.expanduser().resolve() / "gate", slots=args.slots)
        print(f"at most {args.slots} ServerApps at once; start the SuperLink with the gate first on PATH:")
        print(f'PATH="{bin_dir}:$PATH" flower-superlink ...')
        return 0
    if args.command == "stage":
        staged = stage_app(SCRIPTS_DIR.parent, args.target.expanduser().resolve())
        print(
            f"staged the app in {staged}: flwr run {staged} <connection> ... (stage again after code changes)"
        )
        return 0
    if args.command == "stop-flwr-superlink":
        print(stop_local_superlink(flwr_home()))
        return 0
    directory: Path = args.dir.expanduser().resolve()
    existing = LocalDeployment.load(directory)
    if args.command == "stop":
        if existing is None:
            print(f"no deployment recorded in {directory}")
            return 0
        killed = existing.stop()
        print(
            f"stopped {len(existing.processes)} processes"
            + (f" (killed {', '.join(killed)})" if killed else "")
        )
        return 0
    if args.command == "status":  # exit status 0: the question was answered (running or not)
        if existing is None:
            print(f"not running: no deployment recorded in {directory}")
            return 0
        for process in existing.processes:
            print(f"{process.name:12} pid {process.pid:>7}  {'running' if process.alive() else 'stopped'}")
        mode = "TLS" if existing.secure else "insecure"
        print(f"connection {existing.connection!r}: {existing.address} ({mode})")
        print("running" if existing.running() else "not running (stopped or crashed: see the logs)")
        return 0
    if existing is not None and existing.running():
        print(f"error: a deployment is running ({directory}); stop it first", file=sys.stderr)
        return 2
    if args.supernodes < 1:
        print("error: --supernodes must be >= 1", file=sys.stderr)
        return 2
    sys.path.insert(0, str(SCRIPTS_DIR))
    from make_device_data import write_device_files

    overrides = ["dataset=digits", "partition=iid", f"num_clients={args.supernodes}", *args.overrides]
    data_files = write_device_files(directory / "devices", overrides)
    if len(data_files) != args.supernodes:
        print(f"error: the overrides make {len(data_files)} clients, not {args.supernodes}", file=sys.stderr)
        return 2
    try:
        deployment = start(
            directory, data_files=data_files, secure=args.secure, port=args.port, connection=args.connection
        )
    except DeploymentError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    mode = "TLS + SuperNode authentication" if args.secure else "insecure"
    here = Path(__file__).resolve()
    script = here.relative_to(Path.cwd()) if here.is_relative_to(Path.cwd()) else here
    where = "" if directory == DEFAULT_DIR.resolve() else f" --dir {directory}"
    print(f"SuperLink on {deployment.address} ({mode})")
    print(
        f"{args.supernodes} SuperNodes with data from {directory / 'devices'}; logs in {directory / 'logs'}"
    )
    print(f"flwr connection {args.connection!r} written to {flwr_home() / 'config.toml'}")
    run_overrides = " ".join([*overrides, f"clients_per_round={args.supernodes}"])
    project = SCRIPTS_DIR.parent
    app = "." if Path.cwd().resolve() == project else str(project)  # right from any directory
    print(f"run:  flwr run {app} {args.connection} --stream --run-config 'overrides=\"{run_overrides}\"'")
    print(f"stop: python {script} stop{where}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
