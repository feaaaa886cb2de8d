"""What a text run says and refuses before it starts: a network of the wrong kind, a smaller vocabulary,
a test subset larger than the test split, and the data set's label in results and reports.

Small corpora written inside the tests (:mod:`tests.text_corpora`: 60 distinct words, far fewer than
Stack Overflow's default ``dataset.vocab_size`` of 10,000).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import INLINE, simulate_in_process

from fl_app.config.compose import compose_config
from fl_app.config.settings import RunSettings
from fl_app.config.validation import ConfigError, validate_config
from tests.text_corpora import styled_rows, write_rows


@pytest.fixture(autouse=True)
def data_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test converts into its own cache."""
    home = tmp_path / "home"
    monkeypatch.setenv("DPFL_DATA_HOME", str(home))
    return home


def corpus(tmp_path: Path, users: int = 40) -> list[str]:
    """The overrides of a Stack Overflow run on a small parquet corpus written now."""
    path = write_rows(styled_rows(users, seed=2), tmp_path / "corpus.parquet", "parquet")
    return ["dataset=stackoverflow", f"dataset.path={path}", "partition=natural", "num_clients=20"]


def cache_entries(home: Path) -> list[Path]:
    """Everything in the text cache (converted folders, partial ones)."""
    cache = home / "text"
    return sorted(cache.iterdir()) if cache.is_dir() else []


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("cnn", r"^model='cnn': cnn is an image network; on dataset=stackoverflow use auto, char_lstm"),
        (
            "text_corpora:EightTokensLong",
            r"^model='text_corpora:EightTokensLong': the network .* does not take this data's token "
            r"sequences of length 20",
        ),
    ],
)
def test_a_network_of_the_wrong_kind_is_refused_before_the_conversion(
    tmp_path: Path, data_home: Path, model: str, message: str
) -> None:
    """One line naming ``model``, and nothing converted or written."""
    with pytest.raises(ConfigError) as error:
        validate_config(
            compose_config([*corpus(tmp_path), f"model={model}", f"output_dir={tmp_path / 'run'}"])
        )
    assert error.value.key == "model" and "\n" not in str(error.value)
    assert re.search(message, str(error.value)), str(error.value)
    assert cache_entries(data_home) == []
    assert not (tmp_path / "run").exists()


def test_a_next_token_network_on_images_is_refused_before_the_data_is_read(tmp_path: Path) -> None:
    """``dataset=hf`` with a path that does not exist: the network is refused first, by name."""
    overrides = ["dataset=hf", f"dataset.path={tmp_path / 'nowhere.parquet'}", "model=word_lstm"]
    with pytest.raises(ConfigError) as error:
        validate_config(compose_config(overrides))
    assert error.value.key == "model"
    assert str(error.value).startswith(
        "model='word_lstm': is a network of token sequences (dataset=shakespeare, stackoverflow); on "
        "dataset=hf use auto, "
    )


def test_a_text_run_is_labelled_by_its_path(tmp_path: Path) -> None:
    """As ``dataset=hf`` runs are: two corpora are two data sets in a report."""
    overrides = corpus(tmp_path)
    path = overrides[1].partition("=")[2]
    assert RunSettings.from_config(compose_config(overrides)).dataset == f"stackoverflow:{path}"
    other = RunSettings.from_config(compose_config([*overrides[:1], "dataset.path=/data/so.sqlite"]))
    assert other.dataset == "stackoverflow:/data/so.sqlite"
    shakespeare = RunSettings.from_config(compose_config(["dataset=shakespeare", "partition=natural"]))
    assert shakespeare.dataset == "shakespeare:flwrlabs/shakespeare"


@pytest.fixture(scope="module")
def small_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, dict]:
    """One round on the small corpus with the default vocabulary size and a test subset of 10,000."""
    import os

    root = tmp_path_factory.mktemp("small-run")
    home = os.environ.get("DPFL_DATA_HOME")
    os.environ["DPFL_DATA_HOME"] = str(root / "home")
    try:
        overrides = [
            *corpus(root),
            "model=causal_transformer",
            "num_rounds=1",
            "clients_per_round=4",
            "evaluation.test_subset=10000",
            INLINE,
        ]
        results = simulate_in_process(overrides, root / "run", None)
    finally:
        if home is None:
            del os.environ["DPFL_DATA_HOME"]
        else:
            os.environ["DPFL_DATA_HOME"] = home
    return root / "run", overrides[1].partition("=")[2], results


@pytest.mark.simulation
def test_a_smaller_vocabulary_and_a_larger_subset_are_each_said_before_round_one(
    small_run: tuple[Path, str, dict],
) -> None:
    output, _, results = small_run
    assert results["status"] == "completed"
    lines = (output / "run.log").read_text().splitlines()
    first_round = next(i for i, line in enumerate(lines) if "round 1/1" in line)
    vocabulary = [i for i, line in enumerate(lines) if "the vocabulary holds" in line]
    subset = [i for i, line in enumerate(lines) if "evaluation.test_subset=10000" in line]
    assert len(vocabulary) == 1 and len(subset) == 1, "\n".join(lines)
    assert vocabulary[0] < first_round and subset[0] < first_round
    vocabulary_line = lines[vocabulary[0]]
    found = re.search(
        r"the vocabulary holds (\d+) words, fewer than dataset.vocab_size=10000: (\d+) tokens with the "
        r"special ones, so causal_transformer has ([\d,]+) parameters, not the ([\d,]+) it has with "
        r"10,004 tokens",
        vocabulary_line,
    )
    assert found, vocabulary_line
    (meta,) = (output.parent / "home" / "text").glob("*/meta.json")
    words = len(json.loads(meta.read_text())["vocabulary"])
    assert int(found.group(1)) == words < 10000 and int(found.group(2)) == words + 4
    counts = [int(found.group(k).replace(",", "")) for k in (3, 4)]
    assert counts == [parameters(words + 4), parameters(10004)]
    subset_line = lines[subset[0]]
    held = re.search(r"the test split holds ([\d,]+) sequences: evaluating on all of them", subset_line)
    assert held, subset_line
    test_sequences = (meta.parent / "test.tokens").stat().st_size // (21 * 2)  # uint16 rows of 21 ids
    assert int(held.group(1).replace(",", "")) == test_sequences < 10000


def parameters(vocabulary: int) -> int:
    """The causal transformer's parameters for sequences of 20 and ``vocabulary`` tokens."""
    from fl_app.learning.models import build_model

    return sum(p.numel() for p in build_model("causal_transformer", (20,), vocabulary).parameters())


@pytest.mark.simulation
def test_a_text_runs_results_and_report_name_its_path(
    small_run: tuple[Path, str, dict], tmp_path: Path
) -> None:
    from fl_app.report.sweep import main as report

    output, path, results = small_run
    assert results["dataset"] == f"stackoverflow:{path}"
    assert report([str(output), "--out", str(tmp_path / "report")]) == 0
    assert f"stackoverflow:{path}" in (tmp_path / "report" / "report.md").read_text()
    assert json.loads((output / "results.json").read_text())["dataset"] == f"stackoverflow:{path}"
