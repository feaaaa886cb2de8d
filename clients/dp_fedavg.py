"""DP-FedAvg client: plain local training; clipping and noise happen on the server.

McMahan et al., ICLR 2018, Algorithm 1 (UserUpdate without client-side
clipping): the client returns its locally trained model; the trusted server
clips the update to norm C and adds Gaussian noise to the sum
(:mod:`strategies.dp_fedavg`).
"""

from __future__ import annotations

from clients import register_client
from clients.fedavg import FedAvgClient


@register_client("dp_fedavg")
class DPFedAvgClient(FedAvgClient):
    """Same local update as FedAvg; the privacy mechanism runs on the server."""
