"""The order a client trains on its examples, drawn for a whole cohort at once by a counter-based hash.

Local SGD visits a client's examples in a fresh order every epoch. The order is non-privacy
randomness (it comes from the public ``seed``): what matters is that each client's order depends only
on the run seed, the client, the round and the epoch, so that a client trained on its own and the same
client trained with its cohort (vectorised, or in a worker's share of the cohort) see the same
batches. A numpy generator per client costs about 40 us to build on this CPU (``SeedSequence``, PCG64),
more than a cohort of a thousand logistic-regression clients may spend per client in all. So the
orders are drawn from a counter-based hash instead: example ``i`` of client ``c`` in round ``t`` and
epoch ``e`` gets the key ``splitmix64`` of ``(seed, c, t, e, i)``, and the epoch's order sorts the keys
(one ``lexsort`` for the whole cohort). ``splitmix64`` (Steele, Lea, Flood, "Fast splittable
pseudorandom number generators", OOPSLA 2014) passes BigCrush on its outputs; distinct inputs give
distinct keys with overwhelming probability, so each order is a uniformly random permutation.
:func:`client_seed` derives the one number a client's dropout masks start from in the same way.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
#: Distinct streams: the example orders, the dropout seeds.
ORDER_STREAM = 1
DROPOUT_STREAM = 2


def splitmix64(values: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser of ``values`` (``uint64``, element-wise, wrapping)."""
    with np.errstate(over="ignore"):
        z = values + _GAMMA
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def _keyed(seed: int, stream: int, clients: np.ndarray, server_round: int) -> np.ndarray:
    """One 64-bit key per ``uint64`` client id for ``stream`` in ``server_round`` (chained splitmix64)."""
    key = splitmix64(np.asarray([seed & (2**64 - 1)], dtype=np.uint64))
    key = splitmix64(key ^ np.uint64(stream))
    key = splitmix64(key ^ np.uint64(server_round & (2**64 - 1)))
    return splitmix64(key ^ clients)


def client_keys(clients: Sequence[int] | np.ndarray) -> np.ndarray:
    """Client ids as ``uint64`` (a simulated client's partition id, or a device's 64-bit node id).

    Raises ``ValueError`` for an id outside ``[0, 2**64)``.
    """
    if isinstance(clients, np.ndarray) and clients.dtype.kind in "iu":
        if clients.dtype.kind == "i" and clients.size and int(clients.min()) < 0:
            raise ValueError(f"client ids must be non-negative, got {int(clients.min())}")
        return clients.astype(np.uint64)
    ids = [int(c) for c in clients]
    outside = [c for c in ids if not 0 <= c < 2**64]
    if outside:
        raise ValueError(f"client ids must lie in [0, 2**64), got {outside[0]}")
    return np.asarray(ids, dtype=np.uint64)


def client_seed(*, seed: int, client: int, server_round: int) -> int:
    """A 62-bit seed for client ``client``'s dropout masks in ``server_round`` (0 <= value < 2**62)."""
    key = _keyed(seed, DROPOUT_STREAM, client_keys([client]), server_round)
    return int(key[0] >> np.uint64(2))


def example_orders(
    *,
    seed: int,
    clients: Sequence[int] | np.ndarray,
    server_round: int,
    sizes: Sequence[int] | np.ndarray,
    epochs: int,
) -> list[np.ndarray]:
    """Each client's example order in every epoch: ``[epochs, n_c]`` int64 arrays, in ``clients``' order.

    ``sizes[k]`` is client ``clients[k]``'s number of examples. Row ``e`` of a client's array is the
    permutation of ``range(n_c)`` its epoch ``e`` visits.
    """
    counts = np.asarray(sizes, dtype=np.int64)
    flat = concatenated_orders(
        seed=seed, clients=clients, server_round=server_round, sizes=counts, epochs=epochs
    )
    ends = np.cumsum(counts * epochs)
    return [
        flat[end - n * epochs : end].reshape(epochs, n)
        for end, n in zip(ends.tolist(), counts.tolist(), strict=True)
    ]


def concatenated_orders(
    *,
    seed: int,
    clients: Sequence[int] | np.ndarray,
    server_round: int,
    sizes: Sequence[int] | np.ndarray,
    epochs: int,
) -> np.ndarray:
    """:func:`example_orders` concatenated: client after client, each client's epochs in order."""
    ids = client_keys(clients)
    counts = np.asarray(sizes, dtype=np.int64)
    if ids.shape != counts.shape:
        raise ValueError(f"{ids.size} clients for {counts.size} sizes")
    if epochs < 0 or (counts < 0).any():
        raise ValueError("epochs and sizes must be non-negative")
    per_client = counts * epochs
    total = int(per_client.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    base = _keyed(seed, ORDER_STREAM, ids, server_round)  # [clients]
    owner = np.repeat(np.arange(ids.size), per_client)  # which client each (epoch, example) entry is
    starts = np.cumsum(per_client) - per_client
    within = np.arange(total, dtype=np.int64) - starts[owner]  # e * n_c + i inside the client's block
    size = counts[owner]
    epoch = within // np.maximum(size, 1)
    index = within - epoch * size
    with np.errstate(over="ignore"):
        mixed = splitmix64(base[owner] ^ splitmix64(epoch.astype(np.uint64) * _GAMMA))
    keys = splitmix64(mixed ^ index.astype(np.uint64))
    segment = owner * max(epochs, 1) + epoch  # one segment per (client, epoch), in order
    order = np.lexsort((keys, segment))  # by segment, then by key
    return index[order]
