"""A seeded run depends only on its experiment: not on its label, tracker, output folder or spelling.

The derived noise seed and the checkpoint's fingerprint digest the validated, typed settings
(:meth:`fl_app.config.settings.RunSettings.experiment`); the report groups runs by the same reading.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fl_app.config.compose import compose_config
from fl_app.config.validation import typed_settings
from fl_app.report.sweep import Run, summarise
from fl_app.run.results import MODEL_FILE
from fl_app.run.server import noise_source
from tests.conftest import FAST, INLINE

DP = [*FAST, "strategy=dp_fedavg"]
#: Overrides that name, log or place a run, or spell a number of its experiment otherwise.
SAME_EXPERIMENT = {
    "label": ["label=arm_a"],
    "tracking": ["tracking=tensorboard"],
    "trackers": ["tracking=[mlflow,wandb]", "tracker.experiment=other", "tracker.wandb_mode=online"],
    "output dir": ["output_dir=/tmp/dpfl-another-output-folder"],
    "epsilon spelt 8": ["privacy.epsilon=8"],  # the default is 8.0
    "clip spelt 1": ["strategy.clip=1"],  # the default is 1.0
    "cohort as a fraction": ["clients_per_round=0.5"],  # 3 of FAST's 6 clients, as clients_per_round=3
}
#: Overrides that change the experiment.
OTHER_EXPERIMENT = {
    "lr": ["lr=0.3"],
    "seed": ["seed=1"],
    "epsilon": ["privacy.epsilon=4"],
    "clip": ["strategy.clip=0.5"],
    "cohort": ["clients_per_round=4"],
    "alpha": ["partition.alpha=0.3"],
}


def noise_seed(*overrides: str) -> int | None:
    """The privacy-noise seed a seeded DP-FedAvg run of ``overrides`` derives."""
    return noise_source(typed_settings(compose_config([*DP, *overrides]))).seed


@pytest.mark.parametrize("overrides", SAME_EXPERIMENT.values(), ids=SAME_EXPERIMENT.keys())
def test_what_is_not_the_experiment_leaves_the_noise_seed_and_the_fingerprint(overrides):
    base = typed_settings(compose_config(DP))
    other = typed_settings(compose_config([*DP, *overrides]))
    assert other.fingerprint() == base.fingerprint()
    assert noise_seed(*overrides) == noise_seed()


@pytest.mark.parametrize("overrides", OTHER_EXPERIMENT.values(), ids=OTHER_EXPERIMENT.keys())
def test_a_change_of_a_real_setting_changes_the_noise_seed(overrides):
    assert noise_seed(*overrides) != noise_seed()
    assert typed_settings(compose_config([*DP, *overrides])).fingerprint() != (
        typed_settings(compose_config(DP)).fingerprint()
    )


def outcome(results: dict) -> tuple[int, str, dict[str, np.ndarray]]:
    """What a seeded run computed: its noise seed, every round's record, and its final model."""
    with np.load(Path(results["_output_dir"]) / MODEL_FILE) as stored:
        model = {name: stored[name] for name in stored.files}
    return results["privacy"]["randomness"]["noise_seed"], json.dumps(results["rounds"]), model


def same_model(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[name], b[name]) for name in a)


@pytest.mark.simulation
def test_a_seeded_run_is_bit_for_bit_the_same_whatever_its_label_tracker_folder_or_spelling(simulate):
    """Each of ``label=``, ``tracking=tensorboard``, another output folder and ``privacy.epsilon=8``
    (against the default ``8.0``) gives the same rounds and the same final model; ``lr`` does not."""
    base = outcome(simulate([*DP, INLINE], name="base"))
    variants = {
        "output dir": [],  # every run has its own folder under tmp_path
        "label": ["label=arm_a"],
        "tracking": ["tracking=tensorboard"],
        "epsilon spelt 8": ["privacy.epsilon=8"],
    }
    for name, overrides in variants.items():
        seed, rounds, model = outcome(simulate([*DP, INLINE, *overrides], name=name.replace(" ", "_")))
        assert (seed, rounds) == base[:2], name
        assert same_model(model, base[2]), name
    seed, rounds, model = outcome(simulate([*DP, INLINE, "lr=0.3"], name="lr"))
    assert seed != base[0] and rounds != base[1] and not same_model(model, base[2])


def results_of(tmp_path: Path, name: str, config: dict, accuracy: float) -> Run:
    results = {
        "strategy": "dp_fedavg",
        "dataset": "digits",
        "config": config,
        "rounds": [{"round": 1, "accuracy": accuracy}],
        "final": {"accuracy": accuracy, "epsilon": 8.0},
        "privacy": {},
    }
    path = tmp_path / name / "results.json"
    path.parent.mkdir()
    path.write_text(json.dumps(results))
    return Run(path, results)


def test_the_report_groups_two_spellings_of_one_experiment_as_one_arm(tmp_path):
    config = typed_settings(compose_config(DP)).config
    spelt = json.loads(json.dumps(config))
    spelt["privacy"]["epsilon"], spelt["strategy"]["clip"], spelt["seed"] = 8, 1, 7
    fraction = json.loads(json.dumps(config))
    fraction["clients_per_round"], fraction["seed"] = 0.5, 8
    runs = [
        results_of(tmp_path, "a", config, 0.5),
        results_of(tmp_path, "b", spelt, 0.6),
        results_of(tmp_path, "c", fraction, 0.7),
    ]
    rows = summarise(runs)
    assert len(rows) == 1 and rows[0]["seeds"] == 3 and rows[0]["settings"] == ""
    other = json.loads(json.dumps(config))
    other["lr"] = 0.3
    rows = summarise([*runs, results_of(tmp_path, "d", other, 0.4)])
    assert len(rows) == 2 and {row["settings"] for row in rows} == {"lr=0.2", "lr=0.3"}


def test_resume_accepts_its_own_experiment_and_refuses_another(tmp_path):
    """The checkpoint holds the experiment's fingerprint: a checkpoint whose saved overrides compose
    another experiment now (conf/ edited since) is refused; one spelt otherwise is continued."""
    from fl_app.config.validation import ConfigError, validate_config
    from fl_app.run.checkpoint import Checkpoint, save_checkpoint
    from strategies import STRATEGIES
    from tests.conftest import build_run_context

    def checkpoint(folder: Path, saved: list[str], started_as: list[str]) -> None:
        folder.mkdir()
        run = build_run_context(started_as, folder)
        strategy = STRATEGIES.get("dp_fedavg")(run)
        save_checkpoint(
            folder,
            Checkpoint(
                completed_round=1,
                num_rounds=2,
                status="interrupted",
                overrides=saved,
                fingerprint=run.settings.fingerprint(ignore=("num_rounds",)),
                arrays=strategy.initial_arrays(),
                strategy=strategy,
                recorder={"rounds_recorded": 0, "initial": {}, "outside": []},
                elapsed_s=1.0,
            ),
            run,
        )

    spelt = tmp_path / "spelt"
    checkpoint(spelt, [*DP, "privacy.epsilon=8", "label=arm_a"], started_as=DP)
    validate_config(compose_config([f"resume={spelt}"]), check_data=False)
    changed = tmp_path / "changed"
    checkpoint(changed, DP, started_as=[*DP, "lr=0.3"])
    with pytest.raises(ConfigError, match=r"resume=.*compose another experiment now"):
        validate_config(compose_config([f"resume={changed}"]), check_data=False)
