"""Many clients trained as one computation: vmapped SGD over stacked parameters.

:func:`fl_app.learning.training.train_local` trains one client with a Python loop: mini-batch SGD over
``epochs``, a fresh permutation of the client's examples per epoch, batches of ``batch_size`` in that
order (the last one possibly smaller), mean cross-entropy per batch, ``SGD(lr, momentum)``, an
optional FedProx term ``0.5 * mu * ||w - w_global||^2`` and dropout masks seeded from the client's
generator. :func:`train_vectorised` computes the same thing for a whole cohort that starts from the same
global model with one ``torch.func`` computation per step: ``vmap(grad(loss))`` over the clients'
stacked parameters and their stacked batches, then one SGD update of the stacked parameters and
momentum buffers. The clients' example orders come in a :class:`BatchPlan` (:func:`plan_batches` from
orders the caller drew, or :func:`plan_from_generators`, which draws them from per-client generators
exactly as ``train_local`` does), so each client keeps its own generator.

Equal to running ``train_local`` per client up to float rounding: a batched matrix product (or a
grouped convolution) sums its products in another order than the per-client one, so parameters
differ by about 1e-8 to 1e-7 after tens of steps (``tests/test_vectorised_training.py``: element-wise
within rtol 1e-5, atol 1e-6 on smooth models). ReLU and max-pool models have kinks: when rounding
moves a value across one, a few weights get another gradient on one step (seen: a max-pool window
holding 0.23610522 and 0.23610516), and unstable training amplifies it. ``train_local`` does the same
to itself: started from global parameters perturbed by 1e-7 (relative), the CNN's 100 clients end
up to 3.0e-3 away from it after 5 epochs at lr 0.1, where this trainer ends up to 3.5e-3 away (the
benchmark's ``loop's own`` column).

Unequal clients
---------------
A client takes ``epochs * ceil(n / batch_size)`` steps; its last batch of each epoch is padded to
``batch_size`` with masked examples and its loss is the mean over the real ones (what ``train_local``
computes for a smaller batch). Three schedules of the clients' unequal step counts:

``"prefix"`` (the default)
    Clients sorted by step count, longest first; at step ``s`` only the clients that still have a step
    are computed (a prefix of the sorted chunk: a slice of the stacked tensors, no masking, no wasted
    client-steps, one ``vmap`` call per step of the longest client).
``"pad"``
    Clients in the given order, every chunk padded to its longest client's step count; a client
    without a step keeps its parameters and momentum buffers (``torch.where``).
``"bucket"``
    Clients grouped by equal step count, one computation per group (one ``vmap`` call per step of
    every group: up to 1 + 2 + ... + longest calls per epoch).

Measured (``benchmarks/cohort_training.py --schedules prefix,pad,bucket --chunks auto,all``,
docs/benchmarks/cohort_training.md) on the cross-device shape: 100 clients of 60 examples on average
(Dirichlet spread: 242 client-steps, the longest client 7), 28x28 inputs, batch 32, 1 epoch, one
torch thread on a shared 2-core CPU; seconds per round, the per-client loop 0.14 s (MLP) and 2.17 s
(CNN):

========  ==============  ==============  ==============
schedule  MLP auto (166)  CNN auto (4)    CNN all (100)
========  ==============  ==============  ==============
prefix    0.197           3.12            5.43
pad       0.776           5.27            17.4
bucket    0.170           3.05            3.47
========  ==============  ==============  ==============

Padding computes every client for the longest client's steps (700 client-steps for 242 of work) and
is 1.7 to 4 times slower. Prefix and buckets do the same work; they are within the machine's noise
of each other on the CPU. Prefix is the default: it makes the fewest calls (7 here against up to 28),
which is what a GPU pays for per step, and it needs no masking.

Memory and chunks
-----------------
A chunk of ``k`` clients holds ``k`` copies of the trainable parameters, of their gradients and (with
momentum) of their momentum buffers, plus one step's activations of ``k * batch_size`` examples; the
result holds one copy of the parameters per client. The SmallCNN (``cnn``) has 114,314 parameters:
1000 clients' parameters, gradients and buffers are 1.37 GB in float32, the result 0.46 GB; its
layers output 44,042 numbers per 28x28 example, 5.6 MB per client-step at batch 32, so 1000 clients
at once would hold 5.6 GB of layer outputs before their gradients. ``chunk`` bounds this (the results
do not depend on it). ``chunk="auto"`` (:func:`auto_chunk`) takes, on the CPU, the clients whose
step's layer outputs fill :data:`CPU_STEP_BYTES` (24 MiB: 4 CNN clients, 166 MLP clients): the CPU
is compute-bound and a chunk that stays near the caches was fastest (CNN, 100 clients: 3.1 s in
chunks of 4, 5.4 s all at once); on CUDA, a quarter of the free memory.

Limits
------
* Dropout: only ``nn.Dropout`` layers, whose masks are drawn from a per-client ``torch.Generator``
  seeded as :func:`fl_app.learning.training.seeded_dropout` seeds torch's generator, in the same order and
  shapes as ``train_local`` draws them on the CPU (``empty_like(x).bernoulli_(1 - p) / (1 - p)``).
  Masks are drawn on the CPU even when training on CUDA, so they equal ``train_local`` on the CPU,
  not ``train_local`` on CUDA (whose fused dropout kernel draws from the CUDA generator). Other
  dropout layers (``Dropout1d/2d/3d``, ``AlphaDropout``) are refused with a ``ValueError``; random
  operations called in ``forward`` fail inside ``vmap``, also with a ``ValueError``.
* Models with buffers (BatchNorm's running statistics) are refused with a ``ValueError``.
* Models whose forward pass ``torch.func`` cannot transform (``bnn_cnn``: its straight-through
  ``autograd.Function`` has no ``setup_context``) are refused with a ``ValueError`` naming the model.

This module imports only torch, numpy and the standard library (no Flower, Ray or Hydra): it runs on
a machine that has nothing else.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator, Mapping, Sequence, Sized
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F  # noqa: N812 - the conventional name

from fl_app.data.text_tokens import PAD
from fl_app.learning.orders import client_seed, concatenated_orders

Schedule = Literal["prefix", "pad", "bucket"]
SCHEDULES: tuple[str, ...] = ("prefix", "pad", "bucket")

#: Dropout layers other than ``nn.Dropout`` (refused: their masks have other shapes or values).
_OTHER_DROPOUTS = (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


# --------------------------------------------------------------------------------------
# The step plan
# --------------------------------------------------------------------------------------


class ConcatenatedRows(Sequence[np.ndarray]):
    """Clients' arrays stored one after another in one array: client ``c`` has rows ``ends[c-1]:ends[c]``.

    What :func:`train_vectorised` takes as ``xs`` or ``ys`` without copying them again (a worker's
    gathered share of the cohort, :mod:`fl_app.engine.bulk`); indexing gives a client's view.
    """

    def __init__(self, values: np.ndarray, ends: Sequence[int] | np.ndarray) -> None:
        self.values = values
        self.ends = np.asarray(ends, dtype=np.int64)
        if len(self.ends) and (
            np.any(np.diff(self.ends) < 0) or self.ends[0] < 0 or self.ends[-1] > len(values)
        ):
            raise ValueError(f"ends must rise within the {len(values)} rows, got {self.ends.tolist()}")

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, client: int) -> np.ndarray:  # type: ignore[override]
        start = int(self.ends[client - 1]) if client > 0 else 0
        return self.values[start : int(self.ends[client])]


@dataclass(frozen=True)
class BatchPlan:
    """Every client's mini-batches, in the order ``train_local`` visits them, padded to dense tensors.

    Attributes
    ----------
    index : torch.Tensor
        ``int64 [clients, steps, batch_size]``: indices into each client's own examples; 0 where
        padded.
    example_mask : torch.Tensor
        ``bool [clients, steps, batch_size]``: which entries of ``index`` are real examples.
    step_mask : torch.Tensor
        ``bool [clients, steps]``: which steps a client takes (its first ``epochs * ceil(n / batch)``).
    sizes : np.ndarray
        ``int64 [clients]``: each client's number of examples.
    epochs, batch_size : int
        The settings the plan was made for.
    dropout_seeds : tuple of (int or None), or None
        Per client, the seed ``seeded_dropout`` gives torch's generator (None for a client without
        examples); None when the plan was made for a model without dropout.

    """

    index: torch.Tensor
    example_mask: torch.Tensor
    step_mask: torch.Tensor
    sizes: np.ndarray
    epochs: int
    batch_size: int
    dropout_seeds: tuple[int | None, ...] | None = None

    @property
    def clients(self) -> int:
        """Number of clients."""
        return int(self.index.shape[0])

    @property
    def steps(self) -> int:
        """Number of steps of the longest client (the padded step dimension)."""
        return int(self.index.shape[1])

    @property
    def client_steps(self) -> np.ndarray:
        """``int64 [clients]``: the number of SGD steps each client takes."""
        return self.step_mask.sum(dim=1).numpy().astype(np.int64)

    @property
    def counts(self) -> torch.Tensor:
        """``int64 [clients, steps]``: real examples in each batch (0 on padded steps)."""
        return self.example_mask.sum(dim=2)


def client_step_count(size: int, *, epochs: int, batch_size: int) -> int:
    """SGD steps ``train_local`` takes on ``size`` examples: ``epochs * ceil(size / batch_size)``."""
    return epochs * math.ceil(size / batch_size)


def plan_batches(
    sizes: Sequence[int],
    orders: Sequence[Sequence[np.ndarray]],
    *,
    epochs: int,
    batch_size: int,
    dropout_seeds: Sequence[int | None] | None = None,
    check_orders: bool = True,
) -> BatchPlan:
    """Build the padded step plan of a cohort from each client's per-epoch example orders.

    Parameters
    ----------
    sizes : Sequence[int]
        Number of examples of each client (0 allowed: such a client takes no step).
    orders : Sequence[Sequence[np.ndarray]]
        Per client, ``epochs`` permutations of ``range(size)`` (what the client's generator gives
        ``train_local``: ``rng.permutation(size)`` once per epoch); ignored for a client of size 0.
    epochs, batch_size : int
        Local epochs and mini-batch size.
    dropout_seeds : Sequence[int or None], optional
        Per client, the dropout seed (see :func:`plan_from_generators`); needed to train a model with
        dropout.
    check_orders : bool
        Whether to check that each order is a permutation (False where they come from
        ``Generator.permutation``: :func:`plan_from_generators`).

    Returns
    -------
    BatchPlan
        The index, example mask and step mask, ``steps`` = the longest client's step count.

    Raises
    ------
    ValueError
        Non-positive ``epochs`` or ``batch_size``, a negative size, a client without ``epochs``
        orders, or an order that is not a permutation of its client's examples.

    """
    sizes_np = _checked_sizes(
        sizes, orders, epochs=epochs, batch_size=batch_size, dropout_seeds=dropout_seeds
    )
    values = _checked_orders(sizes_np, orders, epochs=epochs, check_orders=check_orders)
    return _plan(sizes_np, values, epochs=epochs, batch_size=batch_size, dropout_seeds=dropout_seeds)


def _plan(
    sizes: np.ndarray,
    values: np.ndarray,
    *,
    epochs: int,
    batch_size: int,
    dropout_seeds: Sequence[int | None] | None,
) -> BatchPlan:
    """The plan of the clients' concatenated orders ``values`` (:func:`_batch_slots`)."""
    index, mask = _batch_slots(sizes, values, epochs=epochs, batch_size=batch_size)
    return BatchPlan(
        index=torch.from_numpy(index),
        example_mask=torch.from_numpy(mask),
        step_mask=torch.from_numpy(mask.any(axis=2)),
        sizes=sizes,
        epochs=int(epochs),
        batch_size=int(batch_size),
        dropout_seeds=None if dropout_seeds is None else tuple(dropout_seeds),
    )


def _checked_sizes(
    sizes: Sequence[int],
    orders: Sized,
    *,
    epochs: int,
    batch_size: int,
    dropout_seeds: Sequence[int | None] | None,
) -> np.ndarray:
    """The clients' sizes as ``int64``, after checking them and the counts of orders (or clients) and seeds.

    Raises ``ValueError`` for non-positive ``epochs`` or ``batch_size``, as many orders or dropout
    seeds as another number of clients, or a negative size.
    """
    if epochs < 1 or batch_size < 1:
        raise ValueError(f"epochs and batch_size must be positive, got {epochs} and {batch_size}")
    sizes_np = np.asarray(sizes, dtype=np.int64).reshape(-1)
    if len(orders) != len(sizes_np):
        raise ValueError(f"{len(orders)} clients' orders for {len(sizes_np)} sizes")
    if dropout_seeds is not None and len(dropout_seeds) != len(sizes_np):
        raise ValueError(f"{len(dropout_seeds)} dropout seeds for {len(sizes_np)} clients")
    if (sizes_np < 0).any():
        raise ValueError(f"client sizes must be non-negative, got {sizes_np.min()}")
    return sizes_np


def _batch_slots(
    sizes: np.ndarray, values: np.ndarray, *, epochs: int, batch_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """``int64`` example index and ``bool`` example mask, ``[clients, steps, batch_size]`` each.

    ``values`` are the clients' orders concatenated (:func:`_checked_orders`); every epoch of a client
    starts a new batch, so its last batch of an epoch may be partly masked.
    """
    per_epoch = -(-sizes // batch_size)
    steps = int((epochs * per_epoch).max(initial=0))
    clients = len(sizes)
    # Entry j of client c's concatenated epochs is epoch j // size, position j % size: slot
    # epoch * batches * batch_size + position of the client's [steps * batch_size] row.
    repeat = epochs * sizes
    client_of = np.repeat(np.arange(clients), repeat)
    within = np.arange(len(values)) - np.repeat(np.cumsum(repeat) - repeat, repeat)
    size_of = np.repeat(sizes, repeat)
    slot = (within // size_of) * np.repeat(per_epoch, repeat) * batch_size + within % size_of
    index = np.zeros((clients, steps * batch_size), dtype=np.int64)
    mask = np.zeros((clients, steps * batch_size), dtype=bool)
    index[client_of, slot] = values
    mask[client_of, slot] = True
    return index.reshape(clients, steps, batch_size), mask.reshape(clients, steps, batch_size)


def _checked_orders(
    sizes: np.ndarray, orders: Sequence[Sequence[np.ndarray]], *, epochs: int, check_orders: bool
) -> np.ndarray:
    """Every client's orders concatenated (client-major, then epoch), after checking their lengths.

    Raises ``ValueError`` for a client without ``epochs`` orders, or an order of another length than its
    client's size (or, with ``check_orders``, that is not a permutation of ``range(size)``).
    """
    parts: list[np.ndarray] = []
    for client, size in enumerate(sizes.tolist()):
        if size == 0:
            continue
        client_orders = orders[client]
        if len(client_orders) != epochs:
            raise ValueError(f"client {client}: {len(client_orders)} orders for {epochs} epochs")
        for epoch, order in enumerate(client_orders):
            order_np = np.asarray(order, dtype=np.int64).reshape(-1)
            if len(order_np) != size or (
                check_orders and not np.array_equal(np.sort(order_np), np.arange(size))
            ):
                raise ValueError(f"client {client}, epoch {epoch}: the order is not a permutation of {size}")
            parts.append(order_np)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def plan_for_clients(
    *,
    seed: int,
    clients: Sequence[int],
    server_round: int,
    sizes: Sequence[int],
    epochs: int,
    batch_size: int,
    dropout: bool = False,
) -> BatchPlan:
    """Plan the clients' batches from their example orders and dropout seeds, as ``train_local`` gets them.

    The orders of :func:`fl_app.learning.orders.example_orders` and the seeds of
    :func:`fl_app.learning.orders.client_seed`: a client trained here visits its examples exactly as it
    does trained on its own (:meth:`clients.base.FederatedClient.train_locally`).
    """
    seeds = (
        [client_seed(seed=seed, client=int(c), server_round=server_round) for c in clients]
        if dropout
        else None
    )
    sizes_np = _checked_sizes(sizes, clients, epochs=epochs, batch_size=batch_size, dropout_seeds=seeds)
    values = concatenated_orders(
        seed=seed, clients=clients, server_round=server_round, sizes=sizes_np, epochs=epochs
    )
    return _plan(sizes_np, values, epochs=epochs, batch_size=batch_size, dropout_seeds=seeds)


def plan_from_generators(
    rngs: Sequence[np.random.Generator],
    sizes: Sequence[int],
    *,
    epochs: int,
    batch_size: int,
    dropout: bool = False,
) -> BatchPlan:
    """Draw each client's orders from its own generator exactly as ``train_local`` does, and plan them.

    ``train_local`` draws nothing for a client without examples; otherwise, for a model with dropout,
    first the seed of torch's generator (``int(rng.integers(2**62))``, in ``seeded_dropout``), then
    one ``rng.permutation(size)`` per epoch. Each generator is advanced as ``train_local`` would
    advance it.

    Parameters
    ----------
    rngs : Sequence[np.random.Generator]
        One generator per client (the one its ``train_local`` would get).
    sizes : Sequence[int]
        Number of examples of each client.
    epochs, batch_size : int
        Local epochs and mini-batch size.
    dropout : bool
        Whether the model has dropout layers (``fl_app.learning.training.has_dropout``; :func:`has_dropout`).

    Returns
    -------
    BatchPlan
        The plan, with ``dropout_seeds`` when ``dropout``.

    """
    if len(rngs) != len(sizes):
        raise ValueError(f"{len(rngs)} generators for {len(sizes)} clients")
    orders: list[list[np.ndarray]] = []
    seeds: list[int | None] = []
    for rng, size in zip(rngs, sizes, strict=True):
        if int(size) == 0:
            orders.append([])
            seeds.append(None)
            continue
        seeds.append(int(rng.integers(2**62)) if dropout else None)
        orders.append([rng.permutation(int(size)) for _ in range(epochs)])
    return plan_batches(
        sizes, orders, epochs=epochs, batch_size=batch_size, dropout_seeds=seeds if dropout else None,
        check_orders=False,
    )  # fmt: skip


def has_dropout(model: nn.Module) -> bool:
    """Whether ``model`` has ``nn.Dropout`` layers (what ``fl_app.learning.training.has_dropout`` checks)."""
    return any(isinstance(module, nn.Dropout) for module in model.modules())


# --------------------------------------------------------------------------------------
# Dropout with given masks
# --------------------------------------------------------------------------------------


class _MaskSource:
    """The masks of the current forward pass, handed out in call order (or the shapes recorded)."""

    def __init__(self) -> None:
        self.masks: Sequence[torch.Tensor] = ()
        self.position = 0
        self.recording: list[tuple[float, tuple[int, ...]]] | None = None

    def next(self, layer: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
        if self.recording is not None:
            self.recording.append((float(layer.p), tuple(x.shape[1:])))
            return x
        if self.position >= len(self.masks):
            raise RuntimeError("the model called more dropout layers than when its shapes were recorded")
        mask = self.masks[self.position]
        self.position += 1
        return x * mask


class _GivenMaskDropout(nn.Module):
    """Stands in for an ``nn.Dropout``: multiplies by the next mask of the :class:`_MaskSource`."""

    def __init__(self, layer: nn.Dropout, source: _MaskSource) -> None:
        super().__init__()
        self.layer = layer
        self.source = source

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x * mask`` (the mask holds 0 and ``1 / (1 - p)``)."""
        return self.source.next(self.layer, x)


def _with_given_masks(model: nn.Module, source: _MaskSource) -> nn.Module:
    """A copy of ``model`` whose ``nn.Dropout`` layers take their masks from ``source``."""
    replica = copy.deepcopy(model)
    for module in list(replica.modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Dropout:
                setattr(module, child_name, _GivenMaskDropout(child, source))
    return replica


def _draw_masks(
    generator: torch.Generator, layers: Sequence[tuple[float, tuple[int, ...]]], rows: int
) -> list[torch.Tensor]:
    """One batch's dropout masks as ``train_local`` draws them on the CPU (``at::native::_dropout``)."""
    masks = []
    for p, shape in layers:
        if p == 0.0:
            masks.append(torch.ones((rows, *shape)))
        elif p == 1.0:
            masks.append(torch.zeros((rows, *shape)))
        else:
            noise = torch.empty((rows, *shape)).bernoulli_(1.0 - p, generator=generator)
            masks.append(noise.div_(1.0 - p))
    return masks


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------


@dataclass
class VectorisedResult:
    """What :func:`train_vectorised` returns.

    Attributes
    ----------
    params : dict[str, torch.Tensor]
        Per parameter name, the clients' trained values stacked in client order, ``[clients, *shape]``.
    losses : np.ndarray
        ``float64 [clients]``: each client's mean training loss over its steps (what ``train_local``
        returns; NaN for a client without examples).

    """

    params: dict[str, torch.Tensor]
    losses: np.ndarray

    def __len__(self) -> int:
        return len(self.losses)

    def client(self, index: int) -> dict[str, torch.Tensor]:
        """Client ``index``'s trained parameters (views into :attr:`params`)."""
        return {name: values[index] for name, values in self.params.items()}

    def clients(self) -> Iterator[dict[str, torch.Tensor]]:
        """Every client's trained parameters, in order."""
        return (self.client(i) for i in range(len(self)))

    def to(self, device: torch.device | str) -> VectorisedResult:
        """The same result with its stacked parameters on ``device`` (one transfer per parameter).

        From a GPU to the host the copies land in page-locked memory (torch's caching host
        allocator: reused from round to round), all queued before one wait: a 1000-client MLP
        cohort is 437 MB, which a copy to pageable memory moves several times slower.
        """
        target = torch.device(device)
        if target.type != "cpu" or not any(v.is_cuda for v in self.params.values()):
            return VectorisedResult(
                params={n: v.to(target) for n, v in self.params.items()}, losses=self.losses
            )
        host = {}
        for name, values in self.params.items():
            host[name] = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            host[name].copy_(values, non_blocking=True)
        for source in {values.device for values in self.params.values() if values.is_cuda}:
            torch.cuda.synchronize(source)  # the copies are queued on their GPU's stream
        return VectorisedResult(params=host, losses=self.losses)


def _as_inputs(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    """As the loop makes input: ``uint8`` images in [0, 1], token ids (other integers) int64, else float."""
    if isinstance(x, np.ndarray) and x.dtype != np.uint8 and np.issubdtype(x.dtype, np.integer):
        return torch.from_numpy(x.astype(np.int64))  # token ids (uint16 memory maps among them)
    tensor = _as_tensor(x)
    if tensor.dtype == torch.uint8:
        return tensor.float().div_(255.0)
    if not tensor.is_floating_point() and tensor.dtype != torch.bool:
        return tensor.to(torch.int64)
    return tensor.to(torch.float32)


def check_model(model: nn.Module) -> None:
    """Raise ``ValueError`` (naming the model) for a model :func:`train_vectorised` cannot train exactly.

    Refused: models with buffers (BatchNorm's running statistics) and dropout layers other than
    ``nn.Dropout``. Whether ``torch.func`` can transform the forward pass is checked by
    :func:`train_vectorised` on the first batch.
    """
    name = type(model).__name__
    buffers = [buffer_name for buffer_name, _ in model.named_buffers()]
    if buffers:
        raise ValueError(
            f"{name} has buffers ({', '.join(buffers[:4])}{', ...' if len(buffers) > 4 else ''}): "
            "train_vectorised does not train models with buffers (BatchNorm's running statistics)"
        )
    others = sorted({type(m).__name__ for m in model.modules() if isinstance(m, _OTHER_DROPOUTS)})
    if others:
        raise ValueError(f"{name} has {', '.join(others)} layers: train_vectorised supports only nn.Dropout")


def _per_client_loss(
    module: nn.Module, source: _MaskSource, names: Sequence[str], proximal_mu: float
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """One client's loss on one padded batch (the function ``vmap(grad(...))`` transforms)."""

    def loss_fn(
        trainable: dict[str, torch.Tensor],
        frozen: dict[str, torch.Tensor],
        reference: dict[str, torch.Tensor],
        x: torch.Tensor,
        y: torch.Tensor,
        weight: torch.Tensor,
        count: torch.Tensor,
        masks: tuple[torch.Tensor, ...],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        params = {**trainable, **frozen}
        source.masks, source.position = masks, 0
        try:
            logits = functional_call(module, params, (x,))
        finally:
            source.masks = ()
        # The mean over the real examples: F.cross_entropy's "mean" is the sum over the batch / its size.
        # -log_softmax at the label is F.cross_entropy's value and gradient exactly; under vmap it avoids
        # nll_loss's Python decomposition (a third of a step's dispatch time for the MLP).
        picked = F.log_softmax(logits, dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        if picked.dim() > 1:  # next-token scores: the mean over the real examples' non-pad targets
            valid = (y != PAD).to(picked.dtype) * weight.unsqueeze(-1)
            loss = (-picked * valid).sum() / valid.sum().clamp(min=1.0)
        else:
            loss = (-picked * weight).sum() / count
        if proximal_mu > 0:
            prox = sum(torch.sum((params[n] - reference[n]) ** 2) for n in names)
            loss = loss + 0.5 * proximal_mu * prox
        return loss, loss.detach()

    return loss_fn


def _groups(plan: BatchPlan, schedule: str, chunk: int) -> list[tuple[np.ndarray, bool]]:
    """The client groups trained one after another, each with whether it is sorted (prefix-active)."""
    steps = plan.client_steps
    clients = np.arange(plan.clients)
    if schedule == "prefix":
        ordered = clients[np.argsort(-steps, kind="stable")]
        return [(ordered[i : i + chunk], True) for i in range(0, len(ordered), chunk)]
    if schedule == "pad":
        return [(clients[i : i + chunk], False) for i in range(0, len(clients), chunk)]
    if schedule == "bucket":
        groups = []
        for value in sorted(set(steps.tolist()), reverse=True):
            members = clients[steps == value]
            groups += [(members[i : i + chunk], True) for i in range(0, len(members), chunk)]
        return groups
    raise ValueError(f"schedule={schedule!r}; allowed: {', '.join(SCHEDULES)}")


def train_vectorised(
    model: nn.Module,
    global_params: Mapping[str, torch.Tensor],
    xs: Sequence[np.ndarray | torch.Tensor],
    ys: Sequence[np.ndarray | torch.Tensor],
    plan: BatchPlan,
    *,
    lr: float,
    momentum: float = 0.0,
    proximal_mu: float = 0.0,
    corrections: Mapping[str, torch.Tensor] | None = None,
    device: torch.device | str | None = None,
    chunk: int | Literal["auto"] | None = "auto",
    schedule: Schedule = "prefix",
) -> VectorisedResult:
    """Train every client of a cohort from ``global_params`` as ``train_local`` would, vectorised.

    Each client ``c`` runs ``plan``'s steps on ``(xs[c], ys[c])``: per step the mean cross-entropy of
    its batch (plus ``0.5 * proximal_mu * ||w - global||^2``), then ``torch.optim.SGD``'s update
    (``b <- g`` on the first step, ``b <- momentum * b + g`` after; ``w <- w - lr * b``; no dampening,
    Nesterov or weight decay). All clients of a chunk take their ``s``-th step together, as one
    ``vmap(grad(loss))`` over their stacked parameters and batches.

    Long because: most of it is the numpy-style Parameters/Returns/Raises of this public entry point.

    Parameters
    ----------
    model : nn.Module
        The architecture (its own parameter values are not used; it is not modified).
    global_params : Mapping[str, torch.Tensor]
        The received global model, one tensor per name of ``model.named_parameters()``: every client's
        start and the FedProx reference.
    xs, ys : Sequence of arrays or tensors
        Per client, its examples (``uint8`` is scaled to [0, 1] as ``train_local`` does) and integer
        labels; ``len(xs[c]) == plan.sizes[c]``.
    plan : BatchPlan
        The clients' batches (:func:`plan_batches`, :func:`plan_from_generators`).
    lr, momentum, proximal_mu : float
        SGD step size, heavy-ball momentum, FedProx coefficient (0 disables it).
    corrections : Mapping[str, torch.Tensor], optional
        Per trainable parameter, each client's constant added to its every gradient, stacked in client
        order ``[clients, *shape]`` (``train_local``'s ``correction``; SCAFFOLD's ``c - c_i``).
    device : torch.device or str, optional
        Where to train (default: where ``global_params`` are).
    chunk : int, "auto" or None
        Train at most this many clients at once (bounds memory; the results do not depend on it).
        ``"auto"`` (default): :func:`auto_chunk`; None: the whole cohort at once.
    schedule : {"prefix", "pad", "bucket"}
        How clients with unequal step counts share the steps (module docstring; same results).

    Returns
    -------
    VectorisedResult
        The trained parameters stacked in client order (on ``device``) and the mean training losses.

    Raises
    ------
    ValueError
        A model this cannot train (:func:`check_model`; a forward pass ``torch.func`` cannot
        transform), a model with dropout and a plan without dropout seeds, or inputs that do not match
        the plan.

    """
    _check_arguments(model, global_params, xs, ys, plan, chunk)
    first = next(iter(global_params.values()))
    target = torch.device(device) if device is not None else first.device
    trainer = _prepare(
        model,
        global_params,
        xs,
        ys,
        plan,
        target,
        lr=lr,
        momentum=momentum,
        proximal_mu=proximal_mu,
        record=chunk == "auto",
    )
    trainer.corrections = _checked_corrections(corrections, trainer, plan.clients)
    out = {n: value.new_empty((plan.clients, *value.shape)) for n, value in trainer.reference.items()}
    losses = np.full(plan.clients, np.nan)
    trained = np.zeros(plan.clients, dtype=bool)
    chunk_size = _chunk_size(chunk, trainer)
    for members, sorted_desc in _groups(plan, schedule, max(chunk_size, 1)):
        trained[members] = _train_group(trainer, members, sorted_desc, out, losses)
    untouched = torch.from_numpy(~trained)
    for n, value in trainer.reference.items():
        if n not in trainer.trainable:
            out[n].copy_(value.expand_as(out[n]))
        elif untouched.any():
            out[n][untouched.to(value.device)] = value
    return VectorisedResult(params=out, losses=losses)


#: Per client, an array or tensor (its examples or labels).
_Arrays = Sequence[np.ndarray | torch.Tensor]
#: Per dropout call of one forward pass, its ``p`` and the shape of one example's input.
_Layers = list[tuple[float, tuple[int, ...]]]
#: One step of the stacked clients: ``(trainable, frozen, reference, x, y, weight, count, masks)`` ->
#: ``(gradients, losses)``.
_StepFn = Callable[..., tuple[dict[str, torch.Tensor], torch.Tensor]]


def _check_arguments(
    model: nn.Module,
    global_params: Mapping[str, torch.Tensor],
    xs: _Arrays,
    ys: _Arrays,
    plan: BatchPlan,
    chunk: int | Literal["auto"] | None,
) -> None:
    """Refuse what :func:`train_vectorised` cannot train, before anything is moved or allocated.

    Parameters
    ----------
    model, global_params, xs, ys, plan, chunk
        :func:`train_vectorised`'s arguments.

    Raises
    ------
    ValueError
        A model :func:`check_model` refuses, ``global_params`` that do not name the model's parameters,
        ``xs`` or ``ys`` for another number of clients than ``plan``'s, a bad ``chunk``, or a model
        with dropout and a plan without dropout seeds.

    """
    check_model(model)
    model_name = type(model).__name__
    names = [name for name, _ in model.named_parameters()]
    if set(global_params) != set(names):
        raise ValueError(
            f"global_params must name {model_name}'s parameters: missing "
            f"{sorted(set(names) - set(global_params))}, unexpected {sorted(set(global_params) - set(names))}"
        )
    if len(xs) != plan.clients or len(ys) != plan.clients:
        raise ValueError(f"{len(xs)} clients' x and {len(ys)} clients' y for a plan of {plan.clients}")
    if chunk is not None and chunk != "auto" and (isinstance(chunk, str) or chunk < 1):
        raise ValueError(f"chunk must be a positive number of clients, 'auto' or None, got {chunk!r}")
    if has_dropout(model) and plan.dropout_seeds is None:
        raise ValueError(
            f"{model_name} has dropout: the plan needs the clients' dropout seeds "
            "(plan_from_generators(..., dropout=True) or plan_batches(..., dropout_seeds=...))"
        )


@dataclass
class _VectorisedTrainer:
    """What every group of clients of one :func:`train_vectorised` call trains with.

    Attributes
    ----------
    plan : BatchPlan
        The cohort's batches.
    model_name : str
        The model's class name (error messages name it).
    target : torch.device
        Where the cohort trains.
    trainable : list[str]
        Names of the parameters SGD updates (``requires_grad``), in the model's order.
    reference : dict[str, torch.Tensor]
        Every parameter's global value (each client's start, the FedProx reference), on ``target``.
    flat_x, flat_y : torch.Tensor or None
        Every client's examples and labels, concatenated in client order, on ``target`` (None when no
        client has examples).
    offsets : np.ndarray
        ``int64 [clients]``: where each client's examples start in ``flat_x``.
    dropout : bool
        Whether the model has ``nn.Dropout`` layers.
    layers : list of (float, tuple of int)
        Per dropout call of one forward pass, its ``p`` and the shape of one example's input.
    activations : int
        Numbers the model's layers output for one example (0 when not measured).
    step_fn : callable
        ``vmap(grad(loss))`` of one step of the stacked clients (:func:`_per_client_loss`).
    lr, momentum : float
        SGD's step size and momentum.
    frozen : dict[str, torch.Tensor]
        The ``reference`` values of the parameters that are not trainable (derived).
    client_steps, counts : np.ndarray, torch.Tensor
        ``plan.client_steps`` and ``plan.counts``, computed once (derived).
    checked : bool
        Whether a step has run (``torch.func`` could transform the forward pass).
    corrections : dict[str, torch.Tensor]
        Every client's gradient correction by trainable parameter, ``[clients, ...]`` (empty: none).

    """

    plan: BatchPlan
    model_name: str
    target: torch.device
    trainable: list[str]
    reference: dict[str, torch.Tensor]
    flat_x: torch.Tensor | None
    flat_y: torch.Tensor | None
    offsets: np.ndarray
    dropout: bool
    layers: _Layers
    activations: int
    step_fn: _StepFn
    lr: float
    momentum: float
    frozen: dict[str, torch.Tensor] = field(init=False)
    client_steps: np.ndarray = field(init=False)
    counts: torch.Tensor = field(init=False)
    checked: bool = False
    corrections: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.frozen = {n: value for n, value in self.reference.items() if n not in self.trainable}
        self.client_steps = self.plan.client_steps
        self.counts = self.plan.counts


def _prepare(
    model: nn.Module,
    global_params: Mapping[str, torch.Tensor],
    xs: _Arrays,
    ys: _Arrays,
    plan: BatchPlan,
    target: torch.device,
    *,
    lr: float,
    momentum: float,
    proximal_mu: float,
    record: bool,
) -> _VectorisedTrainer:
    """What the groups of a cohort share: the global model and inputs on ``target``, the step function.

    Parameters
    ----------
    model, global_params, xs, ys, plan, lr, momentum, proximal_mu
        :func:`train_vectorised`'s arguments, checked (:func:`_check_arguments`).
    target : torch.device
        Where the cohort trains.
    record : bool
        Whether to measure one example's activations (for ``chunk="auto"``).

    Returns
    -------
    _VectorisedTrainer
        The shared state, before any step.

    """
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    reference = {n: global_params[n].detach().to(target) for n, _ in model.named_parameters()}
    flat_x, flat_y, offsets = _flattened_inputs(xs, ys, plan, target)
    step_fn, layers, activations = _step_function(model, reference, flat_x, proximal_mu, record=record)
    return _VectorisedTrainer(
        plan=plan,
        model_name=type(model).__name__,
        target=target,
        trainable=trainable,
        reference=reference,
        flat_x=flat_x,
        flat_y=flat_y,
        offsets=offsets,
        dropout=has_dropout(model),
        layers=layers,
        activations=activations,
        step_fn=step_fn,
        lr=float(lr),
        momentum=float(momentum),
    )


def _checked_corrections(
    corrections: Mapping[str, torch.Tensor] | None, trainer: _VectorisedTrainer, clients: int
) -> dict[str, torch.Tensor]:
    """``corrections`` on the trainer's device (``ValueError`` unless ``[clients, *shape]`` per parameter)."""
    if corrections is None:
        return {}
    if set(corrections) != set(trainer.trainable):
        raise ValueError(f"corrections for {sorted(corrections)}, the model trains {trainer.trainable}")
    out = {}
    for name in trainer.trainable:
        values, like = corrections[name], trainer.reference[name]
        if tuple(values.shape) != (clients, *like.shape):
            raise ValueError(
                f"correction {name!r} has shape {tuple(values.shape)}, not {(clients, *like.shape)}"
            )
        out[name] = values.to(device=trainer.target, dtype=like.dtype)
    return out


def _flattened_inputs(
    xs: _Arrays, ys: _Arrays, plan: BatchPlan, target: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None, np.ndarray]:
    """All clients' examples in one tensor; the plan's local indices are shifted by each client's offset.

    Parameters
    ----------
    xs, ys : Sequence of arrays or tensors
        Per client, its examples (``uint8`` scaled to [0, 1]) and integer labels.
    plan : BatchPlan
        The cohort's batches (``plan.sizes``: each client's number of examples).
    target : torch.device
        Where the cohort trains.

    Returns
    -------
    flat_x, flat_y : torch.Tensor or None
        The examples (float32) and labels (int64) of the clients with examples, in client order, on
        ``target``; None when no client has examples.
    offsets : np.ndarray
        ``int64 [clients]``: where each client's examples start.

    Raises
    ------
    ValueError
        A client with another number of examples or labels than the plan's.

    """
    sizes = plan.sizes
    _check_sizes(xs, ys, sizes)
    nonempty = [c for c in range(plan.clients) if sizes[c] > 0]
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    if not nonempty:
        return None, None, offsets
    # Concatenated as stored (uint8 stays 4x smaller), moved, then converted where the cohort trains.
    if isinstance(xs, ConcatenatedRows) and isinstance(ys, ConcatenatedRows):
        flat_x = _as_inputs(_as_tensor(xs.values[: xs.ends[-1]]).to(target))
        return flat_x, _as_tensor(ys.values[: ys.ends[-1]]).to(target, torch.int64), offsets
    flat_x = _as_inputs(_joined([xs[c] for c in nonempty], target))
    labels = _joined([ys[c] for c in nonempty], target).to(torch.int64)
    return flat_x, labels, offsets


def _check_sizes(xs: _Arrays, ys: _Arrays, sizes: np.ndarray) -> None:
    """``ValueError`` unless every client has as many examples and labels as the plan says."""
    if isinstance(xs, ConcatenatedRows) and isinstance(ys, ConcatenatedRows):
        x_sizes, y_sizes = np.diff(xs.ends, prepend=0), np.diff(ys.ends, prepend=0)
    else:
        x_sizes, y_sizes = np.asarray([len(x) for x in xs]), np.asarray([len(y) for y in ys])
    if len(x_sizes) != len(sizes) or len(y_sizes) != len(sizes):
        raise ValueError(f"{len(x_sizes)} clients' examples and {len(y_sizes)} labels, the plan {len(sizes)}")
    wrong = np.flatnonzero((x_sizes != sizes) | (y_sizes != sizes))
    if wrong.size:
        c = int(wrong[0])
        raise ValueError(f"client {c}: {x_sizes[c]} examples and {y_sizes[c]} labels, the plan {sizes[c]}")


def _joined(arrays: Sequence[np.ndarray | torch.Tensor], target: torch.device) -> torch.Tensor:
    """The clients' arrays as one tensor on ``target`` (uint8 kept; a mixture converted to float32)."""
    raw = [_as_tensor(a) for a in arrays]
    if len({t.dtype for t in raw}) > 1:
        raw = [_as_inputs(t) for t in raw]
    return _concatenated(raw, target)


def _concatenated(tensors: Sequence[torch.Tensor], target: torch.device) -> torch.Tensor:
    """``tensors`` concatenated on ``target`` (with one transfer when they share a device)."""
    if len({t.device for t in tensors}) == 1:
        return torch.cat(list(tensors)).to(target)
    return torch.cat([t.to(target) for t in tensors])


def _as_tensor(values: np.ndarray | torch.Tensor) -> torch.Tensor:
    """``values`` as a tensor where it is (a numpy array shares its memory)."""
    return values if isinstance(values, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(values))


def _step_function(
    model: nn.Module,
    reference: dict[str, torch.Tensor],
    flat_x: torch.Tensor | None,
    proximal_mu: float,
    *,
    record: bool,
) -> tuple[_StepFn, _Layers, int]:
    """``vmap(grad(loss))`` of one step, and what one example's forward pass records.

    Parameters
    ----------
    model : nn.Module
        The architecture (a model with dropout is copied: its ``nn.Dropout`` layers take given masks).
    reference : dict[str, torch.Tensor]
        Every parameter's global value, in the model's order.
    flat_x : torch.Tensor or None
        The cohort's examples (the first one goes through the model); None: nothing is recorded.
    proximal_mu : float
        The FedProx coefficient.
    record : bool
        Whether to measure one example's activations (always done for a model with dropout).

    Returns
    -------
    step_fn : callable
        Of the stacked trainable parameters, the frozen ones, the reference and the step's stacked
        inputs: the gradients and the losses (:func:`_per_client_loss`).
    layers : list of (float, tuple of int)
        The dropout layers' calls (``p`` and one example's shape), empty when nothing was recorded.
    activations : int
        Numbers the model's layers output for one example (0 when nothing was recorded).

    """
    dropout = has_dropout(model)
    source = _MaskSource()
    module = _with_given_masks(model, source) if dropout else model
    layers: _Layers = []
    activations = 0
    if flat_x is not None and (dropout or record):
        # One example through the model: the dropout layers' calls and shapes, the activations' size.
        source.recording = layers
        activations = activation_numel(module, dict(reference), flat_x[:1])
        source.recording = None
    step_fn = vmap(
        grad(_per_client_loss(module, source, list(reference), float(proximal_mu)), argnums=0, has_aux=True),
        in_dims=(0, None, None, 0, 0, 0, 0, 0),
    )
    return step_fn, layers, activations


def _chunk_size(chunk: int | Literal["auto"] | None, trainer: _VectorisedTrainer) -> int:
    """Clients per group: ``chunk``, all of them (None), or :func:`auto_chunk`'s choice ("auto").

    Parameters
    ----------
    chunk : int, "auto" or None
        :func:`train_vectorised`'s argument.
    trainer : _VectorisedTrainer
        The cohort (its plan, model size, activations and device).

    Returns
    -------
    int
        Clients trained at once.

    """
    plan = trainer.plan
    if chunk == "auto":
        parameters = sum(trainer.reference[n].numel() for n in trainer.trainable)
        return auto_chunk(parameters, trainer.activations, plan.batch_size, trainer.target)
    return plan.clients if chunk is None else int(chunk)


@dataclass
class _Group:
    """Clients trained together: their batches, parameters, momentum buffers and summed losses, stacked.

    Attributes
    ----------
    members : torch.Tensor
        ``int64 [k]``: the clients (positions in the cohort).
    steps : np.ndarray
        ``int64 [k]``: each member's number of steps.
    sorted_desc : bool
        Whether ``members`` are sorted by steps, longest first (the active ones are a prefix).
    index : torch.Tensor
        ``int64 [k, steps, batch_size]``: the batches' rows of the cohort's flattened inputs.
    weight, count : torch.Tensor
        ``float32 [k, steps, batch_size]`` and ``[k, steps]``: which entries are real examples, and
        how many (at least 1).
    params, buffers : dict[str, torch.Tensor]
        The members' trainable parameters and momentum buffers (none without momentum), ``[k, ...]``.
    total : torch.Tensor
        ``float64 [k]``: the members' summed losses.
    generators : list[torch.Generator]
        The members' dropout generators (empty for a model without dropout).
    corrections : dict[str, torch.Tensor]
        The members' gradient corrections, ``[k, ...]`` (empty: none).

    """

    members: torch.Tensor
    steps: np.ndarray
    sorted_desc: bool
    index: torch.Tensor
    weight: torch.Tensor
    count: torch.Tensor
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    total: torch.Tensor
    generators: list[torch.Generator]
    corrections: dict[str, torch.Tensor] = field(default_factory=dict)
    #: Per step, the most real examples any member's batch has (the batch is cut to that width).
    widths: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


def _train_group(
    trainer: _VectorisedTrainer,
    members: np.ndarray,
    sorted_desc: bool,
    out: dict[str, torch.Tensor],
    losses: np.ndarray,
) -> bool:
    """Train one group of clients from the global model; write their parameters and losses.

    Parameters
    ----------
    trainer : _VectorisedTrainer
        The cohort.
    members : np.ndarray
        ``int64``: the group's clients (a :func:`_groups` entry).
    sorted_desc : bool
        Whether they are sorted by steps, longest first.
    out : dict[str, torch.Tensor]
        Every client's parameters, stacked; the members' rows of the trainable ones are written.
    losses : np.ndarray
        Every client's mean loss; the members' entries are set (NaN for a client without a step).

    Returns
    -------
    bool
        Whether the members' rows were written (False: no member takes a step).

    """
    group_steps = trainer.client_steps[members]
    if len(members) == 0 or group_steps.max() == 0:
        return False
    group = _stack_group(trainer, members, sorted_desc)
    for step in range(int(group_steps.max())):
        _train_step(trainer, group, step)
    mean = (group.total / torch.from_numpy(group_steps).to(trainer.target)).cpu().numpy()
    for n in trainer.trainable:
        out[n][group.members] = group.params[n].to(out[n].device)
    losses[members] = np.where(group_steps > 0, mean, np.nan)
    return True


def _stack_group(trainer: _VectorisedTrainer, members: np.ndarray, sorted_desc: bool) -> _Group:
    """The group's batches, its members' parameters (the global model's) and fresh buffers, on the target.

    Parameters
    ----------
    trainer : _VectorisedTrainer
        The cohort.
    members : np.ndarray
        ``int64``: the group's clients.
    sorted_desc : bool
        Whether they are sorted by steps, longest first.

    Returns
    -------
    _Group
        The group before its first step.

    """
    plan, target = trainer.plan, trainer.target
    members_t = torch.from_numpy(members)
    real = plan.example_mask[members_t]
    # Padded entries point at example 0 of the cohort (a real row; its loss is weighted 0).
    shift = torch.from_numpy(trainer.offsets[members])[:, None, None]
    index = torch.where(real, plan.index[members_t] + shift, 0).to(target)
    weight = real.to(device=target, dtype=torch.float32)
    real_counts = trainer.counts[members_t]
    widths = real_counts.max(dim=0).values.clamp(min=1).numpy() if len(members) else np.zeros(0, np.int64)
    count = real_counts.clamp(min=1).to(device=target, dtype=torch.float32)
    params = {
        n: trainer.reference[n].unsqueeze(0).expand(len(members), *trainer.reference[n].shape).clone()
        for n in trainer.trainable
    }
    return _Group(
        members=members_t,
        steps=trainer.client_steps[members],
        sorted_desc=sorted_desc,
        index=index,
        weight=weight,
        count=count,
        widths=widths,
        params=params,
        buffers={n: torch.zeros_like(params[n]) for n in trainer.trainable} if trainer.momentum != 0 else {},
        total=torch.zeros(len(members), dtype=torch.float64, device=target),
        generators=_dropout_generators(trainer, members),
        corrections={n: values[members_t.to(values.device)] for n, values in trainer.corrections.items()},
    )


def _dropout_generators(trainer: _VectorisedTrainer, members: np.ndarray) -> list[torch.Generator]:
    """The members' dropout generators, seeded from the plan.

    Parameters
    ----------
    trainer : _VectorisedTrainer
        The cohort.
    members : np.ndarray
        ``int64``: the group's clients.

    Returns
    -------
    list[torch.Generator]
        One CPU generator per member (seed 0 for a client without examples); empty without dropout.

    """
    seeds = trainer.plan.dropout_seeds
    if not trainer.dropout or seeds is None:
        return []
    return [torch.Generator().manual_seed(int(seeds[c] or 0)) for c in members.tolist()]


def _train_step(trainer: _VectorisedTrainer, group: _Group, step: int) -> None:
    """The group's ``step``-th step: every member that still has a step takes it, in one computation.

    Parameters
    ----------
    trainer : _VectorisedTrainer
        The cohort.
    group : _Group
        The group; its parameters, buffers and summed losses are updated in place.
    step : int
        The step (from 0).

    """
    active_np = group.steps > step
    if group.sorted_desc:
        # Longest first: the clients with a step are a prefix; the others are simply not computed.
        width, valid = int(active_np.sum()), None
    else:
        width = len(group.members)
        valid = None if active_np.all() else torch.from_numpy(active_np).to(trainer.target)
    # the batch cut to the widest real batch of the step: the columns after it are padding only
    # (weight 0), so small clients do not pay for batch_size rows each
    cut = int(group.widths[step])
    rows = group.index[:width, step, :cut]
    masks: tuple[torch.Tensor, ...] = ()
    if trainer.dropout:
        counts = trainer.counts[group.members[:width], step]
        masks = _stacked_masks(group.generators[:width], trainer.layers, counts, trainer.plan, trainer.target)
        masks = tuple(mask[:, :cut] for mask in masks)
    current = {n: group.params[n][:width] for n in trainer.trainable}
    grads, loss = _step_gradients(
        trainer, current, rows, group.weight[:width, step, :cut], group.count[:width, step], masks
    )
    for name, shift in group.corrections.items():
        grads[name] = grads[name] + shift[:width]
    _sgd_update(current, group.buffers, grads, width, lr=trainer.lr, momentum=trainer.momentum, valid=valid)
    group.total[:width] += loss.double() if valid is None else torch.where(valid, loss.double(), 0.0)


def _step_gradients(
    trainer: _VectorisedTrainer,
    current: dict[str, torch.Tensor],
    rows: torch.Tensor,
    weight: torch.Tensor,
    count: torch.Tensor,
    masks: tuple[torch.Tensor, ...],
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The active clients' gradients and losses of one step (``trainer.step_fn``).

    Parameters
    ----------
    trainer : _VectorisedTrainer
        The cohort (its step function, frozen parameters, reference and flattened inputs).
    current : dict[str, torch.Tensor]
        The active clients' trainable parameters, ``[width, ...]``.
    rows : torch.Tensor
        ``int64 [width, batch_size]``: their batches' rows of the flattened inputs.
    weight, count, masks : torch.Tensor, torch.Tensor, tuple of torch.Tensor
        Which entries are real examples, how many, and the dropout masks (empty without dropout).

    Returns
    -------
    tuple of (dict[str, torch.Tensor], torch.Tensor)
        The gradients, stacked as ``current``, and the ``[width]`` losses.

    Raises
    ------
    ValueError
        On the cohort's first step, when ``torch.func`` cannot transform the model's forward pass.

    """
    try:
        grads, loss = trainer.step_fn(
            current, trainer.frozen, trainer.reference, trainer.flat_x[rows], trainer.flat_y[rows], weight,
            count, masks,
        )  # fmt: skip
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as error:
        if trainer.checked:
            raise
        raise ValueError(
            f"{trainer.model_name} cannot be trained as a cohort by torch.func: {error}"
        ) from error
    trainer.checked = True
    return grads, loss


def activation_numel(module: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor) -> int:
    """Numbers the leaf modules of ``module`` output for the one example ``x`` (forward, no grad)."""
    total = 0

    def count(_module: nn.Module, _inputs: object, output: object) -> None:
        nonlocal total
        if isinstance(output, torch.Tensor):
            total += output.numel()

    leaves = [m for m in module.modules() if next(m.children(), None) is None]
    handles = [m.register_forward_hook(count) for m in leaves]
    try:
        with torch.no_grad():
            functional_call(module, params, (x,))
    finally:
        for handle in handles:
            handle.remove()
    return total


#: ``chunk="auto"`` on the CPU: clients whose one step's activations take about this many bytes. The
#: CPU is compute-bound and a chunk whose working set stays near the caches is fastest: measured optima
#: 4 clients of the CNN (5.6 MB of activations each at batch 32) and 32 to 160 of the MLP (0.15 MB).
CPU_STEP_BYTES = 24 * 2**20
#: ``chunk="auto"`` on CUDA: the share of the free device memory a chunk may plan to use.
CUDA_MEMORY_SHARE = 0.25


def auto_chunk(parameters: int, activations: int, batch_size: int, device: torch.device) -> int:
    """Clients per chunk for ``chunk="auto"``.

    On the CPU: as many clients as fit :data:`CPU_STEP_BYTES` of one step's activations (at least 1).
    On CUDA: as many as fit :data:`CUDA_MEMORY_SHARE` of the free memory, counting per client 3 copies
    of the parameters (values, gradients, momentum) and 3 of one step's activations (outputs saved
    for the backward pass, their gradients, temporaries), in float32. The CUDA rule is an estimate
    that has not been measured on a device yet.

    Parameters
    ----------
    parameters : int
        Trainable parameters of the model.
    activations : int
        Numbers the model's layers output for one example.
    batch_size : int
        Examples per step.
    device : torch.device
        Where the cohort trains.

    Returns
    -------
    int
        Clients per chunk (at least 1).

    """
    step = 4 * max(activations, 1) * batch_size
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return max(1, int(CUDA_MEMORY_SHARE * free) // (3 * 4 * parameters + 3 * step))
    return max(1, CPU_STEP_BYTES // step)


def _stacked_masks(
    generators: Sequence[torch.Generator],
    layers: Sequence[tuple[float, tuple[int, ...]]],
    counts: torch.Tensor,
    plan: BatchPlan,
    device: torch.device,
) -> tuple[torch.Tensor, ...]:
    """The active clients' dropout masks of one step, ``[clients, batch_size, *shape]`` per layer call."""
    stacked = [torch.zeros((len(generators), plan.batch_size, *shape)) for _, shape in layers]
    for row, (generator, rows) in enumerate(zip(generators, counts.tolist(), strict=True)):
        if rows == 0:
            continue
        for target, mask in zip(stacked, _draw_masks(generator, layers, rows), strict=True):
            target[row, :rows] = mask
    return tuple(mask.to(device) for mask in stacked)


@torch.no_grad()
def _sgd_update(
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    width: int,
    *,
    lr: float,
    momentum: float,
    valid: torch.Tensor | None,
) -> None:
    """``torch.optim.SGD``'s step on the stacked parameters (views of the first ``width`` clients).

    A momentum buffer starts at zero, so its first update ``0 * momentum + g`` is ``g``, as
    ``torch.optim.SGD``'s clone. Clients with ``valid`` False keep their parameters and buffers.
    """
    names = list(grads)
    targets = [params[n] for n in names]
    steps = [grads[n] for n in names]
    if momentum != 0:
        current = [buffers[n][:width] for n in names]
        if valid is None:
            torch._foreach_mul_(current, momentum)
            torch._foreach_add_(current, steps)
            steps = current
        else:
            updated = torch._foreach_add(torch._foreach_mul(current, momentum), steps)
            for buffer, new in zip(current, updated, strict=True):
                buffer.copy_(torch.where(_expand(valid, new), new, buffer))
            steps = current
    if valid is None:
        torch._foreach_add_(targets, steps, alpha=-lr)
    else:
        for target, step in zip(targets, steps, strict=True):
            target.copy_(torch.where(_expand(valid, step), target.add(step, alpha=-lr), target))


def _expand(valid: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``valid [clients]`` shaped to broadcast against a stacked ``[clients, ...]`` tensor."""
    return valid.reshape(-1, *([1] * (like.dim() - 1)))


def stack_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s parameters by name, detached (a ``global_params`` for :func:`train_vectorised`)."""
    return {name: parameter.detach().clone() for name, parameter in model.named_parameters()}


__all__ = [
    "CPU_STEP_BYTES",
    "SCHEDULES",
    "BatchPlan",
    "VectorisedResult",
    "activation_numel",
    "auto_chunk",
    "check_model",
    "client_step_count",
    "has_dropout",
    "plan_batches",
    "plan_from_generators",
    "stack_params",
    "train_vectorised",
]
