"""The example orders of local SGD, drawn for a whole cohort at once (fl_app/learning/orders.py).

A client's order must not depend on who else is in its cohort or share (the same client trained alone,
in a packed message, in a bulk share or vectorised sees the same batches), must be a permutation,
must change with the round, the epoch and the seed, and must be uniform over permutations. Client ids
are a simulated client's partition id or a device's 64-bit node id (up to 2**64 - 1).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fl_app.learning.orders import client_keys, client_seed, concatenated_orders, example_orders, splitmix64


@given(
    sizes=st.lists(st.integers(0, 9), min_size=1, max_size=8),
    epochs=st.integers(0, 3),
    seed=st.integers(0, 2**64 - 1),
    server_round=st.integers(0, 10_000),
)
@settings(max_examples=60, deadline=None)
def test_each_order_is_a_permutation_and_its_own_whatever_the_cohort(
    sizes: list[int], epochs: int, seed: int, server_round: int
) -> None:
    clients = [7 * k + 3 for k in range(len(sizes))]
    orders = example_orders(seed=seed, clients=clients, server_round=server_round, sizes=sizes, epochs=epochs)
    flat = concatenated_orders(
        seed=seed, clients=clients, server_round=server_round, sizes=sizes, epochs=epochs
    )
    assert np.array_equal(flat, np.concatenate([o.reshape(-1) for o in orders] or [np.zeros(0, np.int64)]))
    for client, size, order in zip(clients, sizes, orders, strict=True):
        assert order.shape == (epochs, size)
        for row in order:
            assert sorted(row.tolist()) == list(range(size))
        alone = example_orders(
            seed=seed, clients=[client], server_round=server_round, sizes=[size], epochs=epochs
        )
        assert np.array_equal(alone[0], order)  # the cohort around it changes nothing


def test_orders_change_with_the_round_the_epoch_the_seed_and_the_client() -> None:
    def order(seed: int = 1, client: int = 5, server_round: int = 2, epochs: int = 2) -> np.ndarray:
        drawn = example_orders(
            seed=seed, clients=[client], server_round=server_round, sizes=[50], epochs=epochs
        )
        return drawn[0]

    base = order()
    assert not np.array_equal(base[0], base[1])  # a fresh order every epoch
    for other in (order(seed=2), order(client=6), order(server_round=3)):
        assert not np.array_equal(other[0], base[0])
    assert np.array_equal(order(), base)  # and the same again for the same inputs


def test_device_node_ids_of_64_bits_are_client_ids() -> None:
    """A deployed client's id is its node id, up to 2**64 - 1 (a signed 64-bit conversion overflowed)."""
    node = 11716878691818976120  # a real node id above 2**63
    drawn = example_orders(seed=4, clients=[node], server_round=1, sizes=[6], epochs=1)
    assert sorted(drawn[0][0].tolist()) == list(range(6))
    assert 0 <= client_seed(seed=4, client=node, server_round=1) < 2**62
    assert client_keys([node])[0] == np.uint64(node)
    small = np.asarray([3, 4], dtype=np.int64)  # a simulation's partition ids keep their keys
    assert np.array_equal(client_keys(small), client_keys([3, 4]))
    for bad in ([-1], [2**64], np.asarray([-2])):
        with pytest.raises(ValueError, match="client ids"):
            client_keys(bad)


def test_the_orders_of_three_examples_are_uniform_over_the_six_permutations() -> None:
    """Chi-square over 12,000 clients' orders of 3 examples: every permutation about equally often."""
    clients = np.arange(12_000)
    orders = example_orders(seed=9, clients=clients, server_round=1, sizes=np.full(12_000, 3), epochs=1)
    index = {p: k for k, p in enumerate(itertools.permutations(range(3)))}
    counts = np.bincount([index[tuple(o[0].tolist())] for o in orders], minlength=6)
    expected = len(clients) / 6
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.5, counts  # the 0.999 quantile of chi-square with 5 degrees of freedom


def test_splitmix64_matches_its_reference_outputs() -> None:
    """The first outputs of the reference generator from state 0 (Vigna's splitmix64.c): the finaliser
    of 1 * gamma, 2 * gamma, 3 * gamma (this module adds gamma to its input first)."""
    gamma = 0x9E3779B97F4A7C15
    states = np.asarray([(k * gamma) % 2**64 for k in range(3)], dtype=np.uint64)
    expected = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    assert [int(v) for v in splitmix64(states)] == expected
    assert math.isclose(
        float(np.mean(splitmix64(np.arange(4096, dtype=np.uint64)) >> np.uint64(63))), 0.5, abs_tol=0.05
    )
