"""The comparison report: grouping over seeds, numbers equal to the files, broken files reported."""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from fl_app.report.sweep import main


def spy_on_figures(monkeypatch) -> list:
    """The (figure, axes) of every ``plt.subplots`` call the report makes, in order."""
    from fl_app.report import sweep as report

    made = []
    original = report.plt.subplots

    def spy(*args, **kwargs):
        figure, axes = original(*args, **kwargs)
        made.append((figure, axes))
        return figure, axes

    monkeypatch.setattr(report.plt, "subplots", spy)
    return made


def fake_results(
    directory: Path,
    *,
    strategy: str,
    epsilon: float | None,
    seed: int,
    accuracy: float,
    upload: int = 1000,
    clients: int = 4,
    evaluated_on: str | None = None,
    status: str = "completed",
    loss: float = 1.0,
    unit: str = "one client",
    chance: float | None = None,
    rounds_run: int = 3,
) -> None:
    directory.mkdir(parents=True)
    rounds = [
        {
            "round": r,
            "accuracy": accuracy * r / 3,
            "loss": 1.0,
            "epsilon": epsilon,
            "upload_bytes": upload * clients,
            "download_bytes": 10,
            "clients": clients,
            "failures": 0,
            "wall_s": float(r),
            "round_s": 1.0,
        }
        for r in range(1, rounds_run + 1)
    ]
    results = {
        "schema": 1,
        "status": status,
        "strategy": strategy,
        "dataset": "digits",
        "partition": "iid",
        "config": {
            "strategy": {"name": strategy},
            "seed": seed,
            "num_clients": 8,
            "privacy": {"epsilon": 4.0, "delta": 1e-5},
        },
        "initial": {"accuracy": 0.1, "loss": 2.3},
        "rounds": rounds,
        "final": {
            "accuracy": accuracy,
            "loss": loss,
            "epsilon": epsilon,
            "delta": 1e-5,
            "wall_s": 12.0,
            "rounds": rounds_run,
        },
        "privacy": {"unit": unit if epsilon else "none", "mechanism": "x", "accountant": "y"},
    }
    if chance is not None:
        results["final"]["chance_accuracy"] = chance
    if evaluated_on is not None:  # older runs have no field: they were evaluated on the test split
        results["final"]["evaluated_on"] = evaluated_on
        results["config"]["evaluation"] = {"split": evaluated_on}
    (directory / "results.json").write_text(json.dumps(results))


def test_report_groups_seeds_and_matches_the_files(tmp_path):
    for seed, accuracy in ((1, 0.80), (2, 0.84), (3, 0.82)):
        fake_results(
            tmp_path / f"dp{seed}",
            strategy="dp_fedavg",
            epsilon=3.5 + seed / 100,
            seed=seed,
            accuracy=accuracy,
        )
    fake_results(tmp_path / "fa", strategy="fedavg", epsilon=None, seed=1, accuracy=0.9, upload=2000)
    assert main([str(tmp_path)]) == 0
    rows = {r["algorithm"]: r for r in csv.DictReader((tmp_path / "report.csv").open())}
    dp = rows["dp_fedavg"]
    assert int(dp["seeds"]) == 3
    assert float(dp["accuracy_mean"]) == pytest.approx(np.mean([0.80, 0.84, 0.82]))
    assert float(dp["accuracy_std"]) == pytest.approx(np.std([0.80, 0.84, 0.82], ddof=1))
    assert float(dp["epsilon"]) == pytest.approx(3.53)  # the worst seed's epsilon
    assert float(dp["upload_bytes_per_client_round"]) == 1000
    assert rows["fedavg"]["epsilon"] == ""
    markdown = (tmp_path / "report.md").read_text()
    assert "0.8200 ± 0.0200" in markdown
    assert "∞ (not private)" in markdown
    for name in ("accuracy_vs_epsilon.png", "accuracy_vs_round.png", "accuracy_vs_upload.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_runs_that_differ_only_in_how_they_ran_are_one_group(tmp_path):
    """A run made before ``tracking`` and the GPU and concurrency keys existed joins a run made after."""
    fake_results(tmp_path / "old", strategy="dp_fedavg", epsilon=3.9, seed=1, accuracy=0.8)
    fake_results(tmp_path / "new", strategy="dp_fedavg", epsilon=3.9, seed=2, accuracy=0.6)
    path = tmp_path / "new" / "results.json"
    results = json.loads(path.read_text())
    results["config"]["tracking"] = "tensorboard"
    results["config"]["simulation"] = {"client_gpus": 0.0, "max_concurrent_clients": None, "timeout": 60}
    path.write_text(json.dumps(results))
    fake_results(tmp_path / "other", strategy="dp_fedavg", epsilon=3.9, seed=3, accuracy=0.7)
    path = tmp_path / "other" / "results.json"
    results = json.loads(path.read_text())
    results["config"]["num_clients"] = 16  # a different experiment
    path.write_text(json.dumps(results))
    assert main([str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "report.csv").open()))
    assert sorted(int(row["seeds"]) for row in rows) == [1, 2]
    joined = next(row for row in rows if row["seeds"] == "2")
    assert float(joined["accuracy_mean"]) == pytest.approx(0.7)
    assert "tracking" not in joined["settings"] and "client_gpus" not in joined["settings"]


def test_broken_results_are_reported_not_skipped(tmp_path, capsys):
    fake_results(tmp_path / "ok", strategy="fedavg", epsilon=None, seed=1, accuracy=0.5)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "results.json").write_text("{not json")
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "results.json").write_text(json.dumps({"strategy": "x"}))
    out = tmp_path / "report"
    assert main([str(tmp_path), "--out", str(out)]) == 1
    errors = capsys.readouterr().err
    assert "bad/results.json: unreadable" in errors
    assert "partial/results.json: missing fields" in errors
    assert "could not be used" in (out / "report.md").read_text()
    assert (out / "report.csv").exists()


def test_empty_directory_is_refused(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    assert "no usable results.json" in capsys.readouterr().err
    assert not (tmp_path / "report.md").exists()


def test_report_shows_the_empirical_estimate_beside_the_claim(tmp_path):
    for seed, estimate in ((1, 0.6), (2, 0.9)):
        fake_results(tmp_path / f"dp{seed}", strategy="dp_fedavg", epsilon=3.9, seed=seed, accuracy=0.8)
        path = tmp_path / f"dp{seed}" / "results.json"
        results = json.loads(path.read_text())
        results["privacy"]["empirical_epsilon"] = {
            "epsilon": estimate,
            "low": 0.1,
            "high": 1.7,
            "canaries": 50,
        }
        path.write_text(json.dumps(results))
    fake_results(tmp_path / "fa", strategy="fedavg", epsilon=None, seed=1, accuracy=0.9)
    assert main([str(tmp_path)]) == 0
    rows = {r["algorithm"]: r for r in csv.DictReader((tmp_path / "report.csv").open())}
    assert float(rows["dp_fedavg"]["empirical_epsilon"]) == 0.9  # the largest over seeds
    assert rows["dp_fedavg"]["canaries"] == "50" and rows["fedavg"]["empirical_epsilon"] == ""
    assert "| 0.9 (0.1..1.7; 50) |" in (tmp_path / "report.md").read_text()
    assert (tmp_path / "empirical_vs_claimed.png").stat().st_size > 0


def test_no_estimate_plot_without_canaries(tmp_path):
    fake_results(tmp_path / "dp", strategy="dp_fedavg", epsilon=3.9, seed=1, accuracy=0.8)
    assert main([str(tmp_path)]) == 0
    assert not (tmp_path / "empirical_vs_claimed.png").exists()


def test_a_swept_setting_gets_a_column_and_its_own_line(tmp_path):
    """A sweep over strategy.k keeps k (table column, separate plot lines); one seed shows no ± std;
    rows in different privacy units go to different tables."""
    for k, accuracy in ((2, 0.6), (4, 0.7)):
        for epsilon in (2.0, 8.0):
            directory = tmp_path / f"pkt_k{k}_e{epsilon}"
            fake_results(directory, strategy="privatekt", epsilon=epsilon, seed=1, accuracy=accuracy)
            results = json.loads((directory / "results.json").read_text())
            results["config"]["strategy"]["k"] = k
            results["config"]["privacy"]["epsilon"] = epsilon
            (directory / "results.json").write_text(json.dumps(results))
    fake_results(tmp_path / "fa", strategy="fedavg", epsilon=None, seed=1, accuracy=0.9)
    assert main([str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "report.csv").open()))
    privatekt = [r for r in rows if r["algorithm"] == "privatekt"]
    assert sorted(r["settings"] for r in privatekt) == ["strategy.k=2"] * 2 + ["strategy.k=4"] * 2
    assert {r["settings"] for r in rows if r["algorithm"] == "fedavg"} == {""}
    assert all(r["accuracy_std"] == "" for r in rows)  # one seed: no standard deviation
    markdown = (tmp_path / "report.md").read_text()
    assert " ± 0." not in markdown  # (the header names "mean ± std")
    assert "### Privacy unit: one client" in markdown and "### Privacy unit: none" in markdown
    assert "| strategy.k=4 |" in markdown


def test_plot_lines_never_join_two_configurations(tmp_path):
    from fl_app.report import sweep as report

    for k in (2, 4):
        for epsilon in (2.0, 8.0):
            directory = tmp_path / f"k{k}e{epsilon}"
            fake_results(directory, strategy="privatekt", epsilon=epsilon, seed=1, accuracy=0.5)
            results = json.loads((directory / "results.json").read_text())
            results["config"]["strategy"]["k"] = k
            results["config"]["privacy"]["epsilon"] = epsilon
            (directory / "results.json").write_text(json.dumps(results))
    runs, _ = report.load_runs(tmp_path)
    rows = report.summarise(runs)
    labels = {report._label(row) for row in rows}
    assert labels == {"privatekt (digits, strategy.k=2)", "privatekt (digits, strategy.k=4)"}


def test_an_arm_that_chooses_settings_per_budget_is_one_line(tmp_path):
    """``num_rounds: ${per_budget:...}`` (Hydra's saved config) joins the budgets into one line; a
    swept ``strategy.server_lr`` beside it still splits them, and without the saved rule the
    different round counts are different configurations."""
    from fl_app.report import sweep as report

    rounds_for = {2.0: 30, 8.0: 100}
    for lr in (0.1, 0.3):
        for epsilon, rounds in rounds_for.items():
            directory = tmp_path / "sweep" / f"lr{lr}e{epsilon}"
            fake_results(directory, strategy="dp_fedavg", epsilon=epsilon, seed=1, accuracy=0.5)
            results = json.loads((directory / "results.json").read_text())
            results["config"].update(num_rounds=rounds, server_lr=lr)
            results["config"]["privacy"]["epsilon"] = epsilon
            (directory / "results.json").write_text(json.dumps(results))
            (directory / ".hydra").mkdir()
            (directory / ".hydra" / "config.yaml").write_text(
                'num_rounds: ${per_budget:${privacy.epsilon},"2:30, 8:100"}\n'
                f"server_lr: {lr}\nprivacy:\n  epsilon: {epsilon}\n"
            )
    runs, _ = report.load_runs(tmp_path / "sweep")
    rows = report.summarise(runs)
    assert sorted(r["settings"] for r in rows) == [
        "num_rounds=100, server_lr=0.1",
        "num_rounds=100, server_lr=0.3",
        "num_rounds=30, server_lr=0.1",
        "num_rounds=30, server_lr=0.3",
    ]
    assert {report._label(row) for row in rows} == {
        "dp_fedavg (digits, server_lr=0.1, num_rounds per budget)",
        "dp_fedavg (digits, server_lr=0.3, num_rounds per budget)",
    }
    for saved in (tmp_path / "sweep").rglob(".hydra/config.yaml"):
        saved.unlink()
    rows = report.summarise(report.load_runs(tmp_path / "sweep")[0])
    assert len({report._label(row) for row in rows}) == 4


def test_accuracies_read_on_the_validation_split_say_so(tmp_path):
    fake_results(
        tmp_path / "tune", strategy="dp_fedavg", epsilon=4.0, seed=1, accuracy=0.7, evaluated_on="validation"
    )
    fake_results(
        tmp_path / "test", strategy="dp_fedavg", epsilon=4.0, seed=1, accuracy=0.6, evaluated_on="test"
    )
    assert main([str(tmp_path)]) == 0
    lines = (tmp_path / "report.md").read_text().splitlines()
    assert any("0.7000 (validation)" in line for line in lines)
    assert any("| 0.6000 |" in line for line in lines)
    rows = list(csv.DictReader((tmp_path / "report.csv").open()))
    assert sorted(r["evaluated_on"] for r in rows) == ["test", "validation"]


def test_a_run_from_before_the_validation_split_joins_a_test_split_run(tmp_path):
    fake_results(tmp_path / "old", strategy="dp_fedavg", epsilon=4.0, seed=1, accuracy=0.7)
    fake_results(
        tmp_path / "new", strategy="dp_fedavg", epsilon=4.0, seed=2, accuracy=0.8, evaluated_on="test"
    )
    new = json.loads((tmp_path / "new" / "results.json").read_text())
    new["config"]["evaluation"]["validation_fraction"] = 0.1
    (tmp_path / "new" / "results.json").write_text(json.dumps(new))
    assert main([str(tmp_path)]) == 0
    [row] = list(csv.DictReader((tmp_path / "report.csv").open()))
    assert int(row["seeds"]) == 2 and row["settings"] == ""


def test_only_completed_runs_are_reported_and_the_others_and_missing_jobs_are_listed(tmp_path, capsys):
    """Interrupted runs are not ordinary rows, and a job directory without results.json (kill -9) is
    listed, never silently left out."""
    fake_results(tmp_path / "0", strategy="dp_fedavg", epsilon=4.0, seed=1, accuracy=0.8)
    fake_results(
        tmp_path / "1", strategy="dp_fedavg", epsilon=4.0, seed=2, accuracy=0.3, status="interrupted"
    )
    killed = tmp_path / "2"
    (killed / ".hydra").mkdir(parents=True)
    (killed / "run.log").write_text("")
    assert main([str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert f"note: left out: {tmp_path / '1'}: interrupted" in err
    assert f"note: left out: {killed}: no results.json" in err
    rows = list(csv.DictReader((tmp_path / "report.csv").open()))
    assert len(rows) == 1 and rows[0]["status"] == "completed" and float(rows[0]["accuracy_mean"]) == 0.8
    report = (tmp_path / "report.md").read_text()
    assert (
        "Runs left out (not completed; `--all` includes them)" in report and "Jobs without results" in report
    )
    assert main([str(tmp_path), "--all"]) == 0
    rows = list(csv.DictReader((tmp_path / "report.csv").open()))
    assert rows[0]["status"] == "1 completed, 1 interrupted" and float(
        rows[0]["accuracy_mean"]
    ) == pytest.approx(0.55)


def test_a_diverged_run_is_flagged_in_the_table_and_on_stderr(tmp_path, capsys):
    fake_results(tmp_path / "0", strategy="dp_fedavg", epsilon=1.0, seed=1, accuracy=0.1, loss=132.0)
    fake_results(tmp_path / "1", strategy="dp_fedavg", epsilon=1.0, seed=2, accuracy=0.6, loss=1.2)
    assert main([str(tmp_path)]) == 0
    assert "1 of 2 runs diverged" in capsys.readouterr().err
    assert "⚠ 1 of 2 diverged" in (tmp_path / "report.md").read_text()
    assert next(csv.DictReader((tmp_path / "report.csv").open()))["diverged"] == "1"


def test_epsilons_of_different_units_get_their_own_panels_with_the_chance_level(tmp_path, monkeypatch):

    fake_results(tmp_path / "c", strategy="dp_fedavg", epsilon=2.0, seed=1, accuracy=0.8, chance=0.102)
    fake_results(
        tmp_path / "r",
        strategy="fedavg_ldp",
        epsilon=8.0,
        seed=1,
        accuracy=0.6,
        unit="one report",
        chance=0.102,
    )
    figures = spy_on_figures(monkeypatch)
    assert main([str(tmp_path)]) == 0
    axes = figures[0][1].flat  # accuracy_vs_epsilon.png
    assert [axis.get_title() for axis in axes] == ["privacy unit: one client", "privacy unit: one report"]
    for axis in axes:
        assert "chance level (digits)" in [line.get_label() for line in axis.get_lines()]
        assert 0.102 in [line.get_ydata()[0] for line in axis.get_lines()]
    assert (
        "Chance level (the evaluation split's most frequent label): digits 0.102."
        in (tmp_path / "report.md").read_text()
    )


def test_panel_titles_and_axis_labels_of_long_units_do_not_overlap(tmp_path, monkeypatch):
    """The units' full sentences ran into the next panel's title and x label (seen in the comparison)."""
    from fl_app.report import sweep as report

    units = (
        "one client's entire data set (add or remove one client), central DP",
        "one client's entire data set (zero-out: replaced by data whose clipped updates are zero; "
        "public cohort schedule), central DP",
        "one client's entire local data set (local DP: any two data sets of one client; each upload is "
        "protected against the server)",
    )
    for index, unit in enumerate(units):
        fake_results(
            tmp_path / f"{index}", strategy=f"s{index}", epsilon=2.0, seed=1, accuracy=0.5, unit=unit
        )
    figures = spy_on_figures(monkeypatch)
    monkeypatch.setattr(report.plt, "close", lambda *a, **k: None)
    assert main([str(tmp_path)]) == 0
    figure, axes = figures[0]  # accuracy_vs_epsilon.png
    renderer = figure.canvas.get_renderer()
    panels = list(axes.flat)
    assert len(panels) == 3
    for index in range(len(panels) - 1):
        left, right = panels[index], panels[index + 1]
        for a, b in ((left.title, right.title), (left.xaxis.label, right.xaxis.label)):
            assert a.get_window_extent(renderer).x1 <= b.get_window_extent(renderer).x0, a.get_text()


def test_upload_axis_labels_do_not_overlap(tmp_path, monkeypatch):
    """Minor-tick labels of a log axis spanning about a decade do not run into each other."""

    for index, upload in enumerate((1_200, 3_000, 20_000, 60_000)):  # four arms, one small panel each
        fake_results(
            tmp_path / f"{index}", strategy=f"s{index}", epsilon=1.0, seed=1, accuracy=0.5, upload=upload
        )
    figures = spy_on_figures(monkeypatch)
    assert main([str(tmp_path)]) == 0
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    figure = figures[-1][0]  # accuracy_vs_upload.png
    canvas = FigureCanvasAgg(figure)  # the report closed it
    canvas.draw()
    renderer = canvas.get_renderer()
    for axis in figure.axes:
        if not axis.get_visible():
            continue
        left, right = axis.get_window_extent(renderer).x0, axis.get_window_extent(renderer).x1
        labels = [*axis.get_xticklabels(), *axis.get_xticklabels(minor=True)]
        boxes = [
            t.get_window_extent(renderer)
            for t in labels
            if t.get_visible() and t.get_text() and left - 1 <= t.get_window_extent(renderer).x0 <= right
        ]
        texts = [t.get_text() for t in labels if t.get_text()]
        assert len(boxes) >= 2, texts
        boxes.sort(key=lambda box: box.x0)
        assert all(a.x1 < b.x0 for a, b in itertools.pairwise(boxes)), texts


def test_report_names_the_code_versions_its_rows_come_from(tmp_path):
    """Rows are comparable only from one code version: the report says which ones (``code``)."""
    import json as _json

    from fl_app.run.code_version import code_version, describe

    for seed in (1, 2, 3):
        fake_results(tmp_path / "one" / f"r{seed}", strategy="fedavg", epsilon=None, seed=seed, accuracy=0.8)
    assert main([str(tmp_path / "one"), "--out", str(tmp_path / "out0")]) == 0
    assert "Code:" not in (tmp_path / "out0" / "report.md").read_text()  # older results: no claim
    versions = [
        {"package": "0.1.0", "commit": "a" * 40, "dirty": False},
        {"package": "0.1.0", "commit": "a" * 40, "dirty": False},
        {"package": "0.1.0", "commit": "b" * 40, "dirty": True},
    ]
    for seed, version in zip((1, 2, 3), versions, strict=True):
        path = tmp_path / "one" / f"r{seed}" / "results.json"
        results = _json.loads(path.read_text())
        results["code"] = version
        path.write_text(_json.dumps(results))
    assert main([str(tmp_path / "one"), "--out", str(tmp_path / "out1")]) == 0
    text = (tmp_path / "out1" / "report.md").read_text()
    assert "Code: 2 versions: aaaaaaa (2 runs), bbbbbbb (edited) (1 runs)." in text
    path = tmp_path / "one" / "r3" / "results.json"
    results = _json.loads(path.read_text())
    results["code"] = versions[0]
    path.write_text(_json.dumps(results))
    assert main([str(tmp_path / "one"), "--out", str(tmp_path / "out2")]) == 0
    assert "Code: every run on aaaaaaa." in (tmp_path / "out2" / "report.md").read_text()
    # this checkout: the commit git names; a FAB (no git) records the package alone
    here = code_version()
    assert here["package"] and (here["commit"] is None or len(here["commit"]) == 40)
    assert describe({"package": "0.1.0", "commit": None, "dirty": None}) == "dpfl 0.1.0"
    assert describe(None) == "unknown"


def test_code_version_outside_a_git_checkout_is_the_package_alone(tmp_path, monkeypatch):
    from fl_app.run import code_version as module

    monkeypatch.setattr(module, "ROOT", tmp_path)
    module.code_version.cache_clear()
    try:
        assert module.code_version() == {
            "package": module.code_version()["package"],
            "commit": None,
            "dirty": None,
        }
    finally:
        module.code_version.cache_clear()


def test_a_labelled_arm_is_its_own_row_named_by_its_label(tmp_path):
    """``label=untuned`` makes a row of its own, named ``dp_fedavg (untuned)`` in the algorithm column
    (not a settings column); a run made before ``label`` existed joins an unlabelled one."""
    for seed, (name, label) in enumerate([("a", None), ("b", None), ("c", "untuned"), ("d", "untuned")]):
        fake_results(tmp_path / name, strategy="dp_fedavg", epsilon=3.9, seed=seed, accuracy=0.5 + seed / 10)
        path = tmp_path / name / "results.json"
        results = json.loads(path.read_text())
        if name != "a":  # "a" predates the key
            results["config"]["label"] = label
        path.write_text(json.dumps(results))
    assert main([str(tmp_path)]) == 0
    rows = {row["algorithm"]: row for row in csv.DictReader((tmp_path / "report.csv").open())}
    assert set(rows) == {"dp_fedavg", "dp_fedavg (untuned)"}
    assert float(rows["dp_fedavg"]["accuracy_mean"]) == pytest.approx(0.55)
    assert float(rows["dp_fedavg (untuned)"]["accuracy_mean"]) == pytest.approx(0.75)
    assert all("label" not in row["settings"] for row in rows.values())
    assert "| dp_fedavg (untuned) |" in (tmp_path / "report.md").read_text()


def test_the_plots_have_whole_rounds_draw_one_round_runs_warn_nothing_and_have_short_titles(
    tmp_path, monkeypatch, capsys
):
    """Round ticks at 1.25, empty panels for 1-round runs, six-line titles and a matplotlib warning on
    screen were what the report showed; a secret cohort's runs (no upload sizes) are left out of the
    upload plot instead of drawn at zero on a log axis."""
    import warnings

    long = "dp_fedavg_adaptive_with_a_long_label_that_once_made_titles_of_six_lines"
    for seed in (1, 2):
        fake_results(
            tmp_path / f"dp{seed}", strategy=long, epsilon=2.0, seed=seed, accuracy=0.5, rounds_run=1
        )
    fake_results(tmp_path / "fa", strategy="fedavg", epsilon=None, seed=1, accuracy=0.7, rounds_run=1)
    for path in tmp_path.glob("*/results.json"):  # secret cohorts: no sizes, no counts, no times
        results = json.loads(path.read_text())
        results["rounds"] = [
            {k: r[k] for k in ("round", "accuracy", "loss", "epsilon")} for r in results["rounds"]
        ]
        results["config"]["label"] = "clip=0.1 server_lr=1.0 noise from a very long explanation"
        path.write_text(json.dumps(results))
    figures = spy_on_figures(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the report
        assert main([str(tmp_path)]) == 0
    assert "arning" not in capsys.readouterr().err
    assert not (tmp_path / "accuracy_vs_upload.png").exists()
    written = sorted(p.name for p in tmp_path.glob("*.png"))
    assert written == ["accuracy_vs_epsilon.png", "accuracy_vs_round.png", "epsilon_vs_round.png"]
    for _, axes in figures:
        for axis in [a for a in np.ravel(axes) if a.get_visible()]:
            assert axis.get_title().count("\n") <= 1 and all(
                len(t) <= 75 for t in axis.get_title().split("\n")
            )
            if axis.get_xlabel().startswith("round"):
                ticks = [t for t in axis.get_xticks() if axis.get_xlim()[0] <= t <= axis.get_xlim()[1]]
                assert ticks and all(float(t).is_integer() for t in ticks), ticks
                drawn = [line for line in axis.get_lines() if len(line.get_xdata()) >= 2]
                assert drawn, axis.get_title()  # a 1-round run is a line from round 0, not an empty panel


def test_accuracy_by_round_is_the_mean_over_seeds_with_their_range_and_epsilon_by_round_is_plotted(
    tmp_path, monkeypatch
):
    from matplotlib.collections import PolyCollection

    accuracies = {1: 0.6, 2: 0.9, 3: 0.75}
    for seed, accuracy in accuracies.items():
        fake_results(tmp_path / f"dp{seed}", strategy="dp_fedavg", epsilon=2.0, seed=seed, accuracy=accuracy)
    for path in tmp_path.glob("*/results.json"):
        results = json.loads(path.read_text())
        for row in results["rounds"]:
            row["epsilon"] = 2.0 * row["round"] / 3  # spent round by round
        path.write_text(json.dumps(results))
    figures = spy_on_figures(monkeypatch)
    assert main([str(tmp_path)]) == 0
    (epsilon_axes,) = [axes for _, axes in figures if np.ravel(axes)[0].get_xlabel() == "round"]
    (spent,) = np.ravel(epsilon_axes)[0].get_lines()
    assert list(spent.get_xdata()) == [0, 1, 2, 3] and list(spent.get_ydata()) == pytest.approx(
        [0, 2 / 3, 4 / 3, 2]
    )
    (round_axes,) = [axes for _, axes in figures if np.ravel(axes)[0].get_xlabel().startswith("round (0")]
    axis = np.ravel(round_axes)[0]
    mean = axis.get_lines()[0]
    expected = [0.1] + [np.mean([a * r / 3 for a in accuracies.values()]) for r in (1, 2, 3)]
    assert list(mean.get_xdata()) == [0, 1, 2, 3] and list(mean.get_ydata()) == pytest.approx(expected)
    (band,) = [c for c in axis.collections if isinstance(c, PolyCollection)]
    ys = band.get_paths()[0].vertices[:, 1]
    assert ys.min() == pytest.approx(0.1) and ys.max() == pytest.approx(0.9)  # the best seed's last round
    assert "mean over seeds; band: lowest to highest seed" in axis.figure.texts[0].get_text()


def test_the_report_is_markdown_and_html_with_its_tables_and_plots(tmp_path):
    for seed, accuracy in ((1, 0.80), (2, 0.84)):
        fake_results(tmp_path / f"dp{seed}", strategy="dp_fedavg", epsilon=3.5, seed=seed, accuracy=accuracy)
    fake_results(tmp_path / "fa", strategy="fedavg", epsilon=None, seed=1, accuracy=0.9)
    assert main([str(tmp_path)]) == 0
    markdown = (tmp_path / "report.md").read_text()
    page = (tmp_path / "report.html").read_text()
    plots = [
        "accuracy_vs_epsilon.png",
        "epsilon_vs_round.png",
        "accuracy_vs_round.png",
        "accuracy_vs_upload.png",
    ]
    for name in plots:
        assert (tmp_path / name).stat().st_size > 0
        assert f"]({name})" in markdown and f'<img src="{name}"' in page
    assert markdown.index("accuracy_vs_epsilon.png") < markdown.index("accuracy_vs_round.png")
    for text in ("0.8200 ± 0.0283", "∞ (not private)", "Privacy unit: one client", "dp_fedavg", "fedavg"):
        assert text in markdown and text in page
    assert page.count("<table>") == 2 and page.count("<tr>") == 4  # a table per unit: its header, its group


def test_the_kept_sweeps_report_is_what_the_report_makes_of_its_runs(tmp_path):
    """docs/report_example shows the plots of a kept sweep: its report.md is the report of its runs."""
    kept = Path(__file__).resolve().parents[1] / "docs" / "report_example"
    assert main([str(kept / "runs"), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "report.md").read_text() == (kept / "report.md").read_text()
    for name in ("accuracy_vs_epsilon.png", "epsilon_vs_round.png", "accuracy_vs_round.png"):
        assert (kept / name).is_file() and f"]({name})" in (kept / "report.md").read_text()
