"""The published text settings (``+experiment=so_*``, ``shakespeare_adaptive_clip``), checked before a run.

For each preset, on a generated corpus of the data set's shape (Stack Overflow: 342,477 training users
and the 10,004-token vocabulary; Shakespeare: 715 users and 90 characters;
:func:`fl_app.data.synthetic_text.write_token_corpus`): the configuration validated as a run's is, the
strategy built as the run builds it (its noise calibration and schedule), every one of the preset's
rounds charged to its accountant as the run charges it (:func:`charge_every_round`: the privacy of
the whole run, without training), and the network's size. ``one_round`` runs one round of the preset for real.

Usage::

    python -P benchmarks/text_presets.py /tmp/preset_corpora        # the table of docs/text.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

#: The presets and the data set each runs on.
PRESETS = {
    "so_dp_fedavg": "stackoverflow",
    "so_dp_ftrl": "stackoverflow",
    "so_adaptive_clip": "stackoverflow",
    "so_bandmf": "stackoverflow",
    "shakespeare_adaptive_clip": "shakespeare",
}


def shaped_corpus(folder: Path, dataset: str, *, mean_sentences: float = 1.5) -> Path:
    """A converted corpus of ``dataset``'s population and vocabulary (few sentences per user), once."""
    from fl_app.data.synthetic_text import write_token_corpus

    target = folder / dataset
    if not (target / "meta.json").is_file():
        if dataset == "stackoverflow":
            write_token_corpus(
                target, users=342_477, test_users=300, mean_sentences=mean_sentences, cap=256, seed=0,
                test_mean_sentences=5.0,
            )  # fmt: skip
        else:
            write_token_corpus(
                target, users=715, test_users=100, mean_sentences=20, cap=None, words=86, length=80, seed=0
            )
    return target


def overrides(preset: str, corpus: Path, *extra: str) -> list[str]:
    """The preset on the generated corpus."""
    return [f"+experiment={preset}", f"dataset.path={corpus}", *extra]


def charge_every_round(strategy: Any, rounds: int) -> None:
    """Charge each round to the strategy's accountant with its own ``_record_release``, as the run does.

    DP-BandMF charges every member of the round's group (at Stack Overflow's population, 342,477
    clients a round: minutes of bookkeeping for a schedule of 2,052 rounds). Its members are charged
    alike, so here its groups are cut to their first member and the accountant holds those: each is
    charged what every member of its group is, and the worst of them is the run's worst client.
    """
    from fl_app.privacy.accountant import PrivacyAccountant

    groups = getattr(strategy, "groups", None)
    if groups is not None:
        strategy.groups = [group[:1] for group in groups]
        strategy.accountant = PrivacyAccountant(
            population=[group[0].client_id for group in strategy.groups],
            unit=strategy.privacy_unit,
            method=strategy.run.settings.privacy.accountant,
        )
    for server_round in range(1, rounds + 1):
        strategy._record_release(server_round)


def noise_multiplier(strategy: Any) -> float | None:
    """The round's noise multiplier z (adaptive clipping: its plan's total, before the split)."""
    plan = getattr(strategy, "plan", None)
    return plan.noise_multiplier if plan is not None else getattr(strategy, "noise_multiplier", None)


def dry_run(preset: str, corpus: Path, output: Path) -> dict[str, Any]:
    """Validate, build the strategy, charge every round to its accountant; what a run would promise."""
    from fl_app.config.compose import compose_config
    from fl_app.config.validation import validate_config
    from fl_app.run.harness import run_context_for
    from strategies import STRATEGIES

    settings = validate_config(compose_config(overrides(preset, corpus)))
    run = run_context_for(overrides(preset, corpus), output)
    strategy = STRATEGIES.get(settings.strategy)(run)
    charge_every_round(strategy, settings.num_rounds)
    report = strategy.epsilon()
    network = run.model_spec.build()
    return {
        "preset": preset,
        "strategy": settings.strategy,
        "model": run.model_spec.name,
        "parameters": sum(p.numel() for p in network.parameters()),
        "clients": run.num_clients,
        "clients_per_round": run.clients_per_round,
        "rounds": settings.num_rounds,
        "noise_multiplier": noise_multiplier(strategy),
        "epsilon": None if report is None else report.epsilon,
        "delta": settings.privacy.delta,
    }


def one_round(preset: str, corpus: Path, output: Path) -> dict[str, Any]:
    """One round of the preset, for real (inline backend), on the generated corpus; its results.json."""
    import json

    from fl_app.config.compose import compose_config
    from fl_app.config.validation import validate_config
    from fl_app.engine import simulation

    extra = (
        "num_rounds=1",
        "simulation.backend=inline",
        "evaluation.test_subset=200",
        f"output_dir={output}",
    )
    chosen = overrides(preset, corpus, *extra)
    started = time.perf_counter()
    simulation.run_in_simulation(validate_config(compose_config(chosen)), chosen, output)
    results = json.loads((output / "results.json").read_text())
    results["_seconds"] = time.perf_counter() - started
    return results


def main() -> None:
    """Print the dry-run table (markdown) and each preset's one-round time."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="where the generated corpora are kept")
    parser.add_argument("--presets", nargs="+", choices=list(PRESETS), default=list(PRESETS))
    args = parser.parse_args()
    rows = []
    for preset in args.presets:
        corpus = shaped_corpus(args.folder, PRESETS[preset])
        with tempfile.TemporaryDirectory() as tmp:
            started = time.perf_counter()
            row = dry_run(preset, corpus, Path(tmp))
            row["dry_run_s"] = round(time.perf_counter() - started, 1)
            results = one_round(preset, corpus, Path(tmp) / "run")
        row["one_round_s"] = round(results["_seconds"], 1)
        row["status"] = results["status"]
        print(row, flush=True)
        rows.append(row)
    print("\n| preset | strategy | network (parameters) | clients, per round, rounds | z | epsilon (delta) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        z = "calibrated" if r["noise_multiplier"] is None else f"{r['noise_multiplier']:.4g}"
        print(
            f"| `{r['preset']}` | `{r['strategy']}` | {r['model']} ({r['parameters']:,}) | "
            f"{r['clients']:,}, {r['clients_per_round']}, {r['rounds']} | {z} | "
            f"{r['epsilon']:.4g} ({r['delta']:g}) |"
        )


if __name__ == "__main__":
    main()
