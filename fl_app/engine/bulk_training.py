"""A bulk share's local training: the members one after another on this process's model, or vectorised.

Each member trains exactly as :meth:`clients.base.FederatedClient.train_locally` trains a FedAvg client
on its own: the received model, its data, the train config's SGD, its example orders and dropout seed
(:mod:`fl_app.learning.orders`, drawn here for the whole share at once). With ``simulation.vectorise``
the share is one :func:`fl_app.engine.vectorised_training.train_vectorised` computation (where the
model allows it; a model it refuses trains member by member).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np

from fl_app import keys
from fl_app.engine.vectorised_training import plan_for_clients, train_vectorised
from fl_app.learning.orders import client_seed, example_orders
from fl_app.learning.training import (
    has_dropout,
    load_arrays,
    model_parameters,
    model_state,
    threads_as_environment_says,
    train_local,
    training_device,
)

if TYPE_CHECKING:
    from torch import nn

    from fl_app.engine.bulk import Members, Share

#: One member's result: its index in the share, its trained state (views) and its mean loss.
Trained = tuple[int, dict[str, np.ndarray], float]


def train_stacked(share: Share, members: Members) -> tuple[dict[str, np.ndarray], np.ndarray] | None:
    """The live members trained as one computation (``simulation.vectorise``): stacked parameters, losses.

    None when the run does not vectorise, for a single member, or for a model the vectorised trainer
    refuses (buffers, a layer ``torch.func`` cannot transform): then :func:`train_one_by_one`.
    """
    if not bool(share.config.get(keys.VECTORISE, False)) or len(members.live) < 2:
        return None
    threads_as_environment_says()
    return _vectorised(share, _model(share), members)


def train_one_by_one(share: Share, members: Members) -> Iterator[Trained]:
    """Each live member trained on this process's model in turn; yield its index, state (views) and loss."""
    threads_as_environment_says()
    yield from _one_by_one(share, _model(share), members)


def _model(share: Share) -> nn.Module:
    """The round's network (this process's instance), on the device the train config asks for."""
    from clients.base import process_model

    return process_model(str(share.config[keys.MODEL_SPEC]), training_device(share.config))


def _one_by_one(share: Share, model: nn.Module, members: Members) -> Iterator[Trained]:
    """Each member from the received model, trained with its own orders and dropout seed."""
    clients = [share.partitions[i] for i in members.live]
    sgd = share.sgd
    orders = example_orders(
        seed=share.seed,
        clients=clients,
        server_round=share.server_round,
        sizes=members.sizes,
        epochs=sgd.epochs,
    )
    for position, (index, client, order) in enumerate(zip(members.live, clients, orders, strict=True)):
        load_arrays(model, share.global_arrays)
        for parameter in model_parameters(model):
            parameter.grad = None
        data = members.data(position)
        loss = train_local(
            model, data.x, data.y, epochs=sgd.epochs, batch_size=sgd.batch_size, lr=sgd.lr,
            momentum=sgd.momentum, order=order,
            dropout_seed=client_seed(seed=share.seed, client=client, server_round=share.server_round),
        )  # fmt: skip
        yield index, model_state(model), loss


def _vectorised(
    share: Share, model: nn.Module, members: Members
) -> tuple[dict[str, np.ndarray], np.ndarray] | None:
    """The live members as one vectorised computation (None: a model the vectorised trainer refuses)."""
    sgd = share.sgd
    load_arrays(model, share.global_arrays)
    global_params = {name: p.detach().clone() for name, p in model.named_parameters()}
    plan = plan_for_clients(
        seed=share.seed, clients=[share.partitions[i] for i in members.live], server_round=share.server_round,
        sizes=members.sizes, epochs=sgd.epochs, batch_size=sgd.batch_size, dropout=has_dropout(model),
    )  # fmt: skip
    try:
        result = train_vectorised(
            model, global_params, members.xs, members.ys, plan, lr=sgd.lr, momentum=sgd.momentum
        )
    except ValueError:  # e.g. buffers, a layer torch.func cannot transform
        return None
    result = result.to("cpu")
    if list(result.params) != list(share.global_arrays.keys()):
        return None  # the state has more than the parameters: trained one by one
    return {name: values.numpy() for name, values in result.params.items()}, np.asarray(result.losses)
