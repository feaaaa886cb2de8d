"""One forward pass of a data set's example through a network, its failure as one line."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def forward_probe(network: nn.Module, batch: torch.Tensor, name: str, takes: str) -> Any:
    """``network``'s output for ``batch`` in eval mode, without gradients.

    ``ValueError`` (one line: "the network ``name`` does not take this data's ``takes``: the error")
    when the forward pass raises.
    """
    network.eval()
    try:
        with torch.no_grad():
            return network(batch)
    except (RuntimeError, ValueError, TypeError, IndexError) as error:
        raise ValueError(probe_failure(name, takes, error)) from None


def probe_failure(name: str, takes: str, error: Exception) -> str:
    """One line: the network does not take ``takes``, and the error (cut to 200 characters)."""
    message = " ".join(str(error).split())[:200]
    return f"the network {name!r} does not take this data's {takes}: {type(error).__name__}: {message}"
