"""The train messages of one Ray task trained as one computation (issue 58): the actor's batch hook.

A client class whose local update is :meth:`clients.base.FederatedClient.train_locally` on the global
model, its own data, the train config and its ``"data-order"`` generator, and nothing else, sets
``cohort_form = True`` (and says its FedProx coefficient in ``cohort_proximal_mu``). When the train
config asks for it (``keys.VECTORISE``, from ``simulation.vectorise``), :func:`trained_as_cohorts`
trains every such message of an actor's batch that shares the global model and the SGD settings with
:func:`fl_app.cohort_training.train_cohort`, before the batch's messages run one by one through the
ClientApp as before. The members of the batch's cohort messages (:mod:`fl_app.cohort_messages`)
count as the batch's messages (:func:`fl_app.client_app.trained_as_cohorts` adds them), so they train
together with each other, not 16 at a time; a cohort message's own call here then finds them trained
(a message already planned is skipped, and each call forgets only the plans it made). Each client's
``train_locally`` then takes its own precomputed parameters and
loss (:func:`precomputed`) instead of looping; everything else a client does (clipping, local noise,
randomized response, metrics, its reply) still runs per message, with its own generators. A message
whose preparation fails, a model ``train_cohort`` refuses, or a ``train_locally`` call that differs
from what was planned (:meth:`Planned.matches`) trains on its own, as without this module.

The result equals the per-message path to float tolerance (``tests/test_cohort_execution.py``), not
bit for bit: batched kernels sum in other orders.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from fl_app import keys
from fl_app.cohort_training import has_dropout, plan_from_generators, train_cohort
from fl_app.engine.messages import config_record

if TYPE_CHECKING:
    from clients.base import FederatedClient

#: The fewest messages worth one computation.
MIN_COHORT = 2


@dataclass(frozen=True)
class TrainSettings:
    """What a ``train_locally`` call trains with, besides the model, the data and the generator."""

    examples: int
    epochs: int
    batch_size: int
    lr: float
    momentum: float
    proximal_mu: float


@dataclass(frozen=True)
class Planned:
    """One message's local training, done in its cohort: what it was planned for, and the result."""

    settings: TrainSettings
    params: dict[str, torch.Tensor]
    loss: float

    def matches(self, settings: TrainSettings) -> bool:
        """Whether a ``train_locally`` call asks for exactly what was trained."""
        return settings == self.settings

    def load_into(self, model: nn.Module) -> None:
        """Set ``model``'s parameters to the trained ones."""
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                parameter.copy_(self.params[name].to(parameter.device))

    def state(self, names: Sequence[str]) -> dict[str, np.ndarray] | None:
        """The trained parameters as numpy arrays in the order of ``names`` (views, not copies).

        None unless ``names`` are exactly the trained parameters (a model with buffers, whose state
        has more than its parameters, goes through :meth:`load_into`).
        """
        if set(names) != set(self.params) or len(names) != len(self.params):
            return None
        return {name: self.params[name].detach().cpu().numpy() for name in names}


_planned: dict[str, Planned] = {}


def message_key(message: Any) -> str:
    """What identifies a message within a batch (its id; the engine numbers batched messages)."""
    return str(message.metadata.message_id) or f"object-{id(message)}"


def precomputed(message: Any) -> Planned | None:
    """The message's training, done in its cohort by :func:`trained_as_cohorts`, if it was."""
    return _planned.get(message_key(message))


@contextmanager
def trained_as_cohorts(
    jobs: Sequence[tuple[Any, Any]], client_of: Callable[[Any, Any], FederatedClient | None]
) -> Iterator[int]:
    """Train the batch's cohort-form train messages together; yield how many were trained so.

    Parameters
    ----------
    jobs : Sequence of (Message, Context)
        An actor's batch (:func:`fl_app.engine.batching.run_jobs`).
    client_of : callable
        The client the ClientApp would build for a plain train message (None for one it would not
        hand to a client's ``train`` as it is, e.g. a SecAgg+ stage; may raise).

    """
    groups: list[Group] = []
    for message, context in jobs:
        if message_key(message) in _planned:
            continue  # trained already, with the batch it came in (a cohort message's member)
        client = _cohort_client(message, context, client_of)
        if client is not None:
            _join_group(groups, message, client)
    added: list[str] = []
    try:
        for group in groups:
            members = group.members
            if len(members) >= MIN_COHORT:
                added += _train_group(members)
        yield len(added)
    finally:
        for key in added:  # only this call's: a cohort message's answer runs inside its batch's call
            _planned.pop(key, None)


def _cohort_client(
    message: Any, context: Any, client_of: Callable[[Any, Any], FederatedClient | None]
) -> FederatedClient | None:
    """The message's client when it is a plain train message of a cohort-form client asking for it."""
    if not str(message.metadata.message_type).startswith("train"):
        return None
    config = config_record(message.content, keys.CONFIG)
    if config is None or not bool(config.get(keys.VECTORISE, False)):
        return None
    try:
        client = client_of(message, context)
    except Exception:  # the message's own run raises it, reported
        return None
    return client if getattr(client, "cohort_form", False) else None


@dataclass
class Group:
    """Messages that train together: the same global model (byte for byte), architecture, SGD, device."""

    settings: tuple[Any, ...]
    record: Any  # the first member's ArrayRecord (a batch's messages often share one)
    arrays: dict[str, np.ndarray]
    members: list[tuple[Any, FederatedClient]]

    def takes(self, settings: tuple[Any, ...], record: Any, arrays: dict[str, np.ndarray]) -> bool:
        """Whether a message with these settings and global model trains with this group."""
        if settings != self.settings:
            return False
        return record is self.record or all(
            np.array_equal(self.arrays[name], values) for name, values in arrays.items()
        )


def _group_settings(client: FederatedClient) -> tuple[tuple[Any, ...], Any, dict[str, np.ndarray]] | None:
    """The client's group settings, its global model's record and bytes (None: it trains on its own)."""
    try:
        record = client.incoming_arrays()
        arrays = {name: np.frombuffer(array.data, dtype=np.uint8) for name, array in record.items()}
        sgd = client.train_settings(0, client.cohort_proximal_mu())  # the settings but the data's size
        shapes = tuple((name, values.size) for name, values in arrays.items())
        return (shapes, str(client.config[keys.MODEL_SPEC]), sgd, str(client.device)), record, arrays
    except Exception:  # trains on its own, where the error (if any) is reported
        return None


def _join_group(groups: list[Group], message: Any, client: FederatedClient) -> None:
    """Add the message to the group it trains with (the same record, or equal bytes), or a new one.

    Exact comparison (``memcmp`` speed) rather than a digest of every message's 0.44 MB: hashing
    took about 1 ms per message on the GPU machine, a tenth of a 1000-client round's whole budget.
    """
    found = _group_settings(client)
    if found is None:
        return
    settings, record, arrays = found
    for group in groups:
        if group.takes(settings, record, arrays):
            group.members.append((message, client))
            return
    groups.append(Group(settings=settings, record=record, arrays=arrays, members=[(message, client)]))


def _train_group(members: list[tuple[Any, FederatedClient]]) -> list[str]:
    """Train one group with ``train_cohort`` and record each member's result; the keys recorded."""
    first = members[0][1]
    try:
        model = first.global_model()
        global_params = {n: p.detach().clone() for n, p in model.named_parameters()}
        datasets = [client.local_data() for _, client in members]
        settings = [
            client.train_settings(len(data), client.cohort_proximal_mu())
            for data, (_, client) in zip(datasets, members, strict=True)
        ]
        plan = plan_from_generators(
            [client.generator("data-order") for _, client in members],
            np.array([len(data) for data in datasets], dtype=np.int64),
            epochs=settings[0].epochs,
            batch_size=settings[0].batch_size,
            dropout=has_dropout(model),
        )
        result = train_cohort(
            model, global_params, [d.x for d in datasets], [d.y for d in datasets], plan,
            lr=settings[0].lr, momentum=settings[0].momentum, proximal_mu=settings[0].proximal_mu,
            device=first.device,
        )  # fmt: skip
    except Exception:  # e.g. a model train_cohort refuses: each message trains (and reports) on its own
        return []
    # one transfer per parameter for the whole cohort; each message's own work after training
    # (the update, clipping, local noise, its reply) then runs on the CPU (FederatedClient.device)
    result = result.to("cpu")
    for index, (message, _) in enumerate(members):
        _planned[message_key(message)] = Planned(
            settings=settings[index], params=result.client(index), loss=float(result.losses[index])
        )
    return [message_key(message) for message, _ in members]
