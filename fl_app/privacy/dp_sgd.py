"""DP-SGD: Poisson-sampled mini-batches, per-example clipping, Gaussian noise.

Abadi, Chu, Goodfellow, McMahan, Mironov, Talwar, Zhang, "Deep Learning with
Differential Privacy", CCS 2016 (Algorithm 1), with Poisson sampling and the
fixed denominator of Opacus. Every step of :func:`dp_sgd_train`:

1. each of the ``n`` examples joins the batch independently with probability
   ``q`` (``sampling_rate``), drawn from the explicit ``rng``;
2. per-example gradients ``g_i`` of the cross-entropy loss
   (:func:`per_example_gradients`, ``torch.func.vmap`` over ``grad``);
3. clipping of each example's gradient over all parameters jointly:
   ``g_i <- g_i min(1, C / ||g_i||)`` (:func:`clipped_gradient_sum`);
4. the noisy mean ``(sum_i g_i + N(0, z^2 C^2 I)) / (q n)``: the denominator is
   the *expected* batch size, a constant, so the L2 sensitivity of the released
   sum to adding or removing one example is ``C``;
5. an SGD step (momentum is post-processing).

Privacy: each step is the sampled Gaussian mechanism with noise multiplier
``z`` and rate ``q`` for the add-or-remove-one-example relation on the data
set it is run on; ``steps`` steps are ``steps`` uses of
:class:`~fl_app.privacy.events.SampledGaussian` ``(z, q)`` (or of
:class:`~fl_app.privacy.events.Gaussian` ``(z)`` when ``q = 1``), which is
what the caller records with the accountant (:func:`dp_sgd_mechanism`).
``n`` is treated as public, so ``q`` and ``steps`` are constants of the
mechanism. The only outputs are the model parameters: losses and norms that
the loop sees are not private and are returned for local diagnostics only.

Amplification by sampling needs the sampling to be secret: pass a generator
for privacy noise (OS entropy on real devices), not the seeded data-order one.
Models whose forward pass mixes examples (batch normalisation) are refused: a
per-example gradient would not exist.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn import functional as F  # noqa: N812 - the conventional name

from fl_app.learning.optim import SGD
from fl_app.learning.sequence import next_token_task, token_tensor
from fl_app.privacy.events import Gaussian, Mechanism, SampledGaussian
from fl_app.privacy.mechanisms import gaussian_mechanism

#: Examples per vectorised per-example-gradient call (bounds memory: chunk x parameters floats).
DEFAULT_CHUNK = 256
#: Relative safety margin on the clipping factors against floating-point rounding of the norms.
CLIP_MARGIN = 1e-4


@dataclass(frozen=True)
class DPSGDStats:
    """What one :func:`dp_sgd_train` call did (local diagnostics, *not* private).

    Attributes
    ----------
    steps : int
        Noisy steps taken.
    mean_batch : float
        Average number of examples Poisson sampling put in a batch.
    mean_loss : float
        Mean loss over the sampled batches (nan when every batch was empty).
    clipped_fraction : float
        Share of per-example gradients whose norm exceeded ``C``.

    """

    steps: int
    mean_batch: float
    mean_loss: float
    clipped_fraction: float


def dp_sgd_mechanism(*, noise_multiplier: float, sampling_rate: float) -> Mechanism:
    """The descriptor the accountant composes for one DP-SGD step."""
    if sampling_rate == 1.0:
        return Gaussian(noise_multiplier)
    return SampledGaussian(noise_multiplier, sampling_rate)


def _check_model(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise ValueError(
                f"DP-SGD needs per-example gradients; {type(module).__name__} mixes examples in a batch"
            )


def per_example_gradients(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, chunk: int = DEFAULT_CHUNK
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Gradient of the cross-entropy loss of every example separately.

    Parameters
    ----------
    model : nn.Module
        The network (its parameters are read, not changed).
    x, y : torch.Tensor
        A batch of inputs and integer labels.
    chunk : int
        Examples per vectorised call.

    Returns
    -------
    tuple[list[torch.Tensor], torch.Tensor]
        One tensor per parameter (in ``model.parameters()`` order) of shape
        ``(batch, *parameter.shape)``, and the per-example losses.

    """
    _check_model(model)
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk!r}")
    names = [name for name, _ in model.named_parameters()]
    params = {name: p.detach() for name, p in model.named_parameters()}
    buffers = {name: b.detach() for name, b in model.named_buffers()}

    task = next_token_task(model)  # a next-token network: one example is one sequence, its task's loss

    def loss_of(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        logits = functional_call(model, (p, buffers), (xi.unsqueeze(0),))
        if task is not None:
            return task.loss(logits, yi.unsqueeze(0))
        return F.cross_entropy(logits, yi.unsqueeze(0))

    batched = vmap(grad_and_value(loss_of), in_dims=(None, 0, 0))
    grads: list[list[torch.Tensor]] = [[] for _ in names]
    losses = []
    for start in range(0, len(y), chunk):
        part, loss = batched(params, x[start : start + chunk], y[start : start + chunk])
        for i, name in enumerate(names):
            grads[i].append(part[name])
        losses.append(loss)
    if not losses:
        return [torch.zeros((0, *p.shape)) for p in params.values()], torch.zeros(0)
    # one chunk (a batch of at most ``chunk`` examples): its tensors as they are, not a copy by torch.cat
    return [g[0] if len(g) == 1 else torch.cat(g) for g in grads], torch.cat(losses)


def clipped_gradient_sum(
    per_example: Sequence[torch.Tensor], *, clip: float
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Clip every example's gradient to joint L2 norm ``clip`` and sum over the batch.

    Norms are computed in the gradients' precision (float32: relative error
    about 1e-6 with PyTorch's pairwise summation); the clipping factors are
    reduced by a relative :data:`CLIP_MARGIN` (1e-4) so that rounding can never
    let a clipped gradient's norm exceed ``clip``. Returns the summed clipped
    gradients (one float64 tensor per parameter) and the per-example norms
    before clipping.
    """
    if not (math.isfinite(clip) and clip > 0):
        raise ValueError(f"clip must be a finite number > 0, got {clip!r}")
    batch = per_example[0].shape[0]
    squared = torch.zeros(batch, dtype=torch.float64)
    for g in per_example:
        squared += torch.linalg.vector_norm(g.reshape(batch, -1), dim=1).double().square()
    norms = squared.sqrt()
    factors = torch.clamp(clip / torch.clamp(norms, min=1e-300), max=1.0) * (1.0 - CLIP_MARGIN)
    summed = [torch.tensordot(factors.to(g.dtype), g, dims=1).to(torch.float64) for g in per_example]
    return summed, norms


def dp_sgd_train(
    model: nn.Module,
    x: np.ndarray,
    y: np.ndarray,
    *,
    noise_multiplier: float,
    clip: float,
    sampling_rate: float,
    steps: int,
    lr: float,
    rng: np.random.Generator,
    momentum: float = 0.0,
    chunk: int = DEFAULT_CHUNK,
) -> DPSGDStats:
    """Train ``model`` in place with ``steps`` DP-SGD steps (see the module docstring).

    Parameters
    ----------
    model : nn.Module
        The network to train (no batch normalisation).
    x, y : np.ndarray
        The private examples (``uint8`` images are scaled to [0, 1]) and labels.
    noise_multiplier : float
        ``z > 0``: noise std on the clipped sum is ``z * clip``.
    clip : float
        ``C > 0``: per-example L2 bound.
    sampling_rate : float
        ``q`` in (0, 1]: Poisson sampling probability of every example per step.
    steps : int
        Number of noisy steps (>= 1).
    lr : float
        Learning rate (> 0).
    rng : np.random.Generator
        Privacy randomness: batch sampling and Gaussian noise.
    momentum : float
        SGD momentum in [0, 1).
    chunk : int
        Examples per vectorised per-example-gradient call.

    Returns
    -------
    DPSGDStats
        Local diagnostics (not differentially private: do not send them).

    """
    _check_mechanism(rng, noise_multiplier, sampling_rate, steps)
    _check_training(model, x, y, lr, momentum)
    count = len(y)
    inputs, targets = _as_tensors(x, y)
    optimizer = SGD(list(model.parameters()), lr=lr, momentum=momentum)
    sigma, denominator = noise_multiplier * clip, sampling_rate * count
    model.train()
    tally = _Tally()
    for _ in range(int(steps)):
        rows = np.flatnonzero(rng.random(count) < sampling_rate)
        summed = _clipped_batch_sum(model, inputs, targets, rows, clip=clip, chunk=chunk, tally=tally)
        optimizer.zero_grad(set_to_none=True)
        _set_noisy_gradients(optimizer.params, summed, sigma=sigma, denominator=denominator, rng=rng)
        optimizer.step()
    return tally.stats(int(steps))


def _check_mechanism(
    rng: np.random.Generator, noise_multiplier: float, sampling_rate: float, steps: int
) -> None:
    """Refuse a privacy generator, noise multiplier, sampling rate or step count outside its range."""
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")
    if not (isinstance(noise_multiplier, int | float) and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier must be a finite number > 0, got {noise_multiplier!r}")
    if noise_multiplier <= 0:
        raise ValueError(f"noise_multiplier must be a finite number > 0, got {noise_multiplier!r}")
    if not 0.0 < sampling_rate <= 1.0:
        raise ValueError(f"sampling_rate must be in (0, 1], got {sampling_rate!r}")
    if isinstance(steps, bool) or int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")


def _check_training(model: nn.Module, x: np.ndarray, y: np.ndarray, lr: float, momentum: float) -> None:
    """Refuse a learning rate, momentum, data set or model that DP-SGD cannot train with."""
    if not (math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
    count = len(y)
    if count < 1 or len(x) != count:
        raise ValueError(f"need at least one example and as many inputs as labels, got {len(x)}, {count}")
    _check_model(model)


def _as_tensors(x: np.ndarray, y: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """The examples as model inputs (``uint8`` scaled to [0, 1]) and the labels as int64."""
    from fl_app.learning.training import (
        to_tensor,  # local import: fl_app.learning.training imports no privacy code
    )

    if x.dtype != np.uint8 and np.issubdtype(x.dtype, np.integer):  # token ids of a next-token network
        return token_tensor(x), torch.from_numpy(np.asarray(y, dtype=np.int64))
    return to_tensor(x), torch.from_numpy(np.asarray(y, dtype=np.int64))


@dataclass
class _Tally:
    """Running local diagnostics of one :func:`dp_sgd_train` call (*not* private)."""

    batch_sizes: list[int] = field(default_factory=list)
    loss_sum: float = 0.0
    clipped: int = 0
    seen: int = 0

    def stats(self, steps: int) -> DPSGDStats:
        """The diagnostics of ``steps`` steps."""
        return DPSGDStats(
            steps=steps,
            mean_batch=float(np.mean(self.batch_sizes)),
            mean_loss=self.loss_sum / self.seen if self.seen else math.nan,
            clipped_fraction=self.clipped / self.seen if self.seen else math.nan,
        )


def _clipped_batch_sum(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    rows: np.ndarray,
    *,
    clip: float,
    chunk: int,
    tally: _Tally,
) -> list[torch.Tensor]:
    """Sum of the clipped per-example gradients of the batch ``rows`` (float64, one per parameter).

    Clips and sums ``chunk`` examples at a time (bounded memory) and adds the
    batch's size, losses and clipped count to ``tally``.
    """
    tally.batch_sizes.append(len(rows))
    summed = [torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()]
    for start in range(0, len(rows), chunk):
        index = torch.from_numpy(rows[start : start + chunk])
        grads, losses = per_example_gradients(model, inputs[index], targets[index], chunk=chunk)
        part, norms = clipped_gradient_sum(grads, clip=clip)
        summed = [total + piece for total, piece in zip(summed, part, strict=True)]
        tally.loss_sum += float(losses.sum())
        tally.clipped += int((norms > clip).sum())
        tally.seen += len(index)
    return summed


def _set_noisy_gradients(
    parameters: Sequence[torch.Tensor],
    summed: Sequence[torch.Tensor],
    *,
    sigma: float,
    denominator: float,
    rng: np.random.Generator,
) -> None:
    """Set every parameter's gradient to its noisy clipped sum ``(sum + N(0, sigma^2)) / denominator``."""
    for p, total in zip(parameters, summed, strict=True):
        noisy = gaussian_mechanism(values=total.numpy(), sigma=sigma, rng=rng)
        p.grad = torch.from_numpy(np.asarray(noisy / denominator)).to(p.dtype)
