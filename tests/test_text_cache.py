"""The text cache: a stopped conversion says so and leaves nothing, a cache that fails its check is rebuilt.

Small corpora written inside the tests (:mod:`tests.text_corpora`). The stop test runs the command in
a subprocess whose conversion holds, with part of its arrays written, until the test has stopped it: it
waits for a file the held conversion writes (a named point), never for a time.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fl_app.data.sources import DataFileError
from fl_app.data.text import corpus_path, load_text_corpus, text_source
from tests.text_corpora import styled_rows, words_options, write_rows

ROOT = Path(__file__).resolve().parent.parent
#: A bound only: how long the held command may take to import, check and reach the held conversion.
REACH_TIMEOUT_S = 300


@pytest.fixture(autouse=True)
def data_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test converts into its own cache."""
    home = tmp_path / "home"
    monkeypatch.setenv("DPFL_DATA_HOME", str(home))
    return home


def converted(tmp_path: Path, users: int = 12, seed: int = 0) -> tuple[object, Path, np.ndarray]:
    """A source converted once: the source, its cache folder and its training tokens as converted."""
    path = write_rows(styled_rows(users, seed=seed), tmp_path / f"c{seed}.parquet", "parquet")
    source = text_source(words_options(path), {})
    corpus = load_text_corpus(source)
    return source, corpus_path(source), np.array(corpus.train.tokens)


def test_a_truncated_token_file_is_rebuilt_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, folder, tokens = converted(tmp_path)
    capsys.readouterr()
    path = folder / "train.tokens"
    os.truncate(path, path.stat().st_size - 7)
    corpus = load_text_corpus(source)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "fails its check" in line]
    assert len(lines) == 1, err
    assert "train.tokens holds" in lines[0] and "truncated" in lines[0] and str(folder) in lines[0]
    np.testing.assert_array_equal(corpus.train.tokens, tokens)  # converted again, whole


@pytest.mark.parametrize("change", ["in range", "out of range"])
def test_a_same_size_corruption_is_caught_and_rebuilt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: str
) -> None:
    """Bytes changed in place after a check passed: the size holds, the checksum does not."""
    source, folder, tokens = converted(tmp_path)
    load_text_corpus(source)  # opened again: the check that passed is remembered
    capsys.readouterr()
    path = folder / "train.tokens"
    size = path.stat().st_size
    with path.open("r+b") as handle:
        values = np.fromfile(handle, dtype=np.uint16)
        values[3] = values[3] % 20 + 1 if change == "in range" else 65535  # a word's id, or no id
        assert values[3] != tokens.reshape(-1)[3]
        handle.seek(0)
        handle.write(values.tobytes())
    assert path.stat().st_size == size
    corpus = load_text_corpus(source)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "fails its check" in line]
    assert len(lines) == 1, err
    assert "train.tokens does not match the checksum" in lines[0] and "converting it again" in lines[0]
    np.testing.assert_array_equal(corpus.train.tokens, tokens)
    load_text_corpus(source)
    assert capsys.readouterr().err == ""  # the rebuilt folder passes


def test_a_checked_folder_is_opened_without_reading_its_files_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a check passed, opening the folder costs a ``stat`` per file; a changed file is read again."""
    from fl_app.data import text_cache

    source, folder, _ = converted(tmp_path)
    reads: list[Path] = []
    read_through = text_cache.read_through
    monkeypatch.setattr(
        text_cache, "read_through", lambda path, dtype: reads.append(path) or read_through(path, dtype)
    )
    for _ in range(100):  # a record written within the clock tick of the files' change is not trusted
        reads.clear()
        load_text_corpus(source)
        if not reads:
            break
    assert reads == []
    os.utime(folder / "test_offsets.npy")  # any change of a file: its contents are checked again
    load_text_corpus(source)
    assert len(reads) == 4


def test_a_named_folder_with_an_id_outside_its_vocabulary_is_refused(tmp_path: Path) -> None:
    """A converted folder named by dataset.path (no checksums needed) is still checked id by id."""
    from fl_app.data.synthetic_text import write_token_corpus

    folder = tmp_path / "corpus"
    write_token_corpus(folder, users=6, test_users=2, mean_sentences=3, cap=None, words=30, length=20)
    meta = (folder / "meta.json").read_text()
    (folder / "meta.json").write_text(meta.replace(', "files"', ', "unchecked"'))  # as an older writer's
    values = np.fromfile(folder / "test.tokens", dtype=np.uint16)
    values[-1] = 40  # 30 words + 4 special tokens: ids 0..33
    values.tofile(folder / "test.tokens")
    options = words_options(folder, vocab_size=30)
    with pytest.raises(
        DataFileError, match=r"test.tokens holds the token id 40, outside the vocabulary's 34"
    ):
        load_text_corpus(text_source(options, {}))


def test_leftovers_of_killed_conversions_are_removed_but_not_a_live_ones(
    tmp_path: Path, data_home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = data_home / "text"
    dead = cache / f".{'a' * 32}.x1y2z3"  # a killed process's: nobody holds it
    live = cache / f".{'b' * 32}.q7r8s9"  # a conversion under way (this test holds its lock)
    for folder in (dead, live):
        folder.mkdir(parents=True)
        (folder / "train.tokens").write_bytes(b"\0" * 64)
    descriptor = os.open(live, os.O_RDONLY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        converted(tmp_path)
        assert not dead.exists() and (live / "train.tokens").is_file()
    finally:
        os.close(descriptor)
    err = capsys.readouterr().err
    assert "removed 1 partial conversion(s)" in err and dead.name in err and live.name not in err


#: The command with its conversion held after the first user's rows are written: it writes the file
#: named by $DPFL_TEST_REACHED and waits (at most 600 s) to be stopped.
HELD_COMMAND = """
import os, runpy, sys, time
from pathlib import Path

import fl_app.data.text as text

add = text._Writer.add


def held(self, rows):
    add(self, rows)
    self.handle.flush()
    Path(os.environ["DPFL_TEST_REACHED"]).write_text("held")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        time.sleep(0.05)


text._Writer.add = held
sys.argv = ["fl_app", *sys.argv[1:]]
runpy.run_module("fl_app", run_name="__main__", alter_sys=True)
"""


@pytest.mark.subprocess
def test_a_sigterm_during_a_conversion_says_so_and_leaves_nothing(tmp_path: Path, data_home: Path) -> None:
    """``python -m fl_app`` stopped by SIGTERM in its conversion: one line, status 143, no partial folder."""
    path = write_rows(styled_rows(30, seed=4), tmp_path / "corpus.parquet", "parquet")
    reached = tmp_path / "reached"
    overrides = [
        "dataset=stackoverflow",
        f"dataset.path={path}",
        "dataset.vocab_size=30",
        "partition=natural",
        "num_clients=10",
        "simulation.backend=inline",
        f"output_dir={tmp_path / 'run'}",
    ]
    env = {**os.environ, "DPFL_DATA_HOME": str(data_home), "DPFL_TEST_REACHED": str(reached)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = subprocess.Popen(
        [sys.executable, "-c", HELD_COMMAND, *overrides],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + REACH_TIMEOUT_S
        while not reached.exists() and command.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if not reached.exists():
            command.kill()
            out, err = command.communicate(timeout=60)
            pytest.fail(f"the conversion was not reached (status {command.returncode}):\n{out}\n{err}")
        staging = [entry for entry in (data_home / "text").iterdir() if entry.name.startswith(".")]
        assert len(staging) == 1 and (staging[0] / "train.tokens").stat().st_size > 0  # held, half written
        command.send_signal(signal.SIGTERM)
        out, err = command.communicate(timeout=REACH_TIMEOUT_S)
    finally:
        if command.poll() is None:
            command.kill()
            command.communicate(timeout=60)
    assert command.returncode == 128 + signal.SIGTERM, (command.returncode, out, err)
    stops = [line for line in err.splitlines() if "SIGTERM" in line]
    assert stops == [
        f"dpfl: stopped by SIGTERM before the run began (converting {path}: its partial arrays were "
        "removed): nothing ran, nothing to resume"
    ], err
    assert "Traceback" not in err and "Traceback" not in out
    assert list((data_home / "text").iterdir()) == []  # no partial folder, no converted one
    assert not (tmp_path / "run").exists()
