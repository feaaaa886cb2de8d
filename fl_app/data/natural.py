"""The natural partition (``partition=natural``): each user of the data set is one client.

A data set with real users (FEMNIST's ``writer_id``) names each row's user in a column
(``partition.column``). Every client is one user with all of that user's training rows, in the sizes
they come; no row of a client's user goes anywhere else. The users are ordered by a seeded
permutation: the first ``num_clients`` are the clients (client ``k`` is the ``k``-th smallest of
them by id), the next ones, whole, give the public split (until ``dataset.public_fraction`` of the
training rows) and then the validation split (``evaluation.validation_fraction``); users left over
take no part in the run. So the public and validation rows never belong to a client's user, and
"one client's data" is one user's data.

flwr-datasets' ``NaturalIdPartitioner`` groups rows the same way but makes every distinct id a
partition (it has no number of partitions) and builds an Arrow selection per partition;
:func:`group_rows` does the grouping with one numpy sort (``benchmarks/hf_loader.py`` times both;
``tests/test_hf_data.py`` checks they agree).
"""

from __future__ import annotations

import numpy as np

Rows = tuple[np.ndarray, tuple[np.ndarray, ...], np.ndarray]  # public, clients, validation


def group_rows(groups: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """The distinct ids of ``groups`` (sorted) and, for each, its rows (sorted)."""
    order = np.argsort(groups, kind="stable")
    ids, starts = np.unique(groups[order], return_index=True)
    return ids, np.split(order.astype(np.int64), starts[1:])


def natural_split(
    groups: np.ndarray,
    *,
    num_clients: int,
    public_fraction: float,
    validation_fraction: float,
    seed: int,
    column: str = "partition.column",
) -> Rows:
    """Public, client and validation rows of the natural partition of ``groups`` (one id per row).

    Raises
    ------
    ValueError
        One line: fewer users than ``num_clients`` (both numbers), or too few rows among the users
        that are not clients for the public or validation split.

    """
    ids, rows = group_rows(groups)
    clients, order = draw_client_users(len(ids), num_clients=num_clients, seed=seed, column=column)
    rest = list(order)
    total = len(groups)
    public = take_users(
        rest, rows, round(public_fraction * total), "dataset.public_fraction", public_fraction
    )
    validation = take_users(
        rest, rows, round(validation_fraction * total), "evaluation.validation_fraction", validation_fraction
    )
    return public, tuple(rows[i] for i in clients), validation


def draw_client_users(
    users: int, *, num_clients: int, seed: int, column: str
) -> tuple[np.ndarray, np.ndarray]:
    """The client users (sorted numbers) of ``users`` and the others in a seeded order.

    ``ValueError`` (one line naming ``column``) for fewer users than ``num_clients``.
    """
    if users < num_clients:
        raise ValueError(
            f"{column} has {users} distinct users in the training split, fewer than "
            f"num_clients={num_clients}: set num_clients to at most {users}"
        )
    order = np.random.default_rng([seed, 0x0A7A]).permutation(users)
    return np.sort(order[:num_clients]), order[num_clients:]


def take_users(rest: list[int], rows: list[np.ndarray], target: int, key: str, value: float) -> np.ndarray:
    """Whole users from the front of ``rest`` (removed from it) until their rows reach ``target``."""
    taken: list[np.ndarray] = []
    count = 0
    while count < target and rest:
        user_rows = rows[rest.pop(0)]
        taken.append(user_rows)
        count += len(user_rows)
    if count < target:
        raise ValueError(
            f"{key}={value} asks for {target} rows from users that are not clients, but only {count} are "
            "left (the other users are clients): lower num_clients or the fraction"
        )
    return np.sort(np.concatenate(taken)) if taken else np.zeros(0, dtype=np.int64)
