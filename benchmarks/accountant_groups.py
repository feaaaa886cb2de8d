"""The accountant at Stack Overflow's population: charged per client (before) and per history class (after).

Usage (from the repository root)::

    .venv/bin/python -P benchmarks/accountant_groups.py [--base 131b590] [--users 342477] [--repeats 3]

Two schedules of 342,477 users (the Stack Overflow training population), each charged to the
accountant of commit ``--base`` (read with ``git show``: one counter and one set of rounds per named
client) and to this checkout's (one history class per client, charged per class), interleaved, in
this process:

* ``population``: every round names all users (``so_dp_fedavg``'s one-band DP-BandMF group, and any
  Poisson-sampled release that charges everyone), 1 and 20 rounds;
* ``groups``: 342 public groups of ~1,001 users, one a round (``so_bandmf``), 400 rounds.

For each: the CPU time (``time.process_time``) of recording the rounds, of the worst epsilon (the
second call: the composition of each distinct history is cached by both, so this is the work of
finding the distinct histories), of pickling the accountant (as a checkpoint does) and of reading it
back, and the pickle's size. Each cell is the median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import importlib.util
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DELTA = 1e-6


def base_accountant(revision: str) -> ModuleType:
    """``fl_app/privacy/accountant.py`` of ``revision``, imported as ``accountant_base``."""
    source = subprocess.run(
        ["git", "show", f"{revision}:fl_app/privacy/accountant.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "accountant_base.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("accountant_base", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["accountant_base"] = module  # pickle finds the class by its module's name
    spec.loader.exec_module(module)
    return module


def schedules(users: int) -> dict[str, list[tuple[int, ...]]]:
    """Each schedule's participant tuple per round (a fresh tuple each round, as the strategy builds)."""
    import numpy as np

    population = list(range(users))
    groups = [tuple(int(c) for c in part) for part in np.array_split(np.arange(users), 342)]
    return {
        "population, 1 round": [tuple(population)],
        "population, 20 rounds": [tuple(population) for _ in range(20)],
        "groups, 400 rounds": [tuple(groups[(t - 1) % 342]) for t in range(1, 401)],
    }


def seconds(action: Callable[[], Any]) -> tuple[float, Any]:
    """CPU seconds of ``action()`` and its result."""
    start = time.process_time()
    result = action()
    return time.process_time() - start, result


def measure(cls: type, users: int, rounds: list[tuple[int, ...]]) -> dict[str, float]:
    """Record the rounds, take the worst epsilon twice, pickle and unpickle; CPU seconds and bytes."""
    from fl_app.privacy.events import PrivacyEvent, SampledGaussian

    mechanism = SampledGaussian(1.6, min(1.0, 1000 * 342 / users))
    accountant = cls(population=range(users), unit="one user", method="rdp")

    def record() -> None:
        for server_round, participants in enumerate(rounds, start=1):
            accountant.record(PrivacyEvent(server_round, mechanism, participants=participants))

    record_s, _ = seconds(record)
    accountant.epsilon(delta=DELTA)  # the compositions cached: the second call finds the histories
    epsilon_s, report = seconds(lambda: accountant.epsilon(delta=DELTA))
    pickle_s, data = seconds(lambda: pickle.dumps(accountant, protocol=pickle.HIGHEST_PROTOCOL))
    load_s, _ = seconds(lambda: pickle.loads(data))
    return {
        "record_s": record_s,
        "epsilon_s": epsilon_s,
        "pickle_s": pickle_s,
        "unpickle_s": load_s,
        "pickle_mb": len(data) / 1e6,
        "epsilon": report.epsilon,
    }


def main(argv: list[str] | None = None) -> int:
    """Print the table (markdown)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="131b590", help="the commit whose accountant is 'before'")
    parser.add_argument("--users", type=int, default=342_477)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from fl_app.privacy.accountant import PrivacyAccountant

    arms = {"before": base_accountant(args.base).PrivacyAccountant, "after": PrivacyAccountant}
    columns = ("record_s", "epsilon_s", "pickle_s", "unpickle_s")
    heads = ("record (ms)", "worst epsilon (ms)", "pickle (ms)", "unpickle (ms)", "pickle (MB)")
    print(f"| schedule ({args.users:,} users) | accountant | " + " | ".join(heads) + " | epsilon |")
    print("|---" * (len(heads) + 3) + "|")
    for name, rounds in schedules(args.users).items():
        runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
        for _ in range(args.repeats):
            for arm, cls in arms.items():  # interleaved: before, after, before, after, ...
                runs[arm].append(measure(cls, args.users, rounds))
        for arm in arms:
            cells = [f"{1000 * statistics.median(r[c] for r in runs[arm]):,.2f}" for c in columns]
            cells.append(f"{statistics.median(r['pickle_mb'] for r in runs[arm]):.1f}")
            print(f"| {name} | {arm} | " + " | ".join(cells) + f" | {runs[arm][0]['epsilon']:.4f} |")
        assert runs["before"][0]["epsilon"] == runs["after"][0]["epsilon"], name
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
