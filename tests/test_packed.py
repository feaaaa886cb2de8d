"""A round sent as packed messages answered with partial sums (``simulation.pack_messages``).

For each strategy whose aggregation is a sum (it declares a ``summand``), round 1 runs twice on
real train messages (digits, 40 clients of unequal sizes, so three blocks of 16, 16 and 8): once
with one message per client through the ClientApp, once packed (:func:`fl_app.engine.packed.pack`),
each packed message through the ClientApp and :func:`~fl_app.engine.packed.unpack`. The two
strategies (built alike, the same seeds) must release the same model bit for bit and record the same
failures. The summing itself is checked on constructed replies against a plain float64 loop in the
same blocks; a partial sum of another summand is refused; whole simulations agree round by round
(accuracy, loss, epsilon, bytes, failures, the diagnostics).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import FAST, INLINE, build_run_context, make_context, settings_of
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import MessageType

from clients.node import INJECT_FAILURES_ENV
from fl_app import keys
from fl_app.client_app import app
from fl_app.engine import packed as pack_messages
from fl_app.engine.batching import run_jobs
from fl_app.learning.sums import (
    BLOCK,
    ClippedUpdate,
    PartialSum,
    WeightedModel,
    blocks_of,
    is_partial_sum,
    summed,
)
from fl_app.learning.train_results import TrainResult
from strategies import STRATEGIES

FORTY = ["dataset=digits", "num_clients=40", "clients_per_round=40", "partition=dirichlet"]


def needs(name: str) -> list[str]:
    """What a strategy needs to run here: the same noise in both runs when it is private, and every
    client every round (so three blocks) where it samples by default."""
    from fl_app.config.compose import compose_config

    strategy = compose_config([*FAST, *FORTY, f"strategy={name}"]).strategy
    private = STRATEGIES.get(name).declaration.unit != "none"
    return [
        *(["privacy.noise_seed=3"] if private else []),
        *(["strategy.sampling=fixed"] if "sampling" in strategy else []),
    ]


def summed_strategies() -> dict[str, list[str]]:
    """Every registered strategy whose aggregation is its declared sum, with what it needs to run here."""
    from fl_app.run.round_loop import aggregates_its_sum

    names = sorted(n for n in STRATEGIES.names() if aggregates_its_sum(STRATEGIES.get(n)))
    return {name: needs(name) for name in names}


#: Derived from the registry: a new algorithm whose aggregation is a sum is checked here unasked.
SUMMED = summed_strategies()


def test_the_summed_strategies_include_the_baselines() -> None:
    """The derivation finds the sums it must (a registry or ``summand`` that broke would empty it)."""
    assert {"fedavg", "dp_fedavg", "dp_fedavg_adaptive", "dp_ftrl", "dp_bandmf", "nbafl"} <= set(SUMMED)
    assert (
        SUMMED["dp_fedavg"] == ["privacy.noise_seed=3", "strategy.sampling=fixed"] and SUMMED["fedavg"] == []
    )


def strategy_of(name: str, tmp_path: Path) -> Any:
    overrides = [*FAST, *FORTY, f"strategy={name}", *SUMMED[name]]
    return STRATEGIES.get(name)(build_run_context(overrides, tmp_path))


def node_context(node: int) -> Any:
    return make_context(partition_id=node - 1000, num_partitions=40, node_id=node)


def plain_replies(messages: list[Message]) -> list[Message]:
    """Each train message through the ClientApp, as an actor runs a batch."""
    outcomes = run_jobs(lambda: app, [(m, node_context(int(m.metadata.dst_node_id))) for m in messages])
    return [o[1] if o[0] == "reply" else error_of(m, o) for m, o in zip(messages, outcomes, strict=True)]


def error_of(message: Message, outcome: tuple[Any, ...]) -> Message:
    from flwr.app import Error

    return Message(Error(code=outcome[1], reason=outcome[2]), reply_to=message)


def cohort_replies(messages: list[Message], strategy: Any) -> list[Message]:
    """The same messages packed, each packed message through the ClientApp, then unpacked."""
    partitions = {int(m.metadata.dst_node_id): int(m.metadata.dst_node_id) - 1000 for m in messages}
    packed = pack_messages.pack(messages, partitions=partitions, summand=strategy.summand(1))
    assert [len(c.members) for c in packed] == [16, 16, 8]
    for index, cohort in enumerate(packed):  # the engine gives each message its id when it is pushed
        from fl_app.engine.messages import set_message_id

        set_message_id(cohort.message, f"cohort-{index}")
    replies = plain_replies([c.message for c in packed])
    assert all(is_partial_sum(r) for r in replies), [r.error.reason for r in replies if r.has_error()]
    return pack_messages.unpack(replies, packed, [f"cohort-{i}" for i in range(len(packed))])


@pytest.mark.parametrize("name", sorted(SUMMED))
@pytest.mark.parametrize("failing", [False, True])
def test_packed_messages_release_what_plain_messages_release(
    name: str, failing: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same model bit for bit, the same failures; with client 17 failing in round 1, too."""
    if failing:
        monkeypatch.setenv(INJECT_FAILURES_ENV, "17@1")
    released = []
    for path in ("plain", "cohort"):
        strategy = strategy_of(name, tmp_path / path)
        messages = list(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid=None))
        assert len(messages) == 40
        replies = plain_replies(messages) if path == "plain" else cohort_replies(messages, strategy)
        arrays, _ = strategy.aggregate_train(1, replies)
        assert arrays is not None
        released.append(({n: arrays[n].numpy() for n in arrays}, strategy.replies.failures(1)))
    (plain, plain_failures), (cohort, cohort_failures) = released
    assert plain_failures == cohort_failures == ([17] if failing else [])
    for key, values in plain.items():
        np.testing.assert_array_equal(values, cohort[key], err_msg=f"{name} {key}")


def test_the_cohort_path_really_ran_each_member_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three packed messages carry 40 members; each member's client trains once, on its own node."""
    from clients.fedavg import FedAvgClient

    trained: list[int] = []
    real_result = FedAvgClient.train_result
    monkeypatch.setattr(
        FedAvgClient, "train_result", lambda self: trained.append(self.client_id) or real_result(self)
    )
    strategy = strategy_of("fedavg", tmp_path)
    messages = list(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid=None))
    replies = cohort_replies(messages, strategy)
    assert sorted(trained) == list(range(40))
    assert len(replies) == 3
    assert sorted(m for r in replies for m in PartialSum.members_of(r)) == list(range(1000, 1040))


def constructed_replies(
    count: int, rng: np.random.Generator
) -> tuple[ArrayRecord, list[tuple[int, Message]]]:
    """A global model and ``count`` replies with float32 models, example counts and losses."""
    like = ArrayRecord(
        {"w": Array(rng.normal(size=(5, 3)).astype(np.float32)), "b": Array(np.zeros(3, np.float32))}
    )
    replies = []
    for k in range(count):
        message = Message(content=RecordDict(), dst_node_id=2000 + k, message_type=MessageType.TRAIN)
        arrays = ArrayRecord(
            {n: Array((like[n].numpy() + rng.normal(size=like[n].shape)).astype(np.float32)) for n in like}
        )
        metrics = MetricRecord(
            {keys.NUM_EXAMPLES: int(rng.integers(1, 90)), keys.TRAIN_LOSS: float(rng.random())}
        )
        replies.append(
            (2000 + k, Message(RecordDict({keys.ARRAYS: arrays, keys.METRICS: metrics}), reply_to=message))
        )
    return like, replies


def cohort_reply_of(partial: PartialSum, node: int) -> Message:
    """A packed message's reply carrying ``partial`` (as :func:`fl_app.engine.packed.answer` builds it)."""
    message = Message(content=RecordDict(), dst_node_id=node, message_type=MessageType.TRAIN)
    return Message(RecordDict(partial.records()), reply_to=message)


@pytest.mark.parametrize("summand", [WeightedModel(weighting="num_examples"), ClippedUpdate(clip=1.5)])
def test_summed_is_a_float64_loop_in_blocks_whichever_way_the_replies_come(summand: Any) -> None:
    """37 plain replies and the same as three partial sums (the blocks of 16) give the same bits, equal
    to an independent loop: each block summed from zero in client order, the blocks added in order."""
    rng = np.random.default_rng(5)
    like, replies = constructed_replies(37, rng)
    blocks = blocks_of(node for node, _ in replies)
    plain = summed(replies, summand, like, blocks=blocks)
    expected = {n: np.zeros(like[n].shape) for n in like}
    for start in range(0, 37, BLOCK):
        block = {n: np.zeros(like[n].shape) for n in like}
        for _, reply in replies[start : start + BLOCK]:
            model = {n: reply.content.array_records[keys.ARRAYS][n].numpy().astype(np.float64) for n in like}
            if isinstance(summand, WeightedModel):
                weight = float(reply.content.metric_records[keys.METRICS][keys.NUM_EXAMPLES])
                terms = {n: model[n] * weight for n in like}
            else:
                update = {n: model[n] - like[n].numpy().astype(np.float64) for n in like}
                norm = np.sqrt(sum(np.sum(u**2) for u in update.values()))
                terms = {n: u * min(1.0, 1.5 / norm) for n, u in update.items()}
            for n in like:
                block[n] += terms[n]
        for n in like:
            expected[n] += block[n]
    for n in like:
        np.testing.assert_allclose(plain.arrays[n], expected[n], rtol=1e-12)
    partials = []
    for index, start in enumerate(range(0, 37, BLOCK)):
        partial = PartialSum.zeros_like(like, summand.to_config())
        partial.block = index
        for node, reply in replies[start : start + BLOCK]:
            summand.add_to(partial, node, TrainResult.of_reply(reply, like), like)
        partials.append(cohort_reply_of(partial, replies[start][0]))
    listed = [(node, partials[i // BLOCK]) for i, (node, _) in enumerate(replies)]  # once per member
    together = summed(listed[::-1], summand, like, blocks=blocks)  # any order of arrival
    for n in like:
        np.testing.assert_array_equal(together.arrays[n], plain.arrays[n])
    assert together.scalars == plain.scalars
    assert together.per_member == plain.per_member
    assert together.members == plain.members


def test_a_partial_sum_of_another_clipping_bound_is_refused() -> None:
    """Clipped at 2C where C was sent: the sum's sensitivity is not the one accounted."""
    like, replies = constructed_replies(3, np.random.default_rng(2))
    partial = PartialSum.zeros_like(like, ClippedUpdate(clip=2.0).to_config())
    for node, reply in replies:
        ClippedUpdate(clip=2.0).add_to(partial, node, TrainResult.of_reply(reply, like), like)
    with pytest.raises(ValueError, match="clip"):
        summed(
            [(replies[0][0], cohort_reply_of(partial, replies[0][0]))],
            ClippedUpdate(clip=1.0),
            like,
            blocks={},
        )


def test_a_malformed_member_reply_fails_that_member_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member whose reply lacks its model fails with the reason, as the server would refuse it; the
    others are summed."""
    from clients.fedavg import FedAvgClient

    real_train = FedAvgClient.train

    def train(self: FedAvgClient) -> Message:
        reply = real_train(self)
        if self.client_id == 5:
            del reply.content[keys.ARRAYS]
        return reply

    monkeypatch.setattr(FedAvgClient, "train", train)
    assert "no arrays" in only_client_5_fails(tmp_path)


def only_client_5_fails(tmp_path: Path) -> str:
    """FedAvg's round 1 of 40 through packed messages: client 5 alone fails, the 39 others are summed;
    returns its error's reason."""
    strategy = strategy_of("fedavg", tmp_path)
    messages = list(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid=None))
    replies = cohort_replies(messages, strategy)
    errors = [r for r in replies if r.has_error()]
    assert [int(r.metadata.src_node_id) for r in errors] == [1005]
    valid, failed = strategy.replies.split(1, replies)
    assert [info.client_id for info in failed] == [5]
    assert len(valid) == 39
    return errors[0].error.reason


@pytest.mark.simulation
@pytest.mark.parametrize("strategy", ["fedavg", "dp_fedavg", "nbafl"])
def test_a_simulation_gives_the_same_rounds_with_packed_messages(strategy: str, simulate: Any) -> None:
    """Inline, 40 clients, client 3 failing in round 2: every round's accuracy, loss, epsilon, bytes and
    failures, and the un-noised diagnostics, equal with one message per client, with packed messages,
    and in bulk (FedAvg's client: one message for the round, no client object per member; NbAFL's
    client noises its upload itself, so its round stays packed)."""
    from fl_app.engine import bulk

    overrides = [*FAST, *FORTY, "num_rounds=3", INLINE, f"strategy={strategy}", "privacy.diagnostics=true"]
    arms = {
        "plain": ["simulation.pack_messages=false"],
        "packed": ["simulation.pack_messages=true", "simulation.bulk=false"],
        "bulk": ["simulation.pack_messages=true", "simulation.bulk=true"],
    }
    in_bulk = strategy != "nbafl"
    expected = {"plain": (0, 0), "packed": (3 * 3, 0), "bulk": (0, 3) if in_bulk else (3 * 3, 0)}
    results = {}
    for arm, switches in arms.items():
        answered = {"packed": 0, "bulk": 0}
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(INJECT_FAILURES_ENV, "3@2")
            patch.setattr(pack_messages, "answer", _counted(pack_messages.answer, answered, "packed"))
            patch.setattr(bulk, "answer", _counted(bulk.answer, answered, "bulk"))
            results[arm] = simulate([*overrides, *switches], name=arm)
        assert (answered["packed"], answered["bulk"]) == expected[arm], (arm, answered)  # 3 rounds
    timing = {"wall_s", "round_s", "secret_cohort_round_s"}

    def rounds(run: dict[str, Any]) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k not in timing} for r in run["rounds"]]

    outside = {arm: run.get("outside_guarantee", {}).get("rounds", []) for arm, run in results.items()}
    for arm in ("packed", "bulk"):
        assert rounds(results[arm]) == rounds(results["plain"]), arm
        assert _without_timing(outside[arm]) == _without_timing(outside["plain"]), arm
    # DP-FedAvg's Poisson cohort is secret: its size and failures are published outside the guarantee
    published = outside["bulk"] if strategy == "dp_fedavg" else results["bulk"]["rounds"]
    assert [r.get("failures", r.get("secret_cohort_failures")) for r in published] == [0, 1, 0]
    assert strategy == "fedavg" or all("update_norm_median" in r for r in outside["bulk"])


def _counted(function: Any, counts: dict[str, int], key: str) -> Any:
    """``function``, each call counted in ``counts[key]``."""

    def counting(*args: Any, **kwargs: Any) -> Any:
        counts[key] += 1
        return function(*args, **kwargs)

    return counting


def _without_timing(rounds: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rounds]


def test_a_malformed_member_result_fails_that_member_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member whose train result (handed over before encoding) is not shaped like the model fails
    with the reason the server would give its reply; the others are summed."""
    from clients.fedavg import FedAvgClient

    real_result = FedAvgClient.train_result

    def train_result(self: FedAvgClient) -> TrainResult:
        result = real_result(self)
        if self.client_id == 5:
            return TrainResult(dict(list(result.arrays.items())[:-1]), result.metrics)  # one array short
        return result

    monkeypatch.setattr(FedAvgClient, "train_result", train_result)
    assert "arrays do not match the model" in only_client_5_fails(tmp_path)


def test_a_member_hands_over_its_result_only_where_its_reply_is_that_result_encoded(tmp_path: Path) -> None:
    """FedAvg's client (and Flower's, NbAFL's, FedAvg+LDP's) hand over the train result; a client with its
    own ``train`` (a subclass of FedAvg's that overrides it) hands over its reply, which is what the
    server would get."""
    from clients.base import FederatedClient
    from clients.fedavg import FedAvgClient
    from fl_app.client_app import client_for, train_outcome

    class EchoingClient(FedAvgClient):
        def train(self) -> Message:
            return self.reply(metrics={"echo": 1})

    strategy = strategy_of("fedavg", tmp_path)
    message = next(iter(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid=None)))
    node = node_context(int(message.metadata.dst_node_id))
    client = client_for(message, node)
    assert type(client) is FedAvgClient
    result, state = train_outcome(client)
    assert isinstance(result, TrainResult) and state is None
    reply = client_for(message, node).train()  # the same client again: the same training
    assert list(reply.content.array_records[keys.ARRAYS].keys()) == list(result.arrays)
    for name, array in reply.content.array_records[keys.ARRAYS].items():
        np.testing.assert_array_equal(array.numpy(), result.arrays[name])
    assert dict(reply.content.metric_records[keys.METRICS]) == dict(result.metrics)
    assert isinstance(train_outcome(EchoingClient(message, node))[0], Message)
    assert FederatedClient.train is not EchoingClient.train


@pytest.mark.parametrize(
    "arrays",
    [
        pytest.param({"w": np.arange(12, dtype=np.float32).reshape(3, 4), "b": np.ones(4)}, id="plain"),
        pytest.param({"a": np.ones(5, np.float32), "b": np.ones(5, np.float32)}, id="identical arrays"),
        pytest.param(
            {"t": np.arange(6.0).reshape(2, 3).T, "e": np.zeros(0, np.int64)}, id="transposed, empty"
        ),
        pytest.param({"big": np.zeros(4_000_000, np.float32)}, id="identical chunks"),  # 16 MB: 4 chunks
        pytest.param(  # same length, first and last bytes: the fingerprints collide, the bytes differ
            {"a": np.arange(10.0), "b": np.where(np.arange(10) == 4, -1.0, np.arange(10.0))},
            id="fingerprints collide",
        ),
    ],
)
@pytest.mark.parametrize("examples", [3, 70_000, None])
def test_a_train_result_weighs_what_its_reply_weighs(
    arrays: dict[str, np.ndarray], examples: int | None
) -> None:
    """``result_bytes`` equals the serialised size and array payload of the reply it stands for, and its
    layout is the reply's (the two share one cache of sizes); also for a reply without metrics (None)."""
    from fl_app.engine.message_sizes import array_payload_bytes, content_layout, result_bytes, result_layout
    from fl_app.engine.messages import record_dict_bytes, task_identity

    metrics = None if examples is None else {keys.NUM_EXAMPLES: examples, keys.TRAIN_LOSS: 0.25}
    result = TrainResult(arrays, metrics)
    assert (keys.METRICS in result.content()) is (metrics is not None)
    with task_identity(run_id=1):
        reply = Message(content=result.content(), dst_node_id=1, message_type=MessageType.TRAIN)
    assert result_layout(result) == content_layout(reply)
    assert result_bytes(result) == (record_dict_bytes(reply.content), array_payload_bytes(reply))


def test_results_of_one_signature_weigh_what_their_replies_weigh_every_time() -> None:
    """The arrays' part of a layout is found once per names, dtypes and shapes where no two chunks can
    be identical (all lengths differ), and compared every time where they can (equal lengths): either
    way each result's layout is its reply's, whatever its values, also in Fortran order."""
    from fl_app.engine.message_sizes import content_layout, result_layout
    from fl_app.engine.messages import task_identity

    rng = np.random.default_rng(0)
    distinct = {"w": (30, 7), "b": (7,), "v": (7, 3)}
    equal = {"w": (5, 4), "u": (5, 4), "z": (3,)}  # two zero arrays: one chunk sent once
    for shapes in (distinct, equal, distinct, equal):
        for fill in ("random", "zeros", "random"):
            arrays = {
                k: (rng.normal(size=s) if fill == "random" else np.zeros(s)).astype(np.float32)
                for k, s in shapes.items()
            }
            if "v" in arrays and fill == "zeros":  # Fortran order: a signature of its own
                arrays["v"] = np.asfortranarray(arrays["v"])
            result = TrainResult(
                arrays, {keys.NUM_EXAMPLES: int(rng.integers(1, 10**6)), keys.TRAIN_LOSS: 0.5}
            )
            with task_identity(run_id=1):
                reply = Message(content=result.content(), dst_node_id=1, message_type=MessageType.TRAIN)
            assert result_layout(result) == content_layout(reply), (shapes, fill)


def test_chunks_that_only_look_alike_are_not_taken_for_one() -> None:
    """Two arrays with the same length, first and last bytes but other middles weigh as two, after two
    identical ones weighed as one (the sizes' cache must not hand the second layout the first's size)."""
    from fl_app.engine.message_sizes import result_bytes
    from fl_app.engine.messages import record_dict_bytes

    a = np.arange(10.0)
    looks_alike = np.where(np.arange(10) == 4, -1.0, a)
    metrics = {keys.NUM_EXAMPLES: 3, keys.TRAIN_LOSS: 0.5}
    same = TrainResult({"a": a, "b": a.copy()}, metrics)
    alike = TrainResult({"a": a, "b": looks_alike}, metrics)
    assert result_bytes(same)[0] == record_dict_bytes(same.content())
    assert result_bytes(alike)[0] == record_dict_bytes(alike.content()) > result_bytes(same)[0]


@pytest.mark.parametrize(
    ("backend", "value", "sends"),
    [("inline", "auto", True), ("ray", "auto", True), ("inline", "false", False), ("ray", "true", True)],
)
def test_packed_messages_are_on_unless_switched_off(backend: str, value: str, sends: bool) -> None:
    """``auto`` is on with either backend: measured faster on both (docs/benchmarks/pfl_research.md)."""
    settings = settings_of([f"simulation.backend={backend}", f"simulation.pack_messages={value}"])
    assert settings.simulation.packs_messages is sends


@pytest.mark.parametrize("name", ["fedavg", "dp_fedavg", "nbafl"])
def test_a_batch_of_packed_messages_trains_all_its_members_as_one_computation(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``simulation.vectorise``, the three packed messages of a batch (40 members) train as one
    cohort of 40, not three of 16, 16 and 8 (a GPU pays per computation, not per client); each member's
    training is taken from it once, and the released model equals the per-member loop's to float
    tolerance."""
    from conftest import count_vectorised_trainings

    from fl_app.engine import vectorised as vectorised_engine

    sizes: list[int] = []
    real_group = vectorised_engine._train_group
    monkeypatch.setattr(
        vectorised_engine, "_train_group", lambda group: sizes.append(len(group.members)) or real_group(group)
    )
    taken = count_vectorised_trainings(monkeypatch)
    released = []
    for vectorise in ("true", "false"):
        overrides = [*FAST, *FORTY, f"strategy={name}", *SUMMED[name], f"simulation.vectorise={vectorise}"]
        strategy = STRATEGIES.get(name)(build_run_context(overrides, tmp_path / vectorise))
        messages = list(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid=None))
        arrays, _ = strategy.aggregate_train(1, cohort_replies(messages, strategy))
        assert arrays is not None
        released.append({n: arrays[n].numpy() for n in arrays})
        assert (sizes, len(taken)) == ([40], 40), vectorise  # the loop (second) adds none
    for key, values in released[0].items():
        np.testing.assert_allclose(values, released[1][key], rtol=1e-4, atol=1e-5, err_msg=key)
