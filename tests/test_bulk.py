"""A worker's share of the cohort trained and summed in bulk (``simulation.bulk``, fl_app/engine/bulk.py).

The same round's messages (digits, 40 clients of unequal sizes) answered one message per client and as
bulk messages: one share releases the same model bit for bit (each member trained on the process's
model and its term added one by one, the blocks in order), several shares to float tolerance; the
vectorised trainer and the stacked terms to float tolerance. A bulk round builds no client object and
no member message. Only a client that does exactly what FedAvg's does is trained in bulk (derived from
its class: any override of its training or its reply, or kept state, keeps it out). The stacked terms
(clipping included) against the per-client terms, on random updates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import FAST, build_run_context, make_context
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from test_packed import error_of

from clients.base import FederatedClient
from clients.fedavg import FedAvgClient, plain_fedavg
from fl_app import keys
from fl_app.client_app import app
from fl_app.engine import packed
from fl_app.engine.batching import run_jobs
from fl_app.engine.messages import Broadcast, set_message_id
from fl_app.learning import sums
from fl_app.learning.sums import (
    BLOCK,
    ClippedUpdate,
    PartialSum,
    Stacked,
    Summand,
    WeightedModel,
    is_partial_sum,
)
from fl_app.learning.training import array_values, state_to_arrays
from strategies import STRATEGIES

FORTY = ["dataset=digits", "num_clients=40", "clients_per_round=40", "partition=dirichlet"]
#: Strategies whose client is FedAvg's, with what they need to run here.
FEDAVG_CLIENT = {
    "fedavg": [],
    "dp_fedavg": ["strategy.sampling=fixed", "privacy.noise_seed=3"],
    "dp_fedavg_adaptive": ["privacy.noise_seed=3"],
    "dp_ftrl": ["privacy.noise_seed=3"],
    "dp_bandmf": ["privacy.noise_seed=3"],
}


def strategy_of(name: str, tmp_path: Path, *extra: str) -> Any:
    overrides = [*FAST, *FORTY, f"strategy={name}", *FEDAVG_CLIENT[name], *extra]
    return STRATEGIES.get(name)(build_run_context(overrides, tmp_path))


def answered(messages: list[Message]) -> list[Message]:
    """Each message through the ClientApp, as a worker runs a batch."""
    jobs = [(m, make_context(partition_id=int(m.metadata.dst_node_id) - 1000, num_partitions=40,
                             node_id=int(m.metadata.dst_node_id))) for m in messages]  # fmt: skip
    outcomes = run_jobs(lambda: app, jobs)
    return [o[1] if o[0] == "reply" else error_of(m, o) for m, o in zip(messages, outcomes, strict=True)]


def bulk_replies(messages: list[Message], strategy: Any, shares: int) -> list[Message]:
    """The round as ``shares`` bulk messages through the ClientApp, then unpacked."""
    partitions = {int(m.metadata.dst_node_id): int(m.metadata.dst_node_id) - 1000 for m in messages}
    shared = packed.pack(messages, partitions=partitions, summand=strategy.summand(1), shares=shares)
    assert len(shared) == shares and all(len(s.members) % BLOCK == 0 for s in shared[:-1])
    for index, share in enumerate(shared):
        set_message_id(share.message, f"share-{index}")
    replies = answered([s.message for s in shared])
    assert all(is_partial_sum(r) for r in replies), [r.error.reason for r in replies if r.has_error()]
    return packed.unpack(replies, shared, [f"share-{i}" for i in range(len(shared))])


def released(name: str, tmp_path: Path, path: str, *extra: str) -> dict[str, np.ndarray]:
    """Round 1's released model of ``name``, its replies one per client or in bulk shares."""
    strategy = strategy_of(name, tmp_path / path, *extra)
    messages = list(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid=None))
    replies = answered(messages) if path == "plain" else bulk_replies(messages, strategy, int(path[-1]))
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None and strategy.replies.failures(1) == []
    return {name: array_values(arrays[name]).copy() for name in arrays}


@pytest.mark.parametrize("name", sorted(FEDAVG_CLIENT))
def test_one_share_releases_the_plain_messages_model_bit_for_bit(name: str, tmp_path: Path) -> None:
    plain, one = released(name, tmp_path, "plain"), released(name, tmp_path, "bulk1")
    assert {k: v.tobytes() for k, v in one.items()} == {k: v.tobytes() for k, v in plain.items()}


@pytest.mark.parametrize("name", ["fedavg", "dp_fedavg"])
def test_several_shares_and_the_vectorised_trainer_release_it_to_float_tolerance(
    name: str, tmp_path: Path
) -> None:
    plain = released(name, tmp_path, "plain")
    for path, extra in (("bulk3", ()), ("vectorised1", ("simulation.vectorise=true",))):
        other = released(name, tmp_path, path, *extra)
        for key, values in plain.items():
            np.testing.assert_allclose(
                other[key], values, rtol=1e-5, atol=1e-6, err_msg=f"{name} {path} {key}"
            )


def test_a_bulk_round_builds_no_client_and_no_member_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The share is trained and summed without a client object, a member message or a member Context."""
    import fl_app.client_app as client_app

    built: list[str] = []
    for module, name in ((client_app, "client_for"), (packed, "member_message"), (packed, "member_context")):
        real = getattr(module, name)
        monkeypatch.setattr(
            module, name, lambda *a, _real=real, _name=name, **k: built.append(_name) or _real(*a, **k)
        )
    released("dp_fedavg", tmp_path, "bulk1")
    assert built == []
    released("dp_fedavg", tmp_path, "plain")
    assert built.count("client_for") == 40  # the counting sees the per-message path's clients


def test_a_bulk_member_trains_on_its_data_as_its_own_client_holds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each member's examples reach local training with the values, the order and the memory layout
    its client gives them: torch's convolutions take images by their strides (C-order strides of
    one-channel images ran the main job's CNN about 20 % slower than the stored ones)."""
    import clients.base
    from fl_app.engine import bulk_training

    seen: dict[str, list[tuple[bytes, tuple[int, ...], bytes]]] = {"plain": [], "bulk": []}

    def recording(path: str, real: Any) -> Any:
        def train_local(model: Any, x: np.ndarray, y: np.ndarray, **kwargs: Any) -> float:
            seen[path].append((x.tobytes(), x.strides, np.asarray(y).tobytes()))
            return real(model, x, y, **kwargs)

        return train_local

    monkeypatch.setattr(clients.base, "train_local", recording("plain", clients.base.train_local))
    monkeypatch.setattr(bulk_training, "train_local", recording("bulk", bulk_training.train_local))
    released("fedavg", tmp_path, "plain")
    released("fedavg", tmp_path, "bulk1")
    assert len(seen["plain"]) == 40 and sorted(seen["bulk"]) == sorted(seen["plain"])


def test_only_a_client_that_does_exactly_what_fedavgs_does_goes_in_bulk() -> None:
    """Derived from the class: an override of its training, its reply or its statement of SGD, or kept
    state, keeps a subclass out; a subclass that only renames stays in."""

    class Renamed(FedAvgClient):
        pass

    def overriding(name: str) -> type:
        return type(f"Own{name}", (FedAvgClient,), {name: lambda self: getattr(FedAvgClient, name)(self)})

    assert plain_fedavg(FedAvgClient) and plain_fedavg(Renamed)
    for name in ("train", "train_result", "train_locally", "local_sgd"):
        assert not plain_fedavg(overriding(name)), name
    assert not plain_fedavg(type("Stateful", (FedAvgClient,), {"keeps_state": True}))
    assert not plain_fedavg(FederatedClient) and not plain_fedavg(int)


@pytest.mark.parametrize("cohort", [0, 1, BLOCK, BLOCK + 1, 5 * BLOCK])
@pytest.mark.parametrize("shares", [1, 2, 3])
@pytest.mark.parametrize("broadcast", [False, True])
def test_shares_hold_whole_blocks_in_client_order_and_an_empty_cohort_none(
    cohort: int, shares: int, broadcast: bool
) -> None:
    """At most ``shares`` bulk messages, each a run of whole blocks, together the cohort in order.

    The same from a list of messages and from a :class:`Broadcast` (which builds none until read).
    """
    content = RecordDict({keys.ARRAYS: state_to_arrays({"w": np.zeros(2, dtype=np.float32)})})
    nodes = [500 - i for i in range(cohort)]
    messages = (
        Broadcast(content, nodes, "train")
        if broadcast
        else [Message(content=content, dst_node_id=node, message_type="train") for node in nodes]
    )
    partitions = {500 - i: i for i in range(cohort)}
    out = packed.pack(
        messages, partitions=partitions, summand=WeightedModel(weighting="uniform"), shares=shares
    )
    assert len(out) <= shares and (cohort > 0 or out == [])
    members = [int(m.metadata.dst_node_id) for one in out for m in one.members]
    assert members == [500 - i for i in range(cohort)]
    assert all(len(one.members) % BLOCK == 0 for one in out[:-1])
    assert all(one.message.content[keys.ARRAYS] is content[keys.ARRAYS] for one in out)


def test_an_injected_failure_fails_that_member_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DPFL_INJECT_FAILURES", "7")
    strategy = strategy_of("fedavg", tmp_path)
    messages = list(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid=None))
    replies = bulk_replies(messages, strategy, 2)
    errors = [r for r in replies if r.has_error()]
    assert [int(r.metadata.src_node_id) for r in errors] == [1007] and "client 7 fails" in errors[
        0
    ].error.reason
    valid, failed = strategy.replies.split(1, replies)
    assert [info.client_id for info in failed] == [7] and len(valid) == 39
    weighed = [packed.metered(r) for r in replies if not r.has_error()]
    assert sum(w[2] for w in weighed if w is not None) == 39  # the failed member's reply is not weighed


def random_stacked(rows: int, seed: int) -> tuple[Stacked, ArrayRecord]:
    """Random updates of two arrays around a random global model, in blocks of 5 (one row near zero)."""
    rng = np.random.default_rng(seed)
    like = state_to_arrays(
        {"w": rng.normal(size=(3, 4)).astype(np.float32), "b": rng.normal(size=4).astype(np.float32)}
    )
    arrays = {}
    for name in like:
        centre = array_values(like[name])
        arrays[name] = centre + rng.normal(0, 2.0, (rows, *centre.shape)).astype(np.float32)
    for name in arrays:
        arrays[name][2] = array_values(like[name])  # an update of norm 0
    stacked = Stacked(
        nodes=list(range(100, 100 + rows)),
        arrays=arrays,
        examples=rng.integers(1, 50, rows),
        losses=rng.random(rows),
        blocks=np.arange(rows) // 5,
    )
    return stacked, like


@pytest.mark.parametrize("chunk_bytes", [sums.CHUNK_BYTES, 8 * 16 * 3], ids=["one-chunk", "chunks-of-3"])
@pytest.mark.parametrize("summand", [ClippedUpdate(clip=1.5), WeightedModel(weighting="num_examples"),
                                     WeightedModel(weighting="uniform")],
                         ids=["clipped", "weighted", "uniform"])  # fmt: skip
def test_stacked_terms_equal_the_per_client_terms(
    summand: Any, chunk_bytes: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``add_stacked`` against ``add_to`` per client, block by block (``Summand``'s own ``add_stacked``,
    which adds the rows one by one): sums, scalars, per-member norms; in one chunk of rows and in
    chunks of 3 rows (the last one shorter), whose buffers are reused."""
    monkeypatch.setattr(sums, "CHUNK_BYTES", chunk_bytes)
    stacked, like = random_stacked(13, seed=4)
    fast = PartialSum.zeros_like(like, summand.to_config())
    summand.add_stacked(fast, stacked, like)
    slow = PartialSum.zeros_like(like, summand.to_config())
    Summand.add_stacked(summand, slow, stacked, like)
    assert type(summand).add_stacked is not Summand.add_stacked  # the vectorised one is under test
    for name in like:
        np.testing.assert_allclose(fast.arrays[name], slow.arrays[name], rtol=1e-12, atol=1e-12)
    assert fast.members == slow.members
    assert fast.scalars == pytest.approx(slow.scalars, rel=1e-12)
    for name, values in slow.per_member.items():
        np.testing.assert_allclose(fast.per_member[name], values, rtol=1e-12)
    if isinstance(summand, ClippedUpdate):  # some updates really were clipped, one had norm 0
        norms = np.asarray(fast.per_member["norm"])
        assert (norms > 1.5).any() and (norms == 0).any()


def test_a_stacked_sum_with_another_clip_is_caught() -> None:
    """The oracle above can fail: a stacked sum clipped to another bound differs from the per-client one."""
    stacked, like = random_stacked(13, seed=4)
    fast = PartialSum.zeros_like(like)
    ClippedUpdate(clip=3.0).add_stacked(fast, stacked, like)
    slow = PartialSum.zeros_like(like)
    ClippedUpdate(clip=1.5).add_stacked(slow, stacked, like)
    assert not np.allclose(fast.arrays["w"], slow.arrays["w"])


def test_the_bulk_switch_is_on_unless_switched_off_and_needs_packing(tmp_path: Path) -> None:
    from fl_app.config.compose import compose_config
    from fl_app.config.validation import typed_settings

    def sends(*overrides: str) -> bool:
        return typed_settings(compose_config([*FAST, *overrides])).simulation.sends_bulk

    assert sends() and sends("simulation.bulk=true")
    assert not sends("simulation.bulk=false") and not sends("simulation.pack_messages=false")


@pytest.mark.simulation
@pytest.mark.parametrize("backend", ["processes", "ray"])
def test_a_run_in_bulk_on_two_workers_gives_the_plain_runs_model(
    backend: str, simulate: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forty clients a round as two bulk shares, one per worker (forked processes, Ray's actors): the
    released model equals the one-message-per-client run's to float tolerance, the rounds' records too."""
    from conftest import INLINE, TWO_ACTORS

    from fl_app.engine import bulk

    marks = tmp_path / "bulk-answers"
    real = bulk.answer

    def marked(message: Message, context: Any) -> Message:
        with marks.open("a") as out:  # a forked worker inherits this patch; its count comes back by file
            out.write(f"{len(message.content[keys.PACKED][packed.NODES])}\n")
        return real(message, context)

    monkeypatch.setattr(bulk, "answer", marked)
    common = [*FAST, *FORTY, "num_rounds=2", "strategy=dp_fedavg", "privacy.noise_seed=3", TWO_ACTORS]
    plain = simulate([*common, INLINE, "simulation.pack_messages=false"], name="plain")
    where = [] if backend == "ray" else [f"simulation.backend={backend}"]
    shared = simulate([*common, *where, "simulation.bulk=true"], name="bulk")
    assert shared["status"] == "completed" and shared["final"]["epsilon"] == plain["final"]["epsilon"]
    if backend == "processes":
        shares = sorted(int(n) for n in marks.read_text().split())
        assert shares == [8, 8, 32, 32]  # 2 rounds, 2 shares of whole blocks of 16
    saved = [np.load(Path(r["_output_dir"]) / "final_model.npz") for r in (plain, shared)]
    assert saved[0].files == saved[1].files
    for name in (n for n in saved[0].files if saved[0][n].dtype.kind == "f"):
        np.testing.assert_allclose(saved[1][name], saved[0][name], rtol=1e-5, atol=1e-6, err_msg=name)
