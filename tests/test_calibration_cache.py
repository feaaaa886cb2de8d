"""The disk cache of calibrations (fl_app/privacy/calibration_cache.py): found, checked, never trusted."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from fl_app.privacy import calibration, calibration_cache, composition
from fl_app.privacy.calibration_cache import CACHE_ENV, calibration_key, checked_calibration

#: A DP-FedAvg calibration with PLD (a sampled Gaussian over 20 rounds).
TASK = {"epsilon": 4.0, "delta": 1e-5, "sampling_rate": 0.1, "rounds": 20, "method": "pld"}


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A cache folder of the test's own, and no calibration remembered in this process."""
    folder = tmp_path / "calibrations"
    monkeypatch.setenv(CACHE_ENV, str(folder))
    calibration.dp_fedavg_noise_multiplier.cache_clear()
    yield folder
    calibration.dp_fedavg_noise_multiplier.cache_clear()


def stored_files(folder: Path) -> dict[str, int]:
    """Each stored answer's file name and inode (a rewrite replaces the inode: temporary + rename)."""
    return {path.name: path.stat().st_ino for path in folder.glob("*.npz")}


def counting(answer: float) -> tuple[list[float], Callable[[], float]]:
    """A search that always answers ``answer`` and the list of its answers so far."""
    computed: list[float] = []

    def compute() -> float:
        computed.append(answer)
        return answer

    return computed, compute


def test_an_answer_is_computed_once_then_read(cache: Path) -> None:
    computed, compute = counting(0.75)
    arguments = {"epsilon": 1.0, "rounds": 3}
    assert checked_calibration("search", arguments, compute=compute, meets=lambda z: z >= 0.7) == 0.75
    assert checked_calibration("search", arguments, compute=compute, meets=lambda z: z >= 0.7) == 0.75
    assert computed == [0.75]
    assert len(stored_files(cache)) == 1


def test_a_stored_answer_that_misses_the_target_is_computed_again(cache: Path) -> None:
    computed, compute = counting(0.75)
    arguments = {"epsilon": 1.0}
    checked_calibration("search", arguments, compute=compute, meets=lambda z: True)
    # the same key, a stricter check (as after an edit of the file or of the accountant's code)
    assert checked_calibration("search", arguments, compute=compute, meets=lambda z: z > 0.8) == 0.75
    assert computed == [0.75, 0.75]


@pytest.mark.parametrize("content", [b"", b"not an npz", None])
def test_an_unreadable_or_wrong_file_is_computed_again(cache: Path, content: bytes | None) -> None:
    computed, compute = counting(0.5)
    key = calibration_key("search", {"epsilon": 2.0})
    cache.mkdir()
    path = cache / f"{key}.npz"
    if content is None:
        np.savez(path, other=np.float64(0.1))  # readable, without an answer
    else:
        path.write_bytes(content)
    assert checked_calibration("search", {"epsilon": 2.0}, compute=compute, meets=lambda z: True) == 0.5
    assert computed == [0.5]


def test_off_stores_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, "off")
    monkeypatch.setenv("DPFL_DATA_HOME", str(tmp_path))
    computed, compute = counting(0.5)
    for _ in range(2):
        checked_calibration("search", {"epsilon": 2.0}, compute=compute, meets=lambda z: True)
    assert computed == [0.5, 0.5]
    assert not list(tmp_path.rglob("*.npz"))


def test_the_oldest_answers_go_beyond_max_files(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibration_cache, "MAX_FILES", 3)
    for epsilon in range(5):
        checked_calibration("search", {"epsilon": float(epsilon)}, compute=lambda: 1.0, meets=lambda z: True)
    assert len(stored_files(cache)) == 3


def test_the_key_tells_every_argument_and_search_apart() -> None:
    base = calibration_key("dp_fedavg_noise_multiplier", TASK)
    assert calibration_key("dp_fedavg_noise_multiplier", dict(reversed(TASK.items()))) == base
    assert calibration_key("dp_sgd_noise_multiplier", TASK) != base
    for name, value in TASK.items():
        other = math.nextafter(value, math.inf) if isinstance(value, float) else value
        other = other + 1 if isinstance(value, int) else "rdp" if value == "pld" else other
        assert calibration_key("dp_fedavg_noise_multiplier", {**TASK, name: other}) != base, name
    with pytest.raises(TypeError, match="numbers and strings"):
        calibration_key("search", {"flag": True})


def test_a_replaced_accounting_function_gets_keys_of_its_own(cache: Path, monkeypatch) -> None:
    """A mutant of the accountant (a test's, or any run-time replacement) never reads real answers."""
    task = {**TASK, "method": "rdp"}
    base = calibration_key("dp_fedavg_noise_multiplier", task)
    real = calibration.dp_fedavg_noise_multiplier(**task)
    rdp_epsilon = composition.rdp_epsilon

    def halved(history, *, delta):
        epsilon, order = rdp_epsilon(history, delta=delta)
        return epsilon / 2, order

    monkeypatch.setattr(composition, "rdp_epsilon", halved)
    composition._compose.cache_clear()
    calibration.dp_fedavg_noise_multiplier.cache_clear()
    assert calibration_key("dp_fedavg_noise_multiplier", task) != base
    # the real answer meets the mutant's (looser) target, yet the mutant searches its own
    assert calibration.dp_fedavg_noise_multiplier(**task) < real
    assert len(stored_files(cache)) == 2
    monkeypatch.undo()
    composition._compose.cache_clear()
    assert calibration_key("dp_fedavg_noise_multiplier", task) == base
    # a module-level setting of the accounting, replaced at run time, too
    monkeypatch.setattr(composition, "PLD_VALUE_DISCRETIZATION", 1e-4)
    assert calibration_key("dp_fedavg_noise_multiplier", task) != base


@pytest.mark.subprocess
def test_the_key_is_the_same_in_every_process() -> None:
    """Processes with other string hashes (set constants, dict orders) find each other's answers."""
    import subprocess
    import sys

    code = (
        "from fl_app.privacy import calibration, calibration_cache as c; "
        "print(c.calibration_key('dp_fedavg_noise_multiplier', {'epsilon': 8.0}))"
    )
    keys = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert keys == {calibration_key("dp_fedavg_noise_multiplier", {"epsilon": 8.0})}


def test_dp_fedavg_calibration_reads_the_same_answer_bit_for_bit(cache: Path, monkeypatch) -> None:
    first = calibration.dp_fedavg_noise_multiplier(**TASK)
    files = stored_files(cache)
    assert len(files) == 1
    calibration.dp_fedavg_noise_multiplier.cache_clear()  # as in another process
    as_int = {**TASK, "epsilon": 4, "rounds": 20}  # the same calibration, other Python types
    assert calibration.dp_fedavg_noise_multiplier(**as_int) == first
    assert stored_files(cache) == files  # read, not searched and written again
    monkeypatch.setenv(CACHE_ENV, "off")
    calibration.dp_fedavg_noise_multiplier.cache_clear()
    assert calibration.dp_fedavg_noise_multiplier(**TASK) == first  # what the search alone gives


def test_an_edited_answer_is_used_only_if_it_meets_the_budget(cache: Path) -> None:
    """Tightness can be lost to an edited file, never the budget."""
    fresh = calibration.dp_fedavg_noise_multiplier(**TASK)
    (path,) = cache.glob("*.npz")

    def spent(z: float) -> float:
        return calibration.gaussian_epsilon(
            noise_multiplier=z, sampling_rate=0.1, rounds=20, delta=1e-5, method="pld"
        )

    for edited, expected in [(0.5 * fresh, fresh), (2.0 * fresh, 2.0 * fresh)]:
        np.savez(path, answer=np.float64(edited))
        calibration.dp_fedavg_noise_multiplier.cache_clear()
        answer = calibration.dp_fedavg_noise_multiplier(**TASK)
        assert answer == expected and spent(answer) <= TASK["epsilon"]


def test_dp_sgd_and_randomized_response_calibrations_are_stored_too(cache: Path, monkeypatch) -> None:
    monkeypatch.setattr(calibration, "_DP_SGD_CACHE", {})
    z = calibration.dp_sgd_noise_multiplier(epsilon=2.0, delta=1e-5, sampling_rate=0.05, steps=40)
    per_label = calibration.randomized_response_epsilon_per_label(
        total_epsilon=3.0, delta=1e-5, labels=5, num_classes=10
    )
    files = stored_files(cache)
    assert len(files) == 2
    calibration._DP_SGD_CACHE.clear()
    assert calibration.dp_sgd_noise_multiplier(epsilon=2.0, delta=1e-5, sampling_rate=0.05, steps=40) == z
    again = calibration.randomized_response_epsilon_per_label(
        total_epsilon=3.0, delta=1e-5, labels=5, num_classes=10
    )
    assert again == per_label and stored_files(cache) == files


def _ftrl_histories(scale: float) -> tuple[list[float], Callable[[float], list[dict]]]:
    """A DP-FTRL-like schedule (two participants, Gaussian releases of sensitivity ``scale``) that
    records every noise multiplier it is asked about."""
    from fl_app.privacy.events import Gaussian

    asked: list[float] = []

    def histories_of(z: float) -> list[dict]:
        asked.append(z)
        return [{Gaussian(z / scale): 3}, {Gaussian(z / scale): 2, Gaussian(z): 1}]

    return asked, histories_of


@pytest.fixture
def history_memo(monkeypatch: pytest.MonkeyPatch) -> dict:
    """The process's memo of schedule calibrations, empty for the test."""
    memo: dict = {}
    monkeypatch.setattr(calibration, "_HISTORIES_CACHE", memo)
    return memo


def test_a_schedules_calibration_is_searched_once_per_process_and_once_on_disk(
    cache: Path, history_memo: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DP-FTRL's search over histories: a strategy built again (an audit's trials, a resume) reads it."""
    target = {"epsilon": 2.0, "delta": 1e-5, "method": "pld"}
    asked, histories_of = _ftrl_histories(1.5)
    first = calibration.noise_multiplier_for_histories(**target, histories_of=histories_of)
    searched = len(asked)
    assert searched > 20  # a search
    again = calibration.noise_multiplier_for_histories(**target, histories_of=histories_of)
    assert again == first and len(asked) - searched == 3  # the two reference points and one check
    history_memo.clear()  # as another process: read from the disk, checked
    assert calibration.noise_multiplier_for_histories(**target, histories_of=histories_of) == first
    assert len(asked) - searched == 6 and len(stored_files(cache)) == 1
    monkeypatch.setenv(CACHE_ENV, "off")
    history_memo.clear()
    assert calibration.noise_multiplier_for_histories(**target, histories_of=histories_of) == first
    # another schedule (its releases each 1.5x less sensitive) is another calibration, with less noise
    _, milder = _ftrl_histories(1.0)
    assert calibration.noise_multiplier_for_histories(**target, histories_of=milder) < first / 1.2


def test_a_remembered_schedule_answer_that_misses_the_target_is_searched_again(
    cache: Path, history_memo: dict
) -> None:
    target = {"epsilon": 2.0, "delta": 1e-5, "method": "rdp"}
    _, histories_of = _ftrl_histories(1.5)
    honest = calibration.noise_multiplier_for_histories(**target, histories_of=histories_of)
    (key,) = history_memo
    history_memo[key] = honest / 2  # too little noise for the target
    assert calibration.noise_multiplier_for_histories(**target, histories_of=histories_of) == honest


#: What an edited or damaged cache file may hold instead of an answer: none is one, each is searched again.
NOT_ANSWERS = {
    "zero": np.float64(0.0),
    "negative zero": np.float64(-0.0),
    "negative": np.float64(-1.0),
    "nan": np.float64("nan"),
    "infinity": np.float64("inf"),
    "smallest subnormal": np.float64(5e-324),
    "subnormal": np.float64(1e-310),
    "huge": np.float64(1e308),  # the accountant overflows
    "integer zero": np.int64(0),
    "bool": np.bool_(True),
    "complex": np.complex128(1 + 1j),
    "text": np.array("abc"),
    "text of a number": np.array("0.5"),
    "vector": np.array([1.0, 2.0]),
    "empty": np.array([], dtype=np.float64),
}


def _ftrl_rdp() -> float:
    return calibration.noise_multiplier_for_histories(
        epsilon=2.0, delta=1e-5, histories_of=_ftrl_histories(1.5)[1], method="rdp"
    )


#: Every search kept on disk, on arguments of its own (RDP: a fraction of a second each).
CACHED_SEARCHES: dict[str, Callable[[], float]] = {
    "dp_fedavg_noise_multiplier": lambda: calibration.dp_fedavg_noise_multiplier(**{**TASK, "method": "rdp"}),
    "dp_sgd_noise_multiplier": lambda: calibration.dp_sgd_noise_multiplier(
        epsilon=2.0, delta=1e-5, sampling_rate=0.05, steps=40
    ),
    "randomized_response_epsilon_per_label": lambda: calibration.randomized_response_epsilon_per_label(
        total_epsilon=3.0, delta=1e-5, labels=5, num_classes=10
    ),
    "noise_multiplier_for_histories": _ftrl_rdp,
}


def _forget_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in another process: no calibration remembered in memory."""
    calibration.dp_fedavg_noise_multiplier.cache_clear()
    monkeypatch.setattr(calibration, "_DP_SGD_CACHE", {})
    monkeypatch.setattr(calibration, "_HISTORIES_CACHE", {})


@pytest.mark.parametrize("search", sorted(CACHED_SEARCHES))
def test_a_stored_value_that_is_no_answer_is_searched_again(cache: Path, monkeypatch, search: str) -> None:
    """Zero, negative, subnormal, non-finite, overflowing or mistyped: the run searches and goes on.

    Each stored value used to crash every later run (the accountant refuses or overflows on it) or,
    for a subnormal noise multiplier of DP-SGD, pass the check; each is now searched again, the
    answer is the search's bit for bit, and the file holds it again.
    """
    run = CACHED_SEARCHES[search]
    _forget_in_process(monkeypatch)
    fresh = run()
    (path,) = cache.glob("*.npz")
    for name, value in NOT_ANSWERS.items():
        np.savez(path, answer=value)
        _forget_in_process(monkeypatch)
        assert run() == fresh, name
        with np.load(path) as stored:
            assert stored["answer"].dtype == np.float64 and float(stored["answer"]) == fresh, name
    # the check itself: a normal but absurdly small noise, which the accountant once passed (NaN
    # orders read as epsilon 0), is searched again too
    if search != "randomized_response_epsilon_per_label":  # a tiny epsilon is a (loose) answer there
        np.savez(path, answer=np.float64(1e-200))
        _forget_in_process(monkeypatch)
        assert run() == fresh
