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
