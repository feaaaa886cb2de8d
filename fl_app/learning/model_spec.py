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
    """Which architecture to build, for which input and number of classes.

    ``uncounted``: None for a classifier; for a next-token network (the text data sets: ``num_classes``
    is the vocabulary's size, ``input_shape`` the sequence length), the target ids its accuracy leaves
    out (:class:`fl_app.learning.sequence.NextToken`).
    """

    name: str
    input_shape: tuple[int, ...]
    num_classes: int
    uncounted: tuple[int, ...] | None = None

    def to_json(self) -> str:
        """Serialise for a ConfigRecord (a classifier's text is what it was before next-token networks)."""
        raw: dict[str, object] = {
            "name": self.name,
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
        }
        if self.uncounted is not None:
            raw["next_token_uncounted"] = list(self.uncounted)
        return json.dumps(raw)

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        """Inverse of :meth:`to_json`."""
        raw = json.loads(text)
        uncounted = raw.get("next_token_uncounted")
        return cls(
            raw["name"],
            tuple(raw["input_shape"]),
            int(raw["num_classes"]),
            None if uncounted is None else tuple(int(t) for t in uncounted),
        )

    def build(self) -> nn.Module:
        """Instantiate the (randomly initialised) network (:func:`fl_app.learning.models.build_model`).

        A next-token network is given its task (:func:`fl_app.learning.sequence.mark_next_token`).
        """
        from fl_app.learning.models import build_model

        network = build_model(self.name, self.input_shape, self.num_classes)
        if self.uncounted is not None:
            from fl_app.learning.sequence import mark_next_token

            mark_next_token(network, self.uncounted)
        return network

    def parameter_count(self) -> int:
        """The network's number of parameters, built on torch's meta device (no memory, no initialisation).

        A network that cannot be built there is built as :meth:`build` builds it.
        """
        import torch

        from fl_app.learning.models import build_model

        try:
            with torch.device("meta"):
                network = build_model(self.name, self.input_shape, self.num_classes)
        except (RuntimeError, NotImplementedError, TypeError, ValueError):
            network = build_model(self.name, self.input_shape, self.num_classes)
        return sum(parameter.numel() for parameter in network.parameters())
