"""No file of a secret cohort's run is born while its rounds run: creation (birth) times date nothing.

A file created when round 1 ends (``rounds.jsonl``, ``metrics.csv``, a checkpoint renamed into place,
an MLflow file store's ``epsilon`` series) tells round 1's duration, which follows the secret cohort's
size; a file's modification time can be set again when the run ends, its birth time cannot. These
tests read birth times with ``statx`` (Python 3.11's ``os`` has no ``statx``: glibc's, through ctypes).
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
from pathlib import Path

import pytest
from conftest import FAST, INLINE

#: ``statx``'s mask bit for the birth time, ``AT_SYMLINK_NOFOLLOW``, ``AT_FDCWD`` (linux/stat.h, fcntl.h).
STATX_BTIME, AT_SYMLINK_NOFOLLOW, AT_FDCWD = 0x800, 0x100, -100
#: ``struct statx``'s size, and the offsets of ``stx_mask`` and ``stx_btime`` (seconds, nanoseconds).
STATX_SIZE, MASK_AT, BTIME_AT = 256, 0, 80
#: A file born closer than this to a round window's ends is not counted (the kernel stamps files with a
#: coarse clock, up to one tick behind ``time.time()``).
CLOCK_TICK_S = 0.02


def birth_time(path: Path) -> float | None:
    """``path``'s birth time (seconds since the epoch), or None when its file system records none."""
    libc = ctypes.CDLL(None, use_errno=True)
    statx = getattr(libc, "statx", None)
    if statx is None:
        pytest.skip("this C library has no statx (glibc 2.28 or later has)")
    buffer = ctypes.create_string_buffer(STATX_SIZE)
    statx.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    if statx(AT_FDCWD, os.fsencode(path), AT_SYMLINK_NOFOLLOW, STATX_BTIME, buffer) != 0:
        code = ctypes.get_errno()
        if code == errno.ENOSYS:
            pytest.skip("this kernel has no statx")
        raise OSError(code, os.strerror(code), str(path))
    if not int.from_bytes(buffer.raw[MASK_AT : MASK_AT + 4], "little") & STATX_BTIME:
        return None
    seconds = int.from_bytes(buffer.raw[BTIME_AT : BTIME_AT + 8], "little", signed=True)
    nanoseconds = int.from_bytes(buffer.raw[BTIME_AT + 8 : BTIME_AT + 12], "little")
    return seconds + nanoseconds / 1e9


def rounds_window(timeline: Path) -> tuple[float, float]:
    """When the last session's first round began and its rounds ended (the run's ``DPFL_TIMELINE`` marks)."""
    marks = [json.loads(line) for line in timeline.read_text().splitlines()]
    start = [m["t"] for m in marks if m["phase"] == "round_1"][-1]
    ends = [m["t"] for m in marks if m["phase"] in ("rounds_done", "rounds_stopped") and m["t"] > start]
    return start, min(ends)


def born_during(folders: list[Path], window: tuple[float, float]) -> dict[str, float]:
    """Each file and folder under ``folders`` (themselves too) born inside ``window``: name -> seconds in."""
    start, end = window
    dated: dict[str, float] = {}
    for folder in folders:
        for path in [folder, *folder.rglob("*")]:
            born = birth_time(path)
            if born is None:
                pytest.skip(f"the file system of {path} records no birth time")
            if start + CLOCK_TICK_S < born < end - CLOCK_TICK_S:
                dated[str(path.relative_to(folder.parent))] = round(born - start, 3)
    return dated


def run_files(output: Path) -> list[str]:
    """The names of the files in the run's folder (hidden ones too)."""
    return sorted(p.name for p in output.iterdir())


@pytest.fixture
def timeline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The runs' phase marks (``DPFL_TIMELINE``); each client message takes 0.15 s more, so a round lasts."""
    path = tmp_path / "timeline.jsonl"
    monkeypatch.setenv("DPFL_TIMELINE", str(path))
    monkeypatch.setenv("DPFL_INJECT_DELAY", "0.15")
    return path


SECRET = [*FAST, INLINE, "strategy=dp_fedavg", "num_rounds=3"]  # Poisson cohorts: secret


@pytest.mark.subprocess  # W&B's core runs as a service process
def test_no_file_of_a_secret_cohorts_run_or_of_its_mlflow_file_store_is_born_during_its_rounds(
    simulate, timeline, tmp_path, monkeypatch
):
    """A real run with TensorBoard, W&B offline and an MLflow file store (outside the output folder)."""
    from tracked import offline_wandb

    offline_wandb(monkeypatch, tmp_path / "wandb_home")
    store = tmp_path / "mlruns"
    tracking = ["tracking=[tensorboard,mlflow,wandb]", f"tracker.mlflow_uri={store.as_uri()}"]
    results = simulate([*SECRET, *tracking], name="run")
    output = Path(results["_output_dir"])
    assert "secret" in results["privacy"]["randomness"]["cohort"]
    assert [r["round"] for r in results["rounds"]] == [1, 2, 3]
    # what the rounds wrote is there (the check below has something to find)
    written = {"rounds.jsonl", "metrics.csv", "privacy_ledger.json", "run.log", "tensorboard", "wandb"}
    assert written <= set(run_files(output))
    assert len(list(store.rglob("metrics/epsilon"))) == 1  # the file store's epsilon series
    assert not [name for name in run_files(output) if ".spare" in name]  # the spares are gone
    assert born_during([output, store], rounds_window(timeline)) == {}


def test_a_secret_cohorts_checkpoint_is_born_before_round_one_and_its_run_resumes_exactly(
    simulate, timeline, monkeypatch
):
    """Stopped after round 2 (a Ctrl-C), then ``resume=``: each session's files are born outside its
    rounds, the checkpoint read back is whole, and the resumed run equals a straight one."""
    from fl_app.run import lifecycle
    from fl_app.run.checkpoint import CHECKPOINT_FILE, read_header
    from fl_app.run.reporter import RoundReporter

    straight = simulate(SECRET, name="straight")
    after_round = RoundReporter.__call__

    def stop_after_round_two(self, server_round, arrays):
        metrics = after_round(self, server_round, arrays)
        if server_round == 2:
            lifecycle.request_stop(signal.SIGINT)
        return metrics

    monkeypatch.setattr(RoundReporter, "__call__", stop_after_round_two)
    try:
        stopped = simulate(SECRET, name="stopped")
    finally:
        lifecycle.STOP.clear()
        lifecycle._signal_received.clear()
    monkeypatch.setattr(RoundReporter, "__call__", after_round)
    output = Path(stopped["_output_dir"])
    assert stopped["status"] == "interrupted" and stopped["stopped"]["after_round"] == 2
    assert read_header(output)["completed_round"] == 2
    assert (output / CHECKPOINT_FILE).stat().st_mode & 0o777 == 0o600
    first_round = [json.loads(line) for line in timeline.read_text().splitlines() if "round_1" in line][-1]
    assert birth_time(output / CHECKPOINT_FILE) < first_round["t"]  # round 2's state, in a file born before
    assert born_during([output], rounds_window(timeline)) == {}
    assert not [name for name in run_files(output) if ".spare" in name]

    resumed = simulate([f"resume={output}"], name="stopped")
    assert resumed["status"] == "completed" and [r["round"] for r in resumed["rounds"]] == [1, 2, 3]
    assert [r["accuracy"] for r in resumed["rounds"]] == [r["accuracy"] for r in straight["rounds"]]
    assert resumed["final"]["epsilon"] == straight["final"]["epsilon"]
    assert born_during([output], rounds_window(timeline)) == {}
    assert not [name for name in run_files(output) if ".spare" in name]
