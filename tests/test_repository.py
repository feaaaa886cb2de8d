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
