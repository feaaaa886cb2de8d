"""DP-FTRL client: plain local training; clipping and tree-aggregation noise on the server.

Kairouz, McMahan, Song, Thakkar, Thakurta, Xu, "Practical and Private (Deep)
Learning without Sampling or Shuffling", ICML 2021, federated form: the
scheduled client trains the current model w_t locally (FedAvg's ClientUpdate,
McMahan et al., AISTATS 2017) and returns it; the trusted server clips the
update ``w_k - w_t`` and adds it to the tree-aggregated prefix sum
(:mod:`strategies.dp_ftrl`).
"""

from __future__ import annotations

from clients import register_client
from clients.fedavg import FedAvgClient


@register_client("dp_ftrl")
class DPFTRLClient(FedAvgClient):
    """Same local update as FedAvg; the privacy mechanism runs on the server."""
