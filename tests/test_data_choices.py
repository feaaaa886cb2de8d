"""Choices a private run makes from the clients' data: released by DP and charged, or declared public.

End to end (:func:`test_one_user_s_word_is_absent_and_the_vocabulary_is_charged`): two corpora that
differ in one user, who writes three sentences of a word nobody else uses, run DP-FedAvg with the
same seeds. The models' shapes must be equal and the word absent from the released vocabulary, and
the release must be charged in the run's epsilon (its stage, its ledger, the total within
``privacy.epsilon``). Counting the training users' words un-noised, as TFF's rule does, gives that
user's word an id and the models a row more (44 against 45 rows at the same epsilon).

The refusals need no run: a word file a private run has not declared public, a local-DP strategy
without a public vocabulary, a converted corpus counted un-noised, a ``dataset=hf`` run whose number
of classes would be counted from integer labels.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import INLINE, simulate_in_process

from fl_app.config.compose import compose_config
from fl_app.config.validation import ConfigError, validate_config
from fl_app.data.synthetic_text import styled_corpus

#: The word only the added user writes.
RARE = "zyzzyva"
#: A small run: the corpus's words are common enough to pass the threshold at this budget
#: (privacy.epsilon=50: the vocabulary's tenth gives a threshold of about 59 users of 480).
RUN = [
    "dataset=stackoverflow",
    "partition=natural",
    "dataset.vocab_size=100",
    "model=causal_transformer",
    "strategy=dp_fedavg",
    "num_clients=20",
    "clients_per_round=4",
    "num_rounds=1",
    "local_epochs=1",
    "privacy.epsilon=50",
    "privacy.noise_seed=11",
    "evaluation.test_subset=50",
    "seed=0",
    INLINE,
]


def write_parquet(path: Path, ids: list[str], texts: list[str]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"client_id": ids, "tokens": texts}), str(path))
    return path


def training_user_id(ids: list[str]) -> str:
    """An id for the added user that the held-out rule keeps among the training users."""
    from fl_app.data.text import held_out_users

    for n in range(100):
        candidate = f"z{n:05d}"
        if candidate not in held_out_users(sorted({*ids, candidate}), 0.2):
            return candidate
    raise AssertionError("no training user id found")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Corpus A (600 generated users) and B: A and one more user, whose only word is :data:`RARE`."""
    folder = tmp_path_factory.mktemp("corpora")
    ids, texts = styled_corpus(600, seed=0)
    extra = training_user_id(ids)
    a = write_parquet(folder / "a.parquet", ids, texts)
    b = write_parquet(folder / "b.parquet", [*ids, *[extra] * 3], [*texts, *[f"{RARE} {RARE} {RARE}"] * 3])
    return a, b


def shapes(results: dict) -> dict[str, tuple[int, ...]]:
    with np.load(Path(results["_output_dir"]) / "final_model.npz") as model:
        return {name: model[name].shape for name in model.files}


@pytest.mark.simulation
def test_one_user_s_word_is_absent_and_the_vocabulary_is_charged(
    corpora: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPFL_DATA_HOME", str(tmp_path / "home"))
    a, b = (simulate_in_process([*RUN, f"dataset.path={p}"], tmp_path / p.stem, None) for p in corpora)
    assert shapes(a) == shapes(b), "one user's data changed the vocabulary, un-noised"
    for results in (a, b):
        assert results["status"] == "completed"
        privacy = results["privacy"]
        vocabulary, total = privacy["vocabulary"], privacy["total"]
        assert vocabulary["origin"] == "dp" and 30 <= vocabulary["words"] <= 40, vocabulary
        charged = total["per_stage"]["vocabulary"]
        assert 0 < charged <= 5.0 and vocabulary["epsilon_charged"] == charged
        training = total["per_stage"]["training"]
        assert training < total["epsilon"] <= training + charged + 1e-9  # the release is in the total
        assert total["epsilon"] <= 50.0 and total["delta"] == 1e-5
        assert results["final"]["epsilon"] == total["epsilon"] == results["rounds"][-1]["epsilon"]
        ledger = json.loads((Path(results["_output_dir"]) / vocabulary["ledger"]).read_text())
        assert [(e["server_round"], e["participants"]) for e in ledger["events"]] == [(0, None)]
        assert any(line.startswith("the vocabulary: ") for line in total["covers"])
        log = (Path(results["_output_dir"]) / "run.log").read_text()
        assert "vocabulary: " in log and "charged epsilon" in log
    from fl_app.data.text_vocabulary import read_release

    words_a, _ = read_release(a["privacy"]["vocabulary"]["release"])
    words_b, _ = read_release(b["privacy"]["vocabulary"]["release"])
    assert RARE not in words_b and words_a == words_b


@pytest.mark.simulation
def test_a_declared_public_vocabulary_is_an_assumption_in_the_header_results_and_report(
    corpora: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPFL_DATA_HOME", str(tmp_path / "home"))
    words = tmp_path / "word_count"
    words.write_text("\n".join(f"w{i} {100 - i}" for i in range(40)))
    overrides = [*RUN, f"dataset.path={corpora[0]}", f"dataset.vocabulary={words}", "dataset.vocab_size=40"]
    results = simulate_in_process([*overrides, "dataset.vocabulary_public=true"], tmp_path / "run", None)
    privacy = results["privacy"]
    assumption = privacy["vocabulary"]["assumption"]
    assert privacy["vocabulary"]["origin"] == "public_file" and str(words) in assumption
    assert f"ASSUMED: {assumption}" in privacy["total"]["not_covered"]
    assert "vocabulary" not in privacy["total"]["per_stage"]  # nothing charged: it is declared public
    assert f"ASSUMED: {assumption}" in (tmp_path / "run" / "run.log").read_text()
    from fl_app.report.sweep import main as report

    assert report([str(tmp_path / "run"), "--out", str(tmp_path / "report")]) == 0
    assert f"ASSUMED: {assumption}" in (tmp_path / "report" / "report.md").read_text()


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ids, texts = styled_corpus(200, seed=1)
    return write_parquet(tmp_path_factory.mktemp("small") / "small.parquet", ids, texts)


def validated(small: Path, *extra: str) -> object:
    overrides = ["dataset=stackoverflow", f"dataset.path={small}", "partition=natural", "num_clients=20"]
    overrides += ["dataset.vocab_size=50"]  # the word file holds 50
    return validate_config(compose_config([*overrides, "model=causal_transformer", *extra]))


@pytest.mark.parametrize(
    ("extra", "key", "message"),
    [
        (["strategy=dp_fedavg", "dataset.vocabulary={words}"], "dataset.vocabulary_public", "must be true"),
        (["strategy=dp_fedavg", "dataset.vocabulary_public=true"], "dataset.vocabulary_public", "name it"),
        (["strategy=nbafl"], "dataset.vocabulary", "local or distributed DP"),
        (["strategy=dp_fedavg_secagg"], "dataset.vocabulary", "local or distributed DP"),
        (
            ["strategy=dp_fedavg", "dataset.vocabulary_budget_fraction=1"],
            "dataset.vocabulary_budget_fraction",
            "",
        ),
    ],
)
def test_a_private_run_refuses_a_vocabulary_outside_its_epsilon(
    small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str], key: str, message: str
) -> None:
    monkeypatch.setenv("DPFL_DATA_HOME", str(tmp_path / "home"))
    words = tmp_path / "words.txt"
    words.write_text("\n".join(f"w{i} 3" for i in range(50)))
    with pytest.raises(ConfigError) as error:
        validated(small, *(e.format(words=words) for e in extra))
    assert error.value.key == key and message in str(error.value) and "\n" not in str(error.value)


def test_each_origin_is_recorded_and_a_counted_corpus_is_refused_for_a_private_run(
    small: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DPFL_DATA_HOME", str(tmp_path / "home"))
    words = tmp_path / "words.txt"
    words.write_text("\n".join(f"w{i} 3" for i in range(50)))

    def origin(*extra: str) -> str:
        return validated(small, *extra).data.dataset["vocabulary_choice"]["origin"]  # type: ignore[attr-defined]

    assert origin("strategy=fedavg") == "counted"
    assert origin("strategy=fedavg", f"dataset.vocabulary={words}") == "file"
    assert origin("strategy=dp_fedavg", f"dataset.vocabulary={words}", "dataset.vocabulary_public=true") == (
        "public_file"
    )
    assert origin("strategy=dp_fedavg", "privacy.epsilon=50") == "dp"
    converted = [f for f in (tmp_path / "home" / "text").iterdir() if (f / "meta.json").is_file()]
    counted = next(
        f
        for f in converted
        if not (meta := json.loads((f / "meta.json").read_text())["source"]).get("vocabulary")
        and not meta.get("release")
    )
    overrides = ["dataset=stackoverflow", f"dataset.path={counted}", "partition=natural", "num_clients=20"]
    with pytest.raises(ConfigError, match="counted on its training users, un-noised"):
        validate_config(compose_config([*overrides, "model=causal_transformer", "strategy=dp_fedavg"]))


def test_a_private_run_declares_its_number_of_classes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Integer labels declare no number of classes: a private run must set it (a ClassLabel does)."""
    import datasets
    from PIL import Image

    monkeypatch.setenv("DPFL_DATA_HOME", str(tmp_path / "home"))
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, size=(8, 8)).astype(np.uint8)) for _ in range(40)]
    labels = [i % 4 for i in range(40)]
    folders = {}
    for name, label in (("integers", datasets.Value("int64")), ("declared", datasets.ClassLabel(4))):
        features = datasets.Features({"image": datasets.Image(), "label": label})
        folders[name] = tmp_path / name
        datasets.Dataset.from_dict({"image": images, "label": labels}, features=features).save_to_disk(
            str(folders[name])
        )

    def run(folder: Path, *extra: str) -> object:
        overrides = ["dataset=hf", f"dataset.path={folder}", "partition=iid", "num_clients=4", "model=mlp"]
        return validate_config(compose_config([*overrides, *extra]))

    with pytest.raises(ConfigError) as error:
        run(folders["integers"], "strategy=dp_fedavg")
    assert error.value.key == "dataset.num_classes" and "counted from the clients' labels" in str(error.value)
    run(folders["integers"], "strategy=dp_fedavg", "dataset.num_classes=4")
    run(folders["integers"], "strategy=fedavg")  # not private: the labels may say
    run(folders["declared"], "strategy=dp_fedavg")  # the schema declares it


@pytest.mark.simulation
def test_a_resumed_secure_run_keeps_the_vocabulary_it_released(
    corpora: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``privacy.secure_rng`` a new draw would be a second, different release: a resumed run reads
    the release its checkpoint records and trains on those words (the charge is the first part's)."""
    import signal

    from fl_app.run import lifecycle
    from fl_app.run.reporter import RoundReporter

    monkeypatch.setenv("DPFL_DATA_HOME", str(tmp_path / "home"))
    overrides = [o for o in RUN if not o.startswith("privacy.noise_seed")]
    overrides = [*overrides, "num_rounds=2", "privacy.secure_rng=true", f"dataset.path={corpora[0]}"]
    after_round = RoundReporter.__call__

    def stop_after_round_one(self, server_round, arrays):
        metrics = after_round(self, server_round, arrays)
        if server_round == 1:
            lifecycle.request_stop(signal.SIGINT)
        return metrics

    monkeypatch.setattr(RoundReporter, "__call__", stop_after_round_one)
    output = tmp_path / "run"
    try:
        stopped = simulate_in_process(overrides, output, None)
    finally:
        lifecycle.STOP.clear()
        lifecycle._signal_received.clear()
    monkeypatch.setattr(RoundReporter, "__call__", after_round)
    assert stopped["status"] == "interrupted"
    released = stopped["privacy"]["vocabulary"]["release"]

    def drawn_again(*args, **kwargs):
        raise AssertionError("a resumed run drew its vocabulary again")

    monkeypatch.setattr("fl_app.config.data_choices.dp_release", drawn_again)
    resumed = simulate_in_process([f"resume={output}"], output, None)
    assert resumed["status"] == "completed" and [r["round"] for r in resumed["rounds"]] == [1, 2]
    assert resumed["privacy"]["vocabulary"]["release"] == released
    ledger = json.loads((output / resumed["privacy"]["vocabulary"]["ledger"]).read_text())
    assert [e["server_round"] for e in ledger["events"]] == [0]  # charged once, by the first part
