"""DP partition selection (the text vocabulary's mechanism) against independent oracles.

The noise is measured from the mechanism's own draws and the epsilon it reports is checked against
the exact Gaussian privacy profile (Balle & Wang 2018) at the sensitivity the analysis claims,
``sqrt(k)``, and against dp_accounting's PLD accountant; the threshold's delta against scipy's normal
tail and against the rate at which a word of one user is released. Mutants (noise scaled by ``k``
instead of ``sqrt(k)``, an event that forgets the sensitivity, a threshold one user lower) fail the
same checks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from scipy.stats import norm

from fl_app.data.text_vocabulary import count_bounded_words, user_top_words
from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.composition import EpsilonReport, compose_epsilon
from fl_app.privacy.events import Gaussian, PrivacyEvent, SampledGaussian
from fl_app.privacy.partition_selection import (
    GaussianPartitionSelection,
    SelectionBudget,
    calibrate_selection,
    total_with_selection,
)

#: The defaults of a Stack Overflow run at epsilon 8, delta 1e-5 (a tenth of each), and a small k.
CASES = [(0.8, 1e-6, 100), (4.0, 1e-6, 8)]


def exact_gaussian_delta(*, epsilon: float, sensitivity: float, std: float) -> float:
    """The Gaussian mechanism's exact delta at ``epsilon`` (Balle & Wang 2018, Theorem 8)."""
    mu = sensitivity / std
    return float(norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon) * norm.cdf(-epsilon / mu - mu / 2))


def measured_std(selection: GaussianPartitionSelection, draws: int = 400_000) -> float:
    """The standard deviation of the noise the mechanism adds, from its own draws."""
    counts = np.full(draws, 1000.0)
    return float(np.std(selection.noisy_counts(counts, np.random.default_rng(0)) - counts))


def gaussian_part_holds(
    budget: SelectionBudget, selection: GaussianPartitionSelection
) -> tuple[float, float]:
    """The exact delta of ``selection``'s measured noise at the epsilon the budget reports, and the target.

    ``budget`` says what is charged (its Gaussian event's epsilon at ``delta_gaussian``); ``selection``
    is what runs (its noise). The analysis holds when the exact delta at the sensitivity ``sqrt(k)``
    is at most the target (and close to it: the calibration is tight).
    """
    charged = budget.gaussian_epsilon("pld")
    exact = exact_gaussian_delta(
        epsilon=charged, sensitivity=math.sqrt(selection.words_per_user), std=measured_std(selection)
    )
    return exact, budget.delta_gaussian


@pytest.mark.parametrize(("epsilon", "delta", "k"), CASES)
def test_the_charged_epsilon_is_the_noise_the_mechanism_adds(epsilon: float, delta: float, k: int) -> None:
    budget = calibrate_selection(epsilon=epsilon, delta=delta, words_per_user=k, method="pld")
    selection = budget.selection
    assert measured_std(selection) == pytest.approx(selection.noise_multiplier * math.sqrt(k), rel=5e-3)
    exact, target = gaussian_part_holds(budget, selection)
    assert 0.6 * target < exact <= 1.1 * target, (exact, target)
    # the whole share: the Gaussian part, the threshold's shift and its delta
    assert budget.own_epsilon("pld") <= epsilon
    assert budget.own_epsilon("pld") == pytest.approx(epsilon, rel=1e-3)
    assert budget.delta == pytest.approx(delta, rel=1e-12)
    # dp_accounting's own PLD and RDP accountants on the same event
    import dp_accounting
    from dp_accounting.pld.pld_privacy_accountant import PLDAccountant
    from dp_accounting.rdp.rdp_privacy_accountant import RdpAccountant

    event = dp_accounting.GaussianDpEvent(selection.noise_multiplier)
    pld, rdp = PLDAccountant(), RdpAccountant()
    pld.compose(event)
    rdp.compose(event)
    charged = budget.gaussian_epsilon("pld")
    assert charged == pytest.approx(pld.get_epsilon(budget.delta_gaussian), rel=1e-3)
    assert charged <= rdp.get_epsilon(budget.delta_gaussian)


class NoiseScaledByK(GaussianPartitionSelection):
    """A mutant: the noise scaled by ``k``, not by the sensitivity ``sqrt(k)``."""

    @property
    def noise_std(self) -> float:
        return self.noise_multiplier * self.words_per_user


class SensitivityForgotten(GaussianPartitionSelection):
    """A mutant: the accountant's event is the noise over sensitivity 1 (``sigma``, not ``z``)."""

    @property
    def mechanism(self) -> Gaussian:
        return Gaussian(self.noise_std)


@pytest.mark.parametrize("mutant", [NoiseScaledByK, SensitivityForgotten])
def test_the_check_catches_a_wrong_sensitivity(mutant: type[GaussianPartitionSelection]) -> None:
    budget = calibrate_selection(epsilon=0.8, delta=1e-6, words_per_user=100, method="pld")
    selection = budget.selection
    wrong = mutant(selection.words_per_user, selection.noise_multiplier, selection.threshold)
    charged = SelectionBudget(wrong, budget.epsilon, budget.delta_gaussian, budget.delta_threshold)
    exact, target = gaussian_part_holds(charged, wrong)
    assert not (0.6 * target < exact <= 1.1 * target), (mutant.__name__, exact, target)


@pytest.mark.parametrize(("epsilon", "delta", "k"), CASES)
def test_threshold_delta_is_the_normal_tail_of_a_single_user(epsilon: float, delta: float, k: int) -> None:
    budget = calibrate_selection(epsilon=epsilon, delta=delta, words_per_user=k, method="pld")
    selection = budget.selection
    tail = k * norm.sf((selection.threshold - 1) / (selection.noise_multiplier * math.sqrt(k)))
    assert selection.threshold_delta() == pytest.approx(tail, rel=1e-9)
    assert tail <= budget.delta_threshold
    assert tail == pytest.approx(budget.delta_threshold, rel=1e-6)  # the threshold is the lowest that holds
    assert selection.epsilon_shift() == pytest.approx(-math.log1p(-tail), rel=1e-12)


def test_a_word_of_one_user_is_released_at_the_rate_the_tail_says() -> None:
    """At a threshold one standard deviation above 1, a count-1 word passes with probability Q(1)."""
    k, z = 4, 3.0
    sigma = z * math.sqrt(k)
    selection = GaussianPartitionSelection(k, z, 1.0 + sigma)
    words = 40_000
    released = selection.select({f"w{i:05d}": 1 for i in range(words)}, words, np.random.default_rng(1))
    rate, expected = len(released) / words, norm.sf(1.0)
    assert abs(rate - expected) < 4 * math.sqrt(expected * (1 - expected) / words), (rate, expected)
    assert selection.threshold_delta() == pytest.approx(k * expected, rel=1e-9)
    lower = GaussianPartitionSelection(k, z, sigma)  # a threshold one user lower: more released
    more = lower.select({f"w{i:05d}": 1 for i in range(words)}, words, np.random.default_rng(1))
    assert len(more) > len(released) + 4 * math.sqrt(words * expected)


def test_selection_ranks_by_noisy_count_keeps_the_threshold_and_the_size() -> None:
    selection = GaussianPartitionSelection(1, 1e-9, 5.0)  # all but no noise
    counts = {"a": 3, "b": 10, "c": 7, "d": 7, "e": 5, "f": 6}
    rng = np.random.default_rng(0)
    assert selection.select(counts, 10, rng) == ("b", "c", "d", "f")  # 5 is not above 5; ties by word
    assert selection.select(counts, 2, rng) == ("b", "c")
    assert selection.select({}, 3, rng) == ()
    with pytest.raises(ValueError, match="at least 1"):
        selection.select({"a": 0}, 3, rng)


@dataclass
class Users:
    """Users' texts; each user's contribution to the bounded counts."""

    texts: list[list[str]]


def test_one_user_changes_the_counts_by_at_most_k_ones() -> None:
    """Adding any user changes the count vector by a 0/1 vector of at most ``k`` ones (L2 <= sqrt(k))."""
    rng = np.random.default_rng(3)
    vocabulary = [f"w{i}" for i in range(30)]
    users = [
        [
            " ".join(rng.choice(vocabulary, size=int(rng.integers(1, 12))))
            for _ in range(int(rng.integers(1, 6)))
        ]
        for _ in range(60)
    ]
    k = 5
    without = count_bounded_words(users[1:], k)
    with_user = count_bounded_words(users, k)
    change = {w: with_user.get(w, 0) - without.get(w, 0) for w in set(with_user) | set(without)}
    assert set(change.values()) <= {0, 1}
    assert sum(change.values()) == len(user_top_words(users[0], k)) <= k
    assert user_top_words(["b a a", "c b", "B  c"], 2) == ["a", "b"]  # single spaces, case kept


def test_the_total_is_the_smaller_sound_bound_at_the_run_delta() -> None:
    budget = calibrate_selection(epsilon=0.8, delta=1e-6, words_per_user=100, method="pld")
    delta = 1e-5
    training_delta = delta - budget.delta
    accountant = PrivacyAccountant(population=list(range(100)), unit="one client", method="pld")
    for server_round in range(1, 51):
        accountant.record(PrivacyEvent(server_round, SampledGaussian(1.0, 0.1)))
    training = accountant.epsilon(delta=training_delta)
    basic = total_with_selection(training=training, budget=budget, joint=None, delta=delta, method="pld")
    assert basic.epsilon == pytest.approx(training.epsilon + budget.own_epsilon("pld"))
    assert basic.delta == delta
    joint_accountant = PrivacyAccountant(population=list(range(100)), unit="one client", method="pld")
    joint_accountant.record(PrivacyEvent(0, budget.selection.mechanism))
    joint_accountant.record_all(accountant.events)
    joint = joint_accountant.epsilon(delta=delta - budget.delta_threshold)
    total = total_with_selection(training=training, budget=budget, joint=joint, delta=delta, method="pld")
    assert total.epsilon == pytest.approx(joint.epsilon + budget.selection.epsilon_shift())
    assert training.epsilon < total.epsilon < basic.epsilon  # charged, and tighter than the sum
    history = {SampledGaussian(1.0, 0.1): 50, budget.selection.mechanism: 1}
    oracle = compose_epsilon(history, delta=delta - budget.delta_threshold, method="pld").epsilon
    assert total.epsilon == pytest.approx(oracle + budget.selection.epsilon_shift())
    with pytest.raises(ValueError, match="exceed"):  # the training's delta must leave room for the release's
        total_with_selection(
            training=EpsilonReport(1.0, delta, "pld", None, None, None, None),
            budget=budget,
            joint=None,
            delta=delta,
            method="pld",
        )
