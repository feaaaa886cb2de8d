"""FedAvg client: local SGD on the received model, upload the trained model.

McMahan et al., AISTATS 2017, Algorithm 1 (ClientUpdate): ``E`` local epochs
(``local-epochs``) of mini-batch SGD with batch size ``B`` and learning rate
``eta``, then the model and the number of local examples go back.
"""

from __future__ import annotations

from clients import register_client
from clients.base import FederatedClient
from fl_app import keys
from fl_app.learning.train_results import TrainResult


@register_client("fedavg")
class FedAvgClient(FederatedClient):
    """Trains the global model on local data and returns it."""

    def train_result(self) -> TrainResult:
        """One round of local training: the trained model, the number of examples, the mean loss."""
        trained = self.train_locally()
        return TrainResult(
            trained.state, {keys.NUM_EXAMPLES: len(self.local_data()), keys.TRAIN_LOSS: trained.loss}
        )
