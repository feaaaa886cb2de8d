"""Data: IDX files, where they are found, the public split and the partitions."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fl_app.data import PARTITION_SCHEMES, partition_cache, sources
from fl_app.data.examples import concatenated_ranges
from fl_app.data.federated import DataSpec, FederatedData, build_federated_data, federated_data
from fl_app.data.local import load_local_dataset
from fl_app.data.partition import partition_rows, split_public
from fl_app.data.sources import DataNotFoundError, read_idx, resolve_idx_folder


def write_idx(path: Path, array: np.ndarray, *, compress: bool) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(payload) if compress else payload)


def write_fake_mnist(folder: Path, *, compress: bool, train: int = 50, test: int = 20) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    suffix = ".gz" if compress else ""
    for split, count in (("train", train), ("t10k", test)):
        write_idx(
            folder / f"{split}-images-idx3-ubyte{suffix}",
            rng.integers(0, 256, size=(count, 28, 28)),
            compress=compress,
        )
        write_idx(
            folder / f"{split}-labels-idx1-ubyte{suffix}", rng.integers(0, 10, size=count), compress=compress
        )


@pytest.mark.parametrize("compress", [True, False])
def test_read_idx_round_trip(tmp_path, compress):
    array = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    path = tmp_path / ("x.idx.gz" if compress else "x.idx")
    write_idx(path, array, compress=compress)
    assert np.array_equal(read_idx(path), array)


def test_read_idx_rejects_truncated_files(tmp_path):
    path = tmp_path / "bad"
    write_idx(path, np.zeros((4, 4)), compress=False)
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(ValueError, match="expected"):
        read_idx(path)


def test_resolution_order_data_dir_then_system_then_cache(tmp_path):
    system, cache, mine = tmp_path / "system", tmp_path / "cache", tmp_path / "mine"
    write_fake_mnist(system, compress=True)
    write_fake_mnist(cache, compress=False)
    write_fake_mnist(mine, compress=False)
    found = resolve_idx_folder(
        "mnist", data_dir=str(mine), download=False, search_paths=[system], cache_dir=cache
    )
    assert found == mine
    assert (
        resolve_idx_folder("mnist", data_dir=None, download=False, search_paths=[system], cache_dir=cache)
        == system
    )
    assert (
        resolve_idx_folder(
            "mnist", data_dir=None, download=False, search_paths=[tmp_path / "no"], cache_dir=cache
        )
        == cache
    )


def test_missing_files_give_one_line_with_the_remedy(tmp_path):
    with pytest.raises(DataNotFoundError) as error:
        resolve_idx_folder(
            "fashion_mnist",
            data_dir=None,
            download=False,
            search_paths=[tmp_path / "a"],
            cache_dir=tmp_path / "b",
        )
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith("dataset.data_dir=null")
    assert "apt-get install dataset-fashion-mnist" in message
    with pytest.raises(DataNotFoundError, match=r"dataset.data_dir='/nope'"):
        resolve_idx_folder("mnist", data_dir="/nope", download=True)


def test_download_failure_is_reported_offline(tmp_path, monkeypatch):
    monkeypatch.setattr(sources, "DOWNLOAD_MIRRORS", {"mnist": ("http://127.0.0.1:9/",)})
    with pytest.raises(DataNotFoundError, match="download failed"):
        resolve_idx_folder(
            "mnist", data_dir=None, download=True, search_paths=[], cache_dir=tmp_path / "cache"
        )
    assert not (tmp_path / "cache").exists()


def test_load_idx_dataset_shapes(tmp_path):
    write_fake_mnist(tmp_path, compress=True)
    data = sources.load_idx_dataset("mnist", tmp_path)
    assert data.x_train.shape == (50, 1, 28, 28)
    assert data.x_train.dtype == np.uint8
    assert data.y_test.dtype == np.int64
    assert data.input_shape == (1, 28, 28)


def test_digits_read_without_importing_sklearn_equal_sklearns_loader(monkeypatch):
    from sklearn.datasets import load_digits

    images, target = sources.bundled_digits()
    bunch = load_digits()
    assert images.dtype == bunch.images.dtype and np.array_equal(images, bunch.images)
    assert np.array_equal(target, bunch.target)
    # where the bundled file is not found, scikit-learn's own loader is used
    monkeypatch.setattr(sources.importlib.util, "find_spec", lambda name: None)
    fallback_images, fallback_target = sources.bundled_digits()
    assert np.array_equal(fallback_images, bunch.images) and np.array_equal(fallback_target, bunch.target)


def test_digits_and_synthetic():
    digits = sources.load_dataset({"name": "digits", "test_fraction": 0.25}, seed=1)
    assert digits.x_train.shape[1:] == (1, 8, 8)
    assert len(digits.y_train) + len(digits.y_test) == 1797
    spec = {
        "name": "synthetic",
        "num_train": 300,
        "num_test": 50,
        "image_size": 8,
        "num_classes": 4,
        "class_sep": 2.0,
    }
    synthetic = sources.load_dataset(spec, seed=1)
    again = sources.load_dataset(dict(spec), seed=1)
    assert np.array_equal(synthetic.x_train, again.x_train)
    assert set(np.unique(synthetic.y_train)) == {0, 1, 2, 3}


def test_public_split_and_partitions_cover_disjoint_rows():
    spec = DataSpec(
        dataset={"name": "digits", "test_fraction": 0.25, "public_fraction": 0.2},
        partition={"name": "dirichlet", "alpha": 0.5, "min_partition_size": 2, "self_balancing": False},
        num_clients=7,
        seed=3,
    )
    data = build_federated_data(spec)
    rows = np.concatenate(data.client_rows)
    assert len(np.unique(rows)) == len(rows)
    assert not set(rows) & set(data.public_rows)
    assert len(rows) + len(data.public_rows) == len(data.arrays.y_train)
    assert len(data.public_rows) == round(0.2 * len(data.arrays.y_train))
    assert min(data.client_sizes()) >= 2
    again = build_federated_data(spec)
    assert all(np.array_equal(a, b) for a, b in zip(data.client_rows, again.client_rows, strict=True))
    chosen = [5, 0, 5, 3]  # any order, a client twice
    rows, sizes = data.rows_of(chosen)
    np.testing.assert_array_equal(rows, np.concatenate([data.client_rows[c] for c in chosen]))
    assert sizes.tolist() == [len(data.client_rows[c]) for c in chosen]
    assert data.rows_of([])[0].shape == (0,)


@pytest.mark.parametrize("seed", range(5))
def test_concatenated_ranges_are_the_ranges_one_after_another(seed: int) -> None:
    rng = np.random.default_rng(seed)
    starts, sizes = rng.integers(0, 1000, 30), rng.integers(0, 6, 30)  # empty ranges among them
    expected = np.concatenate([np.arange(a, a + n) for a, n in zip(starts, sizes, strict=True)])
    got = concatenated_ranges(starts, sizes)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, expected)


def test_dirichlet_skews_labels_and_iid_does_not():
    labels = np.repeat(np.arange(10), 300)
    skewed = partition_rows(
        labels, scheme="dirichlet", num_partitions=10, seed=0, options={"alpha": 0.1, "min_partition_size": 1}
    )
    even = partition_rows(
        np.random.default_rng(0).permutation(labels), scheme="iid", num_partitions=10, seed=0, options={}
    )

    def dominant_share(parts: list[np.ndarray], source: np.ndarray) -> float:
        return float(np.mean([np.bincount(source[p], minlength=10).max() / len(p) for p in parts]))

    assert dominant_share(skewed, labels) > 0.5
    assert dominant_share(even, np.random.default_rng(0).permutation(labels)) < 0.2


def test_equal_size_dirichlet_gives_equal_sizes_and_skewed_labels():
    """PrivateKT's partition: every client but the last has `size` rows, each with its own label skew."""
    labels = np.random.default_rng(0).permutation(np.repeat(np.arange(10), 600))
    parts = partition_rows(
        labels, scheme="equal_size_dirichlet", num_partitions=8, seed=4, options={"alpha": 0.5, "size": 500}
    )
    assert [len(p) for p in parts[:-1]] == [500] * 7
    assert len(parts[-1]) == 6000 - 7 * 500
    every = np.concatenate(parts)
    assert len(every) == len(set(every.tolist())) == 6000
    shares = [np.bincount(labels[p], minlength=10).max() / len(p) for p in parts[:-1]]
    assert np.mean(shares) > 0.3  # IID would give about 0.12
    again = partition_rows(
        labels, scheme="equal_size_dirichlet", num_partitions=8, seed=4, options={"alpha": 0.5, "size": 500}
    )
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


def test_size_skewed_partitioners():
    labels = np.zeros(1000, dtype=np.int64)
    sizes = [
        len(p) for p in partition_rows(labels, scheme="exponential", num_partitions=5, seed=0, options={})
    ]
    assert sizes == sorted(sizes)
    assert sizes[-1] > 5 * sizes[0]


def test_two_tier_partition_gives_two_sizes_iid_and_every_row_once():
    from fl_app.data.partition import two_tier_sizes

    labels = np.random.default_rng(0).integers(0, 10, size=6003)
    parts = partition_rows(
        labels, scheme="two_tier", num_partitions=20, seed=0, options={"large_clients": 3, "large_share": 0.6}
    )
    sizes = [len(p) for p in parts]
    large = round(0.6 * 6003)
    assert sizes[-3:] == [1201, 1201, 1200] and sum(sizes[-3:]) == large  # remainder to the first of a tier
    assert set(sizes[:-3]) == {141, 142} and sum(sizes[:-3]) == 6003 - large
    every = np.concatenate(parts)
    assert len(every) == len(set(every.tolist())) == 6003
    # IID: a client's class shares follow the data set's, unlike a label-skewed partition
    shares = [np.bincount(labels[p], minlength=10).max() / len(p) for p in parts[-3:]]
    assert max(shares) < 0.15
    with pytest.raises(ValueError, match=r"partition\.large_clients=20"):
        two_tier_sizes(100, num_partitions=20, large_clients=20, large_share=0.5)
    with pytest.raises(ValueError, match=r"partition\.large_share=1\.0"):
        two_tier_sizes(100, num_partitions=20, large_clients=2, large_share=1.0)
    with pytest.raises(ValueError, match=r"partition\.large_share=0\.99: 1 rows cannot give each of 18"):
        two_tier_sizes(100, num_partitions=20, large_clients=2, large_share=0.99)


def test_federated_data_is_cached_per_process():
    spec = DataSpec(
        dataset={"name": "digits", "test_fraction": 0.25, "public_fraction": 0.1},
        partition={"name": "iid"},
        num_clients=4,
        seed=0,
    )
    assert federated_data(spec) is federated_data(DataSpec.from_json(spec.to_json()))


def _digits_spec(**changes: object) -> DataSpec:
    fields: dict[str, object] = {
        "dataset": {"name": "digits", "test_fraction": 0.25, "public_fraction": 0.1},
        "partition": {"name": "dirichlet", "alpha": 0.5, "min_partition_size": 2, "self_balancing": False},
        "num_clients": 9,
        "seed": 4,
    }
    fields.update(changes)
    return DataSpec(**fields)  # type: ignore[arg-type]


def _same_split(a: FederatedData, b: FederatedData) -> bool:
    if len(a.client_rows) != len(b.client_rows) or not np.array_equal(a.public_rows, b.public_rows):
        return False
    if not np.array_equal(a.validation_rows, b.validation_rows):
        return False
    return all(
        x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a.client_rows, b.client_rows, strict=True)
    )


def test_partition_cache_returns_the_computed_rows(tmp_path, monkeypatch):
    monkeypatch.setenv(partition_cache.CACHE_ENV, str(tmp_path / "cache"))
    spec = _digits_spec()
    computed = build_federated_data(spec, use_cache=False)
    assert not (tmp_path / "cache").exists()  # use_cache=False stores nothing
    first = build_federated_data(spec)  # computes and stores
    assert [p.suffix for p in (tmp_path / "cache").iterdir()] == [".npz"]
    key = partition_cache.partition_key(spec.to_json(), first.arrays.y_train)
    assert partition_cache.load_rows(key) is not None
    second = build_federated_data(spec)  # reads
    assert _same_split(computed, first) and _same_split(computed, second)
    # another spec, other labels or another partitioner's code: another key
    assert partition_cache.partition_key(_digits_spec(seed=5).to_json(), first.arrays.y_train) != key
    flipped = first.arrays.y_train.copy()
    flipped[0] = (flipped[0] + 1) % 10
    assert partition_cache.partition_key(spec.to_json(), flipped) != key
    monkeypatch.setattr(partition_cache, "_CODE_PACKAGES", ("flwr-datasets", "numpy"))
    assert partition_cache.partition_key(spec.to_json(), first.arrays.y_train) != key


def test_an_unreadable_cache_file_is_computed_again(tmp_path, monkeypatch):
    monkeypatch.setenv(partition_cache.CACHE_ENV, str(tmp_path))
    spec = _digits_spec()
    computed = build_federated_data(spec, use_cache=False)
    key = partition_cache.partition_key(spec.to_json(), computed.arrays.y_train)
    for content in (b"half a file", b""):  # an empty file raised EOFError before it was caught
        (tmp_path / f"{key}.npz").write_bytes(content)
        assert partition_cache.load_rows(key) is None
    assert _same_split(computed, build_federated_data(spec))
    assert partition_cache.load_rows(key) is not None  # stored again
    # offsets that do not fit the rows
    np.savez(
        tmp_path / f"{key}.npz", public=computed.public_rows, rows=np.arange(5), offsets=np.array([0, 9])
    )
    assert partition_cache.load_rows(key) is None
    assert _same_split(computed, build_federated_data(spec))


def test_partition_cache_off_and_bounded(tmp_path, monkeypatch):
    monkeypatch.setenv(partition_cache.CACHE_ENV, "off")
    build_federated_data(_digits_spec())
    assert partition_cache.cache_dir() is None
    monkeypatch.setenv(partition_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(partition_cache, "MAX_FILES", 2)
    for seed in range(3):
        build_federated_data(_digits_spec(seed=seed))
    assert len(list(tmp_path.glob("*.npz"))) == 2


@pytest.mark.subprocess
def test_a_process_that_finds_its_partition_cached_never_imports_the_partitioners(tmp_path, monkeypatch):
    """What a simulation's Ray worker does: the driver computed the split, the worker reads it."""
    monkeypatch.setenv(partition_cache.CACHE_ENV, str(tmp_path))
    computed = build_federated_data(_digits_spec())  # this process computes and stores it
    expected = [r.tolist() for r in (computed.public_rows, *computed.client_rows)]
    probe = (
        "import sys, json\n"
        "from fl_app.data.federated import DataSpec, build_federated_data\n"
        f"spec = DataSpec.from_json({_digits_spec().to_json()!r})\n"
        "data = build_federated_data(spec)\n"
        "rows = [r.tolist() for r in (data.public_rows, *data.client_rows)]\n"
        "print(json.dumps({'rows': rows, 'flwr_datasets': 'flwr_datasets' in sys.modules}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], env=dict(os.environ), capture_output=True, text=True, check=True
    )
    worker = json.loads(done.stdout.strip().splitlines()[-1])
    assert worker["flwr_datasets"] is False  # read from the cache
    assert worker["rows"] == expected


def test_partition_schemes_are_the_registered_partitioners():
    from fl_app.config.conf_dir import config_groups
    from fl_app.data.federated import NATURAL
    from fl_app.data.partition import PARTITIONERS

    # every scheme but the natural one splits the labels (fl_app.data.natural splits the users)
    assert NATURAL not in PARTITIONERS
    assert sorted(PARTITION_SCHEMES) == sorted([*PARTITIONERS, NATURAL]) == config_groups()["partition"]


def test_validation_split_belongs_to_no_client_and_replaces_the_test_split():
    plain = build_federated_data(_digits_spec(), use_cache=False)
    spec = _digits_spec(validation_fraction=0.2)
    data = build_federated_data(spec, use_cache=False)
    private = len(plain.arrays.y_train) - len(plain.public_rows)
    assert len(data.validation_rows) == round(0.2 * private)
    clients = np.concatenate(data.client_rows)
    assert not set(data.validation_rows) & set(clients)
    assert not set(data.validation_rows) & set(data.public_rows)
    assert np.array_equal(data.public_rows, plain.public_rows)  # the public split is unchanged
    assert len(clients) + len(data.validation_rows) == private
    assert data.evaluation_split == "validation" and plain.evaluation_split == "test"
    assert np.array_equal(data.evaluation().y, data.arrays.y_train[data.validation_rows])
    assert np.array_equal(plain.evaluation().y, plain.arrays.y_test)
    # the spec carries it through JSON; without it the JSON (and the cache key) is what it was
    assert DataSpec.from_json(spec.to_json()) == spec
    assert "validation_fraction" not in _digits_spec().to_json()
    cfg = {
        "dataset": spec.dataset,
        "partition": spec.partition,
        "num_clients": 9,
        "seed": 4,
        "evaluation": {"split": "validation", "validation_fraction": 0.2},
    }
    assert DataSpec.from_config(cfg) == spec
    on_test = {**cfg, "evaluation": {"split": "test", "validation_fraction": 0.2}}
    assert DataSpec.from_config(on_test) == _digits_spec()


def test_partition_cache_keeps_the_validation_rows(tmp_path, monkeypatch):
    monkeypatch.setenv(partition_cache.CACHE_ENV, str(tmp_path))
    spec = _digits_spec(validation_fraction=0.2)
    computed = build_federated_data(spec, use_cache=False)
    build_federated_data(spec)  # computes and stores
    cached = build_federated_data(spec)  # reads
    assert len(cached.validation_rows) > 0 and _same_split(computed, cached)


def test_server_evaluation_arrays_follow_the_split():
    from fl_app.privacy.rng import RandomSource
    from fl_app.run.server import evaluation_arrays

    data = build_federated_data(_digits_spec(validation_fraction=0.2), use_cache=False)
    randomness = RandomSource(seed=0, secure=False)
    x, y = evaluation_arrays(data, subset=None, randomness=randomness)
    assert np.array_equal(y, data.arrays.y_train[data.validation_rows])
    x_small, y_small = evaluation_arrays(data, subset=10, randomness=randomness)
    assert len(y_small) == 10 and set(map(bytes, x_small)) <= set(map(bytes, x))


def test_split_public_validates():
    with pytest.raises(ValueError):
        split_public(10, public_fraction=1.0, seed=0)


def test_local_device_data_npz_and_idx(tmp_path):
    x = np.random.default_rng(0).integers(0, 255, size=(12, 28, 28)).astype(np.uint8)
    np.savez(tmp_path / "device.npz", x=x, y=np.arange(12) % 10)
    data = load_local_dataset(str(tmp_path / "device.npz"))
    assert data.x.shape == (12, 1, 28, 28) and len(data) == 12
    write_fake_mnist(tmp_path / "idx", compress=True)
    assert len(load_local_dataset(str(tmp_path / "idx"))) == 50
    with pytest.raises(FileNotFoundError, match="data-path"):
        load_local_dataset(str(tmp_path / "missing.npz"))


@pytest.mark.parametrize("scheme", [s for s in PARTITION_SCHEMES if s != "natural"])  # natural: users
@pytest.mark.parametrize(("clients", "rows"), [(7, 2000), (13, 5001), (40, 6000)])
def test_fast_partition_rows_equal_flower_datasets_public_path(scheme: str, clients: int, rows: int) -> None:
    """The per-client rows without one load_partition per client are exactly the public path's."""
    from datasets import Dataset

    from fl_app.data.partition import PARTITIONERS, partition_positions_fast, partition_positions_public

    labels = np.random.default_rng(rows).integers(0, 10, size=rows)
    found = []
    for path in ("public", "fast"):
        partitioner = PARTITIONERS[scheme](
            clients,
            3,
            {"alpha": 0.5, "min_partition_size": 2, "size": None, "large_clients": 2, "large_share": 0.5},
        )
        partitioner.dataset = Dataset.from_dict(
            {"label": labels.astype(np.int64), "row": np.arange(rows, dtype=np.int64)}
        )
        try:
            found.append(
                partition_positions_public(partitioner, num_partitions=clients)
                if path == "public"
                else partition_positions_fast(partitioner, num_partitions=clients, num_rows=rows)
            )
        except ValueError:  # flwr-datasets cannot split these rows this way (e.g. exponential sizes)
            pytest.skip(f"{scheme} cannot make {clients} partitions of {rows} rows")
    public, fast = found
    assert fast is not None
    assert len(fast) == clients
    assert all(np.array_equal(a, b) for a, b in zip(public, fast, strict=True))


def test_fetch_never_installs_system_packages_when_asked_not_to(monkeypatch, tmp_path):
    from fl_app.data import fetch

    calls: list[str] = []
    monkeypatch.setattr(fetch, "_apt_install", lambda package: calls.append(package) or False)
    monkeypatch.setattr(fetch, "resolve_idx_folder", _missing)
    monkeypatch.setenv(fetch.NO_SYSTEM_PACKAGES_ENV, "1")
    assert fetch.main(["fashion_mnist"]) == 0
    assert calls == []
    monkeypatch.delenv(fetch.NO_SYSTEM_PACKAGES_ENV)
    assert fetch.main(["fashion_mnist", "--no-system-packages"]) == 0
    assert calls == []
    assert fetch.main(["fashion_mnist"]) == 0
    assert calls == ["dataset-fashion-mnist"]


def _missing(name, *, data_dir, download):
    from fl_app.data.sources import DataNotFoundError

    raise DataNotFoundError(f"dataset.data_dir={data_dir}: {name} not found (test)")
