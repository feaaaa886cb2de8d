"""dpfl against pfl-research's and TFF's own code, from small fixtures (CI has neither installed).

``tests/data/pfl_crosscheck.json`` was made by ``benchmarks/pfl_crosscheck.py fixtures``: pfl-research's
``download_preprocess.py`` and TFF's ``build_to_ids_fn`` (google-research/federated) on edge-case
sentences with an 8-word list; pfl-research's ``lm_transformer`` and ``lm_lstm`` with seeded weights
(normal(0, 0.1) in parameter order) on seeded inputs: their parameter names, shapes, counts, loss and
outputs. The whole comparison (every sentence of a corpus, outputs at 10,004 tokens, the metric, the
learning curves and the cost) is the script's.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.pfl_crosscheck import QUICK, arm_rounds, overlap, overlap_false_alarm
from fl_app.config.compose import selects_quick
from fl_app.data.text import uncounted_targets
from fl_app.data.text_tokens import Vocabulary, word_sequence, words_of
from fl_app.learning.models import build_model
from fl_app.learning.sequence import NextToken

FIXTURE = json.loads((Path(__file__).parent / "data" / "pfl_crosscheck.json").read_text())
#: Words that pfl-research's script maps to its special tokens (its vocabulary is a dict holding them).
PFL_SPECIAL_WORDS = {"PAD", "UNK", "BOS", "EOS"}


def test_words_are_split_as_tff_splits_them() -> None:
    """TFF's ``tf.strings.split(sentence, sep=' ')``: single spaces, case kept, empty words kept."""
    assert words_of("w1  w2") == ["w1", "", "w2"]
    assert words_of(" w1 ") == ["", "w1", ""]
    assert words_of("W1\tw2") == ["W1\tw2"]
    assert words_of("") == [""]


def test_sentence_ids_are_tffs_on_every_edge_case() -> None:
    """dpfl's ids equal TFF's own ``to_ids`` on each sentence; pfl-research departs only on special words."""
    vocabulary = Vocabulary(tuple(FIXTURE["word_list"]))
    ids = vocabulary.ids()
    departures = []
    for case in FIXTURE["edge_cases"]:
        mine = word_sequence(case["text"], ids, vocabulary, FIXTURE["length"]).tolist()
        assert mine == case["tff"], case["text"]
        if case["pfl_research"] != case["tff"]:
            departures.append(case["text"])
    assert departures and all(set(t.split(" ")) & PFL_SPECIAL_WORDS for t in departures)


def test_edge_cases_cover_what_the_old_split_changed() -> None:
    """Lower-casing and splitting on any whitespace would change these sentences' ids (TFF's, fixture)."""
    vocabulary = Vocabulary(tuple(FIXTURE["word_list"]))
    ids = vocabulary.ids()
    changed = 0
    for case in FIXTURE["edge_cases"]:
        words = case["text"].lower().split()[: FIXTURE["length"]]
        row = [vocabulary.bos, *(ids.get(w, vocabulary.oov) for w in words)]
        row += [vocabulary.eos] if len(words) < FIXTURE["length"] else []
        changed += (row + [0] * (FIXTURE["length"] + 1 - len(row))) != case["tff"]
    assert changed >= 4


@pytest.mark.parametrize("name", ["pfl_transformer", "pfl_lstm"])
def test_parameter_counts_names_and_shapes_are_pfl_researchs(name: str) -> None:
    network = build_model(name, (20,), 10004)
    assert sum(p.numel() for p in network.parameters()) == FIXTURE["parameters_at_10004"][name]
    assert FIXTURE["parameters_at_10004"] == {"pfl_transformer": 1_962_912, "pfl_lstm": 1_347_552}
    small = build_model(name, (8,), 30)
    expected = FIXTURE["networks"][name]["shapes"]
    assert {k: list(p.shape) for k, p in small.named_parameters()} == expected
    assert not list(small.buffers())  # pfl's positional-encoding buffer is computed, not stored


@pytest.mark.parametrize("name", ["pfl_transformer", "pfl_lstm"])
def test_outputs_and_loss_are_pfl_researchs(name: str) -> None:
    """pfl-research's seeded weights (normal(0, 0.1) in its parameter order) give its outputs and loss."""
    network = build_model(name, (8,), 30).eval()
    rng = np.random.default_rng(FIXTURE["network_seed"])
    parameters = dict(network.named_parameters())
    with torch.no_grad():
        for key, shape in FIXTURE["networks"][name]["shapes"].items():
            values = rng.standard_normal(tuple(shape)).astype(np.float32) * np.float32(0.1)
            parameters[key].copy_(torch.from_numpy(values))
    inputs = torch.tensor(FIXTURE["network_inputs"])
    targets = torch.tensor(FIXTURE["network_targets"])
    with torch.no_grad():
        outputs = network(inputs).double()
    expected = FIXTURE["networks"][name]
    np.testing.assert_allclose(outputs[0, :3, :5].numpy(), expected["outputs_first"], atol=2e-6)
    assert float(outputs.sum()) == pytest.approx(expected["outputs_sum"], rel=1e-5, abs=1e-3)
    assert float(outputs.abs().sum()) == pytest.approx(expected["outputs_abs_sum"], rel=1e-6)
    loss = NextToken().loss(network(inputs), targets)
    assert float(loss.detach()) == pytest.approx(expected["loss"], rel=1e-6)


def test_accuracy_counts_as_named() -> None:
    """Both flags false count every non-pad target (pfl's 'accuracy'); the default leaves out end, unknown."""
    vocabulary = Vocabulary(("a", "b"))  # pad 0, words 1-2, oov 3, bos 4, eos 5
    stackoverflow = {"accuracy_without_oov": True}
    assert uncounted_targets(stackoverflow, vocabulary) == (0, 3, 5)
    assert uncounted_targets({**stackoverflow, "accuracy_without_eos": False}, vocabulary) == (0, 3)
    assert uncounted_targets({"accuracy_without_eos": False}, vocabulary) == (0,)
    assert uncounted_targets({}, vocabulary) == (0, 5)


def test_only_the_experiment_or_example_selects_the_quick_example() -> None:
    assert selects_quick("+experiment=quick") and selects_quick("example=quick")
    assert selects_quick("+experiment=[quick,canaries]")
    assert not selects_quick("output_dir=/runs/quick/1")
    assert not selects_quick("dataset.path=/data/quick.sqlite")


def test_curves_overlap_within_the_seeds_spread() -> None:
    def runs(curves: list[list[float]]) -> list[dict]:
        return [{"round": [5, 10, 15], "accuracy": c} for c in curves]

    near = overlap(runs([[0.1, 0.30, 0.40], [0.2, 0.32, 0.41]]), runs([[0.5, 0.31, 0.41], [0.5, 0.33, 0.42]]))
    assert near["overlap"]  # the first evaluated round is not judged
    far = overlap(runs([[0.1, 0.30, 0.40], [0.2, 0.31, 0.41]]), runs([[0.1, 0.40, 0.42], [0.1, 0.41, 0.43]]))
    assert not far["overlap"] and [r["within"] for r in far["rounds"]] == [True, False, False]


def test_a_round_whose_seeds_happen_to_agree_is_judged_by_the_curves_spread() -> None:
    def runs(curves: list[list[float]]) -> list[dict]:
        return [{"round": [5, 10, 15, 20], "accuracy": c} for c in curves]

    # round 10: each side's three seeds within 0.004, the means 0.03 apart; the curve's seeds spread 0.06
    dpfl = runs([[0.2, 0.520, 0.55, 0.60], [0.3, 0.518, 0.61, 0.66], [0.25, 0.516, 0.58, 0.63]])
    pfl = runs([[0.2, 0.550, 0.60, 0.61], [0.3, 0.548, 0.54, 0.67], [0.25, 0.546, 0.57, 0.64]])
    result = overlap(dpfl, pfl)
    assert result["pooled_spread"] == pytest.approx((0.004 + 0.06 + 0.06) / 3)
    assert result["overlap"] and [r["judged"] for r in result["rounds"]] == [False, True, True, True]
    shifted = overlap(
        dpfl, runs([[0.2, 0.620, 0.60, 0.61], [0.3, 0.618, 0.54, 0.67], [0.25, 0.616, 0.57, 0.64]])
    )
    assert not shifted["overlap"] and [r["within"] for r in shifted["rounds"][1:]] == [False, True, True]


def test_the_overlap_criterion_rarely_fails_alike_curves_and_catches_shifted_ones() -> None:
    alike = overlap_false_alarm(seeds=3, spreads=[2.0, 1.3, 1.0], trials=20000)
    assert 0.005 < alike["round"] < 0.03 and 0.02 < alike["curve"] < 0.08
    assert overlap_false_alarm(seeds=3, spreads=[2.0, 1.3, 1.0], shift=3.0, trials=20000)["curve"] > 0.85
    two_seeds = overlap_false_alarm(seeds=2, spreads=[1.0, 1.0, 1.0], trials=20000)
    assert two_seeds["curve"] > 0.2  # why two seeds a side cannot judge an overlap


def test_cost_per_round_comes_from_the_round_marks() -> None:
    sizes = replace(QUICK, cost_rounds=5)
    marks = [  # the end of rounds 1..5: every process's CPU then (the command's pid is the lowest)
        {"at_s": 10.0 + 3 * i, "cpu_s": {"100": 8.0 + 0.1 * i, "101": 1.0 + 1.5 * i, "102": 1.0 + 1.5 * i}}
        for i in range(5)
    ]
    row = {"arm": "dpfl", "exit": 0, "marks": marks}
    assert arm_rounds(row, sizes) == pytest.approx({"cpu_s": 3.1, "wall_s": 3.0, "driver_s": 0.1})
    loop = {"arm": "loop", "exit": 0, "cpu_s": [9.0, 3.0, 3.2, 3.4, 9.0], "round_s": [1, 2, 3, 4, 5]}
    assert arm_rounds(loop, sizes) == pytest.approx({"cpu_s": 3.2, "wall_s": 3, "driver_s": None})
    assert arm_rounds({**row, "marks": marks[:3]}, sizes)["cpu_s"] is None  # a run that stopped early


def test_pfl_central_adam_steps_as_torch_adam_with_the_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three rounds through the strategy and through ``torch.optim.Adam`` with ``LambdaLR``."""
    from flwr.app import Array, ArrayRecord
    from flwr.serverapp.strategy import FedAvg

    from benchmarks.pfl_central_adam import PflCentralAdam

    rng = np.random.default_rng(0)
    start = rng.standard_normal(5).astype(np.float32)
    updates = [rng.standard_normal(5).astype(np.float32) * 1e-3 for _ in range(3)]
    strategy = PflCentralAdam(eta=0.1, tau=0.01, beta_1=0.9, beta_2=0.99, warmup=2)
    parameter = torch.nn.Parameter(torch.from_numpy(start.copy()))
    optimizer = torch.optim.Adam([parameter], 0.1, eps=0.01, betas=(0.9, 0.99))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: s / 2 if s < 2 else 1.0)
    current = start.copy()
    for update in updates:
        strategy.current_arrays = {"w": current.copy()}
        averaged = ArrayRecord({"w": Array(current + update)})
        monkeypatch.setattr(FedAvg, "aggregate_train", lambda self, r, replies, a=averaged: (a, None))
        record, _ = strategy.aggregate_train(1, [])
        current = record["w"].numpy()
        optimizer.zero_grad()
        parameter.grad = torch.from_numpy(-update)  # pfl: the pseudo-gradient is minus the update
        optimizer.step()
        schedule.step()
        np.testing.assert_allclose(current, parameter.detach().numpy(), rtol=1e-5, atol=1e-7)
    assert not np.allclose(current, start)  # the first step is at rate 0, the others move


def test_a_run_of_one_stage_keeps_the_other_stages_of_the_same_sizes(tmp_path: Path) -> None:
    from dataclasses import asdict

    from benchmarks.pfl_crosscheck import FULL, STAGES, earlier_stages

    stages = {stage: {"equal": True, "of": stage} for stage in STAGES if stage != "cost"}
    (tmp_path / "record.partial.json").write_text(json.dumps({"sizes": asdict(QUICK), **stages}))
    kept = earlier_stages(tmp_path, QUICK, {"cost"})
    assert kept == stages  # every stage but the one run again
    assert earlier_stages(tmp_path, QUICK, {"cost", "learning"}).keys() == stages.keys() - {"learning"}
    assert earlier_stages(tmp_path, FULL, {"cost"}) == {}  # another run's sizes: nothing taken
    assert earlier_stages(tmp_path, QUICK, set(STAGES)) == {}  # a whole run takes nothing
