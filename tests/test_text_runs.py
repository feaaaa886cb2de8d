"""Text runs as a whole: which strategies take token sequences, and the papers' presets, one round each.

The presets (``+experiment=so_*``, ``shakespeare_adaptive_clip``) run on a converted corpus of the data
set's real shape generated inside the test (:func:`fl_app.data.synthetic_text.write_token_corpus`:
Stack Overflow's 342,477 training users and 10,004 tokens, Shakespeare's 715 users and 90 tokens),
with few sentences per user so that one round takes seconds: validated as a run is, the strategy
built and every one of the preset's rounds charged to its accountant, then one round for real.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from conftest import INLINE, simulate_in_process

from benchmarks.text_presets import PRESETS, charge_every_round, dry_run, shaped_corpus
from fl_app.config.compose import compose_config
from fl_app.config.validation import ConfigError, validate_config
from fl_app.data.examples import TEXT_DATASETS
from fl_app.data.synthetic_text import write_token_corpus
from strategies import STRATEGIES


@pytest.fixture(scope="module")
def text_run(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A Stack Overflow run on a small converted corpus (some strategies' checks read the data)."""
    folder = tmp_path_factory.mktemp("small") / "corpus"
    write_token_corpus(folder, users=300, test_users=30, mean_sentences=3, cap=None, words=50, seed=1)
    return ["dataset=stackoverflow", f"dataset.path={folder}", "dataset.vocab_size=50", "partition=natural"]


@pytest.mark.parametrize("name", sorted(STRATEGIES.names()))
def test_each_strategy_runs_on_text_or_says_why_not(name: str, text_run: list[str]) -> None:
    """A strategy without a ``sequences`` reason validates on text; one with it is refused with it."""
    cfg = compose_config([*text_run, f"strategy={name}"])
    reason = STRATEGIES.get(name).declaration.sequences
    if reason is None:
        validate_config(cfg, check_data=False)
        return
    with pytest.raises(ConfigError) as error:
        validate_config(cfg, check_data=False)
    assert error.value.key == "strategy" and "\n" not in str(error.value)
    assert str(error.value) == f"strategy={name!r}: does not run on dataset=stackoverflow: {reason}"


def test_an_image_evaluation_stage_is_refused_on_text(text_run: list[str]) -> None:
    with pytest.raises(ConfigError, match=r"^evaluation.stage='laplace_eval': does not run on dataset="):
        validate_config(compose_config([*text_run, "evaluation=laplace_eval"]), check_data=False)


@pytest.mark.parametrize(
    ("extra", "key", "message"),
    [
        (
            ["dataset.path=/nowhere/stackoverflow.sqlite"],
            "dataset.path",
            "/nowhere/stackoverflow.sqlite does not exist",
        ),
        (["model=text_corpora:TenTokens"], "model", r"must give next-token scores of shape \(1, 20, 54\)"),
        (
            ["model=text_corpora:EightTokensLong"],
            "model",
            "does not take this data's token sequences of length 20",
        ),
        (["model=cnn"], "model", "is an image network"),
        (["dataset.sequence_length=0"], "dataset.sequence_length", ""),
    ],
)
def test_bad_text_runs_are_refused_in_one_line(
    text_run: list[str], extra: list[str], key: str, message: str
) -> None:
    """A missing file, a network that does not fit the vocabulary or the length: one line, before a round."""
    with pytest.raises(ConfigError) as error:
        validate_config(compose_config([*text_run, *extra]))
    assert error.value.key == key and "\n" not in str(error.value), str(error.value)
    assert re.search(message, str(error.value)), str(error.value)


def test_the_dry_run_charges_what_the_run_charges(text_run: list[str], tmp_path: Path) -> None:
    """DP-BandMF's groups cut to one member each give the epsilon of every member charged."""
    from fl_app.run.harness import run_context_for

    overrides = [
        *text_run,
        "strategy=dp_bandmf",
        "strategy.bands=3",
        "strategy.noise_multiplier=0.7",
        "num_clients=300",
        "clients_per_round=30",
        "num_rounds=8",
    ]
    run = run_context_for(overrides, tmp_path)
    whole, cut = STRATEGIES.get("dp_bandmf")(run), STRATEGIES.get("dp_bandmf")(run)
    for server_round in range(1, 9):
        whole._record_release(server_round)
    charge_every_round(cut, 8)
    assert len(cut.accountant.events) == 8 and cut.epsilon().epsilon > 0
    assert cut.epsilon().epsilon == pytest.approx(whole.epsilon().epsilon, rel=1e-9)
    cut_short = STRATEGIES.get("dp_bandmf")(run)
    charge_every_round(cut_short, 5)  # fewer rounds: less epsilon
    assert cut_short.epsilon().epsilon < cut.epsilon().epsilon


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shaped")


@pytest.mark.simulation
@pytest.mark.parametrize("preset", list(PRESETS))
def test_each_published_preset_validates_accounts_and_runs_a_round(
    preset: str, corpora: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPFL_DATA_HOME", str(corpora / "home"))  # each corpus converted once per process
    dataset = PRESETS[preset]
    assert dataset in TEXT_DATASETS
    corpus = shaped_corpus(corpora, dataset)
    row = dry_run(preset, corpus, tmp_path / "dry")
    preset_cfg = compose_config([f"+experiment={preset}", f"dataset.path={corpus}"])
    assert row["clients"] == preset_cfg.num_clients and row["rounds"] == preset_cfg.num_rounds
    assert row["clients_per_round"] == preset_cfg.clients_per_round
    expected = {"stackoverflow": ("word_lstm", 4_050_748), "shakespeare": ("char_lstm", 820_522)}[dataset]
    assert (row["model"], row["parameters"]) == expected
    assert row["epsilon"] is not None and math.isfinite(row["epsilon"]) and row["epsilon"] > 0
    if preset_cfg.privacy.get("epsilon") is not None and preset_cfg.strategy.get("noise_multiplier") is None:
        assert row["epsilon"] == pytest.approx(float(preset_cfg.privacy.epsilon), rel=1e-3)
    overrides = [
        f"+experiment={preset}",
        f"dataset.path={corpus}",
        "num_rounds=1",
        "clients_per_round=10",  # the preset's cohort is checked above; its round with fewer clients
        "evaluation.test_subset=200",
        INLINE,
    ]
    results = simulate_in_process(overrides, tmp_path / "run", None)
    assert results["status"] == "completed"
    assert results["final"]["rounds"] == 1 and math.isfinite(results["final"]["loss"])
