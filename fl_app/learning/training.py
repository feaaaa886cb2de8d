"""Local training, evaluation and conversions between models and Flower records."""

from __future__ import annotations

import ast
import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from torch import nn
from torch.nn import functional as F  # noqa: N812 - the conventional name

from fl_app import keys
from fl_app.learning.optim import SGD
from fl_app.learning.sequence import evaluate_next_token, next_token_task, token_tensor

#: Inference batch (evaluation, predictions). 256 rather than 1024: the same outputs (checked on the
#: MLP and both CNNs), and on a 2-core CPU the CNNs' inference is 1.2-1.6x faster (measured by
#: ``python -P benchmarks/privatekt_speed.py levers``; docs/benchmarks/privatekt.md).
EVAL_BATCH = 256


def to_tensor(x: np.ndarray) -> torch.Tensor:
    """Turn stored images into float input: ``uint8`` is scaled to [0, 1]."""
    if x.dtype == np.uint8:
        return torch.from_numpy(x).float().div_(255.0)
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


def model_input(model: nn.Module, x: np.ndarray) -> torch.Tensor:
    """``x`` as ``model`` takes it: token ids (``int64``) for a next-token network, else :func:`to_tensor`."""
    return token_tensor(x) if next_token_task(model) is not None else to_tensor(x)


def loss_function(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The training loss of ``model``: ``F.cross_entropy`` for a classifier, its task's for a next-token one.

    (:class:`fl_app.learning.sequence.NextToken`: the mean over the positions whose target is not the pad.)
    """
    task = next_token_task(model)
    return F.cross_entropy if task is None else task.loss


_NPY_MAGIC = b"\x93NUMPY"


@functools.lru_cache(maxsize=256)
def _npy_layout(header: bytes) -> tuple[np.dtype, tuple[int, ...], bool] | None:
    """dtype, shape and Fortran order of an ``.npy`` header (None: not a plain array)."""
    try:
        fields = ast.literal_eval(header.decode("latin1"))
        dtype = np.dtype(fields["descr"])
    except (ValueError, SyntaxError, KeyError, TypeError):
        return None
    if dtype.hasobject:
        return None
    return dtype, tuple(int(n) for n in fields["shape"]), bool(fields["fortran_order"])


def array_values(array: Array) -> np.ndarray:
    """The values of a Flower ``Array``, read-only, without copying its data.

    Equal to ``array.numpy()`` (which parses the ``.npy`` header in Python and
    copies the data on every call); headers are parsed once per layout, which
    matters when a server reads 100 replies of several arrays each round.
    """
    data = array.data
    if array.stype == "numpy.ndarray" and bytes(data[:6]) == _NPY_MAGIC and data[6] in (1, 2, 3):
        size_bytes = 2 if data[6] == 1 else 4
        length = int.from_bytes(bytes(data[8 : 8 + size_bytes]), "little")
        start = 8 + size_bytes
        layout = _npy_layout(bytes(data[start : start + length]))
        if layout is not None:
            dtype, shape, fortran = layout
            count = math.prod(shape)
            values = np.frombuffer(data, dtype=dtype, count=count, offset=start + length)
            return values.reshape(shape, order="F" if fortran else "C")
    return array.numpy()


_NPY_HEADERS: dict[tuple[str, tuple[int, ...]], bytes] = {}


def npy_parts(values: np.ndarray) -> tuple[bytes, memoryview]:
    """The data of ``Array(values)`` as its ``.npy`` header and the values' bytes, not joined.

    The header is built once per dtype and shape of a C-contiguous array; any other array's data
    comes whole as the first part (``np.save``'s own layout), with nothing after it.
    """
    if values.dtype.hasobject or not values.flags.c_contiguous:
        return bytes(Array(values).data), memoryview(b"")
    key = (values.dtype.str, tuple(values.shape))
    header = _NPY_HEADERS.get(key)
    if header is None:
        full = Array(values).data
        header = _NPY_HEADERS[key] = bytes(full[: len(full) - values.nbytes])
    return header, memoryview(values).cast("B")


def numpy_array(values: np.ndarray) -> Array:
    """``Array(values)``, byte for byte, with the ``.npy`` header built once per dtype and shape.

    Flower's ``Array(ndarray)`` runs ``np.save`` (which formats the header in
    Python) for every array of every reply; the header depends only on the
    dtype and shape of a C-contiguous array (:func:`npy_parts`).
    """
    if values.dtype.hasobject or not values.flags.c_contiguous:
        return Array(values)
    header, body = npy_parts(values)
    return Array(
        dtype=str(values.dtype),
        shape=tuple(values.shape),
        stype="numpy.ndarray",
        data=b"".join((header, body)),  # one copy (header + tobytes() made two)
    )


class _FixedState:
    """A CPU model's state tensors, their numpy views, modules and parameters (:func:`fix_state`)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.values = {k: v.detach().numpy() for k, v in model.state_dict().items()}
        self.names = list(self.values)
        self.targets = [self.values[name] for name in self.names]
        self.modules = list(model.modules())
        self.parameters = list(model.parameters())
        #: The last ArrayRecord loaded: its Array objects and their values (read in place).
        self.loaded: tuple[ArrayRecord, list[Array], list[np.ndarray]] | None = None

    def sources(self, arrays: ArrayRecord) -> list[np.ndarray] | None:
        """The values of ``arrays`` in state order (None: not this model's names), read once per record."""
        if len(arrays) != len(self.names):
            return None
        try:
            items = [arrays[name] for name in self.names]
        except KeyError:
            return None
        if (
            self.loaded is not None
            and self.loaded[0] is arrays
            and all(a is b for a, b in zip(self.loaded[1], items, strict=True))
        ):
            return self.loaded[2]
        values = [array_values(item) for item in items]
        self.loaded = (arrays, items, values)
        return values


#: Models whose state tensors were fixed (:func:`fix_state`), by id (checked against the model).
_FIXED: dict[int, _FixedState] = {}
_MAX_FIXED = 8


def fix_state(model: nn.Module) -> nn.Module:
    """Promise that ``model``'s tensors and modules stay the same objects, so that they are found once.

    :func:`load_arrays`, :func:`model_state` and :func:`train_local` then use them instead of calling
    ``state_dict()``, ``modules()`` and ``parameters()`` for every message. For a CPU model loaded in
    place message after message (a process's model: ``clients.base.process_model``), where those
    calls, the records' ``.npy`` headers and ``model.train()`` were about 0.1-0.2 ms of every
    simulated client's 2-3 ms. A model whose tensors are replaced later
    (``load_state_dict(assign=True)``, ``.to()`` another device, a new ``Parameter`` or submodule)
    must not be fixed. CUDA models are not fixed (returned as they are).
    """
    if model_device(model).type != "cpu":
        return model
    if len(_FIXED) >= _MAX_FIXED:
        _FIXED.clear()
    _FIXED[id(model)] = _FixedState(model)
    return model


def unfix_state(model: nn.Module) -> None:
    """Forget what :func:`fix_state` found for ``model`` (it may be changed, or dropped, from now on)."""
    fixed = _FIXED.get(id(model))
    if fixed is not None and fixed.model is model:
        del _FIXED[id(model)]


def _fixed(model: nn.Module) -> _FixedState | None:
    fixed = _FIXED.get(id(model))
    return fixed if fixed is not None and fixed.model is model else None


def model_parameters(model: nn.Module) -> list[torch.Tensor]:
    """``list(model.parameters())``, found once for a fixed model (:func:`fix_state`)."""
    fixed = _fixed(model)
    return list(fixed.parameters) if fixed is not None else list(model.parameters())


def _model_modules(model: nn.Module) -> list[nn.Module]:
    """``list(model.modules())``, found once for a fixed model (:func:`fix_state`)."""
    fixed = _fixed(model)
    return fixed.modules if fixed is not None else list(model.modules())


def model_state(model: nn.Module) -> dict[str, np.ndarray]:
    """The model's state as numpy arrays (keys = state_dict names; views of CPU tensors, not copies).

    What :func:`model_to_arrays` encodes: a client that needs the values, not a reply, reads them here
    instead of encoding 0.44 MB and decoding it again.
    """
    fixed = _fixed(model)
    if fixed is not None:
        return dict(fixed.values)
    return {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}


def model_to_arrays(model: nn.Module) -> ArrayRecord:
    """The model's state as an ArrayRecord (keys = state_dict names)."""
    return state_to_arrays(model_state(model))


def state_to_arrays(state: dict[str, np.ndarray]) -> ArrayRecord:
    """Numpy arrays by name as an ArrayRecord, as :func:`model_to_arrays` encodes a model's state.

    Filled item by item: ``ArrayRecord(dict)`` builds every ``Array`` a second time (flwr 1.41's
    ``from_array_dict``), a third of the encoding's time; the record is the same (equal object id).
    """
    record = ArrayRecord()
    for name, values in state.items():
        record[name] = numpy_array(values)
    return record


def load_arrays(model: nn.Module, arrays: ArrayRecord) -> None:
    """Load an ArrayRecord (as made by :func:`model_to_arrays`) into ``model``, in place.

    Same keys and shapes as ``model.state_dict()`` are required (strict). Each
    array is decoded once and copied straight into the model's tensor.
    """
    fixed = _fixed(model)
    sources = None if fixed is None else fixed.sources(arrays)
    if fixed is not None and sources is not None:
        _copy_values(fixed.names, fixed.targets, sources)
        return
    state = model.state_dict()
    if list(arrays.keys()) != list(state.keys()) and set(arrays.keys()) != set(state.keys()):
        missing = sorted(set(state) - set(arrays.keys()))
        unexpected = sorted(set(arrays.keys()) - set(state))
        raise RuntimeError(f"arrays do not match the model: missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for key, array in arrays.items():
            values = array_values(array)
            target = state[key]
            _check_shape(key, values, target)
            if target.device.type == "cpu":  # straight from the message's bytes: one copy, not two
                np.copyto(target.numpy(), values, casting="unsafe")
            else:
                target.copy_(torch.from_numpy(values if values.flags.writeable else values.copy()))


def _copy_values(names: Sequence[str], targets: Sequence[np.ndarray], sources: Sequence[np.ndarray]) -> None:
    """Copy each source into its CPU tensor's numpy view (``load_arrays``' shape check and cast)."""
    for name, target, values in zip(names, targets, sources, strict=True):
        _check_shape(name, values, target)
        np.copyto(target, values, casting="unsafe")


def _check_shape(name: str, values: np.ndarray, target: np.ndarray | torch.Tensor) -> None:
    """``RuntimeError`` unless the array ``name`` has the shape of the model's tensor it goes into."""
    if tuple(values.shape) != tuple(target.shape):
        raise RuntimeError(f"array {name!r} has shape {tuple(values.shape)}, the model {tuple(target.shape)}")


def model_device(model: nn.Module) -> torch.device:
    """Where ``model``'s parameters live (training and evaluation put their inputs there)."""
    parameter = next(model.parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device


def has_dropout(model: nn.Module) -> bool:
    """Whether ``model`` has dropout layers (training draws random masks)."""
    return any(isinstance(module, nn.Dropout) for module in _model_modules(model))


@contextlib.contextmanager
def seeded_dropout(
    model: nn.Module, rng: np.random.Generator | None, seed: int | None = None
) -> Iterator[None]:
    """Seed torch's generator (``seed``, else one drawn from ``rng``) while training a model with dropout.

    Dropout masks come from torch's global generator; seeding it keeps a seeded simulation
    reproducible. A model without dropout draws nothing from ``rng``.
    """
    if not has_dropout(model):
        yield
        return
    if seed is None:
        if rng is None:
            raise ValueError("a model with dropout needs a dropout seed or a generator")
        seed = int(rng.integers(2**62))
    with torch.random.fork_rng():
        torch.manual_seed(int(seed))
        yield


@dataclass(frozen=True)
class LocalSGD:
    """What one client's local training is: :func:`train_local`'s settings, besides model, data, order.

    The client contract's description of its local update (:meth:`clients.base.FederatedClient.local_sgd`):
    ``epochs`` passes of mini-batch SGD (``batch_size``, ``lr``, heavy-ball ``momentum``) with an
    optional FedProx term ``proximal_mu`` (Li et al., MLSys 2020) towards the received model and an
    optional constant ``correction`` added to every gradient (SCAFFOLD's ``c - c_i``, by parameter
    name). Whoever runs it (the client's own loop, or the engine's vectorised trainer for a whole
    cohort) runs exactly this, so the two cannot disagree on what a client trains.
    """

    epochs: int
    batch_size: int
    lr: float
    momentum: float = 0.0
    proximal_mu: float = 0.0
    correction: Mapping[str, np.ndarray] | None = field(default=None, compare=False)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> LocalSGD:
        """The SGD a train config asks for (its local epochs, batch, lr and momentum)."""
        return cls(
            epochs=int(config[keys.LOCAL_EPOCHS]),
            batch_size=int(config[keys.BATCH_SIZE]),
            lr=float(config[keys.LR]),
            momentum=float(config.get(keys.MOMENTUM, 0.0)),
        )

    def same_as(self, other: LocalSGD) -> bool:
        """Whether ``other`` trains exactly the same way (the correction compared value by value)."""
        if self != other or (self.correction is None) != (other.correction is None):
            return False
        if self.correction is None or other.correction is None:
            return True
        return list(self.correction) == list(other.correction) and all(
            np.array_equal(self.correction[name], other.correction[name]) for name in self.correction
        )

    def corrections_for(self, model: nn.Module) -> list[torch.Tensor] | None:
        """The correction as one tensor per trainable parameter of ``model`` (``ValueError``: a name)."""
        if self.correction is None:
            return None
        names = [name for name, p in model.named_parameters() if p.requires_grad]
        if set(names) != set(self.correction):
            raise ValueError(f"a gradient correction for {sorted(self.correction)}, the model trains {names}")
        return [torch.as_tensor(np.asarray(self.correction[name])) for name in names]


def train_local(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    rng: np.random.Generator | None = None,
    order: np.ndarray | None = None,
    dropout_seed: int | None = None,
    momentum: float = 0.0,
    proximal_mu: float = 0.0,
    reference: Sequence[torch.Tensor] | None = None,
    correction: Sequence[torch.Tensor] | None = None,
) -> float:
    """Train ``model`` in place with mini-batch SGD; return the mean training loss.

    Long because: most of it is the numpy-style Parameters of this public entry point.

    Parameters
    ----------
    model : nn.Module
        The model to train.
    x, y : np.ndarray
        Examples and integer labels.
    epochs, batch_size, lr, momentum : int, int, float, float
        SGD settings; each epoch visits the examples in a fresh order, in batches of ``batch_size``.
    rng : np.random.Generator, optional
        Where each epoch's order (a permutation) and the dropout seed are drawn from, when ``order``
        and ``dropout_seed`` are not given.
    order : np.ndarray, optional
        ``[epochs, n]``: each epoch's order (:func:`fl_app.learning.orders.example_orders`).
    dropout_seed : int, optional
        Where the dropout masks start, for a model with dropout layers
        (:func:`fl_app.learning.orders.client_seed`).
    proximal_mu : float
        FedProx term ``mu/2 ||w - reference||^2`` (0 disables it).
    reference : Sequence[torch.Tensor], optional
        The parameters the proximal term pulls towards (required when mu > 0).
    correction : Sequence[torch.Tensor], optional
        A constant added to every step's gradient, one tensor per trainable parameter in order
        (SCAFFOLD's ``c - c_i``, Karimireddy et al. 2020, Algorithm 1 line 10); None: none.

    """
    if len(y) == 0:
        return math.nan
    if proximal_mu > 0 and reference is None:
        raise ValueError("proximal_mu > 0 needs the reference parameters")
    orders = _epoch_orders(order, rng, epochs, len(y))
    if not all(module.training for module in _model_modules(model)):  # model.train(): 20 us a client
        model.train()
    trained = [p for p in model_parameters(model) if p.requires_grad]
    step = _Step(model, trained, SGD(trained, lr=lr, momentum=momentum), _correction_for(trained, correction))
    device = model_device(model)
    inputs = model_input(model, x).to(device)
    targets = torch.from_numpy(np.asarray(y, dtype=np.int64)).to(device)
    with seeded_dropout(model, rng, dropout_seed):
        for epoch in range(epochs):
            visit = torch.from_numpy(orders(epoch)).to(device)
            for start in range(0, len(y), batch_size):
                index = visit[start : start + batch_size]
                step(inputs[index], targets[index], proximal_mu, reference)
    return step.total / max(step.batches, 1)


def _epoch_orders(
    order: np.ndarray | None, rng: np.random.Generator | None, epochs: int, n: int
) -> Callable[[int], np.ndarray]:
    """Each epoch's example order: a row of ``order``, else a permutation drawn from ``rng``."""
    if order is not None:
        if order.shape != (epochs, n):
            raise ValueError(f"example orders of shape {order.shape} for {epochs} epochs of {n} examples")
        return lambda epoch: order[epoch]
    if rng is None:
        raise ValueError("train_local needs the example orders or a generator to draw them")
    return lambda epoch: rng.permutation(n)


class _Step:
    """One SGD step on a batch (the proximal term and the correction included), its loss summed."""

    def __init__(
        self, model: nn.Module, trained: list[torch.Tensor], optimizer: SGD, shift: list[torch.Tensor] | None
    ) -> None:
        self.model, self.trained, self.optimizer, self.shift = model, trained, optimizer, shift
        self.total, self.batches = 0.0, 0

    def __call__(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        proximal_mu: float,
        reference: Sequence[torch.Tensor] | None,
    ) -> None:
        loss = loss_function(self.model)(self.model(inputs), targets)
        if proximal_mu > 0 and reference is not None:
            prox = sum(
                torch.sum((p - r) ** 2) for p, r in zip(self.model.parameters(), reference, strict=True)
            )
            loss = loss + 0.5 * proximal_mu * prox
        # the gradients backward() would leave in .grad, without storing them there
        grads = torch.autograd.grad(loss, self.trained, allow_unused=True)
        if self.shift is not None:
            grads = tuple(s if g is None else g + s for g, s in zip(grads, self.shift, strict=True))
        self.optimizer.apply(grads)
        self.total += float(loss.detach())
        self.batches += 1


def _correction_for(
    trained: Sequence[torch.Tensor], correction: Sequence[torch.Tensor] | None
) -> list[torch.Tensor] | None:
    """``correction`` on the parameters' device and dtype (``ValueError`` unless shaped like them)."""
    if correction is None:
        return None
    if len(correction) != len(trained):
        raise ValueError(f"{len(correction)} correction tensors for {len(trained)} trainable parameters")
    shifts = []
    for parameter, values in zip(trained, correction, strict=True):
        if tuple(values.shape) != tuple(parameter.shape):
            raise ValueError(
                f"a correction of shape {tuple(values.shape)} for a parameter {tuple(parameter.shape)}"
            )
        shifts.append(values.to(device=parameter.device, dtype=parameter.dtype))
    return shifts


def local_steps(examples: int, *, epochs: int, batch_size: int) -> int:
    """The SGD steps :func:`train_local` takes on ``examples`` examples: ``epochs * ceil(n / B)``."""
    return int(epochs) * -(-int(examples) // max(int(batch_size), 1))


@torch.no_grad()
def predict_proba(model: nn.Module, x: np.ndarray, *, batch_size: int = EVAL_BATCH) -> np.ndarray:
    """Softmax outputs of ``model`` on ``x``, shape ``(n, classes)``."""
    model.eval()
    inputs = to_tensor(x).to(model_device(model))
    parts = [F.softmax(model(inputs[i : i + batch_size]), dim=1) for i in range(0, len(x), batch_size)]
    return torch.cat(parts).cpu().numpy() if parts else np.zeros((0, 0), dtype=np.float32)


@torch.no_grad()
def evaluate(
    model: nn.Module, x: np.ndarray, y: np.ndarray, *, batch_size: int = EVAL_BATCH
) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy of ``model`` on ``(x, y)``.

    A next-token network's are its task's (:func:`fl_app.learning.sequence.evaluate_next_token`: the
    loss over non-pad targets, the accuracy over counted ones).
    """
    if len(y) == 0:
        return math.nan, math.nan
    task = next_token_task(model)
    if task is not None:
        return evaluate_next_token(model, task, x, y, batch_size=batch_size)
    model.eval()
    device = model_device(model)
    inputs = to_tensor(x).to(device)
    targets = torch.from_numpy(np.asarray(y, dtype=np.int64)).to(device)
    loss_sum, correct = 0.0, 0
    for start in range(0, len(y), batch_size):
        logits = model(inputs[start : start + batch_size])
        batch_targets = targets[start : start + batch_size]
        loss_sum += float(F.cross_entropy(logits, batch_targets, reduction="sum"))
        correct += int((logits.argmax(dim=1) == batch_targets).sum())
    return loss_sum / len(y), correct / len(y)


def threads_as_environment_says() -> None:
    """Torch's threads as ``OMP_NUM_THREADS`` says, when it is set (the engine sets it per worker)."""
    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads > 0 and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def training_device(config: Mapping[str, Any], *, may_use_gpu: bool = True) -> torch.device:
    """Where a client trains: CUDA when the train config asks for it, it may and torch sees one."""
    wanted = str(config.get(keys.DEVICE, "cpu")) == "cuda"
    return torch.device("cuda" if wanted and may_use_gpu and torch.cuda.is_available() else "cpu")


def torch_seed(rng: np.random.Generator) -> int:
    """Draw a seed for torch's generator from a numpy generator."""
    return int(rng.integers(0, 2**63 - 1))
