"""Which network to build: :class:`ModelSpec`, the description that travels to clients.

Kept apart from :mod:`fl_app.learning.models` (the networks, which need torch) so that a process that only
reads a spec, such as a device answering the server's roster query, does not import torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    """Which architecture to build, for which input and number of classes."""

    name: str
    input_shape: tuple[int, ...]
    num_classes: int

    def to_json(self) -> str:
        """Serialise for a ConfigRecord."""
        return json.dumps(
            {"name": self.name, "input_shape": list(self.input_shape), "num_classes": self.num_classes}
        )

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        """Inverse of :meth:`to_json`."""
        raw = json.loads(text)
        return cls(raw["name"], tuple(raw["input_shape"]), int(raw["num_classes"]))

    def build(self) -> nn.Module:
        """Instantiate the (randomly initialised) network (:func:`fl_app.learning.models.build_model`)."""
        from fl_app.learning.models import build_model

        return build_model(self.name, self.input_shape, self.num_classes)
