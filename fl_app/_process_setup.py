"""Process-wide set-up every dpfl process needs before Flower or torchvision load.

Two things must happen in *every* process (the driver, the Flower SuperLink,
the simulation process and each Ray worker) before anything else imports
``torchvision`` or starts Flower:

1. Flower's environment switches (see :mod:`dpfl_env`).
2. The torchvision operator shim. The registry's ``torchvision==0.28.0`` is a
   CUDA build whose ``import torchvision`` fails with
   ``operator torchvision::nms does not exist`` on this CPU-only torch. Defining
   the ``nms`` and ``qnms`` schemas in the ``torchvision`` operator namespace
   first lets transforms, models and file-based datasets import; ops such as
   ``torchvision.ops.nms`` and image decoding still do not work.

The package ``fl_app`` imports this module first.
"""

from __future__ import annotations

from dpfl_env import apply_flower_environment

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


apply_flower_environment()
install_torchvision_op_shim()
