"""Which code a run ran: the package version and, in a git checkout, the commit and whether it was edited.

A comparison's rows are comparable only if they come from one code version. Every
``results.json`` records :func:`code_version` under ``"code"``, and ``python -m fl_app.report`` says
below its tables which versions its rows come from. A deployed app (a FAB installed by a SuperLink)
has no git checkout: its record is the package version alone.
"""

from __future__ import annotations

import subprocess
from functools import cache
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: The folders whose edits change what a run computes (the dirty flag looks at these only).
CODE_PATHS: tuple[str, ...] = ("fl_app", "strategies", "clients", "conf")
GIT_TIMEOUT_S = 5.0


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=GIT_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@cache
def code_version() -> dict[str, Any]:
    """``{"package": str | None, "commit": str | None, "dirty": bool | None}`` of the running code.

    ``commit`` is the checked-out commit (None outside a git checkout, or without git); ``dirty`` is
    whether tracked files under :data:`CODE_PATHS` differ from it (None when ``commit`` is None).
    """
    try:
        package = metadata.version("dpfl")
    except metadata.PackageNotFoundError:
        package = None
    commit = _git("rev-parse", "HEAD") if (ROOT / ".git").exists() else None
    dirty = None
    if commit is not None:
        changes = _git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS)
        dirty = None if changes is None else bool(changes)
    return {"package": package, "commit": commit, "dirty": dirty}


def describe(version: dict[str, Any] | None) -> str:
    """Short text of a recorded version: ``abc1234``, ``abc1234 (edited)``, ``dpfl 0.1.0`` or ``unknown``."""
    if not version:
        return "unknown"
    if version.get("commit"):
        return str(version["commit"])[:7] + (" (edited)" if version.get("dirty") else "")
    return f"dpfl {version['package']}" if version.get("package") else "unknown"
