"""What a run computes from the data, as one digest: checkpoints and noise seeds are tied to it."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from omegaconf import DictConfig, OmegaConf

#: Keys that do not change what a run computes from the data (resources, output, evaluation
#: schedule, the randomness switches themselves): left out of :func:`config_fingerprint`.
FINGERPRINT_IGNORES: tuple[str, ...] = (
    "output_dir",
    "resume",
    "simulation",
    "privacy.noise_seed",
    "privacy.secure_rng",
    "privacy.diagnostics",
    "evaluation.every",
    "evaluation.test_subset",
)


def config_fingerprint(cfg: DictConfig | Mapping[str, Any], *, ignore: Sequence[str] = ()) -> str:
    """A hex digest of the resolved configuration without :data:`FINGERPRINT_IGNORES` (and ``ignore``).

    ``cfg``: a composed configuration, or its plain data (``RunSettings.config``).
    """
    if isinstance(cfg, DictConfig):
        container = OmegaConf.to_container(cfg, resolve=True)
    else:
        container = copy.deepcopy(dict(cfg))
    assert isinstance(container, dict)
    for dotted in (*FINGERPRINT_IGNORES, *ignore):
        node: Any = container
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    text = json.dumps(container, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()
