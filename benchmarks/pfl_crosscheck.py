r"""dpfl against pfl-research on the field's tasks: same data, network, metric, epsilon, learning, cost.

Usage (from the repository root; ``bash scripts/setup_pfl_env.sh`` first, which builds ``.venv-pfl``
with pfl 0.6.0, TensorFlow and h5py)::

    PFL_RESEARCH=<pfl-research checkout or git dir> GOOGLE_FEDERATED=<google-research/federated ...> \\
        .venv/bin/python -P benchmarks/pfl_crosscheck.py --quick          # minutes; one JSON object
    .venv/bin/python -P benchmarks/pfl_crosscheck.py --full               # hours: the recorded comparison
    .venv/bin/python -P benchmarks/pfl_crosscheck.py --quick --only tokens,network,metric
    .venv/bin/python -P benchmarks/pfl_crosscheck.py fixtures   # rewrite tests/data/pfl_crosscheck.json
    .venv/bin/python -P benchmarks/pfl_crosscheck.py doc        # after --full: plots, tables into the page
    .venv/bin/python -P benchmarks/pfl_crosscheck.py image-seeds --seeds 16 --write-doc  # every round

pfl-research's benchmark code (its data script, networks, metrics, LM training script, mechanism
parser) is not on PyPI: ``--pfl-research`` (or ``$PFL_RESEARCH``) names a checkout of
apple/pfl-research or a git directory of it, from which ``benchmarks/`` is extracted with ``git
archive`` into ``.venv-pfl/sources/`` (and reused from there by later runs). TFF's definition of the
Stack Overflow task comes the same way from google-research/federated (``--google-federated``,
``$GOOGLE_FEDERATED``: ``utils/datasets/stackoverflow_word_prediction.py``). Nothing of either is
kept in dpfl; the record names the commits used. pfl's side runs in ``.venv-pfl``
(``benchmarks/pfl_crosscheck_pfl.py``), dpfl's here.

What each check does (``docs/benchmarks/pfl_crosscheck.md`` has the recorded run):

1. **tokens**: a generated corpus of Stack Overflow's shape (:func:`fl_app.data.synthetic_text.styled_corpus`,
   users split into TFF's ``train``/``heldout``/``test``) and a handful of edge-case sentences are
   written in TFF's SQLite layout; dpfl's converter, pfl-research's ``download_preprocess.py`` and
   TFF's ``build_to_ids_fn`` each turn them into token ids given the same word list. Compared: the
   vocabulary and special ids, the users of each split, every sentence's ids.
2. **network**: pfl-research's ``lm_transformer`` (its LM configuration) and ``lm_lstm`` against dpfl's
   ``pfl_transformer`` and ``pfl_lstm`` at 10,004 tokens: parameter counts and names, outputs and loss
   gradients on the same weights and inputs (pfl's state loaded into dpfl's module).
3. **metric**: pfl-research's transformer trained briefly on the corpus, evaluated by pfl on the test
   users; dpfl's evaluation of the same weights on the same sentences, with each set of uncounted
   targets, and the counts that explain the rest token by token.
4. **epsilon**: ``benchmarks/pfl_privacy_check.py``'s ``compare_epsilons``.
5. **learning**: pfl-research's LM configuration scaled (cohort, its noise-cohort ratio, rounds) on the
   generated corpus, run by pfl-research's own ``lm/pytorch/train.py``, and dpfl's
   ``dp_flower``/``FedAdam`` with ``strategy.noise_cohort_size``; DP-FedAvg with pfl-research's image
   configuration at Fashion-MNIST's shape (pfl's ``FederatedAveraging`` and pfl-research's
   ``parse_mechanism``, against dpfl's ``dp_fedavg``). Both start from dpfl's initial weights, three
   seeds each; one plot per task with both bands; the overlap criterion is :func:`overlap`'s.
6. **cost**: rounds of pfl-research's LM configuration (its transformer at 10,004 tokens) on a corpus of
   Stack Overflow's shape whose users all hold 64 sentences (so every arm's round trains the same
   ``cohort x 64`` sentences): pfl (one process), dpfl (``simulation.backend=processes``) and a tight
   single-process PyTorch loop, interleaved; every process's CPU read at each round's end
   (``benchmarks/process_cpu.py``'s sampler finds them, :func:`watch_rounds` reads them), CPU per
   round over rounds 2..R-1.

Prints one JSON object (``tokens_equal``, ``network_equal``, ``metric_equal``, ``epsilon_equal``,
``curves_overlap``, ``round_time_ratio`` and the details); exit status 0 only when the five hold.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DPFL_PYTHON = ROOT / ".venv" / "bin" / "python"
PFL_PYTHON = ROOT / ".venv-pfl" / "bin" / "python"
PFL_SIDE = ROOT / "benchmarks" / "pfl_crosscheck_pfl.py"
FIXTURE = ROOT / "tests" / "data" / "pfl_crosscheck.json"
LENGTH = 20
#: Tolerances: network outputs (float32, fused against plain kernels) and the metric (the issue's 1e-6).
OUTPUT_TOLERANCE = 1e-5
METRIC_TOLERANCE = 1e-6
#: pfl-research's LM configuration: cohort 400, noise cohort 5,000 (a ratio of 12.5), population 1e6.
NOISE_COHORT_RATIO = 5000 / 400
POPULATION = 1_000_000


@dataclass(frozen=True)
class Sizes:
    """How big each check runs (``--quick`` or ``--full``)."""

    users: int  # generated corpus users (all splits)
    vocab_size: int  # words in the fixed word list
    metric_steps: int  # pfl-side SGD steps before the metric
    lm_cohort: int
    lm_rounds: int
    lm_every: int
    image_rounds: int
    image_every: int
    seeds: int
    cost_users: int
    cost_cohort: int
    cost_rounds: int  # rounds of each cost run; CPU a round over rounds 2..R-1
    cost_repeats: int


QUICK = Sizes(600, 36, 100, 20, 12, 4, 20, 5, 3, 200, 10, 6, 1)
#: The recorded run: the issue's smallest LM scale (cohort 50, 100 rounds), which fits a shared 2-core box.
FULL = Sizes(3000, 36, 300, 50, 100, 10, 150, 10, 3, 2000, 50, 6, 2)


# --------------------------------------------------------------------------------------------------
# Sources of pfl-research and TFF's task code
# --------------------------------------------------------------------------------------------------


def git_commit(folder: Path) -> str | None:
    """The commit ``HEAD`` of a checkout or git directory (None: not git)."""
    for args in (["--git-dir", str(folder)], ["-C", str(folder)]):
        done = subprocess.run(
            ["git", *args, "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        )
        if done.returncode == 0:
            return done.stdout.strip()
    return None


def extracted(source: Path | None, paths: Sequence[str], target: Path) -> dict[str, Any]:
    """``paths`` of a checkout or git directory, under ``target`` (extracted once with ``git archive``).

    Returns ``{"path": folder or None, "commit": ..., "how": ...}``; a checkout holding the paths is
    used in place.
    """
    marker = target / ".commit"
    if source is None:
        if marker.exists():
            return {
                "path": target,
                "commit": marker.read_text().strip(),
                "how": f"extracted earlier to {target}",
            }
        return {
            "path": None,
            "commit": None,
            "how": "not given (--pfl-research / --google-federated or the env)",
        }
    source = source.expanduser().resolve()
    if all((source / p).exists() for p in paths):
        return {"path": source, "commit": git_commit(source), "how": f"checkout {source}"}
    commit = git_commit(source)
    if commit is None:
        return {
            "path": None,
            "commit": None,
            "how": f"{source} is neither a checkout holding {paths[0]} nor git",
        }
    if marker.exists() and marker.read_text().strip() == commit:
        return {"path": target, "commit": commit, "how": f"git archive of {source}"}
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "--git-dir", str(source), "archive", "HEAD", *paths], capture_output=True, check=False
    )
    if not archive.stdout:
        return {"path": None, "commit": commit, "how": f"git archive failed: {archive.stderr[-300:]!r}"}
    subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    marker.write_text(commit)
    return {"path": target, "commit": commit, "how": f"git archive of {source}"}


def sources(args: argparse.Namespace, out: Path) -> dict[str, dict[str, Any]]:
    """pfl-research's ``benchmarks/`` and TFF's task module, from the arguments or the environment."""
    cache = ROOT / ".venv-pfl" / "sources"  # beside the environment that runs it, outside the tree's code

    def given(value: Path | None, variable: str) -> Path | None:
        return (
            value if value is not None else (Path(os.environ[variable]) if os.environ.get(variable) else None)
        )

    pfl = extracted(given(args.pfl_research, "PFL_RESEARCH"), ["benchmarks"], cache / "pfl-research")
    if pfl["path"] is not None:
        pfl["benchmarks"] = pfl["path"] / "benchmarks"
    tff = extracted(
        given(args.google_federated, "GOOGLE_FEDERATED"),
        ["utils/datasets/stackoverflow_word_prediction.py"],
        cache / "google-research-federated",
    )
    return {"pfl_research": pfl, "google_federated": tff}


def pfl_side(*args: str, timeout: float = 3600) -> dict[str, Any]:
    """Run a subcommand of ``benchmarks/pfl_crosscheck_pfl.py`` in ``.venv-pfl``; its last line's JSON."""
    command = [str(PFL_PYTHON), "-P", str(PFL_SIDE), *args]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, check=False, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:1])} (pfl side) failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def jsonable(value: Any) -> Any:
    """Paths and numpy scalars as JSON values."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value.relative_to(ROOT)) if value.is_relative_to(ROOT) else str(value)
    if isinstance(value, np.generic):
        return value.item()
    return value


# --------------------------------------------------------------------------------------------------
# 1. Same data
# --------------------------------------------------------------------------------------------------

#: Sentences where tokenizers that agree on clean text could differ (an edge-case corpus of its own).
EDGE_CASES: dict[str, dict[str, list[str]]] = {
    "train": {
        "edge_case_a": [
            "w1 w2 w3",
            "Hello World w1",
            "W1 w2",
            "w1  w2",
            " w1 w2 ",
            "w1\tw2 w3",
            "w1\u00a0w2",
            "",
            "EOS w1 BOS",
            "PAD UNK",
        ],
        "edge_case_b": [
            " ".join(f"w{i % 30}" for i in range(20)),
            " ".join(f"w{i % 30}" for i in range(25)),
            " ".join(f"w{i % 30}" for i in range(19)),
        ],
    },
    "heldout": {"edge_case_c": ["w3 w4 w5 zzz"]},
    "test": {"edge_case_d": ["w7 w8", "w9"]},
}


def split_of(user: str) -> str:
    """TFF-like split of a generated user: 10 % test, 10 % heldout (by a hash of the id), else train."""
    bucket = int(hashlib.sha256(user.encode()).hexdigest()[:8], 16) % 10
    return "test" if bucket == 0 else "heldout" if bucket == 1 else "train"


def write_corpora(folder: Path, users: int, vocab_size: int) -> dict[str, Any]:
    """``so.sqlite`` (the generated corpus), ``edge.sqlite`` and the word list ``words.txt``."""
    from fl_app.data.synthetic_text import styled_corpus
    from tests.text_corpora import write_tff_sqlite

    folder.mkdir(parents=True, exist_ok=True)
    ids, texts = styled_corpus(users, seed=0)
    splits: dict[str, list[tuple[str, str]]] = {"train": [], "heldout": [], "test": []}
    for user, text in zip(ids, texts, strict=True):
        splits[split_of(user)].append((user, text))
    for path in (folder / "so.sqlite", folder / "edge.sqlite"):
        path.unlink(missing_ok=True)
    write_tff_sqlite(splits, folder / "so.sqlite")
    edge = {s: [(u, t) for u, ts in users_.items() for t in ts] for s, users_ in EDGE_CASES.items()}
    write_tff_sqlite(edge, folder / "edge.sqlite")
    users_per_word: Counter[str] = Counter()
    by_user: dict[str, set[str]] = {}
    for user, text in splits["train"]:
        by_user.setdefault(user, set()).update(text.split(" "))
    for words in by_user.values():
        users_per_word.update(words)
    ranked = sorted(users_per_word.items(), key=lambda kv: (-kv[1], kv[0]))
    (folder / "words.txt").write_text("".join(f"{w} {n}\n" for w, n in ranked))
    return {
        "users": {s: len({u for u, _ in rows}) for s, rows in splits.items()},
        "sentences": {s: len(rows) for s, rows in splits.items()},
        "distinct_words": len(ranked),
        "word_list": [w for w, _ in ranked[:vocab_size]],
    }


def dpfl_tokens(sqlite: Path, words: Path, vocab_size: int, home: Path) -> dict[str, Any]:
    """The conversion of ``sqlite`` by dpfl (train with test, and train with heldout as the test split)."""
    os.environ["DPFL_DATA_HOME"] = str(home)
    from fl_app.data.text import load_text_corpus, text_source

    out: dict[str, Any] = {}
    for test_split in ("test", "heldout"):
        options = {
            "name": "stackoverflow",
            "path": str(sqlite),
            "split": "train",
            "test_split": test_split,
            "text_column": "tokens",
            "level": "word",
            "vocab_size": vocab_size,
            "vocabulary": str(words),
            "sequence_length": LENGTH,
            "max_sequences_per_user": None,
        }
        with contextlib.redirect_stdout(sys.stderr):  # its one line about the conversion
            corpus = load_text_corpus(text_source(options, {"column": "client_id"}))
        out["vocabulary"] = corpus.vocabulary
        for split, part in (("train", corpus.train), (test_split, corpus.test)):
            out[split] = [np.asarray(part.rows(u), dtype=np.int64) for u in range(part.users)]
    return out


def sqlite_users(sqlite: Path) -> dict[str, list[str]]:
    """Each split's users in dpfl's order (``ORDER BY client_id``: SQLite's byte order)."""
    import sqlite3

    connection = sqlite3.connect(f"file:{sqlite}?mode=ro", uri=True)
    rows = connection.execute("SELECT DISTINCT split_name, client_id FROM client_metadata ORDER BY client_id")
    users: dict[str, list[str]] = {}
    for split, user in rows:
        users.setdefault(str(split), []).append(str(user))
    connection.close()
    return users


def unpack(archive: Any, prefix: str) -> dict[str, np.ndarray]:
    """The users' rows stored by the pfl side's ``pack``."""
    if f"{prefix}_users" not in archive.files:
        return {}
    users, offsets, rows = archive[f"{prefix}_users"], archive[f"{prefix}_offsets"], archive[f"{prefix}_rows"]
    return {str(u): rows[offsets[i] : offsets[i + 1]] for i, u in enumerate(users)}


def edge_texts() -> dict[tuple[str, int], str]:
    """Each edge-case sentence by (user, position)."""
    return {(u, i): t for users in EDGE_CASES.values() for u, ts in users.items() for i, t in enumerate(ts)}


def compare_tokens(
    sqlite: Path, dpfl: dict[str, Any], pfl: Any, *, texts: dict[tuple[str, int], str] | None = None
) -> dict[str, Any]:
    """Vocabulary, special ids, users per split and every sentence's ids: dpfl, pfl-research, TFF.

    ``pfl`` is the pfl side's ``tokens.npz`` (``pfl_<partition>`` rows from the HDF5, ``tff_<split>``
    from TFF's ``to_ids``). Returns the counts, whether each pair agrees, and every differing sentence
    (with its text when ``texts`` has it) with the sides that follow TFF's definition.
    """
    vocabulary = dpfl["vocabulary"]
    pfl_vocab = dict(
        zip(pfl["pfl_vocabulary_words"].tolist(), pfl["pfl_vocabulary_ids"].tolist(), strict=True)
    )
    dpfl_vocab = {
        "PAD": 0,
        **vocabulary.ids(),
        "UNK": vocabulary.oov,
        "BOS": vocabulary.bos,
        "EOS": vocabulary.eos,
    }
    vocab_diff = sorted(set(pfl_vocab.items()) ^ set(dpfl_vocab.items()))
    users = sqlite_users(sqlite)
    report: dict[str, Any] = {
        "vocabulary_equal": not vocab_diff,
        "vocabulary_differences": vocab_diff[:20],
        "specials": {
            "dpfl": {k: dpfl_vocab[k] for k in ("PAD", "UNK", "BOS", "EOS")},
            "pfl": {k: pfl_vocab.get(k) for k in ("PAD", "UNK", "BOS", "EOS")},
        },
        "splits": {},
        "differences": [],
    }
    have_tff = any(name.startswith("tff_") for name in pfl.files)
    for split, partition in (("train", "train"), ("test", "test"), ("heldout", "val")):
        ids = users.get(split, [])
        dpfl_rows = dict(zip(ids, dpfl.get(split, []), strict=True))
        pfl_rows, tff_rows = unpack(pfl, f"pfl_{partition}"), unpack(pfl, f"tff_{split}")
        sentences = equal_pfl = equal_tff = 0
        for user in ids:
            mine, theirs = dpfl_rows[user], pfl_rows.get(user)
            tff = tff_rows.get(user)
            for i, row in enumerate(mine):
                sentences += 1
                p = None if theirs is None or i >= len(theirs) else theirs[i]
                t = None if tff is None or i >= len(tff) else tff[i]
                same_pfl = p is not None and np.array_equal(row, p)
                same_tff = t is not None and np.array_equal(row, t)
                equal_pfl += same_pfl
                equal_tff += same_tff
                if not same_pfl or (have_tff and not same_tff):
                    follows = [
                        n
                        for n, v in (("dpfl", row), ("pfl-research", p))
                        if t is not None and v is not None and np.array_equal(v, t)
                    ]
                    report["differences"].append(
                        {
                            "split": split,
                            "user": user,
                            "sentence": i,
                            "text": (texts or {}).get((user, i)),
                            "dpfl": row.tolist(),
                            "pfl_research": None if p is None else p.tolist(),
                            "tff": None if t is None else t.tolist(),
                            "follows_tff": follows if t is not None else None,
                        }
                    )
        report["splits"][split] = {
            "pfl_partition": partition,
            "users_dpfl": len(ids),
            "users_pfl": len(pfl_rows),
            "same_users": sorted(ids) == sorted(pfl_rows),
            "same_users_tff": sorted(ids) == sorted(tff_rows) if have_tff else None,
            "sentences": sentences,
            "equal_to_pfl": equal_pfl,
            "equal_to_tff": equal_tff if have_tff else None,
        }
    report["tff_compared"] = have_tff
    return report


def tokens_check(work: Path, sizes: Sizes, src: dict[str, Any]) -> dict[str, Any]:
    """Check 1: the generated corpus and the edge cases through the three tokenizers."""
    corpus = write_corpora(work / "corpus", sizes.users, sizes.vocab_size)
    words = work / "corpus" / "words.txt"
    result: dict[str, Any] = {"corpus": {k: v for k, v in corpus.items() if k != "word_list"}}
    for name, texts in (("so", None), ("edge", edge_texts())):
        sqlite = work / "corpus" / f"{name}.sqlite"
        dpfl = dpfl_tokens(sqlite, words, sizes.vocab_size, work / "dpfl_home")
        args = ["data", "--sqlite", str(sqlite), "--words", str(words), "--vocab-size", str(sizes.vocab_size)]
        args += ["--out", str(work / f"pfl_{name}")]
        if src["pfl_research"]["path"] is not None:
            args += ["--pfl-research", str(src["pfl_research"]["benchmarks"])]
        if src["google_federated"]["path"] is not None:
            args += ["--google-federated", str(src["google_federated"]["path"])]
        side = pfl_side(*args)
        report = compare_tokens(sqlite, dpfl, np.load(work / f"pfl_{name}" / "tokens.npz"), texts=texts)
        report["pfl_side"] = side
        result[name] = report
    so, edge = result["so"], result["edge"]
    clean = (
        so["vocabulary_equal"]
        and not so["differences"]
        and all(s["same_users"] for s in so["splits"].values())
    )
    edge_follow_tff = all("dpfl" in (d["follows_tff"] or []) for d in edge["differences"])
    result["equal"] = bool(clean and so["tff_compared"] and edge_follow_tff)
    result["reading"] = (
        "tokens_equal: on the generated corpus dpfl's ids equal pfl-research's (its own script) and TFF's "
        "(its own to_ids) for every sentence, with the same vocabulary, specials and users per split; on the "
        "edge cases every difference is pfl-research's and dpfl follows TFF"
    )
    result["hdf5"] = str(work / "pfl_so" / "stackoverflow.hdf5")
    return result


# --------------------------------------------------------------------------------------------------
# 2. Same network
# --------------------------------------------------------------------------------------------------


def compare_networks(archive: Any, summary: dict[str, Any]) -> dict[str, Any]:
    """The ``pfl_transformer``/``pfl_lstm`` of dpfl with pfl-research's state: counts, outputs, gradients."""
    import torch

    from fl_app.learning.models import build_model
    from fl_app.learning.sequence import NextToken

    inputs = torch.from_numpy(archive["inputs"])
    targets = torch.from_numpy(archive["targets"])
    out: dict[str, Any] = {}
    for name, theirs in summary.items():
        prefix = f"{name}/state/"
        state = {
            k[len(prefix) :]: torch.from_numpy(archive[k]) for k in archive.files if k.startswith(prefix)
        }
        vocabulary = state["_embeddings.weight"].shape[0]
        network = build_model(name, (inputs.shape[1],), vocabulary).eval()
        skipped = sorted(set(state) - set(network.state_dict()))
        network.load_state_dict({k: v for k, v in state.items() if k not in skipped}, strict=True)
        loss = NextToken().loss(network(inputs), targets)  # mean over non-pad targets, as pfl's loss
        network.zero_grad()
        loss.backward()
        with torch.no_grad():
            outputs = network(inputs)
        expected = torch.from_numpy(archive[f"{name}/outputs"])
        grads = {
            k: float((p.grad - torch.from_numpy(archive[f"{name}/grad/{k}"])).abs().max())
            for k, p in network.named_parameters()
        }
        out[name] = {
            "parameters_pfl": theirs["parameters"],
            "parameters_dpfl": int(sum(p.numel() for p in network.parameters())),
            "same_names_and_shapes": {k: list(p.shape) for k, p in network.named_parameters()}
            == theirs["shapes"],
            "pfl_buffers_not_loaded": skipped,
            "max_output_difference": float((outputs - expected).abs().max()),
            "max_output": float(expected.abs().max()),
            "loss_pfl": theirs["loss"],
            "loss_dpfl": float(loss.detach()),
            "max_gradient_difference": max(grads.values()),
        }
        entry = out[name]
        entry["equal"] = bool(
            entry["parameters_pfl"] == entry["parameters_dpfl"]
            and entry["same_names_and_shapes"]
            and entry["max_output_difference"] <= OUTPUT_TOLERANCE * max(1.0, entry["max_output"])
            and abs(entry["loss_pfl"] - entry["loss_dpfl"]) <= OUTPUT_TOLERANCE
            and entry["max_gradient_difference"] <= OUTPUT_TOLERANCE
        )
    return out


def network_check(work: Path, src: dict[str, Any]) -> dict[str, Any]:
    """Check 2 at pfl-research's LM configuration (10,004 tokens, sequences of 20)."""
    if src["pfl_research"]["path"] is None:
        return {
            "equal": None,
            "reason": f"pfl-research's benchmarks code not available: {src['pfl_research']['how']}",
        }
    path = work / "networks.npz"
    summary = pfl_side(
        "network", "--pfl-research", str(src["pfl_research"]["benchmarks"]), "--out", str(path)
    )
    result = compare_networks(np.load(path), summary)
    result["equal"] = all(v["equal"] for v in result.values())
    result["vocabulary"], result["length"] = 10004, LENGTH
    return result


# --------------------------------------------------------------------------------------------------
# 3. Same metric
# --------------------------------------------------------------------------------------------------


def dpfl_metrics(weights: Any, rows: np.ndarray, vocabulary: Any) -> dict[str, Any]:
    """Dpfl evaluating pfl's weights on ``rows`` (each set of uncounted targets), and per-kind counts."""
    import torch

    from fl_app.data.text_tokens import PAD
    from fl_app.learning.models import build_model
    from fl_app.learning.sequence import NextToken, evaluate_next_token, token_tensor

    state = {k: torch.from_numpy(weights[k]) for k in weights.files if k != "_positional_encoder.pe"}
    network = build_model("pfl_transformer", (LENGTH,), vocabulary.size)
    network.load_state_dict(state)
    x, y = rows[:, :-1], rows[:, 1:]
    sets = {
        "pad": (PAD,),
        "pad, unknown": (PAD, vocabulary.oov),
        "pad, end (dpfl's default without out of vocabulary)": (PAD, vocabulary.eos),
        "pad, unknown, end (dpfl's Stack Overflow default)": (PAD, vocabulary.oov, vocabulary.eos),
    }
    out: dict[str, Any] = {"accuracy": {}}
    for label, uncounted in sets.items():
        loss, accuracy = evaluate_next_token(network, NextToken(uncounted), x, y, batch_size=1024)
        out["accuracy"][label] = accuracy
        out["loss"] = loss
    network.eval()
    with torch.no_grad():
        predicted = torch.cat(
            [network(token_tensor(x[s : s + 1024])).argmax(-1) for s in range(0, len(x), 1024)]
        )
    targets = token_tensor(y)
    kinds = {
        "pad": targets == PAD,
        "unknown": targets == vocabulary.oov,
        "end": targets == vocabulary.eos,
        "begin": targets == vocabulary.bos,
    }
    kinds["word"] = ~(kinds["pad"] | kinds["unknown"] | kinds["end"] | kinds["begin"])
    correct = predicted == targets
    out["targets"] = {
        k: {"count": int(m.sum()), "correct": int((m & correct).sum())} for k, m in kinds.items()
    }
    return out


def metric_check(work: Path, src: dict[str, Any], sizes: Sizes, hdf5: Path) -> dict[str, Any]:
    """Check 3: pfl's metrics of briefly trained weights against dpfl's on the same test sentences."""
    if src["pfl_research"]["path"] is None:
        return {
            "equal": None,
            "reason": f"pfl-research's benchmarks code not available: {src['pfl_research']['how']}",
        }
    weights_path = work / "metric_weights.npz"
    side = pfl_side(
        "metric",
        "--pfl-research",
        str(src["pfl_research"]["benchmarks"]),
        "--hdf5",
        str(hdf5),
        "--steps",
        str(sizes.metric_steps),
        "--out",
        str(weights_path),
    )
    dpfl = dpfl_tokens(
        work / "corpus" / "so.sqlite", work / "corpus" / "words.txt", sizes.vocab_size, work / "dpfl_home"
    )
    rows = np.concatenate(dpfl["test"])
    mine = dpfl_metrics(np.load(weights_path), rows, dpfl["vocabulary"])
    theirs = side["metrics"]
    pairs = {
        "loss (pad left out)": (mine["loss"], theirs["loss"]["value"]),
        "accuracy (pfl: every non-pad target)": (mine["accuracy"]["pad"], theirs["accuracy"]["value"]),
        "accuracy wo unk (pfl)": (mine["accuracy"]["pad, unknown"], theirs["accuracy wo unk"]["value"]),
    }
    t = mine["targets"]
    default = mine["accuracy"]["pad, unknown, end (dpfl's Stack Overflow default)"]
    rebuilt = (theirs["accuracy wo unk"]["weighted_value"] - t["end"]["correct"]) / (
        theirs["accuracy wo unk"]["weight"] - t["end"]["count"]
    )
    result = {
        "pairs": {k: {"dpfl": a, "pfl": b, "difference": abs(a - b)} for k, (a, b) in pairs.items()},
        "dpfl": mine,
        "pfl": theirs,
        "pfl_side": {k: v for k, v in side.items() if k != "metrics"},
        "dpfl_default_from_pfl_counts": {
            "rebuilt": rebuilt,
            "dpfl": default,
            "difference": abs(rebuilt - default),
        },
        "reading": (
            "pfl-research's loss and dpfl's both average over the non-pad targets (end of sentence and "
            "unknown counted; begin is never a target). pfl's 'accuracy' counts every non-pad target, its "
            "'accuracy wo unk' also leaves out the unknown token; dpfl's Stack Overflow default also leaves "
            "out the end of sentence (TFF's accuracy_no_oov_or_eos, the DP-FTRL and MF papers' metric): "
            "pfl's 'accuracy wo unk' "
            "less the end-of-sentence targets and their correct predictions is dpfl's default. "
            "dataset.accuracy_without_eos=false gives pfl's conventions by name."
        ),
    }
    same_counts = (
        t["pad"]["count"] + sum(v["count"] for k, v in t.items() if k != "pad") == rows.shape[0] * LENGTH
    )
    result["equal"] = bool(
        all(v["difference"] <= METRIC_TOLERANCE for v in result["pairs"].values())
        and result["dpfl_default_from_pfl_counts"]["difference"] <= METRIC_TOLERANCE
        and same_counts
        and side["test_sentences"] == len(rows)
    )
    return result


# --------------------------------------------------------------------------------------------------
# 4. Same privacy (benchmarks/pfl_privacy_check.py)
# --------------------------------------------------------------------------------------------------


def epsilon_check(quick: bool) -> dict[str, Any]:
    """``compare_epsilons`` of ``benchmarks/pfl_privacy_check.py`` when that script is there."""
    try:
        from benchmarks.pfl_privacy_check import compare_epsilons
    except ImportError as error:
        return {"epsilon_equal": None, "reason": f"benchmarks/pfl_privacy_check.py not importable: {error}"}
    try:
        return compare_epsilons(quick=quick)
    except Exception as error:  # reported, not raised: the other checks still print
        return {"epsilon_equal": None, "reason": f"compare_epsilons failed: {type(error).__name__}: {error}"}


# --------------------------------------------------------------------------------------------------
# Running commands with every process's CPU counted
# --------------------------------------------------------------------------------------------------


#: How often the round watcher looks for a new line in a run's progress file (seconds).
WATCH_S = 0.05


def process_seconds(pid: int, start: int) -> float | None:
    """The CPU time (user + system) of process ``pid`` started at ``start`` (clock ticks); None: gone."""
    from benchmarks.process_cpu import TICKS

    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    if int(fields[19]) != start:  # the pid was reused
        return None
    return (int(fields[11]) + int(fields[12])) / TICKS


def cpu_by_process(seen: dict[tuple[int, int], list]) -> dict[int, float]:
    """Every process of the command seen so far: its CPU now (its last sample when it has ended)."""
    now: dict[int, float] = {}
    for (pid, start), entry in list(seen.items()):
        fresh = process_seconds(pid, start)
        now[pid] = entry[2] if fresh is None else fresh
    return now


def watch_rounds(
    stop: threading.Event, progress: Path, seen: dict[tuple[int, int], list], marks: list[dict[str, Any]]
) -> None:
    """Until ``stop``: at each new line of ``progress`` (a round ended), every process's CPU and the time.

    The processes are those the ``/proc`` sampler has found (it looks every half second; a run's
    processes start before its first round ends). Polled every :data:`WATCH_S`, so a mark is late by at
    most that much; CPU per round over rounds ``a..b`` is the difference of two marks.
    """
    lines, size, started = 0, -1, time.perf_counter()
    while not stop.wait(WATCH_S):
        try:
            now = progress.stat().st_size
        except OSError:
            continue
        if now == size:
            continue
        size = now
        count = progress.read_bytes().count(b"\n")
        if count > lines:
            mark = {"at_s": time.perf_counter() - started, "cpu_s": cpu_by_process(seen)}
            marks.extend(mark for _ in range(count - lines))
            lines = count


def measured(
    command: Sequence[str],
    log: Path,
    *,
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
    progress: Path | None = None,
) -> dict[str, Any]:
    """Run ``command``; its wall time and the CPU of every process it started (``process_cpu``'s sampler).

    With ``progress`` (a file the command appends a line to at each round's end), ``marks`` holds, for
    each round, the time it ended and every process's CPU then (:func:`watch_rounds`).
    """
    from benchmarks.process_cpu import MARK, sample

    seen: dict[tuple[int, int], list] = {}
    marks: list[dict[str, Any]] = []
    stop, token = threading.Event(), uuid.uuid4().hex
    threads = [threading.Thread(target=sample, args=(stop, token, seen), daemon=True)]
    if progress is not None:
        progress.unlink(missing_ok=True)
        threads.append(threading.Thread(target=watch_rounds, args=(stop, progress, seen, marks), daemon=True))
    log.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    for thread in threads:
        thread.start()
    start = time.perf_counter()
    with log.open("w") as handle:
        code = subprocess.call(
            list(command),
            cwd=cwd,
            stdout=handle,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {}), MARK: token},
        )
    wall = time.perf_counter() - start
    stop.set()
    for thread in threads:
        thread.join()
    cpu = sum(entry[2] for entry in seen.values())
    return {
        "exit": code,
        "wall_s": wall,
        "cpu_s": cpu,
        "processes": len(seen),
        "load_1min": [load, os.getloadavg()[0]],
        **({"marks": marks} if progress is not None else {}),
    }


def dpfl_rounds(output: Path) -> dict[str, Any]:
    """A dpfl run's evaluated rounds (round, accuracy, loss), round durations and noise multiplier."""
    results = json.loads((output / "results.json").read_text())
    evaluated = [r for r in results["rounds"] if r.get("accuracy") is not None]
    hidden = {r["round"]: r for r in (results.get("outside_guarantee") or {}).get("rounds", [])}
    durations = [
        r.get("round_s", hidden.get(r["round"], {}).get("secret_cohort_round_s")) for r in results["rounds"]
    ]
    return {
        "status": results["status"],
        "round": [r["round"] for r in evaluated],
        "accuracy": [r["accuracy"] for r in evaluated],
        "loss": [r.get("loss") for r in evaluated],
        "round_s": durations,
        "epsilon": results["final"].get("epsilon"),
        "privacy": {
            k: v
            for k, v in (results.get("privacy") or {}).items()
            if k in ("noise_multiplier", "deployment", "statement")
        },
    }


def median_after_first(values: Sequence[float | None]) -> float | None:
    """Median of rounds 2..R (the first pays warm-up)."""
    rest = [v for v in values[1:] if v is not None]
    return statistics.median(rest) if rest else None


# --------------------------------------------------------------------------------------------------
# 5. Same learning
# --------------------------------------------------------------------------------------------------


#: dpfl's DP-FedAvg around pfl-research's central Adam (lr 0.1, betas 0.9 / 0.99, eps 0.01), as its LM
#: configuration steps the server (``benchmarks/pfl_central_adam.py``).
PFL_SERVER_STEP = (
    "strategy=dp_flower",
    "strategy.flower=benchmarks.pfl_central_adam:PflCentralAdam",
    "+strategy.kwargs.eta=0.1",
    "+strategy.kwargs.beta_1=0.9",
    "+strategy.kwargs.beta_2=0.99",
    "+strategy.kwargs.tau=0.01",
)


def lm_overrides(corpus: Path, sizes: Sizes, seed: int, train_users: int) -> list[str]:
    """The overrides of dpfl's run of pfl-research's LM configuration, scaled (check 5 of the docstring)."""
    noise_cohort = round(sizes.lm_cohort * NOISE_COHORT_RATIO)
    return [
        "dataset=stackoverflow",
        f"dataset.path={corpus / 'so.sqlite'}",
        f"dataset.vocabulary={corpus / 'words.txt'}",
        f"dataset.vocab_size={sizes.vocab_size}",
        "dataset.vocabulary_public=true",
        "dataset.test_split=heldout",
        "dataset.max_sequences_per_user=64",
        "dataset.accuracy_without_eos=false",
        "partition=natural",
        f"num_clients={train_users}",
        f"clients_per_round={sizes.lm_cohort}",
        "model=pfl_transformer",
        *PFL_SERVER_STEP,
        f"+strategy.kwargs.warmup={warmup_rounds(sizes.lm_rounds)}",
        "strategy.sampling=fixed",
        "strategy.clip=1.0",
        f"strategy.noise_cohort_size={noise_cohort}",
        f"strategy.noise_population={POPULATION}",
        "privacy.epsilon=2",
        "privacy.delta=1e-6",
        f"num_rounds={sizes.lm_rounds}",
        "local_epochs=1",
        "batch_size=16",
        "lr=0.3",
        f"evaluation.every={sizes.lm_every}",
        f"seed={seed}",
    ]


def warmup_rounds(rounds: int) -> int:
    """pfl-research's central warm-up (50 of its 2,000 iterations) scaled to ``rounds``, at least 1."""
    return max(1, round(50 * rounds / 2000))


def pfl_lm_command(benchmarks: Path, hdf5: Path, sizes: Sizes, seed: int, restore: Path) -> list[str]:
    """pfl-research's ``lm/pytorch/train.py`` with its ``baseline.yaml``, scaled, central DP on."""
    warmup = warmup_rounds(sizes.lm_rounds)
    return [
        str(PFL_PYTHON),
        "-m",
        "lm.pytorch.train",
        "--args_config",
        str(benchmarks / "lm/configs/baseline.yaml"),
        "--data_path",
        str(hdf5),
        "--cohort_size",
        str(sizes.lm_cohort),
        "--noise_cohort_size",
        str(round(sizes.lm_cohort * NOISE_COHORT_RATIO)),
        "--population",
        str(float(POPULATION)),
        "--central_num_iterations",
        str(sizes.lm_rounds),
        "--central_privacy_mechanism",
        "gaussian_moments_accountant",
        "--evaluation_frequency",
        "1",  # every round: dpfl's rounds (every lm_every-th) are among them
        "--central_data_fraction",
        "1.0",
        "--central_lr_num_warmup_iterations",
        str(warmup),
        "--seed",
        str(seed),
        "--restore_model_path",
        str(restore),
    ]


def pfl_lm_curve(run: Path) -> dict[str, Any]:
    """pfl-research's ``metrics.csv``: rounds done (iteration + 1), 'accuracy wo unk', loss, durations."""
    import csv

    with (run / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    evaluated = [r for r in rows if r.get("Central val | accuracy wo unk")]
    return {
        "round": [int(r["central_iteration"]) + 1 for r in evaluated],
        "accuracy": [float(r["Central val | accuracy wo unk"]) for r in evaluated],
        "loss": [float(r["Central val | loss"]) for r in evaluated],
        "round_s": [
            float(r["duration of iteration (s)"]) for r in rows if r.get("duration of iteration (s)")
        ],
    }


def completed_lm_runs(
    pfl_dir: Path, dpfl_dir: Path, sizes: Sizes
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Both sides' curves of an LM seed whose two runs went through all their rounds, else None."""
    if not (pfl_dir / "metrics.csv").exists() or not (dpfl_dir / "results.json").exists():
        return None
    pfl, dpfl = pfl_lm_curve(pfl_dir), dpfl_rounds(dpfl_dir)
    if len(pfl["round"]) != sizes.lm_rounds or dpfl.get("status") != "completed":  # pfl evaluates every round
        return None
    return {"exit": 0, **pfl}, {"exit": 0, **dpfl}


def initial_weights(overrides: Sequence[str], path: Path) -> int:
    """The initial model of ``overrides`` (``Strategy.initial_arrays``) as an ``.npz``; the clients."""
    from fl_app.run.harness import run_context_for
    from strategies import STRATEGIES

    with tempfile.TemporaryDirectory() as scratch, contextlib.redirect_stdout(sys.stderr):
        run = run_context_for([*overrides, "strategy=fedavg"], Path(scratch))
        initial = STRATEGIES.get("fedavg")(run).initial_arrays()
    np.savez(path, **{name: initial[name].numpy() for name in initial})
    return len(run.data.client_sizes())


def lm_learning(
    work: Path,
    sizes: Sizes,
    src: dict[str, Any],
    hdf5: Path,
    train_users: int,
    seeds: Sequence[int] | None = None,
    *,
    reuse: bool = False,
) -> dict[str, Any]:
    """pfl-research's scaled LM configuration and dpfl's, interleaved per seed, from the same weights.

    ``seeds``: default ``1..sizes.seeds``; ``reuse``: a seed whose two runs completed in ``work`` is
    read back instead of run again.
    """
    corpus, runs = work / "corpus", work / "learning_lm"
    out: dict[str, Any] = {"pfl": [], "dpfl": [], "commands": {}}
    for seed in seeds if seeds is not None else range(1, sizes.seeds + 1):
        pfl_dir, dpfl_dir = runs / f"pfl-{seed}", runs / f"dpfl-{seed}"
        done = completed_lm_runs(pfl_dir, dpfl_dir, sizes) if reuse else None
        if done is not None:
            out["pfl"].append(done[0])
            out["dpfl"].append(done[1])
            continue
        overrides = lm_overrides(corpus, sizes, seed, train_users)
        init = runs / f"init-{seed}"
        init.mkdir(parents=True, exist_ok=True)
        initial_weights(
            [o for o in overrides if not o.startswith(("strategy.", "+strategy.", "privacy."))],
            init / "dpfl.npz",
        )
        pfl_side(
            "init",
            "--pfl-research",
            str(src["pfl_research"]["benchmarks"]),
            "--weights",
            str(init / "dpfl.npz"),
            "--vocabulary",
            str(sizes.vocab_size + 4),
            "--out",
            str(init),
        )
        pfl_dir.mkdir(parents=True, exist_ok=True)
        command = pfl_lm_command(src["pfl_research"]["benchmarks"], hdf5, sizes, seed, init)
        env = {"PYTHONPATH": str(src["pfl_research"]["benchmarks"]), "OMP_NUM_THREADS": "1"}
        cost = measured(command, pfl_dir / "log.txt", cwd=pfl_dir, env=env)
        out["pfl"].append({**cost, **(pfl_lm_curve(pfl_dir) if cost["exit"] == 0 else {})})
        shutil.rmtree(dpfl_dir, ignore_errors=True)
        dpfl_command = [
            str(DPFL_PYTHON),
            "-m",
            "fl_app",
            *overrides,
            "simulation.backend=processes",
            f"output_dir={dpfl_dir}",
        ]
        cost = measured(
            dpfl_command, runs / f"dpfl-{seed}.log", env={"DPFL_DATA_HOME": str(work / "dpfl_home")}
        )
        out["dpfl"].append({**cost, **(dpfl_rounds(dpfl_dir) if cost["exit"] == 0 else {})})
        out["commands"] = {"pfl": command, "dpfl": dpfl_command}
        print(
            f"lm seed {seed}: pfl exit {out['pfl'][-1]['exit']}, dpfl exit {out['dpfl'][-1]['exit']}",
            file=sys.stderr,
            flush=True,
        )
    return out


IMAGE_TASK = (
    "dataset=fashion_mnist",
    "partition=dirichlet",
    "num_clients=1000",
    "model=mlp",
    "evaluation.test_subset=2000",
)


def image_commands(
    runs: Path, sizes: Sizes, src: dict[str, Any], seed: int
) -> tuple[list[str], list[str], list[str]]:
    """The image task's dpfl overrides of ``seed``, pfl's ``image-run`` command and dpfl's command."""
    task = [*IMAGE_TASK, f"seed={seed}"]
    pfl = [
        str(PFL_PYTHON),
        "-P",
        str(PFL_SIDE),
        "image-run",
        "--pfl-research",
        str(src["pfl_research"]["benchmarks"]),
        "--data",
        str(runs / f"partition-{seed}.npz"),
        "--out",
        str(runs / f"pfl-{seed}.json"),
        "--rounds",
        str(sizes.image_rounds),
        "--every",
        str(sizes.image_every),
        "--seed",
        str(seed),
    ]
    dpfl = [
        str(DPFL_PYTHON),
        "-m",
        "fl_app",
        "strategy=dp_fedavg",
        "strategy.sampling=fixed",
        "strategy.clip=0.4",
        "strategy.noise_cohort_size=1000",
        f"strategy.noise_population={POPULATION}",
        "privacy.epsilon=2",
        "privacy.delta=1e-6",
        *task,
        "clients_per_round=50",
        "local_epochs=1",
        "batch_size=10",
        "lr=0.1",
        f"num_rounds={sizes.image_rounds}",
        f"evaluation.every={sizes.image_every}",
        "simulation.backend=processes",
        f"output_dir={runs / f'dpfl-{seed}'}",
    ]
    return task, pfl, dpfl


def image_learning(
    work: Path,
    sizes: Sizes,
    src: dict[str, Any],
    seeds: Sequence[int] | None = None,
    *,
    reuse: bool = False,
) -> dict[str, Any]:
    """DP-FedAvg with pfl-research's image configuration (cohort 50, noise cohort 1,000, clip 0.4, eps 2).

    Seeds 1..``sizes.seeds`` unless ``seeds`` names them; ``reuse``: a seed whose two runs are already
    in ``work`` is read back instead of run again.
    """
    from benchmarks.pfl_compare import export_partition

    runs = work / "learning_image"
    out: dict[str, Any] = {"pfl": [], "dpfl": [], "commands": {}}
    for seed in seeds or range(1, sizes.seeds + 1):
        task, pfl, dpfl = image_commands(runs, sizes, src, seed)
        pfl_out, dpfl_dir = runs / f"pfl-{seed}.json", runs / f"dpfl-{seed}"
        if reuse and pfl_out.exists() and (dpfl_dir / "results.json").exists():
            out["pfl"].append({"exit": 0, **json.loads(pfl_out.read_text())})
            out["dpfl"].append({"exit": 0, **dpfl_rounds(dpfl_dir)})
            continue
        export_partition(runs / f"partition-{seed}.npz", task)
        cost = measured(pfl, runs / f"pfl-{seed}.log", env={"OMP_NUM_THREADS": "1"})
        out["pfl"].append({**cost, **(json.loads(pfl_out.read_text()) if cost["exit"] == 0 else {})})
        shutil.rmtree(dpfl_dir, ignore_errors=True)
        cost = measured(dpfl, runs / f"dpfl-{seed}.log")
        out["dpfl"].append({**cost, **(dpfl_rounds(dpfl_dir) if cost["exit"] == 0 else {})})
        out["commands"] = {"pfl": pfl, "dpfl": dpfl}
        print(
            f"image seed {seed}: pfl exit {out['pfl'][-1]['exit']}, dpfl exit {out['dpfl'][-1]['exit']}",
            file=sys.stderr,
            flush=True,
        )
    return out


def paired_seeds(image: dict[str, Any]) -> dict[str, Any]:
    """Each evaluated round's difference dpfl - pfl, seed by seed (a seed: the same split and start).

    Per round: both means, the mean difference, its paired t (mean over its standard error) and how
    many seeds have dpfl behind; over the curve (every round but the first), each seed's mean
    difference, their mean and t. Also the noise each side adds to the cohort's sum, in clips.
    """
    d, p = bands(image["dpfl"]), bands(image["pfl"])
    rounds = sorted(set(d) & set(p))
    diff = np.array([np.subtract(d[r], p[r]) for r in rounds])  # rounds x seeds
    n = diff.shape[1] if diff.size else 0

    def t_of(values: np.ndarray) -> float | None:
        spread = float(np.std(values, ddof=1)) if len(values) > 1 else 0.0
        return float(np.mean(values)) / (spread / np.sqrt(len(values))) if spread > 0 else None

    per_seed = diff[1:].mean(axis=0) if len(rounds) > 1 else np.zeros(0)
    return {
        "seeds": n,
        "rounds": [
            {
                "round": r,
                "dpfl": float(np.mean(d[r])),
                "pfl": float(np.mean(p[r])),
                "difference": float(row.mean()),
                "t": t_of(row),
                "dpfl_behind": int((row < 0).sum()),
            }
            for r, row in zip(rounds, diff, strict=True)
        ],
        "curve": {
            "per_seed": per_seed.tolist(),
            "mean": float(per_seed.mean()) if n else None,
            "t": t_of(per_seed),
        },
        "noise_on_sum_over_clip": {
            "pfl": [r.get("relative_noise_stddev") for r in image["pfl"]],
            "dpfl": [
                (r.get("privacy") or {}).get("noise_multiplier", math.nan) * 50 / 1000 for r in image["dpfl"]
            ],
        },
    }


def l2_norm(arrays: Sequence[np.ndarray]) -> float:
    """The L2 norm of ``arrays`` taken as one vector (in float64)."""
    return float(np.sqrt(sum(np.square(a, dtype=np.float64).sum() for a in arrays)))


def keep_summary(
    work: Path,
    name: str,
    result: dict[str, Any],
    curves: dict[str, Any],
    title: str,
    ylabel: str,
    *,
    kept: bool,
) -> None:
    """``<work>/<name>.json`` and ``<name>.png`` (both sides' bands); with ``kept``, both beside the page."""
    (work / f"{name}.json").write_text(json.dumps(jsonable(result), indent=1))
    plot(title, curves, work / f"{name}.png", ylabel)
    if kept:
        KEPT.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(work / f"{name}.png", KEPT / f"{name}.png")
        shutil.copyfile(work / f"{name}.json", KEPT / f"{name}.json")


def local_update_check(work: Path, src: dict[str, Any], clients: Sequence[int]) -> dict[str, Any]:
    """One local update of each of ``clients`` by pfl and by dpfl's ``train_local``: the largest difference.

    Seed 1's split and initial weights, the same example order on both sides; also each update's norm.
    """
    import torch

    from benchmarks.pfl_compare import export_partition
    from fl_app.learning.models import build_model
    from fl_app.learning.training import train_local

    data = work / "partition-1.npz"
    if not data.exists():
        export_partition(data, [*IMAGE_TASK, "seed=1"])
    pfl_side(
        "image-update",
        "--pfl-research",
        str(src["pfl_research"]["benchmarks"]),
        "--data",
        str(data),
        "--clients",
        *map(str, clients),
        "--out",
        str(work / "pfl_updates.npz"),
    )
    archive, theirs = np.load(data), np.load(work / "pfl_updates.npz")
    names, offsets = [str(n) for n in archive["param_names"]], archive["offsets"]
    rows = []
    for client in clients:
        model = build_model("mlp", (1, 28, 28), 10)
        start = {name: torch.from_numpy(archive[f"param_{k}"].copy()) for k, name in enumerate(names)}
        model.load_state_dict(start)
        x, y = (
            archive["x"][offsets[client] : offsets[client + 1]],
            archive["y"][offsets[client] : offsets[client + 1]],
        )
        order = np.random.default_rng(client).permutation(len(y))
        train_local(model, x, y, epochs=1, batch_size=10, lr=0.1, order=order[None, :])
        mine = {n: (v - start[n]).numpy() for n, v in model.state_dict().items()}
        rows.append(
            {
                "client": client,
                "examples": len(y),
                "update_norm": l2_norm(list(mine.values())),
                "max_difference": max(float(np.abs(mine[n] - theirs[f"{client}/{n}"]).max()) for n in names),
            }
        )
    return {"clients": rows, "max_difference": max(r["max_difference"] for r in rows)}


def image_seeds(args: argparse.Namespace) -> dict[str, Any]:
    """``image-seeds``: the image task over paired seeds, evaluated every round; local updates compared."""
    from dataclasses import replace

    work = (args.out or ROOT / "outputs" / "pfl_crosscheck" / "image_seeds").resolve()
    src = sources(args, work)
    if src["pfl_research"]["path"] is None:
        raise SystemExit(f"pfl-research's benchmarks code not available: {src['pfl_research']['how']}")
    sizes = replace(QUICK, image_rounds=args.rounds, image_every=1)
    image = image_learning(work, sizes, src, range(1, args.seeds + 1), reuse=True)
    runs = work / "learning_image"
    offsets = np.diff(np.load(runs / "partition-1.npz")["offsets"])
    clients = sorted({int(np.argmin(offsets)), int(np.argmax(offsets)), 0, 1, 2})
    result = {
        "paired": paired_seeds(image),
        "overlap": overlap(image["dpfl"], image["pfl"]),
        "local_update": local_update_check(runs, src, clients),
    }
    title = f"Fashion-MNIST, DP-FedAvg, {args.seeds} paired seeds, every round"
    keep_summary(work, "image_seeds", result, image, title, "test accuracy", kept=args.write_doc)
    return result


#: The accuracy that marks an LM run's leaving the unigram plateau (0.05-0.06; both sides settle at 0.37).
PLATEAU_EXIT = 0.2


def lm_seeds(args: argparse.Namespace) -> dict[str, Any]:
    """``lm-seeds``: the ``--full`` LM task over seeds 1..N (the seeds already run in its work folder reused).

    Per seed and side, the first round both sides evaluate at which the accuracy is at or above
    :data:`PLATEAU_EXIT`; the paired differences per round (:func:`paired_seeds`) and the overlap;
    the plot with both bands.
    """
    work = (args.out or ROOT / "outputs" / "pfl_crosscheck" / "full").resolve()
    hdf5 = work / "pfl_so" / "stackoverflow.hdf5"
    if not hdf5.exists():
        raise SystemExit(f"{hdf5} is missing: run --full first (its tokens check writes it)")
    src = sources(args, work)
    os.environ["DPFL_DATA_HOME"] = str(work / "dpfl_home")  # conversions stay in the work folder
    train_users = len(sqlite_users(work / "corpus" / "so.sqlite").get("train", []))
    lm = lm_learning(work, FULL, src, hdf5, train_users, range(1, args.seeds + 1), reuse=True)

    common = set(lm["dpfl"][0]["round"]) & set(lm["pfl"][0]["round"])  # dpfl evaluates every 10th

    def exit_round(run: dict[str, Any]) -> int | None:
        pairs = zip(run["round"], run["accuracy"], strict=True)
        return next((r for r, a in pairs if r in common and a >= PLATEAU_EXIT), None)

    result = {
        "seeds": args.seeds,
        "plateau_exit": {side: [exit_round(run) for run in lm[side]] for side in ("pfl", "dpfl")},
        "paired": paired_seeds(lm),
        "overlap": overlap(lm["dpfl"], lm["pfl"]),
    }
    title = f"Stack Overflow-shaped LM, DP, {args.seeds} paired seeds"
    ylabel = "next-word accuracy (pad and unknown left out)"
    keep_summary(work, "lm_seeds", result, lm, title, ylabel, kept=args.write_doc)
    return result


def lm_update_check(args: argparse.Namespace) -> dict[str, Any]:
    """``lm-update``: one local update of the LM task's first training users, pfl's SGD against dpfl's.

    The ``--full`` run's seed-1 initial weights and HDF5; pfl-research's own training code
    (``lm-update`` of the pfl side) and dpfl's ``train_local``, the same example order, dropout off on
    both sides; per user the update's norm and the largest difference.
    """
    import torch

    from fl_app.learning.models import build_model
    from fl_app.learning.sequence import mark_next_token
    from fl_app.learning.training import train_local

    work = (args.out or ROOT / "outputs" / "pfl_crosscheck" / "full").resolve()
    src = sources(args, work)
    weights = work / "learning_lm" / "init-1" / "dpfl.npz"
    theirs_path = work / "lm_updates_pfl.npz"
    pfl_side(
        "lm-update",
        "--pfl-research",
        str(src["pfl_research"]["benchmarks"]),
        "--hdf5",
        str(work / "pfl_so" / "stackoverflow.hdf5"),
        "--weights",
        str(weights),
        "--users",
        str(args.seeds),
        "--out",
        str(theirs_path),
    )
    theirs, start = np.load(theirs_path), np.load(weights)
    torch.set_num_threads(1)
    length = theirs["0/rows"].shape[1] - 1
    network = build_model("pfl_transformer", (length,), start["_embeddings.weight"].shape[0])
    mark_next_token(network, ())  # the loss over non-pad targets, as a text run's network has it
    for module in network.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    initial = {
        k: torch.from_numpy(start[k]) if k in start.files else v.detach().clone()
        for k, v in network.state_dict().items()
    }
    rows = []
    for index in range(args.seeds):
        tokens, order = theirs[f"{index}/rows"], theirs[f"{index}/order"]
        network.load_state_dict(initial)
        train_local(
            network,
            tokens[:, :-1],
            tokens[:, 1:],
            epochs=1,
            batch_size=16,
            lr=0.3,
            order=order[None, :],
            dropout_seed=0,
        )
        mine = {k: (v - initial[k]).numpy() for k, v in network.state_dict().items() if k in start.files}
        names = [k for k in mine if f"{index}/update/{k}" in theirs.files]
        rows.append(
            {
                "user": index,
                "sentences": len(tokens),
                "norm_dpfl": l2_norm([mine[k] for k in names]),
                "norm_pfl": l2_norm([theirs[f"{index}/update/{k}"] for k in names]),
                "max_difference": max(
                    float(np.abs(mine[k] - theirs[f"{index}/update/{k}"]).max()) for k in names
                ),
                "compared": len(names),
            }
        )
    result = {"users": rows, "max_difference": max(r["max_difference"] for r in rows)}
    (work / "lm_update.json").write_text(json.dumps(jsonable(result), indent=1))
    return result


def bands(runs: Sequence[dict[str, Any]]) -> dict[int, list[float]]:
    """Each evaluated round's accuracies over the seeds (rounds every seed evaluated)."""
    per: dict[int, list[float]] = {}
    for run in runs:
        for r, a in zip(run.get("round", []), run.get("accuracy", []), strict=True):
            per.setdefault(int(r), []).append(float(a))
    return {r: v for r, v in sorted(per.items()) if len(v) == len(runs)}


def overlap(dpfl: Sequence[dict[str, Any]], pfl: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Whether the curves overlap within the seeds' spread.

    Judged at every round both evaluated from the second such round on (the first is within the
    warm-up): the gap between the two implementations' seed means is at most the seeds' spread at
    that round, the wider of the two seed ranges (max - min) there or, where that is smaller, the
    average of the wider range over the judged rounds (``pooled_spread``): three seeds' range can be
    close to zero by chance at one round. With three seeds a side drawn alike (normal), a judged
    round fails by chance in about 1 % of cases, a curve of 3 judged rounds in about 5 % and one of 14
    in about 10 % (rounds independent, the earliest with three times the later spread; Monte Carlo);
    a shift of two seed standard deviations at every round fails 60 % and 94 % of them.
    """
    d, p = bands(dpfl), bands(pfl)
    rounds = sorted(set(d) & set(p))
    rows = []
    for r in rounds:
        rows.append(
            {
                "round": r,
                "dpfl": d[r],
                "pfl": p[r],
                "gap": abs(float(np.mean(d[r])) - float(np.mean(p[r]))),
                "spread": max(max(d[r]) - min(d[r]), max(p[r]) - min(p[r])),
                "judged": r != rounds[0] or len(rounds) == 1,
            }
        )
    judged = [row for row in rows if row["judged"]]
    pooled = float(np.mean([row["spread"] for row in judged])) if judged else 0.0
    for row in rows:
        row["within"] = row["gap"] <= max(row["spread"], pooled)
    return {
        "rounds": rows,
        "pooled_spread": pooled,
        "overlap": bool(judged) and all(row["within"] for row in judged),
    }


def overlap_false_alarm(
    *, seeds: int, spreads: Sequence[float], shift: float = 0.0, trials: int = 20000, seed: int = 0
) -> dict[str, float]:
    """How often :func:`overlap` calls two curves different, by Monte Carlo (its docstring's numbers).

    Each side's seeds are normal at each judged round, with the standard deviations ``spreads`` (one
    per judged round), rounds independent; ``shift`` (in standard deviations of that round) is added
    to one side. Returns the fraction of judged rounds that fail and of curves with a failing round.
    """
    rng = np.random.default_rng(seed)
    scale = np.asarray(spreads, dtype=float)[None, :, None]
    a = rng.normal(size=(trials, len(spreads), seeds)) * scale
    b = (rng.normal(size=(trials, len(spreads), seeds)) + shift) * scale
    gap = np.abs(a.mean(axis=2) - b.mean(axis=2))
    wider = np.maximum(np.ptp(a, axis=2), np.ptp(b, axis=2))
    fails = gap > np.maximum(wider, wider.mean(axis=1, keepdims=True))
    return {"round": float(fails.mean()), "curve": float(fails.any(axis=1).mean())}


def plot(task: str, result: dict[str, Any], path: Path, ylabel: str) -> None:
    """One plot: each implementation's seed range (band) and mean per evaluated round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, color in (("pfl", "tab:orange"), ("dpfl", "tab:blue")):
        b = bands(result[name])
        if not b:
            continue
        rounds = np.array(list(b))
        values = np.array(list(b.values()))
        label = "pfl-research 0.6.0" if name == "pfl" else "dpfl"
        ax.fill_between(
            rounds,
            values.min(axis=1),
            values.max(axis=1),
            color=color,
            alpha=0.25,
            label=f"{label}: seed range",
        )
        ax.plot(
            rounds,
            values.mean(axis=1),
            color=color,
            marker="o",
            ms=3,
            label=f"{label}: mean of {values.shape[1]} seeds",
        )
    ax.set_xlabel("round")
    ax.set_ylabel(ylabel)
    ax.set_title(task)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def learning_check(
    work: Path, sizes: Sizes, src: dict[str, Any], hdf5: Path, train_users: int
) -> dict[str, Any]:
    """Check 5: both tasks, their overlap and plots."""
    if src["pfl_research"]["path"] is None:
        return {
            "overlap": None,
            "reason": f"pfl-research's benchmarks code not available: {src['pfl_research']['how']}",
        }
    out: dict[str, Any] = {}
    lm = lm_learning(work, sizes, src, hdf5, train_users)
    lm |= overlap(lm["dpfl"], lm["pfl"])
    plot(
        f"Stack Overflow-shaped LM, DP (cohort {sizes.lm_cohort}, noise cohort "
        f"{round(sizes.lm_cohort * NOISE_COHORT_RATIO)}, eps 2)",
        lm,
        work / "lm.png",
        "next-word accuracy (pad and unknown left out)",
    )
    image = image_learning(work, sizes, src)
    image |= overlap(image["dpfl"], image["pfl"])
    plot(
        "Fashion-MNIST, DP-FedAvg (cohort 50, noise cohort 1000, clip 0.4, eps 2)",
        image,
        work / "image.png",
        "test accuracy",
    )
    out["lm"], out["image"] = lm, image
    out["overlap"] = lm["overlap"] and image["overlap"]
    out["plots"] = [str(work / "lm.png"), str(work / "image.png")]
    return out


# --------------------------------------------------------------------------------------------------
# 6. Same cost
# --------------------------------------------------------------------------------------------------


#: Sentences of every user of the cost corpus: Stack Overflow's cap per user (``max_user_sentences``).
COST_SENTENCES = 64


def cost_corpus(folder: Path, users: int) -> dict[str, Any]:
    """A converted corpus of Stack Overflow's shape (10,004 tokens) whose users all hold 64 sentences.

    Every user holds the cap (64, pfl-research's ``max_user_sentences`` and dpfl's
    ``dataset.max_sequences_per_user``), so every round of every arm trains exactly ``cohort x 64``
    sentences, whichever users it draws: the arms' CPU per round compares the same work.
    """
    from fl_app.data.synthetic_text import write_token_corpus

    if not (folder / "meta.json").exists():
        write_token_corpus(  # a log-normal mean this high puts every user above the cap
            folder,
            users=users,
            test_users=20,
            mean_sentences=1e6,
            cap=COST_SENTENCES,
            seed=7,
            test_mean_sentences=COST_SENTENCES,
        )
    sizes = np.diff(np.load(folder / "train_offsets.npy"))
    if sizes.min() != COST_SENTENCES or sizes.max() != COST_SENTENCES:
        raise RuntimeError(
            f"{folder}: users of {sizes.min()}..{sizes.max()} sentences, not all {COST_SENTENCES}"
        )
    return {"users": len(sizes), "sentences_per_user": COST_SENTENCES}


def tight_loop(folder: Path, cohort: int, rounds: int, seed: int) -> dict[str, Any]:
    """One process, one thread: the same rounds' work with nothing else (PyTorch, dpfl's ``pfl_transformer``).

    Per round: ``cohort`` users drawn without replacement; each trains one epoch of SGD (batch 16, lr 0.3)
    from the global weights on its sentences, its update added to a sum; the global model takes the mean.
    CPU per round is this process's CPU time.
    """
    import torch

    from fl_app.learning.models import build_model
    from fl_app.learning.sequence import NextToken

    torch.set_num_threads(1)
    meta = json.loads((folder / "meta.json").read_text())
    offsets = np.load(folder / "train_offsets.npy")
    tokens = np.fromfile(folder / "train.tokens", dtype=np.dtype(meta["dtype"])).reshape(-1, LENGTH + 1)
    vocabulary = len(meta["vocabulary"]) + 4
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    model = build_model("pfl_transformer", (LENGTH,), vocabulary)
    params = list(model.parameters())
    task = NextToken()
    cpu, wall, sentences = [], [], []
    for _ in range(rounds):
        start_cpu, start = time.process_time(), time.perf_counter()
        global_ = [p.detach().clone() for p in params]
        total = [torch.zeros_like(p) for p in params]
        count = 0
        for user in rng.choice(len(offsets) - 1, size=cohort, replace=False):
            rows = torch.from_numpy(tokens[offsets[user] : offsets[user + 1]].astype(np.int64))
            count += len(rows)
            with torch.no_grad():
                for p, g in zip(params, global_, strict=True):
                    p.copy_(g)
            model.train()
            order = torch.from_numpy(rng.permutation(len(rows)))
            for s in range(0, len(rows), 16):
                batch = rows[order[s : s + 16]]
                loss = task.loss(model(batch[:, :-1]), batch[:, 1:])
                grads = torch.autograd.grad(loss, params)
                with torch.no_grad():
                    torch._foreach_add_(params, grads, alpha=-0.3)
            with torch.no_grad():
                for t, p, g in zip(total, params, global_, strict=True):
                    t.add_(p - g)
        with torch.no_grad():
            for p, g, t in zip(params, global_, total, strict=True):
                p.copy_(g + t / cohort)
        cpu.append(time.process_time() - start_cpu)
        wall.append(time.perf_counter() - start)
        sentences.append(count)
    return {"cpu_s": cpu, "round_s": wall, "sentences": sentences}


def pfl_cost_command(benchmarks: Path, hdf5: Path, sizes: Sizes, seed: int, run: Path) -> list[str]:
    """The pfl arm: ``lm-round`` of ``benchmarks/pfl_crosscheck_pfl.py`` (one process, one torch thread)."""
    return [
        str(PFL_PYTHON),
        "-P",
        str(PFL_SIDE),
        "lm-round",
        "--pfl-research",
        str(benchmarks),
        "--hdf5",
        str(hdf5),
        "--cohort",
        str(sizes.cost_cohort),
        "--rounds",
        str(sizes.cost_rounds),
        "--seed",
        str(seed),
        "--out",
        str(run / "rounds.json"),
        "--progress",
        str(run / "progress.jsonl"),
    ]


def dpfl_cost_command(folder: Path, users: int, sizes: Sizes, seed: int, out: Path) -> list[str]:
    """The dpfl arm: the LM configuration's round (``dp_flower`` with pfl's central Adam), forked workers."""
    return [
        str(DPFL_PYTHON),
        "-m",
        "fl_app",
        "dataset=stackoverflow",
        f"dataset.path={folder}",
        "partition=natural",
        f"num_clients={users}",
        f"clients_per_round={sizes.cost_cohort}",
        "model=pfl_transformer",
        *PFL_SERVER_STEP,
        "strategy.sampling=fixed",
        "strategy.clip=1.0",
        f"strategy.noise_cohort_size={round(sizes.cost_cohort * NOISE_COHORT_RATIO)}",
        f"strategy.noise_population={POPULATION}",
        "privacy.epsilon=2",
        "privacy.delta=1e-6",
        f"num_rounds={sizes.cost_rounds}",
        "local_epochs=1",
        "batch_size=16",
        "lr=0.3",
        f"dataset.max_sequences_per_user={COST_SENTENCES}",
        "evaluation.test_subset=64",
        f"evaluation.every={sizes.cost_rounds}",
        f"seed={seed}",
        "simulation.backend=processes",
        f"output_dir={out}",
    ]


def cost_check(work: Path, sizes: Sizes, src: dict[str, Any]) -> dict[str, Any]:
    """Check 6: runs of each arm, interleaved; every process's CPU at each round's end, beside the loop."""
    if src["pfl_research"]["path"] is None:
        return {
            "round_time_ratio": None,
            "reason": f"pfl-research's benchmarks code not available: {src['pfl_research']['how']}",
        }
    folder = work / "cost_corpus_64"
    corpus = cost_corpus(folder, sizes.cost_users)
    hdf5 = work / "cost_64.hdf5"
    if not hdf5.exists():
        pfl_side("hdf5-from-tokens", "--folder", str(folder), "--out", str(hdf5), "--test-users", "20")
    rows: list[dict[str, Any]] = []
    benchmarks = src["pfl_research"]["benchmarks"]
    for repeat in range(1, sizes.cost_repeats + 1):
        run = work / "cost" / f"pfl-{repeat}"
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir(parents=True)
        command = pfl_cost_command(benchmarks, hdf5, sizes, repeat, run)
        cost = measured(
            command, run / "log.txt", env={"OMP_NUM_THREADS": "1"}, progress=run / "progress.jsonl"
        )
        record = json.loads((run / "rounds.json").read_text()) if cost["exit"] == 0 else {}
        rows.append({"arm": "pfl", "repeat": repeat, **record, **cost, "command": command})
        out = work / "cost" / f"dpfl-{repeat}"
        shutil.rmtree(out, ignore_errors=True)
        command = dpfl_cost_command(folder, corpus["users"], sizes, repeat, out)
        cost = measured(command, work / "cost" / f"dpfl-{repeat}.log", progress=out / "rounds.jsonl")
        rows.append({"arm": "dpfl", "repeat": repeat, **cost, "command": command})
        loop = tight_loop(folder, sizes.cost_cohort, sizes.cost_rounds, seed=repeat)
        rows.append({"arm": "loop", "repeat": repeat, **loop, "exit": 0})
        print(
            f"cost #{repeat}: CPU a round pfl {arm_rounds(rows[-3], sizes)['cpu_s']}, "
            f"dpfl {arm_rounds(rows[-2], sizes)['cpu_s']}, loop {arm_rounds(rows[-1], sizes)['cpu_s']}",
            file=sys.stderr,
            flush=True,
        )
    return summarise_cost(rows, corpus, sizes)


def arm_rounds(row: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    """One run's CPU (every process) and wall time a round over rounds 2..R-1, and the command's share.

    Round 1 pays the first touches (start-up ends there) and round R the run's end; from the round
    watcher's marks (pfl, dpfl), or the loop's own per-round CPU. ``driver_s``: of a dpfl run, the CPU
    a round of its command's own process (the server), the rest being its forked client workers.
    """
    first, last = 1, sizes.cost_rounds - 1  # round-end indices: the end of round 1, of round R-1
    if row.get("exit") != 0:
        return {"cpu_s": None, "wall_s": None}
    if row["arm"] == "loop":
        cpu, wall = row["cpu_s"][first:last], row["round_s"][first:last]
        return {"cpu_s": statistics.mean(cpu), "wall_s": statistics.median(wall), "driver_s": None}
    marks = row.get("marks") or []
    if len(marks) < last:
        return {"cpu_s": None, "wall_s": None}
    a, b = marks[first - 1], marks[last - 1]
    rounds = last - first
    cpu = (sum(b["cpu_s"].values()) - sum(a["cpu_s"].values())) / rounds
    walls = [marks[i]["at_s"] - marks[i - 1]["at_s"] for i in range(first, last)]
    command = min(b["cpu_s"], key=int)  # the command's own process: the lowest pid
    driver = (b["cpu_s"][command] - a["cpu_s"].get(command, 0.0)) / rounds if row["arm"] == "dpfl" else None
    return {"cpu_s": cpu, "wall_s": statistics.median(walls), "driver_s": driver}


def median_ratio(numerator: Sequence[float], denominator: Sequence[float]) -> float | None:
    """The ratio of the two medians (None when either list is empty)."""
    if not numerator or not denominator:
        return None
    return statistics.median(numerator) / statistics.median(denominator)


def summarise_cost(rows: list[dict[str, Any]], corpus: dict[str, Any], sizes: Sizes) -> dict[str, Any]:
    """Per arm: CPU a round (each repeat), a sentence (``cohort x 64`` a round), the median round's wall."""
    sentences = sizes.cost_cohort * corpus["sentences_per_user"]
    arms: dict[str, Any] = {}
    for arm in ("pfl", "dpfl", "loop"):
        per = [arm_rounds(r, sizes) for r in rows if r["arm"] == arm]
        cpu = [p["cpu_s"] for p in per if p["cpu_s"] is not None]
        arms[arm] = {
            "cpu_per_round_s": cpu,
            "median_round_s": [p["wall_s"] for p in per if p["wall_s"] is not None],
            "cpu_per_sentence_ms": [1000 * c / sentences for c in cpu],
            "driver_per_round_s": [p["driver_s"] for p in per if p.get("driver_s") is not None],
        }
    trained = [s for r in rows if r["arm"] == "pfl" for s in r.get("sentences", [])]
    per_sentence = {
        a: statistics.median(v["cpu_per_sentence_ms"]) for a, v in arms.items() if v["cpu_per_sentence_ms"]
    }
    return {
        "corpus": corpus,
        "cohort": sizes.cost_cohort,
        "rounds": sizes.cost_rounds,
        "sentences_per_round": sentences,
        "pfl_trained_sentences": sorted(set(trained)),
        "arms": arms,
        "round_time_ratio": median_ratio(arms["dpfl"]["median_round_s"], arms["pfl"]["median_round_s"]),
        "cpu_per_round_ratio": median_ratio(arms["dpfl"]["cpu_per_round_s"], arms["pfl"]["cpu_per_round_s"]),
        "cpu_per_sentence_ms": per_sentence,
        "per_sentence_over_loop": {a: v / per_sentence["loop"] for a, v in per_sentence.items()}
        if "loop" in per_sentence
        else None,
        "runs": rows,
        "load_1min": [x for r in rows for x in r.get("load_1min", [])],
    }


# --------------------------------------------------------------------------------------------------
# The whole comparison
# --------------------------------------------------------------------------------------------------


STAGES = ("tokens", "network", "metric", "epsilon", "learning", "cost")


def earlier_stages(work: Path, sizes: Sizes, only: set[str]) -> dict[str, Any]:
    """The stages outside ``only`` that an earlier run of the same sizes recorded in ``work``.

    A run stopped after its learning stage (``record.partial.json``) is completed with
    ``--only cost``; nothing is taken from a run of other sizes.
    """
    for name in ("record.json", "record.partial.json"):
        path = work / name
        if only != set(STAGES) and path.exists():
            earlier = json.loads(path.read_text())
            if earlier.get("sizes") == asdict(sizes):
                return {stage: earlier[stage] for stage in STAGES if stage not in only and stage in earlier}
    return {}


def run_all(args: argparse.Namespace) -> dict[str, Any]:
    """Every check of ``--only`` (default all); the JSON record."""
    sizes = QUICK if args.quick else FULL
    work = (args.out or ROOT / "outputs" / "pfl_crosscheck" / ("quick" if args.quick else "full")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    only = set(args.only.split(",")) if args.only else set(STAGES)
    for python in (DPFL_PYTHON, PFL_PYTHON):
        if not python.exists():
            raise SystemExit(f"{python} is missing (bash scripts/setup_pfl_env.sh builds .venv-pfl)")
    src = sources(args, work)
    os.environ["DPFL_DATA_HOME"] = str(work / "dpfl_home")  # conversions stay in the work folder
    record: dict[str, Any] = {
        **earlier_stages(work, sizes, only),
        "mode": "quick" if args.quick else "full",
        "sizes": asdict(sizes),
        "sources": src,
    }
    started = time.perf_counter()
    hdf5 = work / "pfl_so" / "stackoverflow.hdf5"
    if "tokens" in only or not hdf5.exists():
        record["tokens"] = tokens_check(work, sizes, src)
    train_users = len(sqlite_users(work / "corpus" / "so.sqlite").get("train", []))
    if "network" in only:
        record["network"] = network_check(work, src)
    if "metric" in only:
        record["metric"] = metric_check(work, src, sizes, hdf5)
    if "epsilon" in only:
        record["epsilon"] = epsilon_check(args.quick)
    if "learning" in only:
        record["learning"] = learning_check(work, sizes, src, hdf5, train_users)
        (work / "record.partial.json").write_text(json.dumps(jsonable(record), indent=1))
    if "cost" in only:
        record["cost"] = cost_check(work, sizes, src)
    record["seconds"] = time.perf_counter() - started
    record["machine"] = {"cpus": os.cpu_count(), "load_1min_end": os.getloadavg()[0]}
    verdict = {
        "tokens_equal": (record.get("tokens") or {}).get("equal"),
        "network_equal": (record.get("network") or {}).get("equal"),
        "metric_equal": (record.get("metric") or {}).get("equal"),
        "epsilon_equal": (record.get("epsilon") or {}).get("epsilon_equal"),
        "curves_overlap": (record.get("learning") or {}).get("overlap"),
        "round_time_ratio": (record.get("cost") or {}).get("round_time_ratio"),
    }
    record = {**verdict, **record, "record_path": work / "record.json"}
    (work / "record.json").write_text(json.dumps(jsonable(record), indent=1))
    return record


def summary(record: dict[str, Any]) -> dict[str, Any]:
    """What the command prints: the verdicts, the numbers behind them, where the whole record is."""
    tokens, network, metric = (
        record.get("tokens") or {},
        record.get("network") or {},
        record.get("metric") or {},
    )
    learning, cost, epsilon = (
        record.get("learning") or {},
        record.get("cost") or {},
        record.get("epsilon") or {},
    )
    out = {
        k: record[k]
        for k in (
            "tokens_equal",
            "network_equal",
            "metric_equal",
            "epsilon_equal",
            "curves_overlap",
            "round_time_ratio",
        )
    }
    out["details"] = {
        "tokens": {
            "splits": (tokens.get("so") or {}).get("splits"),
            "edge_case_differences": [
                {k: d[k] for k in ("text", "dpfl", "pfl_research", "tff", "follows_tff")}
                for d in (tokens.get("edge") or {}).get("differences", [])
            ],
        },
        "network": {
            n: {
                k: v[k]
                for k in (
                    "parameters_dpfl",
                    "parameters_pfl",
                    "max_output_difference",
                    "max_gradient_difference",
                )
            }
            for n, v in network.items()
            if isinstance(v, dict) and "parameters_dpfl" in v
        }
        or network.get("reason"),
        "metric": metric.get("pairs") or metric.get("reason"),
        "epsilon": {k: epsilon.get(k) for k in ("epsilon_equal", "reason", "pfl_source") if k in epsilon},
        "learning": {
            t: {
                "pooled_spread": (learning.get(t) or {}).get("pooled_spread"),
                "rounds": [
                    {k: r[k] for k in ("round", "gap", "spread", "within", "judged")}
                    for r in (learning.get(t) or {}).get("rounds", [])
                ],
            }
            for t in ("lm", "image")
        }
        if "lm" in learning
        else learning.get("reason"),
        "cost": {
            k: cost.get(k)
            for k in ("cpu_per_round_ratio", "cpu_per_sentence_ms", "per_sentence_over_loop", "reason")
            if k in cost
        },
        "sources": {
            k: {"commit": v.get("commit"), "how": v.get("how")} for k, v in record["sources"].items()
        },
        "seconds": record.get("seconds"),
        "record": str(record.get("record_path")),
    }
    return out


def fixtures() -> dict[str, Any]:
    """``tests/data/pfl_crosscheck.json``: pfl-research's tokens, network outputs and metrics, small.

    Made by the pfl side at a vocabulary of 30 and sequences of 8 (networks) and on the edge cases
    (tokens), from the sources the environment names.
    """
    args = argparse.Namespace(pfl_research=None, google_federated=None)
    work = ROOT / "outputs" / "pfl_crosscheck" / "fixtures"
    src = sources(args, work)
    if src["pfl_research"]["path"] is None or src["google_federated"]["path"] is None:
        raise SystemExit("fixtures need both sources (PFL_RESEARCH and GOOGLE_FEDERATED)")
    corpus = write_corpora(work / "corpus", 40, 8)
    words = work / "corpus" / "words.txt"
    side = pfl_side(
        "data",
        "--sqlite",
        str(work / "corpus" / "edge.sqlite"),
        "--words",
        str(words),
        "--vocab-size",
        "8",
        "--out",
        str(work / "edge"),
        "--pfl-research",
        str(src["pfl_research"]["benchmarks"]),
        "--google-federated",
        str(src["google_federated"]["path"]),
    )
    tokens = np.load(work / "edge" / "tokens.npz")
    edge = []
    for split, partition in (("train", "train"), ("heldout", "val"), ("test", "test")):
        pfl_rows, tff_rows = unpack(tokens, f"pfl_{partition}"), unpack(tokens, f"tff_{split}")
        for user, texts in EDGE_CASES[split].items():
            for i, text in enumerate(texts):
                edge.append(
                    {
                        "text": text,
                        "pfl_research": pfl_rows[user][i].tolist(),
                        "tff": tff_rows[user][i].tolist(),
                    }
                )
    summary = pfl_side(
        "network",
        "--pfl-research",
        str(src["pfl_research"]["benchmarks"]),
        "--vocabulary",
        "30",
        "--length",
        "8",
        "--batch",
        "3",
        "--out",
        str(work / "networks.npz"),
    )
    archive = np.load(work / "networks.npz")
    networks = {
        name: {
            "parameters": summary[name]["parameters"],
            "shapes": summary[name]["shapes"],
            "loss": summary[name]["loss"],
            "outputs_sum": float(archive[f"{name}/outputs"].astype(np.float64).sum()),
            "outputs_first": archive[f"{name}/outputs"][0, :3, :5].round(6).tolist(),
            "outputs_abs_sum": float(np.abs(archive[f"{name}/outputs"].astype(np.float64)).sum()),
        }
        for name in summary
    }
    full = pfl_side(
        "network",
        "--pfl-research",
        str(src["pfl_research"]["benchmarks"]),
        "--batch",
        "1",
        "--out",
        str(work / "networks_full.npz"),
    )
    fixture = {
        "made_by": "PFL_RESEARCH=... GOOGLE_FEDERATED=... "
        ".venv/bin/python -P benchmarks/pfl_crosscheck.py fixtures",
        "pfl_research_commit": src["pfl_research"]["commit"],
        "google_federated_commit": src["google_federated"]["commit"],
        "word_list": corpus["word_list"],
        "length": LENGTH,
        "edge_cases": edge,
        "network_seed": 0,
        "network_inputs": archive["inputs"].tolist(),
        "network_targets": archive["targets"].tolist(),
        "networks": networks,
        "parameters_at_10004": {n: full[n]["parameters"] for n in full},
        "hdf5_by": side["hdf5_by"],
    }
    FIXTURE.write_text(json.dumps(fixture, indent=1) + "\n")
    return {"fixture": str(FIXTURE)}


DOC = ROOT / "docs" / "benchmarks" / "pfl_crosscheck.md"
KEPT = ROOT / "docs" / "benchmarks" / "pfl_crosscheck"


def learning_lines(record: dict[str, Any]) -> list[str]:
    """The learning section's generated block: the two plots and each task's per-round table."""
    learning = record["learning"]
    lines = [
        f"`--{record['mode']}`: {record['sizes']['seeds']} seeds each, the machine shared "
        "(1-minute load at the end "
        f"{record['machine']['load_1min_end']:.1f} on {record['machine']['cpus']} cores). "
        f"`curves_overlap`: {str(record['curves_overlap']).lower()}.",
        "",
        "![LM](pfl_crosscheck/lm.png)",
        "",
        "![Fashion-MNIST](pfl_crosscheck/image.png)",
        "",
    ]
    for task, title in (("lm", "LM (accuracy without pad and unknown)"), ("image", "Fashion-MNIST")):
        rows = learning[task]["rounds"]
        lines += [
            f"{title}: overlap {str(learning[task]['overlap']).lower()} (the wider seed range averaged over "
            f"the judged rounds: {learning[task]['pooled_spread']:.3f})",
            "",
            "| round | dpfl (seeds) | pfl-research (seeds) | gap of the means | wider range | within |",
            "|---|---|---|---|---|---|",
        ]
        for r in rows:
            d = ", ".join(f"{v:.3f}" for v in r["dpfl"])
            p = ", ".join(f"{v:.3f}" for v in r["pfl"])
            within = str(r["within"]) if r.get("judged", True) else "(not judged)"
            lines.append(f"| {r['round']} | {d} | {p} | {r['gap']:.3f} | {r['spread']:.3f} | {within} |")
        lines.append("")
    return lines


def cost_lines(record: dict[str, Any]) -> list[str]:
    """The cost section's generated block: CPU per round and per sentence, wall rounds, the ratios."""
    cost = record["cost"]
    names = {"pfl": "pfl-research 0.6.0", "dpfl": "dpfl, forked processes", "loop": "tight loop"}
    rounds = cost["rounds"]
    lines = [
        f"`--{record['mode']}`: cohort {cost['cohort']} of {cost['corpus']['users']} users of "
        f"{cost['corpus']['sentences_per_user']} sentences ({cost['sentences_per_round']} sentences a "
        f"round), runs of {rounds} rounds measured over rounds 2-{rounds - 1}, "
        f"{record['sizes']['cost_repeats']} repeat(s) interleaved; 1-minute load "
        f"{min(cost['load_1min']):.1f}-{max(cost['load_1min']):.1f} on {record['machine']['cpus']} cores, "
        "shared with other work.",
        "",
        "| arm | CPU per round (each repeat) | CPU per sentence | over the loop | median round, wall |",
        "|---|---|---|---|---|",
    ]
    for arm, name in names.items():
        a = cost["arms"][arm]
        per = ", ".join(f"{v:.2f} s" for v in a["cpu_per_round_s"])
        sentence = cost["cpu_per_sentence_ms"].get(arm)
        over = (cost["per_sentence_over_loop"] or {}).get(arm)
        wall = ", ".join(f"{v:.2f} s" for v in a["median_round_s"])
        lines.append(
            f"| {name} | {per} | {sentence:.2f} ms | {over:.2f} | {wall} |"
            if sentence is not None and over is not None
            else f"| {name} | {per} | - | - | {wall} |"
        )
    ratio, cpu = cost["round_time_ratio"], cost["cpu_per_round_ratio"]
    driver = cost["arms"]["dpfl"].get("driver_per_round_s") or []
    lines += [
        "",
        f"CPU per round, dpfl over pfl: {cpu:.2f}; `round_time_ratio` (dpfl's median round over pfl's, "
        f"wall, two workers against one process): {ratio:.2f}."
        if ratio is not None and cpu is not None
        else "Ratios: not measured (a run failed).",
    ]
    if driver:
        lines.append(
            "Of dpfl's CPU per round, its server process (the command) took "
            + ", ".join(f"{v:.2f} s" for v in driver)
            + "; the rest is its two client workers."
        )
    return lines


def write_doc(work: Path, doc: Path = DOC, kept: Path = KEPT) -> dict[str, Any]:
    """Keep the ``--full`` run's plots and record in ``docs/benchmarks/pfl_crosscheck/``; fill the blocks."""
    from benchmarks.tables import replace_generated_block

    record = json.loads((work / "record.json").read_text())
    kept.mkdir(parents=True, exist_ok=True)
    for name in ("lm.png", "image.png"):
        if (work / name).exists():
            shutil.copyfile(work / name, kept / name)
    slim = {k: v for k, v in record.items() if k not in ("tokens",)}
    slim["tokens"] = {
        k: v for k, v in (record.get("tokens") or {}).items() if k in ("equal", "corpus", "reading")
    }
    (kept / "record.json").write_text(json.dumps(slim, indent=1))
    blocks = (("LEARNING", learning_lines, "learning"), ("COST", cost_lines, "cost"))
    for marker, lines, key in blocks:
        if record.get(key) and "reason" not in record[key]:
            begin = f"<!-- PFL_CROSSCHECK_{marker}:BEGIN (benchmarks/pfl_crosscheck.py doc) -->"
            replace_generated_block(
                doc, lines(record), begin=begin, end=f"<!-- PFL_CROSSCHECK_{marker}:END -->"
            )
    return {"doc": str(doc), "kept": str(kept)}


def main(argv: Sequence[str] | None = None) -> int:
    """Command line (module docstring)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "command",
        nargs="?",
        choices=["run", "fixtures", "doc", "image-seeds", "lm-seeds", "lm-update"],
        default="run",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="a small corpus and short runs (minutes)")
    mode.add_argument("--full", action="store_true", help="the recorded comparison (hours on 2 cores)")
    parser.add_argument(
        "--only", default="", help="comma-separated: tokens,network,metric,epsilon,learning,cost"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="work folder (default outputs/pfl_crosscheck/<mode>)"
    )
    parser.add_argument(
        "--pfl-research", type=Path, default=None, help="apple/pfl-research checkout or git dir"
    )
    parser.add_argument(
        "--google-federated", type=Path, default=None, help="google-research/federated checkout or git dir"
    )
    parser.add_argument("--seeds", type=int, default=16, help="image-seeds, lm-seeds: paired seeds 1..N")
    parser.add_argument("--rounds", type=int, default=20, help="image-seeds: rounds, each evaluated")
    parser.add_argument(
        "--write-doc",
        action="store_true",
        help="image-seeds, lm-seeds: keep the plot and summary in docs/benchmarks/pfl_crosscheck/",
    )
    args = parser.parse_args(argv)
    if args.command == "image-seeds":
        print(json.dumps(jsonable(image_seeds(args))))
        return 0
    if args.command == "lm-update":  # after a --full run: one local update per user (--seeds users)
        print(json.dumps(jsonable(lm_update_check(args))))
        return 0
    if args.command == "lm-seeds":  # after a --full run: more seeds of its LM task
        print(json.dumps(jsonable(lm_seeds(args))))
        return 0
    if args.command == "fixtures":
        print(json.dumps(fixtures()))
        return 0
    if args.command == "doc":  # after a --full run: its plots, record and tables into the page
        print(json.dumps(write_doc(args.out or ROOT / "outputs" / "pfl_crosscheck" / "full")))
        return 0
    if not args.full:
        args.quick = True
    record = run_all(args)
    keys = ("tokens_equal", "network_equal", "metric_equal", "epsilon_equal", "curves_overlap")
    print(json.dumps(jsonable(summary(record))))
    return 0 if all(record[k] is True for k in keys) else 1


if __name__ == "__main__":
    sys.exit(main())
