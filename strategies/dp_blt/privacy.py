"""DP-BLT's participation schema and what each participation is charged.

The strategy's schedule gives the schema (:func:`participation_schema`); the sensitivity under it is
:func:`strategies.dp_blt.buffered_toeplitz.sensitivity_squared`. A group is charged at its ``j``-th
participation the Gaussian mechanism with noise multiplier ``z sens / sqrt(d_j)``
(:func:`participation_mechanisms`), ``d_j`` the ``j``-th increment of the worst pattern's squared
sensitivity; the first group's charges compose to ``Gaussian(z)``, the single release jax_privacy's
``SingleReleaseTrainingAccountant`` charges, and the strategy calibrates ``z`` on them with the
accountant's composition (:func:`fl_app.privacy.calibration.noise_multiplier_for_histories`).
"""

from __future__ import annotations

import functools
import math
from collections import Counter

from fl_app.privacy.composition import History
from fl_app.privacy.events import Gaussian
from strategies.dp_blt.buffered_toeplitz import (
    BufferedToeplitz,
    ParticipationSchema,
    sensitivity_increments,
    sensitivity_squared,
)


def participation_schema(*, num_clients: int, clients_per_round: int, rounds: int) -> ParticipationSchema:
    """The cyclic schedule's schema: ``b = N // m`` groups, ``ceil(T / b)`` participations ``b`` apart."""
    groups = num_clients // clients_per_round
    return ParticipationSchema(rounds, min(groups, rounds), -(-rounds // groups))


@functools.lru_cache(maxsize=256)
def participation_mechanisms(
    blt: BufferedToeplitz, schema: ParticipationSchema, *, noise_multiplier: float
) -> tuple[Gaussian, ...]:
    """What the ``j``-th participation charges, for ``j = 1 .. k``, at noise std ``z C sens``.

    The release up to any round is covered: the ``j``-th charge includes every later row the
    participation reaches (:func:`~strategies.dp_blt.buffered_toeplitz.sensitivity_increments`).
    """
    sens = math.sqrt(sensitivity_squared(blt, schema))
    return tuple(
        Gaussian(noise_multiplier * sens / math.sqrt(increment))
        for increment in sensitivity_increments(blt, schema)
    )


def worst_history(blt: BufferedToeplitz, schema: ParticipationSchema, *, noise_multiplier: float) -> History:
    """The first group's whole history (the worst client's): ``Gaussian(z)`` in ``k`` parts."""
    return dict(Counter(participation_mechanisms(blt, schema, noise_multiplier=noise_multiplier)))
