"""The documents cite files that exist, and stay short enough to read.

Every Markdown link of README.md, BENCHMARKS.md and docs/**/*.md (the kept runs below
docs/benchmarks/**/runs/ excepted) must resolve, against the citing file, to a file or folder of the
repository, and its anchor, if it names one in a Markdown file, to a heading there. Every backticked
path under one of the repository's folders (``fl_app/x.py``, ``conf/strategy/x.yaml``, ``docs/...``)
must exist from the repository root or from the citing file's folder. URLs, anchors within the page and
placeholders (``strategies/<name>.py``, ``{a,b}``) are not checked; a glob (``startup/*.json``) must match
something. A page that proposes files (a worked example of a new algorithm) names them in a comment,
``<!-- docs-check: proposed files: strategies/fedprox.py ... -->``, and only those are exempt.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: Folders whose paths a document may cite in backticks (checked), as the repository's top level has them.
CITED_FOLDERS = ("fl_app", "strategies", "clients", "conf", "docs", "tests", "benchmarks", "scripts", ".ci")
#: The documents' length limits (lines): a README to read in one sitting, a benchmark index.
README_LINES, BENCHMARKS_LINES = 220, 160

FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.S | re.M)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE = re.compile(r"`([^`\n]+)`")
PATH_TOKEN = re.compile(r"(?:\.ci|[a-z_]+)/[\w./*<>{},@=+-]*")
PROPOSED = re.compile(r"<!-- docs-check: proposed files:([^>]*)-->")


def documents(root: Path = ROOT) -> list[Path]:
    """README.md, BENCHMARKS.md and every page below docs/ except the kept runs' files."""
    pages = [root / "README.md", root / "BENCHMARKS.md"]
    pages += sorted(p for p in (root / "docs").rglob("*.md") if "runs" not in p.relative_to(root).parts)
    return [p for p in pages if p.is_file()]


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"<[^>]+>", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a Markdown page (repeated headings get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def placeholder(target: str) -> bool:
    """A path with a placeholder in it: ``<name>``, ``{a,b}``, ``...``."""
    return any(mark in target for mark in ("<", ">", "{", "}", "..."))


def exists(path: Path) -> bool:
    """The file or folder exists (a glob: matches something)."""
    if "*" in path.as_posix():
        anchor = Path(path.anchor)
        return any(anchor.glob(path.as_posix().removeprefix(path.anchor)))
    return path.exists()


def broken_citations(page: Path, root: Path = ROOT) -> list[str]:
    """The citations of ``page`` that resolve to nothing, one line each (``file:line: what``)."""
    text = page.read_text()
    prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    name = page.relative_to(root).as_posix()
    proposed = {path for match in PROPOSED.finditer(text) for path in match.group(1).split()}
    problems = []

    def line_of(position: int) -> int:
        return prose.count("\n", 0, position) + 1

    for match in LINK.finditer(prose):
        target = match.group(1)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#") or placeholder(target):
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (page.parent / file_part).resolve()
        where = f"{name}:{line_of(match.start())}"
        if (
            resolved.is_relative_to(root.resolve())
            and resolved.relative_to(root.resolve()).as_posix() in proposed
        ):
            continue
        if not exists(resolved):
            problems.append(f"{where}: link to {target}, which does not exist")
        elif anchor and resolved.suffix == ".md" and resolved.is_file() and anchor not in anchors(resolved):
            problems.append(f"{where}: link to {target}: {file_part} has no heading #{anchor}")
    for span in CODE.finditer(prose):
        for token in PATH_TOKEN.findall(span.group(1)):
            path = token.rstrip(".,;:)'\"").split("#")[0]
            path = re.sub(r":\d+$", "", path)
            if path.split("/")[0] not in CITED_FOLDERS or placeholder(path) or path in proposed:
                continue
            if not (exists(root / path) or exists(page.parent / path)):
                problems.append(f"{name}:{line_of(span.start())}: `{path}` does not exist")
    return problems


def test_every_file_a_document_cites_exists():
    pages = documents()
    assert len(pages) > 40 and ROOT / "README.md" in pages
    assert not any("runs" in p.relative_to(ROOT).parts for p in pages)
    problems = [problem for page in pages for problem in broken_citations(page)]
    assert problems == []


def test_the_check_finds_a_broken_link_a_stale_anchor_and_a_missing_path(tmp_path):
    """A constructed bad document: each kind of broken citation is found, nothing else is."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "fl_app").mkdir()
    (tmp_path / "fl_app" / "api.py").write_text("")
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## A section\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "# Page\n\n"
        "[fine](other.md#a-section), [fine too](../fl_app/api.py), [web](https://flower.ai), [here](#page)\n"
        "`fl_app/api.py` and `python -m fl_app.report docs/other.md` and `strategies/<name>.py` and "
        "`fl_app/*.py`\n"
        "[gone](flower_engine.md)\n"
        "[stale anchor](other.md#no-such-section)\n"
        "the seam was `fl_app/flower_engine.py`, the tables `docs/*.csv`\n"
        "```bash\npython scripts/missing_in_a_code_block.py\n```\n"
        "<!-- docs-check: proposed files: strategies/fedprox.py -->\n"
        "`strategies/fedprox.py` is proposed, `strategies/fedprox2.py` is not\n"
    )
    problems = broken_citations(page, root=tmp_path)
    assert problems == [
        "docs/page.md:5: link to flower_engine.md, which does not exist",
        "docs/page.md:6: link to other.md#no-such-section: other.md has no heading #no-such-section",
        "docs/page.md:7: `fl_app/flower_engine.py` does not exist",
        "docs/page.md:7: `docs/*.csv` does not exist",
        "docs/page.md:12: `strategies/fedprox2.py` does not exist",
    ]


def test_slugs_are_githubs():
    assert slug("The contract (`strategies/contract.py`)") == "the-contract-strategiescontractpy"
    assert slug("`dp_flower`: dpfl's central DP around a Flower aggregator") == (
        "dp_flower-dpfls-central-dp-around-a-flower-aggregator"
    )
    assert (
        slug("6. Scale out a simulation over a Ray cluster") == "6-scale-out-a-simulation-over-a-ray-cluster"
    )


def test_the_readme_and_the_benchmark_index_stay_short():
    readme = (ROOT / "README.md").read_text().splitlines()
    index = (ROOT / "BENCHMARKS.md").read_text().splitlines()
    assert len(readme) <= README_LINES, f"README.md has {len(readme)} lines (at most {README_LINES})"
    assert len(index) <= BENCHMARKS_LINES, (
        f"BENCHMARKS.md has {len(index)} lines (at most {BENCHMARKS_LINES})"
    )
