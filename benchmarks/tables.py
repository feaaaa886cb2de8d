"""Loading runs and writing Markdown tables: what the per-algorithm benchmark scripts share.

The scripts (``nbafl.py``, ``privatekt.py``, ``dpfl_bnn.py``, ``kd_dp.py``, ``laplace_eval.py``)
read the runs' ``results.json`` through :func:`completed_runs` (the checks of
:func:`fl_app.report.sweep.load_runs`), format numbers with :func:`fmt`, write tables with
:func:`markdown_table` and keep the generated block of their documentation page up to date with
:func:`replace_generated_block`.

A script imports this module as ``benchmarks.tables`` after putting the repository root first on
``sys.path``: opacus installs an unrelated top-level ``benchmarks`` package, which would otherwise
be found instead of this folder.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from fl_app.report.sweep import load_runs
from fl_app.run.lifecycle import COMPLETED_STATUSES as COMPLETED

#: The statuses of a run whose every round ran (``fl_app/run/lifecycle.py``).

#: One run's ``results.json`` as a dict; :func:`completed_runs` adds ``"_path"``.
Run = dict[str, Any]


def completed_runs(root: Path) -> list[Run]:
    """The runs in ``results.json`` files at or below ``root`` whose every round ran.

    That is ``status`` ``completed`` or ``completed_with_failures`` (some clients failed, within the
    run's tolerance: the tables' failure columns show how many).

    Parameters
    ----------
    root : Path
        A run directory, or a folder of them at any depth. A missing folder has no runs.

    Returns
    -------
    list[Run]
        The runs' results, sorted by path, each with ``"_path"``: its run directory as a string.

    Notes
    -----
    A file that :func:`fl_app.report.sweep.load_runs` rejects (unreadable, or without the fields of the
    results contract) is skipped with one line on stderr, never silently. Runs that did not complete
    (``failed``, ``interrupted``) are left out without a message: a sweep still running has them.
    A script that needs runs at a fixed depth or with given folder names filters the result by
    ``"_path"``.

    """
    if not root.is_dir():
        return []
    runs, problems = load_runs(root)
    for problem in problems:
        print(f"skipped {problem}", file=sys.stderr)
    completed = []
    for run in runs:
        if run.results.get("status") in COMPLETED:
            run.results["_path"] = str(run.path.parent)
            completed.append(run.results)
    return completed


def series(run: Run, key: str) -> tuple[list[int], list[float]]:
    """Round numbers and values of ``rounds[].key`` where it is not null; round 0 is ``initial[key]``.

    Parameters
    ----------
    run : Run
        One run's results.
    key : str
        A per-round metric that ``initial`` has too, e.g. ``"accuracy"`` or ``"loss"``.

    Returns
    -------
    tuple[list[int], list[float]]
        The rounds (0 first) and the values, for plotting one curve.

    """
    rounds = [r for r in run["rounds"] if r.get(key) is not None]
    return [0] + [r["round"] for r in rounds], [run["initial"][key]] + [r[key] for r in rounds]


def fmt(
    value: object,
    digits: int = 4,
    missing: str = "-",
    *,
    nan: str | None = None,
    fixed_below: float | None = None,
) -> str:
    """One number for a table cell.

    Parameters
    ----------
    value : object
        A float is written with ``digits`` significant digits (``f"{value:.{digits}g}"``), anything
        else (an int, a string) with ``str``.
    digits : int
        Significant digits of a float.
    missing : str
        The text for None (and, unless ``nan`` says otherwise, for NaN).
    nan : str or None
        The text for NaN, if it differs from ``missing``.
    fixed_below : float or None
        If given, numbers (ints included) of magnitude below it get ``digits`` decimal places instead
        (``0.4530``, ``5.0000``: a column of accuracies lines up); larger ones keep ``digits``
        significant digits.

    Returns
    -------
    str
        The cell's text.

    """
    if value is None:
        return missing
    if isinstance(value, float) and math.isnan(value):
        return missing if nan is None else nan
    if fixed_below is not None and isinstance(value, int | float) and not isinstance(value, bool):
        value = float(value)
        if abs(value) < fixed_below:
            return f"{value:.{digits}f}"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """The lines of a Markdown table.

    Parameters
    ----------
    header : Sequence[str]
        The column titles.
    rows : Iterable[Sequence[object]]
        The rows' cells, each written with ``str`` (format numbers with :func:`fmt` first).

    Returns
    -------
    list[str]
        ``| a | b |``, ``|---|---|`` and one ``| x | y |`` line per row.

    """

    def line(cells: Sequence[object]) -> str:
        return "| " + " | ".join(str(cell) for cell in cells) + " |"

    return [line(header), "|" + "---|" * len(header), *(line(row) for row in rows)]


def with_generated_block(text: str, content: str | Sequence[str], *, begin: str, end: str) -> str | None:
    """``text`` with the part between its first ``begin`` marker and the ``end`` marker after it replaced.

    The markers stay, each on its own line: the result is everything up to and including ``begin``, a
    newline, ``content``, a newline if ``content`` does not end with one, then ``end`` and everything
    after it, unchanged.

    Parameters
    ----------
    text : str
        A Markdown page's text.
    content : str or Sequence[str]
        The new block: a text, or lines (joined with newlines).
    begin, end : str
        The markers, e.g. ``"<!-- BEGIN GENERATED -->"`` and ``"<!-- END GENERATED -->"``.

    Returns
    -------
    str or None
        The new text, or None if ``text`` lacks either marker.

    """
    head, found, rest = text.partition(begin)
    if not found or end not in rest:
        return None
    _, _, tail = rest.partition(end)
    body = content if isinstance(content, str) else "\n".join(content)
    if not body.endswith("\n"):
        body += "\n"
    return f"{head}{begin}\n{body}{end}{tail}"


def replace_generated_block(page: Path, content: str | Sequence[str], *, begin: str, end: str) -> bool:
    """Rewrite ``page`` with its generated block replaced (:func:`with_generated_block`).

    Everything outside the block stays byte for byte.

    Parameters
    ----------
    page : Path
        The Markdown page.
    content : str or Sequence[str]
        The new block: a text, or lines (joined with newlines).
    begin, end : str
        The markers.

    Returns
    -------
    bool
        True if the page was rewritten; False if it does not exist or lacks either marker (a caller
        for which the block is required reports that).

    """
    if not page.is_file():
        return False
    text = page.read_bytes().decode("utf-8")  # not read_text: its newline translation would rewrite \r\n
    new = with_generated_block(text, content, begin=begin, end=end)
    if new is None:
        return False
    page.write_bytes(new.encode())
    return True
