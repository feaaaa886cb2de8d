"""The train messages of one batch trained as one vectorised computation before their clients run.

When the train config asks for it (``keys.VECTORISE``, from ``simulation.vectorise``),
:func:`trained_vectorised` looks at every plain train message of an actor's batch, builds its client
and asks what its local training is (:meth:`clients.base.FederatedClient.local_sgd`). Every client
whose class keeps the contract's own :meth:`~clients.base.FederatedClient.train_locally` and states a
local SGD joins a group with the messages that share its global model, architecture and SGD settings;
each group of two or more is trained by :func:`fl_app.engine.vectorised_training.train_vectorised`
(a per-client gradient correction is stacked). Then the batch's messages run one by one through the
ClientApp as before, and a client's ``train_locally()`` takes its message's result
(:func:`served_training`) when it asks for exactly what was trained; everything else a client does
(clipping, local noise, randomized response, its reply) still runs per message, with its own
generators.

Nothing here is the algorithm author's concern. A client class whose trained results go unused (it
asked for other settings, or never called ``train_locally``) is named once in the log, and its
messages train one by one from then on in this process; a model the vectorised trainer refuses, too.

The result equals the per-message path to float tolerance (``tests/test_vectorised.py``), not
bit for bit: batched kernels sum in other orders.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from logging import WARNING
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.common import log

from fl_app import keys
from fl_app.engine.vectorised_training import has_dropout, plan_for_clients, train_vectorised
from fl_app.learning.records import config_record
from fl_app.learning.training import LocalSGD

if TYPE_CHECKING:
    from clients.base import FederatedClient

#: The fewest messages worth one computation.
MIN_GROUP = 2


@dataclass
class Planned:
    """One message's local training, done in its cohort: what it was planned for, and the result."""

    sgd: LocalSGD
    params: dict[str, torch.Tensor]
    loss: float
    client_class: type
    taken: bool = False

    @property
    def state(self) -> dict[str, np.ndarray]:
        """The trained parameters as numpy arrays (views, not copies)."""
        return {name: value.detach().cpu().numpy() for name, value in self.params.items()}


_planned: dict[str, Planned] = {}
#: Client classes whose cohort results went unused in this process: they train one by one.
_declined: set[type] = set()


def message_key(message: Any) -> str:
    """What identifies a message within a batch (its id; the engine numbers batched messages)."""
    return str(message.metadata.message_id) or f"object-{id(message)}"


def served_training(message: Any, sgd: LocalSGD) -> Planned | None:
    """The message's local training, done in its cohort with exactly ``sgd``, if it was (then taken)."""
    planned = _planned.get(message_key(message))
    if planned is None or not planned.sgd.same_as(sgd):
        return None
    planned.taken = True
    return planned


@contextmanager
def trained_vectorised(
    jobs: Sequence[tuple[Any, Any]], client_of: Callable[[Any, Any], FederatedClient | None]
) -> Iterator[int]:
    """Train the batch's vectorisable train messages together; yield how many were trained so.

    Parameters
    ----------
    jobs : Sequence of (Message, Context)
        An actor's batch (:func:`fl_app.engine.batching.run_jobs`).
    client_of : callable
        The client the ClientApp would build for a plain train message, when its local training is
        the contract's (:func:`clients.base.trains_by_the_contract`); None for any other (a SecAgg+
        stage, a client with its own loop; may raise).

    """
    groups: list[Group] = []
    for message, context in jobs:
        if message_key(message) in _planned:
            continue  # trained already, with the batch it came in (a packed message's member)
        client = _vectorisable_client(message, context, client_of)
        if client is not None:
            _join_group(groups, message, client)
    added: list[str] = []
    try:
        for group in groups:
            if len(group.members) >= MIN_GROUP:
                added += _train_group(group)
        yield len(added)
    finally:
        for key in added:  # only this call's: a packed message's answer runs inside its batch's call
            planned = _planned.pop(key, None)
            if planned is not None and not planned.taken:
                _decline(
                    planned.client_class,
                    "its train_locally() did not take the result (other settings, or no call)",
                )


def _decline(client_class: type, reason: str) -> None:
    """Train ``client_class``'s messages one by one in this process from now on; say so once."""
    if client_class in _declined:
        return
    _declined.add(client_class)
    log(
        WARNING,
        "simulation.vectorise: %s's clients train one by one (%s)",
        client_class.__name__,
        reason,
    )


def _vectorisable_client(
    message: Any, context: Any, client_of: Callable[[Any, Any], FederatedClient | None]
) -> FederatedClient | None:
    """The message's client when it is a plain train message whose local training the engine may run."""
    if not str(message.metadata.message_type).startswith("train"):
        return None
    config = config_record(message.content, keys.CONFIG)
    if config is None or not bool(config.get(keys.VECTORISE, False)):
        return None
    try:
        client = client_of(message, context)
    except Exception:  # the message's own run raises it, reported
        return None
    if client is None or type(client) in _declined:
        return None
    return client


@dataclass
class Group:
    """Messages that train together: the same global model (byte for byte), architecture, SGD, device."""

    settings: tuple[Any, ...]
    record: Any  # the first member's ArrayRecord (a batch's messages often share one)
    arrays: dict[str, np.ndarray]
    members: list[tuple[Any, FederatedClient, LocalSGD]]

    def takes(self, settings: tuple[Any, ...], record: Any, arrays: dict[str, np.ndarray]) -> bool:
        """Whether a message with these settings and global model trains with this group."""
        if settings != self.settings:
            return False
        return record is self.record or all(
            np.array_equal(self.arrays[name], values) for name, values in arrays.items()
        )


def _group_key(
    client: FederatedClient,
) -> tuple[tuple[Any, ...], Any, dict[str, np.ndarray], LocalSGD] | None:
    """The client's group settings, its global model's record and bytes, its SGD (None: on its own)."""
    try:
        sgd = client.local_sgd()
        assert sgd is not None
        record = client.incoming_arrays()
        arrays = {name: np.frombuffer(array.data, dtype=np.uint8) for name, array in record.items()}
        shapes = tuple((name, values.size) for name, values in arrays.items())
        correction = None if sgd.correction is None else tuple(sorted(sgd.correction))
        return (
            (shapes, str(client.config[keys.MODEL_SPEC]), sgd, correction, str(client.device)),
            record,
            arrays,
            sgd,
        )
    except Exception:  # trains on its own, where the error (if any) is reported
        return None


def _join_group(groups: list[Group], message: Any, client: FederatedClient) -> None:
    """Add the message to the group it trains with (the same record, or equal bytes), or a new one.

    Exact comparison (``memcmp`` speed) rather than a digest of every message's 0.44 MB: hashing
    took about 1 ms per message on the GPU machine, a tenth of a 1000-client round's whole budget.
    """
    found = _group_key(client)
    if found is None:
        return
    settings, record, arrays, sgd = found
    for group in groups:
        if group.takes(settings, record, arrays):
            group.members.append((message, client, sgd))
            return
    groups.append(Group(settings=settings, record=record, arrays=arrays, members=[(message, client, sgd)]))


def _stacked_corrections(
    members: list[tuple[Any, FederatedClient, LocalSGD]],
) -> dict[str, torch.Tensor] | None:
    """The members' gradient corrections stacked by parameter name (None: no correction)."""
    first = members[0][2].correction
    if first is None:
        return None
    return {
        name: torch.as_tensor(np.stack([np.asarray(sgd.correction[name]) for _, _, sgd in members]))  # type: ignore[index]
        for name in first
    }


def _train_group(group: Group) -> list[str]:
    """Train one group with ``train_vectorised`` and record each member's result; the keys recorded."""
    members = group.members
    first, sgd = members[0][1], members[0][2]
    try:
        model = first.global_model()
        global_params = {n: p.detach().clone() for n, p in model.named_parameters()}
        datasets = [client.local_data() for _, client, _ in members]
        plan = plan_for_clients(
            seed=int(first.config.get(keys.SEED, 0)),
            clients=[client.client_id for _, client, _ in members],
            server_round=first.server_round,
            sizes=[len(data) for data in datasets],
            epochs=sgd.epochs,
            batch_size=sgd.batch_size,
            dropout=has_dropout(model),
        )
        result = train_vectorised(
            model, global_params, [d.x for d in datasets], [d.y for d in datasets], plan,
            lr=sgd.lr, momentum=sgd.momentum, proximal_mu=sgd.proximal_mu,
            corrections=_stacked_corrections(members), device=first.device,
        )  # fmt: skip
    except Exception as error:  # e.g. a model train_vectorised refuses: each message trains on its own
        _decline(type(first), f"the vectorised trainer cannot train it: {str(error).splitlines()[0][:200]}")
        return []
    # one transfer per parameter for the whole cohort; each message's own work after training
    # (the update, clipping, local noise, its reply) then runs on the CPU
    result = result.to("cpu")
    for index, (message, client, member_sgd) in enumerate(members):
        _planned[message_key(message)] = Planned(
            sgd=member_sgd,
            params=result.client(index),
            loss=float(result.losses[index]),
            client_class=type(client),
        )
    return [message_key(message) for message, _, _ in members]
