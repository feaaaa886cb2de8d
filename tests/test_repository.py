"""The repository's promises: CI runs the README's test command; required files exist."""

from __future__ import annotations

import re
from pathlib import Path

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
        if relative.startswith((".venv/", "build/")):
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
CORE = (
    "fl_app/privacy",
    "fl_app/data",
    "fl_app/models.py",
    "fl_app/model_spec.py",
    "fl_app/training.py",
    "fl_app/bits.py",
    "fl_app/knowledge.py",
    "fl_app/clustering.py",
    "fl_app/keys.py",
)
SHELL = (
    "fl_app.__main__",
    "fl_app.api",
    "fl_app.checkpoint",
    "fl_app.cli",
    "fl_app.client_app",
    "fl_app.config",
    "fl_app.flower_engine",
    "fl_app.hydra_adapter",
    "fl_app.lifecycle",
    "fl_app.metering",
    "fl_app.report",
    "fl_app.results",
    "fl_app.resume",
    "fl_app.roster",
    "fl_app.round_loop",
    "fl_app.run",
    "fl_app.run_context",
    "fl_app.server_app",
    "fl_app.simulation",
    "fl_app.tracking",
    "fl_app.validation",
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
    assert len(files) > 10
    arrows = [
        f"{file.relative_to(ROOT)} imports {name}"
        for file in files
        for name in imported_modules(file)
        if any(name == shell or name.startswith(f"{shell}.") for shell in SHELL)
    ]
    assert arrows == []
    # the check sees function-level imports too (the way an arrow back up usually sneaks in)
    assert "fl_app.simulation" in imported_modules(ROOT / "fl_app" / "api.py")  # inside run_experiment


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


#: The modules of ``strategies/`` every algorithm may import (the base and its parts); the rest
#: are algorithms, one per module, and none imports another.
STRATEGY_PLUMBING = {"base", "arrays", "cohorts", "replies", "reporting", "settings", "stage"}
#: Longest module allowed in ``strategies/`` and ``clients/`` (an algorithm, not its boilerplate).
MAX_MODULE_LINES = 440


def test_algorithm_modules_are_small_and_no_strategy_imports_another():
    modules = sorted((ROOT / "strategies").glob("*.py")) + sorted((ROOT / "clients").glob("*.py"))
    too_long = [
        f"{m.relative_to(ROOT)}: {n} lines"
        for m in modules
        if (n := len(m.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert too_long == []
    algorithms = {m.stem for m in (ROOT / "strategies").glob("*.py")} - STRATEGY_PLUMBING - {"__init__"}
    assert {"privatekt", "kd_dp", "nbafl", "dpfl_bnn", "dp_ftrl"} <= algorithms
    arrows = [
        f"strategies/{m.stem}.py imports {name}"
        for m in sorted((ROOT / "strategies").glob("*.py"))
        for name in imported_modules(m)
        if name.startswith("strategies.") and name.split(".")[1] in algorithms
    ]
    assert arrows == []
