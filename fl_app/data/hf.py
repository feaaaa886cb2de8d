"""Any Hugging Face data set (``dataset=hf``) as the numpy arrays dpfl trains on.

``dataset.path`` names the data set: a hub name (``flwrlabs/femnist``, loaded with
``datasets.load_dataset``, which needs the machine online the first time or a copy in the Hugging
Face cache), a folder written by ``save_to_disk`` (``datasets.load_from_disk``), a parquet file, a
glob of parquet files, or a folder of data files (``load_dataset(<folder>)``, splits by file names).

The split ``dataset.split`` is converted once to arrays: images ``(n, C, H, W)`` (grayscale PIL
images give ``1xHxW``, RGB ``3xHxW``; array columns ``HxW``, ``HxWxC`` or ``CxHxW``), kept as
``uint8`` when the source is 8-bit, integer arrays in 0..255 included (training scales them by 1/255
to [0, 1], as for MNIST), else ``float32`` as they are; labels ``int64`` from a ``ClassLabel`` or
integer column; and, for a natural partition, the id column (``partition.column``) as ``int64``
codes of its sorted distinct values.

The number of classes is the one the data set declares: a ``ClassLabel``'s size, or
``dataset.num_classes`` for an integer column. An integer column without ``dataset.num_classes`` gives
``k`` classes when its labels are exactly ``0..k-1``; labels with a gap (``0..9`` and ``99``) are
refused in one line (they would silently make a 100-class model) that says to declare the number.
The test split is ``dataset.test_split`` (null: ``test`` when the data set has one); without one,
a seeded ``dataset.test_fraction`` of the rows is held out (whole ids when there is an id column,
so that test users are never clients).

The converted arrays are cached in ``$DPFL_DATA_HOME/hf/<key>.npz`` (the users' codes beside them,
``<key>.users-<column>.npz``, so that a natural and a label partition share the arrays), keyed by
the path, revision, splits, image and label columns and a fingerprint of the files (a local path:
every file's name, size and modification time; a hub name: the name and ``dataset.revision``), so
a second run, in any process, reads numpy files and touches neither ``datasets`` nor the hub. A hub
data set changed upstream is picked up with another ``dataset.revision`` (or by deleting the cache
file).

Every problem is one line naming the key (:class:`DataNotFoundError`, :class:`DataFileError`), found
before the conversion starts where it can be (splits, columns, labels): the line saying that a data set
is converted (and where its arrays will be kept) is printed only then.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from fl_app.data.partition_cache import write_npz
from fl_app.data.sources import ArrayDataset, DataFileError, DataNotFoundError, data_home

#: Bump when the conversion changes: cached arrays of another version are not read.
CONVERTER_VERSION = 3
#: Files whose presence marks a ``save_to_disk`` folder.
SAVED_MARKERS = ("dataset_dict.json", "state.json")
#: Rows decoded per batch (bounds the memory of the Python objects of one batch).
BATCH_ROWS = 8192
HOW_TO_PROVIDE = (
    "run once on a machine that is online (the converted arrays are then kept in the dpfl cache), "
    "or save the data set with datasets' save_to_disk (or as parquet files) and set "
    "dataset.path=<that folder or file>"
)
#: What ``dataset.path`` may name on this machine (said when a path names nothing).
LOCAL_FORMS = (
    "set dataset.path to an existing save_to_disk folder, parquet file (or glob of them) or folder of "
    "data files, or to a hub name (user/data_set)"
)


@dataclass(frozen=True)
class HFSource:
    """Which Hugging Face data set, split and columns (the ``dataset`` group of ``dataset=hf``).

    ``group_column`` is the natural partition's id column (``partition.column``), kept per row;
    None when the partition does not need one.
    """

    path: str
    split: str
    test_split: str | None
    test_fraction: float
    image_column: str
    label_column: str
    group_column: str | None = None
    revision: str | None = None

    @classmethod
    def from_options(cls, options: Mapping[str, Any], *, group_column: str | None = None) -> HFSource:
        """Read the ``dataset`` group (validated) and the partition's id column."""
        test_split = options.get("test_split")
        revision = options.get("revision")
        return cls(
            path=str(options["path"]),
            split=str(options.get("split", "train")),
            test_split=None if test_split is None else str(test_split),
            test_fraction=float(options.get("test_fraction", 0.2)),
            image_column=str(options.get("image_column", "image")),
            label_column=str(options.get("label_column", "label")),
            group_column=group_column,
            revision=None if revision is None else str(revision),
        )

    def local_path(self) -> Path | None:
        """The local file, folder or glob ``path`` names, or None (then it is a hub name)."""
        path = Path(self.path).expanduser()
        if path.exists():
            return path
        if any(ch in self.path for ch in "*?[") and any(path.parent.glob(path.name)):
            return path
        return None


@dataclass(frozen=True)
class Converted:
    """One converted split: images, labels, id codes (or None) and the classes its label column declares.

    ``declared_classes``: a ``ClassLabel``'s size; 0 for an integer column, which declares none.
    """

    x: np.ndarray
    y: np.ndarray
    groups: np.ndarray | None
    declared_classes: int


def cache_folder() -> Path:
    """Where converted data sets are kept: ``$DPFL_DATA_HOME/hf``."""
    return data_home() / "hf"


def fingerprint(source: HFSource) -> str:
    """What identifies the data behind ``source.path``: its files' names, sizes and times, or the hub name."""
    local = source.local_path()
    if local is None:
        return f"hub:{source.path}@{source.revision or 'main'}"
    if local.is_file():
        files = [local]
    elif local.is_dir():
        files = sorted(p for p in local.rglob("*") if p.is_file())
    else:
        files = sorted(p for p in local.parent.glob(local.name) if p.is_file())
    digest = hashlib.sha256(str(local.resolve()).encode())
    for file in files:
        digest.update(f"{file_stamp(file)}\n".encode())
    return f"local:{digest.hexdigest()}"


def file_stamp(file: Path) -> str:
    """A file's resolved path, size and modification time: what tells a changed file from its cache."""
    stat = file.stat()
    return f"{file.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"


def cache_key(source: HFSource) -> str:
    """The cache file's name: the source (path, splits, columns) and :func:`fingerprint`."""
    fields = {**asdict(source), "fingerprint": fingerprint(source), "version": CONVERTER_VERSION}
    del fields["test_fraction"]  # the hold-out is drawn after the cache (it depends on the seed)
    del fields["group_column"]  # the users' column is cached beside (:func:`groups_path`)
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:32]


def cache_path(source: HFSource) -> Path:
    """The file the converted arrays of ``source`` are (or will be) kept in."""
    return cache_folder() / f"{cache_key(source)}.npz"


def groups_path(source: HFSource) -> Path:
    """The file of the users' codes (``source.group_column``) of the training split, beside the arrays.

    Apart from the arrays: a natural partition and a label partition of one data set share them.
    """
    column = hashlib.sha256(str(source.group_column).encode()).hexdigest()[:12]
    return cache_folder() / f"{cache_key(source)}.users-{column}.npz"


def load_hf_dataset(source: HFSource, *, seed: int, num_classes: int | None = None) -> ArrayDataset:
    """The train and test arrays of ``source`` (from the cache, else loaded, converted and cached).

    ``num_classes``: ``dataset.num_classes``, the number of classes of an integer label column (None:
    a ``ClassLabel`` declares it, or the labels are exactly ``0..k-1``; :func:`class_count`).

    Raises
    ------
    DataNotFoundError
        The data set is neither local nor reachable (one line: ``dataset.path``, where dpfl looked,
        how to provide it), or a split does not exist.
    DataFileError
        A column is missing or of the wrong type, the labels declare no number of classes, or the
        images disagree in shape (one line naming the key, the column and the columns that exist).

    """
    splits = read_cache(cache_path(source))
    if splits is None:
        splits = convert_source(source, num_classes=num_classes)
        write_cache(cache_path(source), splits)
        if splits[0].groups is not None:
            write_npz(groups_path(source), {"groups": splits[0].groups})
    elif source.group_column is not None:
        splits = (replace(splits[0], groups=cached_groups(source, rows=len(splits[0].y))), splits[1])
    train, test = splits
    labels = [train.y] if test is None else [train.y, test.y]
    classes = class_count(source.label_column, train.declared_classes, labels, num_classes)
    if test is None:
        train, test = hold_out_test(train, fraction=source.test_fraction, seed=seed)
    return ArrayDataset("hf", train.x, train.y, test.x, test.y, classes, groups_train=train.groups)


def class_count(column: str, declared: int, labels: list[np.ndarray], num_classes: int | None) -> int:
    """The number of classes of the label column ``column`` (labels ``>= 0``).

    ``declared``: its ``ClassLabel``'s size (0: an integer column); ``labels``: every split's;
    ``num_classes``: ``dataset.num_classes`` (None: not set). An integer column without it counts
    ``k`` classes when its labels are exactly ``0..k-1``: a gap is refused, never a class of its own.

    Raises
    ------
    DataFileError
        One line naming the key, the value and what to set.

    """
    values = np.unique(np.concatenate(labels)) if labels else np.zeros(0, dtype=np.int64)
    top = int(values[-1]) if values.size else -1
    if declared:
        if num_classes is not None and num_classes != declared:
            raise DataFileError(
                f"dataset.num_classes={num_classes}: the label column {column!r} is a ClassLabel of "
                f"{declared} classes, which declares the number; leave dataset.num_classes null"
            )
        if top >= declared:
            raise DataFileError(
                f"dataset.label_column={column!r}: holds the label {top}, but its ClassLabel declares "
                f"{declared} classes (0..{declared - 1}); fix the data set's labels"
            )
        return declared
    if num_classes is not None:
        if top >= num_classes:
            raise DataFileError(
                f"dataset.num_classes={num_classes}: the label column {column!r} holds the label {top}; "
                f"labels must be 0..{num_classes - 1}: set dataset.num_classes={top + 1} or more"
            )
        return num_classes
    if values.size == top + 1:  # exactly 0..top
        return top + 1
    raise DataFileError(
        f"dataset.label_column={column!r}: integer labels {spans(values)} ({values.size} distinct) "
        f"declare no number of classes, and the label {top} would make a model of {top + 1} classes, "
        f"{top + 1 - values.size} of them never seen; set dataset.num_classes={top + 1} if the data set "
        f"has {top + 1} classes, or relabel the column to 0..{values.size - 1} (or make it a ClassLabel)"
    )


def spans(values: np.ndarray, *, shown: int = 4) -> str:
    """Sorted distinct integers as runs: ``0..9, 99`` (the first ``shown`` runs, then how many more)."""
    breaks = np.flatnonzero(np.diff(values) != 1) + 1
    parts = [run for run in np.split(values, breaks) if len(run)]
    runs = [f"{run[0]}..{run[-1]}" if len(run) > 1 else str(run[0]) for run in parts]
    more = f" and {len(runs) - shown} more runs" if len(runs) > shown else ""
    return ", ".join(runs[:shown]) + more


def cached_groups(source: HFSource, *, rows: int) -> np.ndarray:
    """The users' codes of the training split: from the cache, else read from the id column alone."""
    path = groups_path(source)
    with contextlib.suppress(OSError, KeyError, ValueError), np.load(path, allow_pickle=False) as stored:
        if len(stored["groups"]) == rows:
            return stored["groups"]
    with quiet_datasets():
        dataset = open_split(source, source.split, key="dataset.split")
        if source.group_column not in dataset.features:
            raise column_error("partition.column", str(source.group_column), dataset, "no such column")
        groups = convert_groups(dataset, str(source.group_column))
    write_npz(path, {"groups": groups})
    return groups


def convert_source(source: HFSource, *, num_classes: int | None = None) -> tuple[Converted, Converted | None]:
    """Load ``source``'s train split (and its test split, if any) with ``datasets`` and convert them.

    The splits, their columns and their labels (:func:`class_count`, with ``num_classes``) are checked
    first; then :func:`announce_conversion` says that the conversion starts, and the images are decoded.
    """
    with quiet_datasets():
        train_set, test_set = open_splits(source)
        sets = [train_set] if test_set is None else [train_set, test_set]
        for dataset, group_column in zip(sets, (source.group_column, None), strict=False):
            check_columns(dataset, source, group_column=group_column)
        labels = [convert_labels(dataset, source.label_column) for dataset in sets]
        declared = max(classes for _, classes in labels)
        class_count(source.label_column, declared, [y for y, _ in labels], num_classes)
        announce_conversion(source)
        train = convert_split(train_set, source, labels[0][0], declared, group_column=source.group_column)
        test = None
        if test_set is not None:
            test = convert_split(test_set, source, labels[1][0], declared, group_column=None)
    if test is not None and test.x.shape[1:] != train.x.shape[1:]:
        raise DataFileError(
            f"dataset.test_split={source.test_split or 'test'!r}: examples of shape {test.x.shape[1:]}, "
            f"but the training split's are {train.x.shape[1:]}; one network cannot take both"
        )
    return train, test


def open_splits(source: HFSource) -> tuple[Any, Any | None]:
    """The training split of ``source`` and its test split (None: none, a share is held out)."""
    train_set = open_split(source, source.split, key="dataset.split")
    test_set = None
    if source.test_split is not None:
        test_set = open_split(source, source.test_split, key="dataset.test_split")
    elif source.split != "test":
        with contextlib.suppress(DataNotFoundError):
            test_set = open_split(source, "test", key="dataset.test_split")
    return train_set, test_set


def announce_conversion(source: HFSource) -> None:
    """Say on stdout that ``source`` is converted now, once (its checks passed): then read from the cache."""
    print(
        f"dpfl: reading {source.path} ({source.split}) with datasets and converting it to arrays, once: "
        f"later runs read {cache_path(source)}",
        flush=True,
    )


@contextlib.contextmanager
def quiet_datasets() -> Iterator[None]:
    """No progress bars, warnings or error logs from ``datasets`` and the hub (errors are dpfl's one line)."""
    import datasets

    bars = datasets.utils.logging.is_progress_bar_enabled()
    datasets.utils.logging.disable_progress_bar()
    loggers = [logging.getLogger(name) for name in ("datasets", "huggingface_hub", "fsspec")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)
        if bars:
            datasets.utils.logging.enable_progress_bar()


def open_split(source: HFSource, split: str, *, key: str, cache: Path | None = None) -> Any:
    """The ``datasets.Dataset`` of ``split`` (raises :class:`DataNotFoundError` naming ``key``).

    ``cache``: the dpfl cache the caller keeps its conversion in (:func:`hub_split`).
    """
    import datasets

    local = source.local_path()
    if local is not None and local.is_dir() and any((local / m).is_file() for m in SAVED_MARKERS):
        try:
            loaded = datasets.load_from_disk(str(local))
        except (OSError, ValueError) as error:
            raise DataFileError(
                f"dataset.path={source.path!r}: a save_to_disk folder that datasets cannot read "
                f"({first_line(error)}); save it again"
            ) from None
        if isinstance(loaded, datasets.Dataset):  # one saved split: it is the training split
            if split == source.split:
                return loaded
            raise DataNotFoundError(f"{key}={split!r}: {source.path} holds one split (a saved Dataset)")
        return pick_split(loaded, split, key=key, where=source.path)
    if local is not None:
        parquet = local.is_file() or not local.is_dir()
        loader = ("parquet",) if parquet else (str(local),)
        options = {"data_files": {"train": str(local)}} if parquet else {}
        try:
            loaded = datasets.load_dataset(*loader, **options)
        except (OSError, ValueError) as error:
            raise DataFileError(
                f"dataset.path={source.path!r}: datasets cannot read it ({first_line(error)}); "
                "expected a save_to_disk folder, parquet file(s) or a folder of data files"
            ) from None
        return pick_split(loaded, split, key=key, where=source.path)
    if looks_like_a_path(source.path):  # a path, not a hub name: the hub is no answer
        raise missing_path(source.path, LOCAL_FORMS)
    return hub_split(source, split, key=key, cache=cache)


def looks_like_a_path(path: str) -> bool:
    """Whether ``path`` is written as a file system path (``/``, ``./``, ``../``, ``~``), not a hub name."""
    return path.startswith(("/", "./", "../", "~"))


def missing_path(path: str, forms: str) -> DataNotFoundError:
    """The one line for a ``dataset.path`` written as a path that names nothing; ``forms``: what it may be."""
    what = "matches no file" if any(ch in path for ch in "*?[") else "does not exist"
    return DataNotFoundError(f"dataset.path={path!r}: {Path(path).expanduser()} {what}; {forms}")


def hub_split(source: HFSource, split: str, *, key: str, cache: Path | None = None) -> Any:
    """``split`` of the hub data set ``source.path`` (the Hugging Face cache first when offline).

    ``cache``: the dpfl cache its conversion is kept in (named when it cannot be loaded; default
    :func:`cache_folder`).
    """
    import datasets

    try:
        return datasets.load_dataset(source.path, split=split, revision=source.revision)
    except ValueError as error:
        if "split" in str(error).lower():
            raise DataNotFoundError(f"{key}={split!r}: {source.path} has no such split") from None
        raise DataNotFoundError(not_found(source, error, cache)) from None
    except OSError as error:  # ConnectionError (offline), FileNotFoundError (no such data set)
        raise DataNotFoundError(not_found(source, error, cache)) from None


def not_found(source: HFSource, error: BaseException, cache: Path | None = None) -> str:
    """The one line for a data set that is neither local nor loadable from the hub (``cache``: dpfl's)."""
    import datasets

    hf_cache = datasets.config.HF_DATASETS_CACHE
    dpfl_cache = cache_folder() if cache is None else cache
    return (
        f"dataset.path={source.path!r}: not a local folder or file ({Path(source.path).expanduser()}), "
        f"not in the dpfl cache ({dpfl_cache}) or the Hugging Face cache ({hf_cache}), and the hub "
        f"failed ({first_line(error)}); {HOW_TO_PROVIDE}"
    )


def first_line(error: BaseException) -> str:
    """``Type: message`` on one line, at most 200 characters."""
    return f"{type(error).__name__}: {' '.join(str(error).split())}"[:200]


def pick_split(loaded: Any, split: str, *, key: str, where: str) -> Any:
    """``loaded[split]`` of a ``DatasetDict`` (raises :class:`DataNotFoundError` naming the splits)."""
    if split not in loaded:
        raise DataNotFoundError(
            f"{key}={split!r}: {where} has no such split; it has {', '.join(sorted(loaded))}"
        )
    return loaded[split]


def column_error(key: str, column: str, dataset: Any, problem: str) -> DataFileError:
    """One line naming ``key=column``, the problem and the columns (with their types) that exist."""
    columns = ", ".join(f"{name} ({describe_feature(feature)})" for name, feature in dataset.features.items())
    return DataFileError(f"{key}={column!r}: {problem}; the columns are {columns}")


def describe_feature(feature: Any) -> str:
    """A short name of a ``datasets`` feature type (``Image``, ``ClassLabel(62)``, ``string``)."""
    import datasets

    if isinstance(feature, datasets.ClassLabel):
        return f"ClassLabel({feature.num_classes})"
    if isinstance(feature, datasets.Value):
        return str(feature.dtype)
    return type(feature).__name__


def check_columns(dataset: Any, source: HFSource, *, group_column: str | None) -> None:
    """The image, label and (if asked) id columns exist in one ``datasets.Dataset``."""
    for key, column in (
        ("dataset.image_column", source.image_column),
        ("dataset.label_column", source.label_column),
        ("partition.column", group_column),
    ):
        if column is not None and column not in dataset.features:
            raise column_error(key, column, dataset, "no such column")


def convert_split(
    dataset: Any, source: HFSource, labels: np.ndarray, declared: int, *, group_column: str | None
) -> Converted:
    """Images and (if asked) id codes of one ``datasets.Dataset``, with its converted ``labels``."""
    x = convert_images(dataset, source.image_column)
    groups = None if group_column is None else convert_groups(dataset, group_column)
    return Converted(x, labels, groups, declared)


def convert_labels(dataset: Any, column: str) -> tuple[np.ndarray, int]:
    """Integer labels (``>= 0``) and the classes the column declares (a ``ClassLabel``'s size, else 0)."""
    import datasets

    feature = dataset.features[column]
    integer = isinstance(feature, datasets.Value) and feature.dtype.startswith(("int", "uint"))
    if not isinstance(feature, datasets.ClassLabel) and not integer:
        raise column_error(
            "dataset.label_column",
            column,
            dataset,
            f"is {describe_feature(feature)}, not class labels (ClassLabel or integers)",
        )
    labels = dataset.with_format("arrow", columns=[column])[:][column].to_numpy().astype(np.int64)
    if len(labels) and labels.min() < 0:
        raise column_error("dataset.label_column", column, dataset, f"holds the label {labels.min()} (< 0)")
    return labels, int(feature.num_classes) if isinstance(feature, datasets.ClassLabel) else 0


def convert_groups(dataset: Any, column: str) -> np.ndarray:
    """The id column as ``int64`` codes of its sorted distinct values (as text)."""
    import datasets

    feature = dataset.features[column]
    if not isinstance(feature, datasets.Value | datasets.ClassLabel):
        raise column_error("partition.column", column, dataset, f"is {describe_feature(feature)}, not an id")
    values = dataset.with_format("arrow", columns=[column])[:][column].to_numpy(zero_copy_only=False)
    _, codes = np.unique(values.astype(str), return_inverse=True)
    return codes.astype(np.int64)


def convert_images(dataset: Any, column: str) -> np.ndarray:
    """The image column as ``(n, C, H, W)`` arrays (``uint8`` from 8-bit sources, else ``float32``)."""
    import datasets

    feature = dataset.features[column]
    if isinstance(feature, datasets.Image):
        images = decode_images(dataset, column)
    elif isinstance(feature, datasets.Array2D | datasets.Array3D | datasets.Sequence | datasets.List):
        parts = [batch[column] for batch in dataset.with_format("numpy", columns=[column]).iter(BATCH_ROWS)]
        try:
            images = np.concatenate([np.asarray(part) for part in parts]) if parts else np.zeros((0, 1, 1))
        except ValueError:
            raise column_error(
                "dataset.image_column", column, dataset, "holds arrays of different shapes"
            ) from None
        if images.dtype == object or images.ndim not in (3, 4):
            raise column_error(
                "dataset.image_column",
                column,
                dataset,
                f"holds arrays of shape {images.shape[1:]}, not images (HxW, HxWxC or CxHxW)",
            )
    else:
        raise column_error(
            "dataset.image_column",
            column,
            dataset,
            f"is {describe_feature(feature)}, not images (an Image column or arrays)",
        )
    return channels_first(images, dataset, column)


def decode_images(dataset: Any, column: str) -> np.ndarray:
    """Decode an ``Image`` column with PIL (grayscale stays one channel; other modes become RGB)."""
    from PIL import Image

    table = dataset.with_format("arrow", columns=[column])
    images: np.ndarray | None = None
    for start in range(0, len(dataset), BATCH_ROWS):
        cells = table[start : start + BATCH_ROWS][column].to_pylist()
        for row, cell in enumerate(cells, start=start):
            with Image.open(io.BytesIO(cell["bytes"]) if cell["bytes"] else cell["path"]) as image:
                mode = "L" if image.mode in ("1", "L", "LA", "I;16", "I", "F") else "RGB"
                pixels = np.asarray(image.convert(mode) if image.mode != mode else image)
            if images is None:  # one array for every row: no list of 100,000 small arrays
                images = np.empty((len(dataset), *pixels.shape), dtype=pixels.dtype)
            elif pixels.shape != images.shape[1:]:
                raise column_error(
                    "dataset.image_column",
                    column,
                    dataset,
                    f"row {row} is an image of shape {pixels.shape}, row 0 of {images.shape[1:]}: dpfl "
                    "needs one size (resize them first)",
                )
            images[row] = pixels
    return images if images is not None else np.zeros((0, 1, 1), dtype=np.uint8)


def channels_first(images: np.ndarray, dataset: Any, column: str) -> np.ndarray:
    """Images as ``(n, C, H, W)``: ``HxW`` -> ``1xHxW``, ``HxWxC`` (C 1 or 3) -> ``CxHxW``."""
    if images.ndim == 3:
        images = images[:, None]
    elif images.shape[-1] in (1, 3) and images.shape[1] not in (1, 3):
        images = np.transpose(images, (0, 3, 1, 2))
    wide = images.dtype != np.uint8 and np.issubdtype(images.dtype, np.integer) and images.size > 0
    if wide and images.min() >= 0 and images.max() <= 255:  # 8-bit pixels stored as wider integers
        images = images.astype(np.uint8)
    if images.dtype == np.uint8:
        return np.ascontiguousarray(images)
    if images.dtype == bool or not np.issubdtype(images.dtype, np.number):
        raise column_error("dataset.image_column", column, dataset, f"holds values of type {images.dtype}")
    images = np.ascontiguousarray(images, dtype=np.float32)
    if not np.isfinite(images).all():
        raise column_error("dataset.image_column", column, dataset, "holds NaN or infinite values")
    return images


def hold_out_test(train: Converted, *, fraction: float, seed: int) -> tuple[Converted, Converted]:
    """A seeded ``fraction`` of ``train`` as the test split (whole ids when ``train`` has ids)."""
    rng = np.random.default_rng([seed, 0x7E57])
    if train.groups is not None:
        ids = np.unique(train.groups)
        chosen = rng.permutation(ids)[: max(1, round(fraction * len(ids)))]
        test_rows = np.isin(train.groups, chosen)
    else:
        test_rows = np.zeros(len(train.y), dtype=bool)
        test_rows[rng.permutation(len(train.y))[: max(1, round(fraction * len(train.y)))]] = True

    def take(rows: np.ndarray, groups: bool) -> Converted:
        kept = train.groups[rows] if groups and train.groups is not None else None
        return Converted(train.x[rows], train.y[rows], kept, train.declared_classes)

    return take(~test_rows, True), take(test_rows, False)


def read_cache(path: Path) -> tuple[Converted, Converted | None] | None:
    """The cached splits at ``path``; None when absent or unreadable (then converted again)."""
    try:
        with np.load(path, allow_pickle=False) as stored:
            classes = int(stored["declared_classes"])
            train = Converted(stored["x_train"], stored["y_train"], None, classes)
            test = (
                Converted(stored["x_test"], stored["y_test"], None, classes) if "x_test" in stored else None
            )
    except (OSError, KeyError, ValueError):
        return None
    return train, test


def write_cache(path: Path, splits: tuple[Converted, Converted | None]) -> None:
    """Store the converted splits, without the users (:func:`groups_path` keeps those)."""
    train, test = splits
    arrays = {"x_train": train.x, "y_train": train.y, "declared_classes": np.int64(train.declared_classes)}
    if test is not None:
        arrays.update(x_test=test.x, y_test=test.y)
    write_npz(path, arrays)
