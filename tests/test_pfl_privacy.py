"""dpfl's accountant against pfl-research 0.6.0's numbers, kept as a fixture (no pfl needed).

``tests/data/pfl_privacy_fixture.json`` holds what pfl computed for the quick comparison of
``benchmarks/pfl_privacy_check.py`` (made by ``.venv/bin/python -P benchmarks/pfl_privacy_check.py
fixture``, which runs pfl in ``.venv-pfl``): its epsilons of the same noise multipliers with its PLD,
RDP and PRV accountants on pfl's LM and image configurations and dpfl's quick example, its adaptive
clipping's noise split, its banded MF's compositions and matrix.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's benchmarks

from benchmarks import pfl_privacy_check as check

FIXTURE = Path(__file__).parent / "data" / "pfl_privacy_fixture.json"


@pytest.fixture(scope="module")
def fixture() -> dict[str, Any]:
    return json.loads(FIXTURE.read_text())


def test_dpfl_epsilons_agree_with_pfl_on_every_mechanism(fixture: dict[str, Any]) -> None:
    """DP-FedAvg (PLD, RDP, PRV), adaptive clipping and banded MF: within the accountants' tolerance."""
    result = check.compare(fixture["spec"], fixture["pfl"])
    rows = result["rows"]
    failing = [row for row in rows if not row["within"]]
    assert result["epsilon_equal"], failing
    gaussian = [row for row in rows if row["mechanism"] == "DP-FedAvg, fixed clipping"]
    assert {(row["setting"], row["accountant"]) for row in gaussian} == {
        (setting["name"], accountant) for setting in check.SETTINGS for accountant in ("pld", "rdp", "prv")
    }
    for row in gaussian:
        if row["accountant"] == "rdp":  # the same conversion: dpfl's extra orders can only lower it
            assert row["epsilon_dpfl"] <= row["epsilon_pfl"] * (1 + 1e-9)
    adaptive = next(row for row in rows if row["mechanism"] == "adaptive clipping")
    assert adaptive["update_noise_multiplier_dpfl"] == pytest.approx(adaptive["update_noise_multiplier_pfl"])
    assert adaptive["indicator_noise_std_dpfl"] == pytest.approx(adaptive["indicator_noise_std_pfl"])
    band = next(row for row in rows if row["mechanism"] == "banded matrix factorization")
    assert band["compositions_dpfl"] == band["compositions_pfl"] == 8  # ceil(32 / 4)


def test_large_cohort_noise_is_pfls_noise_scale(fixture: dict[str, Any]) -> None:
    """The noise on the simulated cohort's sum: pfl's ``noise_scale = cohort / noise_cohort``, exactly."""
    result = check.compare(fixture["spec"], fixture["pfl"])
    scaled = [row for row in result["rows"] if row["mechanism"].startswith("large-cohort")]
    assert len(scaled) == 2  # the LM (400 of 5000) and image (50 of 1000) configurations
    for row in scaled:
        assert row["within"]
        expected = row["noise_multiplier"] * row["cohort"] / row["noise_cohort"]
        assert row["sum_noise_multiplier_pfl"] == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("factor", [1.03, 0.97])
def test_the_comparison_catches_a_few_percent_of_noise(fixture: dict[str, Any], factor: float) -> None:
    """A noise multiplier off by 3 % on dpfl's side moves its epsilons out of the tolerance."""
    spec = copy.deepcopy(fixture["spec"])
    for case in spec["gaussian"]:
        case["noise_multiplier"] *= factor
    result = check.compare(spec, fixture["pfl"])
    pld = [
        row for row in result["rows"] if row.get("accountant") == "pld" and "DP-FedAvg" in row["mechanism"]
    ]
    assert not result["epsilon_equal"]
    assert not any(row["within"] for row in pld)


def test_pfls_banded_mf_departures_are_reported(fixture: dict[str, Any]) -> None:
    """pfl's rate (cohort / population) and its matrix's column norms above 1; dpfl's columns at most 1."""
    result = check.compare(fixture["spec"], fixture["pfl"])
    rate, columns = result["differences"]
    assert rate["epsilon_at_cyclic_rate"] > 2 * rate["epsilon_pfl_claims"]
    assert fixture["pfl"]["bandmf"]["column_norm_max"] > 1.1
    assert fixture["pfl"]["bandmf"]["row_norm_max"] == pytest.approx(1.0)
    assert columns["epsilon_with_column_bound"] > columns["epsilon_pfl_claims"]
    ours = check.dpfl_band_matrix(rounds=32, bands=4)
    assert ours["column_norm_max"] <= 1.0 + 1e-12
    assert ours["pattern_sensitivity_max"] <= 8**0.5 + 1e-9


def test_the_fixture_is_the_quick_specification(fixture: dict[str, Any]) -> None:
    """The fixture was made from what the script asks pfl now (dpfl's calibrations included)."""
    assert check._same_spec(fixture["spec"], check.specification(quick=True))
