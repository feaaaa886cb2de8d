"""Hydra override strings: which key one sets, and whether it steers Hydra rather than the run."""

from __future__ import annotations


def override_key(item: str) -> str:
    """The key an override sets: ``privacy.epsilon`` of ``+privacy.epsilon=4`` (also ``++``, ``~``)."""
    return item.lstrip("+~").split("=", 1)[0]


def is_hydra_override(item: str) -> bool:
    """Whether an override steers Hydra (``hydra.*``, ``hydra/launcher=...``), not the run."""
    key = override_key(item)
    return key == "hydra" or key.startswith("hydra.") or key.startswith("hydra/")
