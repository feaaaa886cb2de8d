"""DP-FedAvg client with adaptive clipping: plain local training; clipping, bits and noise on the server.

Andrew, Thakkar, McMahan, Ramaswamy, NeurIPS 2021, Algorithm 1, with the
trusted server of central DP doing what the paper's clients do: it forms the
update ``Delta = w_k - w_t``, the bit ``b = 1[||Delta|| <= C_t]`` and the
clipped update from the returned model (:mod:`strategies.dp_fedavg_adaptive`),
so the client's own round is FedAvg's ClientUpdate (McMahan et al., AISTATS
2017, Algorithm 1).
"""

from __future__ import annotations

from clients import register_client
from clients.fedavg import FedAvgClient


@register_client("dp_fedavg_adaptive")
class DPFedAvgAdaptiveClient(FedAvgClient):
    """Same local update as FedAvg; the adaptive clipping and the noise run on the server."""
