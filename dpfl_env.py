"""Flower and Ray environment switches for every process of a dpfl environment.

This module is deliberately tiny and imports nothing heavy: the installed
``dpfl_flower_env.pth`` imports it at the start of every Python interpreter of
the environment (so the ``flwr`` CLI and the background SuperLink it starts see
the switches), and ``fl_app`` imports it again for processes started elsewhere.

``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION`` stops each ``flwr run`` from
``uv sync``-ing the project (which would pull a 5 GB CUDA build of torch) and
``FLWR_TELEMETRY_ENABLED`` turns telemetry off. Values are set with
``setdefault``: a value the user exported wins.
"""

from __future__ import annotations

import os

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
    "RAY_max_direct_call_object_size": str(64 << 20),
    "RAY_task_rpc_inlined_bytes_limit": str(256 << 20),
}


def apply_flower_environment() -> None:
    """Set Flower's and Ray's environment switches unless the user set them."""
    for key, value in FLOWER_ENVIRONMENT.items():
        os.environ.setdefault(key, value)
