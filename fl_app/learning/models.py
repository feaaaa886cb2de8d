"""The models module: every network the project trains, chosen by name.

``model=auto`` picks the CNN for 28x28 images and the MLP otherwise. A model is
described by a :class:`ModelSpec` (name, input shape, classes), which travels to
clients in the train message so that they build the same architecture.

A user's own network, without editing dpfl: ``model=<module>:<Class>`` names an
``nn.Module`` subclass whose constructor takes ``(input_shape, num_classes)``
(``input_shape`` is ``(channels, height, width)``) and whose forward pass returns
class logits of shape ``(batch, num_classes)``; every process that builds the
model (the server, each simulated client, a device) imports the module, so it must
be importable there (the working directory or ``PYTHONPATH``). A factory function
is registered under a name instead, with ``@register_model("name")`` in a module
that ``DPFL_PLUGINS`` names (``fl_app/config/registry.py``), and chosen with ``model=name``.
Validation runs one example through the network and checks it gives one score per
class (:func:`check_model_fits`); a private run refuses a network whose state holds buffers
(:func:`private_state_refusal`: BatchNorm's running statistics come from private data).
"""

from __future__ import annotations

import copy
import importlib
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from fl_app.learning.probe import forward_probe, probe_failure
from fl_app.learning.text_models import TEXT_MODELS, auto_text_model

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


def resolve_model_name(name: str, input_shape: tuple[int, ...], num_classes: int | None = None) -> str:
    """Turn ``auto`` into a concrete model name for ``input_shape``.

    Token sequences (``input_shape`` is ``(length,)``, ``num_classes`` the vocabulary's size): the char
    LSTM for a vocabulary of characters, the word LSTM otherwise
    (:func:`fl_app.learning.text_models.auto_text_model`).
    """
    if name != "auto":
        return name
    if len(input_shape) == 1:
        return auto_text_model(num_classes if num_classes is not None else CHARACTERS_UNKNOWN)
    return "cnn" if is_28x28_image(input_shape) else "mlp"


#: The vocabulary assumed when ``resolve_model_name`` is not told one (a word vocabulary).
CHARACTERS_UNKNOWN = 10**6


def is_28x28_image(input_shape: tuple[int, ...]) -> bool:
    """Whether ``input_shape`` is a 28x28 image (MNIST-like): the CNNs' input under ``model=auto``."""
    return tuple(input_shape[-2:]) == (28, 28)


def model_factory(name: str) -> ModelFactory:
    """The factory of the registered model ``name``, or the ``nn.Module`` class ``module:Class`` names.

    Raises
    ------
    ValueError
        ``model=<name>: ...`` in one line: unknown, not importable, or not an ``nn.Module`` class.

    """
    if name in MODELS:
        return MODELS[name]
    if ":" not in name:
        raise ValueError(
            f"model={name!r}: unknown; allowed: auto, {', '.join(sorted(MODELS))}, <module>:<Class>"
        )
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(
            f"model={name!r}: cannot import {module_name} ({error}); it must be importable from the "
            "working directory or PYTHONPATH"
        ) from None
    found = getattr(module, attribute, None)
    if not (isinstance(found, type) and issubclass(found, nn.Module)):
        raise ValueError(
            f"model={name!r}: {module_name} has no nn.Module class {attribute!r} (a factory function is "
            "registered with @register_model instead)"
        )
    return found


def build_model(name: str, input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    """Build the registered model ``name`` (or the user's ``module:Class``)."""
    return model_factory(name)(tuple(input_shape), num_classes)


def check_model_fits(name: str, example: np.ndarray, num_classes: int) -> nn.Module:
    """Build ``name`` for ``example``'s shape and check one forward pass gives ``num_classes`` scores.

    Parameters
    ----------
    name : str
        A registered model or ``module:Class``.
    example : np.ndarray
        One example of the data, shape ``(1, channels, height, width)`` (``uint8`` or float).
    num_classes : int
        Number of classes of the data.

    Returns
    -------
    nn.Module
        The network built (in evaluation mode).

    Raises
    ------
    ValueError
        One line naming the model, the input shape and what went wrong.

    """
    shape = tuple(int(d) for d in example.shape[1:])
    batch = torch.from_numpy(np.ascontiguousarray(example, dtype=np.float32))
    if example.dtype == np.uint8:
        batch /= 255.0  # as training sees it
    try:
        network = build_model(name, shape, num_classes)
    except (RuntimeError, ValueError, TypeError, IndexError) as error:
        raise ValueError(
            probe_failure(name, f"examples of shape {shape} with {num_classes} classes", error)
        ) from None
    output = forward_probe(network, batch, name, f"examples of shape {shape} with {num_classes} classes")
    if not isinstance(output, torch.Tensor) or tuple(output.shape) != (1, num_classes):
        got = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
        raise ValueError(
            f"the network {name!r} gives {got} for one example of shape {shape}; it must give class "
            f"logits of shape (1, {num_classes}) (the data has {num_classes} classes)"
        )
    return network


def state_buffers(network: nn.Module) -> list[str]:
    """The keys of ``network``'s state that are buffers, not parameters (what it sends besides them).

    Persistent buffers only: ``register_buffer(..., persistent=False)`` keeps one out of the state
    (every process builds it, none sends it).
    """
    names = {name for name, _ in network.named_buffers(remove_duplicate=False)}
    return [key for key in network.state_dict() if key in names]


def running_statistics(network: nn.Module, examples: torch.Tensor) -> list[str]:
    """The buffers that training updates from the data it sees, by state key (non-persistent ones too).

    A normalisation layer that tracks running statistics (``BatchNorm``, ``InstanceNorm`` with
    ``track_running_stats=True``: its ``running_mean``, ``running_var``, ``num_batches_tracked``), and
    any buffer that a training-mode forward pass of a copy of ``network`` on ``examples`` changes.
    """
    found = {
        f"{prefix}.{name}" if prefix else name
        for prefix, module in network.named_modules()
        if getattr(module, "track_running_stats", False)
        for name, _ in module.named_buffers(recurse=False)
    }
    trial = copy.deepcopy(network)
    before = {name: buffer.clone() for name, buffer in trial.named_buffers(remove_duplicate=False)}
    trial.train()
    try:
        with torch.no_grad():
            trial(examples)
    except Exception:  # e.g. a layer that needs more examples: the layers named above are still found
        pass
    after = dict(trial.named_buffers(remove_duplicate=False))
    found |= {name for name, value in before.items() if not torch.equal(value, after[name])}
    return [name for name, _ in network.named_buffers(remove_duplicate=False) if name in found]


def private_state_refusal(network: nn.Module, examples: torch.Tensor, strategy: str) -> str | None:
    """Why a private ``strategy`` cannot train ``network`` (None: it can): buffers beside the parameters.

    A private strategy clips and noises trained parameters only. Running statistics (BatchNorm's) are
    computed from the clients' private data without that mechanism, and a constant buffer that the
    model's state carries would be released beside the parameters all the same.
    """
    statistics = running_statistics(network, examples)
    if statistics:
        return (
            f"buffers {', '.join(statistics)} are running statistics computed from private data, which "
            f"are not clipped or noised (strategy={strategy} is private and releases only clipped, noised "
            "parameters); use GroupNorm or LayerNorm, or BatchNorm with track_running_stats=False"
        )
    constant = state_buffers(network)
    if constant:
        return (
            f"buffers {', '.join(constant)} are part of the model's state but not parameters, and are not "
            f"clipped or noised (strategy={strategy} is private and releases only clipped, noised "
            "parameters); register a constant buffer with persistent=False (every process builds it)"
        )
    return None


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


class LogisticRegression(nn.Module):
    """Multinomial logistic regression: one linear layer from the flattened input to the class logits.

    The network whose local training costs least: what a benchmark of the engine's own work per
    client runs (``benchmarks/host_per_client.py``).
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        features = 1
        for dim in input_shape:
            features *= dim
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(features, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits."""
        return self.net(x)


register_model("cnn")(SmallCNN)
register_model("mlp")(MLP)
register_model("logreg")(LogisticRegression)
for _text_name, _text_network in TEXT_MODELS.items():
    register_model(_text_name)(_text_network)


class PrivateKTCNN(nn.Module):
    """PrivateKT's network (Qi et al. 2023; taoqi98/PrivateKT ``Code/model.py``), about 1.68 M parameters.

    Conv 32 (5x5) -> max-pool 2 -> dropout 0.2 -> conv 128 (5x5) -> max-pool 2 -> dropout 0.2 -> three
    dense layers of 512 with ReLU, each followed by dropout 0.2 -> class logits (the softmax is in the
    loss). As in the authors' Keras model the convolutions have no activation and no padding, and every
    layer starts from Glorot-uniform weights and zero biases (Keras' defaults).
    """

    DROPOUT = 0.2

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        channels, height, width = input_shape
        self.features = nn.Sequential(
            nn.Conv2d(channels, 32, kernel_size=5),
            nn.MaxPool2d(2),
            nn.Dropout(self.DROPOUT),
            nn.Conv2d(32, 128, kernel_size=5),
            nn.MaxPool2d(2),
            nn.Dropout(self.DROPOUT),
        )
        side_h, side_w = ((height - 4) // 2 - 4) // 2, ((width - 4) // 2 - 4) // 2
        if side_h < 1 or side_w < 1:
            raise ValueError(f"privatekt_cnn needs images of at least 16x16, got {height}x{width}")
        layers: list[nn.Module] = [nn.Flatten()]
        features = 128 * side_h * side_w
        for _ in range(3):
            layers += [nn.Linear(features, 512), nn.ReLU(), nn.Dropout(self.DROPOUT)]
            features = 512
        layers.append(nn.Linear(features, num_classes))
        self.classifier = nn.Sequential(*layers)
        for module in self.modules():
            if isinstance(module, nn.Conv2d | nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits."""
        return self.classifier(self.features(x))


register_model("privatekt_cnn")(PrivateKTCNN)


# --------------------------------------------------------------------------------------
# DPFL-BNN (Liu, Zhang, Song, Letaief 2023, Section II-D and IV-A1): binary CNN
# --------------------------------------------------------------------------------------


class SignSTE(torch.autograd.Function):
    """``Sign(w)`` (Eq. 6, ties to +1) with the straight-through gradient of Hubara et al. 2016.

    Backward passes the incoming gradient where ``|w| <= 1`` and zeroes it
    elsewhere (the hard-tanh estimator); with the latent weights clipped to
    [-1, 1] (Section II-D) it is the plain identity.
    """

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, weight: torch.Tensor) -> torch.Tensor:
        """Return +1 where ``weight >= 0`` and -1 elsewhere."""
        ctx.save_for_backward(weight)
        return torch.where(weight >= 0, 1.0, -1.0).to(weight.dtype)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        """Straight-through: ``grad * 1{|w| <= 1}``."""
        (weight,) = ctx.saved_tensors
        return grad * (weight.abs() <= 1).to(grad.dtype)


def binarize(weight: torch.Tensor) -> torch.Tensor:
    """``Sign`` of the latent weights with the straight-through gradient (:class:`SignSTE`)."""
    return SignSTE.apply(weight)


class BinaryConv2d(nn.Module):
    """Convolution with binary weights ``Sign(W)`` (no bias), output scaled by ``gain / sqrt(fan_in)``.

    ``weight`` holds the latent full-precision weights (initialised uniformly in
    [-1, 1]); the forward pass uses only their signs. The scale is a fixed
    constant of the architecture (not learned, never uploaded): it keeps the
    pre-activations of a +-1 filter in tanh's working range without batch norm,
    whose parameters would have to leave the client in full precision.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int = 3, gain: float = 2.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, kernel_size, kernel_size))
        nn.init.uniform_(self.weight, -1.0, 1.0)
        self.padding = kernel_size // 2
        self.scale = gain * float(in_channels * kernel_size * kernel_size) ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Convolve with the binarized weights ('same' padding)."""
        return nn.functional.conv2d(x, binarize(self.weight), padding=self.padding) * self.scale


class BinaryLinear(nn.Module):
    """Fully connected layer with binary weights ``Sign(W)`` (no bias), scaled by ``gain / sqrt(fan_in)``."""

    def __init__(self, in_features: int, out_features: int, gain: float = 2.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.uniform_(self.weight, -1.0, 1.0)
        self.scale = gain * float(in_features) ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Multiply by the binarized weights."""
        return nn.functional.linear(x, binarize(self.weight)) * self.scale


class BinaryCNN(nn.Module):
    """The DPFL-BNN CNN: every parameter is a binary weight (Section IV-A1).

    Two 3x3 convolutions with 16 filters, each followed by tanh and 2x2 max
    pooling; a fully connected layer from the flattened features (16 x 7 x 7 =
    784 for 28x28 images, the document's "784 units") to 100 tanh units; a
    fully connected output layer (softmax in the loss). No biases and no batch
    norm, so nothing but +-1 weights describes the model. Any input of at least
    4x4 pixels works (8x8 digits: 64 flattened features).
    """

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        channels, height, width = input_shape
        if height < 4 or width < 4:
            raise ValueError(f"bnn_cnn needs inputs of at least 4x4 pixels, got {input_shape}")
        self.conv1 = BinaryConv2d(channels, 16, 3)
        self.conv2 = BinaryConv2d(16, 16, 3)
        self.fc1 = BinaryLinear(16 * (height // 4) * (width // 4), 100)
        self.fc2 = BinaryLinear(100, num_classes, gain=4.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return class logits."""
        x = nn.functional.max_pool2d(torch.tanh(self.conv1(x)), 2)
        x = nn.functional.max_pool2d(torch.tanh(self.conv2(x)), 2)
        x = torch.tanh(self.fc1(torch.flatten(x, 1)))
        return self.fc2(x)


register_model("bnn_cnn")(BinaryCNN)
