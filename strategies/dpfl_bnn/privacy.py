"""DPFL-BNN's accounting: RR_gamma on every uploaded bit, in the client unit and the document's.

"Differentially Private Federated Learning with Binary Neural Networks" (DPFL-BNN; the seed
document, Definition 3 and Theorem 1; ``docs/algorithms/dpfl_bnn.md``). Each upload carries the ``d``
binary weights of a client's model, each kept with probability ``1/2 + gamma`` and flipped
otherwise (:class:`~fl_app.privacy.events.BinaryRandomizedResponse`). A client's data set decides
all ``d`` bits, so one upload is ``d`` uses of the mechanism in the client unit (the headline
epsilon); the document's Theorem 1 counts one use per round, which bounds what one coordinate
reveals in isolation and is kept beside it, labelled (:attr:`BinaryRRLedger.coordinate_accountant`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.calibration import largest_meeting
from fl_app.privacy.checks import require_positive, require_positive_int, require_probability
from fl_app.privacy.composition import compose_epsilon
from fl_app.privacy.events import (
    BinaryRandomizedResponse,
    PrivacyEvent,
)

# --------------------------------------------------------------------------------------
# DPFL-BNN (Liu et al. 2023, Theorem 1)
# --------------------------------------------------------------------------------------


def binary_rr_epsilon(
    *, gamma: float, delta: float, rounds: int, bits_per_round: int = 1, method: str = "rdp"
) -> float:
    """Epsilon of ``rounds * bits_per_round`` uses of RR_gamma (accountant composition)."""
    require_positive_int("rounds", rounds)
    require_positive_int("bits_per_round", bits_per_round)
    history = {BinaryRandomizedResponse(gamma): rounds * bits_per_round}
    return compose_epsilon(history, delta=delta, method=method).epsilon


def bnn_gamma(*, epsilon: float, delta: float, rounds: int, bits_per_round: int = 1) -> float:
    """Largest gamma whose RR_gamma composed ``rounds * bits_per_round`` times meets (epsilon, delta).

    DPFL-BNN Theorem 1 with the Renyi order optimised (over the accountant's
    orders, and with dp-accounting's RDP-to-DP conversion) instead of the
    document's fixed order ``alpha = 1 + 2(1/delta)/epsilon``.
    ``bits_per_round=1`` is the document's per-coordinate accounting; ``d``
    accounts for a client's whole d-bit upload per round.
    """
    require_positive("epsilon", epsilon)
    require_probability("delta", delta)
    return largest_meeting(
        lambda g: binary_rr_epsilon(gamma=g, delta=delta, rounds=rounds, bits_per_round=bits_per_round),
        target=epsilon,
        low=0.0,
        high=0.5 - 1e-12,
    )


def bnn_rdp_closed_form(*, gamma: float, order: float) -> float:
    """RDP of RR_gamma at order alpha > 1 (DPFL-BNN Lemma 3, Mironov 2017)."""
    if not 0 <= gamma < 0.5:
        raise ValueError(f"gamma must be in [0, 0.5), got {gamma!r}")
    if order <= 1:
        raise ValueError(f"order must be > 1, got {order!r}")
    p, q = 0.5 + gamma, 0.5 - gamma
    log_terms = (
        order * math.log(p) + (1 - order) * math.log(q),
        order * math.log(q) + (1 - order) * math.log(p),
    )
    top = max(log_terms)
    return (top + math.log(sum(math.exp(t - top) for t in log_terms))) / (order - 1)


def bnn_gamma_theorem1(*, epsilon: float, delta: float, rounds: int) -> float:
    """Gamma from DPFL-BNN Theorem 1 as printed, with its order corrected to log(1/delta).

    Theorem 1 fixes ``alpha = 1 + 2 log(1/delta) / epsilon`` (the document prints
    ``1/delta`` in place of ``log(1/delta)``) and requires
    ``T rho(alpha) + log(1/delta)/(alpha - 1) <= epsilon``, i.e.
    ``rho(alpha) <= epsilon / (2T)``. Kept for comparison: :func:`bnn_gamma`
    optimises the order and gives a gamma at least this large.
    """
    require_positive("epsilon", epsilon)
    require_probability("delta", delta)
    require_positive_int("rounds", rounds)
    order = 1.0 + 2.0 * math.log(1.0 / delta) / epsilon
    budget = epsilon / (2.0 * rounds)
    return largest_meeting(
        lambda g: bnn_rdp_closed_form(gamma=g, order=order), target=budget, low=0.0, high=0.5 - 1e-12
    )


CLIENT_UNIT = (
    "one client's entire data set, replaced by any other data set (client-level local DP: "
    "every upload is randomized on the client; the server is not trusted)"
)
COORDINATE_UNIT = (
    "one coordinate (binary weight) of one client's upload, seen in isolation (the document's "
    "Theorem 1 accounting; NOT a client-level guarantee)"
)
#: What a null ``strategy.gamma`` is calibrated for.
CALIBRATIONS = ("per_coordinate", "client_level")


@dataclass(frozen=True)
class GammaPlan:
    """``gamma`` of RR_gamma, where it came from, and the epsilon it gives after every round.

    Attributes
    ----------
    gamma : float
        Keep each bit with probability ``1/2 + gamma``.
    source : str
        ``strategy.gamma``, or the calibration that chose it.
    client_level : float
        Epsilon of a client taking part in every round, ``d`` uses per round (the headline unit).
    per_coordinate : float
        The same in the document's per-coordinate accounting (one use per round).

    """

    gamma: float
    source: str
    client_level: float
    per_coordinate: float

    @classmethod
    def make(
        cls,
        *,
        gamma: float | None,
        calibration: str,
        epsilon: float,
        delta: float,
        rounds: int,
        num_bits: int,
        method: str,
    ) -> GammaPlan:
        """``gamma`` as given, else calibrated so that ``rounds`` uploads cost ``epsilon``."""
        if gamma is not None:
            source = "strategy.gamma"
        else:
            bits = 1 if calibration == "per_coordinate" else num_bits
            gamma = bnn_gamma(epsilon=epsilon, delta=delta, rounds=rounds, bits_per_round=bits)
            source = (
                f"calibrated: privacy.epsilon={epsilon:g} at delta={delta:g} after num_rounds={rounds} "
                f"for the {calibration.replace('_', '-')} accounting"
            )
        return cls(
            gamma,
            source,
            binary_rr_epsilon(
                gamma=gamma, delta=delta, rounds=rounds, bits_per_round=num_bits, method=method
            ),
            binary_rr_epsilon(gamma=gamma, delta=delta, rounds=rounds, method=method),
        )


class BinaryRRLedger:
    """The client-level accountant (the run's epsilon) and the per-coordinate one, fed together.

    Parameters
    ----------
    plan : GammaPlan
        The mechanism.
    num_bits : int
        ``d``, bits per upload.
    population : Sequence[int]
        Every client's id.
    method : str
        The composition method (``privacy.accountant``).
    delta : float
        The delta every epsilon is reported at.

    """

    def __init__(
        self, *, plan: GammaPlan, num_bits: int, population: Sequence[int], method: str, delta: float
    ) -> None:
        self.plan = plan
        self.num_bits = num_bits
        self.delta = delta
        self.mechanism = BinaryRandomizedResponse(plan.gamma)
        self.accountant = PrivacyAccountant(population=population, unit=CLIENT_UNIT, method=method)
        self.coordinate_accountant = PrivacyAccountant(
            population=population, unit=COORDINATE_UNIT, method=method
        )

    def record(self, server_round: int, selected: Sequence[int]) -> None:
        """One upload of every selected client (failures included) in both accountings."""
        if not selected:
            return
        participants = tuple(selected)
        self.accountant.record(
            PrivacyEvent(
                server_round,
                self.mechanism,
                count=self.num_bits,
                participants=participants,
                label="uplink: RR_gamma on the d bits of one upload (client level)",
            )
        )
        self.coordinate_accountant.record(
            PrivacyEvent(
                server_round,
                self.mechanism,
                count=1,
                participants=participants,
                label="uplink: RR_gamma on one coordinate (the document's per-coordinate accounting)",
            )
        )

    def epsilon_per_coordinate(self) -> float:
        """The document's per-coordinate epsilon of the worst client."""
        return self.coordinate_accountant.epsilon(delta=self.delta).epsilon

    def summary(self, *, target_epsilon: float, rounds: int) -> dict[str, Any]:
        """Both accountings side by side, gamma and where it came from."""
        plan = self.plan
        return {
            "gamma": plan.gamma,
            "flip_probability": 0.5 - plan.gamma,
            "gamma_source": plan.source,
            "epsilon_per_bit": self.mechanism.pure_epsilon,
            "gamma_theorem1_at_privacy_epsilon": bnn_gamma_theorem1(
                epsilon=target_epsilon, delta=self.delta, rounds=rounds
            ),
            "client_level": {
                "unit": CLIENT_UNIT,
                "uses_per_round": self.num_bits,
                "epsilon": self.accountant.epsilon(delta=self.delta).epsilon,
                "epsilon_if_every_round": plan.client_level,
                "delta": self.delta,
            },
            "per_coordinate": {
                "unit": COORDINATE_UNIT,
                "uses_per_round": 1,
                "epsilon": self.epsilon_per_coordinate(),
                "epsilon_if_every_round": plan.per_coordinate,
                "delta": self.delta,
                "note": "a client's data set determines all d coordinates of each upload, so this "
                "bounds what one coordinate reveals, not what the upload reveals about the client",
            },
        }
