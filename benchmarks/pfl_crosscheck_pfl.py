"""pfl-research's side of ``benchmarks/pfl_crosscheck.py``, run with ``.venv-pfl/bin/python`` (no dpfl).

Every function here runs pfl 0.6.0 (``pip install pfl==0.6.0``, ``scripts/setup_pfl_env.sh``) and the
code of pfl-research's benchmarks, which pip does not ship: ``--pfl-research`` names a copy of the
repository's ``benchmarks/`` folder (``benchmarks/pfl_crosscheck.py`` extracts it from a checkout or a
git snapshot), put on ``sys.path`` at run time; none of it is kept in dpfl. TFF's definition of the
Stack Overflow task (google-research/federated ``utils/datasets/stackoverflow_word_prediction.py``) is
loaded the same way from ``--google-federated`` and run under TensorFlow (``tensorflow_federated``,
which it imports but does not use for the tokenizer, is replaced by an empty module).

Subcommands (each prints one JSON object as its last line):

* ``data``: pfl-research's ``dataset/stackoverflow/download_preprocess.py`` on a TFF SQLite file with a
  given word list (its ``load_word_counts``, which downloads TFF's counts, replaced by one reading the
  list), writing ``stackoverflow.hdf5``; when TensorFlow or h5py is missing, the HDF5 written from the
  same rows by :func:`independent_hdf5` (TFF's definition in plain Python). Also TFF's own ``to_ids`` on
  every sentence. Both as arrays in ``tokens.npz``.
* ``network``: pfl-research's ``lm_transformer`` (its LM configuration) and ``lm_lstm`` with weights
  from a seeded generator: parameter names, shapes, counts, outputs and loss gradients on given inputs.
* ``metric``: pfl-research's transformer trained briefly on the HDF5's training users, then evaluated by
  pfl's ``PyTorchModel.evaluate`` on its test users: loss, accuracy, accuracy without unknown, the weights.
* ``init``: a checkpoint folder (``checkpoint.pt``) for pfl-research's ``--restore_model_path`` from
  dpfl's initial weights.
* ``hdf5-from-tokens``: a converted dpfl corpus folder (raw token files, read with numpy) as the HDF5
  layout of ``download_preprocess.py``.
* ``image-run``: DP-FedAvg with pfl-research's image configuration (cohort, noise cohort, clip, epsilon,
  local training) on an exported partition, through pfl's ``SimulatedBackend`` (``--mechanism``:
  clipping without noise, or neither, for experiments).
* ``image-update``: one client's local update by pfl's own SGD, for given clients and example orders.
* ``lm-update``: the same for the LM task's training users, with dropout off on both sides.
* ``lm-round``: rounds of pfl-research's LM configuration on an HDF5, their times and trained
  sentences (``--progress``: a line appended at each round's end, where the harness reads the CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import itertools
import json
import math
import os
import shutil
import sqlite3
import sys
import time
import types
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

SPECIALS = ("PAD", "UNK", "BOS", "EOS")


def use_benchmarks(folder: Path) -> None:
    """Put pfl-research's ``benchmarks/`` first on ``sys.path`` (its packages dataset, model, utils)."""
    if not (folder / "model" / "pytorch" / "transformer.py").is_file():
        raise SystemExit(
            f"{folder} is not pfl-research's benchmarks/ folder (no model/pytorch/transformer.py)"
        )
    sys.path.insert(0, str(folder))


# --------------------------------------------------------------------------------------------------
# Same data
# --------------------------------------------------------------------------------------------------


def read_words(path: Path, size: int) -> list[str]:
    """The first ``size`` words of a ``word count`` file (TFF's ``stackoverflow.word_count`` layout)."""
    words = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.split():
            words.append(line.split()[0])
        if len(words) >= size:
            break
    return words


def split_users(sqlite: Path) -> dict[str, list[str]]:
    """Each split's users (``client_metadata``), sorted; ``heldout`` is pfl-research's ``val``."""
    connection = sqlite3.connect(f"file:{sqlite}?mode=ro", uri=True)
    users: dict[str, list[str]] = {}
    for split, user in connection.execute("SELECT DISTINCT split_name, client_id FROM client_metadata"):
        users.setdefault(str(split), []).append(str(user))
    connection.close()
    return {split: sorted(ids) for split, ids in users.items()}


def sentences_of(sqlite: Path, split: str) -> dict[str, list[str]]:
    """Every user's ``tokens`` feature in row order, parsed with TensorFlow's ``tf.io.parse_example``."""
    import tensorflow as tf

    connection = sqlite3.connect(f"file:{sqlite}?mode=ro", uri=True)
    rows = connection.execute(
        "SELECT client_id, serialized_example_proto FROM examples WHERE split_name = ? ORDER BY rowid",
        (split,),
    ).fetchall()
    connection.close()
    spec = {"tokens": tf.io.FixedLenFeature(dtype=tf.string, shape=())}
    out: dict[str, list[str]] = {}
    for user, blob in rows:
        text = tf.io.parse_single_example(blob, spec)["tokens"].numpy().decode("utf-8")
        out.setdefault(str(user), []).append(text)
    return out


class Absent(types.ModuleType):
    """A stand-in for a module the tokenizer never calls: any attribute is another stand-in.

    TFF's task module names ``tff.simulation.datasets.ClientData`` in annotations and wraps its
    preprocessing in ``tff.tf_computation``; ``build_to_ids_fn`` uses TensorFlow alone.
    """

    def __getattr__(self, name: str) -> Absent:
        if name.startswith("__"):
            raise AttributeError(name)
        return Absent(f"{self.__name__}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Absent:
        """Another stand-in (a decorator or a type that is never used)."""
        return self


def tff_to_ids(federated: Path) -> Any:
    """google-research/federated's ``build_to_ids_fn`` (TFF's definition), loaded from ``federated``."""
    path = federated / "utils" / "datasets" / "stackoverflow_word_prediction.py"
    sys.modules.setdefault("tensorflow_federated", Absent("tensorflow_federated"))
    spec = importlib.util.spec_from_file_location("tff_stackoverflow_word_prediction", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_to_ids_fn


def tff_rows(
    sqlite: Path, words: list[str], length: int, federated: Path
) -> dict[str, dict[str, np.ndarray]]:
    """TFF's ``to_ids`` on every sentence of every split, zero-padded to ``length + 1`` (its padded batch)."""
    import tensorflow as tf

    to_ids = tff_to_ids(federated)(vocab=words, max_sequence_length=length, num_oov_buckets=1)
    out: dict[str, dict[str, np.ndarray]] = {}
    for split in split_users(sqlite):
        out[split] = {}
        for user, texts in sentences_of(sqlite, split).items():
            rows = np.zeros((len(texts), length + 1), dtype=np.int64)
            for i, text in enumerate(texts):
                ids = to_ids({"tokens": tf.constant(text)}).numpy()
                rows[i, : len(ids)] = ids
            out[split][user] = rows
    return out


def pfl_research_hdf5(sqlite: Path, words: list[str], length: int, folder: Path, benchmarks: Path) -> Path:
    """Run pfl-research's ``download_preprocess.py`` on ``sqlite`` with the word list ``words``."""
    use_benchmarks(benchmarks)
    module = importlib.import_module("dataset.stackoverflow.download_preprocess")

    def load_word_counts(cache_dir: Any = None, vocab_size: int | None = None) -> OrderedDict:
        counts = OrderedDict((word, len(words) - i) for i, word in enumerate(words))
        return OrderedDict(itertools.islice(counts.items(), vocab_size))

    module.load_word_counts = load_word_counts  # its own downloads TFF's counts
    folder.mkdir(parents=True, exist_ok=True)
    # It reads <output_dir>/stackoverflow.sqlite, else downloads TFF's: a fresh copy every time.
    shutil.copyfile(sqlite, folder / "stackoverflow.sqlite")
    with contextlib.redirect_stdout(sys.stderr):
        module.dl_preprocess_and_dump_h5(str(folder), len(words), length, 1)
    return folder / "stackoverflow.hdf5"


def write_metadata(h5: Any, ids: dict[str, int], length: int) -> None:
    """``/metadata`` as ``download_preprocess.py`` writes it: words at ``ids`` (1..k), pad 0, unk k+1..."""
    k = len(ids)
    h5["/metadata/vocabulary_size"] = k + 4
    h5["/metadata/unk_symbol"] = k + 1
    h5["/metadata/pad_symbol"] = 0
    h5["/metadata/max_sequence_length"] = length
    for token, id_ in [("PAD", 0), *ids.items(), ("UNK", k + 1), ("BOS", k + 2), ("EOS", k + 3)]:
        h5.create_dataset(f'/metadata/vocabulary/"{token}"', data=id_, dtype="int32")


def independent_hdf5(sqlite: Path, words: list[str], length: int, folder: Path) -> Path:
    """The HDF5 of ``download_preprocess.py`` written by TFF's definition in plain Python (no TensorFlow).

    Rows parsed by a minimal ``tf.train.Example`` reader of this function's own; a sentence split on
    single spaces, cut to ``length`` words, ids ``1..K`` (else ``K + 1``), ``K + 3`` appended when
    shorter, ``K + 2`` in front, 0 after: TFF's ``build_to_ids_fn``. Used only when TensorFlow is missing.
    """
    import h5py

    ids = {word: i + 1 for i, word in enumerate(words)}
    k = len(words)
    path = folder / "stackoverflow.hdf5"
    folder.mkdir(parents=True, exist_ok=True)
    connection = sqlite3.connect(f"file:{sqlite}?mode=ro", uri=True)
    with h5py.File(path, "w") as h5:
        write_metadata(h5, ids, length)
        for split, users in split_users(sqlite).items():
            partition = "val" if split == "heldout" else split
            for user in users:
                blobs = connection.execute(
                    "SELECT serialized_example_proto FROM examples WHERE client_id = ? AND split_name = ? "
                    "ORDER BY rowid",
                    (user, split),
                ).fetchall()
                rows = np.zeros((len(blobs), length + 1), dtype=np.int32)
                for i, (blob,) in enumerate(blobs):
                    words_ = example_text(blob, "tokens").split(" ")[:length]
                    seq = [k + 2, *(ids.get(w, k + 1) for w in words_)] + (
                        [k + 3] if len(words_) < length else []
                    )
                    rows[i, : len(seq)] = seq
                h5.create_dataset(f"/{partition}/{user}/inputs", data=rows[:, :-1])
                h5.create_dataset(f"/{partition}/{user}/targets", data=rows[:, 1:])
    connection.close()
    return path


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, at


def _messages(data: bytes) -> list[tuple[int, bytes]]:
    """The length-delimited fields of a protobuf message (field number, bytes); other wire types skipped."""
    out, at = [], 0
    while at < len(data):
        key, at = _varint(data, at)
        wire = key & 7
        if wire == 2:
            size, at = _varint(data, at)
            out.append((key >> 3, data[at : at + size]))
            at += size
        elif wire == 0:
            _, at = _varint(data, at)
        elif wire == 5:
            at += 4
        elif wire == 1:
            at += 8
    return out


def example_text(blob: bytes, feature: str) -> str:
    """The bytes feature ``feature`` of a serialized ``tf.train.Example`` (Example.features.feature map)."""
    for _, features in _messages(blob):
        for _, entry in _messages(features):
            fields = dict(_messages(entry))
            if fields.get(1, b"").decode() == feature:
                bytes_list = dict(_messages(fields[2]))[1]
                return b" ".join(v for _, v in _messages(bytes_list)).decode("utf-8")
    raise ValueError(f"no feature {feature!r}")


def read_hdf5(path: Path) -> dict[str, Any]:
    """An HDF5 of ``download_preprocess.py``'s layout: vocabulary, metadata, each partition's users' rows."""
    import h5py

    out: dict[str, Any] = {"partitions": {}}
    with h5py.File(path, "r") as h5:
        out["vocabulary"] = {
            name[1:-1] if name.startswith('"') else name: int(h5[f"metadata/vocabulary/{name}"][()])
            for name in h5["metadata/vocabulary"]
        }
        for key in ("vocabulary_size", "unk_symbol", "pad_symbol", "max_sequence_length"):
            out[key] = int(h5[f"metadata/{key}"][()])
        for partition in ("train", "val", "test"):
            if partition not in h5:
                continue
            out["partitions"][partition] = {
                user: np.concatenate(
                    [
                        np.asarray(h5[f"{partition}/{user}/inputs"]),
                        np.asarray(h5[f"{partition}/{user}/targets"])[:, -1:],
                    ],
                    axis=1,
                ).astype(np.int64)
                for user in h5[partition]
            }
    return out


def data_command(args: argparse.Namespace) -> dict[str, Any]:
    """``data``: the HDF5 (pfl-research's script, else independent) and TFF's rows, as ``tokens.npz``."""
    words = read_words(args.words, args.vocab_size)
    result: dict[str, Any] = {}
    try:
        import h5py  # noqa: F401
        import tensorflow  # noqa: F401

        have_tf = True
    except ImportError as error:
        have_tf, result["tensorflow"] = False, f"not installed ({error})"
    if have_tf and args.pfl_research is not None:
        start = time.perf_counter()
        hdf5 = pfl_research_hdf5(args.sqlite, words, args.length, args.out, args.pfl_research)
        result["hdf5_by"] = "pfl-research benchmarks/dataset/stackoverflow/download_preprocess.py"
        result["hdf5_s"] = time.perf_counter() - start
    else:
        hdf5 = independent_hdf5(args.sqlite, words, args.length, args.out)
        result["hdf5_by"] = (
            "independent (TFF's definition in plain Python; pfl-research's script could not run)"
        )
    read = read_hdf5(hdf5)
    arrays: dict[str, np.ndarray] = {}
    for partition, users in read["partitions"].items():
        pack(arrays, f"pfl_{partition}", users)
    if have_tf and args.google_federated is not None:
        start = time.perf_counter()
        for split, users in tff_rows(args.sqlite, words, args.length, args.google_federated).items():
            pack(arrays, f"tff_{split}", users)
        result["tff_by"] = (
            "google-research/federated utils/datasets/stackoverflow_word_prediction.py build_to_ids_fn"
        )
        result["tff_s"] = time.perf_counter() - start
    else:
        result["tff_by"] = None
    vocab_names = sorted(read["vocabulary"], key=read["vocabulary"].get)
    arrays["pfl_vocabulary_words"] = np.array(vocab_names)
    arrays["pfl_vocabulary_ids"] = np.array([read["vocabulary"][w] for w in vocab_names])
    np.savez(args.out / "tokens.npz", **arrays)
    result |= {k: read[k] for k in ("vocabulary_size", "unk_symbol", "pad_symbol", "max_sequence_length")}
    result["hdf5"] = str(hdf5)
    result["partitions"] = {p: len(u) for p, u in read["partitions"].items()}
    return result


def pack(arrays: dict[str, np.ndarray], prefix: str, users: dict[str, np.ndarray]) -> None:
    """Users' rows as three arrays: ``<prefix>_users``, ``_offsets`` and ``_rows`` (users sorted)."""
    names = sorted(users)
    parts = [users[u] for u in names]
    arrays[f"{prefix}_users"] = np.array(names)
    arrays[f"{prefix}_offsets"] = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
    width = parts[0].shape[1] if parts else 0
    arrays[f"{prefix}_rows"] = np.concatenate(parts) if parts else np.zeros((0, width), dtype=np.int64)


# --------------------------------------------------------------------------------------------------
# Same network
# --------------------------------------------------------------------------------------------------


def pfl_networks(benchmarks: Path, vocabulary: int, length: int) -> dict[str, Any]:
    """pfl-research's ``lm_transformer`` (its LM configuration) and ``lm_lstm`` (embedding 96, 256 cells)."""
    use_benchmarks(benchmarks)
    from model.pytorch import lm_lstm, lm_transformer

    unk = vocabulary - 3
    return {
        "pfl_transformer": lm_transformer(96, 96, 8, 1536, 3, vocabulary, length, 0, unk, 0.1),
        "pfl_lstm": lm_lstm(96, 256, 1, vocabulary, 0, unk),
    }


def seeded_weights(network: Any, seed: int) -> None:
    """Every parameter from ``normal(0, 0.1)`` of a seeded generator, in ``named_parameters`` order."""
    import torch

    rng = np.random.default_rng(seed)
    with torch.no_grad():
        for _, parameter in network.named_parameters():
            values = rng.standard_normal(tuple(parameter.shape)).astype(np.float32) * np.float32(0.1)
            parameter.copy_(torch.from_numpy(values))


def network_command(args: argparse.Namespace) -> dict[str, Any]:
    """``network``: each network's names, shapes and count; outputs and loss gradients on seeded inputs."""
    import torch

    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    inputs = rng.integers(1, args.vocabulary, size=(args.batch, args.length))
    inputs[0, args.length // 2 :] = 0  # a short sentence, padded
    targets = np.concatenate([inputs[:, 1:], rng.integers(1, args.vocabulary, size=(args.batch, 1))], axis=1)
    targets[0, args.length // 2 - 1 :] = 0
    arrays: dict[str, np.ndarray] = {"inputs": inputs, "targets": targets}
    summary: dict[str, Any] = {}
    for name, network in pfl_networks(args.pfl_research, args.vocabulary, args.length).items():
        seeded_weights(network, args.seed)
        x, y = torch.from_numpy(inputs), torch.from_numpy(targets)
        loss = network.loss(x, y, eval=True)  # pfl-research's loss, dropout off
        network.zero_grad()
        loss.backward()
        with torch.no_grad():
            outputs = network(x)
        for key, value in network.state_dict().items():
            arrays[f"{name}/state/{key}"] = value.numpy()
        for key, parameter in network.named_parameters():
            arrays[f"{name}/grad/{key}"] = parameter.grad.numpy()
        arrays[f"{name}/outputs"] = outputs.numpy()
        summary[name] = {
            "parameters": int(sum(p.numel() for p in network.parameters())),
            "shapes": {k: list(p.shape) for k, p in network.named_parameters()},
            "buffers": [k for k, _ in network.named_buffers()],
            "loss": float(loss),
        }
    np.savez(args.out, **arrays)
    return summary


# --------------------------------------------------------------------------------------------------
# Same metric
# --------------------------------------------------------------------------------------------------


def partition_arrays(hdf5: Path, partition: str) -> tuple[np.ndarray, np.ndarray]:
    """All inputs and targets of a partition, users in the HDF5's order (pfl-research's central data set)."""
    rows = read_hdf5(hdf5)["partitions"][partition]
    joined = np.concatenate([rows[u] for u in sorted(rows)])
    return joined[:, :-1], joined[:, 1:]


def metric_command(args: argparse.Namespace) -> dict[str, Any]:
    """``metric``: the transformer trained for ``--steps`` SGD steps, evaluated by pfl on the test users."""
    import torch
    from pfl.data.dataset import Dataset
    from pfl.hyperparam import NNEvalHyperParams
    from pfl.metrics import StringMetricName
    from pfl.model.pytorch import PyTorchModel

    torch.manual_seed(args.seed)
    meta = read_hdf5(args.hdf5)
    network = pfl_networks(args.pfl_research, meta["vocabulary_size"], meta["max_sequence_length"])[
        "pfl_transformer"
    ]
    x, y = partition_arrays(args.hdf5, "train")
    optimizer = torch.optim.SGD(network.parameters(), lr=args.lr)
    rng = np.random.default_rng(args.seed)
    for _ in range(args.steps):
        batch = rng.choice(len(x), size=min(32, len(x)), replace=False)
        optimizer.zero_grad()
        network.loss(torch.from_numpy(x[batch]), torch.from_numpy(y[batch])).backward()
        optimizer.step()
    model = PyTorchModel(
        model=network,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(network.parameters(), lr=1.0),
    )
    x_test, y_test = partition_arrays(args.hdf5, "test")
    data = Dataset(raw_data=[torch.from_numpy(x_test), torch.from_numpy(y_test)], eval_kwargs={"eval": True})
    metrics = model.evaluate(data, lambda n: StringMetricName(n), NNEvalHyperParams(local_batch_size=1024))
    out = {}
    for name, value in metrics:
        out[str(name)] = {
            "value": float(value.overall_value),
            "weighted_value": float(getattr(value, "weighted_value", math.nan)),
            "weight": float(getattr(value, "weight", math.nan)),
        }
    state = {k: v.numpy() for k, v in network.state_dict().items()}
    np.savez(args.out, **state)
    return {"metrics": out, "steps": args.steps, "test_sentences": len(y_test)}


# --------------------------------------------------------------------------------------------------
# Learning runs' start and data
# --------------------------------------------------------------------------------------------------


def init_command(args: argparse.Namespace) -> dict[str, Any]:
    """``init``: ``<out>/checkpoint.pt``, pfl-research's transformer holding dpfl's initial weights."""
    import torch

    weights = np.load(args.weights)
    network = pfl_networks(args.pfl_research, args.vocabulary, args.length)["pfl_transformer"]
    state = network.state_dict()
    missing = [k for k in state if k not in weights.files and k != "_positional_encoder.pe"]
    if missing:
        raise SystemExit(f"{args.weights} lacks {missing[:3]}")
    for key in weights.files:
        state[key] = torch.from_numpy(weights[key])
    network.load_state_dict(state)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(network.state_dict(), args.out / "checkpoint.pt")
    return {"checkpoint": str(args.out / "checkpoint.pt"), "tensors": len(state)}


def hdf5_from_tokens_command(args: argparse.Namespace) -> dict[str, Any]:
    """``hdf5-from-tokens``: a converted dpfl corpus (``meta.json``, ``*.tokens``, ``*_offsets.npy``) as HDF5.

    The training users are ``train``, the test users ``val`` (pfl-research evaluates on ``val``) and
    ``test``; user ids are their numbers. The vocabulary's words, specials and metadata as
    ``download_preprocess.py`` writes them.
    """
    import h5py

    meta = json.loads((args.folder / "meta.json").read_text())
    words, length = meta["vocabulary"], int(meta["sequence_length"])
    with h5py.File(args.out, "w") as h5:
        write_metadata(h5, {w: i + 1 for i, w in enumerate(words)}, length)
        counts: dict[str, dict[str, int]] = {}
        for split, partitions in (("train", ("train",)), ("test", ("val", "test"))):
            offsets = np.load(args.folder / f"{split}_offsets.npy")
            tokens = np.memmap(args.folder / f"{split}.tokens", dtype=np.dtype(meta["dtype"]), mode="r")
            tokens = tokens.reshape(-1, length + 1)
            users = len(offsets) - 1 if split == "train" else min(len(offsets) - 1, args.test_users)
            for partition in partitions:
                counts[partition] = {}
                for user in range(users):
                    rows = np.asarray(tokens[offsets[user] : offsets[user + 1]], dtype=np.int32)
                    h5.create_dataset(f"/{partition}/{user:07d}/inputs", data=rows[:, :-1])
                    h5.create_dataset(f"/{partition}/{user:07d}/targets", data=rows[:, 1:])
                    counts[partition][f"{user:07d}"] = int(np.minimum((rows != 0).sum(axis=1), length).sum())
        for partition, values in counts.items():
            h5[f"/metadata/num_tokens/{partition}"] = json.dumps(values)
    return {"hdf5": str(args.out), "users": {p: len(v) for p, v in counts.items()}}


# --------------------------------------------------------------------------------------------------
# DP-FedAvg with pfl-research's image configuration
# --------------------------------------------------------------------------------------------------


def image_run_command(args: argparse.Namespace) -> dict[str, Any]:
    """``image-run``: pfl's ``FederatedAveraging`` with pfl-research's central DP on an exported partition.

    The mechanism is pfl-research's own ``utils.argument_parsing.parse_mechanism`` (its
    ``gaussian_moments_accountant``: PLD calibrated for ``noise_cohort / population`` and the noise
    scaled by ``cohort / noise_cohort``); users drawn as pfl-research's benchmarks draw them
    (``get_user_sampler('random')``: uniformly with replacement), weighted by user
    (``weight_by_samples: false``), central SGD at lr 1. The network is the exported one (dpfl's MLP,
    784-128-64-10, with dpfl's initial weights), its loss and metrics pfl-research's
    ``image_classification_loss``/``metrics``. Evaluation after every ``--every`` rounds on the
    exported evaluation rows.
    """
    import torch

    torch.set_num_threads(1)
    np.random.seed(args.seed)  # noqa: NPY002 - pfl-research's samplers draw from numpy's global state
    torch.manual_seed(args.seed)
    use_benchmarks(args.pfl_research)
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByUser
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, StringMetricName, get_overall_value
    from pfl.model.pytorch import PyTorchModel
    from pfl.privacy import CentrallyAppliedPrivacyMechanism
    from utils.argument_parsing import parse_mechanism

    archive = np.load(args.data)
    x_all = archive["x"].astype(np.float32) / np.float32(255.0)
    y_all = archive["y"].astype(np.int64)
    offsets = archive["offsets"]
    users = {str(i): (x_all[a:b], y_all[a:b]) for i, (a, b) in enumerate(itertools.pairwise(offsets))}
    network = partition_network(archive)

    def make_user(uid: str) -> Dataset:
        x, y = users[uid]
        order = np.random.permutation(len(y))  # noqa: NPY002 - a fresh order at each participation, as dpfl
        return Dataset(raw_data=[x[order], y[order]], user_id=uid)

    training = FederatedDataset(make_user, get_user_sampler("random", list(users)))
    mechanism = parse_mechanism(
        mechanism_name=args.mechanism,
        clipping_bound=args.clip,
        epsilon=args.epsilon,
        delta=args.delta,
        order=2,
        cohort_size=args.cohort,
        noise_cohort_size=args.noise_cohort,
        num_epochs=args.rounds,
        population=args.population,
    )
    backend = SimulatedBackend(
        training_data=training,
        val_data=None,
        postprocessors=[WeightByUser(), CentrallyAppliedPrivacyMechanism(mechanism)],
    )
    model = PyTorchModel(
        model=network,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(network.parameters(), lr=1.0),
    )
    eval_set = Dataset(
        (
            torch.from_numpy(archive["x_eval"].astype(np.float32) / 255.0),
            torch.from_numpy(archive["y_eval"].astype(np.int64)),
        )
    )
    history: dict[str, list[float]] = {"round": [], "accuracy": [], "loss": [], "round_s": []}

    class Recorder(TrainingProcessCallback):
        def on_train_begin(self, *, model: Any) -> Metrics:
            self.last = time.perf_counter()
            return Metrics()

        def after_central_iteration(
            self, aggregate_metrics: Any, model: Any, *, central_iteration: int
        ) -> Any:
            history["round_s"].append(time.perf_counter() - self.last)
            done = central_iteration + 1
            if done % args.every == 0 or done == args.rounds:
                values = model.evaluate(
                    eval_set, lambda n: StringMetricName(n), NNEvalHyperParams(local_batch_size=1000)
                )
                by_name = {str(k): get_overall_value(v) for k, v in values}
                history["round"].append(done)
                history["accuracy"].append(by_name["accuracy"])
                history["loss"].append(by_name["loss"])
            self.last = time.perf_counter()
            return False, Metrics()

    algorithm = FederatedAveraging()
    algorithm.run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=args.rounds,
            evaluation_frequency=10**9,
            train_cohort_size=args.cohort,
            val_cohort_size=0,
        ),
        backend=backend,
        model=model,
        model_train_params=NNTrainHyperParams(
            local_learning_rate=args.lr, local_num_epochs=1, local_batch_size=args.batch
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=1000),
        callbacks=[Recorder()],
    )
    result = {
        "relative_noise_stddev": float(getattr(mechanism, "_relative_noise_stddev", math.nan)),
        **history,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result))
    return {"final_accuracy": history["accuracy"][-1], "rounds": args.rounds}


def partition_network(archive: Any) -> Any:
    """The exported partition's MLP (784-128-64-10) with its initial weights, pfl's image loss and metrics.

    Its parameters are named as dpfl's ``mlp`` names them (``net.1.weight``, ...), as the archive has them.
    """
    import torch
    from model.pytorch.metrics import image_classification_loss, image_classification_metrics

    network = torch.nn.Sequential()
    network.add_module(
        "net",
        torch.nn.Sequential(
            torch.nn.Flatten(),
            torch.nn.Linear(int(np.prod(archive["x"].shape[1:])), 128),
            torch.nn.ReLU(),
            torch.nn.Linear(128, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 10),
        ),
    )
    names = [str(n) for n in archive["param_names"]]
    network.load_state_dict(
        {name: torch.from_numpy(archive[f"param_{k}"].copy()) for k, name in enumerate(names)}
    )
    network.loss = types.MethodType(image_classification_loss, network)
    network.metrics = types.MethodType(image_classification_metrics, network)
    return network


def local_update(network: Any, *, lr: float, batch: int) -> Any:
    """``update(x, y)``: one epoch of pfl's SGD from ``network``'s weights, trained minus initial.

    As pfl's ``FederatedAveraging.train_one_user`` runs it (its ``sgd_bridge``); the weights are put
    back after each update.
    """
    import torch
    from pfl.data.dataset import Dataset
    from pfl.hyperparam import NNTrainHyperParams
    from pfl.internal.bridge import FrameworkBridgeFactory
    from pfl.model.pytorch import PyTorchModel

    model = PyTorchModel(
        model=network,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(network.parameters(), lr=1.0),
    )
    params = NNTrainHyperParams(local_learning_rate=lr, local_num_epochs=1, local_batch_size=batch)

    def update(x: Any, y: Any) -> dict[str, np.ndarray]:
        initial = model.get_parameters()
        FrameworkBridgeFactory.sgd_bridge().do_sgd(model, Dataset(raw_data=[x, y]), params)
        difference = model.get_model_difference(initial, clone=True)
        model.set_parameters(initial)
        return {name: values.detach().numpy() for name, values in difference.items()}

    return update


def image_update_command(args: argparse.Namespace) -> dict[str, Any]:
    """``image-update``: one local update per named client by pfl's own SGD (its ``sgd_bridge``).

    The exported partition's network and initial weights; each client's examples in the order
    ``numpy.random.default_rng(client).permutation(n)``; one epoch of SGD (``--lr``, ``--batch``) as
    pfl's ``FederatedAveraging.train_one_user`` runs it; the updates (trained minus initial) to ``--out``.
    """
    import torch

    torch.set_num_threads(1)
    use_benchmarks(args.pfl_research)

    archive = np.load(args.data)
    x_all = archive["x"].astype(np.float32) / np.float32(255.0)
    y_all = archive["y"].astype(np.int64)
    offsets = archive["offsets"]
    network = partition_network(archive)
    update = local_update(network, lr=args.lr, batch=args.batch)
    updates: dict[str, np.ndarray] = {}
    for client in args.clients:
        x, y = x_all[offsets[client] : offsets[client + 1]], y_all[offsets[client] : offsets[client + 1]]
        order = np.random.default_rng(client).permutation(len(y))
        for name, values in update(x[order], y[order]).items():
            updates[f"{client}/{name}"] = values
    np.savez(args.out, **updates)
    return {"clients": list(args.clients), "out": str(args.out)}


def without_dropout(network: Any) -> Any:
    """``network`` with every dropout off in training mode too (``nn.Dropout`` and attention's)."""
    import torch

    for module in network.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(module, torch.nn.MultiheadAttention):
            module.dropout = 0.0
    return network


def lm_update_command(args: argparse.Namespace) -> dict[str, Any]:
    """``lm-update``: one local update per named training user by pfl's own SGD, dropout off.

    pfl-research's transformer holding ``--weights``; each user's rows (inputs and targets of the
    HDF5) in the order ``numpy.random.default_rng(index).permutation(n)``; one epoch of SGD as pfl's
    ``FederatedAveraging.train_one_user`` runs it (``--lr``, ``--batch``). Dropout is switched off so
    that the two implementations' updates can be compared value by value. Writes each user's rows,
    order and update to ``--out``.
    """
    import torch

    torch.set_num_threads(1)

    meta = read_hdf5(args.hdf5)
    network = pfl_networks(args.pfl_research, meta["vocabulary_size"], meta["max_sequence_length"])
    network = without_dropout(network["pfl_transformer"])
    weights, state = np.load(args.weights), network.state_dict()
    for key in weights.files:
        state[key] = torch.from_numpy(weights[key])
    network.load_state_dict(state)
    update = local_update(network, lr=args.lr, batch=args.batch)
    users = sorted(meta["partitions"]["train"])[: args.users]
    arrays: dict[str, np.ndarray] = {}
    for index, user in enumerate(users):
        rows = meta["partitions"]["train"][user]
        order = np.random.default_rng(index).permutation(len(rows))
        x, y = torch.from_numpy(rows[order, :-1]), torch.from_numpy(rows[order, 1:])
        for name, values in update(x, y).items():
            arrays[f"{index}/update/{name}"] = values
        arrays[f"{index}/rows"], arrays[f"{index}/order"] = rows, order
    np.savez(args.out, **arrays)
    return {"users": len(users), "out": str(args.out)}


# --------------------------------------------------------------------------------------------------
# One language-model round, for its cost
# --------------------------------------------------------------------------------------------------


def trained_sentences(metrics: Any) -> float | None:
    """The sentences the round's cohort trained on: pfl's ``number of data points``, summed over users.

    pfl keeps it as a ``Weighted`` (each user's count with weight 1), whose overall value is the mean
    per user; the sum is its weighted value.
    """
    for name, value in metrics:
        if str(name).endswith("number of data points"):
            return float(getattr(value, "weighted_value", value))
    return None


def lm_round_command(args: argparse.Namespace) -> dict[str, Any]:
    """``lm-round``: rounds of pfl-research's LM configuration on an HDF5, their wall and CPU time.

    pfl-research's own pieces (its Stack Overflow data set from the HDF5, at most 64 sentences a user;
    its ``lm_transformer``; its ``parse_mechanism``), pfl's ``FederatedAveraging`` with central Adam
    (lr 0.1, eps 0.01, betas 0.9/0.99), ``WeightByUser``, one torch thread, one process. Unlike
    pfl-research's ``lm/pytorch/train.py``, no user is evaluated before and after its training and
    there is no central evaluation: what a round must do, as dpfl's round. Records each round's wall
    and CPU time and the sentences its cohort trained on; ``--progress`` gets a line at each round's end.
    """
    import dataclasses

    import torch

    torch.set_num_threads(1)
    np.random.seed(args.seed)  # noqa: NPY002 - pfl-research's samplers draw from numpy's global state
    torch.manual_seed(args.seed)
    use_benchmarks(args.pfl_research)
    from dataset.stackoverflow.numpy import get_metadata, make_federated_dataset
    from model.pytorch import lm_transformer
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByUser
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel
    from pfl.privacy import CentrallyAppliedPrivacyMechanism
    from utils.argument_parsing import parse_mechanism

    meta = get_metadata(str(args.hdf5))
    training = make_federated_dataset(str(args.hdf5), "train", max_user_sentences=64)
    network = lm_transformer(
        96,
        96,
        8,
        1536,
        3,
        meta["vocab_size"],
        meta["max_sequence_length"],
        meta["pad_symbol"],
        meta["unk_symbol"],
        0.1,
    )
    model = PyTorchModel(
        model=network,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.Adam(network.parameters(), 0.1, eps=0.01, betas=(0.9, 0.99)),
    )
    mechanism = parse_mechanism(
        mechanism_name="gaussian_moments_accountant",
        clipping_bound=1.0,
        epsilon=2.0,
        delta=1e-6,
        order=None,
        cohort_size=args.cohort,
        noise_cohort_size=round(args.cohort * 12.5),
        num_epochs=args.rounds,
        population=1e6,
    )
    backend = SimulatedBackend(
        training_data=training,
        val_data=None,
        postprocessors=[WeightByUser(), CentrallyAppliedPrivacyMechanism(mechanism)],
    )

    class TrainOnly(FederatedAveraging):
        def get_next_central_contexts(self, *a: Any, **k: Any) -> Any:
            contexts, model_, metrics = super().get_next_central_contexts(*a, **k)
            if contexts is not None:
                contexts = tuple(dataclasses.replace(c, do_evaluation=False) for c in contexts)
            return contexts, model_, metrics

    history: dict[str, list[float]] = {"round_s": [], "round_cpu_s": [], "sentences": []}

    class Recorder(TrainingProcessCallback):
        def on_train_begin(self, *, model: Any) -> Metrics:
            self.last, self.cpu = time.perf_counter(), time.process_time()
            return Metrics()

        def after_central_iteration(
            self, aggregate_metrics: Any, model: Any, *, central_iteration: int
        ) -> Any:
            history["round_s"].append(time.perf_counter() - self.last)
            history["round_cpu_s"].append(time.process_time() - self.cpu)
            history["sentences"].append(trained_sentences(aggregate_metrics))
            if args.progress is not None:  # a line per round: the harness reads every process's CPU there
                with args.progress.open("a") as handle:
                    handle.write(json.dumps({"round": central_iteration + 1}) + "\n")
            self.last, self.cpu = time.perf_counter(), time.process_time()
            return False, Metrics()

    TrainOnly().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=args.rounds,
            evaluation_frequency=10**9,
            train_cohort_size=args.cohort,
            val_cohort_size=0,
        ),
        backend=backend,
        model=model,
        model_train_params=NNTrainHyperParams(
            local_learning_rate=0.3, local_num_epochs=1, local_batch_size=16
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=1024),
        callbacks=[Recorder()],
    )
    args.out.write_text(json.dumps(history))
    return {"rounds": args.rounds, "median_round_s": float(np.median(history["round_s"]))}


def main(argv: list[str] | None = None) -> int:
    """Command line (module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    data = sub.add_parser("data")
    data.add_argument("--sqlite", type=Path, required=True)
    data.add_argument("--words", type=Path, required=True)
    data.add_argument("--vocab-size", type=int, required=True)
    data.add_argument("--length", type=int, default=20)
    data.add_argument("--out", type=Path, required=True)
    for name in ("network", "metric", "init", "image-run"):
        sub.add_parser(name)
    parsers = sub.choices
    for name in ("data", "network", "metric", "init", "image-run"):
        parsers[name].add_argument("--pfl-research", type=Path, default=None)
    data.add_argument("--google-federated", type=Path, default=None)
    net = parsers["network"]
    net.add_argument("--vocabulary", type=int, default=10004)
    net.add_argument("--length", type=int, default=20)
    net.add_argument("--batch", type=int, default=4)
    net.add_argument("--seed", type=int, default=0)
    net.add_argument("--out", type=Path, required=True)
    metric = parsers["metric"]
    metric.add_argument("--hdf5", type=Path, required=True)
    metric.add_argument("--steps", type=int, default=200)
    metric.add_argument("--lr", type=float, default=0.5)
    metric.add_argument("--seed", type=int, default=0)
    metric.add_argument("--out", type=Path, required=True)
    init = parsers["init"]
    init.add_argument("--weights", type=Path, required=True)
    init.add_argument("--vocabulary", type=int, required=True)
    init.add_argument("--length", type=int, default=20)
    init.add_argument("--out", type=Path, required=True)
    tokens = sub.add_parser("hdf5-from-tokens")
    tokens.add_argument("--folder", type=Path, required=True)
    tokens.add_argument("--test-users", type=int, default=200)
    tokens.add_argument("--out", type=Path, required=True)
    lm_update = sub.add_parser("lm-update")
    lm_update.add_argument("--pfl-research", type=Path, required=True)
    lm_update.add_argument("--hdf5", type=Path, required=True)
    lm_update.add_argument("--weights", type=Path, required=True)
    lm_update.add_argument("--users", type=int, default=20)
    lm_update.add_argument("--lr", type=float, default=0.3)
    lm_update.add_argument("--batch", type=int, default=16)
    lm_update.add_argument("--out", type=Path, required=True)
    update = sub.add_parser("image-update")
    update.add_argument("--pfl-research", type=Path, required=True)
    update.add_argument("--data", type=Path, required=True)
    update.add_argument("--clients", type=int, nargs="+", required=True)
    update.add_argument("--lr", type=float, default=0.1)
    update.add_argument("--batch", type=int, default=10)
    update.add_argument("--out", type=Path, required=True)
    rounds = sub.add_parser("lm-round")
    rounds.add_argument("--pfl-research", type=Path, required=True)
    rounds.add_argument("--hdf5", type=Path, required=True)
    rounds.add_argument("--cohort", type=int, required=True)
    rounds.add_argument("--rounds", type=int, required=True)
    rounds.add_argument("--seed", type=int, default=0)
    rounds.add_argument("--out", type=Path, required=True)
    rounds.add_argument("--progress", type=Path, default=None, help="a line appended at each round's end")
    image = parsers["image-run"]
    image.add_argument("--data", type=Path, required=True)
    image.add_argument("--out", type=Path, required=True)
    image.add_argument("--rounds", type=int, required=True)
    image.add_argument("--every", type=int, default=5)
    image.add_argument("--seed", type=int, default=0)
    image.add_argument(
        "--mechanism",
        choices=["gaussian_moments_accountant", "norm_clipping_only", "none"],
        default="gaussian_moments_accountant",
        help="pfl-research's central mechanism (the others: clipping without noise, neither)",
    )
    for key, kind, default in (
        ("cohort", int, 50),
        ("noise-cohort", int, 1000),
        ("population", float, 1e6),
        ("clip", float, 0.4),
        ("epsilon", float, 2.0),
        ("delta", float, 1e-6),
        ("lr", float, 0.1),
        ("batch", int, 10),
    ):
        image.add_argument(f"--{key}", type=kind, default=default)
    args = parser.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    commands = {
        "data": data_command,
        "network": network_command,
        "metric": metric_command,
        "init": init_command,
        "hdf5-from-tokens": hdf5_from_tokens_command,
        "image-run": image_run_command,
        "image-update": image_update_command,
        "lm-update": lm_update_command,
        "lm-round": lm_round_command,
    }
    print(json.dumps(commands[args.command](args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
