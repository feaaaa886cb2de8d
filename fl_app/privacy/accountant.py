"""One accountant: compose recorded privacy events into a per-client epsilon.

Strategies say *what happened* by recording :class:`~fl_app.privacy.events.PrivacyEvent`
objects; this class says *what it costs*. It keeps, for every client, how many
times each mechanism touched that client's data (events without a participant
list count for every client), and composes a client's history with
:func:`~fl_app.privacy.composition.compose_epsilon`. The epsilon it reports for
a run is the worst client's: the guarantee every client gets.

Clients with identical histories are charged and stored once: each client holds
the index of its history class (one numpy array over the population), an event
moves every class among its participants to the class of that history plus the
event (a handful of classes per event, not one update per member), and the
worst epsilon composes each distinct class once. The events share one copy of
each distinct participant tuple (a public group charged every ``b`` rounds, the
whole population charged every round), so a pickled accountant (a run's
checkpoint) stores each such tuple once.

The unit of privacy (what a neighbouring pair is: one record, one client's data
set, one report) is stated by the strategy and carried in :attr:`unit`; the
accountant's arithmetic does not depend on it because every mechanism
descriptor is normalised by the sensitivity for that unit.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from fl_app.privacy.composition import METHODS, EpsilonReport, basic_epsilon, compose_epsilon, history_key
from fl_app.privacy.events import Mechanism, PrivacyEvent

_STATE_VERSION = 1
#: A history in hashable form (:func:`~fl_app.privacy.composition.history_key`).
HistoryKey = tuple[tuple[Mechanism, int], ...]
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
        self._index_population()
        if len(self._members) != len(self.population):
            raise ValueError("population ids must be unique")
        self.unit = unit
        self.method = method
        self.events: list[PrivacyEvent] = []
        self._common: Counter[Mechanism] = Counter()
        size = len(self.population)
        #: Each client's history class (by population position): an index into ``_classes``.
        self._class = np.zeros(size, dtype=np.int32)
        #: The personal part of each class's history (class 0: nothing personal), and its index.
        self._classes: list[HistoryKey] = [()]
        self._class_ids: dict[HistoryKey, int] = {(): 0}
        self._moves: dict[tuple[int, Mechanism, int], int] = {}
        #: Distinct rounds each client was named in, and the last of them (-1: none yet).
        self._round_count = np.zeros(size, dtype=np.int32)
        self._last_round = np.full(size, -1, dtype=np.int32)
        #: False once an event names a client in a round before one it was already named in.
        self._rounds_in_order = True
        #: Each distinct participant tuple the events hold: its one shared instance and, once it is named
        #: again, its population positions (the population's own tuple: everyone, in order).
        self._participant_sets: dict[tuple[int, ...], list[Any]] = {}
        self._know_population()

    def _know_population(self) -> None:
        """The population's own tuple among the participant tuples, with its positions."""
        self._participant_sets[self.population] = [self.population, np.arange(len(self.population))]

    def _index_population(self) -> None:
        """The lookups derived from :attr:`population` (rebuilt when unpickled, never stored)."""
        self._members = frozenset(self.population)
        # device node ids are unsigned 64-bit (above int64's range); simulated client ids are small
        self._id_dtype = np.uint64 if min(self.population) >= 0 else np.int64
        ids = np.asarray(self.population, dtype=self._id_dtype)
        self._order = np.argsort(ids, kind="stable")
        self._sorted_ids = ids[self._order]

    # ----------------------------------------------------------------- recording

    def record(self, event: PrivacyEvent) -> None:
        """Add one event (validated against the population)."""
        if event.participants is None:
            self._common[event.mechanism] += event.count
        else:
            event, positions = self._located(event)
            self._charge(positions, event.mechanism, event.count)
            self._count_round(positions, event.server_round)
        self.events.append(event)

    def record_all(self, events: Iterable[PrivacyEvent]) -> None:
        """Record several events in order."""
        for event in events:
            self.record(event)

    def _positions(self, participants: tuple[int, ...]) -> np.ndarray:
        """Population positions of ``participants``; ValueError for strangers or a repeated id."""
        if not self._members.issuperset(participants):
            unknown = sorted({int(c) for c in participants} - self._members)
            raise ValueError(f"event names clients outside the population: {unknown[:5]}")
        ids = np.fromiter(participants, dtype=self._id_dtype, count=len(participants))
        positions = self._order[np.searchsorted(self._sorted_ids, ids)]
        if np.unique(positions).size != positions.size:
            raise ValueError("event lists a participant twice")
        return positions

    def _located(self, event: PrivacyEvent) -> tuple[PrivacyEvent, np.ndarray]:
        """``event`` holding the shared instance of its participant tuple, and their positions.

        A tuple seen for the first time is validated (ValueError before anything changes); one named
        again keeps its positions.
        """
        assert event.participants is not None
        known = self._participant_sets.get(event.participants)
        if known is None:
            positions = self._positions(event.participants)
            self._participant_sets[event.participants] = [event.participants, None]
            return event, positions
        shared, positions = known
        if positions is None:
            positions = known[1] = self._positions(shared)
        if shared is not event.participants:
            event = copy.copy(event)
            object.__setattr__(event, "participants", shared)  # equal content, one instance for all events
        return event, positions

    def _charge(self, positions: np.ndarray, mechanism: Mechanism, count: int) -> None:
        """Move the named clients' classes to their history plus ``count`` uses of ``mechanism``."""
        named = self._class[positions]
        if named.size and named.min() == named.max():  # one class (a group charged together)
            self._class[positions] = self._moved(int(named[0]), mechanism, count)
            return
        classes, inverse = np.unique(named, return_inverse=True)
        moved = np.fromiter(
            (self._moved(int(c), mechanism, count) for c in classes), dtype=np.int32, count=classes.size
        )
        self._class[positions] = moved[inverse]

    def _moved(self, current: int, mechanism: Mechanism, count: int) -> int:
        """The class of class ``current``'s history plus ``count`` uses of ``mechanism``."""
        move = (current, mechanism, count)
        if move not in self._moves:
            personal = Counter(dict(self._classes[current]))
            personal[mechanism] += count
            key = history_key(personal)
            if key not in self._class_ids:
                self._class_ids[key] = len(self._classes)
                self._classes.append(key)
            self._moves[move] = self._class_ids[key]
        return self._moves[move]

    def _count_round(self, positions: np.ndarray, server_round: int) -> None:
        """Count ``server_round`` for the named clients that were not yet named in it."""
        last = self._last_round[positions]
        if (last > server_round).any():
            self._rounds_in_order = False  # counted from the events from now on (rounds_participated)
        self._round_count[positions] += last < server_round
        self._last_round[positions] = np.maximum(last, server_round)

    # ----------------------------------------------------------------- queries

    def history(self, client: int) -> dict[Mechanism, int]:
        """How many times each mechanism touched ``client``'s data."""
        merged = Counter(self._common)
        position = self._position(client)
        if position is not None:
            merged.update(dict(self._classes[int(self._class[position])]))
        return dict(merged)

    def rounds_participated(self, client: int) -> int:
        """Number of distinct rounds in which ``client`` was named in an event."""
        position = self._position(client)
        if position is None:
            return 0
        if self._rounds_in_order:
            return int(self._round_count[position])
        client = int(client)
        return len({e.server_round for e in self.events if e.participants and client in e.participants})

    def _position(self, client: int) -> int | None:
        """``client``'s position in :attr:`population` (None: not a member)."""
        if int(client) not in self._members:
            return None
        slot = int(np.searchsorted(self._sorted_ids, np.asarray(int(client), dtype=self._id_dtype)))
        return int(self._order[slot])

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

    def _distinct_histories(self) -> list[HistoryKey]:
        """The distinct whole histories of the population's clients (one per class in use)."""
        used = np.flatnonzero(np.bincount(self._class, minlength=len(self._classes)))
        keys = set()
        for index in used:
            merged = Counter(self._common)
            merged.update(dict(self._classes[int(index)]))
            keys.add(history_key(merged))
        return sorted(keys, key=repr)

    # ----------------------------------------------------------------- state

    def __getstate__(self) -> dict[str, Any]:
        """The pickled state: the lookups derived from the population are rebuilt, not stored."""
        state = dict(self.__dict__)
        for derived in ("_members", "_id_dtype", "_order", "_sorted_ids", "_class_ids", "_moves"):
            del state[derived]
        state["_participant_sets"] = list(self._participant_sets)  # the shared tuples, once each
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Rebuild the lookups :meth:`__getstate__` left out (an earlier version's state: its events)."""
        if "_class" not in state:  # per-client counters of an earlier version: replay its events
            replayed = PrivacyAccountant(
                population=state["population"], unit=state["unit"], method=state["method"]
            )
            replayed.record_all(state["events"])
            state = replayed.__getstate__()
        shared = state.pop("_participant_sets")
        self.__dict__.update(state)
        self._index_population()
        self._participant_sets = {group: [group, None] for group in shared}
        self._know_population()
        self._class_ids = {key: index for index, key in enumerate(self._classes)}
        self._moves = {}

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
