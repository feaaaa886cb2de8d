"""The client of Flower's strategies run by dpfl: FedAvg's local SGD, plus FedProx's proximal term.

Flower's ``FedProx`` (``flwr.serverapp.strategy``) sends ``proximal-mu`` in the train config and
leaves the term to the client (its docstring): local training then minimises
``loss + mu/2 ||w - w_t||^2`` (Li et al., "Federated Optimization in Heterogeneous Networks",
MLSys 2020, Algorithm 2), with ``w_t`` the received model. Without the key it is FedAvg's client.
"""

from __future__ import annotations

from dataclasses import replace

from clients import register_client
from clients.fedavg import FedAvgClient
from fl_app.training import LocalSGD

#: Flower's FedProx config key (``flwr.serverapp.strategy.FedProx.configure_train``).
PROXIMAL_MU = "proximal-mu"


@register_client("flower")
class FlowerClient(FedAvgClient):
    """Local SGD on the received model (with the proximal term when the config asks), the model back."""

    def local_sgd(self) -> LocalSGD:
        """The train config's SGD with FedProx's ``proximal-mu`` from the Flower strategy (0: FedAvg)."""
        return replace(super().local_sgd(), proximal_mu=max(float(self.config.get(PROXIMAL_MU, 0.0)), 0.0))
