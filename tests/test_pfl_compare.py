"""benchmarks/pfl_compare.py without pfl: the exported split is dpfl's, and the table from a fake record."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's benchmarks, not opacus'

from benchmarks import pfl_compare
from fl_app.run.harness import run_context_for
from fl_app.run.server import evaluation_arrays
from strategies import STRATEGIES

#: A small split of the bundled digits (no download): 12 clients, a 60-image evaluation subset.
SMALL = ["dataset=digits", "partition=dirichlet", "num_clients=12", "model=mlp", "evaluation.test_subset=60"]


def test_export_writes_the_rows_dpfl_clients_train_on(tmp_path: Path) -> None:
    """Every client's examples, the evaluation subset and the initial model are dpfl's own."""
    path = tmp_path / "split.npz"
    summary = pfl_compare.export_partition(path, SMALL)
    archive = np.load(path)
    run = run_context_for([*SMALL, "strategy=fedavg"], tmp_path / "run")
    data = run.data
    offsets = archive["offsets"]
    assert summary["clients"] == len(offsets) - 1 == 12
    for client in range(12):
        mine = data.client(client)
        rows = slice(offsets[client], offsets[client + 1])
        np.testing.assert_array_equal(archive["x"][rows], mine.x)
        np.testing.assert_array_equal(archive["y"][rows], mine.y)
        np.testing.assert_array_equal(archive["rows"][rows], data.client_rows[client])
    x_eval, y_eval = evaluation_arrays(data, subset=60, randomness=run.randomness)
    np.testing.assert_array_equal(archive["x_eval"], x_eval)
    np.testing.assert_array_equal(archive["y_eval"], y_eval)
    initial = STRATEGIES.get("fedavg")(run).initial_arrays()
    names = [str(n) for n in archive["param_names"]]
    assert names == list(initial.keys())
    for k, name in enumerate(names):
        np.testing.assert_array_equal(archive[f"param_{k}"], initial[name].numpy())
    assert json.loads(str(archive["meta"]))["num_clients"] == 12


def test_dpfl_command_and_summary(tmp_path: Path) -> None:
    """The DP arm publishes its Poisson rounds' durations only in ``outside_guarantee``: both are read."""
    command = pfl_compare.dpfl_command("dp_fedavg", 7, tmp_path / "out")
    assert "strategy.sampling=poisson" in command
    assert "privacy.diagnostics=true" in command
    assert "num_rounds=7" in command
    assert "num_clients=1000" in command
    results = {
        "status": "completed",
        "initial": {"accuracy": 0.1},
        "rounds": [{"round": 1, "accuracy": 0.3}, {"round": 2, "accuracy": 0.4}],
        "final": {"accuracy": 0.4, "loss": 1.5, "epsilon": 8.0, "wall_s": 3.0},
        "privacy": {"noise_multiplier": 0.93},
        "outside_guarantee": {
            "rounds": [
                {"round": 1, "secret_cohort_round_s": 2.0, "secret_cohort_clients": 97},
                {"round": 2, "secret_cohort_round_s": 0.5, "secret_cohort_clients": 103},
            ]
        },
    }
    (tmp_path / "results.json").write_text(json.dumps(results))
    summary = pfl_compare.dpfl_run_summary(tmp_path)
    assert summary["round_s"] == [2.0, 0.5]
    assert summary["clients"] == [97, 103]
    assert summary["noise_multiplier"] == 0.93


def test_table_ratios_are_dpfl_over_pfl() -> None:
    """Round and command ratios divide dpfl's time by pfl's; the noise table shows both accountants."""

    def run(framework: str, config: str, command_s: float, rounds: list[float], acc: float) -> dict:
        return pfl_compare.summarise(
            {
                "framework": framework,
                "config": config,
                "repeat": 1,
                "command_s": command_s,
                "exit": 0,
                "round_s": rounds,
                "final_accuracy": acc,
                "noise_multiplier": 0.9 if config == "dp_fedavg" else None,
            }
        )

    record = {
        "task": {
            "configs": ["fedavg"],
            "repeats": 1,
            "rounds": 3,
            "epsilon": 8.0,
            "delta": 1e-5,
            "sampling_rate": 0.1,
        },
        "threads": "one and two",
        "noise": {
            "dpfl": {"pld": 0.936, "pld_s": 1.0, "rdp": 0.994, "rdp_s": 0.1},
            "pfl": {"pld": 0.936, "pld_s": 10.0, "rdp": 0.994, "rdp_s": 1.0},
        },
        "runs": [
            run("pfl", "fedavg", 10.0, [5.0, 1.0, 1.0], 0.7),
            run("dpfl", "fedavg", 30.0, [9.0, 2.0, 2.0], 0.71),
        ],
    }
    assert record["runs"][1]["median_round_s"] == 2.0
    assert record["runs"][1]["outside_rounds_s"] == 17.0
    row = next(line for line in pfl_compare.table_lines(record) if line.startswith("| non-private"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[4] == "2.00"  # round ratio
    assert cells[7] == "3.00"  # command ratio
