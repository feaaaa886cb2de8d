"""Where a command's CPU goes, by kind of process: a ``/proc`` sampler around the command.

``getrusage`` misses Ray's processes (they are re-parented away from the command), so this samples
every process on the machine every half second while the command runs and keeps, per process, its
last CPU time (user + system), its command line and the test (``PYTEST_CURRENT_TEST`` in its
environment at start) that started it. Processes that started before the command are left out. A
process shorter than the interval may be missed or under-counted; the total is checked against the
machine's busy time (``/proc/stat``), so the machine must be quiet.

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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.driver_threads import busy_seconds  # noqa: E402

INTERVAL_S = 0.5
TICKS = os.sysconf("SC_CLK_TCK")
#: (text in the first 120 characters of the command line, kind), first match wins.
KINDS = (
    ("execnet", "pytest worker"),
    (" -u -c ", "pytest worker"),
    ("-m fl_app", "python -m fl_app"),
    ("default_worker.py", "Ray worker (client actor)"),
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


def _describe(pid: int) -> tuple[str, str]:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return "", ""
    marker = b"PYTEST_CURRENT_TEST="
    test = next((e[len(marker) :].decode(errors="replace") for e in environment if e.startswith(marker)), "")
    return command, test.split(" ")[0].split("::")[0]


def sample(stop: threading.Event, seen: dict[tuple[int, int], list]) -> None:
    """Until ``stop``: every process's last CPU time, with its command line and test module."""
    before = {read[0] for pid in os.listdir("/proc") if pid.isdigit() and (read := _read(pid)) is not None}
    while not stop.wait(INTERVAL_S):
        for pid in os.listdir("/proc"):
            read = _read(pid) if pid.isdigit() else None
            if read is None or read[0] in before:
                continue
            key, cpu = read
            if key not in seen:
                seen[key] = [*_describe(key[0]), cpu]
            seen[key][2] = cpu


def main(argv: list[str] | None = None) -> int:
    """Run the command under the sampler; print the CPU per kind of process and per test module."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    seen: dict[tuple[int, int], list] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=sample, args=(stop, seen), daemon=True)
    busy, started = busy_seconds(), time.monotonic()
    sampler.start()
    code = subprocess.call(command, cwd=ROOT)
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
