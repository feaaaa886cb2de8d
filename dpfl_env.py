"""Flower, Ray and BLAS environment switches for every process of a dpfl environment.

This module is deliberately tiny and imports nothing heavy: the installed
``dpfl_flower_env.pth`` imports it at the start of every Python interpreter of
the environment (so the ``flwr`` CLI and the background SuperLink it starts see
the switches), and ``fl_app`` imports it again for processes started elsewhere.

``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION`` stops each ``flwr run`` from
``uv sync``-ing the project (which would pull a 5 GB CUDA build of torch) and
``FLWR_TELEMETRY_ENABLED`` turns telemetry off. Values are set with
``setdefault``: a value the user exported wins.

It also serialises Flower's installation of an app (FAB) into a Flower home
(:func:`serialise_fab_installs`). The one patch of Flower made outside
``fl_app/engine/`` (the seam of every other one), because it must be in place
before any dpfl code loads: Flower's own processes (``flwr-serverapp``,
``flwr-clientapp``) install the run's FAB first. Flower 1.41/1.42's
``flwr.cli.install.validate_and_install`` creates the app's folder and then
copies the files into it, while a second process installing the same FAB sees
the folder, takes it as installed and fails to find ``pyproject.toml`` in it
(``FileNotFoundError: Cannot find pyproject.toml in .../apps/dpfl.dpfl...``,
the run ends as failed). That happens whenever two runs of one app start
together on a SuperLink, or two of their messages reach one SuperNode together
(seen in tests/test_deploy.py on a loaded machine). The patch holds an exclusive
file lock (``fcntl.flock`` on ``<apps folder>/.install.lock``) around Flower's
unchanged function, so the second process waits for the first to finish and
then finds a complete folder.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from typing import Any

FLOWER_ENVIRONMENT: dict[str, str] = {
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "0",
    # Pass task arguments and results of up to 64 MiB inline (through the task's
    # RPC) instead of through Ray's shared-memory object store: a model message
    # (0.4 MB for the MLP, 7 MB for PrivateKT's CNN) then costs one copy instead
    # of an object-store round trip (measured: 100 echo messages of 0.44 MB on
    # two actors, 0.8 s through the store, 0.23 s inline; benchmarks/overhead.py).
    # No idle Python workers started ahead of the first task: an actor starts its own worker
    # anyway (measured: same start-up), and an idle prestarted worker killed when the run ends
    # can abort in Ray's C++ teardown ("Mutex corrupt ... SIGABRT ... Fatal Python error:
    # Aborted", found in 2 of ~1000 session logs here, printed to the run's console).
    "RAY_prestart_worker_first_driver": "0",
    # No C++ failure-signal handler in Ray's processes: the driver's (installed by ``ray.init`` in the
    # thread that starts Ray) caught a SIGTERM to the command's group before dpfl's handler was back,
    # printed Ray's "*** SIGTERM received ..." lines and stack, and Ray's workers printed theirs on the
    # way down. dpfl stops on SIGINT/SIGTERM itself; a crash of Ray's C++ still ends its process.
    "RAY_DISABLE_FAILURE_SIGNAL_HANDLER": "1",
    "RAY_max_direct_call_object_size": str(64 << 20),
    "RAY_task_rpc_inlined_bytes_limit": str(256 << 20),
    # One OpenBLAS thread for numpy (torch keeps its own threads). The server's numpy work is vector
    # products of model size (clipping norms, canary projections): on a quiet machine a second BLAS
    # thread saves 0.006 ms per norm of 100,000 floats; with the cores busy (client actors, a parallel
    # sweep, a test suite) its threads wait for cores and the norm is 12x slower, a canary estimate
    # 5x (benchmarks/blas_threads.py, docs/benchmarks/blas_threads.md).
    "OPENBLAS_NUM_THREADS": "1",
}


def apply_flower_environment() -> None:
    """Set Flower's and Ray's environment switches unless the user set them."""
    for key, value in FLOWER_ENVIRONMENT.items():
        os.environ.setdefault(key, value)


#: The Flower module whose installs are serialised, and the function wrapped in it.
FAB_INSTALL_MODULE = "flwr.cli.install"
_LOCKED_MARK = "_dpfl_serialised"


def serialise_installs_of(module: Any) -> None:
    """Wrap ``module.validate_and_install`` (Flower's) in an exclusive lock on its apps folder.

    Idempotent. ``install_from_fab`` calls ``validate_and_install`` by its module global, so replacing
    the attribute covers every caller. Where ``fcntl`` is missing (Windows) nothing is changed.
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        return
    original = module.validate_and_install
    if getattr(original, _LOCKED_MARK, False):
        return

    def validate_and_install(
        project_dir: Any, fab_hash: str, fab_name: Any, install_dir: Any, skip_prompt: bool = False
    ) -> Any:
        base = install_dir.expanduser() if install_dir else module.get_flwr_home()
        apps = base / module.APP_DIR
        apps.mkdir(parents=True, exist_ok=True)
        with open(apps / ".install.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            return original(project_dir, fab_hash, fab_name, install_dir, skip_prompt)

    setattr(validate_and_install, _LOCKED_MARK, True)
    validate_and_install.__wrapped__ = original  # type: ignore[attr-defined]
    module.validate_and_install = validate_and_install


class SerialiseFabInstalls(importlib.abc.MetaPathFinder):
    """Wraps Flower's FAB install once ``flwr.cli.install`` has loaded, then leaves ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        """Let the usual finders find ``flwr.cli.install``; wrap it once it has executed."""
        if fullname != FAB_INSTALL_MODULE:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            serialise_installs_of(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def serialise_fab_installs() -> None:
    """Arrange for Flower's FAB installs to be serialised in this process (idempotent)."""
    if FAB_INSTALL_MODULE in sys.modules:
        serialise_installs_of(sys.modules[FAB_INSTALL_MODULE])
    elif not any(isinstance(finder, SerialiseFabInstalls) for finder in sys.meta_path):
        sys.meta_path.insert(0, SerialiseFabInstalls())


def set_up_process() -> None:
    """Everything a process of a dpfl environment needs first: the switches and the install lock."""
    apply_flower_environment()
    serialise_fab_installs()
