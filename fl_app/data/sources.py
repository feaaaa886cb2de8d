"""Data sets as local numpy arrays, found on disk (or downloaded) without a hub.

Supported names: ``fashion_mnist`` (default), ``mnist``, ``digits``
(scikit-learn's bundled 8x8 set), ``synthetic`` (seeded, generated) and ``svhn``;
``hf`` (any Hugging Face data set) is :mod:`fl_app.data.hf`'s.

The two IDX data sets are searched in this order:

1. ``dataset.data_dir`` when it is set (it must then hold the files);
2. the Debian package path (``/usr/share/datasets/fashion-mnist/`` for
   Fashion-MNIST, from ``apt-get install dataset-fashion-mnist``);
3. the dpfl cache, ``$DPFL_DATA_HOME/<name>`` (default ``~/.cache/dpfl/<name>``);
4. a download into that cache when ``dataset.download`` is true and the
   machine is online (the decompressed files are checked against known SHA-256
   sums).

Otherwise :class:`DataNotFoundError` says, in one line, where it looked and how
to get the files.

``svhn`` (Netzer et al. 2011, the cropped-digits ``train_32x32.mat`` and
``test_32x32.mat``; 3x32x32 colour images, label 10 mapped to digit 0) is read
with scipy from ``dataset.data_dir`` or the dpfl cache ``$DPFL_DATA_HOME/svhn``;
when neither has it and ``dataset.download`` is true, torchvision downloads it
into the cache (checking its MD5 sums). That needs a machine that is online:
offline, :class:`DataNotFoundError` names ``dataset.data_dir`` and says how to
get the files.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import os
import shutil
import tempfile
import urllib.error
import urllib.request
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

IDX_FILES: tuple[str, ...] = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)

# SHA-256 of the *decompressed* IDX files (mirrors recompress the .gz files).
IDX_SHA256: dict[str, dict[str, str]] = {
    "fashion_mnist": {
        "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
        "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
        "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
        "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
    },
    "mnist": {
        "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
        "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
        "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
        "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
    },
}

DOWNLOAD_MIRRORS: dict[str, tuple[str, ...]] = {
    "fashion_mnist": (
        "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",
        "https://github.com/zalandoresearch/fashion-mnist/raw/master/data/fashion/",
    ),
    "mnist": (
        "https://ossci-datasets.s3.amazonaws.com/mnist/",
        "https://storage.googleapis.com/cvdf-datasets/mnist/",
    ),
}

DEBIAN_PATHS: dict[str, tuple[Path, ...]] = {
    "fashion_mnist": (Path("/usr/share/datasets/fashion-mnist"),),
    "mnist": (),
}

HOW_TO_GET: dict[str, str] = {
    "fashion_mnist": (
        "install Debian's package (apt-get install dataset-fashion-mnist), run "
        "`python -m fl_app.data.fetch fashion_mnist` on a machine that is online, or set "
        "dataset.data_dir=<folder with the four IDX files>"
    ),
    "mnist": (
        "run `python -m fl_app.data.fetch mnist` on a machine that is online, or set "
        "dataset.data_dir=<folder with train-images-idx3-ubyte[.gz] and the three other "
        "IDX files>"
    ),
}

IDX_DATASETS: tuple[str, ...] = ("fashion_mnist", "mnist")
DATASET_NAMES: tuple[str, ...] = ("fashion_mnist", "mnist", "digits", "synthetic", "svhn", "hf")

# SVHN (cropped digits): torchvision's file names; ``extra_32x32.mat`` is not used.
SVHN_FILES: dict[str, str] = {"train": "train_32x32.mat", "test": "test_32x32.mat"}
SVHN_HOW_TO_GET = (
    "put train_32x32.mat and test_32x32.mat (http://ufldl.stanford.edu/housenumbers/) into a folder "
    "and set dataset.data_dir=<that folder>, or run once with dataset.download=true on a machine that "
    "is online (torchvision downloads them into the dpfl cache)"
)
DOWNLOAD_TIMEOUT_S = 20.0


class DataNotFoundError(FileNotFoundError):
    """The files of a data set are nowhere to be found; the message says how to get them."""


class DataFileError(ValueError):
    """A data file exists but cannot be read (truncated, corrupt, wrong format)."""


@dataclass(frozen=True)
class ArrayDataset:
    """A labelled data set held as numpy arrays.

    Images are ``uint8`` (scaled by 1/255 for training) or ``float32`` with
    shape ``(n, channels, height, width)``; labels are ``int64``. ``groups_train`` is, for a data
    set with natural users (``dataset=hf`` with ``partition=natural``), each training row's user as
    an ``int64`` code; None otherwise.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    groups_train: np.ndarray | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one example, ``(channels, height, width)``."""
        return tuple(int(d) for d in self.x_train.shape[1:])


def data_home() -> Path:
    """Return the dpfl cache folder for downloaded data sets."""
    return Path(os.environ.get("DPFL_DATA_HOME", Path.home() / ".cache" / "dpfl"))


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (gzip-compressed or not) into a numpy array."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as handle:
            raw = handle.read()
    except (EOFError, OSError, zlib.error) as error:
        raise DataFileError(
            f"{path} is truncated or corrupt ({type(error).__name__}): delete it and fetch it again "
            "(python -m fl_app.data.fetch)"
        ) from None
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise DataFileError(f"{path} is not an unsigned-byte IDX file")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    offset = 4 + 4 * ndim
    expected = int(np.prod(dims))
    if len(raw) - offset != expected:
        raise DataFileError(
            f"{path} holds {len(raw) - offset} bytes of data, expected {expected} (truncated? delete it "
            "and fetch it again: python -m fl_app.data.fetch)"
        )
    # A writable copy: torch refuses (with a warning on every evaluation) to wrap read-only memory.
    return np.frombuffer(raw, dtype=np.uint8, offset=offset).reshape(dims).copy()


def find_idx_files(folder: Path) -> dict[str, Path] | None:
    """Return the four IDX files in ``folder`` (``.gz`` or plain), or ``None``."""
    found: dict[str, Path] = {}
    for stem in IDX_FILES:
        for candidate in (folder / stem, folder / f"{stem}.gz"):
            if candidate.is_file():
                found[stem] = candidate
                break
        else:
            return None
    return found


def resolve_idx_folder(
    name: str,
    *,
    data_dir: str | None,
    download: bool,
    search_paths: Sequence[Path] | None = None,
    cache_dir: Path | None = None,
) -> Path:
    """Find the folder holding ``name``'s IDX files, downloading them if allowed.

    Parameters
    ----------
    name : str
        ``"fashion_mnist"`` or ``"mnist"``.
    data_dir : str or None
        The user's ``dataset.data_dir``; when set, only this folder is used.
    download : bool
        Whether to try the official mirrors when nothing is found on disk.
    search_paths : Sequence[Path], optional
        System folders to search (default: the Debian package paths).
    cache_dir : Path, optional
        Download cache (default: ``data_home() / name``).

    Raises
    ------
    DataNotFoundError
        With a one-line message naming ``dataset.data_dir``, where it looked and
        how to get the files.

    """
    if name not in IDX_DATASETS:
        raise ValueError(f"{name!r} is not an IDX data set; expected one of {IDX_DATASETS}")
    if data_dir is not None:
        folder = Path(data_dir).expanduser()
        if find_idx_files(folder) is None:
            raise DataNotFoundError(
                f"dataset.data_dir={data_dir!r}: no {name} IDX files there (expected "
                f"{', '.join(f + '[.gz]' for f in IDX_FILES)}); {HOW_TO_GET[name]}"
            )
        return folder
    system = list(DEBIAN_PATHS[name] if search_paths is None else search_paths)
    cache = cache_dir if cache_dir is not None else data_home() / name
    looked = [*system, cache]
    for folder in looked:
        if find_idx_files(folder) is not None:
            return folder
    reason = "download disabled (dataset.download=false)"
    if download:
        try:
            download_idx(name, cache)
            return cache
        except (OSError, ValueError, urllib.error.URLError) as error:
            reason = f"download failed: {error}"
    raise DataNotFoundError(
        f"dataset.data_dir=null: {name} IDX files not found in "
        f"{', '.join(str(p) for p in looked)} and {reason}; {HOW_TO_GET[name]}"
    )


def download_idx(name: str, target: Path, *, timeout: float = DOWNLOAD_TIMEOUT_S) -> None:
    """Download ``name``'s four IDX files into ``target``, verifying their checksums."""
    errors: list[str] = []
    for mirror in DOWNLOAD_MIRRORS[name]:
        try:
            with tempfile.TemporaryDirectory(prefix=f"dpfl-{name}-") as tmp:
                for stem in IDX_FILES:
                    gz_path = Path(tmp) / f"{stem}.gz"
                    with urllib.request.urlopen(f"{mirror}{stem}.gz", timeout=timeout) as resp:
                        gz_path.write_bytes(resp.read())
                    digest = hashlib.sha256(gzip.decompress(gz_path.read_bytes())).hexdigest()
                    if digest != IDX_SHA256[name][stem]:
                        raise ValueError(f"checksum mismatch for {stem} from {mirror}")
                target.mkdir(parents=True, exist_ok=True)
                for stem in IDX_FILES:
                    shutil.move(str(Path(tmp) / f"{stem}.gz"), target / f"{stem}.gz")
            return
        except (OSError, ValueError, urllib.error.URLError) as error:
            errors.append(f"{mirror}: {getattr(error, 'reason', error)}")
    raise OSError("; ".join(errors))


#: The shape of one example of each data set read from files (what its files must hold).
EXAMPLE_SHAPES: dict[str, tuple[int, ...]] = {
    "fashion_mnist": (1, 28, 28),
    "mnist": (1, 28, 28),
    "svhn": (3, 32, 32),
}
REFETCH_HINT = "the file is corrupt: delete it and fetch it again (python -m fl_app.data.fetch)"


def check_examples(
    images: np.ndarray, labels: np.ndarray, *, num_classes: int, source: str, first_label: int = 0
) -> None:
    """Raise :class:`DataFileError` naming ``source`` and the first bad row, unless the split is sound.

    Sound: one label per image, integer labels in ``first_label..first_label + num_classes - 1``,
    images of ``uint8`` or of finite floats. Vectorised: a few ms for Fashion-MNIST's 60,000 rows.
    """
    if labels.ndim != 1 or len(labels) != len(images):
        raise DataFileError(
            f"{source}: {len(images)} images but labels of shape {labels.shape}; {REFETCH_HINT}"
        )
    if not np.issubdtype(labels.dtype, np.integer):
        raise DataFileError(f"{source}: labels of type {labels.dtype}, not integers; {REFETCH_HINT}")
    last = first_label + num_classes - 1
    bad = np.flatnonzero((labels < first_label) | (labels > last))
    if bad.size:
        raise DataFileError(
            f"{source}: row {bad[0]} (counting from 0) has label {labels[bad[0]]}, outside "
            f"{first_label}..{last} ({bad.size} such rows); {REFETCH_HINT}"
        )
    if images.dtype != np.uint8 and not np.issubdtype(images.dtype, np.floating):
        raise DataFileError(f"{source}: images of type {images.dtype}, not uint8 or float; {REFETCH_HINT}")
    if images.dtype != np.uint8:
        rows = np.flatnonzero(~np.isfinite(images.reshape(len(images), -1)).all(axis=1))
        if rows.size:
            raise DataFileError(f"{source}: row {rows[0]} (counting from 0) holds NaN or infinite values")


def check_shape(images: np.ndarray, name: str, source: str) -> None:
    """Raise :class:`DataFileError` when ``source``'s examples are not of ``name``'s shape."""
    expected = EXAMPLE_SHAPES[name]
    if tuple(images.shape[1:]) != expected:
        shape = tuple(images.shape[1:])
        raise DataFileError(
            f"{source}: examples of shape {shape}, but {name}'s are {expected}; {REFETCH_HINT}"
        )


def load_idx_dataset(name: str, folder: Path) -> ArrayDataset:
    """Load an MNIST-format data set from the IDX files in ``folder`` (checked: :func:`check_examples`)."""
    files = find_idx_files(folder)
    if files is None:
        raise DataNotFoundError(f"no {name} IDX files in {folder}")
    splits = {}
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images_file, labels_file = files[f"{prefix}-images-idx3-ubyte"], files[f"{prefix}-labels-idx1-ubyte"]
        images, labels = read_idx(images_file)[:, None], read_idx(labels_file)
        check_shape(images, name, str(images_file))
        check_examples(images, labels, num_classes=10, source=str(labels_file))
        splits[split] = (images, labels.astype(np.int64))
    return ArrayDataset(name, *splits["train"], *splits["test"], num_classes=10)


def bundled_digits() -> tuple[np.ndarray, np.ndarray]:
    """Scikit-learn's bundled 8x8 digits: ``float64`` images of shape (1797, 8, 8) in 0..16, labels.

    Read from the file ``sklearn.datasets.load_digits`` reads (``sklearn/datasets/data/digits.csv.gz``,
    found without importing scikit-learn: its import costs 0.6-0.9 s of CPU, as much as the rest of a
    small run's start, in every process that loads the set); through ``load_digits`` where that file
    is not there. ``tests/test_data.py`` checks that both give the same arrays.
    """
    spec = importlib.util.find_spec("sklearn")
    origin = spec.origin if spec is not None else None
    path = Path(origin).parent / "datasets" / "data" / "digits.csv.gz" if origin else None
    if path is None or not path.is_file():
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.images, bunch.target
    with gzip.open(path, "rt") as text:
        table = np.loadtxt(text, delimiter=",", dtype=np.float64)
    return table[:, :-1].reshape(-1, 8, 8), table[:, -1].astype(int)


def load_digits_dataset(*, test_fraction: float, seed: int) -> ArrayDataset:
    """Load scikit-learn's bundled 8x8 digits (:func:`bundled_digits`), split into train and test."""
    images, target = bundled_digits()
    images = np.clip(images * 16.0, 0, 255).astype(np.uint8)[:, None]
    labels = target.astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(labels))
    num_test = round(test_fraction * len(labels))
    test, train = order[:num_test], order[num_test:]
    return ArrayDataset("digits", images[train], labels[train], images[test], labels[test], 10)


def make_synthetic_dataset(
    *,
    num_train: int,
    num_test: int,
    image_size: int,
    num_classes: int,
    class_sep: float,
    seed: int,
) -> ArrayDataset:
    """Generate a seeded classification task of Gaussian clusters shaped like images."""
    rng = np.random.default_rng(seed)
    num_features = image_size * image_size
    # Scale so that half the distance between two centres is ~class_sep noise std.
    centres = rng.normal(size=(num_classes, num_features)).astype(np.float32)
    centres *= class_sep * np.sqrt(2.0 / num_features)

    def sample(count: int) -> tuple[np.ndarray, np.ndarray]:
        labels = rng.integers(0, num_classes, size=count).astype(np.int64)
        points = centres[labels] + rng.normal(size=(count, num_features)).astype(np.float32)
        return points.reshape(count, 1, image_size, image_size), labels

    x_train, y_train = sample(num_train)
    x_test, y_test = sample(num_test)
    return ArrayDataset("synthetic", x_train, y_train, x_test, y_test, num_classes)


def resolve_svhn_folder(*, data_dir: str | None, download: bool, cache_dir: Path | None = None) -> Path:
    """Find the folder with SVHN's two ``.mat`` files, downloading them with torchvision if allowed.

    Raises
    ------
    DataNotFoundError
        With a one-line message naming ``dataset.data_dir`` and how to get the files.

    """
    if data_dir is not None:
        folder = Path(data_dir).expanduser()
        if all((folder / name).is_file() for name in SVHN_FILES.values()):
            return folder
        raise DataNotFoundError(
            f"dataset.data_dir={data_dir!r}: no SVHN files there (expected "
            f"{', '.join(SVHN_FILES.values())}); {SVHN_HOW_TO_GET}"
        )
    cache = cache_dir if cache_dir is not None else data_home() / "svhn"
    if all((cache / name).is_file() for name in SVHN_FILES.values()):
        return cache
    reason = "download disabled (dataset.download=false)"
    if download:
        try:
            download_svhn(cache)
            return cache
        except (OSError, RuntimeError, ValueError) as error:
            reason = f"download failed: {' '.join(str(error).split())[:200]}"
    raise DataNotFoundError(
        f"dataset.data_dir=null: SVHN files not found in {cache} and {reason}; {SVHN_HOW_TO_GET}"
    )


def download_svhn(target: Path) -> None:
    """Download SVHN's train and test ``.mat`` files into ``target`` with torchvision (MD5-checked)."""
    from torchvision.datasets import SVHN

    target.mkdir(parents=True, exist_ok=True)
    for split in SVHN_FILES:
        SVHN(root=str(target), split=split, download=True)


def load_svhn_dataset(folder: Path) -> ArrayDataset:
    """Load SVHN from ``folder``: images ``(n, 3, 32, 32)`` ``uint8``, labels 0-9 (10 means 0)."""
    from scipy.io import loadmat

    parts: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for split, name in SVHN_FILES.items():
        raw = loadmat(folder / name)
        images = np.ascontiguousarray(np.transpose(raw["X"], (3, 2, 0, 1)), dtype=np.uint8)
        labels = np.asarray(raw["y"], dtype=np.int64).reshape(-1)
        check_shape(images, "svhn", str(folder / name))
        check_examples(images, labels, num_classes=10, source=str(folder / name), first_label=1)
        parts[split] = (images, labels % 10)
    return ArrayDataset("svhn", *parts["train"], *parts["test"], num_classes=10)


def load_dataset(options: Mapping[str, Any], *, seed: int) -> ArrayDataset:
    """Load the data set described by the ``dataset`` config group.

    Parameters
    ----------
    options : Mapping[str, Any]
        The ``dataset`` group: ``name`` plus that data set's own keys.
    seed : int
        Seed for the digits train/test split and the synthetic generator.

    """
    name = options["name"]
    if name in IDX_DATASETS:
        folder = resolve_idx_folder(
            name, data_dir=options.get("data_dir"), download=bool(options.get("download", True))
        )
        return load_idx_dataset(name, folder)
    if name == "digits":
        return load_digits_dataset(test_fraction=float(options["test_fraction"]), seed=seed)
    if name == "svhn":
        folder = resolve_svhn_folder(
            data_dir=options.get("data_dir"), download=bool(options.get("download", True))
        )
        return load_svhn_dataset(folder)
    if name == "synthetic":
        return make_synthetic_dataset(
            num_train=int(options["num_train"]),
            num_test=int(options["num_test"]),
            image_size=int(options["image_size"]),
            num_classes=int(options["num_classes"]),
            class_sep=float(options["class_sep"]),
            seed=seed,
        )
    raise ValueError(
        f"dataset.name={name!r} is unknown here; allowed: {', '.join(DATASET_NAMES[:-1])} "
        "(dataset=hf: fl_app.data.hf.load_hf_dataset)"
    )
