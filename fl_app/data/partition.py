"""Public/private split and client partitions of a local array data set.

Partitions come from flwr-datasets' partitioners applied to a tiny in-memory
``datasets.Dataset`` of labels and row indices (no hub download): the
partitioner decides which rows each client gets, the arrays stay in numpy.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from datasets import Dataset

from fl_app.data.flower_partitioners import (
    DirichletPartitioner,
    ExponentialPartitioner,
    IidPartitioner,
    LinearPartitioner,
    Partitioner,
)


def _iid(num_partitions: int, seed: int, options: Mapping[str, Any]) -> Partitioner:
    del seed, options  # rows are already in a seeded random order
    return IidPartitioner(num_partitions=num_partitions)


def _dirichlet(num_partitions: int, seed: int, options: Mapping[str, Any]) -> Partitioner:
    return DirichletPartitioner(
        num_partitions=num_partitions,
        partition_by="label",
        alpha=float(options["alpha"]),
        min_partition_size=int(options.get("min_partition_size", 2)),
        self_balancing=bool(options.get("self_balancing", False)),
        seed=seed,
    )


def _linear(num_partitions: int, seed: int, options: Mapping[str, Any]) -> Partitioner:
    del seed, options
    return LinearPartitioner(num_partitions=num_partitions)


def _exponential(num_partitions: int, seed: int, options: Mapping[str, Any]) -> Partitioner:
    del seed, options
    return ExponentialPartitioner(num_partitions=num_partitions)


def two_tier_sizes(
    num_rows: int, *, num_partitions: int, large_clients: int, large_share: float
) -> list[int]:
    """Client sizes of the two-tier partition: a few large-data clients and many general clients.

    The ``large_clients`` last clients share ``round(large_share * num_rows)`` rows equally, the
    other ``num_partitions - large_clients`` (general) clients share the rest equally; a remainder
    of a division goes one row each to the first clients of the tier. KD-DP's document (Tan et al.
    2024) groups clients into "large-data clients" and "general clients" by data size; this is that
    population in its plainest form (IID labels, two sizes).

    Raises
    ------
    ValueError
        When a tier is empty or a client would get no row; the message names the partition key.

    """
    if not 1 <= large_clients < num_partitions:
        raise ValueError(f"partition.large_clients={large_clients}: must be in [1, num_clients - 1]")
    if not 0.0 < large_share < 1.0:
        raise ValueError(f"partition.large_share={large_share}: must be in (0, 1)")
    large_rows = round(large_share * num_rows)
    sizes: list[int] = []
    for clients, rows in (
        (num_partitions - large_clients, num_rows - large_rows),
        (large_clients, large_rows),
    ):
        size, extra = divmod(rows, clients)
        if size == 0:
            raise ValueError(
                f"partition.large_share={large_share}: {rows} rows cannot give each of {clients} clients one"
            )
        sizes += [size + 1] * extra + [size] * (clients - extra)
    return sizes


class AssignedOncePartitioner(Partitioner):
    """A partitioner that assigns every client's rows at the first ``load_partition`` call.

    Subclasses implement :meth:`_assign` (client id -> row indices of ``self.dataset``). The
    assignment is kept in ``_partition_id_to_indices``, the attribute
    :func:`partition_positions_fast` reads (as for flwr-datasets' own partitioners).
    """

    def __init__(self, num_partitions: int) -> None:
        super().__init__()
        self._num_partitions = num_partitions
        self._partition_id_to_indices: dict[int, list[int]] = {}

    @property
    def num_partitions(self) -> int:
        """Number of clients."""
        return self._num_partitions

    def load_partition(self, partition_id: int) -> Dataset:
        """The rows of client ``partition_id`` (all partitions are assigned on the first call)."""
        if not self._partition_id_to_indices:
            self._partition_id_to_indices = self._assign()
        return self.dataset.select(self._partition_id_to_indices[partition_id])

    def _assign(self) -> dict[int, list[int]]:
        raise NotImplementedError


class TwoTierPartitioner(AssignedOncePartitioner):
    """IID rows in two client sizes (:func:`two_tier_sizes`), contiguous in the given (seeded) row order.

    Parameters
    ----------
    num_partitions : int
        Number of clients.
    large_clients : int
        Number of large-data clients (the last ones).
    large_share : float
        Share of the rows the large-data clients hold together.

    """

    def __init__(self, num_partitions: int, *, large_clients: int, large_share: float) -> None:
        super().__init__(num_partitions)
        self.large_clients = large_clients
        self.large_share = large_share

    def _assign(self) -> dict[int, list[int]]:
        sizes = two_tier_sizes(
            len(self.dataset),
            num_partitions=self.num_partitions,
            large_clients=self.large_clients,
            large_share=self.large_share,
        )
        ends = np.cumsum(sizes)
        return {
            i: list(range(int(end) - size, int(end)))
            for i, (size, end) in enumerate(zip(sizes, ends, strict=True))
        }


def _two_tier(num_partitions: int, seed: int, options: Mapping[str, Any]) -> Partitioner:
    del seed  # rows are already in a seeded random order: each client's rows are IID
    return TwoTierPartitioner(
        num_partitions, large_clients=int(options["large_clients"]), large_share=float(options["large_share"])
    )


class EqualSizeDirichletPartitioner(AssignedOncePartitioner):
    """Equal-size clients, each with its own Dirichlet(alpha) class shares (PrivateKT's partition).

    The partition of Qi et al.'s code (taoqi98/PrivateKT, ``Code/preprocessing.py``,
    ``local_data_partition``): every client but the last draws class shares ``p ~ Dir(alpha 1)``,
    takes ``round(p * size)`` rows per class (the largest count adjusted so they sum to ``size``)
    from each class's shuffled rows in turn, and the last client gets every row left. A class that
    runs out gives fewer rows (as in their code). ``flwr-datasets``' ``DirichletPartitioner``
    instead splits each class over clients, so client sizes vary (139 to 1,288 for 80 MNIST
    clients).

    Parameters
    ----------
    num_partitions : int
        Number of clients.
    alpha : float
        Dirichlet concentration of each client's class shares.
    size : int | None
        Rows per client (all but the last); None: ``rows // num_partitions``.
    seed : int
        Seed of the class shuffles and the shares.

    """

    def __init__(self, num_partitions: int, *, alpha: float, size: int | None, seed: int) -> None:
        super().__init__(num_partitions)
        self.alpha = alpha
        self.size = size
        self.seed = seed

    def _assign(self) -> dict[int, list[int]]:
        labels = np.asarray(self.dataset["label"], dtype=np.int64)
        rng = np.random.default_rng([self.seed, 0xD1C4])
        classes = np.unique(labels)
        pools = {c: rng.permutation(np.flatnonzero(labels == c)) for c in classes}
        used = dict.fromkeys(classes, 0)
        size = self.size if self.size is not None else len(labels) // self.num_partitions
        assigned: dict[int, list[int]] = {}
        for client in range(self.num_partitions - 1):
            counts = np.round(rng.dirichlet([self.alpha] * len(classes)) * size).astype(np.int64)
            counts[counts.argmax()] -= counts.sum() - size
            rows = []
            for c, count in zip(classes, counts, strict=True):
                rows.append(pools[c][used[c] : used[c] + count])
                used[c] += int(count)
            assigned[client] = np.concatenate(rows).tolist()
        rest = [pools[c][used[c] :] for c in classes]
        assigned[self.num_partitions - 1] = np.concatenate(rest).tolist()
        return assigned


def _equal_size_dirichlet(num_partitions: int, seed: int, options: Mapping[str, Any]) -> Partitioner:
    size = options.get("size")
    return EqualSizeDirichletPartitioner(
        num_partitions, alpha=float(options["alpha"]), size=None if size is None else int(size), seed=seed
    )


PARTITIONERS: dict[str, Callable[[int, int, Mapping[str, Any]], Partitioner]] = {
    "iid": _iid,
    "dirichlet": _dirichlet,
    "equal_size_dirichlet": _equal_size_dirichlet,
    "linear": _linear,
    "exponential": _exponential,
    "two_tier": _two_tier,
}


def split_public(num_examples: int, *, public_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split row indices into a public part and a private (client) part.

    Returns
    -------
    tuple[np.ndarray, np.ndarray]
        ``(public_indices, private_indices)``; both in a seeded random order.

    """
    if not 0.0 <= public_fraction < 1.0:
        raise ValueError(f"public_fraction must be in [0, 1), got {public_fraction}")
    order = np.random.default_rng([seed, 0x5EED]).permutation(num_examples)
    num_public = round(public_fraction * num_examples)
    return np.sort(order[:num_public]), order[num_public:]


def split_validation(
    private_rows: np.ndarray, *, fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Set a seeded random share of the private (client) rows aside as the validation split.

    The validation rows are taken before partitioning, so they belong to no client: choosing
    hyperparameters on them reads no client's data.

    Returns
    -------
    tuple[np.ndarray, np.ndarray]
        ``(validation_rows, remaining_private_rows)``; the validation rows sorted, the remaining
        rows in their given order. ``fraction=0`` sets nothing aside.

    """
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"validation fraction must be in [0, 1), got {fraction}")
    count = round(fraction * len(private_rows))
    if count == 0:
        return np.zeros(0, dtype=np.int64), private_rows
    chosen = np.zeros(len(private_rows), dtype=bool)
    chosen[np.random.default_rng([seed, 0x7A11D]).choice(len(private_rows), size=count, replace=False)] = True
    return np.sort(private_rows[chosen]), private_rows[~chosen]


def partition_rows(
    labels: np.ndarray, *, scheme: str, num_partitions: int, seed: int, options: Mapping[str, Any]
) -> list[np.ndarray]:
    """Assign the rows of ``labels`` to ``num_partitions`` clients.

    Parameters
    ----------
    labels : np.ndarray
        Labels of the rows to partition (their order is the row order).
    scheme : str
        A key of :data:`PARTITIONERS`.
    num_partitions : int
        Number of clients.
    seed : int
        Seed for partitioners that draw proportions.
    options : Mapping[str, Any]
        The ``partition`` config group (e.g. ``alpha``).

    Returns
    -------
    list[np.ndarray]
        For each client, positions into ``labels`` (sorted).

    """
    if scheme not in PARTITIONERS:
        raise ValueError(f"partition.name={scheme!r} is unknown; allowed: {', '.join(PARTITIONERS)}")
    partitioner = PARTITIONERS[scheme](num_partitions, seed, options)
    partitioner.dataset = Dataset.from_dict(
        {"label": labels.astype(np.int64), "row": np.arange(len(labels), dtype=np.int64)}
    )
    try:
        with warnings.catch_warnings():  # one warning per failed draw, each listing every client's alpha
            warnings.filterwarnings(
                "ignore", message="The specified min_partition_size", category=UserWarning
            )
            fast = partition_positions_fast(partitioner, num_partitions=num_partitions, num_rows=len(labels))
            if fast is not None:
                return fast
            return partition_positions_public(partitioner, num_partitions=num_partitions)
    except ValueError as error:
        if scheme != "dirichlet":
            raise
        raise ValueError(dirichlet_refusal(len(labels), num_partitions, options)) from error


def dirichlet_refusal(num_rows: int, num_partitions: int, options: Mapping[str, Any]) -> str:
    """Why the Dirichlet partition found no split: the clients, the rows, the minimum, the remedies."""
    minimum = int(options.get("min_partition_size", 2))
    return (
        f"every draw of Dirichlet(partition.alpha={options['alpha']}) shares left some of the "
        f"{num_partitions} clients with fewer than partition.min_partition_size={minimum} of the "
        f"{num_rows} rows ({num_rows / num_partitions:.1f} per client on average); use fewer clients, "
        "a larger partition.alpha (more even shares) or partition=iid"
    )


def partition_positions_public(partitioner: Partitioner, *, num_partitions: int) -> list[np.ndarray]:
    """The rows of every partition through flwr-datasets' public ``load_partition`` (the reference)."""
    # Read the row column through Arrow: the default (Python) format extracts row by row, ~5x slower.
    return [
        np.sort(partitioner.load_partition(i).with_format("arrow")["row"].to_numpy().astype(np.int64))
        for i in range(num_partitions)
    ]


def partition_positions_fast(
    partitioner: Partitioner, *, num_partitions: int, num_rows: int
) -> list[np.ndarray] | None:
    """The same rows as :func:`partition_positions_public`, without one ``load_partition`` per client.

    ``load_partition`` builds an Arrow selection per client: 5 s for 1000
    clients and 13 s for 5000, in the server and again in every simulation
    worker. The row column is ``0..n-1``, so a partition's rows are its
    indices: ``IidPartitioner`` shards contiguously (``datasets``' ``shard``
    rule), and the Dirichlet and size partitioners keep the indices they drew
    (a private attribute of flwr-datasets 0.6). ``tests/test_data.py`` checks
    both against the public path. None when neither applies (use the public path).
    """
    if isinstance(partitioner, IidPartitioner):
        size, extra = divmod(num_rows, num_partitions)
        starts = [size * i + min(i, extra) for i in range(num_partitions + 1)]
        return [np.arange(starts[i], starts[i + 1], dtype=np.int64) for i in range(num_partitions)]
    partitioner.load_partition(0)  # draws every partition's indices
    drawn = getattr(partitioner, "_partition_id_to_indices", None)
    if not isinstance(drawn, dict) or sorted(drawn) != list(range(num_partitions)):
        return None
    return [np.sort(np.asarray(drawn[i], dtype=np.int64)) for i in range(num_partitions)]
