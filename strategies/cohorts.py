"""Which clients a round selects: seeded samples, planned schedules, Poisson cohorts.

:class:`CohortSampling` is mixed into :class:`strategies.base.FederatedStrategy`; its methods
read the strategy's ``run`` (roster, seeded ``randomness``, secret ``noise``) and
``planned_cohorts``. A public (seeded) cohort never carries amplification by sampling; a Poisson
cohort draws its coins from the privacy randomness, so that it can.
"""

from __future__ import annotations

from collections import Counter

from fl_app.roster import ClientInfo
from fl_app.run_context import RunContext


class CohortSampling:
    """Client selection for a strategy (see the module docstring)."""

    run: RunContext
    #: Cohorts fixed at start-up (:meth:`seeded_schedule`), or None to sample each round.
    planned_cohorts: dict[int, list[ClientInfo]] | None

    def select_clients(self, server_round: int) -> list[ClientInfo]:
        """The cohort of ``server_round``: the planned schedule if there is one, else a seeded sample.

        Without a plan: ``clients_per_round`` clients uniformly without replacement (seeded).
        """
        if self.planned_cohorts is not None:
            if server_round not in self.planned_cohorts:
                raise RuntimeError(
                    f"round {server_round} is beyond num_rounds={len(self.planned_cohorts)}, which the "
                    "privacy calibration assumed"
                )
            return self.planned_cohorts[server_round]
        return self.uniform_cohort(server_round)

    def uniform_cohort(self, server_round: int) -> list[ClientInfo]:
        """``clients_per_round`` clients uniformly without replacement, from the run seed."""
        rng = self.run.randomness.generator("client-sampling", server_round=server_round)
        count = self.run.clients_per_round
        chosen = rng.choice(len(self.run.roster), size=count, replace=False)
        return [self.run.roster[i] for i in sorted(chosen)]

    def epoch_cohorts(self, num_rounds: int, *, purpose: str = "epoch-schedule") -> list[list[int]]:
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
        """The cohorts of rounds 1..``num_rounds``, fixed at start-up from the run seed.

        ``balanced=False``: each round a uniform sample (:meth:`uniform_cohort`); some clients
        then take part more often than others. ``balanced=True``: :meth:`epoch_cohorts`. Local-DP
        strategies plan their schedule so that calibration can count the busiest client's
        participations exactly (:func:`max_participations`).
        """
        if balanced:
            roster = self.run.roster
            return {
                t: [roster[i] for i in cohort]
                for t, cohort in enumerate(self.epoch_cohorts(num_rounds), start=1)
            }
        return {t: self.uniform_cohort(t) for t in range(1, num_rounds + 1)}

    def poisson_cohort(self, server_round: int, rate: float) -> list[ClientInfo]:
        """Every client joins independently with probability ``rate`` (Poisson sampling).

        The coins come from the privacy randomness (``run.noise``: OS entropy with
        ``privacy.secure_rng`` and always on devices), because amplification by
        sampling holds only for a cohort the adversary cannot predict.
        """
        rng = self.run.noise.generator("poisson-cohort", server_round=server_round)
        joins = rng.random(self.run.num_clients) < rate
        return [info for info, joined in zip(self.run.roster, joins, strict=True) if joined]


#: Values of a planned schedule (``strategy.schedule``; :meth:`FederatedStrategy.seeded_schedule`).
SCHEDULES = ("random", "balanced")


def max_participations(schedule: dict[int, list[ClientInfo]]) -> int:
    """Rounds the most-selected client of ``schedule`` takes part in."""
    counts = Counter(info.client_id for clients in schedule.values() for info in clients)
    return max(counts.values()) if counts else 0
