"""``dataset=hf`` ``partition=natural`` (a user per client), ``model=module:Class``.

Every data set here is built in the test, in the Hugging Face formats (a ``save_to_disk`` folder, a
parquet file), and read by the real loader; nothing downloads (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
from flwr_datasets.partitioner import NaturalIdPartitioner
from PIL import Image
from torch import nn

from fl_app.data import hf as hf_module
from fl_app.data.federated import DataSpec, build_federated_data
from fl_app.data.hf import HFSource, load_hf_dataset
from fl_app.data.natural import group_rows, natural_split
from fl_app.data.sources import DataFileError, DataNotFoundError
from fl_app.learning.models import check_model_fits
from tests.conftest import FAST, INLINE
from tests.test_reliability import assert_one_line, preflight_cli

ROOT = Path(__file__).resolve().parents[1]
#: Users and their row counts (sizes as they come: unequal).
USERS = {"w_anna": 9, "w_ben": 5, "w_cleo": 12, "w_dan": 7, "w_eve": 6, "w_finn": 8, "w_gus": 4, "w_hal": 10}
SIDE = 8


class TinyNet(nn.Module):
    """A user's own network (``model=tests.test_hf_data:TinyNet``): one linear layer."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits."""
        return self.net(x)


class WrongWidth(nn.Module):
    """A network with three outputs whatever the data's classes (refused at validation)."""

    def __init__(self, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        del num_classes
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(input_shape)), 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Three scores."""
        return self.net(x)


def make_rows(seed: int = 0, *, rgb: bool = False) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Images (class-dependent 8x8 patterns plus noise), labels 0..3 and each row's user."""
    rng = np.random.default_rng(seed)
    writers = [name for name, count in USERS.items() for _ in range(count)]
    labels = rng.integers(0, 4, size=len(writers))
    patterns = rng.integers(0, 256, size=(4, SIDE, SIDE))
    noise = rng.integers(-30, 31, size=(len(writers), SIDE, SIDE))
    images = np.clip(patterns[labels] + noise, 0, 255).astype(np.uint8)
    if rgb:
        images = np.stack([images, 255 - images, images // 2], axis=-1)
    return images, labels, writers


def make_dataset(seed: int = 0, *, rgb: bool = False) -> datasets.Dataset:
    """A Hugging Face data set: an Image column (PIL), a ClassLabel column and a writer id column."""
    images, labels, writers = make_rows(seed, rgb=rgb)
    features = datasets.Features(
        {
            "image": datasets.Image(),
            "character": datasets.ClassLabel(names=["a", "b", "c", "d"]),
            "writer_id": datasets.Value("string"),
            "note": datasets.Value("string"),
        }
    )
    return datasets.Dataset.from_dict(
        {
            "image": [Image.fromarray(image) for image in images],
            "character": labels.tolist(),
            "writer_id": writers,
            "note": ["x"] * len(writers),
        },
        features=features,
    )


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The dpfl cache and the Hugging Face cache in ``tmp_path``; the hub offline."""
    monkeypatch.setenv("DPFL_DATA_HOME", str(tmp_path / "dpfl"))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))  # subprocesses
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")  # read at import
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


@pytest.fixture
def saved(hf_home: Path) -> Path:
    """A ``save_to_disk`` folder of :func:`make_dataset` (one saved Dataset: a train split only)."""
    folder = hf_home / "femnist_like"
    make_dataset().save_to_disk(str(folder))
    return folder


def source(path: Path | str, *, group_column: str | None = "writer_id", **options: object) -> HFSource:
    """The :class:`HFSource` of ``path`` with FEMNIST's column names."""
    return HFSource.from_options(
        {"path": str(path), "label_column": "character", **options}, group_column=group_column
    )


# --------------------------------------------------------------------------- the loader


def test_a_saved_folder_becomes_channel_first_arrays_with_users(saved):
    images, labels, writers = make_rows()
    data = load_hf_dataset(source(saved), seed=3)
    assert data.x_train.dtype == np.uint8 and data.x_train.shape[1:] == (1, SIDE, SIDE)
    assert data.num_classes == 4 and data.input_shape == (1, SIDE, SIDE)
    # no test split: a seeded fifth of the users (round(0.2 * 8) = 2), whole, is the test split
    assert len(data.y_train) + len(data.y_test) == len(labels)
    names = sorted(USERS)
    train_users = {names[code] for code in np.unique(data.groups_train)}
    assert len(train_users) == len(USERS) - 2
    test_rows = [i for i, w in enumerate(writers) if w not in train_users]
    train_rows = [i for i, w in enumerate(writers) if w in train_users]
    np.testing.assert_array_equal(data.x_train[:, 0], images[train_rows])
    np.testing.assert_array_equal(data.y_train, labels[train_rows])
    np.testing.assert_array_equal(data.x_test[:, 0], images[test_rows])
    assert [names[code] for code in data.groups_train] == [writers[i] for i in train_rows]


def test_rgb_parquet_with_a_test_split_and_array_columns(hf_home):
    images, labels, _ = make_rows(rgb=True)
    both = datasets.DatasetDict({"train": make_dataset(rgb=True), "test": make_dataset(seed=1, rgb=True)})
    both.save_to_disk(str(hf_home / "both"))
    data = load_hf_dataset(source(hf_home / "both", group_column=None), seed=0)
    assert data.x_train.shape == (len(labels), 3, SIDE, SIDE)  # RGB -> 3xHxW, every train row kept
    np.testing.assert_array_equal(data.x_train, images.transpose(0, 3, 1, 2))
    assert len(data.y_test) == len(labels) and data.groups_train is None
    datasets.DatasetDict({"train": make_dataset(rgb=True), "test": make_dataset()}).save_to_disk(
        str(hf_home / "mixed")
    )
    with pytest.raises(DataFileError, match=r"dataset.test_split='test': examples of shape \(1, 8, 8\), but"):
        load_hf_dataset(source(hf_home / "mixed", group_column=None), seed=0)
    make_dataset(rgb=True).to_parquet(str(hf_home / "rows.parquet"))
    from_parquet = load_hf_dataset(source(hf_home / "rows.parquet"), seed=3)
    assert from_parquet.x_train.shape[1:] == (3, SIDE, SIDE) and len(from_parquet.y_test) > 0
    floats = datasets.Dataset.from_dict(
        {"pixels": (images[..., 0] / 255.0).astype(np.float32).tolist(), "label": labels.tolist()},
        features=datasets.Features(
            {
                "pixels": datasets.Array2D(shape=(SIDE, SIDE), dtype="float32"),
                "label": datasets.Value("int64"),
            }
        ),
    )
    floats.save_to_disk(str(hf_home / "floats"))
    arrays = load_hf_dataset(
        HFSource.from_options({"path": str(hf_home / "floats"), "image_column": "pixels"}), seed=0
    )
    assert arrays.x_train.dtype == np.float32 and arrays.x_train.shape[1:] == (1, SIDE, SIDE)
    assert arrays.x_train.min() >= 0.0 and arrays.x_train.max() <= 1.0 and arrays.num_classes == 4
    integers = datasets.Dataset.from_dict(
        {"pixels": images[..., 0].astype(np.int64).tolist(), "label": labels.tolist()},
        features=datasets.Features(
            {"pixels": datasets.List(datasets.List(datasets.Value("int64"))), "label": datasets.ClassLabel(4)}
        ),
    )
    integers.save_to_disk(str(hf_home / "integers"))
    as_lists = load_hf_dataset(
        HFSource.from_options({"path": str(hf_home / "integers"), "image_column": "pixels"}), seed=0
    )
    assert as_lists.x_train.dtype == np.uint8  # 8-bit pixels in wider integers: scaled in training


def test_the_second_run_reads_the_cache_and_a_changed_file_is_converted_again(saved, monkeypatch):
    plain = load_hf_dataset(source(saved, group_column=None), seed=3)  # a label partition's run
    assert plain.groups_train is None and len(list((saved.parent / "dpfl" / "hf").glob("*.npz"))) == 1

    def no_conversion(src: HFSource, **options: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(hf_module, "convert_source", no_conversion)
    first = load_hf_dataset(source(saved), seed=3)  # the natural partition's: the users' column only
    assert len(list((saved.parent / "dpfl" / "hf").glob("*.npz"))) == 2
    codes = np.unique(make_rows()[2], return_inverse=True)[1]  # every row's writer, as sorted codes
    np.testing.assert_array_equal(first.groups_train, codes[np.isin(codes, first.groups_train)])
    again = load_hf_dataset(source(saved), seed=3)
    np.testing.assert_array_equal(first.x_train, again.x_train)
    np.testing.assert_array_equal(first.groups_train, again.groups_train)
    arrow = next(saved.glob("*.arrow"))
    os.utime(arrow, ns=(arrow.stat().st_atime_ns, arrow.stat().st_mtime_ns + 10**9))
    with pytest.raises(AssertionError, match="converted again"):
        load_hf_dataset(source(saved), seed=3)


def test_a_hub_data_set_is_converted_once_and_read_offline_from_the_cache(hf_home, monkeypatch):
    """The hub path (``datasets.load_dataset(name, split=...)``, stubbed: nothing downloads)."""
    calls: list[tuple[str, str]] = []

    def hub(path: str, *, split: str, revision: str | None) -> datasets.Dataset:
        calls.append((path, split))
        if split != "train":
            raise ValueError(f"Unknown split \"{split}\". Should be one of ['train'].")
        return make_dataset()

    monkeypatch.setattr(datasets, "load_dataset", hub)
    first = load_hf_dataset(source("flwrlabs/femnist"), seed=3)
    assert calls == [("flwrlabs/femnist", "train"), ("flwrlabs/femnist", "test")]

    def offline(*args: object, **kwargs: object) -> None:
        raise ConnectionError("Couldn't reach 'flwrlabs/femnist' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    again = load_hf_dataset(source("flwrlabs/femnist"), seed=3)  # a second run: the dpfl cache only
    np.testing.assert_array_equal(first.x_train, again.x_train)
    np.testing.assert_array_equal(first.y_test, again.y_test)
    with pytest.raises(DataNotFoundError) as error:  # another revision is not in the cache
        load_hf_dataset(source("flwrlabs/femnist", revision="v2"), seed=3)
    assert str(error.value).startswith("dataset.path='flwrlabs/femnist': not a local folder or file")
    assert "OfflineModeIsEnabled" in str(error.value) and "save_to_disk" in str(error.value)


def test_missing_or_mistyped_columns_and_missing_data_are_one_line(saved, hf_home):
    with pytest.raises(DataFileError) as missing:
        load_hf_dataset(source(saved, image_column="img"), seed=0)
    text = str(missing.value)
    assert text.startswith("dataset.image_column='img': no such column") and "\n" not in text
    assert "image (Image)" in text and "writer_id (string)" in text and "character (ClassLabel(4))" in text
    with pytest.raises(DataFileError, match=r"dataset.label_column='note': is string, not class labels"):
        load_hf_dataset(source(saved, label_column="note"), seed=0)
    with pytest.raises(DataFileError, match=r"dataset.image_column='note': is string, not images"):
        load_hf_dataset(source(saved, image_column="note"), seed=0)
    with pytest.raises(DataFileError, match=r"partition.column='user': no such column"):
        load_hf_dataset(source(saved, group_column="user"), seed=0)
    with pytest.raises(DataNotFoundError, match=r"dataset.test_split='valid': .* one split"):
        load_hf_dataset(source(saved, test_split="valid"), seed=0)
    sizes = datasets.Dataset.from_dict(
        {"image": [Image.new("L", (8, 8)), Image.new("L", (9, 8))], "label": [0, 1]},
        features=datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")}),
    )
    sizes.save_to_disk(str(hf_home / "sizes"))
    with pytest.raises(DataFileError, match=r"row 1 is an image of shape \(8, 9\), row 0 of \(8, 8\)"):
        load_hf_dataset(HFSource.from_options({"path": str(hf_home / "sizes")}), seed=0)


def integer_labels(folder: Path, labels: list[int], *, declared: int | None = None) -> Path:
    """A ``save_to_disk`` folder of 8x8 images and ``labels`` in a ``label`` column.

    ``declared``: a ``ClassLabel`` of that many classes; None: a plain ``int64`` column, which declares none.
    """
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, size=(len(labels), SIDE, SIDE)).astype(np.uint8)
    label = datasets.Value("int64") if declared is None else datasets.ClassLabel(declared)
    datasets.Dataset.from_dict(
        {"image": [Image.fromarray(image) for image in pixels], "label": labels},
        features=datasets.Features({"image": datasets.Image(), "label": label}),
    ).save_to_disk(str(folder))
    return folder


#: Labels 0..9 (twice each) and a stray 99: an integer column with a gap.
GAP_LABELS = [*range(10), *range(10), 99, 99]


def test_the_number_of_classes_is_declared_never_inferred_from_a_gap(hf_home):
    gap = integer_labels(hf_home / "gap", GAP_LABELS)
    with pytest.raises(DataFileError) as refused:
        load_hf_dataset(HFSource.from_options({"path": str(gap)}), seed=0)
    text = str(refused.value)
    assert "\n" not in text and text.startswith("dataset.label_column='label': integer labels 0..9, 99")
    assert "set dataset.num_classes=100 if the data set has 100 classes" in text
    assert not list((hf_home / "dpfl" / "hf").glob("*.npz"))  # refused before converting: nothing kept
    assert (
        load_hf_dataset(HFSource.from_options({"path": str(gap)}), seed=0, num_classes=100).num_classes == 100
    )
    with pytest.raises(DataFileError, match=r"dataset.num_classes=50: .* holds the label 99; .*=100 or more"):
        load_hf_dataset(HFSource.from_options({"path": str(gap)}), seed=0, num_classes=50)  # from the cache
    dense = integer_labels(hf_home / "dense", [*range(10), *range(10)])
    assert load_hf_dataset(HFSource.from_options({"path": str(dense)}), seed=0).num_classes == 10
    # a ClassLabel declares its classes, those no row has included; dataset.num_classes must agree
    declared = integer_labels(hf_home / "declared", [*range(10), *range(10)], declared=12)
    assert load_hf_dataset(HFSource.from_options({"path": str(declared)}), seed=0).num_classes == 12
    with pytest.raises(DataFileError, match=r"dataset.num_classes=10: .* ClassLabel of 12 classes"):
        load_hf_dataset(HFSource.from_options({"path": str(declared)}), seed=0, num_classes=10)


def test_a_gap_in_the_labels_and_a_missing_path_are_one_line_before_anything_starts(hf_home):
    gap = integer_labels(hf_home / "gap", GAP_LABELS)
    command = [
        *FAST,
        "dataset=hf",
        f"dataset.path={gap}",
        "partition=iid",
        "num_clients=2",
        "clients_per_round=2",
    ]
    refused = preflight_cli(*command, cwd=hf_home)
    assert_one_line(refused, "dataset.label_column='label'", "0..9, 99", "dataset.num_classes=100")
    assert "converting" not in refused.stdout and not (hf_home / "dpfl" / "hf").exists()
    assert_one_line(
        preflight_cli(*command, "dataset.num_classes=1.5", cwd=hf_home),
        "dataset.num_classes=1.5: must be an integer >= 2",
    )
    declared = preflight_cli(
        *command, "dataset.num_classes=100", "model=tests.test_hf_data:WrongWidth", cwd=hf_home
    )
    assert_one_line(declared, "(1, 100)")  # validation's forward pass: 100 classes, as declared
    assert "converting it to arrays, once" in declared.stdout
    missing = hf_home / "no_such_folder"
    gone = preflight_cli(*FAST, "dataset=hf", f"dataset.path={missing}", "partition=iid", cwd=hf_home)
    assert_one_line(
        gone, f"dataset.path='{missing}': {missing} does not exist; set dataset.path to an existing"
    )
    assert "online" not in gone.stderr and "converting" not in gone.stdout
    assert_one_line(
        preflight_cli(*FAST, "dataset=hf", f"dataset.path={missing}/*.parquet", "partition=iid", cwd=hf_home),
        "*.parquet matches no file",
    )


# --------------------------------------------------------------------------- the natural partition


def test_grouping_agrees_with_flwr_datasets_natural_id_partitioner():
    writers = make_rows()[2]
    ids, rows = group_rows(np.unique(writers, return_inverse=True)[1])
    partitioner = NaturalIdPartitioner(partition_by="writer_id")
    partitioner.dataset = datasets.Dataset.from_dict({"writer_id": writers, "row": list(range(len(writers)))})
    theirs = {tuple(sorted(partitioner.load_partition(i)["row"])) for i in range(partitioner.num_partitions)}
    assert {tuple(r.tolist()) for r in rows} == theirs and len(ids) == len(USERS)


def test_natural_split_keeps_users_whole_and_public_users_apart():
    groups = np.repeat(np.arange(10), [3, 5, 2, 8, 4, 6, 1, 7, 5, 9])
    public, clients, validation = natural_split(
        groups, num_clients=5, public_fraction=0.1, validation_fraction=0.1, seed=4
    )
    assert len(clients) == 5
    client_users = [set(groups[rows]) for rows in clients]
    assert all(len(users) == 1 for users in client_users)  # one user per client...
    for rows, users in zip(clients, client_users, strict=True):  # ...with every row of that user
        assert set(rows) == set(np.flatnonzero(groups == next(iter(users))))
    clients_users = set().union(*client_users)
    assert not clients_users & set(groups[public]) and not clients_users & set(groups[validation])
    assert not set(groups[public]) & set(groups[validation])
    assert len(public) >= 5 and len(validation) >= 5  # round(0.1 * 50) rows each, whole users
    with pytest.raises(
        ValueError, match="has 10 distinct users in the training split, fewer than num_clients=12"
    ):
        natural_split(groups, num_clients=12, public_fraction=0.0, validation_fraction=0.0, seed=0)
    with pytest.raises(ValueError, match=r"dataset.public_fraction=0.3 asks for 15 rows"):
        natural_split(groups, num_clients=9, public_fraction=0.3, validation_fraction=0.0, seed=0)


def test_hf_data_works_with_the_label_skew_partitions_and_auto_models(saved):
    for partition in ({"name": "iid"}, {"name": "dirichlet", "alpha": 1.0, "min_partition_size": 1}):
        spec = DataSpec({"name": "hf", "path": str(saved), "label_column": "character"}, partition, 3, 0)
        data = build_federated_data(spec)
        assert sum(data.client_sizes()) == len(data.arrays.y_train) and not data.natural
        check_model_fits("mlp", data.arrays.x_train[:1], data.num_classes)
    check_model_fits("tests.test_hf_data:TinyNet", data.arrays.x_train[:1], data.num_classes)
    with pytest.raises(ValueError, match=r"gives \(1, 3\) .* must give class logits of shape \(1, 4\)"):
        check_model_fits("tests.test_hf_data:WrongWidth", data.arrays.x_train[:1], data.num_classes)


def test_a_device_builds_a_users_network_only_from_a_module_its_operator_allowed(monkeypatch):
    from clients.node import check_device_model

    monkeypatch.delenv("DPFL_PLUGINS", raising=False)
    check_device_model("cnn")
    check_device_model("tests.test_hf_data:TinyNet")  # the app's own packages
    with pytest.raises(ValueError, match=r"model='my_lab.nets:Net': .* DPFL_PLUGINS=my_lab.nets to allow"):
        check_device_model("my_lab.nets:Net")
    monkeypatch.setenv("DPFL_PLUGINS", "my_lab.nets")
    check_device_model("my_lab.nets:Net")


# --------------------------------------------------------------------------- refusals on the command line


def hf_args(path: Path, *extra: str) -> list[str]:
    """A command on the saved data set, natural partition by writer."""
    return [
        *FAST,
        "dataset=hf",
        f"dataset.path={path}",
        "dataset.label_column=character",
        "partition=natural",
        "partition.column=writer_id",
        "num_clients=4",
        "clients_per_round=2",
        *extra,
    ]


def test_bad_columns_users_and_models_are_one_line_before_anything_starts(saved, hf_home):
    cases = [
        (["dataset.image_column=img"], ["dataset.image_column='img': no such column", "writer_id (string)"]),
        (["partition.column=user"], ["partition.column='user': no such column", "character (ClassLabel(4))"]),
        (["num_clients=7"], ["num_clients=7", "6 distinct users", "fewer than num_clients=7"]),
        (["model=tests.test_hf_data:WrongWidth"], ["model='tests.test_hf_data:WrongWidth'", "(1, 4)"]),
        (["model=no_such_module:Net"], ["model='no_such_module:Net': cannot import no_such_module"]),
    ]
    outputs = []
    for extra, fragments in cases:
        result = preflight_cli(*hf_args(saved, *extra), cwd=hf_home)
        assert_one_line(result, *fragments)
        outputs.append(result.stdout)
    assert "converting" not in outputs[0] + outputs[1]  # refused before converting: no line, no file
    assert "converting it to arrays, once" in outputs[2]  # the first conversion says so; its file is kept
    assert Path(outputs[2].split("later runs read ")[1].strip()).is_file()
    again = preflight_cli(*hf_args(saved, "model=tests.test_hf_data:WrongWidth"), cwd=hf_home)
    assert_one_line(again, "(1, 4)")
    assert "converting" not in again.stdout  # the same data set again: read from the dpfl cache
    assert_one_line(
        preflight_cli(*FAST, "partition=natural", "partition.column=w", cwd=hf_home),
        "partition.name='natural': needs a data set with a user column: dataset=hf",
    )
    assert not (hf_home / "outputs").exists()


@pytest.mark.subprocess
def test_an_unreachable_hub_data_set_is_one_line_naming_where_dpfl_looked(hf_home):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fl_app",
            *FAST,
            "dataset=femnist",
            "partition=natural",
            "partition.column=writer_id",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=hf_home,
        env=env,
    )
    assert_one_line(
        result,
        "dataset.path='flwrlabs/femnist': not a local folder or file",
        str(hf_home / "dpfl" / "hf"),
        "the hub failed (ConnectionError",
        "save_to_disk",
    )
    assert not (hf_home / "outputs").exists()


# --------------------------------------------------------------------------- one short real run


def test_dp_fedavg_on_natural_users_trains_each_client_on_one_users_rows(saved, hf_home, simulate):
    overrides = hf_args(
        saved,
        "strategy=dp_fedavg",
        "strategy.sampling=fixed",
        "model=tests.test_hf_data:TinyNet",
        "privacy.epsilon=8",
        "num_rounds=2",
        INLINE,
    )
    results = simulate(overrides)  # inline: the clients see this process's DPFL_DATA_HOME and HF_HUB_OFFLINE
    assert results["status"] == "completed" and len(results["rounds"]) == 2
    assert results["dataset"] == f"hf:{saved}" and results["partition"] == "natural(column=writer_id)"
    assert results["client"].startswith("one user: every training row of one writer_id")
    assert "epsilon per client is an epsilon per user" in results["client"]
    assert results["final"]["epsilon"] is not None and results["final"]["epsilon"] <= 8.0 + 1e-9
    from fl_app.config.compose import compose_config
    from fl_app.config.settings import RunSettings

    data = build_federated_data(RunSettings.from_config(compose_config(overrides)).data)
    assert data.natural and len(data.client_rows) == 4
    groups = data.arrays.groups_train
    for rows in data.client_rows:  # exactly one user's rows, all of them
        (user,) = set(groups[rows].tolist())
        np.testing.assert_array_equal(np.sort(rows), np.flatnonzero(groups == user))
    log = (Path(results["_output_dir"]) / "run.log").read_text()
    assert "a client is one user" in log
    from fl_app.report.sweep import main as report

    assert report([results["_output_dir"], "--out", str(hf_home / "report")]) == 0
    table = (hf_home / "report" / "report.md").read_text()
    assert "### Privacy unit: one client's entire data set" in table
    assert "a client is one user (partition=natural)" in table
