"""SCAFFOLD client: local SGD corrected by the control variates; its own control variate kept as state.

Karimireddy, Kale, Mohri, Reddi, Stich, Suresh, "SCAFFOLD: Stochastic Controlled Averaging for
Federated Learning", ICML 2020, Algorithm 1. The client receives the global model ``x`` and the server
control variate ``c``; it keeps its own control variate ``c_i`` (zero before its first round) between
rounds. From ``y_i = x`` it takes ``K`` local SGD steps ``y_i <- y_i - eta_l (g_i(y_i) - c_i + c)``
(line 10: the correction ``c - c_i`` added to every gradient), then sets (option II, line 12)
``c_i+ = c_i - c + (x - y_i) / (K eta_l)`` and uploads ``y_i`` (the server averages ``y_i - x``) and
``Delta c_i = c_i+ - c_i``, keeping ``c_i+``.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from flwr.app import ArrayRecord

from clients import register_client
from clients.fedavg import FedAvgClient
from fl_app import keys
from fl_app.learning.train_results import TrainResult
from fl_app.learning.training import LocalSGD, array_values, state_to_arrays

#: The record of the control variates: the server's ``c`` in a train message, ``Delta c_i`` in a reply,
#: the client's own ``c_i`` in its state (this algorithm's wire protocol).
CONTROL = "scaffold-control"


@register_client("scaffold")
class ScaffoldClient(FedAvgClient):
    """FedAvg's local SGD with the correction ``c - c_i``; uploads its model and ``Delta c_i``."""

    keeps_state = True  # c_i, between rounds

    def controls(self) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
        """The server's ``c`` (received) and this client's ``c_i`` (its state; zeros at first), by name."""
        received = self.received(CONTROL)
        if received is None:
            raise ValueError(f"scaffold: the train message carries no {CONTROL!r} record")
        server = {name: array_values(received[name]).astype(np.float64) for name in received}
        kept = self.state.get(CONTROL)
        own = {name: np.zeros_like(values) for name, values in server.items()}
        if isinstance(kept, ArrayRecord):
            own = {name: array_values(kept[name]).astype(np.float64) for name in kept}
        return server, own

    def local_sgd(self) -> LocalSGD:
        """The train config's SGD with every gradient corrected by ``c - c_i`` (Algorithm 1, line 10)."""
        server, own = self.controls()
        correction = {name: (server[name] - own[name]).astype(np.float32) for name in server}
        return replace(super().local_sgd(), correction=correction)

    def train_result(self) -> TrainResult:
        """``K`` corrected steps; keep ``c_i+`` (option II); upload ``y_i`` and ``Delta c_i``."""
        server, own = self.controls()
        trained = self.train_locally()
        start = self.incoming_arrays()
        lr = float(self.config[keys.LR])
        updated = dict(own)
        if trained.steps > 0:
            updated = {
                name: own[name]
                - server[name]
                + (array_values(start[name]) - trained.state[name]) / (trained.steps * lr)
                for name in server
            }
        self.state[CONTROL] = state_to_arrays(
            {name: values.astype(np.float32) for name, values in updated.items()}
        )
        delta = {name: (updated[name] - own[name]).astype(np.float32) for name in server}
        metrics = {keys.NUM_EXAMPLES: len(self.local_data()), keys.TRAIN_LOSS: trained.loss}
        return TrainResult(trained.state, metrics, records={CONTROL: delta})
