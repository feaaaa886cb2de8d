"""The small text preset learns here: FedAvg and DP-FedAvg at epsilon 8 beat the unigram baseline.

``+experiment=text_small`` on a corpus generated inside the test
(:func:`fl_app.data.synthetic_text.write_corpus`: users who each favour a few words over a shared
Markov chain), run as the preset sets it, seeded, on the inline backend. The baseline is
``final.chance_accuracy``: always predicting the evaluation sentences' most frequent counted word.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import INLINE, simulate_in_process

from fl_app.data.synthetic_text import write_corpus


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "styled.parquet", 3000, seed=0)


@pytest.mark.simulation
@pytest.mark.parametrize("strategy", ["fedavg", "dp_fedavg"])
def test_small_preset_beats_the_unigram_baseline(
    strategy: str, corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPFL_DATA_HOME", str(tmp_path / "home"))
    overrides = ["+experiment=text_small", f"dataset.path={corpus}", f"strategy={strategy}", "seed=0", INLINE]
    results = simulate_in_process(overrides, tmp_path / "run", None)
    assert results["status"] == "completed"
    final = results["final"]
    assert final["rounds"] == 12
    assert 0.02 < final["chance_accuracy"] < 0.15, final  # the corpus's most frequent word
    assert final["accuracy"] >= 2 * final["chance_accuracy"], final
    if strategy == "dp_fedavg":
        assert results["privacy"]["unit"] != "none"
        # a DP vocabulary took a tenth of the budget; composed with the training, the total is below 8
        stages = results["privacy"]["total"]["per_stage"]
        assert stages["training"] == pytest.approx(7.2, abs=0.01) and 0 < stages["vocabulary"] <= 0.8
        assert stages["training"] < final["epsilon"] <= 8.0, final
        assert results["privacy"]["vocabulary"]["words"] == 40  # every word of the corpus passed
