"""One accountant: compose recorded privacy events into a per-client epsilon.

Strategies say *what happened* by recording :class:`~fl_app.privacy.events.PrivacyEvent`
objects; this class says *what it costs*. It keeps, for every client, how many
times each mechanism touched that client's data (events without a participant
list count for every client), and composes a client's history with
:func:`~fl_app.privacy.composition.compose_epsilon`. The epsilon it reports for
a run is the worst client's: the guarantee every client gets.

The unit of privacy (what a neighbouring pair is: one record, one client's data
set, one report) is stated by the strategy and carried in :attr:`unit`; the
accountant's arithmetic does not depend on it because every mechanism
descriptor is normalised by the sensitivity for that unit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from fl_app.privacy.composition import METHODS, EpsilonReport, basic_epsilon, compose_epsilon, history_key
from fl_app.privacy.events import Mechanism, PrivacyEvent

_STATE_VERSION = 1
#: The file a run's main accountant writes its events to (its output directory).
LEDGER_FILE = "privacy_ledger.json"


class PrivacyAccountant:
    """Per-client composition of recorded privacy events.

    Parameters
    ----------
    population : Sequence[int]
        Ids of all clients whose data the run may touch.
    unit : str
        What a neighbouring pair is (e.g. ``"one client's entire data set"``).
    method : str
        ``"rdp"`` or ``"pld"`` (see :mod:`fl_app.privacy.composition`).

    """

    def __init__(self, *, population: Sequence[int], unit: str, method: str = "rdp") -> None:
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if not population:
            raise ValueError("population must not be empty")
        self.population: tuple[int, ...] = tuple(int(c) for c in population)
        self._members = frozenset(self.population)
        if len(self._members) != len(self.population):
            raise ValueError("population ids must be unique")
        self.unit = unit
        self.method = method
        self.events: list[PrivacyEvent] = []
        self._common: Counter[Mechanism] = Counter()
        self._personal: dict[int, Counter[Mechanism]] = {}
        self._rounds: dict[int, set[int]] = {}

    # ----------------------------------------------------------------- recording

    def record(self, event: PrivacyEvent) -> None:
        """Add one event (validated against the population)."""
        if event.participants is None:
            self._common[event.mechanism] += event.count
        else:
            unknown = set(event.participants) - self._members
            if unknown:
                raise ValueError(f"event names clients outside the population: {sorted(unknown)[:5]}")
            if len(set(event.participants)) != len(event.participants):
                raise ValueError("event lists a participant twice")
            for client in event.participants:
                self._personal.setdefault(client, Counter())[event.mechanism] += event.count
                self._rounds.setdefault(client, set()).add(event.server_round)
        self.events.append(event)

    def record_all(self, events: Iterable[PrivacyEvent]) -> None:
        """Record several events in order."""
        for event in events:
            self.record(event)

    # ----------------------------------------------------------------- queries

    def history(self, client: int) -> dict[Mechanism, int]:
        """How many times each mechanism touched ``client``'s data."""
        merged = Counter(self._common)
        merged.update(self._personal.get(int(client), Counter()))
        return dict(merged)

    def rounds_participated(self, client: int) -> int:
        """Number of distinct rounds in which ``client`` was named in an event."""
        return len(self._rounds.get(int(client), ()))

    def epsilon(self, *, delta: float, client: int | None = None) -> EpsilonReport:
        """Epsilon of one client, or of the worst client when ``client`` is None."""
        if client is not None:
            if int(client) not in self._members:
                raise ValueError(f"client {client} is not in the population")
            return compose_epsilon(self.history(client), delta=delta, method=self.method)
        reports = [
            compose_epsilon(dict(key), delta=delta, method=self.method) for key in self._distinct_histories()
        ]
        return max(reports, key=lambda report: report.epsilon)

    def basic_epsilon(self, client: int | None = None) -> float | None:
        """Basic-composition epsilon (worst client by default), or None if not all pure."""
        keys = [history_key(self.history(client))] if client is not None else self._distinct_histories()
        values = [basic_epsilon(dict(key)) for key in keys]
        return None if any(v is None for v in values) else max(v for v in values if v is not None)

    def _distinct_histories(self) -> list[tuple[tuple[Mechanism, int], ...]]:
        keys = {history_key(self.history(client)) for client in self._personal}
        if len(self._personal) < len(self.population):
            keys.add(history_key(dict(self._common)))
        return sorted(keys, key=repr)

    # ----------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready state: configuration plus the event ledger."""
        return {
            "version": _STATE_VERSION,
            "population": list(self.population),
            "unit": self.unit,
            "method": self.method,
            "events": [event.to_dict() for event in self.events],
        }

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> PrivacyAccountant:
        """Rebuild an accountant by replaying a saved ledger."""
        if state.get("version") != _STATE_VERSION:
            raise ValueError(f"unsupported accountant state version {state.get('version')!r}")
        accountant = cls(population=state["population"], unit=state["unit"], method=state["method"])
        accountant.record_all(PrivacyEvent.from_dict(e) for e in state["events"])
        return accountant


def combined_epsilon(
    *, accountants: Sequence[PrivacyAccountant], delta: float, method: str = "rdp"
) -> EpsilonReport:
    """Worst client's epsilon of the events of several accountants, composed per client.

    Sequential composition across the stages of a run (e.g. training, then an
    evaluation): each client's histories are merged and composed as one. The
    accountants must share one population and state their events in one unit
    (the caller converts, e.g. one client's ``n`` reports for a client-level unit).

    Parameters
    ----------
    accountants : Sequence[PrivacyAccountant]
        The stages' accountants (at least one).
    delta : float
        Target delta.
    method : str
        ``"rdp"`` or ``"pld"`` for the merged histories.

    """
    if not accountants:
        raise ValueError("need at least one accountant")
    population = accountants[0].population
    if any(set(a.population) != set(population) for a in accountants):
        raise ValueError("the accountants cover different populations")
    joint = PrivacyAccountant(population=population, unit=accountants[0].unit, method=method)
    for accountant in accountants:
        joint.record_all(accountant.events)
    return joint.epsilon(delta=delta)
