"""Flower's own strategies in dpfl (``strategy=flower``): FedAvg, FedProx, FedAdam, ... through the adapter.

Oracles: dpfl's own FedAvg (the same average) and Adam's update written out (Reddi et al., ICLR 2021,
Algorithm 2). Strategy tests run whole rounds in process through the real ClientApp
(:class:`InProcessGrid`); ``tests/test_dp_flower.py`` has dpfl's central DP around them.
"""

from __future__ import annotations

import logging
import math
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import InProcessGrid, build_run_context, make_context, make_message
from flwr.app import ConfigRecord

from fl_app import keys
from fl_app.config.compose import compose_config
from fl_app.config.validation import ConfigError, validate_config
from strategies import STRATEGIES
from strategies.arrays import flat_vector
from strategies.flower import runnable_classes

ROOT = Path(__file__).resolve().parents[1]

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
        (
            ["strategy.flower=Strategy"],
            r"strategy.flower='Strategy': Strategy is Flower's abstract base class",
        ),
        (["strategy.flower=FedXgbBagging"], r"FedXgbBagging aggregates serialised XGBoost models"),
        (["strategy.flower=FedProx"], r"FedProx needs proximal_mu > 0 .* add \+strategy.kwargs.proximal_mu="),
        (["strategy.flower=FedAdam", "+strategy.kwargs.eta_l=0.1"], r"eta_l: .*never send it"),
        (
            ["strategy.kwargs.eta=0.01"],
            r"strategy.kwargs.eta='0.01': .* add it with a \+, as \+strategy.kwargs.eta=0.01",
        ),
        (["strategy.flower=os:getcwd"], r"must name a Flower strategy class"),
        (["+strategy.kwargs.fraction_train=0.5"], r"fraction_train: dpfl draws the cohort"),
        (["+strategy.kwargs.eta=0.1"], r"strategy.kwargs=\{'eta': 0.1\}: FedAvg: .*unexpected keyword"),
    ],
)
def test_a_bad_flower_setting_is_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message) as caught:
        validated(tmp_path, "strategy=flower", *overrides)
    assert "\n" not in str(caught.value)


def validated(tmp_path, *overrides: str):
    """The run's settings as validation reads them (composition and validation both raise ConfigError)."""
    cfg = compose_config([*SHAPE, *overrides, f"output_dir={tmp_path / 'x'}"])
    return validate_config(cfg, check_data=False)


def test_the_unknown_class_error_lists_only_the_classes_dpfl_runs(tmp_path):
    with pytest.raises(ConfigError) as caught:
        validated(tmp_path, "strategy=flower", "strategy.flower=FedNope")
    listed = re.search(r"\(([^)]*)\)", str(caught.value)).group(1).split(", ")
    assert listed == runnable_classes()
    assert not {"Strategy", "FedXgbBagging", "FedXgbCyclic", "Result"} & set(listed)
    assert "DifferentialPrivacyServerSideFixedClipping" in listed and "QFedAvg" in listed


#: The keyword arguments a class needs to run at all (FedProx: its proximal term).
NEEDS = {"FedProx": ["+strategy.kwargs.proximal_mu=0.1"]}


@pytest.mark.parametrize("name", [n for n in runnable_classes() if not n.startswith("DifferentialPrivacy")])
def test_every_listed_class_runs_a_round_on_dpfls_flower_client(tmp_path, name):
    """What the error lists runs: one round through the real client (the DP wrappers: test_flower_dp.py)."""
    strategy = strategy_of(tmp_path, "strategy=flower", f"strategy.flower={name}", *NEEDS.get(name, []))
    start, messages, new = one_round(strategy, InProcessGrid(6))
    assert {m.content[keys.CONFIG][keys.ALGORITHM] for m in messages} == {"flower"}  # only the server changes
    assert new is not None and not np.array_equal(flat_vector(new), flat_vector(start))


def test_the_documented_sweep_has_no_two_equal_arms(tmp_path):
    """FedAvgM runs with server momentum 0.9 unless given (Flower's default 0.0 made it FedAvg's twin)."""
    page = (ROOT / "docs" / "algorithms" / "flower.md").read_text()
    (arms,) = re.findall(r"python -m fl_app -m strategy=flower strategy\.flower=(\S+)", page)
    finals = {}
    for name in arms.split(","):
        strategy = strategy_of(tmp_path, "strategy=flower", f"strategy.flower={name}")
        arrays, grid = None, InProcessGrid(6)
        for t in (1, 2):  # momentum shows from the second round on
            _, _, arrays = one_round(strategy, grid, t, arrays)
        finals[name] = flat_vector(arrays)
    assert len(finals) == 4
    names = list(finals)
    for i, first in enumerate(names):
        for second in names[i + 1 :]:
            assert not np.allclose(finals[first], finals[second], atol=1e-6), (first, second)
    assert (
        strategy_of(tmp_path, "strategy=flower", "strategy.flower=FedAvgM").flower.strategy.server_momentum
        == 0.9
    )


def header_of(strategy) -> str:
    """What ``describe()`` logs (the run's header)."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("flwr")
    logger.addHandler(handler)
    try:
        strategy.describe()
    finally:
        logger.removeHandler(handler)
    return "\n".join(lines)


def test_the_header_says_only_what_the_run_does(tmp_path):
    adam = header_of(
        strategy_of(tmp_path, "strategy=flower", "strategy.flower=FedAdam", "+strategy.kwargs.eta=0.02")
    )
    wrapped = header_of(strategy_of(tmp_path, "strategy=dp_flower", "strategy.flower=FedAdam"))
    for header in (adam, wrapped):
        # Flower's summary() would say Fraction: train (1.00) (dpfl samples), eta_l (no client reads it)
        assert "Fraction" not in header and "Minimum" not in header and "eta_l" not in header, header
        assert "eta=" in header and "beta_1=0.9" in header
    assert (
        "eta=0.02" in adam and "weighted_by_key='num-examples'" in adam
    )  # Flower's FedAvg weighs by examples
    assert "Weighted by" not in wrapped and "weighted_by" not in wrapped  # DP-FedAvg's one reply: unweighted
    assert "secret Poisson cohorts" in wrapped


def test_the_page_says_a_flower_strategy_changes_only_the_server_and_fedavg_sums_in_float32(tmp_path):
    page = (ROOT / "docs" / "algorithms" / "flower.md").read_text()
    section = page.split("## A Flower strategy changes only the server", 1)[1].split("\n## ", 1)[0]
    assert "clients/flower.py" in section and "float32" in section and "strategy=fedavg" in section
    flower = strategy_of(tmp_path, "strategy=flower", "strategy.flower=FedAvg")
    ours = strategy_of(tmp_path, "strategy=fedavg")
    _, _, a = one_round(flower, InProcessGrid(6))
    _, _, b = one_round(ours, InProcessGrid(6))
    # what the page says: equal to float32 rounding, not bit for bit
    assert not np.array_equal(flat_vector(a), flat_vector(b))
    np.testing.assert_allclose(flat_vector(a), flat_vector(b), rtol=0, atol=1e-6)


# ------------------------------------------------------------------ its quick example (test_simulations)


def check_quick_example(results: dict, example) -> None:
    """Flower's FedAdam ran: not private, every round's cohort as drawn, the server's optimiser named."""
    assert results["privacy"]["unit"] == "none" and all(r["epsilon"] is None for r in results["rounds"])
    assert all(r["clients"] == example.clients_per_round for r in results["rounds"])
    assert results["config"]["strategy"]["flower"] == "FedAdam"
    assert results["final"]["accuracy"] > results["initial"]["accuracy"]
