"""Where a command's CPU goes, by kind of process: a ``/proc`` sampler around the command.

``getrusage`` misses Ray's processes (they are re-parented away from the command), so this starts the
command with a marker in its environment (:data:`MARK`, inherited by every process it starts, Ray's
workers and Flower's SuperNodes' ClientApps included), looks at every process on the machine every
half second while the command runs, and keeps, for each one that carries the marker, its last CPU
time (user + system), its command line and the test (``PYTEST_CURRENT_TEST`` in its environment at
start) that started it; nothing else running on the machine is counted. A
process shorter than the interval may be missed, and so may up to half a second of a process's CPU just
before it exits; the total is printed beside the machine's busy time (``/proc/stat``), which on a quiet
machine shows how much was missed.

    python -P benchmarks/process_cpu.py -- .venv/bin/python -m pytest -q -p no:cacheprovider

Prints the command's wall time, the machine's busy CPU, then the CPU per kind of process (pytest
workers, Ray workers, Ray's own processes, ``python -m fl_app``, the deployment's Flower processes)
and per test module for what the tests started.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.driver_threads import busy_seconds  # noqa: E402

INTERVAL_S = 0.5
#: The environment variable that marks the command's processes (its value: this run's token).
MARK = "DPFL_PROCESS_CPU"
TICKS = os.sysconf("SC_CLK_TCK")
#: (text in the first 120 characters of the command line, kind), first match wins.
KINDS = (
    ("execnet", "pytest worker"),
    (" -u -c ", "pytest worker"),
    ("-m fl_app", "python -m fl_app"),
    ("default_worker.py", "Ray worker (client actor)"),
    ("setup_worker.py", "Ray worker (client actor)"),  # a worker with a runtime_env, before its exec
    ("ray::", "Ray worker (client actor)"),
    ("gcs_server", "Ray GCS and raylet"),
    ("raylet", "Ray GCS and raylet"),
    ("dashboard", "Ray helper processes"),
    ("log_monitor", "Ray helper processes"),
    ("monitor.py", "Ray helper processes"),
    ("runtime_env", "Ray helper processes"),
    ("flwr-clientapp", "flwr-clientapp"),
    ("flwr-serverapp", "flwr-serverapp"),
    ("flower-supernode", "SuperNode"),
    ("flower-superlink", "SuperLink"),
    ("flower-superexec", "SuperExec"),
    ("bin/flwr ", "flwr CLI"),
    ("loky", "joblib worker"),
    ("pytest", "pytest"),
)


def kind_of(command_line: str) -> str:
    """The kind of a process from its command line."""
    head = command_line[:120]
    for text, kind in KINDS:
        if text in head:
            return kind
    return "other" if command_line.strip() else "(exited before its first look)"


def _read(pid: str) -> tuple[tuple[int, int], float] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return (int(pid), int(fields[19])), (int(fields[11]) + int(fields[12])) / TICKS


def _describe(pid: int, token: str) -> tuple[str, str] | None:
    """The command line and test module of a process of the command (None: not one of its processes)."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    if f"{MARK}={token}".encode() not in environment:
        return None
    marker = b"PYTEST_CURRENT_TEST="
    test = next((e[len(marker) :].decode(errors="replace") for e in environment if e.startswith(marker)), "")
    return command, test.split(" ")[0].split("::")[0]


def sample(stop: threading.Event, token: str, seen: dict[tuple[int, int], list]) -> None:
    """Until ``stop``: the last CPU time of every process marked with ``token``, its command line and test."""
    others: set[tuple[int, int]] = set()
    while not stop.wait(INTERVAL_S):
        for pid in os.listdir("/proc"):
            read = _read(pid) if pid.isdigit() else None
            if read is None or read[0] in others:
                continue
            key, cpu = read
            if key not in seen:
                described = _describe(key[0], token)
                if described is None:
                    others.add(key)
                    continue
                seen[key] = [*described, cpu]
            seen[key][2] = cpu


def main(argv: list[str] | None = None) -> int:
    """Run the command under the sampler; print the CPU per kind of process and per test module."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    seen: dict[tuple[int, int], list] = {}
    stop, token = threading.Event(), uuid.uuid4().hex
    sampler = threading.Thread(target=sample, args=(stop, token, seen), daemon=True)
    busy, started = busy_seconds(), time.monotonic()
    sampler.start()
    code = subprocess.call(command, cwd=ROOT, env={**os.environ, MARK: token})
    wall, busy = time.monotonic() - started, busy_seconds() - busy
    stop.set()
    sampler.join()
    kinds: collections.Counter[str] = collections.Counter()
    counts: collections.Counter[str] = collections.Counter()
    modules: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for command_line, module, cpu in seen.values():
        kind = kind_of(command_line)
        kinds[kind] += cpu
        counts[kind] += 1
        modules[module or "(the command itself)"][kind] += cpu
    print(f"exit {code}; wall {wall:.0f} s; machine busy {busy:.0f} s; sampled {sum(kinds.values()):.0f} s")
    print("| kind of process | processes | CPU s |\n|---|---|---|")
    for kind, cpu in kinds.most_common():
        print(f"| {kind} | {counts[kind]} | {cpu:.0f} |")
    print("\n| started by | CPU s | largest kinds |\n|---|---|---|")
    for module, per_kind in sorted(modules.items(), key=lambda item: -sum(item[1].values()))[:15]:
        largest = ", ".join(f"{kind} {cpu:.0f}" for kind, cpu in per_kind.most_common(3))
        print(f"| {module} | {sum(per_kind.values()):.0f} | {largest} |")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
