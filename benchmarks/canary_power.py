r"""How much under-noising the canary estimate catches: detection power by number of canaries.

The one-shot canary estimate (``privacy.canaries``, :mod:`fl_app.privacy.canaries`) flags a run when
its whole 95 % interval lies above the accountant's epsilon (``low > claim``). This script measures
how often that happens when the mechanism adds less noise than it accounts for: each strategy's noise
draw is divided by a factor ``f`` (a bug that keeps the claim: the accountant still records the
calibrated noise), and the run is repeated with ``--repeats`` seeds for every ``(f, canaries)``.

The shape is the suite's (``tests/test_empirical_privacy.py``): digits, 20 clients, 10 per round,
5 rounds, claimed epsilon 2 at delta 1e-5, constructed replies (every real update: norm 2 in a random
direction, so every update is clipped), the strategy's real server code (and, for FedAvg+LDP, the
device's clip-and-noise step). ``true epsilon`` is the accountant's epsilon of the noise that was
really added (the mutant's), for reference.

Usage::

    python benchmarks/canary_power.py --strategies dp_fedavg dp_ftrl --repeats 20 \
        --out docs/benchmarks/empirical_privacy/power.md
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from fl_app.engine.messages import set_task_identity
from fl_app.run.harness import random_update_rounds, run_context_for
from strategies import STRATEGIES

SHAPE = ["dataset=digits", "num_clients=20", "clients_per_round=10", "num_rounds=5", "privacy.epsilon=2"]
SETTINGS = {"dp_fedavg_adaptive": ["strategy.bit_noise=3.0"]}
#: The module whose noise function each strategy's mutant patches, and that function's name.
NOISE_FUNCTION = {
    "dp_fedavg": ("strategies.dp_fedavg", "gaussian_mechanism"),
    "dp_fedavg_adaptive": ("strategies.dp_fedavg_adaptive", "gaussian_mechanism"),
    "dp_ftrl": ("strategies.dp_ftrl.strategy", "gaussian_mechanism"),
    "fedavg_ldp": ("strategies.fedavg_ldp", "local_gaussian_update"),
}


@contextlib.contextmanager
def under_noised(name: str, factor: float) -> Iterator[None]:
    """Inside: ``name``'s noise is ``factor`` times smaller than the one it accounts for."""
    module_name, function = NOISE_FUNCTION[name]
    module = sys.modules.get(module_name) or __import__(module_name, fromlist=["_"])
    original = getattr(module, function)

    def weaker(**kwargs: Any) -> Any:
        if "sigma" in kwargs:
            kwargs["sigma"] = kwargs["sigma"] / factor
        else:
            kwargs["noise_multiplier"] = kwargs["noise_multiplier"] / factor
        return original(**kwargs)

    setattr(module, function, weaker)
    try:
        yield
    finally:
        setattr(module, function, original)


def canary_run(name: str, *, canaries: int, factor: float, seed: int) -> dict[str, float]:
    """One run of the suite's shape: the estimate, the claim and the mutant's true epsilon."""
    overrides = [*SHAPE, f"strategy={name}", f"privacy.canaries={canaries}", f"seed={seed}"]
    overrides += [f"privacy.noise_seed={seed + 1}", *SETTINGS.get(name, [])]
    with tempfile.TemporaryDirectory() as output:
        strategy = STRATEGIES.get(name)(run_context_for(overrides, Path(output)))
        with under_noised(name, factor):
            arrays = random_update_rounds(strategy, 5, norm=2.0, seed=seed)
        empirical = strategy.empirical_privacy(arrays)
        claim = float(strategy.epsilon().epsilon)
    assert empirical is not None
    return {
        "estimate": empirical["epsilon"],
        "low": empirical["low"],
        "high": empirical["high"],
        "claim": claim,
    }


def true_epsilon(name: str, factor: float) -> float:
    """The accountant's epsilon (PLD) of the noise the mutant adds: its multiplier divided by ``factor``."""
    from collections import Counter

    from fl_app.privacy.composition import compose_epsilon
    from fl_app.privacy.events import Gaussian, SampledGaussian

    with tempfile.TemporaryDirectory() as output:
        overrides = [*SHAPE, f"strategy={name}", *SETTINGS.get(name, [])]
        strategy = STRATEGIES.get(name)(run_context_for(overrides, Path(output)))
    rounds, delta = 5, 1e-5
    if name == "dp_fedavg":
        history = {SampledGaussian(strategy.noise_multiplier / factor, strategy.rate): rounds}
    elif name == "dp_fedavg_adaptive":
        plan = strategy.plan
        history = {SampledGaussian(plan.noise_multiplier / factor, plan.sampling_rate): rounds}
    elif name == "dp_ftrl":
        worst = strategy._worst_histories()(strategy.noise_multiplier / factor)
        return max(compose_epsilon(h, delta=delta, method="pld").epsilon for h in worst)
    else:  # fedavg_ldp: Gaussian(z) per upload of its busiest client
        history = dict(Counter({Gaussian(strategy.noise_multiplier / factor): strategy.max_participations}))
    return compose_epsilon(history, delta=delta, method="pld").epsilon


def main(argv: list[str] | None = None) -> int:
    """Measure the detection rate per (strategy, factor, canaries); print and write a markdown table."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--strategies", nargs="+", default=["dp_fedavg", "dp_ftrl"])
    parser.add_argument("--factors", nargs="+", type=float, default=[1.0, 1.25, 1.5, 2.0, 3.0, 10.0])
    parser.add_argument("--canaries", nargs="+", type=int, default=[200, 1000, 5000])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None, help="markdown table")
    parser.add_argument("--json", type=Path, default=None, help="every run's numbers")
    args = parser.parse_args(argv)
    set_task_identity(run_id=1)  # messages built outside a run
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    for name in args.strategies:
        for canaries in args.canaries:
            for factor in args.factors:
                runs = [
                    canary_run(name, canaries=canaries, factor=factor, seed=seed)
                    for seed in range(args.repeats)
                ]
                caught = sum(r["low"] > r["claim"] for r in runs)
                row = {
                    "strategy": name,
                    "canaries": canaries,
                    "factor": factor,
                    "claim": runs[0]["claim"],
                    "true_epsilon": true_epsilon(name, factor),
                    "estimate_mean": float(np.mean([r["estimate"] for r in runs])),
                    "low_mean": float(np.mean([r["low"] for r in runs])),
                    "detected": caught / len(runs),
                    "runs": runs,
                }
                rows.append(row)
                print(
                    f"{name} canaries={canaries} noise/{factor:g}: estimate {row['estimate_mean']:.3g} "
                    f"(low {row['low_mean']:.3g}) claim {row['claim']:.3g}, detected {caught}/{len(runs)} "
                    f"[{time.monotonic() - started:.0f} s]",
                    flush=True,
                )
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.out is not None:
        args.out.write_text(table(rows, args))
    return 0


def table(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """Detection rate per factor and number of canaries, one table per strategy."""
    lines = []
    for name in args.strategies:
        own = [r for r in rows if r["strategy"] == name]
        lines += [f"#### `{name}` (claim {own[0]['claim']:.3g})", ""]
        header = (
            "| noise divided by | true epsilon | "
            + " | ".join(f"{c:,} canaries" for c in args.canaries)
            + " |"
        )
        lines += [header, "|" + "---|" * (2 + len(args.canaries))]
        for factor in args.factors:
            cells = []
            for canaries in args.canaries:
                row = next(r for r in own if r["canaries"] == canaries and r["factor"] == factor)
                cells.append(
                    f"{row['detected']:.0%} (est. {row['estimate_mean']:.2f}, low {row['low_mean']:.2f})"
                )
            true = next(r for r in own if r["factor"] == factor)["true_epsilon"]
            lines.append(f"| {factor:g} | {true:.3g} | " + " | ".join(cells) + " |")
        smallest = []
        for canaries in args.canaries:
            caught = [r["factor"] for r in own if r["canaries"] == canaries and r["detected"] >= 0.95]
            smallest.append(
                f"{canaries:,}: {min(caught):g}x"
                if caught
                else f"{canaries:,}: none up to {max(args.factors):g}x"
            )
        lines += [
            "",
            "Smallest under-noising detected in at least 95 % of runs: " + "; ".join(smallest) + ".",
            "",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
