"""Which clients a round selects: seeded samples, planned schedules, Poisson cohorts.

:class:`Cohorts` is a strategy's collaborator (``strategy.cohorts``): it reads the run (roster,
seeded ``randomness``, secret ``noise``) and holds the schedule planned at start-up, if any. A
public (seeded) cohort never carries amplification by sampling; a Poisson cohort draws its coins
from the privacy randomness, so that it can.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from fl_app.run.context import RunContext
from fl_app.run.roster import ClientInfo

#: Values of a planned schedule (``strategy.schedule``; :meth:`Cohorts.seeded_schedule`).
SCHEDULES = ("random", "balanced")


class Cohorts:
    """Client selection for one run (see the module docstring).

    Parameters
    ----------
    run : RunContext
        The run whose roster and randomness the cohorts come from.

    """

    def __init__(self, run: RunContext) -> None:
        self.run = run
        #: Cohorts fixed at start-up (:meth:`plan`), or None to sample each round.
        self.planned: dict[int, list[ClientInfo]] | None = None

    def plan(self, schedule: dict[int, list[ClientInfo]]) -> dict[int, list[ClientInfo]]:
        """Fix the cohorts of rounds 1..T at start-up (returned, for the strategy's calibration)."""
        self.planned = schedule
        return schedule

    def select(self, server_round: int) -> list[ClientInfo]:
        """The cohort of ``server_round``: the planned schedule if there is one, else a seeded sample."""
        if self.planned is not None:
            if server_round not in self.planned:
                raise RuntimeError(
                    f"round {server_round} is beyond num_rounds={len(self.planned)}, which the "
                    "privacy calibration assumed"
                )
            return self.planned[server_round]
        return self.uniform(server_round)

    def uniform(self, server_round: int) -> list[ClientInfo]:
        """``clients_per_round`` clients uniformly without replacement, from the run seed."""
        rng = self.run.randomness.generator("client-sampling", server_round=server_round)
        count = self.run.clients_per_round
        chosen = rng.choice(len(self.run.roster), size=count, replace=False)
        return [self.run.roster[i] for i in sorted(chosen)]

    def epochs(self, num_rounds: int, *, purpose: str = "epoch-schedule") -> list[list[int]]:
        """Roster indices of rounds 1..``num_rounds``, each client at most once per epoch.

        Each epoch is a permutation of the roster, seeded by the run seed and the epoch, cut
        into ``N // m`` cohorts of exactly ``m = clients_per_round`` clients (the ``N mod m``
        left over sit that epoch out). A client therefore takes part in at most
        ``ceil(num_rounds / (N // m))`` rounds: the balanced schedule of Kairouz et al.
        (ICML 2021, DP-FTRL) and of "every client once per pass over the population".
        The schedule is public; it must not be what a privacy claim's amplification rests on.
        """
        size = self.run.clients_per_round
        per_epoch = self.run.num_clients // size
        cohorts: list[list[int]] = []
        epoch = 0
        while len(cohorts) < num_rounds:
            order = self.run.randomness.generator(purpose, server_round=epoch).permutation(
                self.run.num_clients
            )
            cohorts += [sorted(int(i) for i in order[k * size : (k + 1) * size]) for k in range(per_epoch)]
            epoch += 1
        return cohorts[:num_rounds]

    def seeded_schedule(self, num_rounds: int, *, balanced: bool = False) -> dict[int, list[ClientInfo]]:
        """The cohorts of rounds 1..``num_rounds``, from the run seed (not yet :meth:`plan` ned).

        ``balanced=False``: each round a uniform sample (:meth:`uniform`); some clients then take
        part more often than others. ``balanced=True``: :meth:`epochs`. Local-DP strategies plan
        their schedule so that calibration can count the busiest client's participations exactly
        (:func:`max_participations`).
        """
        if balanced:
            roster = self.run.roster
            return {
                t: [roster[i] for i in cohort] for t, cohort in enumerate(self.epochs(num_rounds), start=1)
            }
        return {t: self.uniform(t) for t in range(1, num_rounds + 1)}

    def poisson(
        self, server_round: int, rate: float, among: Sequence[ClientInfo] | None = None
    ) -> list[ClientInfo]:
        """Every client (of ``among``; default: the roster) joins independently with probability ``rate``.

        The coins come from the privacy randomness (``run.noise``: OS entropy with
        ``privacy.secure_rng`` and always on devices), because amplification by
        sampling holds only for a cohort the adversary cannot predict.
        """
        population = self.run.roster if among is None else among
        rng = self.run.noise.generator("poisson-cohort", server_round=server_round)
        joins = rng.random(len(population)) < rate
        return [info for info, joined in zip(population, joins, strict=True) if joined]


def max_participations(schedule: dict[int, list[ClientInfo]]) -> int:
    """Rounds the most-selected client of ``schedule`` takes part in."""
    counts = Counter(info.client_id for clients in schedule.values() for info in clients)
    return max(counts.values()) if counts else 0
