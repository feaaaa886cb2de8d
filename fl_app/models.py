"""The models module: every network the project trains, chosen by name.

``model=auto`` picks the CNN for 28x28 images and the MLP otherwise. A model is
described by a :class:`ModelSpec` (name, input shape, classes), which travels to
clients in the train message so that they build the same architecture.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

ModelFactory = Callable[[tuple[int, ...], int], nn.Module]
MODELS: dict[str, ModelFactory] = {}


def register_model(name: str) -> Callable[[ModelFactory], ModelFactory]:
    """Register a model factory ``(input_shape, num_classes) -> nn.Module`` under ``name``."""

    def decorator(factory: ModelFactory) -> ModelFactory:
        if name in MODELS:
            raise ValueError(f"model {name!r} is already registered")
        MODELS[name] = factory
        return factory

    return decorator


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
        """Instantiate the (randomly initialised) network."""
        return build_model(self.name, self.input_shape, self.num_classes)


def resolve_model_name(name: str, input_shape: tuple[int, ...]) -> str:
    """Turn ``auto`` into a concrete model name for ``input_shape``."""
    if name != "auto":
        return name
    return "cnn" if tuple(input_shape[-2:]) == (28, 28) else "mlp"


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build the registered model ``name``."""
    if name not in MODELS:
        raise ValueError(f"model={name!r} is unknown; allowed: auto, {', '.join(sorted(MODELS))}")
    return MODELS[name](tuple(input_shape), num_classes)


class SmallCNN(nn.Module):
    """Two 5x5 conv layers (16, 32 filters) with 2x2 max pooling, then 64 hidden units.

    About 110k parameters for 28x28 grey images: small enough for CPU
    simulations of hundreds of clients and for DP noise to stay manageable.
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        channels, height, width = input_shape
        self.features = nn.Sequential(
            nn.Conv2d(channels, 16, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        flat = 32 * (height // 4) * (width // 4)
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(flat, 64), nn.ReLU(), nn.Linear(64, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits."""
        return self.classifier(self.features(x))


class MLP(nn.Module):
    """A two-hidden-layer perceptron (128, 64 units) for small inputs such as 8x8 digits."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        features = 1
        for dim in input_shape:
            features *= dim
        self.net = nn.Sequential(
            nn.Flatten(),
            nn.Linear(features, 128),
            nn.ReLU(),
            nn.Linear(128, 64),
            nn.ReLU(),
            nn.Linear(64, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits."""
        return self.net(x)


register_model("cnn")(SmallCNN)
register_model("mlp")(MLP)
