"""An actor's batch of train messages trained as one vectorised computation (``simulation.vectorise``).

Every algorithm whose client keeps the contract's ``train_locally`` and states a local SGD builds its
real train messages (its strategy's ``configure_train``, digits, six clients of unequal sizes); the
same batch runs through the engine's ``run_jobs`` with the vectorised path and without it, and every
reply must agree to float tolerance: the trained model (FedAvg, FedProx through Flower's strategy),
the clipped and noised update (FedAvg+LDP, NbAFL: the same seeded noise on the same update),
PrivateKT's randomized labels, SCAFFOLD's model and control variate (tests/test_scaffold.py sets random ones).
The vectorised path must really have been taken (counted), a call that differs from the plan trains
on its own, and a client class whose results go unused is named once and trains one by one.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from conftest import FAST, INLINE, build_run_context, count_vectorised_trainings, make_context
from flwr.app import ConfigRecord

from clients.base import trains_by_the_contract
from fl_app import keys
from fl_app.client_app import app, client_for
from fl_app.engine import vectorised as vectorised_engine
from fl_app.engine.batching import run_jobs
from strategies import STRATEGIES

SIX = ["dataset=digits", "num_clients=6", "clients_per_round=6", "partition=dirichlet", "local_epochs=2"]
#: Algorithm -> overrides that make its check stronger (a proximal term, Flower's FedProx); every
#: registered algorithm is checked whether or not it is named here.
ALGORITHMS = {
    "nbafl": ["strategy.mu=0.01"],
    "flower": ["strategy.flower=FedProx", "+strategy.kwargs.proximal_mu=0.1"],
}


@pytest.fixture(autouse=True)
def _fresh_declines(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts with no client class declined by an earlier one (the set is per process)."""
    monkeypatch.setattr(vectorised_engine, "_declined", set())


def batch_of(
    name: str,
    tmp_path: Any,
    extra: list[str] | None = None,
    prepare: Callable[[Any, list[tuple[Any, Any]]], None] | None = None,
) -> list[tuple[Any, Any]]:
    """Round 1's train messages of ``name`` with the vectorised path asked for, and their nodes' contexts.

    ``prepare(strategy, jobs)`` runs before the messages are built (``jobs`` empty) and again after
    (an algorithm's own test sets what its check needs: SCAFFOLD's random control variates).
    """
    overrides = [*FAST, *SIX, f"strategy={name}", "simulation.vectorise=true", *ALGORITHMS.get(name, [])]
    overrides += extra or []
    strategy = STRATEGIES.get(name)(build_run_context(overrides, tmp_path))
    if prepare is not None:
        prepare(strategy, [])
    messages = list(strategy.configure_train(1, strategy.initial_arrays(), ConfigRecord(), grid=None))
    jobs = [
        (m, make_context(partition_id=m.metadata.dst_node_id - 1000, node_id=m.metadata.dst_node_id))
        for m in messages
    ]
    if prepare is not None:
        prepare(strategy, jobs)
    return jobs


def replies_of(jobs: list[tuple[Any, Any]], *, vectorise: bool) -> list[Any]:
    """``run_jobs`` on the batch, with the train config's switch set to ``vectorise``."""
    for message, _ in jobs:
        message.content.config_records[keys.CONFIG][keys.VECTORISE] = vectorise
    outcomes = run_jobs(lambda: app, jobs)
    assert all(outcome[0] == "reply" for outcome in outcomes), [o[1:3] for o in outcomes if o[0] != "reply"]
    return [outcome[1] for outcome in outcomes]


def arrays_of(reply: Any) -> dict[str, np.ndarray]:
    """Every array of a reply, by record and name."""
    return {  # PrivateKT's labels are packed bytes ("raw"): compared as bytes
        f"{record}/{name}": array.numpy() if array.stype != "raw" else np.frombuffer(array.data, np.uint8)
        for record, arrays in reply.content.array_records.items()
        for name, array in arrays.items()
    }


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the messages whose training came from their cohort (loaded into a model, or read as is)."""
    return count_vectorised_trainings(monkeypatch)


def vectorisable_batch(name: str, tmp_path: Any) -> list[tuple[Any, Any]] | None:
    """Round 1's train messages of ``name`` when the engine may train its clients vectorised, else None.

    Derived from the client class (:func:`clients.base.trains_by_the_contract`): a new algorithm is
    checked without being listed.
    """
    declaration = STRATEGIES.get(name).declaration
    if declaration.min_clients > 6:
        return None
    deploy = [o for o in declaration.deploy if not o.startswith("model=")]
    try:
        jobs = batch_of(name, tmp_path, deploy)
    except AttributeError as error:  # a protocol that talks to the grid first (SecAgg+): never trains here
        if "'NoneType' object" not in str(error):
            raise  # anything else is the algorithm's or the test's error, never a silent skip
        return None
    message, context = jobs[0]
    return jobs if trains_by_the_contract(client_for(message, context)) else None


def test_the_vectorisable_algorithms_include_the_baselines(tmp_path: Any) -> None:
    """The derivation finds the clients it must (a broken contract check would skip them all)."""
    found = {name for name in STRATEGIES.names() if vectorisable_batch(name, tmp_path / name) is not None}
    assert {"fedavg", "dp_fedavg", "fedavg_ldp", "nbafl", "privatekt", "flower"} <= found
    assert not found & {"kd_dp", "dpfl_bnn", "dp_fedavg_secagg", "laplace_eval"}, found


@pytest.mark.parametrize("name", sorted(STRATEGIES.names()))
def test_replies_equal_the_per_message_path(name: str, tmp_path: Any, loads: list[int]) -> None:
    jobs = vectorisable_batch(name, tmp_path)
    if jobs is None:
        pytest.skip(f"{name}'s client trains its own way (never vectorised)")
    assert len(jobs) == 6, f"{name}: {len(jobs)} train messages for a cohort of 6"
    together = replies_of(copy.deepcopy(jobs), vectorise=True)
    assert len(loads) == 6, f"{name}: {len(loads)} of 6 messages trained in their cohort"
    alone = replies_of(copy.deepcopy(jobs), vectorise=False)
    assert len(loads) == 6
    for a, b in zip(together, alone, strict=True):
        arrays_a, arrays_b = arrays_of(a), arrays_of(b)
        assert arrays_a.keys() == arrays_b.keys()
        for key, value in arrays_a.items():
            if value.dtype.kind in "iu":  # PrivateKT's randomized labels: argmax may flip at a near tie
                assert np.mean(value == arrays_b[key]) >= 0.95, (name, key)
            else:
                np.testing.assert_allclose(
                    value, arrays_b[key], rtol=1e-4, atol=2e-5, err_msg=f"{name} {key}"
                )
        metrics_a = {k: v for r in a.content.metric_records.values() for k, v in r.items()}
        metrics_b = {k: v for r in b.content.metric_records.values() for k, v in r.items()}
        assert metrics_a.keys() == metrics_b.keys()
        for key, value in metrics_a.items():
            assert value == pytest.approx(metrics_b[key], rel=1e-4), (name, key)


def test_a_call_that_differs_from_the_plan_trains_on_its_own(
    tmp_path: Any, loads: list[int], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """NbAFL's plan made with another proximal coefficient than its call asks for: nothing is taken, the
    replies are the per-message path's bit for bit, and the class is named once and declined."""
    from clients.nbafl import NbAFLClient

    real = vectorised_engine._group_key

    def other_plan(client: Any) -> Any:
        found = real(client)
        assert found is not None
        settings, record, arrays, sgd = found
        return settings, record, arrays, replace(sgd, proximal_mu=0.5)

    monkeypatch.setattr(vectorised_engine, "_group_key", other_plan)
    jobs = batch_of("nbafl", tmp_path)
    with caplog.at_level(logging.WARNING):
        together = replies_of(copy.deepcopy(jobs), vectorise=True)
    assert loads == []
    assert NbAFLClient in vectorised_engine._declined
    assert sum("NbAFLClient's clients train one by one" in r.getMessage() for r in caplog.records) == 1
    alone = replies_of(copy.deepcopy(jobs), vectorise=False)
    for a, b in zip(together, alone, strict=True):
        for key, value in arrays_of(a).items():
            np.testing.assert_array_equal(value, arrays_of(b)[key])


def test_a_client_class_that_never_takes_its_result_is_named_once_then_trains_alone(
    tmp_path: Any, loads: list[int], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A FedAvg client whose ``train_result`` trains a model of its own (never ``train_locally``): its
    first batch is trained as a cohort and unused, one line names it, and later batches train no cohort."""
    from clients.fedavg import FedAvgClient
    from fl_app.learning.train_results import TrainResult
    from fl_app.learning.training import model_state, train_local

    def own_training(self: Any) -> TrainResult:
        model, data, sgd = self.global_model(), self.local_data(), self.local_sgd()
        loss = train_local(model, data.x, data.y, epochs=sgd.epochs, batch_size=sgd.batch_size, lr=sgd.lr,
                           rng=self.generator("data-order"))  # fmt: skip
        return TrainResult(model_state(model), {keys.NUM_EXAMPLES: len(data), keys.TRAIN_LOSS: loss})

    monkeypatch.setattr(FedAvgClient, "train_result", own_training)
    cohorts: list[int] = []
    real = vectorised_engine.train_vectorised
    monkeypatch.setattr(
        vectorised_engine, "train_vectorised", lambda *a, **k: cohorts.append(1) or real(*a, **k)
    )
    with caplog.at_level(logging.WARNING):
        replies_of(batch_of("fedavg", tmp_path), vectorise=True)
        replies_of(batch_of("fedavg", tmp_path / "again"), vectorise=True)
    assert cohorts == [1] and loads == []
    assert sum("FedAvgClient's clients train one by one" in r.getMessage() for r in caplog.records) == 1


def test_messages_with_other_global_models_train_in_their_own_cohort(
    tmp_path: Any, loads: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Half the batch carries a global model that differs in one weight: two cohorts of three, not one
    of six (a cohort trains from one model), and every reply still equals the per-message path's."""
    from fl_app.learning.training import array_values, numpy_array

    jobs = batch_of("fedavg", tmp_path)
    for message, _ in jobs[::2]:
        message.content = copy.deepcopy(message.content)  # the strategy's messages share one record
        arrays = message.content.array_records[keys.ARRAYS]
        name = next(iter(arrays.keys()))
        changed = array_values(arrays[name]).copy()
        changed.flat[0] += 1e-3
        arrays[name] = numpy_array(changed)
    sizes: list[int] = []
    real = vectorised_engine._train_group

    def spy(group: Any) -> list[str]:
        sizes.append(len(group.members))
        return real(group)

    monkeypatch.setattr(vectorised_engine, "_train_group", spy)
    together = replies_of(copy.deepcopy(jobs), vectorise=True)
    assert sorted(sizes) == [3, 3] and len(loads) == 6
    alone = replies_of(copy.deepcopy(jobs), vectorise=False)
    for a, b in zip(together, alone, strict=True):
        for key, value in arrays_of(a).items():
            np.testing.assert_allclose(value, arrays_of(b)[key], rtol=1e-4, atol=2e-5)


def test_without_the_switch_or_for_other_clients_nothing_is_planned(tmp_path: Any, loads: list[int]) -> None:
    replies_of(batch_of("fedavg", tmp_path), vectorise=False)
    replies_of(batch_of("fedavg", tmp_path / "b", ["model=cnn"]), vectorise=True)
    assert len(loads) == 6  # the CNN cohort (vmap-able): planned; the switch off: not
    loads.clear()
    replies_of(batch_of("dpfl_bnn", tmp_path / "c"), vectorise=True)  # its own binary training loop
    assert loads == []


def test_auto_is_on_only_where_clients_train_on_cuda(tmp_path: Any) -> None:
    from fl_app.config.compose import compose_config
    from fl_app.config.validation import typed_settings

    def vectorises(*overrides: str) -> bool:
        return typed_settings(compose_config([*FAST, *overrides])).simulation.vectorises

    assert vectorises() is False  # auto, CPU
    assert vectorises("simulation.vectorise=true") is True
    assert vectorises("simulation.vectorise=false", "simulation.client_gpus=0.5") is False


@pytest.mark.simulation
def test_a_seeded_dp_fedavg_run_learns_the_same_on_both_paths(
    simulate: Any, loads: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole engine: eight messages per task trained together, the same seeded DP-FedAvg run's
    accuracy and epsilon as with one loop per message (float noise apart). Which path ran is counted:
    the vectorised trainer's calls and the messages whose training was taken from a cohort (the two paths
    may agree bit for bit on some machines, so their results cannot tell). Its clients run inline
    (the same batch hook as on an actor, :mod:`fl_app.engine.inline`); the Ray actors' batches are
    checked against the golden rounds in test_flower_engine.py."""
    cohorts: list[int] = []  # the clients of each train_vectorised call
    real = vectorised_engine.train_vectorised

    def counting(model: Any, global_params: Any, xs: Any, *args: Any, **kwargs: Any) -> Any:
        cohorts.append(len(xs))
        return real(model, global_params, xs, *args, **kwargs)

    monkeypatch.setattr(vectorised_engine, "train_vectorised", counting)
    common = [
        *FAST, "strategy=dp_fedavg", "num_clients=12", "clients_per_round=8", "num_rounds=3",
        "privacy.epsilon=8", "simulation.messages_per_task=8", "simulation.max_concurrent_clients=1", INLINE,
        "simulation.bulk=false",  # the per-message engine (the bulk path trains its share itself)
    ]  # fmt: skip
    vectorised = simulate([*common, "simulation.vectorise=true"], "vectorised")
    assert cohorts and min(cohorts) >= vectorised_engine.MIN_GROUP, cohorts
    assert len(loads) == sum(cohorts)  # every client the vectorised trainer trained took its result
    calls, taken = len(cohorts), len(loads)
    looped = simulate([*common, "simulation.vectorise=false"], "looped")
    assert (len(cohorts), len(loads)) == (calls, taken)  # the loop: no cohort trained, none taken
    assert vectorised["status"] == looped["status"] == "completed"
    assert vectorised["final"]["epsilon"] == looped["final"]["epsilon"]
    assert vectorised["final"]["accuracy"] == pytest.approx(looped["final"]["accuracy"], abs=0.02)
    assert vectorised["final"]["loss"] == pytest.approx(looped["final"]["loss"], rel=1e-2)


def test_a_client_that_overrides_train_locally_is_never_vectorised(
    tmp_path: Any, loads: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A FedAvg client subclass with its own ``train_locally`` loop: the engine trains no cohort for it
    (it could not know what the loop does), and its override runs for every message."""
    from clients.base import FederatedClient
    from clients.fedavg import FedAvgClient

    called: list[int] = []

    def own(self: Any) -> Any:
        called.append(1)
        return FederatedClient.train_locally(self)

    monkeypatch.setattr(FedAvgClient, "train_locally", own)
    replies_of(batch_of("fedavg", tmp_path), vectorise=True)
    assert len(called) == 6 and loads == []
