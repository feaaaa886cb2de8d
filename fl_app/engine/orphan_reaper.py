"""Ray's processes live no longer than the dpfl process that started them, however it ends.

A private Ray instance is a tree of processes: the GCS, the raylet and a few helpers (started by the
driver), and the raylet's own children (its dashboard and runtime-env agents, the workers). Ray ties the
GCS and the raylet to the thread that started them (``PR_SET_PDEATHSIG``), but not the raylet's
children: after ``kill -9`` of the command its two agents stayed up for about 96 s (measured),
re-parented to init.

So before it starts Ray, :func:`watch_owner` starts this module as a small watchdog process (in a
session of its own, ignoring SIGINT, SIGTERM and SIGHUP, so that neither a Ctrl-C nor a signal to the
command's process group reaches it). It blocks reading a pipe whose only writer is the starting process:
the read returns when that process closes it (:meth:`OwnerWatch.close`, after Ray's shutdown) or dies,
whatever killed it. It then kills whatever is left of that Ray instance and, when the process died
without stopping it, says so in one line. It takes no CPU while it waits.

What belongs to the instance (:func:`leftovers`):

* every process whose environment holds :data:`MARK_ENV` with the start's token (the starting process
  sets it before ``ray.init``; every process Ray starts inherits it);
* every Ray process holding a file open in the instance's session folder (``<temp>/session_<time>_<pid of
  the driver>``, named to the watchdog once ``ray.init`` returned, :meth:`OwnerWatch.tell_session`): the
  raylet's children rename themselves (``ray::DashboardAgent``), which blanks the environment
  ``/proc`` shows, but they log into that folder. Before the folder is named, the session folders of the
  starting process's id serve: a process holds one id at a time, and an earlier instance it started was
  shut down before this one began.

Processes of another command's Ray, or of a cluster joined with ``simulation.ray_address`` (no watchdog
then), are never touched.

Run as ``python -I <this file> <token> <pid>``: ``-I`` keeps the package's folder off ``sys.path``, so
the watchdog imports nothing but the standard library and psutil.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

#: Environment variable naming the Ray start a process belongs to (inherited by all of Ray's processes).
MARK_ENV = "DPFL_RAY_OWNER"
#: Seconds to wait for killed processes to be gone.
KILL_WAIT_S = 5.0
#: Looks at the process table (a process may start while the first ones die).
PASSES = 3
_ERRORS = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError)


def _looks_like_ray(process: psutil.Process) -> bool:
    """Whether ``process`` may be one of Ray's (its name or the start of its command line says so)."""
    try:
        if process.status() == psutil.STATUS_ZOMBIE:
            return False
        return any("ray" in part.lower() for part in [process.name(), *process.cmdline()[:3]])
    except _ERRORS:
        return False


def _holds_file(process: psutil.Process, inside: Callable[[str], bool]) -> bool:
    try:
        return any(inside(opened.path) for opened in process.open_files())
    except _ERRORS:
        return False


def _marked(process: psutil.Process, token: str) -> bool:
    try:
        return process.environ().get(MARK_ENV) == token
    except _ERRORS:
        return False


def in_sessions_of(pid: int) -> Callable[[str], bool]:
    """Whether a path lies in a Ray session folder of driver ``pid`` (``.../session_<time>_<pid>/...``)."""
    pattern = re.compile(rf"/session_[^/]*_{pid}/")
    return lambda path: pattern.search(path) is not None


def in_folder(folder: str) -> Callable[[str], bool]:
    """Whether a path lies in ``folder``."""
    prefix = folder.rstrip(os.sep) + os.sep
    return lambda path: path.startswith(prefix)


def leftovers(token: str, inside: Callable[[str], bool]) -> list[psutil.Process]:
    """The running Ray processes (not this one) marked with ``token`` or holding a file ``inside`` accepts."""
    return [
        process
        for process in psutil.process_iter()
        if process.pid != os.getpid()
        and _looks_like_ray(process)
        and (_marked(process, token) or _holds_file(process, inside))
    ]


def kill_processes(processes: list[psutil.Process]) -> int:
    """SIGKILL ``processes`` (they hold nothing a run needs) and wait for them; how many were killed."""
    killed = []
    for process in processes:
        with contextlib.suppress(*_ERRORS):
            process.kill()  # psutil checks the start time first: a reused pid is never hit
            killed.append(process)
    psutil.wait_procs(killed, timeout=KILL_WAIT_S)
    return len(killed)


def end_leftovers(token: str, inside: Callable[[str], bool]) -> int:
    """Kill :func:`leftovers`, looking again until none is left; how many were killed."""
    total = 0
    for _ in range(PASSES):
        left = leftovers(token, inside)
        if not left:
            break
        total += kill_processes(left)
    return total


@dataclass
class OwnerWatch:
    """The starting process's side of a watchdog: the token Ray's processes carry, the pipe's write end."""

    token: str
    write_fd: int
    watchdog: subprocess.Popen[bytes]

    def _tell(self, line: str) -> None:
        if self.write_fd >= 0:
            with contextlib.suppress(OSError):
                os.write(self.write_fd, f"{line}\n".encode())

    def tell_session(self, folder: str) -> None:
        """Name the instance's session folder (once ``ray.init`` returned)."""
        self._tell(f"session {folder}")

    def quiet(self) -> None:
        """Ask the watchdog to end what is left without its line (this process ended Ray's start itself)."""
        self._tell("quiet")

    def end_now(self) -> int:
        """Kill what this start has started so far (a start this process abandons); how many."""
        return end_leftovers(self.token, in_sessions_of(os.getpid()))

    def unmark(self) -> None:
        """Processes this process starts from now on do not carry the mark (idempotent)."""
        if os.environ.get(MARK_ENV) == self.token:
            del os.environ[MARK_ENV]

    def close(self) -> None:
        """Release the watchdog and wait for it (it ends what is left of this start and exits); idempotent."""
        if self.write_fd >= 0:
            self._tell("done")  # a pipe closed without it: this process died
            with contextlib.suppress(OSError):
                os.close(self.write_fd)
            self.write_fd = -1
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.watchdog.wait(timeout=PASSES * KILL_WAIT_S)
        self.unmark()


def watch_owner() -> OwnerWatch:
    """Start a watchdog for the Ray instance this process is about to start; mark its processes.

    Call before ``ray.init``: the mark (:data:`MARK_ENV`) is set in this process's environment, which
    Ray's processes inherit.
    """
    token = f"{os.getpid()}-{secrets.token_hex(8)}"
    environment = {key: value for key, value in os.environ.items() if key != MARK_ENV}
    read_fd, write_fd = os.pipe()  # neither end is inherited by the processes Ray starts (PEP 446)
    try:
        watchdog = subprocess.Popen(
            [sys.executable, "-I", str(Path(__file__).resolve()), token, str(os.getpid())],
            stdin=read_fd,
            stdout=subprocess.DEVNULL,
            env=environment,
            start_new_session=True,
        )
    finally:
        os.close(read_fd)
    os.environ[MARK_ENV] = token
    return OwnerWatch(token, write_fd, watchdog)


def _watch(token: str, owner: int) -> int:
    """The watchdog: wait until the owner closes the pipe or dies, then end what is left of its Ray."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    told = b""
    with contextlib.suppress(OSError):
        while chunk := os.read(0, 4096):  # b"" once the owner closed the pipe or is gone
            told += chunk
    lines = told.decode(errors="replace").splitlines()
    folders = [line.split(" ", 1)[1] for line in lines if line.startswith("session ")]
    died = "done" not in lines  # else the owner closed the pipe after stopping Ray itself
    if folders:
        inside = in_folder(folders[-1])
    elif died:
        inside = in_sessions_of(owner)
    else:  # the owner lives on and may start another instance, with the same id in its folder's name
        inside = lambda path: False  # noqa: E731
    ended = end_leftovers(token, inside)
    if ended and died and "quiet" not in lines:
        with contextlib.suppress(OSError):
            print(
                f"dpfl: ended {ended} Ray process(es) left running by dpfl process {owner}, which ended "
                "without stopping them",
                file=sys.stderr,
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(_watch(sys.argv[1], int(sys.argv[2])))
