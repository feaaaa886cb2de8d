"""dpfl's central DP around a Flower aggregator (``strategy=dp_flower``): DP-FedAdam, DP-FedAvgM, ...

Oracles: DP-FedAvg's release at the same noise seed (the wrapper only post-processes it) and
dp_accounting's PLD for the epsilon; its one-round end-to-end audit (``PRIVACY_AUDIT``) runs in
``tests/test_privacy_end_to_end.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dp_accounting as dpa
import numpy as np
import pytest
from conftest import InProcessGrid
from test_flower import SHAPE, one_round, strategy_of

from fl_app.config.compose import compose_config
from fl_app.config.validation import ConfigError, validate_config


def test_dp_flower_refuses_aggregators_that_need_every_reply(tmp_path):
    cfg = compose_config(
        [*SHAPE, "strategy=dp_flower", "strategy.flower=Krum", f"output_dir={tmp_path / 'x'}"]
    )
    with pytest.raises(ConfigError, match=r"strategy.flower='Krum': must be FedAvg or a server optimiser"):
        validate_config(cfg, check_data=False)


def test_dp_flower_with_fedavg_releases_exactly_dp_fedavgs_model(tmp_path):
    """The wrapper only post-processes: with Flower's FedAvg its release is DP-FedAvg's, to the bit."""
    common = ["strategy.sampling=fixed", "privacy.noise_seed=5"]
    wrapped = strategy_of(tmp_path, "strategy=dp_flower", "strategy.flower=FedAvg", *common)
    plain = strategy_of(tmp_path, "strategy=dp_fedavg", *common)
    assert wrapped.noise_multiplier == plain.noise_multiplier
    _, _, ours = one_round(wrapped, InProcessGrid(6))
    _, _, theirs = one_round(plain, InProcessGrid(6))
    assert all(np.array_equal(ours[n].numpy(), theirs[n].numpy()) for n in theirs)
    assert wrapped.accountant.state_dict() == plain.accountant.state_dict()


def test_dp_flowers_epsilon_is_the_pld_of_its_rounds(tmp_path):
    """DP-FedAdam's epsilon after T rounds of Poisson sampling: dp_accounting's PLD, computed here."""
    strategy = strategy_of(tmp_path, "strategy=dp_flower", "privacy.epsilon=4")
    assert strategy.settings.flower == "FedAdam" and strategy.secret_cohort
    arrays = strategy.initial_arrays()
    grid = InProcessGrid(6)
    for t in range(1, 4):
        arrays, _, new = one_round(strategy, grid, t, arrays)
        arrays = new
    accountant = dpa.pld.PLDAccountant()
    event = dpa.PoissonSampledDpEvent(0.5, dpa.GaussianDpEvent(strategy.noise_multiplier))
    accountant.compose(event, 3)
    expected = accountant.get_epsilon(strategy.run.settings.privacy.delta)
    assert strategy.epsilon().epsilon == pytest.approx(expected, rel=1e-3)
    assert strategy.epsilon().epsilon == pytest.approx(4.0, rel=1e-3)  # calibrated to the budget
    summary = strategy.report_run(arrays).privacy.summary
    assert summary["server_optimizer"] == "Flower FedAdam" and summary["sampling"] == "poisson"


# ------------------------------------------------------------------ its end-to-end audit and quick example


def dp_flower_audit(tmp_path: Path, held: dict, trials: int) -> Any:
    """DP-FedAvg's audit through the Flower wrapper: the noised average goes to Flower's FedAvgM.

    The release, and so the audit's statistic, passes through the Flower object's ``aggregate_train``
    (server momentum 0.9: in round 1 it moves by the noised average itself).
    """
    from test_privacy_end_to_end import central_update_audit

    overrides = [
        "clients_per_round=1",
        "strategy.clip=0.1",
        "privacy.epsilon=2",
        "strategy.flower=FedAvgM",
        "+strategy.kwargs.server_momentum=0.9",
    ]
    return central_update_audit("dp_flower", overrides, [9, 10], tmp_path, held, trials)


#: (its one-round audit, rounds per input, the least fraction of the reported epsilon it must find)
PRIVACY_AUDIT = (dp_flower_audit, 4000, 0.15)


def check_quick_example(results: dict[str, Any], example: Any) -> None:
    """DP-FedAdam: DP-FedAvg's secret Poisson cohorts and accountant, Flower's FedAdam named."""
    privacy = results["privacy"]
    assert privacy["sampling"] == "poisson" and privacy["randomness"]["source"] == "seeded"
    assert privacy["server_optimizer"] == "Flower FedAdam"
    accountant = dpa.pld.PLDAccountant()
    event = dpa.PoissonSampledDpEvent(
        privacy["sampling_rate"], dpa.GaussianDpEvent(privacy["noise_multiplier"])
    )
    accountant.compose(event, len(results["rounds"]))
    assert results["final"]["epsilon"] == pytest.approx(
        accountant.get_epsilon(example.privacy.delta), rel=1e-3
    )
