"""What the documents state about the code agrees with the code.

Each test reads a statement of a page and checks it against what the code does: the network names
``dpfl --help`` and ``conf/config.yaml`` offer against the model registry, the SQLite layout of
docs/text.md against the reader (a file built from the page must be accepted), where the first text
example's data is cached, where docs/performance.md sends a stateful client against the engine's rule,
which of SCAFFOLD's hooks the walk-through presents as its own against its class, and the README's
promise about bad values against the exception docs/text.md states.
"""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from text_corpora import encode_example

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
FENCED = re.compile(r"^```(?P<lang>[a-z]*)\n(?P<code>.*?)^```", re.M | re.S)


def section(page: Path, heading: str) -> str:
    """The text of ``page`` from the heading that starts with ``heading`` to the next of its level."""
    text = page.read_text()
    start = text.index(heading)
    level = heading.split(" ")[0]
    following = re.search(rf"^{level} ", text[start + len(heading) :], re.M)
    return text[start : start + len(heading) + following.start()] if following else text[start:]


def test_help_and_config_name_every_network_and_autos_text_rule() -> None:
    from fl_app.cli import main_keys, overview
    from fl_app.learning.models import MODELS
    from fl_app.learning.text_models import CHARACTER_VOCABULARY, TEXT_MODELS

    meaning = dict((key, text) for key, _, text in main_keys())["model"]
    offered = set(re.split(r"\s*\|\s*", re.sub(r"\([^()]*(\([^()]*\)[^()]*)*\)", "", meaning)))
    assert set(MODELS) <= offered, sorted(set(MODELS) - offered)
    assert f"on text char_lstm for at most {CHARACTER_VOCABULARY} tokens, else word_lstm" in meaning
    help_text = overview()
    assert all(name in help_text for name in MODELS)
    row = next(
        line for line in (DOCS / "configuration.md").read_text().splitlines() if line.startswith("| `model`")
    )
    assert all(f"`{name}`" in row for name in [*MODELS, *TEXT_MODELS])


def test_a_sqlite_file_built_from_the_text_page_is_accepted(tmp_path: Path) -> None:
    """The page's ``CREATE TABLE`` statements, exactly, then a user's rows: dpfl reads its sentences."""
    from fl_app.data.text_sources import TextSource, open_reader

    layout = [m["code"] for m in FENCED.finditer((DOCS / "text.md").read_text()) if m["lang"] == "sql"]
    assert len(layout) == 1, "docs/text.md gives TFF's SQLite layout in one sql block"
    path = tmp_path / "from_the_page.sqlite"
    with sqlite3.connect(path) as connection:
        connection.executescript(layout[0])
        blob = encode_example({"tokens": [b"the page is right"], "title": [b"t"], "score": [1],
                               "creation_date": [b"2010"], "tags": [b"x"], "type": [b"answer"]})  # fmt: skip
        connection.execute("INSERT INTO examples VALUES (?, ?, ?)", ("train", "u1", blob))
        connection.execute("INSERT INTO client_metadata VALUES (?, ?, ?)", ("u1", "train", 1))
    connection.close()
    options = {"name": "stackoverflow", "path": str(path), "text_column": "tokens", "split": "train",
               "level": "word", "sequence_length": 20, "max_sequences_per_user": None}  # fmt: skip
    reader = open_reader(TextSource.from_options(options, user_column="client_id"))
    assert reader.user_ids("train") == ["u1"]
    assert [list(user.texts) for user in reader.users("train")] == [["the page is right"]]


def test_the_first_text_example_without_the_hub_names_the_text_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/text.md's first command reads the hub's Shakespeare and converts it into
    ``$DPFL_DATA_HOME/text/``: offline, the one line names that folder, not the image sets' ``hf`` one."""
    import datasets

    from fl_app.data.sources import DataNotFoundError
    from fl_app.data.text_sources import TextSource, open_reader

    page = (DOCS / "text.md").read_text()
    first = FENCED.search(page)
    assert first is not None and "dataset=shakespeare" in first["code"].splitlines()[0]
    assert "`$DPFL_DATA_HOME/text/`" in page[: first.start()]

    def offline(*args: object, **kwargs: object) -> None:
        raise ConnectionError("Couldn't reach 'flwrlabs/shakespeare' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setenv("DPFL_DATA_HOME", str(tmp_path / "dpfl"))
    monkeypatch.setattr(datasets, "load_dataset", offline)
    options = {"name": "shakespeare", "path": "flwrlabs/shakespeare", "text_column": "x", "split": "train",
               "level": "character", "sequence_length": 80, "max_sequences_per_user": None}  # fmt: skip
    reader = open_reader(TextSource.from_options(options, user_column="character_id"))
    with pytest.raises(DataNotFoundError) as missing:
        reader.dataset("train", "dataset.split")
    assert f"not in the dpfl cache ({tmp_path / 'dpfl' / 'text'})" in str(missing.value)


def test_the_performance_page_sends_a_stateful_client_where_the_engine_does(tmp_path: Path) -> None:
    from conftest import FAST, build_run_context

    from clients.scaffold import ScaffoldClient
    from fl_app.run.round_path import round_path
    from strategies import STRATEGIES

    run = build_run_context([*FAST, "strategy=scaffold"], tmp_path)
    path = round_path(
        STRATEGIES.get("scaffold")(run), run.settings, ScaffoldClient, simulated=False, bulk_shares=0
    )
    assert path.messages == "per_client"  # on devices; in a simulation:
    from fl_app.engine.workers import forget_workers, record_workers

    record_workers("inline", 1)
    try:
        path = round_path(
            STRATEGIES.get("scaffold")(run), run.settings, ScaffoldClient, simulated=True, bulk_shares=0
        )
    finally:
        forget_workers()
    assert (path.messages, path.why) == ("packed", "not in bulk: ScaffoldClient keeps state")
    bulk = section(DOCS / "performance.md", "## A cohort in bulk")
    sentence = next(s for s in re.split(r"(?<=\.)\s", " ".join(bulk.split())) if "keeps state" in s)
    assert "goes packed, not in bulk" in sentence and "per-message path" not in sentence


def test_the_scaffold_walkthrough_presents_no_inherited_hook_as_its_own() -> None:
    """A hook of the strategy contract the SCAFFOLD section names is SCAFFOLD's own, or the sentence says
    it is the base class's."""
    from strategies.base import FederatedStrategy
    from strategies.scaffold import ScaffoldStrategy

    text = section(DOCS / "contributing" / "adding-an-algorithm.md", "## 5. A stateful algorithm: SCAFFOLD")
    prose = " ".join(FENCED.sub("", text).split())
    hooks = {name for name in dir(FederatedStrategy) if not name.startswith("_")}
    named = 0
    for sentence in re.split(r"(?<=[.;])\s", prose):
        for hook in re.findall(r"`(?:self\.)?(\w+)\(", sentence):
            if hook not in hooks:
                continue
            named += 1
            if hook not in vars(ScaffoldStrategy):
                assert "base class" in sentence, (
                    f"{hook}() is FederatedStrategy's, not SCAFFOLD's: {sentence}"
                )
    assert named >= 3


def test_the_readme_says_what_a_bad_value_stops_before() -> None:
    """The README's promise points to the exception docs/text.md states: what only a text corpus's data
    can refute is found once the corpus is read and converted (still before the run starts)."""
    readme = " ".join((ROOT / "README.md").read_text().split())
    promise = re.search(r"A bad value stops the command .*?\.(?=\s)", readme)
    assert promise is not None
    assert "converted" in promise.group(0) and "(docs/text.md#accepted-formats)" in promise.group(0)
    text = " ".join((DOCS / "text.md").read_text().split())
    assert "is found after the conversion, still before the run starts" in text


def test_the_flower_dp_page_shows_what_its_command_gives(simulate: Any) -> None:
    """docs/algorithms/flower_dp.md's run, again (inline: a seeded run's rounds do not depend on the
    backend): the accuracy, loss, epsilons and best round its transcript prints."""
    block = next(
        m["code"] for m in FENCED.finditer((DOCS / "algorithms" / "flower_dp.md").read_text())
        if m["code"].startswith("$ python -m fl_app")
    )  # fmt: skip
    command = re.match(r"\$ python -m fl_app (?P<args>(?:.*\\\n)*.*)\n", block)
    assert command is not None
    overrides = command["args"].replace("\\\n", " ").split()
    shown = re.search(
        r"round 10/10: accuracy (?P<accuracy>\S+), loss (?P<loss>\S+), epsilon (?P<epsilon>\S+) .*"
        r"Flower's accountant: epsilon (?P<flower>\S+) .*final accuracy \S+ \(best (?P<best>\S+) in round "
        r"(?P<round>\d+)\)",
        block,
        re.S,
    )
    assert shown is not None
    results = simulate([*overrides, "simulation.backend=inline"])
    final = results["final"]
    assert f"{final['accuracy']:.4g}" == shown["accuracy"] and f"{final['loss']:.4g}" == shown["loss"]
    assert (
        f"{final['epsilon']:.4g}" == shown["epsilon"] and f"{final['flower_epsilon']:.4g}" == shown["flower"]
    )
    assert (f"{final['best_accuracy']:.4g}", final["best_round"]) == (shown["best"], int(shown["round"]))
