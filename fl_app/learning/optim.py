"""Stochastic gradient descent and Adam without ``torch.optim``.

:class:`SGD` computes exactly what ``torch.optim.SGD(params, lr=lr, momentum=momentum)`` computes
on CPU tensors (its single-tensor path: no weight decay, dampening 0, no Nesterov), :class:`Adam`
what ``torch.optim.Adam(params, lr=lr, betas=betas, eps=eps)`` computes (its single-tensor path:
no weight decay, no AMSGrad), bit for bit (``tests/test_results_models.py``). Why not
``torch.optim``: its ``Optimizer`` methods are wrapped in
``torch._disable_dynamo``, whose first call imports ``torch._dynamo``, 1.6 s of CPU here. Every Ray
actor of a simulation and every ClientApp process of a deployment (Flower starts one per message)
paid it before its first training step.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


class ParameterOptimizer:
    """What :class:`SGD` and :class:`Adam` share: the parameters, ``zero_grad`` and the step loop.

    ``step()`` calls :meth:`update` for every parameter that has a gradient, in order, with its index.
    """

    def __init__(self, params: Iterable[torch.Tensor], *, lr: float) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        self.params = list(params)
        self.lr = float(lr)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every parameter's gradient (``None``, or zeros with ``set_to_none=False``)."""
        for parameter in self.params:
            if parameter.grad is None:
                continue
            if set_to_none:
                parameter.grad = None
            else:
                parameter.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One update of every parameter that has a gradient."""
        for index, parameter in enumerate(self.params):
            if parameter.grad is not None:
                self.update(index, parameter, parameter.grad)

    @torch.no_grad()
    def apply(self, grads: Sequence[torch.Tensor | None]) -> None:
        """:meth:`step` with the gradients given, one per parameter in order (None: no gradient).

        What a loop that takes its gradients from ``torch.autograd.grad`` steps with: the same update
        as ``step()`` after ``backward()`` with these as the parameters' ``.grad``.
        """
        for index, parameter, grad in self._given(grads):
            self.update(index, parameter, grad)

    def _given(self, grads: Sequence[torch.Tensor | None]) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        """The parameters that have a gradient in ``grads``, with their index (``ValueError``: a miscount)."""
        if len(grads) != len(self.params):
            raise ValueError(f"{len(grads)} gradients for {len(self.params)} parameters")
        return [(i, p, g) for i, (p, g) in enumerate(zip(self.params, grads, strict=True)) if g is not None]

    def update(self, index: int, parameter: torch.Tensor, grad: torch.Tensor) -> None:
        """Change ``parameter`` (the ``index``-th) in place by its gradient ``grad``."""
        raise NotImplementedError


class SGD(ParameterOptimizer):
    """Mini-batch SGD with optional heavy-ball momentum (``torch.optim.SGD``'s update rule).

    ``step()``: for every parameter with a gradient ``g``, ``b <- g`` on the first step and
    ``b <- momentum * b + g`` after it (when ``momentum != 0``, else ``b = g``), then
    ``p <- p - lr * b``.
    """

    def __init__(self, params: Iterable[torch.Tensor], *, lr: float, momentum: float = 0.0) -> None:
        super().__init__(params, lr=lr)
        if not momentum >= 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        self.momentum = float(momentum)
        self.momentum_buffers: list[torch.Tensor | None] = [None] * len(self.params)

    @torch.no_grad()
    def apply(self, grads: Sequence[torch.Tensor | None]) -> None:
        """:meth:`ParameterOptimizer.apply`; without momentum, one ``torch._foreach_add_`` for all.

        ``p.add_(g, alpha=-lr)`` per parameter and the fused call compute the same values bit for bit
        (``tests/test_results_models.py``); the fused one dispatches once per step, not per parameter.
        """
        if self.momentum != 0:
            super().apply(grads)
            return
        given = self._given(grads)
        if given:
            torch._foreach_add_([p for _, p, _ in given], [g for _, _, g in given], alpha=-self.lr)

    def update(self, index: int, parameter: torch.Tensor, grad: torch.Tensor) -> None:
        """``p <- p - lr * b`` with ``b`` the momentum buffer (or ``g`` without momentum)."""
        if self.momentum != 0:
            buffer = self.momentum_buffers[index]
            if buffer is None:
                buffer = grad.detach().clone()
                self.momentum_buffers[index] = buffer
            else:
                buffer.mul_(self.momentum).add_(grad, alpha=1)
            grad = buffer
        parameter.add_(grad, alpha=-self.lr)


@dataclass
class AdamMoments:
    """One parameter's Adam state: how many steps it took and its two moment estimates."""

    step: float
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


class Adam(ParameterOptimizer):
    """Adam (Kingma and Ba, ICLR 2015) with ``torch.optim.Adam``'s update rule.

    ``step()``: for every parameter with a gradient ``g``, ``t <- t + 1``,
    ``m <- lerp(m, g, 1 - beta1)``, ``v <- beta2 * v + (1 - beta2) * g * g``, then
    ``p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)``.
    :attr:`state` maps a parameter's index to its :class:`AdamMoments` once it has been stepped; a
    caller may set it to resume from saved moments.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
    ) -> None:
        super().__init__(params, lr=lr)
        if not all(0.0 <= beta < 1.0 for beta in betas):
            raise ValueError(f"Invalid beta parameters: {betas}")
        self.beta1, self.beta2 = (float(beta) for beta in betas)
        self.eps = float(eps)
        self.state: dict[int, AdamMoments] = {}

    def update(self, index: int, parameter: torch.Tensor, grad: torch.Tensor) -> None:
        """One Adam step of ``parameter`` (its moments start at zero on its first step)."""
        moments = self.state.get(index)
        if moments is None:
            zeros = torch.zeros_like(parameter, memory_format=torch.preserve_format)
            moments = self.state[index] = AdamMoments(0.0, zeros, zeros.clone())
        moments.step += 1.0  # torch.optim's float32 count: exact below 2**24 steps
        moments.exp_avg.lerp_(grad, 1 - self.beta1)
        moments.exp_avg_sq.mul_(self.beta2).addcmul_(grad, grad, value=1 - self.beta2)
        step_size = self.lr / (1 - self.beta1**moments.step)
        denom = (moments.exp_avg_sq.sqrt() / (1 - self.beta2**moments.step) ** 0.5).add_(self.eps)
        parameter.addcdiv_(moments.exp_avg, denom, value=-step_size)
