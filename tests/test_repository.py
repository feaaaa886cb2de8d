"""The repository's promises: CI runs the README's test command; required files exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    commands = []
    for block in blocks[:2]:
        commands += [line for line in block.splitlines() if line and not line.startswith("#")]
    return commands


def test_ci_runs_the_readme_test_command():
    main_job, tests = readme_commands()
    assert "pytest" in tests and "fl_app" in main_job
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci


def test_required_top_level_layout():
    for name in (
        "pyproject.toml",
        "conf",
        "fl_app",
        "strategies",
        "clients",
        "tests",
        "README.md",
        ".ci/run",
    ):
        assert (ROOT / name).exists(), name


def test_gitignore_keeps_packages_in_the_flower_app_bundle():
    """The FAB builder drops whatever .gitignore matches: patterns must not hit package folders."""
    import pathspec

    spec = pathspec.PathSpec.from_lines("gitwildmatch", (ROOT / ".gitignore").read_text().splitlines())
    for path in ROOT.rglob("*.py"):
        relative = path.relative_to(ROOT).as_posix()
        if relative.startswith((".venv/", ".venv-pfl/", ".venv-jax/", "build/")):  # venvs, build output
            continue
        assert not spec.match_file(relative), relative
    for path in (ROOT / "conf").rglob("*.yaml"):
        assert not spec.match_file(path.relative_to(ROOT).as_posix())


def test_ruff_lint_and_format_are_clean():
    """The code style the project promises (pyproject's ruff settings) holds for every file."""
    import subprocess
    import sys

    ruff = Path(sys.executable).parent / "ruff"
    for command in (["check", "."], ["format", "--check", "."]):
        process = subprocess.run([str(ruff), *command], cwd=ROOT, capture_output=True, text=True, check=False)
        assert process.returncode == 0, process.stdout + process.stderr


def test_benchmarks_md_and_readme_results_are_generated_not_hand_edited():
    """BENCHMARKS.md and the README's results table are what benchmarks/build_docs.py makes from
    the generated pages in docs/benchmarks/ (regenerate after new runs; never edit numbers)."""
    import subprocess
    import sys

    process = subprocess.run(
        [sys.executable, "-P", str(ROOT / "benchmarks" / "build_docs.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert process.returncode == 0, process.stderr


#: The core: privacy math, data, models, training and the algorithms' helpers. It must not import the
#: app shell (run wiring, Flower apps, simulation, results, CLI, strategies, clients), so it can be
#: tested and reused without Flower's or Hydra's machinery.
CORE = ("fl_app/privacy", "fl_app/data", "fl_app/learning", "fl_app/keys.py")
#: Entry points inside the core's folders (they start a shell tool).
CORE_ENTRY_POINTS = ("fl_app/privacy/__main__.py",)
#: The app shell: the entry points and the packages of configuration, runs, the engine and reports.
SHELL = (
    "fl_app.__main__",
    "fl_app.api",
    "fl_app.cli",
    "fl_app.client_app",
    "fl_app.server_app",
    "fl_app.config",
    "fl_app.run",
    "fl_app.engine",
    "fl_app.report",
    "strategies",
    "clients",
)


def imported_modules(path: Path) -> list[str]:
    """Every module ``path`` imports, at module level or inside functions."""
    import ast

    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_the_core_imports_nothing_from_the_app_shell():
    files = []
    for entry in CORE:
        path = ROOT / entry
        assert path.exists(), entry
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    files = [f for f in files if f.relative_to(ROOT).as_posix() not in CORE_ENTRY_POINTS]
    assert len(files) > 10
    arrows = [
        f"{file.relative_to(ROOT)} imports {name}"
        for file in files
        for name in imported_modules(file)
        if any(name == shell or name.startswith(f"{shell}.") for shell in SHELL)
    ]
    assert arrows == []
    # the check sees function-level imports too (the way an arrow back up usually sneaks in)
    assert "fl_app.engine.simulation" in imported_modules(ROOT / "fl_app" / "api.py")  # inside run_experiment


@pytest.mark.subprocess
def test_fl_app_defers_torch_and_shims_torchvision_before_it_loads():
    """``import fl_app`` alone costs no torch import; torchvision still imports after it (the shim)."""
    import subprocess
    import sys

    code = (
        "import sys, fl_app\n"
        "print('torch' in sys.modules)\n"
        "import torchvision.transforms\n"
        "import torch\n"
        "print(hasattr(torch.ops.torchvision, 'nms'))\n"
    )
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert output.stdout.split() == ["False", "True"]


#: The modules of ``strategies/`` every algorithm may import (the contract and the usual
#: implementation's parts); every other module or package of ``strategies/`` is one algorithm's home.
STRATEGY_PLUMBING = {
    "base",
    "private",
    "arrays",
    "cohorts",
    "replies",
    "reporting",
    "settings",
    "stage",
    "contract",
}
#: Most lines of one algorithm's home (``strategies/<name>.py`` or ``strategies/<name>/``, with its
#: ``clients/<name>.py``): a package may grow files, not without bound.
MAX_HOME_LINES = 1_300
#: Most lines of the shared strategy plumbing, all its modules together (the usual round and the
#: private layer on top of it, replies, reports, settings, cohorts, arrays, stages, the contract).
#: The private layer's statements of noise fixed by a setting and of a simulated deployment's epsilon
#: took it past 1,800 (their arithmetic lives in ``fl_app/privacy/fixed_noise.py``).
MAX_PLUMBING_LINES = 1_900


def algorithm_homes() -> dict[str, list[Path]]:
    """Algorithm name -> the files of its home (server side and client)."""
    homes: dict[str, list[Path]] = {}
    for entry in sorted((ROOT / "strategies").iterdir()):
        name = entry.stem
        if name.startswith("_") or name in STRATEGY_PLUMBING or name == "__pycache__":
            continue
        files = sorted(entry.rglob("*.py")) if entry.is_dir() else [entry]
        client = ROOT / "clients" / f"{name}.py"
        homes[name] = files + ([client] if client.exists() else [])
    return homes


def lines_of(files: list[Path]) -> int:
    return sum(len(path.read_text().splitlines()) for path in files)


def imported_names(path: Path) -> list[tuple[str, str]]:
    """``(module, name)`` for every ``from module import name`` in ``path`` (module level or in functions)."""
    import ast

    return [
        (node.module, alias.name)
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
        for alias in node.names
    ]


def private_reaches(path: Path, homes: set[str], own: str) -> list[str]:
    """What ``path`` (in home ``own``) takes of another algorithm's private names (a leading ``_``)."""
    import re

    reaches = [
        f"{path.relative_to(ROOT)} imports {module}.{name}"
        for module, name in imported_names(path)
        if module.startswith("strategies.")
        and module.split(".")[1] in homes
        and module.split(".")[1] != own
        and (name.startswith("_") or any(part.startswith("_") for part in module.split(".")[2:]))
    ]
    text = path.read_text()
    for home in sorted(homes - {own}):  # `import strategies.other as x` then `x._private`
        for alias in re.findall(rf"import strategies\.{home}(?:\.\w+)* as (\w+)", text):
            reaches += [
                f"{path.relative_to(ROOT)} uses {alias}.{m}" for m in re.findall(rf"\b{alias}\.(_\w+)", text)
            ]
    return reaches


def test_each_algorithm_has_one_bounded_home_and_reaches_into_no_other():
    """An algorithm's server side, privacy math and helpers live in one home, capped as a whole.

    One algorithm may build on another's public classes (``dp_flower`` on ``dp_fedavg``'s settings and
    strategy and on ``flower``'s adapter); it never takes another home's private names (a leading
    underscore, in the name or in the module path).
    """
    from strategies import EVALUATION_STAGES, STRATEGIES

    homes = algorithm_homes()
    assert set(STRATEGIES.names()) | set(EVALUATION_STAGES.names()) == set(homes)
    too_long = {name: n for name, files in homes.items() if (n := lines_of(files)) > MAX_HOME_LINES}
    assert too_long == {}
    plumbing = [ROOT / "strategies" / f"{name}.py" for name in sorted(STRATEGY_PLUMBING)]
    assert lines_of(plumbing) <= MAX_PLUMBING_LINES
    reaches = [
        reach
        for name, files in homes.items()
        for path in files
        for reach in private_reaches(path, set(homes), name)
    ]
    assert reaches == []
    # the check sees a private name taken from another home, and one reached through a module alias
    probe = ROOT / "strategies" / "_probe_reach.py"
    try:
        probe.write_text("from strategies.dp_fedavg import _x\nimport strategies.flower as f\nf._y\n")
        assert len(private_reaches(probe, set(homes), "dp_flower")) == 2
    finally:
        probe.unlink()
    # nothing of one algorithm left in the shared core
    for moved in ("fl_app/knowledge.py", "fl_app/bits.py", "fl_app/clustering.py", "fl_app/privacy/kd_dp.py"):
        assert not (ROOT / moved).exists(), moved


#: Flower's public API (its documented modules); any other ``flwr`` module is private to Flower.
FLOWER_PUBLIC = ("flwr.app", "flwr.serverapp", "flwr.serverapp.strategy", "flwr.clientapp", "flwr.common",
                 "flwr.clientapp.mod", "flwr.simulation", "flwr.client.mod")  # fmt: skip
#: Hydra's non-public modules.
HYDRA_PRIVATE = ("hydra._internal", "hydra.initialize", "hydra.core.global_hydra")
#: Test modules allowed Flower's internals: the engine's own tests (they drive the patched engine),
#: and the oracle tests that compare dpfl's DP arithmetic with Flower's own functions.
PRIVATE_API_TESTS = ("test_flower_engine.py", "test_baselines.py", "test_client_level_baselines.py")


def private_api_uses(path: Path) -> list[str]:
    """Flower and Hydra internals ``path`` imports, and private Flower attributes it writes."""
    uses = []
    for name in imported_modules(path):
        flower = (name == "flwr" or name.startswith("flwr.")) and name not in FLOWER_PUBLIC
        if flower or name.startswith(HYDRA_PRIVATE):
            uses.append(name)
    uses += re.findall(r"metadata\.__dict__\[[^]]*\]", path.read_text())
    return uses


def test_flower_and_hydra_internals_only_in_the_engine_seam():
    """Every private Flower/Hydra API (imports, private attributes) lives in fl_app/engine/."""
    folders = ("fl_app", "strategies", "clients", "benchmarks", "scripts", "tests")
    outside = {
        path.relative_to(ROOT).as_posix(): uses
        for folder in folders
        for path in sorted((ROOT / folder).rglob("*.py"))
        if not path.relative_to(ROOT).as_posix().startswith("fl_app/engine/")
        and path.name not in PRIVATE_API_TESTS
        and (uses := private_api_uses(path))
    }
    assert outside == {}
    inside = {p.name: private_api_uses(p) for p in sorted((ROOT / "fl_app" / "engine").glob("*.py"))}
    assert inside["dispatch.py"] and inside["messages.py"] and inside["hydra.py"]  # the check sees them


def import_graph(files: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports: module level, inside functions, in package ``__init__``.

    ``from package import name`` is an arrow to ``package.name`` when that is a module, else to the
    package; imports under ``if TYPE_CHECKING:`` are not executed and do not count.
    """
    import ast

    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text())
        typing_only = {
            id(inner)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for inner in ast.walk(node)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [
                    f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in files else node.module
                    for alias in node.names
                ]
            graph[name] |= {target for target in targets if target in files and target != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    import sys

    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for target in graph[module]:
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in on_stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for module in graph:
        if module not in index:
            visit(module)
    return cycles


def project_modules() -> dict[str, Path]:
    """Dotted name -> file of every module of fl_app, strategies and clients."""
    modules = {}
    for package in ("fl_app", "strategies", "clients"):
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            modules[name.removesuffix(".__init__")] = path
    return modules


def test_no_import_cycles_among_the_projects_modules(tmp_path):
    """No cycle, counting function-level imports and package ``__init__`` imports."""
    modules = project_modules()
    assert len(modules) > 80
    assert import_cycles(import_graph(modules)) == []
    # the check finds a cycle hidden in a function and one through a package __init__
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("def later():\n    from pkg.b import x\n")
    (tmp_path / "pkg" / "a.py").write_text("def f():\n    import pkg.b\n")
    (tmp_path / "pkg" / "b.py").write_text("from pkg import a\nimport pkg\nx = 1\n")
    files = {"pkg": tmp_path / "pkg" / "__init__.py", "pkg.a": tmp_path / "pkg" / "a.py"}
    files["pkg.b"] = tmp_path / "pkg" / "b.py"
    assert import_cycles(import_graph(files)) == [["pkg", "pkg.a", "pkg.b"]]


def test_every_algorithm_is_registered_where_the_platform_expects_it():
    """One declaration per algorithm; this names what a new one still lacks.

    docs/contributing/adding-an-algorithm.md says how to add one.

    Its conf file (or a ``store_strategy_config`` of its module), its declared quick example, its
    end-to-end audit when it is private by default (``@audit_of`` in tests/test_privacy_end_to_end.py
    or ``PRIVACY_AUDIT`` in its own test module), and an arm in exactly the comparisons it declares.
    Nothing else: suite rounds, checks, deployment settings all come from the declaration.
    """
    from fl_app.config.compose import compose_config
    from fl_app.config.validation import typed_settings
    from strategies import STRATEGIES
    from strategies.contract import COMPARISONS
    from tests.test_privacy_end_to_end import AUDITS

    conf = ROOT / "conf"
    arms = {
        group: {p.stem.removesuffix("_untuned") for p in (conf / group).glob("*.yaml")}
        for group in COMPARISONS
    }
    missing: dict[str, list[str]] = {}
    for name in STRATEGIES.names():
        if name.startswith("plugin_"):
            continue  # a test's algorithm (tests/test_plugin.py)
        declaration = STRATEGIES.get(name).declaration
        lacks = []
        if not (conf / "strategy" / f"{name}.yaml").exists():
            lacks.append(f"conf/strategy/{name}.yaml")
        if declaration.quick is None:
            lacks.append("a quick example (Declaration(quick=QuickExample(...)))")
        if (
            declaration.is_private(typed_settings(compose_config([f"strategy={name}"])))
            and name not in AUDITS
        ):
            lacks.append("an end-to-end audit (PRIVACY_AUDIT in tests/test_<name>.py)")
        for group in COMPARISONS:
            if (group in declaration.comparisons) != (name in arms[group]):
                lacks.append(f"conf/{group}/{name}.yaml and comparisons={declaration.comparisons} disagree")
        if lacks:
            missing[name] = lacks
    assert missing == {}
    assert not (conf / "examples").exists()  # quick examples live in the declarations


#: The modules that compose, validate and read the configuration (and the entry points that compose a
#: job); everything else reads the typed :class:`fl_app.config.settings.RunSettings`.
CONFIG_MODULES = {
    "fl_app/config/compose.py",
    "fl_app/config/validation.py",
    "fl_app/config/checks.py",
    "fl_app/config/text_checks.py",
    "fl_app/config/settings.py",
    "fl_app/config/overrides.py",
    "fl_app/config/fingerprint.py",
    "fl_app/config/conf_dir.py",
    "fl_app/engine/hydra.py",
    "fl_app/__main__.py",
    "fl_app/api.py",
    "fl_app/run/resume.py",
    "fl_app/run/sweep_resume.py",
    "strategies/settings.py",
}


def raw_config_reads(path: Path) -> list[str]:
    """Reads of a composed configuration in ``path``: ``cfg.x``, ``cfg[x]``, ``self.cfg...``, ``f(cfg)``."""
    import ast

    def is_cfg(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id == "cfg") or (
            isinstance(node, ast.Attribute) and node.attr == "cfg"
        )

    reads = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute | ast.Subscript) and is_cfg(node.value):
            reads.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and any(is_cfg(argument) for argument in node.args):
            reads.append(f"{node.lineno}: {ast.unparse(node)[:80]}")
        elif isinstance(node, ast.Name) and node.id == "DictConfig":
            reads.append(f"{node.lineno}: DictConfig")
    return reads


def test_nothing_reads_the_raw_configuration_after_validation(tmp_path):
    """Past composition and validation, code reads typed settings, never the ``DictConfig``."""
    reads = {
        path.relative_to(ROOT).as_posix(): found
        for folder in ("fl_app", "strategies", "clients")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path.relative_to(ROOT).as_posix() not in CONFIG_MODULES and (found := raw_config_reads(path))
    }
    assert reads == {}
    probe = tmp_path / "probe.py"
    probe.write_text("def f(run):\n    return run.cfg.lr, cfg['x'], g(cfg)\n")
    assert len(raw_config_reads(probe)) == 3
    assert all((ROOT / module).exists() for module in CONFIG_MODULES)


def test_the_suite_hands_out_its_longest_modules_first() -> None:
    """Modules by measured seconds, longest first; an unknown one by the median; a module's order kept."""
    from types import SimpleNamespace

    from conftest import MODULE_SECONDS, longest_modules_first

    items = [
        SimpleNamespace(nodeid=f"tests/{m}.py::t{i}")
        for m, i in [("a", 1), ("b", 1), ("a", 2), ("new", 1), ("c", 1)]
    ]
    seconds = {"tests/a.py": 5.0, "tests/b.py": 50.0, "tests/c.py": 20.0, "tests/d.py": 1.0}  # median 12.5
    ordered = [item.nodeid for item in longest_modules_first(items, seconds)]  # type: ignore[arg-type]
    assert ordered == [
        "tests/b.py::t1",
        "tests/c.py::t1",
        "tests/new.py::t1",
        "tests/a.py::t1",
        "tests/a.py::t2",
    ]
    recorded = json.loads(MODULE_SECONDS.read_text())
    assert all((ROOT / module).is_file() for module in recorded), "regenerate tests/module_seconds.json"
