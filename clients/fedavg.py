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


#: What a client does exactly as FedAvg's when it overrides none of these.
FEDAVG_SURFACE = ("train", "train_result", "train_locally", "local_sgd")


def plain_fedavg(client_class: type) -> bool:
    """Whether clients of ``client_class`` do exactly what FedAvg's do: the engine may train them in bulk.

    A :class:`FedAvgClient` (or subclass) that overrides none of :data:`FEDAVG_SURFACE` and keeps no state:
    its round is the contract's local SGD from the train config on the received model, and its reply is
    the trained model with its example count and loss (:mod:`fl_app.engine.bulk`).
    """
    return fedavg_difference(client_class) is None


def fedavg_difference(client_class: type) -> str | None:
    """What ``client_class`` does beyond FedAvg's client, in words; None: nothing (:func:`plain_fedavg`)."""
    name = getattr(client_class, "__name__", repr(client_class))
    if not isinstance(client_class, type) or not issubclass(client_class, FedAvgClient):
        return f"{name} is not FedAvg's client"
    if client_class.keeps_state:
        return f"{name} keeps state"
    changed = [m for m in FEDAVG_SURFACE if getattr(client_class, m) is not getattr(FedAvgClient, m)]
    return f"{name} has its own {', '.join(changed)}" if changed else None
