"""The federated view of a data set: test split, public split, validation split, client partitions.

A :class:`DataSpec` is everything needed to rebuild the identical split in any
process; it travels to simulated clients inside the train message (a JSON
string), so the ClientApp needs neither Hydra nor a shared disk. Each process
builds the :class:`FederatedData` for a spec once and keeps it
(:func:`federated_data`), so a Ray worker loads the data set and its partition once
and then serves every round and every virtual client from memory. The partition's
rows are computed by the first process that needs them and read from a disk cache
by the others (:mod:`fl_app.data.partition_cache`).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fl_app.data.examples import DEFAULT_USER_COLUMNS, TEXT_DATASETS, ClientDataset, concatenated_ranges
from fl_app.data.hf import HFSource, load_hf_dataset
from fl_app.data.natural import natural_split
from fl_app.data.partition_cache import load_rows, partition_key, store_rows
from fl_app.data.sources import ArrayDataset, load_dataset

#: The partition whose clients are the data set's own users (``partition.column``).
NATURAL = "natural"


@dataclass(frozen=True)
class DataSpec:
    """A reproducible description of the federated split.

    Attributes
    ----------
    dataset : dict
        The ``dataset`` config group.
    partition : dict
        The ``partition`` config group.
    num_clients : int
        Number of client partitions.
    seed : int
        Seed of the public split, the validation split, the partitioner and generated data.
    validation_fraction : float
        Share of the training split set aside, before partitioning, as the validation split that
        the server evaluates on instead of the test split (``evaluation.split=validation``); those
        rows belong to no client. 0: no validation split (the test split is the evaluation set).

    """

    dataset: dict[str, Any]
    partition: dict[str, Any]
    num_clients: int
    seed: int
    validation_fraction: float = 0.0
    _key: str = field(default="", compare=False, repr=False)

    @classmethod
    def from_config(cls, composed: Mapping[str, Any]) -> DataSpec:
        """Build the spec from a composed run configuration (read once, by :mod:`fl_app.config.settings`)."""
        evaluation = composed.get("evaluation") or {}
        validation = evaluation.get("split", "test") == "validation"
        dataset = dict(composed["dataset"])
        if dataset.get("name") in ("hf", *TEXT_DATASETS) and dataset.get("path"):
            dataset["path"] = absolute_if_local(str(dataset["path"]))
        if dataset.get("name") in TEXT_DATASETS and dataset.get("vocabulary"):
            dataset["vocabulary"] = str(Path(str(dataset["vocabulary"])).expanduser().resolve())
        partition = dict(composed["partition"])
        if dataset.get("name") in TEXT_DATASETS and partition.get("column") is None:
            partition["column"] = DEFAULT_USER_COLUMNS[str(dataset["name"])]
        return cls(
            dataset=dataset,
            partition=partition,
            num_clients=int(composed["num_clients"]),
            seed=int(composed["seed"]),
            validation_fraction=float(evaluation["validation_fraction"]) if validation else 0.0,
        )

    def to_json(self) -> str:
        """Serialise for a ConfigRecord (canonical: equal specs give equal strings)."""
        raw: dict[str, Any] = {
            "dataset": self.dataset,
            "partition": self.partition,
            "num_clients": self.num_clients,
            "seed": self.seed,
        }
        if self.validation_fraction > 0:  # absent otherwise: the specs (and cache keys) of runs without it
            raw["validation_fraction"] = self.validation_fraction
        return json.dumps(raw, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DataSpec:
        """Inverse of :meth:`to_json`."""
        raw = json.loads(text)
        return cls(
            raw["dataset"],
            raw["partition"],
            int(raw["num_clients"]),
            int(raw["seed"]),
            float(raw.get("validation_fraction", 0.0)),
        )


def absolute_if_local(path: str) -> str:
    """``path`` made absolute when it names a local file, folder or glob (Ray's workers run elsewhere)."""
    local = HFSource(path, "train", None, 0.0, "", "").local_path()
    return str(local.resolve()) if local is not None else path


@dataclass(frozen=True)
class FederatedData:
    """A data set split into test, public (unlabeled), validation and per-client parts."""

    arrays: ArrayDataset
    public_rows: np.ndarray
    client_rows: tuple[np.ndarray, ...]
    validation_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def num_classes(self) -> int:
        """Number of classes."""
        return self.arrays.num_classes

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one example."""
        return self.arrays.input_shape

    def client(self, partition_id: int) -> ClientDataset:
        """Return the labelled examples of client ``partition_id``."""
        rows = self.client_rows[partition_id]
        return ClientDataset(self.arrays.x_train[rows], self.arrays.y_train[rows])

    def rows_of(self, partitions: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The training rows of ``partitions``, one client's after another's, and each client's count."""
        flat, starts, sizes = self._stored_rows
        chosen = np.asarray(partitions, dtype=np.int64)
        return flat[concatenated_ranges(starts[chosen], sizes[chosen])], sizes[chosen]

    @functools.cached_property
    def _stored_rows(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every client's rows in one array, where each client's start and its count (built once)."""
        sizes = np.asarray([len(rows) for rows in self.client_rows], dtype=np.int64)
        flat = np.concatenate(self.client_rows) if self.client_rows else np.zeros(0, dtype=np.int64)
        return flat.astype(np.int64, copy=False), np.cumsum(sizes) - sizes, sizes

    @property
    def natural(self) -> bool:
        """Whether every client is one user of the data set (``partition=natural``)."""
        return self.arrays.groups_train is not None

    @property
    def uncounted_targets(self) -> tuple[int, ...] | None:
        """None: a classification data set (a text data set's targets that accuracy leaves out)."""
        return None

    def client_sizes(self) -> list[int]:
        """Number of examples of every client."""
        return [len(rows) for rows in self.client_rows]

    def public_x(self) -> np.ndarray:
        """Images of the public split (its labels are never exposed here)."""
        return self.arrays.x_train[self.public_rows]

    def test(self) -> ClientDataset:
        """The server's test split."""
        return ClientDataset(self.arrays.x_test, self.arrays.y_test)

    @property
    def evaluation_split(self) -> str:
        """``"validation"`` when the spec set a validation split aside, else ``"test"``."""
        return "validation" if len(self.validation_rows) else "test"

    def evaluation(self) -> ClientDataset:
        """The split the server evaluates on: the validation split if there is one, else the test split.

        With a validation split (``evaluation.split=validation``, for tuning), the test split is
        never read, so choices made on these results leave the test split untouched.
        """
        if not len(self.validation_rows):
            return self.test()
        rows = self.validation_rows
        return ClientDataset(self.arrays.x_train[rows], self.arrays.y_train[rows])


def build_federated_data(spec: DataSpec, *, use_cache: bool = True) -> FederatedData:
    """Load the data set and split it as ``spec`` says.

    The rows of the split come from the disk cache (:mod:`fl_app.data.partition_cache`) when
    another process (or an earlier run) computed them, else they are computed and stored there;
    ``use_cache=False`` always computes them and stores nothing.
    """
    if spec.dataset["name"] in TEXT_DATASETS:  # token arrays on disk, users by offset: no row lists
        from fl_app.data.text import build_text_data

        return build_text_data(  # type: ignore[return-value]  # the same interface (TextData)
            spec.dataset,
            spec.partition,
            num_clients=spec.num_clients,
            seed=spec.seed,
            validation_fraction=spec.validation_fraction,
        )
    arrays = load_arrays(spec)
    key = partition_key(spec.to_json(), arrays.y_train, arrays.groups_train) if use_cache else None
    cached = load_rows(key) if key is not None else None
    if cached is not None:
        public_rows, client_rows, validation_rows = cached
        return FederatedData(arrays, public_rows, client_rows, validation_rows)
    if arrays.groups_train is not None:
        public_rows, client_rows, validation_rows = natural_split(
            arrays.groups_train,
            num_clients=spec.num_clients,
            public_fraction=float(spec.dataset.get("public_fraction", 0.0)),
            validation_fraction=spec.validation_fraction,
            seed=spec.seed,
            column=f"partition.column={spec.partition.get('column')!r}",
        )
        if key is not None:
            store_rows(key, public_rows, client_rows, validation_rows)
        return FederatedData(arrays, public_rows, client_rows, validation_rows)
    # Imported here: the partitioners pull in flwr-datasets, datasets, pandas, pyarrow, scipy and
    # matplotlib (about 2 s of CPU), which a device's ClientApp process never needs.
    from fl_app.data.partition import partition_rows, split_public, split_validation

    public_rows, private_rows = split_public(
        len(arrays.y_train),
        public_fraction=float(spec.dataset.get("public_fraction", 0.0)),
        seed=spec.seed,
    )
    validation_rows, private_rows = split_validation(
        private_rows, fraction=spec.validation_fraction, seed=spec.seed
    )
    positions = partition_rows(
        arrays.y_train[private_rows],
        scheme=str(spec.partition["name"]),
        num_partitions=spec.num_clients,
        seed=spec.seed,
        options=spec.partition,
    )
    client_rows = tuple(private_rows[p] for p in positions)
    if key is not None:
        store_rows(key, public_rows, client_rows, validation_rows)
    return FederatedData(arrays, public_rows, client_rows, validation_rows)


def load_arrays(spec: DataSpec) -> ArrayDataset:
    """The data set of ``spec``: a built-in one, or a Hugging Face one (with users, for ``natural``)."""
    source = hf_source(spec)
    if source is None:
        return load_dataset(spec.dataset, seed=spec.seed)
    declared = spec.dataset.get("num_classes")
    return load_hf_dataset(source, seed=spec.seed, num_classes=None if declared is None else int(declared))


def hf_source(spec: DataSpec) -> HFSource | None:
    """The Hugging Face data set ``spec`` reads (its users' column for ``natural``); None: a built-in one."""
    if spec.dataset["name"] != "hf":
        return None
    natural = spec.partition["name"] == NATURAL
    column = str(spec.partition["column"]) if natural else None
    return HFSource.from_options(spec.dataset, group_column=column)


def describe_client(spec: DataSpec) -> str:
    """What one client's data is: one user's (a natural partition), or a drawn share of the rows."""
    if spec.partition["name"] == NATURAL:
        return (
            f"one user: every training row of one {spec.partition['column']} of {spec.dataset.get('path')} "
            "(partition=natural), so an epsilon per client is an epsilon per user"
        )
    return (
        f"a share of {spec.dataset['name']}'s training rows drawn by the {spec.partition['name']} "
        "partition, not one person's data"
    )


@functools.lru_cache(maxsize=2)
def _cached(spec_json: str) -> FederatedData:
    return build_federated_data(DataSpec.from_json(spec_json))


def federated_data(spec: DataSpec) -> FederatedData:
    """Return the (per-process cached) federated data of ``spec``."""
    return _cached(spec.to_json())


@functools.lru_cache(maxsize=8)
def _canonical(spec_json: str) -> str:
    return DataSpec.from_json(spec_json).to_json()


def federated_data_of(spec_json: str) -> FederatedData:
    """:func:`federated_data` of a message's spec (:meth:`DataSpec.to_json`), parsed once per text."""
    return _cached(_canonical(spec_json))
