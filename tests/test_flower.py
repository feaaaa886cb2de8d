"""Flower's own strategies in dpfl (``strategy=flower``): FedAvg, FedProx, FedAdam, ... through the adapter.

Oracles: dpfl's own FedAvg (the same average) and Adam's update written out (Reddi et al., ICLR 2021,
Algorithm 2). Strategy tests run whole rounds in process through the real ClientApp
(:class:`InProcessGrid`); ``tests/test_dp_flower.py`` has dpfl's central DP around them.
"""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest
from conftest import InProcessGrid, build_run_context, make_context, make_message
from flwr.app import ConfigRecord

from fl_app import keys
from fl_app.config import compose_config
from fl_app.validation import ConfigError, validate_config
from strategies import STRATEGIES
from strategies.arrays import flat_vector

SHAPE = ["dataset=digits", "model=mlp", "num_clients=6", "clients_per_round=3", "num_rounds=3"]


def one_round(strategy, grid: InProcessGrid, server_round: int = 1, arrays=None):
    """``configure_train`` then ``aggregate_train`` through the grid; (start, messages, new arrays)."""
    arrays = strategy.initial_arrays() if arrays is None else arrays
    messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
    new, _ = strategy.aggregate_train(server_round, grid.send_and_receive(messages))
    return arrays, messages, new


def strategy_of(tmp_path, *overrides: str):
    run = build_run_context([*SHAPE, *overrides], tmp_path)
    return STRATEGIES.get(run.settings.strategy)(run)


def test_flowers_fedavg_averages_as_dpfls_fedavg_does(tmp_path):
    flower = strategy_of(tmp_path, "strategy=flower", "strategy.flower=FedAvg")
    ours = strategy_of(tmp_path, "strategy=fedavg")
    _, messages, through_flower = one_round(flower, InProcessGrid(6))
    _, mine, by_dpfl = one_round(ours, InProcessGrid(6))
    assert [m.metadata.dst_node_id for m in messages] == [m.metadata.dst_node_id for m in mine]
    config = messages[0].content[keys.CONFIG]
    assert config[keys.ALGORITHM] == "flower" and config[keys.SERVER_ROUND] == 1
    np.testing.assert_allclose(flat_vector(through_flower), flat_vector(by_dpfl), rtol=0, atol=1e-6)
    assert {n: a.numpy().dtype for n, a in through_flower.items()} == {
        n: a.numpy().dtype for n, a in by_dpfl.items()
    }


def test_flowers_fedprox_sends_mu_and_the_client_applies_it(tmp_path):
    prox = strategy_of(
        tmp_path, "strategy=flower", "strategy.flower=FedProx", "+strategy.kwargs.proximal_mu=5.0"
    )
    start, messages, _ = one_round(prox, InProcessGrid(6))
    assert messages[0].content[keys.CONFIG]["proximal-mu"] == 5.0
    from fl_app.client_app import train

    def trained(config_changes: dict) -> np.ndarray:
        config = dict(messages[0].content[keys.CONFIG]) | config_changes
        message = make_message(config, start, node_id=1000)
        reply = train(message, make_context(partition_id=0, num_partitions=6, node_id=1000))
        return flat_vector(reply.content.array_records[keys.ARRAYS])

    pulled, free = trained({}), trained({"proximal-mu": 0.0})
    # the proximal term keeps the local model closer to the received one (Li et al., MLSys 2020)
    assert np.linalg.norm(pulled - flat_vector(start)) < 0.9 * np.linalg.norm(free - flat_vector(start))


def test_flowers_fedadam_takes_adams_step_on_the_average(tmp_path):
    eta, beta_1, beta_2, tau = 0.05, 0.9, 0.99, 1e-3
    adam = strategy_of(
        tmp_path,
        "strategy=flower",
        "strategy.flower=FedAdam",
        f"+strategy.kwargs.eta={eta}",
        f"+strategy.kwargs.beta_1={beta_1}",
        f"+strategy.kwargs.beta_2={beta_2}",
        f"+strategy.kwargs.tau={tau}",
    )
    average = strategy_of(tmp_path, "strategy=fedavg")
    start, _, stepped = one_round(adam, InProcessGrid(6))
    _, _, mean = one_round(average, InProcessGrid(6))
    delta = flat_vector(mean).astype(np.float64) - flat_vector(start)
    m, v = (1 - beta_1) * delta, (1 - beta_2) * delta**2
    eta_norm = eta * math.sqrt(1 - beta_2**2) / (1 - beta_1**2)  # Flower's bias correction at round 1
    expected = flat_vector(start) + eta_norm * m / (np.sqrt(v) + tau)
    np.testing.assert_allclose(flat_vector(stepped), expected, rtol=1e-5, atol=1e-6)
    # its optimiser state travels with the checkpoint
    kept = pickle.loads(pickle.dumps(adam.for_checkpoint().flower))
    assert kept.strategy.m_t is not None and kept.strategy.v_t is not None


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["strategy.flower=FedNope"], r"strategy.flower='FedNope': must name a Flower strategy class"),
        (["strategy.flower=DifferentialPrivacyServerSideFixedClipping"], r"not accounted by dpfl"),
        (["strategy.flower=os:getcwd"], r"must name a Flower strategy class"),
        (["+strategy.kwargs.fraction_train=0.5"], r"fraction_train: dpfl draws the cohort"),
        (["+strategy.kwargs.eta=0.1"], r"strategy.kwargs=\{'eta': 0.1\}: FedAvg: .*unexpected keyword"),
    ],
)
def test_a_bad_flower_setting_is_one_line(tmp_path, overrides, message):
    cfg = compose_config([*SHAPE, "strategy=flower", *overrides, f"output_dir={tmp_path / 'x'}"])
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg, check_data=False)


# ------------------------------------------------------------------ its quick example (test_simulations)


def check_quick_example(results: dict, example) -> None:
    """Flower's FedAdam ran: not private, every round's cohort as drawn, the server's optimiser named."""
    assert results["privacy"]["unit"] == "none" and all(r["epsilon"] is None for r in results["rounds"])
    assert all(r["clients"] == example.clients_per_round for r in results["rounds"])
    assert results["config"]["strategy"]["flower"] == "FedAdam"
    assert results["final"]["accuracy"] > results["initial"]["accuracy"]
