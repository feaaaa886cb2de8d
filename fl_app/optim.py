"""Stochastic gradient descent without ``torch.optim``.

:class:`SGD` computes exactly what ``torch.optim.SGD(params, lr=lr, momentum=momentum)`` computes
on CPU tensors (its single-tensor path: no weight decay, dampening 0, no Nesterov; bit for bit,
``tests/test_results_models.py``). Why not ``torch.optim``: its ``Optimizer`` methods are wrapped in
``torch._disable_dynamo``, whose first call imports ``torch._dynamo``, 1.6 s of CPU here. Every Ray
actor of a simulation and every ClientApp process of a deployment (Flower starts one per message)
paid it before its first training step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class SGD:
    """Mini-batch SGD with optional heavy-ball momentum (``torch.optim.SGD``'s update rule).

    ``step()``: for every parameter with a gradient ``g``, ``b <- g`` on the first step and
    ``b <- momentum * b + g`` after it (when ``momentum != 0``, else ``b = g``), then
    ``p <- p - lr * b``.
    """

    def __init__(self, params: Iterable[torch.Tensor], *, lr: float, momentum: float = 0.0) -> None:
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not momentum >= 0.0:
            raise ValueError(f"Invalid momentum value: {momentum}")
        self.params = list(params)
        self.lr = float(lr)
        self.momentum = float(momentum)
        self.momentum_buffers: list[torch.Tensor | None] = [None] * len(self.params)

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
            grad = parameter.grad
            if grad is None:
                continue
            if self.momentum != 0:
                buffer = self.momentum_buffers[index]
                if buffer is None:
                    buffer = grad.detach().clone()
                    self.momentum_buffers[index] = buffer
                else:
                    buffer.mul_(self.momentum).add_(grad, alpha=1)
                grad = buffer
            parameter.add_(grad, alpha=-self.lr)
