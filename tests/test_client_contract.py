"""The client contract as an algorithm's author uses it (``clients/base.py``), on a real Message.

Oracle: FedAvg's own client answering the same message; a client that also asks for the received
model after training must upload the same trained model, and ``Trained.model()`` must still hold it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from conftest import client_for, make_context, make_message, spec_config
from flwr.app import ArrayRecord

from clients.fedavg import FedAvgClient
from fl_app import keys
from fl_app.learning.model_spec import ModelSpec
from fl_app.learning.train_results import TrainResult
from fl_app.learning.training import array_values, model_state, model_to_arrays

SHAPE = ["dataset=digits", "num_clients=6"]


class LooksBackClient(FedAvgClient):
    """Trains, then takes the received model (to compare against it), then uploads the trained state."""

    looked: ClassVar[dict[str, np.ndarray]] = {}
    reloaded: ClassVar[dict[str, np.ndarray]] = {}

    def train_result(self) -> TrainResult:
        trained = self.train_locally()
        received = self.global_model()
        type(self).looked = {name: values.copy() for name, values in model_state(received).items()}
        type(self).reloaded = {name: values.copy() for name, values in model_state(trained.model()).items()}
        return TrainResult(trained.state, {keys.NUM_EXAMPLES: len(self.local_data())})


def _train_message() -> tuple[dict[str, Any], ArrayRecord]:
    config = {**spec_config(SHAPE), keys.ALGORITHM: "fedavg"}
    return config, model_to_arrays(ModelSpec.from_json(config[keys.MODEL_SPEC]).build())


def _uploaded(reply: Any) -> dict[str, np.ndarray]:
    arrays = reply.content.array_records[keys.ARRAYS]
    return {name: array_values(arrays[name]).copy() for name in arrays}


def test_the_received_model_after_training_leaves_the_trained_state_as_trained() -> None:
    config, start = _train_message()
    fedavg = _uploaded(client_for(make_message(config, start), make_context(partition_id=1)).train())
    looks_back = _uploaded(LooksBackClient(make_message(config, start), make_context(partition_id=1)).train())
    received = {name: array_values(start[name]) for name in start}
    assert any(not np.array_equal(fedavg[name], received[name]) for name in received)  # it trained
    for name in received:
        np.testing.assert_array_equal(looks_back[name], fedavg[name])
        np.testing.assert_array_equal(LooksBackClient.looked[name], received[name])
        np.testing.assert_array_equal(LooksBackClient.reloaded[name], fedavg[name])
