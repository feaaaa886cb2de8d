"""What every client does without a network: identity, data, randomness, replies, the roster answer.

:class:`NodeClient` is the part of :class:`clients.base.FederatedClient` that needs no torch: a
device answering the server's roster query (partition id, data set size) runs only this, so its
ClientApp process does not import torch (about 1 s of CPU per process on the machines measured,
docs/deploy.md). A client object lives for one message; everything it needs arrives in the message
(keys of :mod:`fl_app.keys`) or lives in the node's context (``node_config`` for the data,
``state`` for what persists across rounds).

Privacy noise is drawn from OS entropy when the message asks for it or when the client does not run
in a simulation (a real device ignores any seed the server sends, so the server can never reproduce
a device's noise).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from fl_app import keys
from fl_app.config.registry import PLUGINS_ENV, referable_packages
from fl_app.data.federated import ClientDataset, federated_data_of
from fl_app.data.local import check_local_dataset, load_local_dataset
from fl_app.learning.model_spec import ModelSpec
from fl_app.learning.records import config_record
from fl_app.privacy.rng import RandomSource, make_generator

#: Fault injection for failure-handling tests: ``DPFL_INJECT_FAILURES="3,5@2"``
#: makes client 3 raise in every round and client 5 in round 2 (train and
#: evaluate messages). Unset in normal use.
INJECT_FAILURES_ENV = "DPFL_INJECT_FAILURES"
#: ``DPFL_INJECT_DELAY="0.5"``: every client message of a round > 0 takes that many seconds more
#: (interrupt tests need rounds that last). Unset in normal use.
INJECT_DELAY_ENV = "DPFL_INJECT_DELAY"


@functools.lru_cache(maxsize=8)
def parse_model_spec(text: str) -> ModelSpec:
    """The :class:`ModelSpec` of a message's JSON (parsed once per process)."""
    return ModelSpec.from_json(text)


def check_device_model(name: str) -> None:
    """Refuse, on a device, a ``module:Class`` network outside the app's packages and ``DPFL_PLUGINS``.

    As for algorithms (:meth:`fl_app.config.registry.Registry.get`), a message cannot make a device import
    whatever happens to be installed: the operator names the user's module in ``DPFL_PLUGINS``.
    """
    module = name.partition(":")[0]
    if ":" in name and module.split(".")[0] not in referable_packages():
        raise ValueError(
            f"the server's model={name!r}: a device imports only modules of "
            f"{', '.join(referable_packages())}; start this SuperNode with {PLUGINS_ENV}={module} to allow it"
        )


class InjectedFailureError(RuntimeError):
    """Raised by a client named in ``DPFL_INJECT_FAILURES``."""


def injected_failure(client_id: int, server_round: int) -> bool:
    """Whether ``DPFL_INJECT_FAILURES`` asks this client to fail in this round."""
    for item in filter(None, os.environ.get(INJECT_FAILURES_ENV, "").replace(" ", "").split(",")):
        client, _, round_text = item.partition("@")
        if int(client) == client_id and (not round_text or int(round_text) == server_round):
            return True
    return False


class NodeClient:
    """A node's answer to one message, without a network (see the module docstring).

    Parameters
    ----------
    message : Message
        The incoming message (train, evaluate or query).
    context : Context
        The node's context (``node_config``, persistent ``state``).

    """

    def __init__(self, message: Message, context: Context) -> None:
        self.message = message
        self.context = context
        self.config: ConfigRecord = config_record(message.content, keys.CONFIG) or ConfigRecord()
        delay = float(os.environ.get(INJECT_DELAY_ENV, "0") or 0)
        if self.server_round > 0 and delay > 0:
            time.sleep(delay)
        if self.server_round > 0 and injected_failure(self.client_id, self.server_round):
            raise InjectedFailureError(
                f"client {self.client_id} fails in round {self.server_round} ({INJECT_FAILURES_ENV})"
            )

    # ------------------------------------------------------------------ identity

    @property
    def in_simulation(self) -> bool:
        """True for a simulated node (it has a ``partition-id``)."""
        return keys.NODE_PARTITION_ID in self.context.node_config

    @property
    def client_id(self) -> int:
        """Stable id: the partition id in simulation, the node id on a device."""
        if self.in_simulation:
            return int(self.context.node_config[keys.NODE_PARTITION_ID])
        return int(self.context.node_id)

    @property
    def server_round(self) -> int:
        """The round this message belongs to (0 outside rounds)."""
        return int(self.config.get(keys.SERVER_ROUND, 0))

    # ------------------------------------------------------------------ data

    def model_spec(self) -> ModelSpec:
        """The architecture the server asked for (a device builds a user's network only if allowed)."""
        spec = parse_model_spec(str(self.config[keys.MODEL_SPEC]))
        if not self.in_simulation:
            check_device_model(spec.name)
        return spec

    def local_data(self) -> ClientDataset:
        """Return the labelled training data of this client.

        Simulation: the partition ``partition-id`` of the split described by the
        message's data spec (cached per process). Device: the file or folder in
        ``node_config["data-path"]``, checked against the server's model when
        the message names one.
        """
        if self.in_simulation:
            return federated_data_of(str(self.config[keys.DATA_SPEC])).client(self.client_id)
        if keys.NODE_DATA_PATH not in self.context.node_config:
            raise ValueError("this SuperNode has no data: start it with --node-config 'data-path=\"<file>\"'")
        path = str(self.context.node_config[keys.NODE_DATA_PATH])
        data = load_local_dataset(path)
        if keys.MODEL_SPEC in self.config:
            model = self.model_spec()
            check_local_dataset(data, path, input_shape=model.input_shape, num_classes=model.num_classes)
        return data

    # ------------------------------------------------------------------ randomness

    def generator(self, purpose: str) -> np.random.Generator:
        """Non-privacy randomness (data order), derived from the run seed."""
        return make_generator(
            seed=int(self.config.get(keys.SEED, 0)),
            secure=False,
            purpose=purpose,
            client=self.client_id,
            server_round=self.server_round,
        )

    @property
    def noise_source(self) -> RandomSource:
        """Where privacy noise comes from: OS entropy unless a seeded simulation."""
        secure = bool(self.config.get(keys.SECURE_RNG, False)) or not self.in_simulation
        if secure or keys.NOISE_SEED not in self.config:
            return RandomSource(seed=None, secure=True)
        return RandomSource(seed=int(self.config[keys.NOISE_SEED]), secure=False)

    def noise_generator(self, purpose: str) -> np.random.Generator:
        """Privacy-noise randomness for ``purpose`` in this round."""
        return self.noise_source.generator(purpose, client=self.client_id, server_round=self.server_round)

    # ------------------------------------------------------------------ replies

    def reply(
        self,
        *,
        arrays: ArrayRecord | None = None,
        metrics: dict[str, Any] | None = None,
        configs: dict[str, ConfigRecord] | None = None,
    ) -> Message:
        """Reply with (optionally) arrays, metrics and extra config records."""
        content = RecordDict()
        if arrays is not None:
            content[keys.ARRAYS] = arrays
        content[keys.METRICS] = MetricRecord(metrics or {})
        for name, record in (configs or {}).items():
            content[name] = record
        return Message(content=content, reply_to=self.message)

    def describe(self) -> Message:
        """Answer the server's roster query: partition id and data set size.

        Data set sizes are treated as public (NbAFL's m and KD-DP's grouping
        need them, and FedAvg weights by them).
        """
        partition = self.client_id if self.in_simulation else -1
        return self.reply(metrics={keys.PARTITION_ID: partition, keys.NUM_EXAMPLES: len(self.local_data())})
