"""The FedProx walk-through of docs/contributing/adding-an-algorithm.md runs as written, and a plug-in's run
resumes only with its module.

The page's sections 1-4 each give one file (``## N. `path`: ...`` and the section's first code block).
Those files are not in the repository: this module writes them into a temporary folder, makes
``strategies/fedprox.py`` and ``clients/fedprox.py`` importable under those names (the folder joins the
two packages' search paths for the test) and loads them as plug-ins, as the page's last section says a
module outside the package is loaded (``DPFL_PLUGINS``; the yaml's defaults through
``store_strategy_config``). One round of ``strategy=fedprox`` then runs in this process (inline), and the
page's own test module runs on it. Afterwards nothing of it stays registered, and resuming that run
without ``DPFL_PLUGINS`` is refused in one line naming the module and the variable.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import yaml
from conftest import FAST, INLINE, simulate_in_process

import clients
import strategies
from clients import CLIENTS
from fl_app.config.checks import ConfigError
from fl_app.config.registry import PLUGINS_ENV, load_plugins
from strategies import STRATEGIES, store_strategy_config

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "contributing" / "adding-an-algorithm.md"
#: The walk-through's files, by the path its section heading names.
SECTION = re.compile(r"^## \d+\. `(?P<path>[\w/.]+)`", re.M)
BLOCK = re.compile(r"^```[a-z]*\n(?P<code>.*?)^```", re.M | re.S)
NAME = "fedprox"
MODULES = ("clients.fedprox", "strategies.fedprox")


def walkthrough_files(page: Path = PAGE) -> dict[str, str]:
    """Each file the page's numbered sections give: its path and the section's first code block."""
    text = page.read_text()
    starts = list(SECTION.finditer(text))
    files = {}
    for here, after in zip(starts, [*starts[1:], None], strict=True):
        section = text[here.end() : after.start() if after is not None else len(text)]
        block = BLOCK.search(section)
        if block is not None:
            files[here["path"]] = block["code"]
    return files


class Walkthrough:
    """The page's files in ``root``, loaded as plug-ins while :meth:`loaded` runs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.files = walkthrough_files()
        for path, code in self.files.items():
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(code)

    @contextmanager
    def loaded(self) -> Iterator[None]:
        """Its strategy and client registered (``DPFL_PLUGINS``), its defaults stored; all undone after."""
        from hydra.core.config_store import ConfigStore

        defaults = yaml.safe_load(self.files[f"conf/strategy/{NAME}.yaml"])
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(strategies, "__path__", [*strategies.__path__, str(self.root / "strategies")])
            patch.setattr(clients, "__path__", [*clients.__path__, str(self.root / "clients")])
            patch.setenv(PLUGINS_ENV, ",".join(MODULES))
            try:
                store_strategy_config(NAME, **{k: v for k, v in defaults.items() if k != "name"})
                load_plugins()  # as every process that looks a name up does first
                yield
            finally:
                STRATEGIES.unregister(NAME)
                CLIENTS.unregister(NAME)
                ConfigStore.instance().repo["strategy"].pop(f"{NAME}.yaml", None)
                for module in MODULES:
                    sys.modules.pop(module, None)

    def test_module(self) -> ModuleType:
        """The page's ``tests/test_fedprox.py``, imported under a name of its own."""
        spec = importlib.util.spec_from_file_location(
            "walkthrough_test_fedprox", self.root / "tests/test_fedprox.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module


@pytest.fixture(scope="module")
def walkthrough(tmp_path_factory: pytest.TempPathFactory) -> Walkthrough:
    return Walkthrough(tmp_path_factory.mktemp("walkthrough"))


@pytest.fixture(scope="module")
def fedprox_run(walkthrough: Walkthrough, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One round of the page's ``strategy=fedprox``, inline in this process."""
    output = tmp_path_factory.mktemp("fedprox_run") / "run"
    with walkthrough.loaded():
        return simulate_in_process([*FAST, INLINE, f"strategy={NAME}", "num_rounds=1"], output, None)


def test_the_page_gives_the_four_files_of_its_sections(walkthrough: Walkthrough) -> None:
    assert set(walkthrough.files) == {
        f"strategies/{NAME}.py",
        f"clients/{NAME}.py",
        f"conf/strategy/{NAME}.yaml",
        f"tests/test_{NAME}.py",
    }
    for path in walkthrough.files:
        assert not (ROOT / path).exists(), f"{path} is shipped: the page says it is a walk-through"
    assert "a walk-through" in PAGE.read_text()


def test_the_walkthrough_runs_a_round_and_passes_its_own_tests(
    walkthrough: Walkthrough, fedprox_run: dict[str, Any], tmp_path: Path
) -> None:
    assert fedprox_run["status"] == "completed" and fedprox_run["strategy"] == NAME
    assert fedprox_run["config"]["strategy"]["mu"] == 0.01  # the yaml's default
    assert fedprox_run["engine"]["messages"] == "packed"  # its client states its own local SGD
    with walkthrough.loaded():
        page_tests = walkthrough.test_module()
        page_tests.test_every_train_message_carries_mu(tmp_path / "a")
        page_tests.test_the_proximal_term_keeps_the_local_model_near_the_global_one(tmp_path / "b")
        page_tests.check_quick_example(fedprox_run, SimpleNamespace(clients_per_round=3))
    assert NAME not in STRATEGIES.names() and not any(m in sys.modules for m in MODULES)


def test_resuming_a_plugins_run_without_its_module_names_the_module_and_the_variable(
    fedprox_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from fl_app.config.compose import compose_config

    monkeypatch.delenv(PLUGINS_ENV, raising=False)
    output = Path(fedprox_run["_output_dir"]).resolve()
    with pytest.raises(ConfigError) as refused:
        compose_config([f"resume={output}", "num_rounds=2"])
    assert str(refused.value) == (
        f"strategy='{NAME}': is in the plugin module strategies.{NAME} that the run in {output} loaded: "
        f"set {PLUGINS_ENV}={','.join(MODULES)} to resume it"
    )
