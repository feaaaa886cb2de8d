"""Build ``BENCHMARKS.md`` (an index), the pages' report tables and the README's headline table.

Every number in the benchmark pages comes from a benchmark script or ``python -m fl_app.report``,
which wrote it from the runs' ``results.json`` files:

* ``docs/benchmarks/platform.md``: ``python benchmarks/overhead.py section ...``;
* ``docs/benchmarks/compare_all/report.md`` (+ its PNGs): ``python -m fl_app.report ... --out
  docs/benchmarks/compare_all``; ``docs/benchmarks/compare_all.md`` holds the commands and the
  reading of that table;
* ``docs/benchmarks/cross_device.md`` with ``docs/benchmarks/cross_device/report.md``:
  ``python -m fl_app.report docs/benchmarks/cross_device/runs --out docs/benchmarks/cross_device``
  (the central arms' command and the reference, kept with ``benchmarks/keep_runs.py``), and its second
  table, ``docs/benchmarks/cross_device/untrusted/report.md`` (the distributed and local arms' command,
  kept in ``cross_device/untrusted/runs``), and ``docs/benchmarks/cross_device/blt_check/report.md``
  (banded MF and DP-FTRL again on DP-BLT's code version, kept in ``cross_device/blt_check/runs``), and
  ``docs/benchmarks/cross_device/bandmf_server_lr1/report.md`` (banded MF's rows under its earlier rule,
  DP-FedAvg's server step, kept in ``cross_device/bandmf_server_lr1/runs``);
* ``docs/benchmarks/record_level.md`` with ``docs/benchmarks/record_level/report.md``:
  ``python -m fl_app.report <sweep dir> --out docs/benchmarks/record_level``;
* ``docs/benchmarks/empirical_privacy.md`` with ``docs/benchmarks/empirical_privacy/report.md``:
  ``python -m fl_app.report multirun/canaries --out docs/benchmarks/empirical_privacy``;
* ``docs/benchmarks/deployment_load.md``: ``python benchmarks/serverapp_storm.py ...``;
* ``docs/benchmarks/startup.md``: ``python benchmarks/startup.py breakdown|sweep|population|commands ...``;
* ``docs/benchmarks/pfl_research.md``: ``python -P benchmarks/pfl_compare.py table --out
  docs/benchmarks/pfl_research --write-doc``;
* ``docs/benchmarks/pfl_crosscheck.md``: ``python -P benchmarks/pfl_crosscheck.py --full`` (its record
  and plots kept in ``docs/benchmarks/pfl_crosscheck/``);
* ``docs/benchmarks/pfl_privacy.md``: ``python -P benchmarks/pfl_privacy_check.py --write-doc``;
* ``docs/benchmarks/published_numbers.md``: ``python -P benchmarks/published_numbers.py --write-doc``;
* ``docs/benchmarks/distributed_dp.md``: ``python -P benchmarks/distributed_dp.py table --write-doc``;
* ``docs/benchmarks/text.md``: ``python -P benchmarks/text_memory.py``, ``benchmarks/text_round.py`` and
  ``benchmarks/text_presets.py``;
* ``docs/benchmarks/<algorithm>.md``: each algorithm's benchmark script.

This script types no number either. It does three things:

1. **The pages' report tables.** A page marks where a ``python -m fl_app.report`` table of its own
   goes: ``<!-- REPORT -->`` for ``docs/benchmarks/<page>/report.md``, ``<!-- REPORT:sub -->`` for
   ``docs/benchmarks/<page>/sub/report.md``. The first build turns the marker into a block
   (``<!-- REPORT:BEGIN -->`` ... ``<!-- REPORT:END -->``, or ``<!-- REPORT:sub:BEGIN -->`` ...)
   holding a copy of that table, and every build after it refreshes the copy.
2. **``BENCHMARKS.md``**: an index, one entry per page (:data:`ORDER`: its title, a one-line summary
   and the link; a page not listed there is listed under "Other pages", never left out), the
   history pages of ``docs/benchmarks/history/``, and the headline table.
3. **The headline table** (:func:`headline_table`): the cross-device comparison's rows at epsilon 8
   per client, tuned arms and the non-private reference, cut from its two ``report.md`` tables,
   between the README's ``<!-- HEADLINE:BEGIN -->`` and ``<!-- HEADLINE:END -->`` (and in the index).
4. **The README's first run** (:func:`benchmarks.quick_example.readme_block`): DP-FedAvg's quick
   example as the kept run in ``docs/benchmarks/quick_example/`` printed it, trimmed, between
   ``<!-- QUICK_EXAMPLE:BEGIN -->`` and ``<!-- QUICK_EXAMPLE:END -->``.

Usage (from the repository root)::

    python -P benchmarks/build_docs.py [--from-runs] [--check]

``--from-runs`` first regenerates every table made from runs kept in the repository
(:data:`KEPT_RUN_PAGES`: ``python -m fl_app.report <page>/runs --out <page>``, then the pages' own
tables and plots of those runs), so that one command rebuilds every table from the recorded runs.
``--check`` writes nothing and exits with status 1 if any file is not what this script generates.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks.tables, with or without -P

from benchmarks.quick_example import readme_block as quick_example_block
from benchmarks.tables import with_generated_block

ROOT = Path(__file__).resolve().parent.parent
PAGES = ROOT / "docs" / "benchmarks"
HISTORY = PAGES / "history"
#: The index: groups of (page, one-line summary), in BENCHMARKS.md order. A listed page that is
#: missing is named as missing; a page that is not listed is still indexed (under "Other pages").
ORDER: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    (
        "Comparisons at an equal budget",
        (
            (
                "cross_device",
                "**The comparison**: every client-level arm at epsilon 1, 2, 4 and 8 per client in the "
                "cross-device regime (N = 1000), the server trusted (central arms, tuned and untuned) and "
                "not trusted (distributed and local DP); its first edition and the PLD re-run as history.",
            ),
            (
                "record_level",
                "KD-DP, federated DP-SGD and NbAFL in the same shape, per training example: a table of "
                "their own, tuned and untuned rows, how the rules were chosen.",
            ),
            (
                "banded_mf",
                "The central arms' earlier run, on an earlier commit, with the tuning of banded MF and the "
                "arithmetic of its band choice; its noise state and checkpoint at the word LSTM's size "
                "beside BLT's, and the accountant at Stack Overflow's population.",
            ),
            (
                "distributed_dp",
                "SecAgg+ with Skellam noise beside central DP-FedAvg on the same public schedule, per bit "
                "width; masks from the whole key, before and after.",
            ),
            (
                "compare_all",
                "The quick demo: every training algorithm at an equal budget on 20 clients, where the "
                "client-level arms sit near chance.",
            ),
            (
                "empirical_privacy",
                "Canary estimates of epsilon beside the accountant's for every supporting strategy, and "
                "how much under-noising the estimate catches.",
            ),
        ),
    ),
    (
        "Each algorithm against its source",
        (
            ("nbafl", "NbAFL's findings (epsilon, N, T, K-random scheduling) on MNIST and Fashion-MNIST."),
            (
                "privatekt",
                "PrivateKT: the authors' demo as they run it, what a demo round costs, and the earlier "
                "MLP benchmarks (per-round reading, equal total budget, self-training probes).",
            ),
            (
                "dpfl_bnn",
                "DPFL-BNN in its paper's setting: accuracy per gamma, upload size, both accountings.",
            ),
            (
                "kd_dp",
                "KD-DP against DP-FedAvg, NbAFL and federated DP-SGD at equal record-level budgets, and in "
                "its paper's population (a few large-data clients, many small ones).",
            ),
            (
                "laplace_eval",
                "Does the silhouette score of Laplace-protected softmax vectors follow the clear one, and "
                "down to which epsilon.",
            ),
            (
                "blt",
                "BLT-correlated DP-FTRL against jax_privacy 2.0.0: the optimised BLT's loss and max error, "
                "its sensitivity, streaming noise and epsilon, in 10 settings up to so_blt's 2052 rounds.",
            ),
        ),
    ),
    (
        "Speed and the platform",
        (
            (
                "platform",
                "The main job over seeds, and what Flower + Ray cost per round against a plain PyTorch "
                "loop, cross-silo and cross-device, with a profile of the cross-device round.",
            ),
            (
                "startup",
                "What a run costs besides its rounds: start-up phases, a sweep, populations up to 100,000 "
                "clients, the main job and quick examples as whole commands.",
            ),
            ("partition_cache", "Start-up and memory with and without the partition cache."),
            (
                "calibration_cache",
                "A noise calibration searched, and read back from the disk cache by the next process.",
            ),
            ("hf_loader", "A Hugging Face data set of 100,000 rows, 3,500 users: first run and cache."),
            (
                "text",
                "Stack Overflow's shape (342,477 users): peak memory, the word LSTM's round at 100 clients "
                "(loop and cohort trainer), and the published text presets checked and run for one round.",
            ),
            (
                "pfl_research",
                "The same cross-device DP-FedAvg task in Apple's pfl-research and in dpfl, interleaved: "
                "round time, whole command, accuracy, the calibrated noise.",
            ),
            (
                "pfl_crosscheck",
                "dpfl against pfl-research's own code on the field's tasks: the same Stack Overflow token "
                "ids (and TFF's), networks, metric, epsilons, learning curves and the cost of a "
                "language-model round.",
            ),
            (
                "pfl_privacy",
                "dpfl's accountant beside pfl-research's on DP-FedAvg, adaptive clipping and banded MF "
                "(pfl's LM and image configurations), sampling as each code samples, and the large-cohort "
                "convention (strategy.noise_cohort_size).",
            ),
            (
                "published_numbers",
                "The published numbers beside the text presets (DP-FTRL's README and figures, the "
                "multi-epoch MF figure) and the Gboard deployments' epsilons, with dpfl's accountant on "
                "the same parameters.",
            ),
            (
                "cohort_training",
                "A cohort as one torch.func computation against the per-client loop, on the CPU and "
                "on an NVIDIA H200, a torch-only DP-FedAvg round on it, and the engine's "
                "simulation.vectorise.",
            ),
            (
                "engine_gpu",
                "dpfl's whole engine on one NVIDIA H200: rounds of 100 and 1000 clients, cohort against "
                "loop, where a round's time goes (host and GPU), and why the per-message engine misses "
                "the goals of 0.1 s and 30 ms a round.",
            ),
            (
                "bulk",
                "A cohort in bulk (one message per worker): the engine's work per client at 1000 clients "
                "per round, and the 1000-client MLP round on 2 cores against the tight loop.",
            ),
            (
                "deployment_load",
                "Many runs submitted to a local deployment on a busy machine: the ServerApp launch gate.",
            ),
            ("blas_threads", "Why every process starts with one BLAS thread."),
            (
                "shamir_combine",
                "SecAgg+ unmasking: Flower's Shamir recombination against dpfl's.",
            ),
            (
                "inline_backend",
                "simulation.backend=inline against Ray: wall time and CPU with the clients in the driver.",
            ),
            ("suite", "The test suite's wall and CPU time per number of pytest-xdist processes."),
        ),
    ),
)
HEADLINE_BEGIN, HEADLINE_END = "<!-- HEADLINE:BEGIN -->", "<!-- HEADLINE:END -->"
QUICK_BEGIN, QUICK_END = "<!-- QUICK_EXAMPLE:BEGIN -->", "<!-- QUICK_EXAMPLE:END -->"
#: The reports the headline table is cut from (the two tables of the cross-device comparison).
HEADLINE_REPORTS = (PAGES / "cross_device" / "report.md", PAGES / "cross_device" / "untrusted" / "report.md")
#: The budget of the headline table's private rows.
HEADLINE_EPSILON = "8"
#: Pages whose table ``python -m fl_app.report`` makes from the runs kept in ``<page>/runs``
#: (benchmarks/keep_runs.py), with the number of jobs of the commands that made them (one command per
#: page but the central arms': the preset's 84 jobs and the reference's 3 on a53bc25, DP-BLT's 24 on cf70b82,
#: banded MF's 12 on 7979a94 after its rule was tuned over DP-BLT's grid; its earlier 12 kept in
#: ``cross_device/bandmf_server_lr1``).
KEPT_RUN_PAGES = {
    "cross_device": 123,
    "cross_device/untrusted": 36,
    "cross_device/blt_check": 12,
    "cross_device/bandmf_server_lr1": 12,
    "banded_mf": 36,
    "record_level": 36,
    "record_level/untuned": 24,
    "kd_dp/regime": 18,
    "kd_dp/regime_skew": 12,
    "kd_dp/regime_full": 3,
    "kd_dp/regime_tuned": 12,
}
HEADER = """# Benchmarks

An index, generated by `python -P benchmarks/build_docs.py`: every number lives in its page in
[`docs/benchmarks/`](docs/benchmarks/), which the benchmark scripts and `python -m fl_app.report`
write from the runs' `results.json` files, with the exact commands. The machine: 2 CPU cores,
24 GiB, no GPU, shared with other work while most of these runs were made, so wall times are noisy;
compare ratios measured in one run.
"""

#: ``<!-- REPORT -->`` or ``<!-- REPORT:sub -->``: where a page's report table goes (first build).
REPORT_MARKER = re.compile(r"<!-- REPORT(?::((?!BEGIN -->|END -->)[\w/]+))? -->")
#: ``<!-- REPORT[:sub]:BEGIN -->``: a report table's block in a page.
REPORT_BLOCK = re.compile(r"<!-- REPORT(?::([\w/]+?))?:BEGIN -->")


def report_markers(sub: str | None) -> tuple[str, str]:
    """The begin and end markers of the block holding report ``sub`` (None: the page's own)."""
    name = f"REPORT:{sub}" if sub else "REPORT"
    return f"<!-- {name}:BEGIN -->", f"<!-- {name}:END -->"


def page_text(page: Path, missing: list[str]) -> str:
    """``page`` with each report block (or first-build marker) holding its report's current table."""
    text = page.read_text()
    folder = page.with_suffix("")
    subs = [m.group(1) for pattern in (REPORT_MARKER, REPORT_BLOCK) for m in pattern.finditer(text)]
    for sub in subs:
        report = folder / (sub or "") / "report.md"
        if not report.is_file():
            missing.append(report.relative_to(ROOT).as_posix())
            continue
        table = relinked(report.read_text().strip(), report.parent.relative_to(page.parent).as_posix())
        begin, end = report_markers(sub)
        bare = f"<!-- REPORT:{sub} -->" if sub else "<!-- REPORT -->"
        if bare in text:
            text = text.replace(bare, f"{begin}\n{table}\n{end}", 1)
        else:
            updated = with_generated_block(text, table, begin=begin, end=end)
            if updated is None:
                raise SystemExit(f"{page.relative_to(ROOT)}: {begin} has no {end}")
            text = updated
    return text


def relinked(text: str, folder: str) -> str:
    """``text`` (a report's Markdown) with its relative links made relative to the page it is copied into."""
    return re.sub(r"\]\((?!https?://|/|#)([^)]+)\)", lambda m: f"]({folder}/{m.group(1)})", text)


def title_of(page: Path) -> str:
    """The page's first level-1 heading (its file name when it has none)."""
    for line in page.read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return page.stem


def table_rows(report: str) -> list[tuple[str, dict[str, str]]]:
    """Each table row of an ``fl_app.report`` table with the heading of its section (the privacy unit)."""
    rows, heading, columns = [], "", []
    for line in report.splitlines():
        if line.startswith("#"):
            heading, columns = line.lstrip("#").strip(), []
        elif line.startswith("|") and not line.startswith("|---"):
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if not columns:
                columns = cells
            else:
                rows.append((heading, dict(zip(columns, cells, strict=True))))
    return rows


def trust(heading: str) -> str:
    """Whom a row's epsilon holds against, from its section heading (``fl_app.report.sweep``'s unit)."""
    if "distributed DP" in heading:
        return "distributed: the server too (SecAgg+)"
    if "local DP" in heading:
        return "local: the server too"
    if "central DP" in heading:
        return "central: model observers, not the server"
    return "not private"


def headline_table() -> list[str]:
    """The cross-device comparison at epsilon 8 per client: tuned arms, then the non-private reference."""
    private, reference = [], []
    for report in HEADLINE_REPORTS:
        if not report.is_file():
            return [f"(not yet measured: `{report.relative_to(ROOT).as_posix()}` is missing)"]
        for heading, row in table_rows(report.read_text()):
            if "(untuned)" in row["algorithm"]:
                continue
            line = (
                f"| `{row['algorithm']}` | {trust(heading)} | {row['epsilon (cumulative)']} | "
                f"{row['final accuracy (mean ± std)']} | {row['T']} |"
            )
            if row["target epsilon"] == HEADLINE_EPSILON:
                private.append(line)
            elif row["target epsilon"] == "-":
                reference.append(line)
    header = [
        "| `strategy=` | epsilon holds against | epsilon per client | test accuracy (mean ± std, 3 seeds) "
        "| rounds |",
        "|---|---|---|---|---|",
    ]
    return header + private + reference


def benchmarks_text(missing: list[str]) -> str:
    """The whole ``BENCHMARKS.md``: the index of the pages, the history, the headline table."""
    parts, listed = [HEADER.strip()], {"history"}
    parts.append(
        "## Headline: the cross-device comparison at epsilon 8\n\n"
        "Fashion-MNIST, Dirichlet(0.5) over N = 1000 clients, the MLP, delta 1e-5; each arm's settings "
        "chosen on a validation split ([the page](docs/benchmarks/cross_device.md), which has every "
        "budget, the untuned rows and the commands):\n\n" + "\n".join(headline_table())
    )
    for group, entries in ORDER:
        lines = [f"## {group}", ""]
        for name, summary in entries:
            listed.add(name)
            page = PAGES / f"{name}.md"
            if not page.is_file():
                missing.append(page.relative_to(ROOT).as_posix())
                continue
            lines.append(f"- [{title_of(page)}](docs/benchmarks/{name}.md): {summary}")
        parts.append("\n".join(lines))
    others = sorted(p for p in PAGES.glob("*.md") if p.stem not in listed)
    if others:
        parts.append(
            "## Other pages\n\n" + "\n".join(f"- [{title_of(p)}](docs/benchmarks/{p.name})" for p in others)
        )
    history = sorted(HISTORY.glob("*.md")) if HISTORY.is_dir() else []
    if history:
        parts.append(
            "## History\n\nWhat earlier versions measured or changed, kept as it was written (some pages "
            "above also keep their own earlier editions, e.g. the cross-device comparison's first):\n\n"
            + "\n".join(f"- [{title_of(p)}](docs/benchmarks/history/{p.name})" for p in history)
        )
    if missing:
        parts.append(
            "## Not yet measured\n\n" + "\n".join(f"- `{m}` is missing" for m in sorted(set(missing)))
        )
    return "\n\n".join(parts) + "\n"


def readme_text(readme: str) -> str:
    """The README with the headline table and the first run's output between their markers."""
    text = with_generated_block(readme, headline_table(), begin=HEADLINE_BEGIN, end=HEADLINE_END)
    if text is None:
        raise SystemExit(f"README.md: the markers {HEADLINE_BEGIN} and {HEADLINE_END} are missing")
    text = with_generated_block(text, quick_example_block(), begin=QUICK_BEGIN, end=QUICK_END)
    if text is None:
        raise SystemExit(f"README.md: the markers {QUICK_BEGIN} and {QUICK_END} are missing")
    return text


def rebuild_from_runs() -> None:
    """Regenerate every page made from kept runs: its report, then the pages' own tables and plots."""
    from benchmarks import banded_mf, kd_dp_regime
    from fl_app.report import sweep as report

    with contextlib.chdir(ROOT):  # report.csv names the runs by path: relative, wherever the clone is
        for page in KEPT_RUN_PAGES:
            runs = PAGES.relative_to(ROOT) / page / "runs"
            if not runs.is_dir():
                raise SystemExit(f"error: {runs} is missing: no kept runs to rebuild from")
            if report.main([str(runs), "--out", str(runs.parent)]) != 0:
                raise SystemExit(f"error: python -m fl_app.report failed on {runs}")
    for page in ("cross_device", "banded_mf"):  # the central arms on one axis
        if banded_mf.plot(PAGES / page / "runs", PAGES / page / "central_arms.png") != 0:
            raise SystemExit(f"error: the central arms' plot of {page} failed")
    if banded_mf.write_gaps(PAGES / "cross_device" / "runs", PAGES / "cross_device.md") != 0:
        raise SystemExit("error: the central arms' table of gaps failed")
    if kd_dp_regime.main(["--runs", str(PAGES / "kd_dp"), "--doc", str(PAGES / "kd_dp.md")]) != 0:
        raise SystemExit("error: the KD-DP regime table failed")


def outputs() -> dict[Path, str]:
    """Every file this script writes, with its text."""
    missing: list[str] = []
    files = {page: page_text(page, missing) for page in sorted(PAGES.glob("*.md"))}
    files[ROOT / "BENCHMARKS.md"] = benchmarks_text(missing)
    files[ROOT / "README.md"] = readme_text((ROOT / "README.md").read_text())
    return files


def main() -> int:
    """Write (or with ``--check`` compare) ``BENCHMARKS.md``, the pages' tables and the README's."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    parser.add_argument(
        "--from-runs", action="store_true", help="first regenerate the tables made from kept runs"
    )
    args = parser.parse_args()
    if args.from_runs:
        rebuild_from_runs()
    files = outputs()
    stale = [path for path, text in files.items() if not path.is_file() or path.read_text() != text]
    names = [path.relative_to(ROOT).as_posix() for path in stale]
    if args.check:
        for name in names:
            print(f"{name} is not what benchmarks/build_docs.py generates", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(files[path])
    print("wrote " + (", ".join(names) if names else "nothing (every file is current)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
