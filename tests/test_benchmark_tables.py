"""benchmarks/tables.py, and the benchmark scripts' tables from fake sweep trees (no simulation, no plots)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's benchmarks, not opacus'

from benchmarks import build_docs, kd_dp, nbafl, privatekt, select_on_validation
from benchmarks.tables import completed_runs, fmt, markdown_table, replace_generated_block, series


def write_run(
    directory: Path,
    *,
    strategy: str = "nbafl",
    status: str = "completed",
    accuracies: tuple[float | None, ...] = (0.3, 0.5, 0.6),
    epsilon: float | None = 4.0,
    config: dict[str, Any] | None = None,
    privacy: dict[str, Any] | None = None,
    final: dict[str, Any] | None = None,
    per_round: dict[str, Any] | None = None,
) -> None:
    """``directory/results.json`` in the shape of ``fl_app.run.results``, with the fields the scripts read."""
    directory.mkdir(parents=True, exist_ok=True)
    rounds = [
        {
            "round": r,
            "accuracy": accuracy,
            "loss": 2.0 - r / 4,
            "epsilon": None if epsilon is None else epsilon * r / len(accuracies),
            "clients": 5,
            "failures": 0,
            **(per_round or {}),
        }
        for r, accuracy in enumerate(accuracies, start=1)
    ]
    results = {
        "status": status,
        "strategy": strategy,
        "dataset": "mnist",
        "config": {
            "strategy": {"name": strategy},
            "num_clients": 10,
            "clients_per_round": 5,
            "num_rounds": len(accuracies),
            "local_epochs": 1,
            "seed": 1,
            "privacy": {"epsilon": epsilon},
            **(config or {}),
        },
        "initial": {"accuracy": 0.1, "loss": 2.3},
        "rounds": rounds,
        "final": {
            "accuracy": [a for a in accuracies if a is not None][-1],
            "loss": rounds[-1]["loss"],
            "epsilon": epsilon,
            "wall_s": 125.0,
            "rounds": len(accuracies),
            **(final or {}),
        },
        "privacy": {"unit": "record", **(privacy or {})},
    }
    (directory / "results.json").write_text(json.dumps(results))


# ------------------------------------------------------------------------------------------------ fmt
@pytest.mark.parametrize(
    ("args", "kwargs", "expected"),
    [
        ((None,), {}, "-"),
        ((math.nan,), {}, "-"),
        ((None,), {"missing": "inf"}, "inf"),
        ((None,), {"missing": "null", "nan": "-"}, "null"),
        ((math.nan,), {"missing": "null", "nan": "-"}, "-"),
        ((0.123456,), {}, "0.1235"),
        ((0.123456, 2), {}, "0.12"),
        ((np.float64(0.5),), {}, "0.5"),
        ((1447470.0, 6), {}, "1.44747e+06"),
        ((48000,), {}, "48000"),  # ints are not rounded
        (("soft",), {}, "soft"),
        ((5, 4), {"fixed_below": 100}, "5.0000"),
        ((0.45, 2), {"fixed_below": 100}, "0.45"),
        ((0.4, 4), {"fixed_below": 100}, "0.4000"),
        ((234.81, 4), {"fixed_below": 100}, "234.8"),
        ((None, 4), {"fixed_below": 100}, "-"),
    ],
)
def test_fmt(args, kwargs, expected):
    assert fmt(*args, **kwargs) == expected


# ------------------------------------------------------------------------------------- markdown_table
def test_markdown_table_header_rule_and_rows():
    assert markdown_table(["a", "b c"], [[1, None], ["x", fmt(0.25)]]) == [
        "| a | b c |",
        "|---|---|",
        "| 1 | None |",
        "| x | 0.25 |",
    ]
    assert markdown_table(["only"], []) == ["| only |", "|---|"]


# ---------------------------------------------------------------------------- replace_generated_block
BEGIN, END = "<!-- BEGIN GENERATED -->", "<!-- END GENERATED -->"


def test_replace_generated_block_keeps_the_text_outside_byte_for_byte(tmp_path):
    page = tmp_path / "page.md"
    head, tail = "# Title\r\n\r\nbefore  \n\n", "\n\nafter \t\n<!-- BEGIN GENERATED -->\nnot a block\n"
    page.write_bytes(f"{head}{BEGIN}\nold\nlines\n{END}{tail}".encode())
    assert replace_generated_block(page, ["| a |", "|---|"], begin=BEGIN, end=END)
    assert page.read_bytes() == f"{head}{BEGIN}\n| a |\n|---|\n{END}{tail}".encode()
    assert replace_generated_block(page, "text\n\n", begin=BEGIN, end=END)  # as given, blank line kept
    assert page.read_bytes() == f"{head}{BEGIN}\ntext\n\n{END}{tail}".encode()
    assert replace_generated_block(page, [], begin=BEGIN, end=END)
    assert page.read_bytes() == f"{head}{BEGIN}\n\n{END}{tail}".encode()


@pytest.mark.parametrize(
    "text",
    ["no markers\n", f"only {BEGIN}\n", f"{END} before {BEGIN}\n"],
    ids=["none", "no end", "end first"],
)
def test_replace_generated_block_without_the_markers_leaves_the_page_alone(tmp_path, text):
    page = tmp_path / "page.md"
    page.write_text(text)
    assert not replace_generated_block(page, "new\n", begin=BEGIN, end=END)
    assert page.read_text() == text
    missing = tmp_path / "missing.md"
    assert not replace_generated_block(missing, "new\n", begin=BEGIN, end=END)
    assert not missing.exists()


# -------------------------------------------------------------------------------- completed_runs, series
def test_completed_runs_keeps_runs_whose_every_round_ran_sorted_with_their_path(tmp_path):
    write_run(tmp_path / "b", accuracies=(0.2, 0.7))
    write_run(tmp_path / "a" / "0")
    write_run(tmp_path / "a" / "1", status="interrupted")
    write_run(tmp_path / "a" / "2", status="failed")
    write_run(tmp_path / "c", status="completed_with_failures")
    runs = completed_runs(tmp_path)
    assert [run["_path"] for run in runs] == [str(tmp_path / p) for p in ("a/0", "b", "c")]
    assert runs[1]["final"]["accuracy"] == 0.7
    assert completed_runs(tmp_path / "b")[0]["_path"] == str(tmp_path / "b")  # a run directory itself


def test_completed_runs_reports_a_broken_file_instead_of_raising(tmp_path, capsys):
    write_run(tmp_path / "good")
    (tmp_path / "truncated").mkdir()
    (tmp_path / "truncated" / "results.json").write_text('{"status": "compl')
    (tmp_path / "no_rounds").mkdir()
    (tmp_path / "no_rounds" / "results.json").write_text(json.dumps({"status": "completed"}))
    runs = completed_runs(tmp_path)
    assert [Path(run["_path"]).name for run in runs] == ["good"]
    err = capsys.readouterr().err
    assert f"skipped {tmp_path / 'truncated' / 'results.json'}: unreadable" in err
    assert f"skipped {tmp_path / 'no_rounds' / 'results.json'}: missing fields" in err


def test_completed_runs_of_a_missing_folder_is_empty(tmp_path):
    assert completed_runs(tmp_path / "not_there") == []
    (tmp_path / "file").write_text("")
    assert completed_runs(tmp_path / "file") == []


def test_series_starts_at_the_initial_model_and_skips_rounds_without_the_value(tmp_path):
    write_run(tmp_path, accuracies=(0.3, None, 0.6))
    (run,) = completed_runs(tmp_path)
    assert series(run, "accuracy") == ([0, 1, 3], [0.1, 0.3, 0.6])
    assert series(run, "loss") == ([0, 1, 2, 3], [2.3, 1.75, 1.5, 1.25])


# ------------------------------------------------------------------------------------ the scripts
def section(text: str, title: str) -> list[str]:
    """The table lines under ``title`` in a generated Markdown file."""
    lines = text.split("\n")
    start = lines.index(title) + 2
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return lines[start:end]


def nbafl_run(directory: Path, *, epsilon: float, n: int = 50, k: int = 50, **kwargs: Any) -> None:
    write_run(
        directory,
        epsilon=epsilon * 0.9,
        accuracies=(0.2, 0.3, 0.4 + epsilon / 1000),
        config={"num_clients": n, "privacy": {"epsilon": epsilon}},
        privacy={"K": k, "L": 1.0, "m": 960, "sigma_up": 0.123456, "sigma_down": 0.0},
        per_round={"clients": k},
        **kwargs,
    )


def test_nbafl_tables_from_a_fake_sweep(tmp_path, monkeypatch, capsys):
    plots: list[str] = []
    monkeypatch.setattr(nbafl, "plot_curves", lambda *a, **k: plots.append(k["path"].name))
    monkeypatch.setattr(nbafl, "plot_final", lambda *a, **k: plots.append(k["path"].name))
    root = tmp_path / "runs"
    for i, epsilon in enumerate((60.0, 5.0)):
        nbafl_run(root / "mnist_eps" / str(i), epsilon=epsilon, final={"epsilon_client_level": epsilon * 3})
    nbafl_run(root / "mnist_eps" / "2", epsilon=7.0, status="interrupted")
    (root / "mnist_eps" / "3").mkdir()
    (root / "mnist_eps" / "3" / "results.json").write_text("{")
    write_run(root / "mnist_fedavg", strategy="fedavg", epsilon=None, per_round={"clients": 50})
    for i, k in enumerate((10, 30)):
        nbafl_run(root / "mnist_k" / str(i), epsilon=60.0, k=k)
    nbafl_run(root / "mnist_calibration" / "0", epsilon=2.0, final={"loss": None})

    assert nbafl.main(["--root", str(root), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "nbafl_tables.md").read_text()
    assert section(text, "### mnist: epsilon sweep") == [
        "| strategy | N | K | T | L | m | epsilon (document) | epsilon (accountant, record) "
        "| epsilon (client level) | sigma_U | sigma_D | final loss | final accuracy | wall s | run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        "| fedavg | 10 | 50 | 3 | - | - | - | inf | inf | - | - | 1.25 | 0.6 | 125 | mnist_fedavg |",
        "| nbafl | 50 | 50 | 3 | 1 | 960 | 5 | 4.5 | 15 | 0.1235 | 0 | 1.25 | 0.405 | 125 | 1 |",
        "| nbafl | 50 | 50 | 3 | 1 | 960 | 60 | 54 | 180 | 0.1235 | 0 | 1.25 | 0.46 | 125 | 0 |",
    ]
    k_sweep = section(text, "### mnist_k: document epsilon = 60 (classic calibration)")[2:]
    assert [row.split(" | ")[2] for row in k_sweep] == ["10", "30"]  # the K column, by K
    (calibration,) = section(text, "### MNIST: strategy.calibration=accountant")[2:]
    assert "| 2 | 1.8 | inf | 0.1235 | 0 | inf | 0.402 |" in calibration  # no loss: inf
    assert "fashion_mnist" not in text
    assert plots == ["nbafl_mnist_epsilon.png", "nbafl_mnist_k.png"]
    assert f"skipped {root / 'mnist_eps' / '3' / 'results.json'}: unreadable" in capsys.readouterr().err


def test_privatekt_tables_from_a_fake_sweep(tmp_path, monkeypatch):
    # The public split's true labels 0, 1, 9, 9: kt labels 0, 1, 2, 3 are half right.
    data = SimpleNamespace(
        arrays=SimpleNamespace(y_train=np.array([9, 0, 1, 9, 9])), public_rows=np.array([1, 2, 3, 4])
    )
    monkeypatch.setattr(privatekt, "federated_data", lambda spec: data)
    monkeypatch.setattr(privatekt, "plot_curves", lambda runs, out: None)
    monkeypatch.setattr(privatekt, "plot_comparison", lambda runs, out: None)
    config = {
        "dataset": {"name": "fake"},
        "partition": {"name": "iid"},
        "model": "mlp",
        "evaluation": {"test_subset": None},
        "strategy": {"name": "privatekt", "local_epochs": None, "self_train_targets": "soft"},
    }
    privacy = {
        "epsilon_per_round": 5,
        "epsilon_cumulative": 96.96273,
        "epsilon_basic_composition": 110.0,
        "epsilon_per_label": 0.08,
        "beta": 0.0083,
        "num_classes": 10,
        "noise_multiplier": 18.97456,
    }
    kt = {"kt_indices": [0, 1, 2, 3], "kt_labels": [0, 1, 2, 3]}

    def run(path: Path, strategy: str = "privatekt", epsilon: float = 5.0, **kwargs: Any) -> None:
        write_run(
            path,
            strategy=strategy,
            epsilon=epsilon,
            accuracies=(0.2, 0.45, 0.4),
            config={**config, "privacy": {"epsilon": epsilon}},
            privacy=privacy,
            per_round=kt if strategy == "privatekt" else {},
            **kwargs,
        )

    root = tmp_path / "runs"
    run(root / "mnist_per_round")
    for i, epsilon in enumerate((2.0, 1.0)):
        run(root / "compare" / "privatekt" / str(i), epsilon=epsilon)
        run(
            root / "compare" / "fedavg_ldp" / str(i),
            "fedavg_ldp",
            epsilon,
            final={"accuracy": 0.098, "loss": None if epsilon == 1.0 else 2.5},
        )
    run(root / "compare" / "privatekt" / "2", epsilon=4.0, status="failed")
    run(root / "compare" / "fedavg", "fedavg", final={"accuracy": 0.9426})

    assert privatekt.main(["--root", str(root), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "privatekt_tables.md").read_text()
    (per_round,) = section(text, "### Per-round budget (the paper's reading)")[2:]
    assert per_round.startswith("| MNIST | mlp | 3 | 5 | 1 | 5.0000 | 0.4000 | 0.4500 (2) | 0.50 / 0.50 | ")
    assert per_round.endswith(" | 96.9627 | 110 | 0 | 2 min |")
    compare = section(text, "### Equal total budget per client")[2:]
    assert [row.split(" | ")[0] for row in compare] == ["| 1", "| 2"]  # the failed run at 4 is left out
    # (0.4 - 0.098) / (0.9426 - 0.098) = 36% of the gap closed; no final loss: diverged
    assert "| 0.0980 | nan (diverged) | 1.0000 | 18.9746 | 0.9426 | 36% | 0 / 0 / 0 |" in compare[0]
    assert "| 0.0980 | 2.500 | 2.0000 |" in compare[1]
    assert section(text, "### Self-training probes (MNIST, epsilon 5 per round)") == [
        "| run | self-training targets | input dropout | rounds | clients/round | local epochs | test images "
        "| final acc. | best acc. (round) | knowledge acc. first / last 10 rounds | wall time |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]


def test_kd_dp_tables_and_doc_block(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(kd_dp, "plot_accuracy", lambda dataset, methods, out: out / "a.png")
    monkeypatch.setattr(kd_dp, "plot_rounds", lambda dataset, methods, out: out / "r.png")
    root = tmp_path / "runs"
    groups = {"large": 1.0, "large_teacher_only": 0.5, "general": 1.0, "special": 0.5}
    kd_privacy = {
        "stages": {"teacher_rounds": 2},
        "epsilon_by_group": groups,
        "special_client": {"label_agreement_with_teacher": 0.1534},
        "epsilon_overall": 1.0,
    }
    write_run(root / "mnist" / "kd_dp_eps1", strategy="kd_dp", epsilon=1.0, privacy=kd_privacy)
    write_run(root / "mnist" / "kd_dp_eps2", strategy="kd_dp", epsilon=2.0, status="interrupted")
    write_run(root / "mnist" / "notes", strategy="kd_dp", privacy=kd_privacy)  # not <method>_eps<epsilon>
    write_run(
        root / "mnist" / "old" / "kd_dp_eps4", strategy="kd_dp", epsilon=4.0, privacy=kd_privacy
    )  # too deep
    write_run(
        root / "mnist" / "dp_fedavg_eps1",
        strategy="dp_fedavg",
        epsilon=1.0,
        accuracies=(0.12, 0.1245, 0.107),
        privacy={"noise_multiplier": 18.97, "clip": 1.0, "denominator": 5.0},
    )
    (root / "mnist" / "kd_dp_eps1.cpu.json").write_text(json.dumps({"cpu_s": 1234.5}))
    doc = tmp_path / "kd_dp.md"
    doc.write_text(f"intro\n{kd_dp.BEGIN}\nold\n{kd_dp.END}\noutro\n")

    out = tmp_path / "out"
    assert kd_dp.main(["--root", str(root), "--out", str(out), "--doc", str(doc)]) == 0
    text = (out / "kd_dp_tables.md").read_text()
    assert section(text, "**mnist**: final test accuracy (reported epsilon at delta = 1e-5)") == [
        "| method | unit | epsilon = 1 |",
        "|---|---|---|",
        "| KD-DP (epsilon_special = epsilon/2) | record | 0.6000 (1) |",
        "| DP-FedAvg | client | 0.1070 (1) |",
    ]
    (detail,) = section(text, "**mnist**: KD-DP runs in detail")[2:]
    assert detail == "| kd_dp | 1 | 0.5 | 0.6000 | 0.6000 | 0.153 | 1 (0.5) | 1 | 0.5 | 1 | 1.23e+03 |"
    assert (
        doc.read_text()
        == f"intro\n{kd_dp.BEGIN}\n" + text.split("\n", 2)[2].rstrip("\n") + f"\n{kd_dp.END}\noutro\n"
    )

    doc.write_text("no markers\n")
    assert kd_dp.main(["--root", str(root), "--out", str(out), "--doc", str(doc)]) == 1
    assert doc.read_text() == "no markers\n"
    assert f"{doc}: no file or no {kd_dp.BEGIN}" in capsys.readouterr().err


# ------------------------------------------------------------------------------ select_on_validation
def _tuning_run(directory: Path, *, teacher_rounds: int, lr: float, epsilon: float, last: float, **kw: Any):
    write_run(
        directory,
        strategy="kd_dp",
        epsilon=epsilon,
        accuracies=(0.1, 0.2, last),
        config={"lr": lr, "strategy": {"name": "kd_dp", "teacher_rounds": teacher_rounds}},
        final={"evaluated_on": "validation"},
        **kw,
    )


def test_select_on_validation_keeps_two_arms_of_one_strategy_apart_and_skips_unfinished_runs(
    tmp_path, capsys
):
    """KD-DP and federated DP-SGD are both strategy=kd_dp: one table each, each choice from its own runs;
    a failed run never wins, however high its score."""
    for eps in (1.0, 8.0):
        _tuning_run(tmp_path / f"fed-{eps}-a", teacher_rounds=0, lr=0.1, epsilon=eps, last=0.40)
        _tuning_run(tmp_path / f"fed-{eps}-b", teacher_rounds=0, lr=0.3, epsilon=eps, last=0.50)
        _tuning_run(tmp_path / f"kd-{eps}-a", teacher_rounds=5, lr=0.1, epsilon=eps, last=0.45)
        _tuning_run(tmp_path / f"kd-{eps}-b", teacher_rounds=5, lr=0.3, epsilon=eps, last=0.10)
    _tuning_run(tmp_path / "kd-8-c", teacher_rounds=5, lr=0.3, epsilon=8.0, last=0.99, status="failed")
    assert select_on_validation.main([str(tmp_path), "--last", "1"]) == 0
    out, err = capsys.readouterr()
    assert "kd-8-c" in err and "status failed" in err
    assert "| kd_dp (strategy.teacher_rounds=0) | 1 | `lr=0.3` | 0.5000 |" in out
    assert "| kd_dp (strategy.teacher_rounds=5) | 8 | `lr=0.1` | 0.4500 |" in out
    assert out.count("#### kd_dp (") == 2


def test_select_on_validation_names_an_arm_of_one_grid_point_by_what_the_sweep_varies(tmp_path, capsys):
    """An arm run at one setting is labelled ``lr=0.3``, not by an empty name."""
    _tuning_run(tmp_path / "fed-a", teacher_rounds=0, lr=0.1, epsilon=1.0, last=0.40)
    _tuning_run(tmp_path / "fed-b", teacher_rounds=0, lr=0.3, epsilon=1.0, last=0.50)
    _tuning_run(tmp_path / "kd", teacher_rounds=5, lr=0.3, epsilon=1.0, last=0.45)
    assert select_on_validation.main([str(tmp_path), "--last", "1"]) == 0
    out = capsys.readouterr().out
    assert "| kd_dp (strategy.teacher_rounds=5) | 1 | `lr=0.3` | 0.4500 |" in out
    assert "``" not in out


def test_select_on_validation_refuses_runs_evaluated_on_the_test_split(tmp_path, capsys):
    _tuning_run(tmp_path / "a", teacher_rounds=0, lr=0.1, epsilon=1.0, last=0.4)
    write_run(tmp_path / "b", strategy="kd_dp", config={"lr": 0.3}, final={"evaluated_on": "test"})
    assert select_on_validation.main([str(tmp_path)]) == 2
    assert "evaluated on the test split" in capsys.readouterr().err


def demo_folder(directory: Path, *, seed: int, planned: int) -> None:
    directory.mkdir(parents=True)
    (directory / "config.yaml").write_text(f"seed: {seed}\nnum_rounds: {planned}\n")


def test_privatekt_demo_table_and_figure_from_a_finished_and_a_stopped_seed(tmp_path, capsys):
    root = tmp_path / "runs"
    # seed 1 finished 20 rounds (results.json, evaluated every 10 rounds); seed 2 stopped after round
    # 12 (metrics.csv only, as a run that is still going or waits for resume=).
    demo_folder(root / "demo_seed1", seed=1, planned=20)
    accuracies = tuple(0.3 if r == 10 else 0.5 if r == 20 else None for r in range(1, 21))
    write_run(
        root / "demo_seed1",
        strategy="privatekt",
        accuracies=accuracies,
        epsilon=40.0,
        per_round={"round_s": 100.0},
    )
    results = json.loads((root / "demo_seed1" / "results.json").read_text())
    for r in results["rounds"]:
        r["epsilon_basic"] = 5.0 * r["round"]
    (root / "demo_seed1" / "results.json").write_text(json.dumps(results))
    demo_folder(root / "demo_seed2", seed=2, planned=100)
    lines = ["round,accuracy,loss,epsilon,epsilon_basic,round_s"]
    lines += [f"{r},{0.2 if r == 10 else ''},,{1.5 * r},{5 * r},{90 + r}" for r in range(1, 13)]
    (root / "demo_seed2" / "metrics.csv").write_text("\n".join(lines) + "\n")
    page = tmp_path / "page.md"
    page.write_text(f"before\n{privatekt.DEMO_BEGIN}\nold\n{privatekt.DEMO_END}\nafter\n")
    out = tmp_path / "out"
    out.mkdir()

    assert privatekt.main(["--demo-root", str(root), "--out", str(out), "--page", str(page)]) == 0

    text = page.read_text()
    assert text.startswith(f"before\n{privatekt.DEMO_BEGIN}\n") and text.endswith(
        f"{privatekt.DEMO_END}\nafter\n"
    )
    rows = {
        line.split(" | ")[0].strip("| "): line.split(" | ")
        for line in text.splitlines()
        if line[:3] in ("| 1", "| 2")
    }
    # round 10: both seeds, mean 0.25 against the authors' 0.298; the worst client's epsilon is
    # the larger of the two seeds' (accountant 20.0 from seed 1's 40 * 10 / 20; basic 50).
    assert rows["10"][1:6] == ["0.298", "0.300", "0.200", "0.250 (2)", "-0.048"]
    assert rows["10"][6].startswith("20 / 50 |")
    # round 20: only seed 1 got there.
    assert rows["20"][1:6] == ["0.473", "0.500", "-", "0.500 (1)", "+0.027"]
    assert "round" in text and "| 30 |" not in text
    assert "seed 1: 20 of 20 rounds, finished; median round 100 s" in text
    assert (
        "seed 2: 12 of 100 rounds, not finished (a stopped run continues with resume=); median round 96 s"
        in text
    )
    assert (out / "privatekt_demo_vs_authors.png").stat().st_size > 10_000


def test_the_privatekt_pages_demo_table_is_generated_from_the_recorded_runs(tmp_path, capsys):
    """The committed page's demo block is what the recorded runs (config.yaml, metrics.csv) give."""
    recorded = privatekt.DEMO_PAGE.parent / "privatekt_demo" / "runs"
    page = tmp_path / "page.md"
    page.write_text(privatekt.DEMO_PAGE.read_text())
    out = tmp_path / "out"
    out.mkdir()

    assert privatekt.main(["--demo-root", str(recorded), "--out", str(out), "--page", str(page)]) == 0

    assert page.read_text() == privatekt.DEMO_PAGE.read_text()
    assert sorted(folder.name for folder in recorded.iterdir()) == ["demo_seed1", "demo_seed2", "demo_seed3"]


def test_privatekt_demo_without_runs_says_so(tmp_path, capsys):
    assert privatekt.main(["--demo-root", str(tmp_path), "--out", str(tmp_path / "out")]) == 1
    assert "no demo_seed* run" in capsys.readouterr().err


def test_privatekt_speed_tables_from_recorded_measurements(tmp_path, capsys):
    from benchmarks import privatekt_speed

    levers = [
        {
            "threads": 1,
            "layout": "contiguous",
            "compile": False,
            "work": "client training (5 epochs)",
            "seconds": 4.0,
            "warm_up_s": 0.1,
            "rows": 600,
        },
        {
            "threads": 2,
            "layout": "channels_last",
            "compile": False,
            "batch": 256,
            "work": "public-split inference",
            "seconds": 2.0,
            "rows": 12000,
        },
    ]
    summary = {
        "plain_contiguous": {
            "client_phase_s": 95.0,
            "client_work_s": 90.0,
            "server_s": 12.0,
            "round_s": 102.0,
        },
        "simulation": {"round_s": 107.1, "round_times": [113.0, 104.0, 107.1, 121.0]},
        "ratio_to_plain_contiguous": 107.1 / 102.0,
    }
    (tmp_path / "levers.json").write_text(json.dumps(levers))
    (tmp_path / "round.json").write_text(json.dumps(summary))
    privatekt_speed.main_with(["tables", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    # 600 images x 5 epochs in 4 s; 12,000 images in 2 s
    assert "| client training (5 epochs) | 1 | contiguous | no | - | 4.00 | 750 |" in out
    assert "| public-split inference | 2 | channels_last | no | 256 | 2.00 | 6000 |" in out
    assert "| plain PyTorch (contiguous) | 90.0 s | 12.0 s | 102.0 s | - |" in out
    assert "| simulation (median of rounds 2..4; all: 113, 104, 107, 121 s) | - | - | 107.1 s | 1.05 |" in out


def test_privatekt_speed_tables_without_measurements_says_so(tmp_path):
    from benchmarks import privatekt_speed

    with pytest.raises(SystemExit, match=r"neither levers\.json nor round\.json"):
        privatekt_speed.main_with(["tables", "--out", str(tmp_path)])


def test_the_recorded_authors_log_is_theirs_every_round():
    log = privatekt.authors_log()
    # rounds quoted from their notebook (docs/benchmarks/privatekt.md's demo table)
    quoted = {10: 0.298, 20: 0.473, 30: 0.610, 50: 0.761, 100: 0.894, 200: 0.929, 500: 0.951}
    assert all(abs(log[r] - value) <= 5e-4 + 1e-9 for r, value in quoted.items()), {r: log[r] for r in quoted}
    assert min(log) == 1 and max(log) == 500 and len(log) == 496  # 466-469 missing from their output
    assert all(0.0 < value < 1.0 for value in log.values())


# ------------------------------------------------------------------------------ tables from kept runs
#: Pages whose table is ``fl_app.report.sweep`` of runs kept in the repository (benchmarks/keep_runs.py):
#: page folder below docs/benchmarks, and the number of jobs of the one command that made them. The
#: list is build_docs.py's, whose ``--from-runs`` regenerates them all.
KEPT_RUNS = build_docs.KEPT_RUN_PAGES


@pytest.mark.parametrize(("page", "jobs"), KEPT_RUNS.items())
def test_a_table_rebuilds_from_the_runs_kept_in_the_repository(tmp_path, page, jobs):
    """docs/benchmarks/<page>/report.md (and a README block copied from it) is what ``fl_app.report.sweep``
    makes of the kept runs today: nothing in the table was edited by hand, no job is missing."""
    from fl_app.report import sweep as report

    kept = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / page
    assert len(list((kept / "runs").glob("*/results.json"))) == jobs
    assert report.main([str(kept / "runs"), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "report.md").read_text() == (kept / "report.md").read_text()


def test_keep_runs_copies_results_and_the_saved_config_only(tmp_path, capsys):
    from benchmarks import banded_mf, keep_runs

    job = tmp_path / "sweep" / "3-dp_bandmf-privacy.epsilon=2,seed=1"
    write_run(job, strategy="dp_bandmf", epsilon=2.0)
    (job / ".hydra").mkdir()
    (job / ".hydra" / "config.yaml").write_text("num_rounds: ${per_budget:${privacy.epsilon},'2:50'}\n")
    (job / "model.pt").write_bytes(b"weights")
    assert keep_runs.main([str(tmp_path / "sweep"), "--out", str(tmp_path / "runs")]) == 0
    copied = sorted(
        p.relative_to(tmp_path / "runs").as_posix() for p in (tmp_path / "runs").rglob("*") if p.is_file()
    )
    kept = "3-dp_bandmf-privacy.epsilon=2+seed=1"  # no comma: Flower's FAB manifest is unquoted CSV
    assert copied == [f"{kept}/.hydra/config.yaml", f"{kept}/results.json"]
    assert "kept 1 runs" in capsys.readouterr().out
    assert keep_runs.main([str(tmp_path / "empty"), "--out", str(tmp_path / "runs")]) == 2
    assert "error: no results.json below" in capsys.readouterr().err
    assert banded_mf.keep(tmp_path / "sweep", tmp_path / "again") == 0  # the page's own command


def test_banded_mf_plot_draws_every_arm_or_refuses_an_empty_folder(tmp_path, capsys):
    """An arm is a strategy and its label: the untuned row is its own line; the non-private run is the
    reference line, not an arm."""
    from benchmarks import banded_mf
    from fl_app.report.sweep import load_runs

    for arm, label in (("dp_fedavg", None), ("dp_fedavg", "untuned"), ("dp_bandmf", None)):
        for eps in (1.0, 2.0):
            for seed in (1, 2):
                write_run(
                    tmp_path / "runs" / f"{arm}-{label}-{eps}-{seed}",
                    strategy=arm,
                    epsilon=eps,
                    accuracies=(0.3, 0.5 if label else 0.7),
                    config={"seed": seed, "label": label},
                )
    write_run(tmp_path / "runs" / "reference", strategy="fedavg", epsilon=None, accuracies=(0.5, 0.85))
    by_arm, labels, reference = banded_mf.group_arms(load_runs(tmp_path / "runs")[0])
    assert set(by_arm) == {("dp_fedavg", ""), ("dp_fedavg", "untuned"), ("dp_bandmf", "")}
    assert by_arm[("dp_fedavg", "untuned")] == {1.0: [0.5, 0.5], 2.0: [0.5, 0.5]}
    assert by_arm[("dp_fedavg", "")][2.0] == [0.7, 0.7]
    assert labels[("dp_bandmf", "", 1.0)] == "T=2"
    assert reference == [0.85]
    assert banded_mf.plot(tmp_path / "runs", tmp_path / "out.png") == 0
    assert (tmp_path / "out.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "none").mkdir()
    assert banded_mf.plot(tmp_path / "none", tmp_path / "none.png") == 2
    assert "no completed private runs" in capsys.readouterr().err


def test_central_gaps_table_gives_what_tuning_bought_and_banded_mf_against_each_arm():
    from benchmarks import banded_mf

    by_arm = {
        ("dp_fedavg", ""): {1.0: [0.70, 0.72], 8.0: [0.80]},
        ("dp_fedavg", "untuned"): {1.0: [0.40, 0.44]},
        ("dp_bandmf", ""): {1.0: [0.74], 8.0: [0.79]},
    }
    rows = banded_mf.gaps_table(by_arm)[2:]
    assert rows == [
        "| dp_bandmf | 1 | 0.740 (1) | - | - | - |",
        "| dp_bandmf | 8 | 0.790 (1) | - | - | - |",
        "| dp_fedavg | 1 | 0.710 (2) | 0.420 (2) | +29.0 | +3.0 |",
        "| dp_fedavg | 8 | 0.800 (1) | - | - | -1.0 |",
    ]
    # with a DP-BLT arm, a column of its own beside banded MF's (BLT at 8 only: "-" at 1)
    by_arm[("dp_blt", "")] = {8.0: [0.82, 0.84]}
    table = banded_mf.gaps_table(by_arm)
    assert table[0].endswith("| dp_bandmf minus this arm (points) | dp_blt minus this arm (points) |")
    assert table[2:] == [
        "| dp_bandmf | 1 | 0.740 (1) | - | - | - | - |",
        "| dp_bandmf | 8 | 0.790 (1) | - | - | - | +4.0 |",
        "| dp_blt | 8 | 0.830 (2) | - | - | -4.0 | - |",
        "| dp_fedavg | 1 | 0.710 (2) | 0.420 (2) | +29.0 | +3.0 | - |",
        "| dp_fedavg | 8 | 0.800 (1) | - | - | -1.0 | +3.0 |",
    ]


def test_central_gaps_in_the_cross_device_page_rebuild_from_the_kept_runs():
    """docs/benchmarks/cross_device.md's table of gaps is the script's, from the kept runs, unedited."""
    from benchmarks import banded_mf
    from benchmarks.tables import with_generated_block
    from fl_app.report.sweep import load_runs

    root = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
    page = (root / "cross_device.md").read_text()
    by_arm, _, reference = banded_mf.group_arms(load_runs(root / "cross_device" / "runs")[0])
    lines = banded_mf.gaps_table(by_arm)
    assert with_generated_block(page, lines, begin=banded_mf.GAPS_BEGIN, end=banded_mf.GAPS_END) == page
    # every central arm (DP-FedAvg, adaptive clipping, DP-FTRL, banded MF, DP-BLT), tuned and untuned,
    # at every budget, 3 seeds each; the reference apart
    assert len(lines) == 2 + 5 * 4 and sum("(3) | " in line for line in lines) == 20
    assert all(line.count("(3)") == 2 for line in lines[2:]) and len(reference) == 3


def test_kd_dp_regime_pairs_in_the_page_rebuild_from_the_kept_runs():
    """docs/benchmarks/kd_dp.md's seed-by-seed table of the regime runs is the script's, unedited."""
    from benchmarks import kd_dp_regime
    from benchmarks.tables import with_generated_block

    root = Path(__file__).resolve().parents[1]
    page = (root / "docs" / "benchmarks" / "kd_dp.md").read_text()
    lines = kd_dp_regime.table(kd_dp_regime.load(root / "docs" / "benchmarks" / "kd_dp"))
    assert with_generated_block(page, lines, begin=kd_dp_regime.BEGIN, end=kd_dp_regime.END) == page
    # every arm of every population is there, the ablation included (the pairs need it)
    assert sum(" federated DP-SGD |" in line for line in lines) == 4


def test_kd_dp_regime_pairs_a_tuned_arm_with_the_tuned_ablation_only(tmp_path):
    """Runs labelled ``tuned`` are their own arms, each compared with the tuned ablation (not the
    unlabelled one), seed by seed."""
    from benchmarks import kd_dp_regime

    def arm(folder: str, name: str, *, teacher_rounds: int, final: float, seed: int = 1) -> None:
        strategy = {"name": "kd_dp", "teacher_rounds": teacher_rounds, "epsilon_special": None}
        partition = {"large_share": 0.5}
        label = "tuned" if folder.endswith("_tuned") else None
        config = {"strategy": strategy, "clients_per_round": 10, "seed": seed, "partition": partition}
        config["label"] = label
        write_run(
            tmp_path / folder / "runs" / f"{name}-{seed}",
            strategy="kd_dp",
            epsilon=1.0,
            config=config,
            final={"accuracy": final},
        )

    arm("regime", "ablation", teacher_rounds=0, final=0.70)
    arm("regime", "kd_dp", teacher_rounds=5, final=0.75)
    arm("regime_tuned", "ablation", teacher_rounds=0, final=0.80)
    arm("regime_tuned", "kd_dp", teacher_rounds=5, final=0.78)
    rows = {line.split(" | ")[2]: line for line in kd_dp_regime.table(kd_dp_regime.load(tmp_path))[2:]}
    assert set(rows) == {
        "federated DP-SGD",
        "KD-DP, no label noise",
        "federated DP-SGD, tuned",
        "KD-DP, no label noise, tuned",
    }
    assert "| +0.050 | 1 of 1 |" in rows["KD-DP, no label noise"]
    assert "| -0.020 | 0 of 1 |" in rows["KD-DP, no label noise, tuned"]
    assert rows["federated DP-SGD, tuned"].endswith("| - | - |")


def test_suite_time_reads_pytests_summary_and_marks_a_run_beside_other_work():
    from benchmarks import suite_time

    output = "....\n== slowest ==\n=========== 800 passed, 2 skipped in 888.03s (0:14:48) ===========\n"
    assert suite_time.summary_line(output) == "800 passed, 2 skipped in 888.03s (0:14:48)"
    record = {"date": "2026-11-26 09:00", "workers": 3, "wall_s": 540.0, "cpu_s": 900.0, "busy_share": 0.833}
    lines = suite_time.table(
        [{**record, "load_before": 0.1, "summary": "a"}, {**record, "load_before": 2.4, "summary": "b"}]
    )
    assert lines[2] == "| 2026-11-26 09:00 | `-n 3` | 540 s (9.0 min) | 900 s | 83% | 0.1 | a |"
    assert "| 2.4 (not quiet) | b |" in lines[3]
    assert suite_time.main(["run", "--workers", "0"]) == 2  # refused before anything runs


def test_process_cpu_names_the_kinds_of_the_suites_processes():
    from benchmarks.process_cpu import kind_of

    assert kind_of("/venv/bin/python -u -c import sys;exec(eval(sys.stdin.readline()))") == "pytest worker"
    assert kind_of("/venv/bin/python -m fl_app dataset=digits") == "python -m fl_app"
    assert kind_of("ray::BatchingActor.run_batch") == "Ray worker (client actor)"
    assert kind_of("/venv/bin/python /ray/workers/setup_worker.py x") == "Ray worker (client actor)"
    assert kind_of("/venv/lib/ray/core/src/ray/raylet/raylet --x") == "Ray GCS and raylet"
    assert kind_of("/venv/bin/python -I /tmp/fed/superlink/bin/flwr-serverapp --run-once") == "flwr-serverapp"
    assert kind_of("/usr/bin/sleep 1") == "other" and kind_of("") == "(exited before its first look)"


@pytest.mark.subprocess
def test_process_cpu_counts_a_child_that_burns_cpu(capsys):
    from benchmarks.process_cpu import main

    # after burning it waits, so the sampler's last look (every 0.5 s) sees all of its CPU
    burn = "import time\nend = time.process_time() + 1.2\nwhile time.process_time() < end: pass\n"
    burn += "time.sleep(3)"
    assert main(["--", sys.executable, "-c", burn]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("| other |"))
    assert 0.8 <= float(row.split("|")[3]) <= 2.0, out


def test_round_phases_charges_each_py_spy_sample_to_its_phase():
    """py-spy's raw lines (outermost frame first) sorted by benchmarks/round_phases.py's rules: the
    innermost specific frame decides (a forward pass inside train_local is training, inside
    evaluate_global evaluation), general rules only where no specific one matches, waits dropped."""
    from benchmarks import round_phases

    def frame(name: str, path: str, line: int = 1) -> str:
        return f"{name} ({path}:{line})"

    main = frame("main", "/w/fl_app/__main__.py")
    forward = frame("MLP.forward", "/w/fl_app/learning/models.py")
    raw = "\n".join(
        [
            'process 1:"python -m fl_app";thread (0x1);'
            + ";".join([main, frame("train_local", "/w/fl_app/learning/training.py", 204), forward])
            + " 30",
            ";".join([main, frame("evaluate_global", "/w/strategies/base.py", 173), forward]) + " 20",
            ";".join([main, frame("run", "/w/flwr/engine.py")]) + " 5",
            ";".join([main, frame("wait", "/usr/lib/python3.11/threading.py")]) + " 1000",
            ";".join([frame("<module>", "/usr/lib/python3.11/json/decoder.py")]) + " 2",
            "not a sample line",
        ]
    )
    by_phase, by_frame = round_phases.read_samples(raw, rate=10)
    assert by_phase == {
        "local training": 3.0,
        "central evaluation": 2.0,
        "Flower: engine, records, messages": 0.5,
        round_phases.OTHER: 0.2,
    }
    assert by_frame["local training", "learning/training.py:204 train_local"] == 3.0
    assert round_phases.parse_frame("Module._call_impl (/t/torch/nn/module.py:1775)") == (
        "/t/torch/nn/module.py",
        "Module._call_impl",
        "1775",
    )


def test_cross_device_cpu_loop_pair_runs_two_loops_at_once_each_with_its_output(tmp_path: Path) -> None:
    """The contention arm: two copies of the loop's command in one shell, which fails if either does."""
    import shlex
    import subprocess

    from benchmarks import cross_device_cpu

    command, _ = cross_device_cpu.loop_pair_command(30, tmp_path / "out")
    first, _ = cross_device_cpu.loop_command(30, tmp_path / "out")
    second, _ = cross_device_cpu.loop_command(30, tmp_path / "out-2")
    template = cross_device_cpu.PAIR_SCRIPT
    assert command == ["bash", "-c", template.format(shlex.join(first), shlex.join(second))]
    assert cross_device_cpu.COPIES["loop-pair"] == 2
    # the shell's exit status: 0 only when both copies exit 0, whichever ends first, even when both have
    # ended before the shell waits (repeated: `wait -n` exited 127 there, on CI, in some runs)
    cases = [("true", "true", 0)] * 20 + [
        ("false", "true", 1),
        ("true", "false", 1),
        ("true", "sleep 0.2; false", 1),
        ("sleep 0.2; false", "true", 1),
        ("sleep 0.2; true", "true", 0),
    ]
    for one, other, status in cases:
        script = template.format(f"({one})", f"({other})")
        assert subprocess.run(["bash", "-c", script], check=False).returncode == status, (one, other)


def test_cross_device_cpu_per_round_is_the_cpu_between_two_round_counts() -> None:
    """The CPU per round: (CPU at R2 - CPU at R1) / (R2 - R1) per arm, and its multiple of the loop's."""
    from benchmarks import cross_device_cpu

    def row(arm: str, repeat: int, rounds: int, cpu: float) -> dict[str, Any]:
        return {"arm": arm, "repeat": repeat, "rounds": rounds, "machine_cpu_s": cpu}

    rows = [
        row("loop", 1, 30, 10.0),
        row("dpfl-processes", 1, 30, 21.0),
        row("loop", 1, 100, 17.0),
        row("dpfl-processes", 1, 100, 35.0),
        row("loop", 2, 30, 9.0),  # a repeat without its longer runs has no row
    ]
    lines = cross_device_cpu.per_round_lines(rows, 30, 100)
    assert lines[2:] == ["| loop | 1 | 0.1000 | 1.00 |", "| dpfl-processes | 1 | 0.2000 | 2.00 |"]
