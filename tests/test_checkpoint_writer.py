"""The checkpoint written while the next round runs: in order, durable before a run ends, its failure raised.

:class:`fl_app.run.checkpoint.CheckpointWriter` writes each round's checkpoint on a background thread.
These tests check what that must not change: the file on disk is the last round's when a run returns,
a write never overtakes the one before it, and a full disk still ends the run with its one line while
the previous checkpoint stays whole.
"""

from __future__ import annotations

import errno
import io
import pickle
import threading
from pathlib import Path

import pytest
from conftest import FAST, INLINE

from fl_app.run import checkpoint
from fl_app.run.checkpoint import CHECKPOINT_FILE, CheckpointWriter, read_header
from fl_app.run.files import WriteFailed, write_failed


def test_writes_land_in_order_and_a_failure_is_raised_by_the_next_settle(tmp_path: Path, monkeypatch) -> None:
    """The second write waits for the first; a failed write raises once, at ``settle``; the file stays."""
    started, release, order = threading.Event(), threading.Event(), []
    real = checkpoint.write_atomically

    def gated(path: Path, data: bytes, **kwargs: object) -> None:
        if data == b"one":
            started.set()
            assert release.wait(timeout=30)
        order.append(data)
        if data == b"full":
            raise write_failed(path, OSError(errno.ENOSPC, "No space left on device"))
        real(path, data, **kwargs)

    monkeypatch.setattr(checkpoint, "write_atomically", gated)
    writer = CheckpointWriter()
    writer.write(tmp_path, b"one")
    assert started.wait(timeout=30)
    second = threading.Thread(target=writer.write, args=(tmp_path, b"two"))
    second.start()  # blocks in write() until the first write is done
    release.set()
    second.join(timeout=30)
    writer.settle()
    assert order == [b"one", b"two"]
    assert (tmp_path / CHECKPOINT_FILE).read_bytes() == b"two"

    writer.write(tmp_path, b"full")  # returns: the failure belongs to the write on the thread
    with pytest.raises(WriteFailed, match=r"private_server_state\.pkl: No space left on device"):
        writer.settle()
    writer.settle()  # raised once
    assert (tmp_path / CHECKPOINT_FILE).read_bytes() == b"two"
    assert not list(tmp_path.glob(f".{CHECKPOINT_FILE}.*"))  # no temporary file left


def header_round(data: bytes) -> int:
    """The completed round a checkpoint's bytes hold (its first pickle is the header)."""
    return int(pickle.load(io.BytesIO(data))["completed_round"])


def test_a_run_returns_with_its_last_checkpoint_on_disk(tmp_path: Path, monkeypatch) -> None:
    """Every round's checkpoint is written, in round order, and the last is on disk when the run returns."""
    from fl_app.api import run_experiment

    real, written = checkpoint.write_atomically, []

    def recording(path: Path, data: bytes, **kwargs: object) -> None:
        written.append(header_round(data))
        real(path, data, **kwargs)

    monkeypatch.setattr(checkpoint, "write_atomically", recording)
    out = tmp_path / "run"
    results = run_experiment(*FAST, INLINE, "strategy=fedavg", "num_rounds=3", output_dir=out)
    assert results["status"] == "completed"
    assert written == [1, 2, 3]
    assert read_header(out)["completed_round"] == 3


def test_a_full_disk_at_a_background_checkpoint_ends_the_run_and_keeps_the_previous_one(
    tmp_path: Path, monkeypatch
) -> None:
    """Round 2's checkpoint cannot be written: the run fails with the write's one line, round 1's stays."""
    from fl_app.api import run_experiment
    from fl_app.run.lifecycle import RunFailed

    real = checkpoint.write_atomically

    def full_at_round_two(path: Path, data: bytes, **kwargs: object) -> None:
        if header_round(data) == 2:
            raise write_failed(path, OSError(errno.ENOSPC, "No space left on device"))
        real(path, data, **kwargs)

    monkeypatch.setattr(checkpoint, "write_atomically", full_at_round_two)
    out = tmp_path / "run"
    with pytest.raises(RunFailed, match=r"private_server_state\.pkl: No space left on device"):
        run_experiment(*FAST, INLINE, "strategy=fedavg", "num_rounds=4", output_dir=out)
    assert read_header(out)["completed_round"] == 1
    assert not list(out.glob(f".{CHECKPOINT_FILE}.*"))  # no temporary file left
    assert "dpfl: run failed after round 2: could not write" in (out / "run.log").read_text()
