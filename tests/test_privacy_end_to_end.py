"""End-to-end privacy audit: every private strategy's real client and server code, one round.

``tests/test_privacy_audit.py`` samples mechanism primitives with parameters it computes itself;
it cannot see a strategy's calibration, its composition or its accountant. Here, for each private
strategy, the platform builds the run (``fl_app.run.server.make_run_context``), the strategy calibrates
its noise, ``configure_train`` (or the evaluation stage's ``configure_evaluate``) sends its real
messages, the real client (``clients/<name>.py``, through the ClientApp's dispatch) trains and
answers, the server releases (``aggregate_train``) and accounts, and the strategy reports its
epsilon after the round. The round is repeated many times on two neighbouring inputs, as the
strategy's unit says (one client present or absent, one client's data set replaced, one record
replaced or removed, one evaluated example replaced), each repetition in a run with another noise
seed (the privacy randomness: the cohort and every noise draw); the outputs are reduced to the
optimal scalar statistic (the projection on the direction in which the neighbours differ, or the
count of reports that agree with the first input) and :func:`fl_app.privacy.audit.audit_epsilon`
lower-bounds epsilon at the run's delta with Clopper-Pearson margins (confidence 0.99). A strategy
fails when the bound exceeds the epsilon it reported; a check on the bound's size makes sure the
audit could see a leak.

The neighbouring inputs are extreme, which makes the audit tight. Models start at zero (a
legitimate global model: DP must hold for every one) and inputs are zero, so one SGD step moves only
the output bias, by ``lr (p - y)``: a client whose labels are all 0 and one whose labels are 1..9
move it in exactly opposite directions (clipped to C: two updates 2C apart, the worst case of the
replacement relation), and a client with one example of every class does not move it at all. The
model is one linear layer (``audit_linear``, registered for these tests only): thousands of rounds
then take seconds.

Mutants of the code under test are caught (``test_audit_catches_*``): FedAvg+LDP calibrated with
sensitivity C instead of 2C, an accountant that halves the RDP epsilon, distributed noise sized in
the wrong units or off by 2x, and banded noise off by 2x.

DP-BandMF's noise spans rounds, so its audit runs three rounds per repetition (a client in two of
them) and reduces the whole release to one likelihood-ratio statistic.

What does not depend on the noise (a DP-FedAvg client's local training) is computed once per input
(and checked to be deterministic); everything else runs in every repetition. Distributed
DP-FedAvg's repetitions sum the clients' uploads exactly instead of running SecAgg+'s key exchange
and masks, which cancel in the sum (``ExactSumRound``; a test compares its releases with whole
protocol rounds', bit for bit). Only the data a client
holds (``FederatedClient.local_data``) is chosen by the test.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from algorithm_tests import declared
from conftest import (
    InProcessGrid,
    client_for,
    count_vectorised_trainings,
    dense_lower_toeplitz,
    error_reply,
    make_context,
    reply_to,
    settings_of,
)
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message
from torch import nn

import clients.dp_fedavg_secagg as ddp_client
from clients.base import FederatedClient
from clients.dpfl_bnn import BNN_PACKED_SIGNS, BNN_STATE_LATENT, unpack_signs
from clients.laplace_eval import INFERENCE_REPORTS
from clients.privatekt import KT_LABELS, KT_LABELS_ARRAY, decode_labels
from fl_app import keys
from fl_app.data.federated import ClientDataset, federated_data
from fl_app.engine.secagg import collect_reply, modular_integers
from fl_app.learning.model_spec import ModelSpec
from fl_app.learning.models import MODELS
from fl_app.privacy import calibration, composition, distributed
from fl_app.privacy.audit import AuditResult, audit_epsilon
from fl_app.privacy.rng import RandomSource
from fl_app.run.context import RunContext
from fl_app.run.roster import ClientInfo
from fl_app.run.server import make_run_context
from strategies import EVALUATION_STAGES, STRATEGIES
from strategies.arrays import flat_vector, split_vector
from strategies.dp_bandmf import strategy as bandmf_strategy
from strategies.dp_fedavg_secagg import strategy as secagg_strategy
from strategies.dp_fedavg_secagg.secagg import SecAggRound
from strategies.laplace_eval.stage import LaplaceEvalStage

#: Digits (8x8) with the MLP: one SGD step of lr 1 on at most 10 examples (batch 16).
COMMON = ["dataset=digits", "model=mlp", "num_rounds=1", "lr=1.0", "batch_size=16", "local_epochs=1"]
#: The audits' delta: large enough that the bound is reachable with a few thousand runs.
DELTA = 0.01
CONFIDENCE = 0.99


#: The audits' model: one linear layer (two arrays), registered for these tests only.
AUDIT_MODEL = "audit_linear"
#: Digits (8x8): one SGD step of lr 1 on at most 10 examples (batch 16), one round.
COMMON = [
    "dataset=digits",
    f"model={AUDIT_MODEL}",
    "num_rounds=1",
    "lr=1.0",
    "batch_size=16",
    "local_epochs=1",
]
#: The audits' delta. Each strategy reports its epsilon at the run's ``privacy.delta``; the audit
#: tests that claim at the same delta. Gaussian mechanisms are audited at 0.1, where the hockey-stick
#: divergence is decided by events a few thousand rounds can estimate (at 1e-5 the bound would stay
#: far below any epsilon); pure mechanisms (randomized response, Laplace) at 0.01.
GAUSSIAN_DELTA = 0.1
PURE_DELTA = 0.01
CONFIDENCE = 0.99


class AuditLinear(nn.Module):
    """Logits ``W x + b`` of the flattened input: the cheapest model the clients can train."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.linear = nn.Linear(int(np.prod(input_shape)), num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits."""
        return self.linear(torch.flatten(x, 1))


def clear_privacy_caches() -> None:
    """Forget memoised epsilons and calibrations (a mutant must not leak into other tests)."""
    composition._compose.cache_clear()
    calibration._DP_SGD_CACHE.clear()
    calibration._HISTORIES_CACHE.clear()
    calibration.dp_fedavg_noise_multiplier.cache_clear()
    secagg_strategy._plan.cache_clear()


@pytest.fixture(autouse=True)
def audit_setup(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The audit model, one torch thread (thousands of tiny steps), quiet logs, clean caches."""
    monkeypatch.setitem(MODELS, AUDIT_MODEL, AuditLinear)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.ERROR)
    clear_privacy_caches()
    yield
    clear_privacy_caches()
    logger.setLevel(level)
    torch.set_num_threads(threads)


# ------------------------------------------------------------------------------ inputs


def examples(labels: Sequence[int], shape: tuple[int, ...] = (1, 8, 8)) -> ClientDataset:
    """Examples with the given labels and all-zero inputs (only the output bias can learn from them)."""
    return ClientDataset(
        np.zeros((len(labels), *shape), dtype=np.float32), np.asarray(labels, dtype=np.int64)
    )


ZEROS = examples([0] * 9)  # one step moves the output bias along +(e_0 - 1/10)
OTHERS = examples(list(range(1, 10)))  # ... along -(e_0 - 1/10)
UNIFORM = examples(list(range(10)))  # ... not at all (the softmax of a zero model is uniform)


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> dict[int, ClientDataset]:
    """What each client holds (by client id); the audit swaps one client's entry between inputs."""
    data: dict[int, ClientDataset] = {}
    monkeypatch.setattr(FederatedClient, "local_data", lambda self: data[self.client_id])
    return data


def audit_run(overrides: Sequence[str], tmp_path: Path, sizes: Sequence[int], delta: float) -> RunContext:
    """The platform's RunContext for a federation whose clients hold ``sizes`` examples."""
    settings = settings_of([*COMMON, f"num_clients={len(sizes)}", f"privacy.delta={delta}", *overrides])
    data = federated_data(settings.data)
    roster = [ClientInfo(i, 1000 + i, int(n)) for i, n in enumerate(sizes)]
    model = ModelSpec(
        STRATEGIES.get(settings.strategy).declaration.model_name(settings, data.input_shape),
        data.input_shape,
        data.num_classes,
    )
    return make_run_context(settings, roster=roster, data=data, model_spec=model, output_dir=tmp_path)


def zero_model(run: RunContext) -> ArrayRecord:
    """All-zero arrays of the run's model."""
    state = run.model_spec.build().state_dict()
    return ArrayRecord({k: Array(np.zeros(tuple(v.shape), dtype=np.float32)) for k, v in state.items()})


def bias_direction(arrays: ArrayRecord, first: int = 0, second: int | None = None) -> np.ndarray:
    """Unit vector on the output bias: ``e_first - e_second``, or ``e_first - 1/10`` without ``second``."""
    parts = []
    for name in arrays:
        part = np.zeros(arrays[name].numpy().shape)
        if name.endswith("bias") and part.shape == (10,):
            part[:] = 0.0 if second is not None else -0.1
            part[first] += 1.0
            if second is not None:
                part[second] -= 1.0
        parts.append(part.ravel())
    direction = np.concatenate(parts)
    return direction / np.linalg.norm(direction)


def reseeded(strategy: Any, seed: int) -> Any:
    """``strategy`` in a run whose privacy randomness has seed ``seed`` (one independent repetition)."""
    run = dataclasses.replace(strategy.run, noise=RandomSource(seed=seed))
    strategy.run = run
    for part in (getattr(strategy, "cohorts", None), getattr(strategy, "replies", None)):
        if part is not None:  # its collaborators draw from the same run
            part.run = run
    return strategy


def train_message(strategy: Any, arrays: ArrayRecord, client: int) -> Message | None:
    """The round-1 train message the strategy sends ``client`` (None: not in this round's cohort)."""
    for message in strategy.configure_train(1, arrays, ConfigRecord(), grid=None):
        if int(message.metadata.dst_node_id) == 1000 + client:
            return message
    return None


def context_of(message: Message, client: int, num_clients: int) -> Context:
    return make_context(partition_id=client, num_partitions=num_clients, node_id=message.metadata.dst_node_id)


def run_client(message: Message, client: int, num_clients: int, context: Context | None = None) -> Message:
    """The real ClientApp dispatch of one train message on a simulated node."""
    return client_for(message, context or context_of(message, client, num_clients)).train()


#: One train message of :func:`repeat`: (message, client, number of clients, the node's context or None).
Call = tuple[Message, int, int, Context | None]
#: How many repetitions :func:`repeat` hands :func:`run_clients` at once (the vectorised path trains
#: them as one cohort, as an actor trains a batch).
CHUNK = 250


def run_clients(calls: Sequence[Call]) -> list[Message]:
    """:func:`run_client` on each call, in order (the vectorised fixture runs them as one batch)."""
    return [run_client(*call) for call in calls]


def repeat(
    strategy: Any,
    start: ArrayRecord,
    held: dict[int, ClientDataset],
    inputs: Sequence[ClientDataset],
    statistic: Callable[[Message], float],
    trials: int,
    *,
    context: Callable[[int, Message], Context] | None = None,
) -> list[np.ndarray]:
    """Client 0 holds each input in turn; ``trials`` rounds per input, each with fresh noise seeds.

    Every repetition is the strategy's ``configure_train`` and the client's ``train``.
    """
    outputs = []
    for world, data in enumerate(inputs):
        held[0] = data
        values: list[float] = []
        for first in range(0, trials, CHUNK):
            calls: list[Call] = []
            for trial in range(first, min(first + CHUNK, trials)):  # each message carries its own seeds
                message = train_message(reseeded(strategy, 2 * trial + world), start, 0)
                assert message is not None
                node = None if context is None else context(world, message)
                calls.append((message, 0, strategy.run.num_clients, node))
            values += [statistic(reply) for reply in run_clients(calls)]
        outputs.append(np.asarray(values))
    return outputs


def reported_after_one_round(strategy: Any, start: ArrayRecord) -> float:
    """Run one real round (every selected client answers) and return the epsilon the strategy reports."""
    reseeded(strategy, 99_999)
    messages = list(strategy.configure_train(1, start, ConfigRecord(), grid=None))
    replies = [run_client(m, int(m.metadata.dst_node_id) - 1000, strategy.run.num_clients) for m in messages]
    strategy.aggregate_train(1, replies)
    return float(strategy.epsilon().epsilon)


def projection(direction: np.ndarray) -> Callable[[Message], float]:
    """The upload's coordinate along ``direction`` (the optimal statistic for Gaussian noise)."""

    def statistic(reply: Message) -> float:
        return float(flat_vector(reply.content.array_records[keys.ARRAYS]) @ direction)

    return statistic


def audit(
    outputs_a: np.ndarray, outputs_b: np.ndarray, *, delta: float, discrete: bool = False
) -> AuditResult:
    return audit_epsilon(
        outputs_a=outputs_a, outputs_b=outputs_b, delta=delta, discrete=discrete, confidence=CONFIDENCE
    )


@dataclasses.dataclass(frozen=True)
class Audited:
    """One strategy's audit: the lower bound from its outputs and the epsilon it reported."""

    result: AuditResult
    reported: float

    @property
    def holds(self) -> bool:
        return self.result.passes(self.reported)

    def __str__(self) -> str:
        return (
            f"outputs show epsilon >= {self.result.epsilon_lower_bound:.3f} ({self.result.best_set}); "
            f"the strategy reported {self.reported:.3f}"
        )


# ------------------------------------------------------------------------------ one round per strategy

AuditFunction = Callable[[Path, dict[int, ClientDataset], int], "Audited"]
AUDITS: dict[str, tuple[AuditFunction, int, float]] = {}


def audit_of(name: str, *, rounds: int, power: float) -> Callable[[AuditFunction], AuditFunction]:
    """Register the decorated function as ``name``'s one-round audit (``rounds`` per input; it must find
    at least ``power`` times the reported epsilon, or passing would prove nothing)."""

    def register(function: AuditFunction) -> AuditFunction:
        AUDITS[name] = (function, rounds, power)
        return function

    return register


@audit_of("dp_fedavg", rounds=4000, power=0.15)  # a Poisson mixture at q = 1/2: a weaker statistic
def dp_fedavg_audit(tmp_path: Path, held: dict[int, ClientDataset], trials: int) -> Audited:
    """DP-FedAvg, add or remove one client: client 0 holds ZEROS or is absent (a zero update).

    Poisson sampling at q = 1/2 from the privacy randomness, server clipping (C = 0.1), central
    noise: the released model projected on client 0's clipped update. Client 1 moves nothing.
    """
    overrides = ["clients_per_round=1", "strategy.clip=0.1", "privacy.epsilon=2"]
    return central_update_audit("dp_fedavg", overrides, [9, 10], tmp_path, held, trials)


def central_update_audit(
    name: str,
    overrides: Sequence[str],
    sizes: Sequence[int],
    tmp_path: Path,
    held: dict[int, ClientDataset],
    trials: int,
) -> Audited:
    """A central-DP strategy, client 0 present (holding ZEROS) or absent (a zero update, as a failure).

    The strategy's real ``configure_train`` (its cohort) and ``aggregate_train`` (clipping, noise,
    server step) run for every trial with fresh privacy randomness; client 0's update is its real
    local training, computed once (training has no noise). The released model is projected on the
    output bias, where an all-zero client moves its update.
    """
    run = audit_run([f"strategy={name}", *overrides], tmp_path, sizes, GAUSSIAN_DELTA)
    strategy = STRATEGIES.get(name)(run)
    start = zero_model(run)
    held.update({0: ZEROS, **{client: UNIFORM for client in range(1, len(sizes))}})
    trained = {}
    for client in range(len(sizes)):
        seed = next(s for s in range(10_000) if train_message(reseeded(strategy, s), start, client))
        message = train_message(reseeded(strategy, seed), start, client)
        assert message is not None
        first, second = run_client(message, client, len(sizes)), run_client(message, client, len(sizes))
        assert np.array_equal(
            flat_vector(first.content.array_records[keys.ARRAYS]),
            flat_vector(second.content.array_records[keys.ARRAYS]),
        )
        trained[client] = first.content.array_records[keys.ARRAYS]
    direction = bias_direction(start)
    outputs = []
    for world, present in enumerate((True, False)):
        values = []
        for trial in range(trials):
            fresh = reseeded(STRATEGIES.get(name)(run), 2 * trial + world)
            messages = list(fresh.configure_train(1, start, ConfigRecord(), grid=None))
            replies = central_replies(fresh, messages, trained, present)
            arrays, _ = fresh.aggregate_train(1, replies)
            values.append(float(flat_vector(arrays) @ direction))
        outputs.append(np.asarray(values))
    reported = STRATEGIES.get(name)(run)
    list(reported.configure_train(1, start, ConfigRecord(), grid=None))
    reported.aggregate_train(1, [])
    return Audited(audit(*outputs, delta=run.settings.privacy.delta), float(reported.epsilon().epsilon))


def central_replies(
    strategy: Any, messages: list[Message], trained: dict[int, ArrayRecord], present: bool
) -> list[Message]:
    """Each client's reply with its trained arrays; client 0's an error when it is absent."""
    return [
        error_reply(m, "absent")
        if int(m.metadata.dst_node_id) == 1000 and not present
        else reply_to(m, arrays=trained[int(m.metadata.dst_node_id) - 1000])
        for m in messages
    ]


@audit_of("dp_fedavg_adaptive", rounds=4000, power=0.1)  # as dp_fedavg; the count is not looked at
def dp_fedavg_adaptive_audit(tmp_path: Path, held: dict[int, ClientDataset], trials: int) -> Audited:
    """Adaptive clipping, add or remove one client; Poisson q = 1/2 from the privacy randomness.

    The model alone is the statistic (the noised clipped count is released too, so the audit sees
    less than the combined release the accountant charges).
    """
    overrides = [
        "clients_per_round=1",
        "strategy.initial_clip=0.1",
        "strategy.bit_noise=5",
        "privacy.epsilon=2",
    ]
    return central_update_audit("dp_fedavg_adaptive", overrides, [9, 10], tmp_path, held, trials)


@audit_of("dp_ftrl", rounds=1500, power=0.3)  # one tree leaf: the Gaussian mechanism with z
def dp_ftrl_audit(tmp_path: Path, held: dict[int, ClientDataset], trials: int) -> Audited:
    """DP-FTRL, zero-out neighbours: the one scheduled client's update is its own or zero (one leaf)."""
    overrides = ["clients_per_round=1", "strategy.clip=0.1", "privacy.epsilon=2"]
    return central_update_audit("dp_ftrl", overrides, [9], tmp_path, held, trials)


@audit_of("dp_bandmf", rounds=1500, power=0.3)  # two participations in three rounds of correlated noise
def dp_bandmf_audit(tmp_path: Path, held: dict[int, ClientDataset], trials: int) -> Audited:
    """DP-BandMF over three rounds, two bands: a client takes part in rounds 1 and 3 (its group's) or not.

    Two clients in two public groups (q = 1); the first group's client's update is its real local
    training from the zero model (ZEROS), replayed against each round's model (a fixed update is one
    an adversary may choose); the other client's is zero. Each repetition runs the strategy's three
    rounds with fresh privacy randomness. The statistic is the likelihood ratio of the whole
    release: the per-round noisy sums ``s = m (w_{t+1} - w_t)`` along the update's direction,
    whitened by the public matrix (``C s = C x + z``, ``z`` i.i.d.), projected on ``C e`` (``e``: the
    rounds the client is in). It sees the correlated noise, the bands and the calibration at once.
    """
    overrides = [
        "strategy=dp_bandmf",
        "num_rounds=3",
        "clients_per_round=1",
        "strategy.bands=2",
        "strategy.clip=0.1",
        "privacy.epsilon=2",
    ]
    run = audit_run(overrides, tmp_path, [9, 10], GAUSSIAN_DELTA)
    start = zero_model(run)
    strategy = STRATEGIES.get("dp_bandmf")(run)
    first = next(i.client_id for i in strategy.group_of_round(1))
    held.update({first: ZEROS, 1 - first: UNIFORM})
    message = next(m for m in strategy.configure_train(1, start, ConfigRecord(), grid=None))
    trained = flat_vector(run_client(message, first, 2).content.array_records[keys.ARRAYS])
    update = trained - flat_vector(start)
    rounds = [t for t in range(1, 4) if first in {i.client_id for i in strategy.group_of_round(t)}]
    assert rounds == [1, 3]
    matrix = dense_lower_toeplitz(strategy.matrix.coefficients, 3)
    signature = matrix @ np.array([1.0 if t in rounds else 0.0 for t in range(1, 4)])

    return correlated_audit(
        lambda: STRATEGIES.get("dp_bandmf")(run),
        run=run,
        start=start,
        first=first,
        update=update,
        matrix=matrix,
        signature=signature,
        trials=trials,
    )


def correlated_audit(
    make: Callable[[], Any],
    *,
    run: RunContext,
    start: ArrayRecord,
    first: int,
    update: np.ndarray,
    matrix: np.ndarray,
    signature: np.ndarray,
    trials: int,
) -> Audited:
    """The audit of a correlated-noise strategy over ``len(matrix)`` rounds (banded MF, BLT).

    Each repetition runs a fresh strategy from ``make`` with fresh privacy randomness; client
    ``first`` replies ``update`` (present) or fails (absent), every other client replies the model
    it received. The statistic: the per-round noisy sums along the update's direction, whitened by
    the public ``matrix`` and projected on ``signature`` (``matrix`` times the client's rounds).
    """
    direction = update / np.linalg.norm(update)

    def released(fresh: Any, present: bool) -> float:
        current, sums = start, []
        for t in range(1, len(matrix) + 1):
            replies = []
            for m in fresh.configure_train(t, current, ConfigRecord(), grid=None):
                if int(m.metadata.dst_node_id) - 1000 == first:
                    moved = shifted(current, update)
                    replies.append(reply_to(m, arrays=moved) if present else error_reply(m, "absent"))
                else:
                    replies.append(reply_to(m, arrays=current))
            new, _ = fresh.aggregate_train(t, replies)
            assert new is not None
            sums.append((flat_vector(new) - flat_vector(current)) @ direction)
            current = new
        return float((matrix @ np.asarray(sums)) @ signature)

    outputs = [
        np.asarray([released(reseeded(make(), 2 * k + w), w == 0) for k in range(trials)]) for w in range(2)
    ]
    reporter = reseeded(make(), 99_999)
    released(reporter, True)
    return Audited(audit(*outputs, delta=run.settings.privacy.delta), float(reporter.epsilon().epsilon))


def shifted(arrays: ArrayRecord, update: np.ndarray) -> ArrayRecord:
    """``arrays`` moved by the flat vector ``update`` (float32, as a client uploads)."""
    names = list(arrays.keys())
    parts = split_vector(flat_vector(arrays) + update, [arrays[n].numpy() for n in names])
    return ArrayRecord({n: Array(p.astype(np.float32)) for n, p in zip(names, parts, strict=True)})


class ExactSumRound(SecAggRound):
    """SecAgg+'s server with the key exchange and the masks left out: the uploads are summed as they are.

    A test double for the audits of distributed DP-FedAvg's noise: the masks cancel
    in the sum mod ``2^b``, so what the server releases is the same, bit for bit
    (:func:`test_the_exact_sum_double_releases_what_secagg_plus_releases`), while a round costs a
    quarter of a whole protocol's (7-10 ms against 25-39, mostly Flower's key agreement, Shamir
    shares and records; measured alternately, 40 rounds at a time). The strategy's
    calibration, selection, reply checks, modular sum, decoding and accounting, and each client's
    training and encoding, run as in a real round.
    """

    def setup_and_share_keys(self) -> set[int]:
        self.neighbours = {nid: set(self.nodes) for nid in self.nodes}
        self.keyed = set(self.nodes)
        self.forward = {nid: ([], []) for nid in self.nodes}
        return set(self.keyed)

    def unmask(
        self, masked_total: list[np.ndarray], survivors: set[int], *, charge: Callable[[], None]
    ) -> list[np.ndarray]:
        self.check_parts(survivors)
        charge()
        return [np.mod(t, self.modulus) for t in masked_total]


class ExactSumGrid(InProcessGrid):
    """Answers each collect-stage message with its node's client's vector, unmasked (the mod's double)."""

    def __init__(self, num_partitions: int, *, modulus: int) -> None:
        super().__init__(num_partitions)
        self.modulus = modulus

    def answer(self, message: Message, context: Context, *, plain_flower: bool) -> Message:  # type: ignore[override]
        reply = client_for(message, context).train()
        return collect_reply(message, reply, lambda vectors: modular_integers(vectors, self.modulus))


#: Distributed DP-FedAvg's audit: three clients (the fewest a released sum may hold), all in the round.
SECAGG_AUDIT = [
    "strategy=dp_fedavg_secagg",
    "clients_per_round=3",
    "strategy.clip=0.1",
    "strategy.min_survivors=1.0",
    "privacy.epsilon=2",
]


def secagg_released(strategy: Any, start: ArrayRecord, *, exact_sum: bool) -> ArrayRecord:
    """The model one round of ``strategy`` releases: a whole SecAgg+ round in process, or with the
    masks' exact sum in its place (:class:`ExactSumRound`)."""
    grid = ExactSumGrid(3, modulus=1 << strategy.settings.bits) if exact_sum else InProcessGrid(3)
    double = mock.patch.object(secagg_strategy, "SecAggRound", ExactSumRound)
    with double if exact_sum else nullcontext():
        replies = grid.send_and_receive(list(strategy.configure_train(1, start, ConfigRecord(), grid)))
        new, _ = strategy.aggregate_train(1, replies)
    assert new is not None
    return new


@audit_of("dp_fedavg_secagg", rounds=800, power=0.2)  # one Skellam sum of 3 shares: 0.54 of 2.0
def dp_fedavg_secagg_audit(tmp_path: Path, held: dict[int, ClientDataset], trials: int) -> Audited:
    """Distributed DP-FedAvg, zero-out neighbours: client 0's update is its own (ZEROS) or zero (UNIFORM).

    Three clients (clients 1 and 2 hold UNIFORM), all in the round. Every repetition is the
    strategy's round and each node's client (clip, rotation, rounding, Skellam noise) with the
    masks' exact sum in place of the SecAgg+ protocol (:class:`ExactSumRound`: the same release bit
    for bit, :func:`test_the_exact_sum_double_releases_what_secagg_plus_releases`; a whole protocol
    round costs about four times as much). The statistic is the released model on the output bias.
    """
    run = audit_run(SECAGG_AUDIT, tmp_path, [9, 10, 10], GAUSSIAN_DELTA)
    start = zero_model(run)
    held[1] = held[2] = UNIFORM
    direction = bias_direction(start)
    strategy = STRATEGIES.get("dp_fedavg_secagg")(run)  # reseeded for every round (its ledger grows)
    outputs = []
    for world, data in enumerate((ZEROS, UNIFORM)):
        held[0] = data
        values = [
            float(
                flat_vector(secagg_released(reseeded(strategy, 2 * t + world), start, exact_sum=True))
                @ direction
            )
            for t in range(trials)
        ]
        outputs.append(np.asarray(values))
    reporter = reseeded(STRATEGIES.get("dp_fedavg_secagg")(run), 99_999)
    secagg_released(reporter, start, exact_sum=True)
    return Audited(audit(*outputs, delta=run.settings.privacy.delta), float(reporter.epsilon().epsilon))


@audit_of("fedavg_ldp", rounds=1500, power=0.3)
def fedavg_ldp_audit(tmp_path: Path, held: dict[int, ClientDataset], trials: int) -> Audited:
    """FedAvg+LDP, replace a client's data set: ZEROS or OTHERS, clipped updates exactly 2C apart."""
    run = audit_run(
        ["strategy=fedavg_ldp", "clients_per_round=1", "strategy.clip=0.1", "privacy.epsilon=2"],
        tmp_path,
        [9],
        GAUSSIAN_DELTA,
    )
    strategy = STRATEGIES.get("fedavg_ldp")(run)
    start = zero_model(run)
    a, b = repeat(strategy, start, held, (ZEROS, OTHERS), projection(bias_direction(start)), trials)
    return Audited(audit(a, b, delta=run.settings.privacy.delta), reported_after_one_round(strategy, start))


@audit_of("nbafl", rounds=1500, power=0.3)  # client level: uploads exactly 2C apart
def nbafl_audit(tmp_path: Path, held: dict[int, ClientDataset], trials: int) -> Audited:
    """NbAFL, replace a client's data set (its proven unit): ZEROS or OTHERS.

    From a zero model one step gives parameter vectors along +-(e_0 - 1/10) on the output bias,
    each clipped to C = 0.1: exactly 2C apart, the client-level sensitivity the accountant
    assumes. K = N = 1, T = 1 (no downlink noise): the released model is the client's noised upload.
    """
    run = audit_run(
        ["strategy=nbafl", "clients_per_round=1", "strategy.clip=0.1", "privacy.epsilon=2"],
        tmp_path,
        [9],
        GAUSSIAN_DELTA,
    )
    strategy = STRATEGIES.get("nbafl")(run)
    assert strategy.unit == "client"
    start = zero_model(run)
    direction = bias_direction(start)

    def released(reply: Message) -> float:
        arrays, _ = strategy.aggregate_train(1, [reply])  # the server's release (mean of K = 1 uploads)
        return float(flat_vector(arrays) @ direction)

    a, b = repeat(strategy, start, held, (ZEROS, OTHERS), released, trials)
    fresh = STRATEGIES.get("nbafl")(run)
    held[0] = ZEROS
    return Audited(audit(a, b, delta=run.settings.privacy.delta), reported_after_one_round(fresh, start))


@audit_of("privatekt", rounds=1500, power=0.5)
def privatekt_audit(tmp_path: Path, held: dict[int, ClientDataset], trials: int) -> Audited:
    """PrivateKT, replace a client's data set: its K = 2 predicted labels are all 0 (ZEROS) or all 1.

    The statistic is the number of uploaded labels equal to 0 (sufficient for K labels).
    """
    run = audit_run(
        ["strategy=privatekt", "clients_per_round=1", "strategy.k=2", "privacy.epsilon=3"],
        tmp_path,
        [9],
        PURE_DELTA,
    )
    strategy = STRATEGIES.get("privatekt")(run)
    start = zero_model(run)

    def zeros_reported(reply: Message) -> float:
        array = reply.content.array_records[KT_LABELS][KT_LABELS_ARRAY]
        return float(np.sum(decode_labels(array, k=2, num_classes=10) == 0))

    a, b = repeat(strategy, start, held, (ZEROS, OTHERS), zeros_reported, trials)
    held[0] = ZEROS
    return Audited(
        audit(a, b, delta=run.settings.privacy.delta, discrete=True),
        reported_after_one_round(strategy, start),
    )


@audit_of("dpfl_bnn", rounds=1000, power=0.3)
def dpfl_bnn_audit(tmp_path: Path, held: dict[int, ClientDataset], trials: int) -> Audited:
    """DPFL-BNN, replace a client's data set (which determines its latent weights): all d binary
    weights +1 or all -1 (latent state +-1, aggregate 0, a learning rate too small to flip a sign).

    The statistic is the number of uploaded bits equal to +1; the reported epsilon is the
    client-level one (d uses of RR_gamma per round), calibrated by default.
    """
    run = audit_run(
        [
            "strategy=dpfl_bnn",
            "clients_per_round=1",
            "lr=1e-6",
            "strategy.local_steps=1",
            "privacy.epsilon=4",
        ],
        tmp_path,
        [9],
        GAUSSIAN_DELTA,
    )
    strategy = STRATEGIES.get("dpfl_bnn")(run)
    parameters = dict(run.model_spec.build().named_parameters())
    start = ArrayRecord({n: Array(np.zeros(tuple(p.shape), dtype=np.float32)) for n, p in parameters.items()})
    d = strategy.num_bits

    def with_latent(world: int, message: Message) -> Context:
        context = context_of(message, 0, 1)
        sign = 1.0 if world == 0 else -1.0
        context.state[BNN_STATE_LATENT] = ArrayRecord(
            {n: Array(np.full(tuple(p.shape), sign, dtype=np.float32)) for n, p in parameters.items()}
        )
        return context

    def ones(reply: Message) -> float:
        packed = reply.content.array_records[keys.ARRAYS][BNN_PACKED_SIGNS].numpy()
        return float(np.sum(unpack_signs(packed, d, dtype=np.float64) > 0))

    a, b = repeat(strategy, start, held, (ZEROS, ZEROS), ones, trials, context=with_latent)
    return Audited(audit(a, b, delta=run.settings.privacy.delta), reported_after_one_round(strategy, start))


@audit_of("kd_dp", rounds=1000, power=0.25)
def kd_dp_audit(tmp_path: Path, held: dict[int, ClientDataset], trials: int) -> Audited:
    """KD-DP's teacher round, add or remove one record of the large-data client (its unit).

    The large client holds ten copies of one example of every class (their clipped gradients sum to
    zero) plus, or not, one example of class 0; one DP-SGD step over the whole set (q = 1) from a
    zero model. The statistic is the uploaded teacher's coordinate along that example's gradient.
    """
    run = audit_run(
        [
            "strategy=kd_dp",
            "num_rounds=2",
            "strategy.teacher_rounds=1",
            "batch_size=128",
            "strategy.clip=0.5",
            "privacy.epsilon=3",
        ],
        tmp_path,
        [101, 10],
        GAUSSIAN_DELTA,
    )
    strategy = STRATEGIES.get("kd_dp")(run)
    start = zero_model(run)
    background = list(range(10)) * 10
    held[1] = UNIFORM
    a, b = repeat(
        strategy,
        start,
        held,
        (examples([*background, 0]), examples(background)),
        projection(-bias_direction(start)),
        trials,
    )
    held[0] = examples([*background, 0])
    return Audited(audit(a, b, delta=run.settings.privacy.delta), reported_after_one_round(strategy, start))


@audit_of("laplace_eval", rounds=2000, power=0.4)
def laplace_eval_audit(tmp_path: Path, held: dict[int, ClientDataset], trials: int) -> Audited:
    """The clustering evaluation, replace one local example (its unit): the global model maps
    example a to (nearly) e_0 and example b to e_1, so their softmax vectors are 2 apart in L1.

    The statistic is the difference of the first two coordinates of that example's noised vector.
    """
    run = audit_run(
        [
            "strategy=fedavg",
            "clients_per_round=1",
            "evaluation=laplace_eval",
            "evaluation.laplace_eval_eps=2",
            "evaluation.cluster_client_num=1",
        ],
        tmp_path,
        [2],
        PURE_DELTA,
    )
    stage = LaplaceEvalStage(STRATEGIES.get("fedavg")(run))
    weight = np.zeros((10, 64), dtype=np.float32)
    weight[0, 0] = weight[1, 1] = 50.0
    model = ArrayRecord(
        {"linear.weight": Array(weight), "linear.bias": Array(np.zeros(10, dtype=np.float32))}
    )
    first, second = np.zeros((2, 1, 8, 8), dtype=np.float32), np.zeros((2, 1, 8, 8), dtype=np.float32)
    first[0, 0, 0, 0] = second[0, 0, 0, 1] = 1.0
    outputs = []
    for world, x in enumerate((first, second)):
        held[0] = ClientDataset(x, np.zeros(2, dtype=np.int64))
        values = []
        for trial in range(trials):
            reseeded(stage.inner, 2 * trial + world)
            (message,) = stage.configure_evaluate(1, model, ConfigRecord(), grid=None)
            reply = client_for(message, context_of(message, 0, 1)).evaluate()
            vectors = reply.content.array_records[INFERENCE_REPORTS]["softmax"].numpy()
            values.append(float(vectors[0, 0] - vectors[0, 1]))
        outputs.append(np.asarray(values))
    stage.aggregate_evaluate(1, [reply])
    return Audited(audit(*outputs, delta=run.settings.privacy.delta), float(stage.ledger.example_epsilon()))


#: Each private algorithm's one-round audit: name -> (audit, rounds per input, the least fraction of the
#: reported epsilon the audit must find). Filled by :func:`audit_of` here and by ``PRIVACY_AUDIT`` in an
#: algorithm's own test module (``tests/test_<name>.py``, :mod:`algorithm_tests`), so no list is kept.
for _name in [*STRATEGIES.names(), *EVALUATION_STAGES.names()]:
    if _name not in AUDITS and declared(_name, "PRIVACY_AUDIT") is not None:
        AUDITS[_name] = declared(_name, "PRIVACY_AUDIT")


# ------------------------------------------------------------------------------ tests


@pytest.mark.audit
@pytest.mark.parametrize("name", list(AUDITS))
def test_one_round_of_each_private_strategy_meets_the_epsilon_it_reports(name, tmp_path, held):
    function, trials, power = AUDITS[name]
    audited = function(tmp_path, held, trials)
    assert audited.holds, f"{name}: {audited}"
    # The audit can see a leak: the neighbours are extreme enough for the bound to reach a
    # good part of the reported epsilon (otherwise passing would prove nothing).
    assert audited.result.epsilon_lower_bound >= power * audited.reported, f"{name}: {audited}"


# ------------------------------------------------------------------------------ the vectorised path


@pytest.fixture
def vectorised(monkeypatch: pytest.MonkeyPatch, held: dict[int, ClientDataset]) -> list[int]:
    """Every audited train message runs as an actor runs a batch with ``simulation.vectorise``:
    beside a second client (client 1, holding OTHERS) through the engine's ``run_jobs``, trained as
    one computation (fl_app/engine/vectorised.py) before each builds its own reply. :func:`repeat`'s
    repetitions go :data:`CHUNK` at a time, each with its companion, in one batch (one cohort of
    2 x CHUNK members, as an actor trains its batch); a single message goes with its companion alone.
    Counts the trainings taken from the cohort (companions included)."""
    from fl_app.client_app import app
    from fl_app.engine.batching import run_jobs

    taken = count_vectorised_trainings(monkeypatch)

    def chunk_in_a_batch(calls: Sequence[Call]) -> list[Message]:
        held.setdefault(1, OTHERS)
        jobs = []
        for message, client, num_clients, context in calls:
            message.content.config_records[keys.CONFIG][keys.VECTORISE] = True
            companion = Message(
                content=message.content, dst_node_id=1001, message_type=message.metadata.message_type
            )
            jobs += [
                (message, context or context_of(message, client, max(num_clients, 2))),
                (companion, make_context(partition_id=1, num_partitions=max(num_clients, 2), node_id=1001)),
            ]
        outcomes = run_jobs(lambda: app, jobs)
        assert all(outcome[0] == "reply" for outcome in outcomes), [o for o in outcomes if o[0] != "reply"]
        return [outcome[1] for outcome in outcomes[::2]]

    def in_a_batch(
        message: Message, client: int, num_clients: int, context: Context | None = None
    ) -> Message:
        return chunk_in_a_batch([(message, client, num_clients, context)])[0]

    monkeypatch.setattr(sys.modules[__name__], "run_client", in_a_batch)
    monkeypatch.setattr(sys.modules[__name__], "run_clients", chunk_in_a_batch)
    return taken


@pytest.mark.audit
@pytest.mark.parametrize("name", ["fedavg_ldp", "nbafl"])
def test_the_vectorised_path_meets_the_epsilon_it_reports(name, tmp_path, held, vectorised):
    """The local-DP clients whose noise is added after a vectorised-trained update: the same audit."""
    function, trials, power = AUDITS[name]
    audited = function(tmp_path, held, trials)
    assert len(vectorised) >= 2 * trials, f"{name}: the vectorised path was not taken ({len(vectorised)})"
    assert audited.holds, f"{name}: {audited}"
    assert audited.result.epsilon_lower_bound >= power * audited.reported, f"{name}: {audited}"


@pytest.mark.audit
def test_audit_catches_a_wrong_sensitivity_on_the_vectorised_path(tmp_path, held, vectorised, monkeypatch):
    """Mutant 1 (noise sized for C instead of 2C) through the vectorised path is caught too."""
    monkeypatch.setattr(calibration, "local_update_sensitivity", lambda *, clip: clip)
    audited = fedavg_ldp_audit(tmp_path, held, 1500)
    assert len(vectorised) >= 3000
    assert not audited.holds, f"the audit missed a sensitivity of C instead of 2C: {audited}"


# ------------------------------------------------------------------------------ packed messages


@pytest.fixture
def packed_path(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every audited central round goes as packed messages (``simulation.pack_messages``): the round's
    messages packed (:func:`fl_app.engine.packed.pack`), each answered where its members run
    (:func:`~fl_app.engine.packed.answer`: each member's update clipped there, summed), unpacked, and
    the strategy aggregates the partial sums. Counts the members summed in packed messages."""
    from fl_app.engine import packed as pack_messages
    from fl_app.engine.messages import set_message_id

    members: list[int] = []

    def packed_replies(
        strategy: Any, messages: list[Message], trained: dict[int, ArrayRecord], present: bool
    ) -> list[Message]:
        def run_member(member: Message, context: Context) -> tuple[Message, None]:
            client = int(member.metadata.dst_node_id) - 1000
            if client == 0 and not present:
                raise RuntimeError("absent")
            members.append(client)
            return reply_to(member, arrays=trained[client]), None

        partitions = {int(m.metadata.dst_node_id): int(m.metadata.dst_node_id) - 1000 for m in messages}
        packed = pack_messages.pack(messages, partitions=partitions, summand=strategy.summand(1))
        replies = []
        for index, one in enumerate(packed):
            set_message_id(one.message, f"packed-{index}")
            node = int(one.message.metadata.dst_node_id)
            context = make_context(partition_id=node - 1000, num_partitions=2, node_id=node)
            replies.append(pack_messages.answer(one.message, context, run_member))
        return pack_messages.unpack(replies, packed, [f"packed-{i}" for i in range(len(packed))])

    monkeypatch.setattr(sys.modules[__name__], "central_replies", packed_replies)
    return members


@pytest.mark.audit
def test_dp_fedavg_as_packed_messages_meets_the_epsilon_it_reports(tmp_path, held, packed_path):
    """DP-FedAvg's audit with the clipping and summing done in packed messages."""
    assert_dp_fedavg_audit_holds(tmp_path, held, packed_path)


def assert_dp_fedavg_audit_holds(tmp_path: Path, held: Any, answered: list[int]) -> None:
    """DP-FedAvg's audit holds at its power, every trial's round answered on the path under test."""
    function, trials, power = AUDITS["dp_fedavg"]
    audited = function(tmp_path, held, trials)
    assert len(answered) >= trials, f"the path answered {len(answered)} rounds of {trials} trials"
    assert audited.holds, f"dp_fedavg: {audited}"
    assert audited.result.epsilon_lower_bound >= power * audited.reported, f"dp_fedavg: {audited}"


@pytest.mark.audit
def test_audit_catches_packed_messages_that_do_not_clip(tmp_path, held, packed_path, monkeypatch):
    """Mutant 6: packed messages sum their members' updates unclipped (the bound sent, not applied)."""
    from fl_app.learning.sums import ClippedUpdate

    real = ClippedUpdate.add_to

    def unclipped(self: ClippedUpdate, total: Any, node: int, result: Any, like: ArrayRecord) -> None:
        real(ClippedUpdate(clip=1e9), total, node, result, like)

    monkeypatch.setattr(ClippedUpdate, "add_to", unclipped)
    audited = dp_fedavg_audit(tmp_path, held, 1500)
    assert len(packed_path) >= 1500
    assert not audited.holds, f"the audit missed unclipped updates in packed messages: {audited}"


# ------------------------------------------------------------------------------ bulk shares


@pytest.fixture(params=["one-by-one", "stacked"])
def bulk_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every audited central round goes as one bulk share (``simulation.bulk``): the round packed as
    one message (:func:`fl_app.engine.packed.pack` with ``shares=1``) and answered by
    :func:`fl_app.engine.bulk.answer`, whose members' training returns the audit's trained arrays:
    one by one (each term added as it comes) or stacked (the share's terms added block by block, as
    the vectorised trainer's results are). Client 0, when absent, fails before training. Counts the
    members summed in bulk."""
    from fl_app.engine import bulk, bulk_training
    from fl_app.engine import packed as pack_messages
    from fl_app.engine.messages import set_message_id
    from fl_app.engine.vectorised_training import ConcatenatedRows

    members: list[int] = []
    world: dict[str, Any] = {}

    def live_members(share: Any) -> bulk.Members:
        live = []
        for index, node in enumerate(share.nodes):
            if node == 1000 and not world["present"]:
                share._fail(node, RuntimeError("absent"))
            else:
                live.append(index)
        ends = 9 * np.arange(1, len(live) + 1)
        x, y = np.zeros((9 * len(live), 1, 8, 8), np.float32), np.zeros(9 * len(live), np.int64)
        return bulk.Members(live, ConcatenatedRows(x, ends), ConcatenatedRows(y, ends))

    def state_of(share: Any, index: int) -> dict[str, np.ndarray]:
        members.append(share.partitions[index])
        arrays = world["trained"][share.partitions[index]]
        return {name: arrays[name].numpy() for name in share.global_arrays}

    def one_by_one(share: Any, live: bulk.Members) -> Iterator[tuple[int, Any, float]]:
        for index in live.live:
            yield index, state_of(share, index), 0.0

    def stacked(share: Any, live: bulk.Members) -> tuple[dict[str, np.ndarray], np.ndarray] | None:
        if request.param != "stacked" or len(live.live) < 2:  # as the vectorised trainer declines one member
            return None
        states = [state_of(share, index) for index in live.live]
        return {name: np.stack([s[name] for s in states]) for name in share.global_arrays}, np.zeros(
            len(states)
        )

    monkeypatch.setattr(bulk.Share, "_live_members", live_members)
    monkeypatch.setattr(bulk_training, "train_one_by_one", one_by_one)
    monkeypatch.setattr(bulk_training, "train_stacked", stacked)

    def bulk_replies(
        strategy: Any, messages: list[Message], trained: dict[int, ArrayRecord], present: bool
    ) -> list[Message]:
        world.update(trained=trained, present=present)
        partitions = {int(m.metadata.dst_node_id): int(m.metadata.dst_node_id) - 1000 for m in messages}
        packed = pack_messages.pack(messages, partitions=partitions, summand=strategy.summand(1), shares=1)
        if not messages:  # Poisson sampling chose nobody: nothing to send
            assert packed == []
            return []
        assert len(packed) == 1 and bulk.is_bulk(packed[0].message)
        set_message_id(packed[0].message, "bulk-0")
        node = int(packed[0].message.metadata.dst_node_id)
        context = make_context(partition_id=node - 1000, num_partitions=2, node_id=node)
        reply = bulk.answer(packed[0].message, context)
        return pack_messages.unpack([reply], packed, ["bulk-0"])

    monkeypatch.setattr(sys.modules[__name__], "central_replies", bulk_replies)
    return members


@pytest.mark.audit
def test_dp_fedavg_in_bulk_meets_the_epsilon_it_reports(tmp_path, held, bulk_path):
    """DP-FedAvg's audit with the members' clipping and summing done in a bulk share."""
    assert_dp_fedavg_audit_holds(tmp_path, held, bulk_path)


@pytest.mark.audit
def test_audit_catches_a_bulk_share_that_does_not_clip(tmp_path, held, bulk_path, monkeypatch):
    """Mutant 7: a bulk share sums its members' updates unclipped, one by one and stacked."""
    from fl_app.learning.sums import ClippedUpdate

    real, real_stacked = ClippedUpdate.add_to, ClippedUpdate.add_stacked

    def unclipped(self: ClippedUpdate, *args: Any) -> None:
        real(ClippedUpdate(clip=1e9), *args)

    def unclipped_stacked(self: ClippedUpdate, *args: Any) -> None:
        real_stacked(ClippedUpdate(clip=1e9), *args)

    monkeypatch.setattr(ClippedUpdate, "add_to", unclipped)
    monkeypatch.setattr(ClippedUpdate, "add_stacked", unclipped_stacked)
    audited = dp_fedavg_audit(tmp_path, held, 1500)
    assert len(bulk_path) >= 1500
    assert not audited.holds, f"the audit missed unclipped updates in a bulk share: {audited}"


# ------------------------------------------------------------------------------ the audit catches bugs


@pytest.mark.audit
def test_audit_catches_fedavg_ldp_calibrated_with_sensitivity_c_instead_of_2c(tmp_path, held, monkeypatch):
    """Mutant 1: the noise std z C instead of z 2C; the strategy still reports Gaussian(z)."""
    monkeypatch.setattr(calibration, "local_update_sensitivity", lambda *, clip: clip)
    audited = fedavg_ldp_audit(tmp_path, held, 1500)
    assert not audited.holds, f"the audit missed a sensitivity of C instead of 2C: {audited}"
    assert audited.result.epsilon_lower_bound > 1.2 * audited.reported, audited


@pytest.mark.audit
@pytest.mark.parametrize("name", ["privatekt", "laplace_eval"])
def test_audit_catches_an_accountant_that_halves_the_rdp_epsilon(name, tmp_path, held, monkeypatch):
    """Mutant 2: RDP epsilons halved, in the accountant and hence in every calibration against it.

    Pure mechanisms show it with a margin at this sample size (PrivateKT calibrates its labels
    against the halved accountant: their true epsilon doubles; the evaluation stage reports half of
    its Laplace epsilon). The Gaussian strategies' bounds (at most ~0.45 of the true epsilon from a
    few thousand rounds) cannot separate a factor 2 that the RDP-to-PLD slack partly absorbs.
    """
    rdp_epsilon = composition.rdp_epsilon

    def halved(history: Any, *, delta: float) -> tuple[float, float]:
        epsilon, order = rdp_epsilon(history, delta=delta)
        return epsilon / 2, order

    monkeypatch.setattr(composition, "rdp_epsilon", halved)
    clear_privacy_caches()
    function, trials, _ = AUDITS[name]
    audited = function(tmp_path, held, trials)
    assert not audited.holds, f"the audit missed an accountant that halves the RDP epsilon: {audited}"


@pytest.mark.audit
def test_the_exact_sum_double_releases_what_secagg_plus_releases(tmp_path, held):
    """The audit's rounds (:class:`ExactSumRound`) release what whole SecAgg+ rounds release, bit for
    bit, on both inputs and several noise seeds: the masks cancel, nothing else differs."""
    run = audit_run(SECAGG_AUDIT, tmp_path, [9, 10, 10], GAUSSIAN_DELTA)
    start = zero_model(run)
    held[1] = held[2] = UNIFORM
    strategy = STRATEGIES.get("dp_fedavg_secagg")(run)
    releases = []
    for world, data in enumerate((ZEROS, UNIFORM)):
        held[0] = data
        for trial in range(3):
            real = secagg_released(reseeded(strategy, 2 * trial + world), start, exact_sum=False)
            double = secagg_released(reseeded(strategy, 2 * trial + world), start, exact_sum=True)
            assert list(double) == list(real)
            for name in real:
                np.testing.assert_array_equal(double[name].numpy(), real[name].numpy())
            releases.append(flat_vector(real))
    assert len({r.tobytes() for r in releases}) == len(releases)  # every seed drew other noise


@pytest.mark.audit
def test_audit_catches_distributed_noise_calibrated_for_an_unscaled_sensitivity(tmp_path, held, monkeypatch):
    """Mutant 3: the clients size their Skellam noise in model units, not after scaling to integers.

    The local variance is divided by s^2 (s ~ 1e4) on the client, the classic unit slip of
    distributed DP; the server's plan, and the epsilon it reports, are the right ones.
    """
    real = ddp_client.encode_update

    def unscaled(update: np.ndarray, *, plan: Any, signs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        slipped = dataclasses.replace(plan, local_variance=plan.local_variance / plan.scale**2)
        return real(update, plan=slipped, signs=signs, rng=rng)

    monkeypatch.setattr(ddp_client, "encode_update", unscaled)
    audited = dp_fedavg_secagg_audit(tmp_path, held, 200)
    assert not audited.holds, f"the audit missed noise sized for an unscaled sensitivity: {audited}"
    assert audited.result.epsilon_lower_bound > 1.2 * audited.reported, audited  # all 200 rounds separate


@pytest.mark.audit
def test_audit_catches_distributed_noise_off_by_2x(tmp_path, held, monkeypatch):
    """Mutant 4: every client's Skellam share has half the standard deviation the plan says."""
    real = distributed.skellam_noise
    monkeypatch.setattr(
        distributed,
        "skellam_noise",
        lambda *, shape, variance, rng: real(shape=shape, variance=variance / 4, rng=rng),
    )
    audited = dp_fedavg_secagg_audit(tmp_path, held, 1000)
    assert not audited.holds, f"the audit missed Skellam noise off by 2x: {audited}"


@pytest.mark.audit
def test_audit_catches_banded_noise_off_by_2x(tmp_path, held, monkeypatch):
    """Mutant 5: DP-BandMF's uncorrelated noise z_t has half the standard deviation the calibration says."""
    real = bandmf_strategy.CorrelatedNoise
    monkeypatch.setattr(
        bandmf_strategy, "CorrelatedNoise", lambda coefficients, *, sigma: real(coefficients, sigma=sigma / 2)
    )
    audited = dp_bandmf_audit(tmp_path, held, 1500)
    assert not audited.holds, f"the audit missed banded noise off by 2x: {audited}"
