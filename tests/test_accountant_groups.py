"""The accountant's history classes against a per-client accountant, and what a pickled ledger stores.

:class:`~fl_app.privacy.accountant.PrivacyAccountant` charges and stores the clients of identical
histories once (a class index per client). :class:`PerClient` below is the plain definition it must
equal: every named client's own counter and set of rounds, every client composed on its own. The
property test draws populations (ids in any order, not contiguous), events of several mechanisms
and counts, naming subsets, everyone (``None``) or repeating a tuple, in rounds that go forwards,
repeat or go back, and compares every query, after a pickle round trip and a ledger replay too.
"""

from __future__ import annotations

import pickle
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fl_app.privacy.accountant import PrivacyAccountant
from fl_app.privacy.composition import compose_epsilon
from fl_app.privacy.events import (
    Gaussian,
    Laplace,
    Mechanism,
    PrivacyEvent,
    RandomizedResponse,
    SampledGaussian,
)

DELTA = 1e-5
MECHANISMS: tuple[Mechanism, ...] = (
    SampledGaussian(1.1, 0.1),
    Gaussian(3.0),
    Laplace(0.5),
    RandomizedResponse(1.0, 4),
)


class PerClient:
    """The definition: each client's own history and rounds, each client's epsilon composed alone."""

    def __init__(self, population: list[int]) -> None:
        self.population = population
        self.common: Counter[Mechanism] = Counter()
        self.personal: dict[int, Counter[Mechanism]] = {c: Counter() for c in population}
        self.rounds: dict[int, set[int]] = {c: set() for c in population}

    def record(self, event: PrivacyEvent) -> None:
        if event.participants is None:
            self.common[event.mechanism] += event.count
            return
        for client in event.participants:
            self.personal[client][event.mechanism] += event.count
            self.rounds[client].add(event.server_round)

    def history(self, client: int) -> dict[Mechanism, int]:
        return dict(self.common + self.personal[client])

    def epsilon(self) -> float:
        return max(compose_epsilon(self.history(c), delta=DELTA).epsilon for c in self.population)

    def basic_epsilon(self) -> float | None:
        values = [compose_epsilon(self.history(c), delta=DELTA).basic for c in self.population]
        return None if any(v is None for v in values) else max(v for v in values if v is not None)


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[int], list[PrivacyEvent]]:
    """A population (unique ids in any order) and 1-25 events over it."""
    population = draw(st.lists(st.integers(-50, 10_000), min_size=1, max_size=30, unique=True))
    named: list[tuple[int, ...]] = []
    events, server_round = [], 1
    for _ in range(draw(st.integers(1, 25))):
        server_round = max(0, server_round + draw(st.sampled_from([0, 1, 1, 1, 2, -1, -3])))
        kind = draw(st.sampled_from(["subset", "subset", "everyone", "again"]))
        if kind == "everyone":
            participants = None
        elif kind == "again" and named:
            participants = tuple(draw(st.sampled_from(named)))  # an equal tuple, another instance
        else:
            participants = tuple(
                draw(st.lists(st.sampled_from(population), unique=True, max_size=len(population)))
            )
            named.append(participants)
        mechanism = draw(st.sampled_from(MECHANISMS))
        events.append(
            PrivacyEvent(server_round, mechanism, count=draw(st.integers(1, 3)), participants=participants)
        )
    return population, events


def assert_equal_to_per_client(accountant: PrivacyAccountant, reference: PerClient) -> None:
    for client in reference.population:
        assert accountant.history(client) == reference.history(client), client
        assert accountant.rounds_participated(client) == len(reference.rounds[client]), client
    assert accountant.epsilon(delta=DELTA).epsilon == reference.epsilon()
    assert accountant.basic_epsilon() == reference.basic_epsilon()
    client = reference.population[-1]
    assert (
        accountant.epsilon(delta=DELTA, client=client).epsilon
        == compose_epsilon(reference.history(client), delta=DELTA).epsilon
    )


@settings(max_examples=60, deadline=None)
@given(histories())
def test_the_grouped_accountant_equals_the_per_client_one(case: tuple[list[int], list[PrivacyEvent]]) -> None:
    population, events = case
    accountant, reference = PrivacyAccountant(population=population, unit="one client"), PerClient(population)
    for event in events:
        accountant.record(event)
        reference.record(event)
    assert_equal_to_per_client(accountant, reference)
    assert accountant.events == events
    restored = pickle.loads(pickle.dumps(accountant))
    assert_equal_to_per_client(restored, reference)
    assert restored.events == events
    assert_equal_to_per_client(PrivacyAccountant.from_state_dict(accountant.state_dict()), reference)
    restored.record(PrivacyEvent(99, MECHANISMS[0], participants=(population[0],)))  # still records
    reference.record(PrivacyEvent(99, MECHANISMS[0], participants=(population[0],)))
    assert_equal_to_per_client(restored, reference)


def test_a_refused_event_changes_nothing() -> None:
    accountant = PrivacyAccountant(population=[5, 3, 9], unit="one client")
    accountant.record(PrivacyEvent(1, Laplace(1.0), participants=(9, 3)))
    before = pickle.dumps(accountant)
    with pytest.raises(ValueError, match=r"outside the population: \[4, 7\]"):
        accountant.record(PrivacyEvent(2, Laplace(1.0), participants=(3, 7, 4)))
    with pytest.raises(ValueError, match="twice"):
        accountant.record(PrivacyEvent(2, Laplace(1.0), participants=(3, 5, 3)))
    assert pickle.dumps(accountant) == before


def test_a_group_charged_every_round_is_stored_once_and_charged_as_one_class() -> None:
    """The whole population named in 40 rounds (a one-band DP-BandMF's group, a Poisson-sampled
    release naming everyone): the pickle holds its ids once (40 rounds store what one does, plus
    the small events), and all its members share one class."""
    population = list(range(20_000))
    accountant = PrivacyAccountant(population=population, unit="one client")

    def charge(server_round: int) -> int:
        accountant.record(
            PrivacyEvent(server_round, SampledGaussian(1.0, 0.01), participants=tuple(population))
        )
        return len(pickle.dumps(accountant, protocol=pickle.HIGHEST_PROTOCOL))

    one_round = charge(1)
    forty_rounds = [charge(t) for t in range(2, 41)][-1]
    assert forty_rounds - one_round < 39 * 300  # a round adds an event, not 20,000 ids
    assert len({id(e.participants) for e in accountant.events}) == 1
    assert len(np.unique(accountant._class)) == 1
    assert accountant.rounds_participated(123) == 40
    assert accountant.history(123) == {SampledGaussian(1.0, 0.01): 40}


def test_an_earlier_versions_pickled_accountant_is_read_by_replaying_its_events() -> None:
    """A checkpoint of an earlier version held per-client counters: its events rebuild the classes."""
    accountant = PrivacyAccountant(population=[0, 1, 2], unit="one client")
    accountant.record(PrivacyEvent(1, Laplace(1.0), participants=(0, 2)))
    accountant.record(PrivacyEvent(2, Gaussian(2.0)))
    earlier = {
        "population": (0, 1, 2),
        "unit": "one client",
        "method": "rdp",
        "events": list(accountant.events),
        "_common": Counter({Gaussian(2.0): 1}),
        "_personal": {0: Counter({Laplace(1.0): 1}), 2: Counter({Laplace(1.0): 1})},
        "_rounds": {0: {1}, 2: {1}},
    }
    restored = PrivacyAccountant.__new__(PrivacyAccountant)
    restored.__setstate__(earlier)
    assert [restored.history(c) for c in range(3)] == [accountant.history(c) for c in range(3)]
    assert restored.rounds_participated(2) == 1 and restored.rounds_participated(1) == 0


def test_device_node_ids_above_the_signed_64_bit_range_are_members() -> None:
    """Real devices' node ids are unsigned 64-bit: the accountant charges them as any other id."""
    devices = [2**64 - 5, 2**63 + 7, 12345]
    accountant = PrivacyAccountant(population=devices, unit="one client's data", method="rdp")
    accountant.record(PrivacyEvent(1, Gaussian(1.0), count=1, participants=(2**64 - 5, 12345)))
    assert accountant.history(2**64 - 5) == {Gaussian(1.0): 1}
    assert accountant.history(2**63 + 7) == {}
    assert accountant.rounds_participated(2**64 - 5) == 1 and accountant.rounds_participated(-3) == 0
    reread = pickle.loads(pickle.dumps(accountant))
    assert reread.epsilon(delta=1e-5).epsilon == accountant.epsilon(delta=1e-5).epsilon > 0
    with pytest.raises(ValueError, match="outside the population"):
        accountant.record(PrivacyEvent(2, Gaussian(1.0), count=1, participants=(-1,)))
