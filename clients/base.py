"""The base of every client that trains: the node's machinery plus the network, from a real Message.

A client object lives for one message: the ClientApp builds it from the
incoming :class:`~flwr.app.Message` and the node's :class:`~flwr.app.Context`,
calls :meth:`FederatedClient.train` (or ``evaluate``) and returns the reply.
Identity, data, randomness, replies and the roster answer are
:class:`clients.node.NodeClient`'s (no torch); this class adds the model (built
once per process, :func:`process_model`), local SGD and evaluation.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message
from torch import nn

from clients.node import NodeClient, parse_model_spec
from fl_app import keys
from fl_app.cohort_execution import TrainSettings, precomputed
from fl_app.data.federated import ClientDataset
from fl_app.engine.messages import array_record
from fl_app.train_results import TrainResult
from fl_app.training import (
    array_values,
    evaluate,
    fix_state,
    load_arrays,
    model_parameters,
    model_state,
    train_local,
    unfix_state,
)

#: Built models of this process, by model spec and device (see :func:`process_model`).
_PROCESS_MODELS: dict[tuple[str, str], nn.Module] = {}
_MAX_PROCESS_MODELS = 4


def process_model(spec_text: str, device: torch.device | None = None) -> nn.Module:
    """Return this process's instance of the model ``spec_text`` describes, built on first use.

    A simulated client lives for one message, but its process (a Ray actor)
    serves many clients one after another: building the network once and
    loading each message's arrays into it saves the construction and random
    initialisation per message. Every parameter is overwritten by the caller
    (:meth:`FederatedClient.global_model`), so reuse changes no result. Its tensors are only ever
    loaded and trained in place, so they are fixed (:func:`fl_app.training.fix_state`).
    """
    place = torch.device("cpu") if device is None else device
    key = (spec_text, str(place))
    model = _PROCESS_MODELS.get(key)
    if model is None:
        if len(_PROCESS_MODELS) >= _MAX_PROCESS_MODELS:
            for dropped in _PROCESS_MODELS.values():
                unfix_state(dropped)
            _PROCESS_MODELS.clear()
        model = _PROCESS_MODELS[key] = fix_state(parse_model_spec(spec_text).build().to(place))
    return model


class FederatedClient(NodeClient):
    """Common machinery of all training clients; subclasses implement :meth:`train`.

    ``simulation.client_gpus > 0`` asks clients to train on CUDA (:attr:`device`): the model of
    :meth:`global_model` is then placed there, and :func:`fl_app.training.train_local`,
    ``evaluate`` and ``predict_proba`` follow the model. A client whose own loops are CPU-only
    sets :attr:`uses_gpu` to False and keeps the CPU.

    Parameters
    ----------
    message : Message
        The incoming message (train, evaluate or query).
    context : Context
        The node's context (``node_config``, persistent ``state``).

    """

    #: Whether this client's training may run on the GPU the simulation gives it.
    uses_gpu: bool = True
    #: Whether its train messages may be trained as one computation with the others of an actor's
    #: batch (``simulation.vectorise``, :mod:`fl_app.cohort_execution`): true only where the local
    #: update is :meth:`train_locally` on the global model as received, its own data, the train
    #: config and its ``"data-order"`` generator, with :meth:`cohort_proximal_mu` as FedProx term.
    cohort_form: bool = False

    def __init__(self, message: Message, context: Context) -> None:
        threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
        if threads > 0 and torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        super().__init__(message, context)

    # ------------------------------------------------------------------ model

    @property
    def device(self) -> torch.device:
        """Where this client trains: CUDA or the CPU.

        CUDA when the server asked for it (``simulation.client_gpus > 0``), this client can use it
        (:attr:`uses_gpu`) and torch sees a device; the CPU otherwise, and for a message whose
        training was done in its cohort (:mod:`fl_app.cohort_execution`, which moves the cohort's
        results to the CPU at once): what is left of it (the update, clipping, local noise, the
        reply's arrays) would otherwise pay a dozen host-device transfers per message.
        """
        if precomputed(self.message) is not None:
            return torch.device("cpu")
        wanted = str(self.config.get(keys.DEVICE, "cpu")) == "cuda"
        return torch.device("cuda" if wanted and self.uses_gpu and torch.cuda.is_available() else "cpu")

    def incoming_arrays(self) -> ArrayRecord:
        """The ArrayRecord the server sent (``KeyError`` when it sent none)."""
        arrays = array_record(self.message.content, keys.ARRAYS)
        if arrays is None:
            raise KeyError(keys.ARRAYS)
        return arrays

    def global_model(self) -> nn.Module:
        """The server's model: this process's instance of the architecture with the received arrays.

        The instance is shared by the messages this process serves one after
        another (:func:`process_model`): use it for this message only.
        """
        self.model_spec()  # a device refuses a network its operator did not allow (check_device_model)
        model = process_model(str(self.config[keys.MODEL_SPEC]), self.device)
        load_arrays(model, self.incoming_arrays())
        for parameter in model_parameters(model):
            parameter.grad = None
        return model

    def cohort_proximal_mu(self) -> float:
        """The FedProx coefficient this client's :meth:`train_locally` call passes (0: none)."""
        return 0.0

    def train_settings(self, examples: int, proximal_mu: float) -> TrainSettings:
        """The train config's SGD settings for ``examples`` examples."""
        return TrainSettings(
            examples=int(examples),
            epochs=int(self.config[keys.LOCAL_EPOCHS]),
            batch_size=int(self.config[keys.BATCH_SIZE]),
            lr=float(self.config[keys.LR]),
            momentum=float(self.config.get(keys.MOMENTUM, 0.0)),
            proximal_mu=float(proximal_mu),
        )

    def train_locally(self, model: nn.Module, x: np.ndarray, y: np.ndarray, **extra: Any) -> float:
        """Local SGD with the train config's hyperparameters; returns the mean loss.

        ``extra`` goes to :func:`fl_app.training.train_local` (e.g. ``proximal_mu`` with the global
        model as ``reference``). When this message was trained in its cohort
        (:mod:`fl_app.cohort_execution`) with exactly these settings, ``model`` takes that result.
        """
        settings = self.train_settings(len(y), float(extra.get("proximal_mu", 0.0)))
        planned = precomputed(self.message)
        if planned is not None and planned.matches(settings) and set(extra) <= {"proximal_mu", "reference"}:
            planned.load_into(model)
            return planned.loss
        return train_local(
            model,
            x,
            y,
            epochs=settings.epochs,
            batch_size=settings.batch_size,
            lr=settings.lr,
            momentum=settings.momentum,
            rng=self.generator("data-order"),
            **extra,
        )

    def trained_in_cohort(self, examples: int) -> tuple[dict[str, np.ndarray], float] | None:
        """The model state this message's training reached in its cohort (by name) and its loss.

        None unless the message was trained in its cohort (:mod:`fl_app.cohort_execution`) with
        exactly this client's settings for ``examples`` examples and the cohort's parameters are the
        model's whole state. Then the client needs no model: loading the global arrays, then the
        trained parameters, then encoding the model were three copies of it per message, most of a
        1000-client round's host time on a GPU (docs/benchmarks/engine_gpu.md). The arrays equal
        what :func:`~fl_app.training.model_state` reads from a model that took the result. A subclass
        that overrides :meth:`train_locally` keeps its own (None: it trains through it).
        """
        if type(self).train_locally is not FederatedClient.train_locally:
            return None
        planned = precomputed(self.message)
        if planned is None or not planned.matches(self.train_settings(examples, self.cohort_proximal_mu())):
            return None
        state = planned.state(list(self.incoming_arrays().keys()))
        if state is None:
            return None
        self.model_spec()  # the same check global_model() makes
        return state, planned.loss

    def locally_trained(self, data: ClientDataset) -> tuple[dict[str, np.ndarray], float]:
        """The model state after this message's local training on ``data`` (by name), and its loss.

        From the message's cohort when it was trained in one (:meth:`trained_in_cohort`), else the
        global model trained here with :meth:`train_locally`.
        """
        cohort = self.trained_in_cohort(len(data))
        if cohort is not None:
            return cohort
        model = self.global_model()
        loss = self.train_locally(model, data.x, data.y)
        return model_state(model), loss  # not encoded and decoded again: about 2 ms of the message's CPU

    def local_update(self) -> tuple[list[str], list[np.ndarray]]:
        """Train the received model on the local data; its arrays' names and ``w_k - w_t`` in float64.

        Raises ``ValueError`` for a model array that is not floating point (an update of integers
        could not be clipped and noised as the mechanisms assume).
        """
        received = self.incoming_arrays()
        names = list(received.keys())
        start = {name: array_values(received[name]) for name in names}  # read in place, not decoded
        for name in names:
            if not np.issubdtype(start[name].dtype, np.floating):
                raise ValueError(f"model array {name!r} is not floating point: it has no model update")
        trained, _ = self.locally_trained(self.local_data())
        return names, [trained[n].astype(np.float64) - start[n].astype(np.float64) for n in names]

    # ------------------------------------------------------------------ entry points

    def train_result(self) -> TrainResult | None:
        """The round's training as its model state and metrics, for a client whose reply is just that.

        Such a client implements this and not :meth:`train`, whose reply is then this result encoded
        (:meth:`~fl_app.train_results.TrainResult.content`). None (the default): the client implements
        :meth:`train` itself.
        """
        return None

    def train(self) -> Message:
        """Local training for one round: :meth:`train_result` encoded; or a subclass's own reply."""
        result = self.train_result()
        if result is None:
            raise NotImplementedError(f"{type(self).__name__} does not train")
        return Message(content=result.content(), reply_to=self.message)

    def train_unencoded(self) -> TrainResult | Message:
        """What a cohort message's member returns (:mod:`fl_app.cohort_messages`).

        The train result before encoding when :meth:`train` is only its encoding (the member's term is
        read from it: no copy of the model into message arrays and back), else the reply.
        """
        if type(self).train is FederatedClient.train:
            result = self.train_result()
            if result is not None:
                return result
        return self.train()

    def evaluate(self) -> Message:
        """Evaluate the received global model on this client's local data."""
        data = self.local_data()
        loss, accuracy = evaluate(self.global_model(), data.x, data.y)
        return self.reply(
            metrics={keys.NUM_EXAMPLES: len(data), keys.EVAL_LOSS: loss, keys.EVAL_ACCURACY: accuracy}
        )
