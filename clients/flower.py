"""The client of Flower's strategies run by dpfl: FedAvg's local SGD, plus FedProx's proximal term.

Flower's ``FedProx`` (``flwr.serverapp.strategy``) sends ``proximal-mu`` in the train config and
leaves the term to the client (its docstring): local training then minimises
``loss + mu/2 ||w - w_t||^2`` (Li et al., "Federated Optimization in Heterogeneous Networks",
MLSys 2020, Algorithm 2), with ``w_t`` the received model. Without the key it is FedAvg's client.
"""

from __future__ import annotations

from clients import register_client
from clients.fedavg import FedAvgClient
from fl_app import keys
from fl_app.train_results import TrainResult
from fl_app.training import model_state

#: Flower's FedProx config key (``flwr.serverapp.strategy.FedProx.configure_train``).
PROXIMAL_MU = "proximal-mu"


@register_client("flower")
class FlowerClient(FedAvgClient):
    """Local SGD on the received model (with the proximal term when the config asks), the model back."""

    def cohort_proximal_mu(self) -> float:
        """FedProx's ``proximal-mu`` from the Flower strategy's train config (0: plain FedAvg)."""
        return max(float(self.config.get(PROXIMAL_MU, 0.0)), 0.0)

    def train_result(self) -> TrainResult:
        """One round of local training (with the proximal term when the config asks)."""
        mu = float(self.config.get(PROXIMAL_MU, 0.0))
        if mu <= 0:
            return super().train_result()
        data = self.local_data()
        model = self.global_model()
        reference = [p.detach().clone() for p in model.parameters()]
        loss = self.train_locally(model, data.x, data.y, proximal_mu=mu, reference=reference)
        return TrainResult(model_state(model), {keys.NUM_EXAMPLES: len(data), keys.TRAIN_LOSS: loss})
