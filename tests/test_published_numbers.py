"""DP-FTRL's worst-case tree sensitivity, and dpfl's accountant on published Gboard parameters.

The oracle for :func:`strategies.dp_ftrl.privacy.worst_tree_sensitivity` is every participation
pattern of small trees; the published numbers are google-research/federated's
(``dp_ftrl/blogpost_supplemental_privacy_accounting.ipynb`` and ``mf_dpftrl_matrices/``, at
a5af8c44), as ``benchmarks/published_numbers.py`` puts them beside dpfl's.
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's benchmarks

from benchmarks import published_numbers
from fl_app.privacy.composition import compose_epsilon
from fl_app.privacy.events import Gaussian
from strategies.dp_ftrl.privacy import tree_sensitivity_increments, worst_tree_sensitivity


def complete_tree_sensitivity(leaves: tuple[int, ...], steps: int) -> int:
    """``sum_u n_u^2`` over every aligned block of ``2^k`` leaves within ``steps`` (the complete forest)."""
    total, size = 0, 1
    while size <= steps:
        for start in range(0, steps - size + 1, size):
            inside = sum(start < leaf <= start + size for leaf in leaves)
            total += inside * inside
        size *= 2
    return total


def brute_force(steps: int, participations: int, separation: int, tree: str) -> int:
    """The worst S over every pattern of at most ``participations`` leaves ``separation`` apart."""
    best = 0
    for count in range(1, participations + 1):
        for leaves in itertools.combinations(range(1, steps + 1), count):
            if any(b - a < separation for a, b in itertools.pairwise(leaves)):
                continue
            if tree == "online":
                value = sum(tree_sensitivity_increments(leaves=leaves, steps=steps))
            else:
                value = complete_tree_sensitivity(leaves, steps)
            best = max(best, value)
    return best


@pytest.mark.parametrize("tree", ["online", "complete"])
@pytest.mark.parametrize("steps", [1, 5, 8, 13, 16])
def test_worst_tree_sensitivity_is_the_worst_pattern(tree: str, steps: int) -> None:
    for participations in (1, 2, 4):
        for separation in (1, 2, 3, 5):
            expected = brute_force(steps, participations, separation, tree)
            got = worst_tree_sensitivity(
                steps=steps, max_participations=participations, separation=separation, tree=tree
            )
            assert got == expected, (steps, participations, separation)


def test_one_participation_is_the_trees_depth() -> None:
    for steps in (1, 7, 100, 1600):
        depth = worst_tree_sensitivity(steps=steps, max_participations=1, separation=steps)
        assert depth == steps.bit_length()


def test_gboard_dp_ftrl_rho_and_epsilon_as_published() -> None:
    """z = 7, 2000 rounds, 6 participations 314 apart: S = 79, rho 0.81, epsilon 8.90 (RDP), 8.53 exact."""
    p = published_numbers.GBOARD_DP_FTRL
    squared = worst_tree_sensitivity(
        steps=p["steps"],
        max_participations=p["max_participations"],
        separation=p["min_separation"] + 1,
        tree="complete",
    )
    assert squared == 79
    assert round(squared / (2 * p["noise_multiplier"] ** 2), 2) == p["published_rho"]
    report = compose_epsilon(
        {Gaussian(p["noise_multiplier"] / math.sqrt(squared)): 1}, delta=p["delta"], method="pld"
    )
    assert round(report.rdp, 2) == p["published_epsilon"]
    assert report.pld == pytest.approx(8.526, abs=1e-3) and report.epsilon == report.pld
    online = worst_tree_sensitivity(steps=2000, max_participations=6, separation=314, tree="online")
    assert online == 67 < squared  # dpfl's tree releases one node a round


def test_gboard_mf_epsilons_as_published() -> None:
    """The MF models: one Gaussian at the published rho's sensitivity, dpfl's PLD within 1e-5."""
    for model in published_numbers.GBOARD_MF:
        sigma = model["noise_multiplier"]
        squared = 2 * model["published_rho"] * sigma**2
        report = compose_epsilon({Gaussian(sigma / math.sqrt(squared)): 1}, delta=1e-10, method="pld")
        assert report.pld == pytest.approx(model["published_epsilon"], abs=1e-5)
    pt_br = published_numbers.GBOARD_MF[1]  # unit columns: the Gaussian z in each of 2 participations
    report = compose_epsilon({Gaussian(pt_br["noise_multiplier"]): 2}, delta=1e-10, method="pld")
    assert report.pld == pytest.approx(pt_br["published_epsilon"], abs=1e-5)
