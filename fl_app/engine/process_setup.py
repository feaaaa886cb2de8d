"""Process-wide set-up every dpfl process needs before Flower or torchvision load.

What must happen in *every* process (the driver, the Flower SuperLink,
the simulation process and each Ray worker) before anything else imports
``torchvision`` or starts Flower:

1. Flower's environment switches (see :mod:`dpfl_env`).
2. In a parallel sweep's worker process, SIGINT and SIGTERM left to the command
   (:func:`fl_app.run.lifecycle.leave_stops_to_the_sweep_command`).
3. glibc's allocator told to keep freed memory for reuse (:func:`keep_freed_memory`).
4. The torchvision operator shim. The registry's ``torchvision==0.28.0`` is a
   CUDA build whose ``import torchvision`` fails with
   ``operator torchvision::nms does not exist`` on this CPU-only torch. Defining
   the ``nms`` and ``qnms`` schemas in the ``torchvision`` operator namespace
   first lets transforms, models and file-based datasets import; ops such as
   ``torchvision.ops.nms`` and image decoding still do not work.

The package ``fl_app`` imports this module first. The shim is installed by a meta-path hook
right before ``torchvision`` is first imported (:class:`ShimBeforeTorchvision`), not at once: defining
it imports torch (1.2 s of CPU), which a process that never touches torch or torchvision (``flwr
run`` checking the app's references, a deployment's roster answer) should not pay.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import os
import sys
from typing import Any

from dpfl_env import set_up_process
from fl_app.run.lifecycle import leave_stops_to_the_sweep_command

_TORCHVISION_OPS: tuple[str, ...] = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)

# Keep the Library object alive: its registrations live as long as it does.
_torchvision_library: object | None = None


def install_torchvision_op_shim() -> None:
    """Define ``torchvision::nms``/``qnms`` schemas so ``import torchvision`` works.

    Idempotent, and a no-op when a torchvision build already defines them.
    """
    global _torchvision_library
    if _torchvision_library is not None:
        return
    import torch

    try:
        torch.ops.torchvision.nms  # noqa: B018 - probe whether the op exists
    except (AttributeError, RuntimeError):
        pass
    else:
        _torchvision_library = True
        return
    library = torch.library.Library("torchvision", "DEF")
    for schema in _TORCHVISION_OPS:
        library.define(schema)
    _torchvision_library = library


class ShimBeforeTorchvision(importlib.abc.MetaPathFinder):
    """Installs the shim when ``torchvision`` is about to be imported, then leaves ``sys.meta_path``."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        """Install the shim before ``torchvision`` loads; let the usual finders find every module."""
        if fullname == "torchvision":
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            install_torchvision_op_shim()
        return None


def install_shim_hook() -> None:
    """Arrange for the shim to be installed before ``torchvision`` is imported (idempotent)."""
    if "torchvision" in sys.modules:
        install_torchvision_op_shim()
    elif not any(isinstance(finder, ShimBeforeTorchvision) for finder in sys.meta_path):
        sys.meta_path.insert(0, ShimBeforeTorchvision())


#: glibc's ``mallopt`` parameters (``malloc.h``).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: Blocks up to this size come from the heap and are reused (glibc's largest on 64-bit systems).
MMAP_THRESHOLD = 32 << 20
#: Free memory at the top of the heap that stays mapped.
TRIM_THRESHOLD = 1 << 30
#: ``DPFL_KEEP_FREED_MEMORY=0`` leaves glibc's allocator as it is.
KEEP_FREED_MEMORY_ENV = "DPFL_KEEP_FREED_MEMORY"


def keep_freed_memory() -> bool:
    """Ask glibc's ``malloc`` to keep freed blocks of up to 32 MiB for reuse; return whether it did.

    By default glibc maps every large block fresh and unmaps it when it is freed (its threshold
    adapts, but freed heap memory is returned, and torch's and numpy's blocks of a few MiB are mapped
    each time), so a round that allocates the same buffers as the last one (a cohort's examples, the
    vectorised trainer's stacks, the sums) pays every page fault again: a 1000-client round of
    logistic regression took 0.46M minor page faults and 85-100 ms over 30 rounds, and 0.16M and
    65-72 ms with these settings (``benchmarks/host_per_client.py``, docs/benchmarks/bulk.md).
    The cost: memory freed inside the process stays mapped to it (its peak).

    Not applied (False) outside Linux's glibc, with ``DPFL_KEEP_FREED_MEMORY=0``, or when the
    environment sets glibc's own ``MALLOC_MMAP_THRESHOLD_`` or ``MALLOC_TRIM_THRESHOLD_``.
    """
    own = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
    if os.environ.get(KEEP_FREED_MEMORY_ENV, "1") == "0" or any(key in os.environ for key in own):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # musl, or no glibc
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


set_up_process()
keep_freed_memory()
install_shim_hook()
leave_stops_to_the_sweep_command()
