"""The client contract: what an algorithm's client writes, on top of the node's machinery.

A client object lives for one message: the ClientApp builds it from the incoming
:class:`~flwr.app.Message` and the node's :class:`~flwr.app.Context`, calls :meth:`FederatedClient.train`
(or ``evaluate``) and returns the reply. Identity, data, randomness, replies and the roster answer are
:class:`clients.node.NodeClient`'s (no torch); this class adds the model and local training.

An algorithm's client writes at most three train entry points, and states what it is:

* :meth:`FederatedClient.local_sgd`: what its local training is (SGD settings, a FedProx term, a
  gradient correction), or None when it trains its own way;
* :meth:`FederatedClient.train_result`: the reply's content from :meth:`FederatedClient.train_locally`'s
  result (the trained model by default); or :meth:`FederatedClient.train`, for a reply of its own;
* :attr:`FederatedClient.keeps_state` and :attr:`FederatedClient.state`: what it keeps between rounds.

How a round runs (one message per client, several clients packed into one message, a cohort trained
as one vectorised computation) is the engine's choice (:mod:`fl_app.engine`): it reads these
statements and never needs a hook of the client's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Message, RecordDict
from torch import nn

from clients.node import NodeClient, parse_model_spec
from fl_app import keys
from fl_app.engine.client_states import state_of
from fl_app.engine.vectorised import served_training
from fl_app.learning.orders import client_seed, example_orders
from fl_app.learning.records import array_record
from fl_app.learning.train_results import TrainResult
from fl_app.learning.training import (
    LocalSGD,
    array_values,
    evaluate,
    fix_state,
    load_arrays,
    local_steps,
    model_parameters,
    model_state,
    threads_as_environment_says,
    train_local,
    training_device,
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
    loaded and trained in place, so they are fixed (:func:`fl_app.learning.training.fix_state`).
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


@dataclass
class Trained:
    """The result of :meth:`FederatedClient.train_locally`: the trained model's state, its loss, its steps.

    ``state`` holds every array of the model by name (views: use them before the process trains its
    next client); ``steps`` is the number of SGD steps taken (SCAFFOLD's ``K``). A later
    :meth:`FederatedClient.global_model` of the same message loads the received arrays into the model
    whose tensors ``state`` views: the state is copied out first (:meth:`release_model`), so it keeps the
    trained values whatever the client calls after training.
    """

    state: dict[str, np.ndarray]
    loss: float
    steps: int
    _client: FederatedClient | None = field(default=None, repr=False)
    _model: nn.Module | None = field(default=None, repr=False)
    _views_model: bool = field(default=False, repr=False)

    def release_model(self) -> None:
        """Keep the trained values apart from the model, which is about to hold other arrays.

        Copies :attr:`state` when it views the model's tensors and forgets the model:
        :meth:`model` loads the state into a model again when asked.
        """
        if self._views_model:
            self.state = {name: np.array(values, copy=True) for name, values in self.state.items()}
            self._views_model = False
        self._model = None

    def model(self) -> nn.Module:
        """A model holding the trained state (this process's instance: use it for this message only)."""
        if self._model is None:
            if self._client is None:
                raise RuntimeError("a Trained result without its client has no model")
            model = self._client.global_model()
            with torch.no_grad():
                for name, value in model.state_dict().items():
                    value.copy_(torch.from_numpy(np.asarray(self.state[name])))
            self._model = model
            self._client._holding_model = self
        return self._model

    def update(self, start: ArrayRecord) -> dict[str, np.ndarray]:
        """``w_k - w_t`` in float64, by name: the trained state minus ``start`` (the received model).

        Raises ``ValueError`` for an array that is not floating point (an update of integers could not
        be clipped and noised as the mechanisms assume).
        """
        update = {}
        for name in start:
            begin = array_values(start[name])
            if not np.issubdtype(begin.dtype, np.floating):
                raise ValueError(f"model array {name!r} is not floating point: it has no model update")
            update[name] = self.state[name].astype(np.float64) - begin.astype(np.float64)
        return update


class FederatedClient(NodeClient):
    """The client contract (see the module docstring); subclasses implement :meth:`train_result`.

    ``simulation.client_gpus > 0`` asks clients to train on CUDA (:attr:`device`): the model of
    :meth:`global_model` is then placed there, and :func:`fl_app.learning.training.train_local`,
    ``evaluate`` and ``predict_proba`` follow the model. A client whose own loops are CPU-only
    sets :attr:`uses_gpu` to False and keeps the CPU.

    Parameters
    ----------
    message : Message
        The incoming message (train, evaluate or query).
    context : Context
        The node's context (``node_config``; ``state`` on a device).

    """

    #: Whether this client's training may run on the GPU the simulation gives it.
    uses_gpu: ClassVar[bool] = True
    #: Whether this client keeps records between rounds in :attr:`state` (per client, not per node).
    keeps_state: ClassVar[bool] = False

    def __init__(self, message: Message, context: Context) -> None:
        threads_as_environment_says()
        super().__init__(message, context)
        self._state: RecordDict | None = None
        self._holding_model: Trained | None = None  # the result whose values the process model holds

    # ------------------------------------------------------------------ what the server sent

    @property
    def device(self) -> torch.device:
        """Where this client trains: CUDA when the server asked for it, the client can and torch sees one."""
        return training_device(self.config, may_use_gpu=self.uses_gpu)

    def incoming_arrays(self) -> ArrayRecord:
        """The ArrayRecord the server sent as the model (``KeyError`` when it sent none)."""
        arrays = array_record(self.message.content, keys.ARRAYS)
        if arrays is None:
            raise KeyError(keys.ARRAYS)
        return arrays

    def received(self, name: str) -> ArrayRecord | None:
        """Another ArrayRecord the server sent (its strategy's ``records_for_clients``), or None."""
        return array_record(self.message.content, name)

    def global_model(self) -> nn.Module:
        """The server's model: this process's instance of the architecture with the received arrays.

        The instance is shared by the messages this process serves one after
        another (:func:`process_model`): use it for this message only. :meth:`train_locally` trains the
        same instance, so a model taken before it holds the trained values afterwards; a call after it
        leaves the :class:`Trained` result's ``state`` as trained (copied out of the model first) and
        makes its :meth:`Trained.model` load that state again when asked.
        """
        self.model_spec()  # a device refuses a network its operator did not allow (check_device_model)
        if self._holding_model is not None:
            self._holding_model.release_model()
            self._holding_model = None
        model = process_model(str(self.config[keys.MODEL_SPEC]), self.device)
        load_arrays(model, self.incoming_arrays())
        for parameter in model_parameters(model):
            parameter.grad = None
        return model

    # ------------------------------------------------------------------ state between rounds

    @property
    def state(self) -> RecordDict:
        """The client's records kept between rounds (empty at first); write to it to keep something.

        Only for a class that declares :attr:`keeps_state`. In a simulation the engine keeps them per
        client id, in every kind of round and in the checkpoint (so ``resume=`` continues exactly); on
        a device they live in the node's ``context.state``.
        """
        if not type(self).keeps_state:
            raise AttributeError(
                f"{type(self).__name__} does not declare keeps_state = True: it has no state between rounds"
            )
        if self._state is None:
            self._state = state_of(self.message, self.context)
        return self._state

    # ------------------------------------------------------------------ local training

    def local_sgd(self) -> LocalSGD | None:
        """What this client's local training is: the train config's SGD (override to add to it).

        Return None for a client that trains its own way (it never calls :meth:`train_locally`).
        """
        return LocalSGD.from_config(self.config)

    def train_locally(self) -> Trained:
        """:meth:`local_sgd` run on the received model and this client's data; the trained state.

        The engine may have trained this message already, with the same settings, as part of a
        vectorised cohort: its result is then taken instead of training again.
        """
        sgd = self.local_sgd()
        if sgd is None:
            raise TypeError(f"{type(self).__name__}.local_sgd() is None: it has no standard local training")
        data = self.local_data()
        served = served_training(self.message, sgd)
        steps = local_steps(len(data), epochs=sgd.epochs, batch_size=sgd.batch_size)
        if served is not None:
            self.model_spec()  # the same check global_model() makes
            return Trained(served.state, served.loss, steps, _client=self)
        model = self.global_model()
        reference = [p.detach().clone() for p in model.parameters()] if sgd.proximal_mu > 0 else None
        seed, client, server_round = int(self.config.get(keys.SEED, 0)), self.client_id, self.server_round
        order = example_orders(
            seed=seed, clients=[client], server_round=server_round, sizes=[len(data)], epochs=sgd.epochs
        )
        loss = train_local(
            model,
            data.x,
            data.y,
            epochs=sgd.epochs,
            batch_size=sgd.batch_size,
            lr=sgd.lr,
            momentum=sgd.momentum,
            order=order[0],
            dropout_seed=client_seed(seed=seed, client=client, server_round=server_round),
            proximal_mu=sgd.proximal_mu,
            reference=reference,
            correction=sgd.corrections_for(model),
        )
        trained = Trained(model_state(model), loss, steps, _client=self, _model=model, _views_model=True)
        self._holding_model = trained
        return trained

    # ------------------------------------------------------------------ entry points

    def train_result(self) -> TrainResult | None:
        """The round's reply as its arrays, metrics and records before encoding (override).

        None (the default): the client implements :meth:`train` itself.
        """
        return None

    def train(self) -> Message:
        """Local training for one round: :meth:`train_result` encoded (override for a reply of its own)."""
        result = self.train_result()
        if result is None:
            raise NotImplementedError(f"{type(self).__name__} does not train")
        return Message(content=result.content(), reply_to=self.message)

    def evaluate(self) -> Message:
        """Evaluate the received global model on this client's local data."""
        data = self.local_data()
        loss, accuracy = evaluate(self.global_model(), data.x, data.y)
        return self.reply(
            metrics={keys.NUM_EXAMPLES: len(data), keys.EVAL_LOSS: loss, keys.EVAL_ACCURACY: accuracy}
        )


def trains_by_the_contract(client: FederatedClient) -> bool:
    """Whether the engine may run ``client``'s local training: the contract's loop, a stated local SGD.

    A class with its own ``train_locally`` (the engine could not know what it does) or whose
    ``local_sgd()`` is None (it trains its own way) is never trained in a vectorised cohort.
    """
    if own_local_training(type(client)) is not None:
        return False
    try:
        return client.local_sgd() is not None
    except Exception:  # the message's own run reports it
        return False


def own_local_training(client_class: type) -> str | None:
    """Why the engine never trains ``client_class``'s clients for them, in words; None: it may.

    It may when the class keeps the contract's :meth:`FederatedClient.train_locally` (and a client
    states a local SGD: :func:`trains_by_the_contract`).
    """
    if getattr(client_class, "train_locally", None) is not FederatedClient.train_locally:
        return f"{client_class.__name__} does not train through the contract's train_locally"
    return None
