"""What happened: immutable privacy events, one per mechanism use per round.

A strategy records a :class:`PrivacyEvent` whenever a mechanism touches
clients' data: which mechanism (with its parameters), how many times each
participant applied it that round, and who took part. How those events add up
to an epsilon is the accountant's business (:mod:`fl_app.privacy.accountant`).

Every mechanism descriptor is parameterised *relative to its sensitivity*
(noise multiplier = noise std / L2 sensitivity; Laplace epsilon = L1
sensitivity / scale; randomized response by its per-report epsilon), so the
same descriptor is correct for whatever neighbouring relation the sensitivity
was computed for. The strategy states that relation as the privacy ``unit``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from fl_app.privacy.checks import require_positive


@dataclass(frozen=True)
class Gaussian:
    """Gaussian noise with std = ``noise_multiplier`` x L2 sensitivity."""

    noise_multiplier: float
    kind: ClassVar[str] = "gaussian"

    def __post_init__(self) -> None:
        require_positive("noise_multiplier", self.noise_multiplier)

    @property
    def pure_epsilon(self) -> float | None:
        """The Gaussian mechanism has no pure-epsilon guarantee."""
        return None


@dataclass(frozen=True)
class SampledGaussian:
    """The Gaussian mechanism applied after Poisson sampling with rate ``sampling_rate``.

    Amplification by sampling holds for add-or-remove-one neighbours whose
    participation is an independent coin with probability ``sampling_rate``.
    """

    noise_multiplier: float
    sampling_rate: float
    kind: ClassVar[str] = "sampled_gaussian"

    def __post_init__(self) -> None:
        require_positive("noise_multiplier", self.noise_multiplier)
        if not 0 < self.sampling_rate <= 1:
            raise ValueError(f"sampling_rate must be in (0, 1], got {self.sampling_rate!r}")

    @property
    def pure_epsilon(self) -> float | None:
        """No pure-epsilon guarantee."""
        return None


@dataclass(frozen=True)
class Laplace:
    """Laplace noise with scale = L1 sensitivity / ``epsilon``: ``epsilon``-DP per use."""

    epsilon: float
    kind: ClassVar[str] = "laplace"

    def __post_init__(self) -> None:
        require_positive("epsilon", self.epsilon)

    @property
    def pure_epsilon(self) -> float | None:
        """Per-use pure epsilon."""
        return self.epsilon


def keep_probability(*, epsilon: float, num_classes: int) -> float:
    """``beta = (e^eps - 1) / (e^eps - 1 + C)``: C-ary randomized response's keep probability.

    Computed as ``1 / (1 + C e^-eps / (1 - e^-eps))``, equal and finite for every ``eps > 0``
    (``e^eps`` overflows a float above ``eps`` of about 709; beta is then 1 to double precision).
    """
    return 1.0 / (1.0 + num_classes * math.exp(-epsilon) / -math.expm1(-epsilon))


@dataclass(frozen=True)
class RandomizedResponse:
    """k-ary randomized response on one label, ``epsilon``-LDP per report.

    Keeps the label with probability ``beta = (e^eps - 1) / (e^eps - 1 + C)``,
    otherwise reports a uniformly random class out of ``num_classes``.
    """

    epsilon: float
    num_classes: int
    kind: ClassVar[str] = "randomized_response"

    def __post_init__(self) -> None:
        require_positive("epsilon", self.epsilon)
        if int(self.num_classes) != self.num_classes or self.num_classes < 2:
            raise ValueError(f"num_classes must be an integer >= 2, got {self.num_classes!r}")

    @property
    def keep_probability(self) -> float:
        """``beta``: probability that the true label is kept before randomisation."""
        return keep_probability(epsilon=self.epsilon, num_classes=self.num_classes)

    @property
    def pure_epsilon(self) -> float | None:
        """Per-report pure epsilon."""
        return self.epsilon


@dataclass(frozen=True)
class BinaryRandomizedResponse:
    """RR_gamma on one bit: keep with probability 1/2 + gamma (DPFL-BNN Definition 3)."""

    gamma: float
    kind: ClassVar[str] = "binary_randomized_response"

    def __post_init__(self) -> None:
        if not 0 <= self.gamma < 0.5:
            raise ValueError(f"gamma must be in [0, 0.5), got {self.gamma!r}")

    @property
    def pure_epsilon(self) -> float | None:
        """Per-bit pure epsilon, ``ln((1/2 + gamma) / (1/2 - gamma))``."""
        return math.log((0.5 + self.gamma) / (0.5 - self.gamma))


@dataclass(frozen=True)
class TreeAggregation:
    """Gaussian tree aggregation of a stream of ``steps`` sums, one participation per tree.

    The binary-tree mechanism (Dwork, Naor, Pitassi, Rothblum 2010; Chan, Shi,
    Song 2011) as DP-FTRL uses it (Kairouz, McMahan, Song, Thakkar, Thakurta,
    Xu, ICML 2021, Algorithm 1): every tree node (a partial sum of the stream)
    gets Gaussian noise of std ``noise_multiplier`` x L2 sensitivity, and every
    prefix sum is a sum of noisy nodes. A participant that contributes to at
    most one of the ``steps`` leaves is in at most ``ceil(log2(steps + 1))``
    nodes, so the whole tree is the Gaussian mechanism with noise multiplier
    ``noise_multiplier / sqrt(ceil(log2(steps + 1)))`` (the paper's Appendix D;
    dp-accounting's ``SingleEpochTreeAggregationDpEvent``). The neighbouring
    relation is zero-out (replace the participant's contribution by zero):
    the run's cohort schedule is public and the same for both data sets.
    Several trees (TreeRestart) compose.
    """

    noise_multiplier: float
    steps: int
    kind: ClassVar[str] = "tree_aggregation"

    def __post_init__(self) -> None:
        require_positive("noise_multiplier", self.noise_multiplier)
        if int(self.steps) != self.steps or self.steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got {self.steps!r}")

    @property
    def depth(self) -> int:
        """``ceil(log2(steps + 1))``: the most tree nodes one leaf belongs to."""
        return int(self.steps).bit_length()

    @property
    def pure_epsilon(self) -> float | None:
        """No pure-epsilon guarantee."""
        return None


@dataclass(frozen=True)
class Skellam:
    """Skellam noise on an integer vector sum: the distributed-DP mechanism of Agarwal, Kairouz, Liu 2021.

    The sum of integer vectors gets noise ``Poisson(mu / 2) - Poisson(mu / 2)`` per coordinate (the
    symmetric Skellam distribution of variance ``mu``; the sum of the clients' independent Skellam
    shares is again Skellam, of the summed variance). Unlike the other descriptors this one is not
    normalised by a single sensitivity: its Renyi DP depends on the L1 and the L2 sensitivity of the
    integer query separately (:func:`fl_app.privacy.rdp.skellam_rdp`), all three in the
    integer domain (after scaling and rounding). It has no PLD here: it is accounted by RDP.
    """

    variance: float
    l1_sensitivity: float
    l2_sensitivity: float
    kind: ClassVar[str] = "skellam"

    def __post_init__(self) -> None:
        require_positive("variance", self.variance)
        require_positive("l1_sensitivity", self.l1_sensitivity)
        require_positive("l2_sensitivity", self.l2_sensitivity)

    @property
    def pure_epsilon(self) -> float | None:
        """No pure-epsilon guarantee."""
        return None


Mechanism = (
    Gaussian
    | SampledGaussian
    | Laplace
    | RandomizedResponse
    | BinaryRandomizedResponse
    | TreeAggregation
    | Skellam
)

MECHANISM_KINDS: dict[str, type[Mechanism]] = {
    cls.kind: cls
    for cls in (
        Gaussian,
        SampledGaussian,
        Laplace,
        RandomizedResponse,
        BinaryRandomizedResponse,
        TreeAggregation,
        Skellam,
    )
}


def mechanism_to_dict(mechanism: Mechanism) -> dict[str, Any]:
    """Serialise a mechanism descriptor (``kind`` plus its parameters)."""
    return {"kind": mechanism.kind, **asdict(mechanism)}


def mechanism_from_dict(data: dict[str, Any]) -> Mechanism:
    """Inverse of :func:`mechanism_to_dict`."""
    params = dict(data)
    kind = params.pop("kind")
    if kind not in MECHANISM_KINDS:
        raise ValueError(f"unknown mechanism kind {kind!r}; known: {sorted(MECHANISM_KINDS)}")
    return MECHANISM_KINDS[kind](**params)


@dataclass(frozen=True)
class PrivacyEvent:
    """One use of a mechanism in one round.

    Attributes
    ----------
    server_round : int
        The round (>= 1; 0 for work done before the first round).
    mechanism : Mechanism
        The mechanism and its parameters.
    count : int
        How many times each participant applied it this round (e.g. K labels,
        d bits).
    participants : tuple[int, ...] or None
        Client ids whose data the mechanism touched; ``None`` means every client
        of the population (e.g. a Poisson-sampled central release, where each
        client's possible participation is what the mechanism accounts for).
    label : str
        What the release was (e.g. ``"uplink"``, ``"evaluation"``).

    """

    server_round: int
    mechanism: Mechanism
    count: int = 1
    participants: tuple[int, ...] | None = None
    label: str = ""

    def __post_init__(self) -> None:
        if int(self.count) != self.count or self.count < 1:
            raise ValueError(f"count must be an integer >= 1, got {self.count!r}")
        if self.server_round < 0:
            raise ValueError(f"server_round must be >= 0, got {self.server_round!r}")
        if self.participants is not None:
            object.__setattr__(self, "participants", tuple(int(c) for c in self.participants))

    def to_dict(self) -> dict[str, Any]:
        """Serialise (JSON-ready)."""
        return {
            "server_round": self.server_round,
            "mechanism": mechanism_to_dict(self.mechanism),
            "count": self.count,
            "participants": None if self.participants is None else list(self.participants),
            "label": self.label,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrivacyEvent:
        """Inverse of :meth:`to_dict`."""
        participants = data.get("participants")
        return cls(
            server_round=int(data["server_round"]),
            mechanism=mechanism_from_dict(data["mechanism"]),
            count=int(data["count"]),
            participants=None if participants is None else tuple(participants),
            label=str(data.get("label", "")),
        )
