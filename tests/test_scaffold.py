"""SCAFFOLD (``strategy=scaffold``): corrected local SGD, the clients' control variates kept as state.

Oracles: the corrected local SGD against ``torch.optim.SGD`` with the correction added to every
gradient by hand; the client's option-II control variate and its upload recomputed from the reply
(Karimireddy et al., ICML 2020, Algorithm 1, lines 10-13); the server's two steps (lines 16-17) on
constructed replies. The engine keeps each client's ``c_i`` by client id: a run interrupted and
resumed equals the straight run on every backend, a packed round equals a plain one bit for bit, and
a run whose clients lost their state (a mutant store) does not.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from conftest import build_run_context, count_vectorised_trainings, make_context, reply_to
from flwr.app import ConfigRecord

from clients.scaffold import CONTROL
from fl_app import keys
from fl_app.client_app import train
from fl_app.learning.training import array_values, local_steps, state_to_arrays, train_local
from strategies import STRATEGIES

SHAPE = ["dataset=digits", "num_clients=6", "clients_per_round=3", "strategy=scaffold", "batch_size=16"]
RUN = [
    "dataset=digits", "num_clients=12", "clients_per_round=6", "strategy=scaffold", "partition.alpha=0.1",
    "local_epochs=2", "batch_size=16", "lr=0.1",
]  # fmt: skip


def strategy_of(tmp_path: Path, *extra: str) -> Any:
    return STRATEGIES.get("scaffold")(build_run_context([*SHAPE, *extra], tmp_path))


def random_like(arrays: dict[str, np.ndarray], seed: int, scale: float = 0.05) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.normal(0, scale, values.shape).astype(np.float32) for name, values in arrays.items()}


def test_a_gradient_correction_is_added_to_every_step() -> None:
    """``train_local(correction=v)`` equals SGD whose every gradient has ``v`` added (torch.optim.SGD)."""
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    theirs = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    theirs.load_state_dict(ours.state_dict())
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(21, 8)).astype(np.float32), rng.integers(0, 3, 21)
    correction = [torch.from_numpy(rng.normal(0, 0.5, p.shape).astype(np.float32)) for p in ours.parameters()]
    train_local(ours, x, y, epochs=2, batch_size=5, lr=0.1, momentum=0.5, rng=np.random.default_rng(3),
                correction=correction)  # fmt: skip
    optimizer = torch.optim.SGD(theirs.parameters(), lr=0.1, momentum=0.5)
    order_rng = np.random.default_rng(3)
    for _ in range(2):
        order = order_rng.permutation(21)
        for start in range(0, 21, 5):
            index = torch.from_numpy(order[start : start + 5])
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(
                theirs(torch.from_numpy(x)[index]), torch.from_numpy(y)[index]
            ).backward()
            for parameter, shift in zip(theirs.parameters(), correction, strict=True):
                parameter.grad += shift
            optimizer.step()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_the_client_keeps_option_ii_and_uploads_the_difference(tmp_path: Path) -> None:
    """From ``c`` (sent) and ``c_i`` (kept): ``c_i+ = c_i - c + (x - y_i) / (K eta)`` is kept and
    ``c_i+ - c_i`` uploaded with ``y_i``; ``K`` is the number of local steps."""
    strategy = strategy_of(tmp_path)
    strategy.control = random_like(strategy.control, seed=1)
    start = strategy.initial_arrays()
    message = next(iter(strategy.configure_train(1, start, ConfigRecord(), grid=None)))
    client_id = int(message.metadata.dst_node_id) - 1000
    context = make_context(partition_id=client_id, node_id=int(message.metadata.dst_node_id))
    own = random_like(strategy.control, seed=2)
    context.state[CONTROL] = state_to_arrays(own)
    reply = train(message, context)
    trained = {n: array_values(a) for n, a in reply.content.array_records[keys.ARRAYS].items()}
    delta = {n: array_values(a) for n, a in reply.content.array_records[CONTROL].items()}
    kept = {n: array_values(a) for n, a in context.state[CONTROL].items()}  # type: ignore[union-attr]
    size = len(strategy.run.data.client(client_id).y)
    steps = local_steps(size, epochs=strategy.run.settings.local_epochs, batch_size=16)
    lr = float(message.content[keys.CONFIG][keys.LR])
    assert steps == strategy.run.settings.local_epochs * -(-size // 16) > 0
    for name, c in strategy.control.items():
        expected = own[name] - c + (array_values(start[name]) - trained[name]) / (steps * lr)
        np.testing.assert_allclose(kept[name], expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(delta[name], expected - own[name], rtol=1e-5, atol=1e-6)


def test_the_correction_changes_what_the_client_trains(tmp_path: Path) -> None:
    """The same message with ``c - c_i`` zero or not: another model (the correction reaches the loop)."""
    strategy = strategy_of(tmp_path)
    start = strategy.initial_arrays()
    message = next(iter(strategy.configure_train(1, start, ConfigRecord(), grid=None)))
    node = int(message.metadata.dst_node_id)
    plain = train(message, make_context(partition_id=node - 1000, node_id=node))
    corrected_context = make_context(partition_id=node - 1000, node_id=node)
    corrected_context.state[CONTROL] = state_to_arrays(random_like(strategy.control, seed=3))
    corrected = train(message, corrected_context)
    a = plain.content.array_records[keys.ARRAYS]
    b = corrected.content.array_records[keys.ARRAYS]
    assert any(not np.array_equal(array_values(a[n]), array_values(b[n])) for n in strategy.control)


def test_the_server_steps_the_model_and_its_control_variate(tmp_path: Path) -> None:
    """``x + eta_g (mean y_i - x)`` and ``c + sum_i Delta c_i / N`` over the valid replies (a failure
    counts in neither)."""
    strategy = strategy_of(tmp_path, "strategy.server_lr=0.5")
    strategy.control = random_like(strategy.control, seed=4)
    before = {n: v.copy() for n, v in strategy.control.items()}
    start = strategy.initial_arrays()
    messages = list(strategy.configure_train(1, start, ConfigRecord(), grid=None))
    x = {n: array_values(start[n]).astype(np.float64) for n in start}
    uploads = [
        random_like({n: v for n, v in x.items()}, seed=10 + i, scale=0.2) for i in range(len(messages))
    ]
    deltas = [random_like(strategy.control, seed=20 + i) for i in range(len(messages))]
    replies = []
    for message, up, dc in zip(messages[:-1], uploads, deltas, strict=False):
        reply = reply_to(
            message, arrays=state_to_arrays(up), metrics={keys.NUM_EXAMPLES: 5, keys.TRAIN_LOSS: 1.0}
        )
        reply.content[CONTROL] = state_to_arrays(dc)
        replies.append(reply)
    new, _ = strategy.aggregate_train(1, replies)
    assert new is not None
    count = len(replies)
    for name in x:
        mean = np.mean([up[name].astype(np.float64) for up in uploads[:count]], axis=0)
        np.testing.assert_allclose(
            array_values(new[name]), x[name] + 0.5 * (mean - x[name]), rtol=1e-6, atol=1e-7
        )
    for name, c in before.items():
        total = np.sum([dc[name].astype(np.float64) for dc in deltas[:count]], axis=0)
        np.testing.assert_allclose(strategy.control[name], c + total / 6, rtol=1e-6, atol=1e-7)
    assert strategy.replies.failures(1) == [int(messages[-1].metadata.dst_node_id) - 1000]


def rounds_of(results: dict[str, Any]) -> list[tuple[float, float]]:
    return [(r["accuracy"], r["loss"]) for r in results["rounds"]]


def final_model(results: dict[str, Any]) -> dict[str, bytes]:
    with np.load(Path(results["_output_dir"]) / "final_model.npz") as saved:
        return {name: saved[name].tobytes() for name in saved.files}


@pytest.mark.simulation
@pytest.mark.parametrize("backend", ["inline", "processes", "ray"])
def test_a_resumed_run_equals_the_straight_run(backend: str, simulate: Any) -> None:
    """Three rounds, then ``resume=`` to six: the same rounds and final model as six straight (each
    client's ``c_i`` comes back from the checkpoint, by client id, on every backend)."""
    common = [*RUN, f"simulation.backend={backend}"]
    straight = simulate([*common, "num_rounds=6"], "straight")
    first = simulate([*common, "num_rounds=3"], "first")
    resumed = simulate([f"resume={first['_output_dir']}", "num_rounds=6"], "first")
    assert resumed["status"] == straight["status"] == "completed"
    assert rounds_of(resumed) == rounds_of(straight)
    assert final_model(resumed) == final_model(straight)


@pytest.mark.simulation
def test_state_survives_packed_rounds_and_a_lost_state_changes_the_run(
    simulate: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Packed (16 clients a message, each member's ``c_i`` carried in and out) and plain rounds release
    the same models bit for bit; a store that forgets every state (a mutant) gives another run."""
    from fl_app.engine.client_states import ClientStates

    common = [*RUN, "num_rounds=4", "simulation.backend=inline"]
    packed = simulate([*common, "simulation.pack_messages=true"], "packed")
    plain = simulate([*common, "simulation.pack_messages=false"], "plain")
    assert rounds_of(packed) == rounds_of(plain) and final_model(packed) == final_model(plain)
    monkeypatch.setattr(ClientStates, "keep", lambda self, client_id, records: None)
    forgetful = simulate([*common, "simulation.pack_messages=true"], "forgetful")
    assert final_model(forgetful) != final_model(packed)


def test_the_checkpoint_names_the_clients_state_as_private(tmp_path: Path) -> None:
    """What the interrupt line says the checkpoint holds: the clients' state between rounds, un-noised."""
    from fl_app.run.text import private_state_text

    strategy = strategy_of(tmp_path)
    text = private_state_text(strategy, tmp_path, client_states=True)
    assert "every client's state between rounds" in text and "not noised" in text


def check_quick_example(results: dict[str, Any], example: Any) -> None:
    """Not private, every round's cohort as drawn, the model learns."""
    assert results["privacy"]["unit"] == "none" and all(r["epsilon"] is None for r in results["rounds"])
    assert all(r["clients"] == example.clients_per_round for r in results["rounds"])
    assert results["final"]["accuracy"] > results["initial"]["accuracy"]
    assert json.dumps(results["config"]["strategy"]["server_lr"]) == "1.0"


def test_the_vectorised_trainer_applies_each_clients_correction(tmp_path: Path, monkeypatch: Any) -> None:
    """Random server and client control variates (zero ones would make the correction vanish, and a
    trainer that ignored it would pass): the six replies trained as one computation equal the loop's."""
    import copy

    from test_vectorised import arrays_of, batch_of, replies_of

    from fl_app.engine import vectorised as vectorised_engine

    monkeypatch.setattr(vectorised_engine, "_declined", set())
    loads = count_vectorised_trainings(monkeypatch)
    rng = np.random.default_rng(5)

    def random_controls(strategy: Any, jobs: list[tuple[Any, Any]]) -> None:
        if not jobs:
            strategy.control = {
                n: rng.normal(0, 0.02, v.shape).astype(np.float32) for n, v in strategy.control.items()
            }
        for _, context in jobs:
            own = {n: rng.normal(0, 0.02, v.shape).astype(np.float32) for n, v in strategy.control.items()}
            context.state[CONTROL] = state_to_arrays(own)

    jobs = batch_of("scaffold", tmp_path, prepare=random_controls)
    together = replies_of(copy.deepcopy(jobs), vectorise=True)
    assert len(loads) == 6, f"{len(loads)} of 6 messages trained in their cohort"
    alone = replies_of(copy.deepcopy(jobs), vectorise=False)
    for a, b in zip(together, alone, strict=True):
        for key, value in arrays_of(a).items():
            np.testing.assert_allclose(value, arrays_of(b)[key], rtol=1e-4, atol=2e-5, err_msg=key)
