"""Submodules imported on first use (:mod:`fl_app.data.lazy_import`): flwr-datasets' plotting and metrics."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fl_app.data.lazy_import import DeferredModule, defer_submodules


def _package(root: Path, name: str) -> None:
    """A package whose ``__init__`` imports two submodules; each records in ``LOADED`` that it ran."""
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(f"LOADED = []\nfrom {name} import heavy, light\n")
    for sub in ("heavy", "light"):
        (root / name / f"{sub}.py").write_text(
            f"import {name}\n{name}.LOADED.append({sub!r})\nVALUE = {sub!r}\n"
        )


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"lazy_probe_{tmp_path.name.replace('-', '_')}"
    _package(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for module in [m for m in sys.modules if m == name or m.startswith(f"{name}.")]:
        del sys.modules[module]


def test_a_deferred_submodule_runs_on_its_first_attribute_and_is_then_the_real_module(package: str) -> None:
    assert defer_submodules(package, ["heavy", "absent"]) == [f"{package}.heavy"]
    imported = importlib.import_module(package)
    assert imported.LOADED == ["light"]  # its __init__ imported both; only the other one ran
    assert isinstance(imported.heavy, DeferredModule)
    from_import = {}
    exec(f"from {package}.heavy import VALUE", from_import)
    assert from_import["VALUE"] == "heavy" and imported.LOADED == ["light", "heavy"]
    real = sys.modules[f"{package}.heavy"]
    assert not isinstance(real, DeferredModule) and imported.heavy is real
    assert imported.heavy.VALUE == "heavy" and imported.LOADED == ["light", "heavy"]  # ran once


def test_nothing_is_deferred_once_the_package_is_imported(package: str) -> None:
    importlib.import_module(package)
    assert defer_submodules(package, ["heavy"]) == []
    assert sys.modules[package].LOADED == ["heavy", "light"]


def test_an_unknown_package_defers_nothing() -> None:
    assert defer_submodules("no_such_package_here", ["anything"]) == []


@pytest.mark.subprocess
def test_partitioning_leaves_flwr_datasets_plotting_unimported_and_still_importable() -> None:
    """Before: importing the partitioners imported seaborn and scipy.stats (2 s of CPU per process)."""
    probe = (
        "import json, sys\n"
        "import fl_app.data.partition\n"
        "heavy = ['seaborn', 'scipy.stats', 'matplotlib.pyplot']\n"
        "before = [m for m in heavy if m in sys.modules]\n"
        "from flwr_datasets.visualization import plot_label_distributions\n"
        "import flwr_datasets\n"
        "from flwr_datasets.metrics import compute_counts\n"
        "print(json.dumps({'before': before, 'after': [m for m in heavy if m in sys.modules],\n"
        "    'plot': plot_label_distributions.__module__, 'counts': callable(compute_counts),\n"
        "    'bound': type(flwr_datasets.visualization).__name__}))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe],
        env=dict(os.environ),
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["before"] == []
    assert seen["after"] == ["seaborn", "scipy.stats", "matplotlib.pyplot"]
    assert seen["plot"].startswith("flwr_datasets.visualization") and seen["counts"]
    assert seen["bound"] == "module"
