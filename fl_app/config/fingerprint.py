"""Digests of a run's configuration: what a run computes from the data, and what it was composed from.

:func:`experiment_fingerprint` digests the experiment: the typed values validation read
(:meth:`fl_app.config.settings.RunSettings.experiment`) without :data:`NOT_THE_EXPERIMENT`. A derived
noise seed and a checkpoint are tied to it, so the spelling of a number (``privacy.epsilon=8`` or
``8.0``), a ``label``, a tracker or an output folder never changes a seeded run, and every setting that
does change what a run computes changes the digest. :func:`config_fingerprint` digests the resolved
configuration as composed (a sweep's completed job is matched to its command by it).
"""

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

#: Settings that are not the experiment (left out of :func:`experiment_fingerprint`): those of
#: :data:`FINGERPRINT_IGNORES`, the run's name in reports (``label``), what it logs and where
#: (``tracking``, ``tracker``), whether missing data files may be downloaded (``dataset.download``) and
#: the text vocabulary validation derives (a DP release from OS entropy differs from run to run).
NOT_THE_EXPERIMENT: tuple[str, ...] = (
    *FINGERPRINT_IGNORES,
    "label",
    "tracking",
    "tracker",
    "data.dataset.download",
    "data.dataset.vocabulary_choice",  # derived by validation from the others (fl_app.config.data_choices)
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
    return _digest(container, (*FINGERPRINT_IGNORES, *ignore))


def experiment_fingerprint(experiment: Mapping[str, Any], *, ignore: Sequence[str] = ()) -> str:
    """A hex digest of ``experiment`` (typed values) without :data:`NOT_THE_EXPERIMENT` (and ``ignore``)."""
    return _digest(copy.deepcopy(dict(experiment)), (*NOT_THE_EXPERIMENT, *ignore))


def canonical_number(value: Any) -> Any:
    """``value`` as a float when it is a number (``2`` and ``2.0`` alike), else unchanged (booleans too)."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return value


def _digest(container: dict[str, Any], ignore: Sequence[str]) -> str:
    for dotted in ignore:
        node: Any = container
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    text = json.dumps(container, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()
