"""Clustering evaluation on Laplace-protected inference results (MindSpore Federated document).

Clients on real Messages, the stage on constructed replies, and a short real simulation of both
modes (NOT_ENCRYPT and LAPLACE).
"""

from __future__ import annotations

import json
import math
import uuid
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    FAST,
    INLINE,
    build_run_context,
    client_for,
    error_reply,
    make_context,
    make_message,
    reply_to,
    settings_of,
    spec_config,
)
from flwr.app import Array, ArrayRecord, ConfigRecord, MessageType
from scipy import stats
from sklearn.metrics import calinski_harabasz_score, silhouette_score

from clients.laplace_eval import (
    EVAL_SENSITIVITY,
    INFERENCE_REPORTS,
    LAPLACE_EVAL_EPS,
    PRIVACY_EVAL_TYPE,
    LaplaceEvalClient,
)
from fl_app import keys
from fl_app.config.compose import compose_config
from fl_app.config.validation import ConfigError, validate_config
from fl_app.data.federated import DataSpec, federated_data
from fl_app.engine.messages import set_message_id
from fl_app.learning.model_spec import ModelSpec
from fl_app.learning.training import model_to_arrays, predict_proba
from fl_app.privacy.mechanisms import probability_rows
from fl_app.run.server import evaluation_stage
from strategies.dp_fedavg import DPFedAvgStrategy
from strategies.fedavg import FedAvgStrategy
from strategies.laplace_eval.privacy import (
    PROBABILITY_VECTOR_L1_SENSITIVITY,
    laplace_epsilon_for_scale,
    laplace_epsilon_for_tail,
)
from strategies.laplace_eval.stage import LaplaceEvalStage, SensitivityWarning, clustering_scores

DIGITS = ["dataset=digits", "num_clients=6", "clients_per_round=3", "num_rounds=4"]
STAGE = [*DIGITS, "evaluation=laplace_eval"]
#: The MindSpore document's epsilon per report (+experiment=laplace_eval; no longer the default).
DOCUMENT = [*STAGE, "evaluation.laplace_eval_eps=230260"]


# ------------------------------------------------------------------ privacy core additions


def test_probability_vectors_have_l1_sensitivity_two_and_epsilon_follows_the_scale():
    one_hot = probability_rows(values=np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]))
    assert np.abs(one_hot[0] - one_hot[1]).sum() == PROBABILITY_VECTOR_L1_SENSITIVITY == 2.0
    rows = probability_rows(
        values=np.random.default_rng(0).dirichlet(np.ones(10), size=500).astype(np.float32)
    )
    assert rows.dtype == np.float64
    assert np.allclose(rows.sum(axis=1), 1.0, atol=1e-15)
    assert np.abs(rows[:, None, :] - rows[None, :, :]).sum(axis=2).max() <= 2.0
    with pytest.raises(ValueError, match="positive sum"):
        probability_rows(values=np.zeros((2, 3)))
    # The document's noise: scale 1/230260 (sensitivity 1) is epsilon 460520 for probability vectors.
    document_epsilon = laplace_epsilon_for_tail(tau=1e-5, probability=0.9, sensitivity=1.0)
    assert document_epsilon == pytest.approx(math.log(10) / 1e-5)
    assert laplace_epsilon_for_scale(scale=1.0 / document_epsilon, sensitivity=2.0) == pytest.approx(
        2 * document_epsilon
    )
    with pytest.raises(ValueError, match="scale"):
        laplace_epsilon_for_scale(scale=0.0, sensitivity=2.0)


# ------------------------------------------------------------------ client (real messages)


def _evaluate_message(mode: str, *, epsilon: float = 5.0, sensitivity: float = 2.0, seed: int = 7):
    config = {
        **spec_config(DIGITS),
        keys.ALGORITHM: "laplace_eval",
        PRIVACY_EVAL_TYPE: mode,
        keys.NOISE_SEED: seed,
    }
    if mode == "LAPLACE":
        config[LAPLACE_EVAL_EPS] = epsilon
        config[EVAL_SENSITIVITY] = sensitivity
    model = ModelSpec.from_json(config[keys.MODEL_SPEC]).build()
    message = make_message(config, model_to_arrays(model), message_type=MessageType.EVALUATE)
    return message, model, config


def _clear_vectors(model, config, partition: int) -> np.ndarray:
    data = federated_data(DataSpec.from_json(config[keys.DATA_SPEC])).client(partition)
    return probability_rows(values=predict_proba(model, data.x))


def test_client_uploads_only_the_noised_vectors():
    message, model, config = _evaluate_message("LAPLACE", epsilon=5.0)
    client = client_for(message, make_context(partition_id=1))
    assert isinstance(client, LaplaceEvalClient)
    reply = client.evaluate()
    content = reply.content
    # One ArrayRecord holding one array: no metrics (not even the example count), no configs.
    assert list(content.keys()) == [INFERENCE_REPORTS]
    assert len(content.metric_records) == 0
    assert len(content.config_records) == 0
    record = content.array_records[INFERENCE_REPORTS]
    assert len(record) == 1
    reports = next(iter(record.values())).numpy()
    clear = _clear_vectors(model, config, 1)
    assert reports.shape == clear.shape  # the shape (examples x classes) is all it shows
    assert reports.dtype == np.float64
    assert not np.any(np.isclose(reports, clear, rtol=0, atol=1e-12))  # every coordinate is noised
    assert reply.metadata.reply_to_message_id == message.metadata.message_id


def test_not_encrypt_adds_no_noise():
    message, model, config = _evaluate_message("NOT_ENCRYPT")
    reply = client_for(message, make_context(partition_id=2)).evaluate()
    reports = reply.content.array_records[INFERENCE_REPORTS]["softmax"].numpy()
    assert np.array_equal(reports, _clear_vectors(model, config, 2))


@pytest.mark.parametrize(("epsilon", "sensitivity"), [(5.0, 2.0), (1.0, 2.0), (230260.0, 1.0)])
def test_noise_scale_is_sensitivity_over_epsilon(epsilon, sensitivity):
    noises = []
    for partition in range(6):  # ~1800 vectors x 10 coordinates
        message, model, config = _evaluate_message("LAPLACE", epsilon=epsilon, sensitivity=sensitivity)
        reports = client_for(message, make_context(partition_id=partition)).evaluate()
        vectors = reports.content.array_records[INFERENCE_REPORTS]["softmax"].numpy()
        noises.append((vectors - _clear_vectors(model, config, partition)).ravel())
    noise = np.concatenate(noises)
    scale = sensitivity / epsilon
    assert np.mean(np.abs(noise)) == pytest.approx(scale, rel=0.03)  # E|X| = b; ~0.8% standard error
    assert abs(np.mean(noise)) < 5 * math.sqrt(2) * scale / math.sqrt(noise.size)
    assert stats.kstest(noise, stats.laplace(scale=scale).cdf).pvalue > 1e-3
    # The document's scale 1/epsilon (sensitivity 1) is a different distribution when sensitivity is 2.
    if sensitivity != 1.0:
        assert stats.kstest(noise, stats.laplace(scale=1.0 / epsilon).cdf).pvalue < 1e-6


def test_noise_differs_between_clients_and_rounds_and_uses_os_entropy_on_devices():
    message, _, _ = _evaluate_message("LAPLACE")
    first = client_for(message, make_context(partition_id=0)).evaluate()
    again = client_for(message, make_context(partition_id=0)).evaluate()
    a = first.content.array_records[INFERENCE_REPORTS]["softmax"].numpy()
    b = again.content.array_records[INFERENCE_REPORTS]["softmax"].numpy()
    assert np.array_equal(a, b)  # seeded simulation: reproducible
    client = client_for(message, make_context(partition_id=0))
    assert not client.noise_source.secure
    device = LaplaceEvalClient(message, make_context(partition_id=None, node_config={"data-path": "x"}))
    assert device.noise_source.secure
    assert device.noise_source.seed is None


# ------------------------------------------------------------------ the stage (constructed replies)


def _reports_reply(message, vectors: np.ndarray):
    return reply_to(message, extra={INFERENCE_REPORTS: ArrayRecord({"softmax": Array(vectors)})})


def test_stage_is_off_unless_configured(tmp_path):
    assert evaluation_stage(settings_of(DIGITS)) is None
    assert evaluation_stage(settings_of(STAGE)) is LaplaceEvalStage
    strategy = FedAvgStrategy(build_run_context(DIGITS, tmp_path))
    assert list(strategy.configure_evaluate(1, strategy.initial_arrays(), ConfigRecord(), grid=None)) == []


def test_server_scores_equal_scikit_learn_and_failures_are_charged(tmp_path):
    run = build_run_context([*DOCUMENT, "evaluation.cluster_client_num=4"], tmp_path)
    stage = LaplaceEvalStage(FedAvgStrategy(run))
    messages = list(stage.configure_evaluate(1, stage.initial_arrays(), ConfigRecord(), grid=None))
    assert len(messages) == 4
    config = messages[0].content.config_records[keys.CONFIG]
    assert config[keys.ALGORITHM] == "laplace_eval"
    assert config[LAPLACE_EVAL_EPS] == pytest.approx(230260.0)
    rng = np.random.default_rng(3)
    vectors = [rng.dirichlet(np.full(10, 0.3), size=n) + rng.laplace(0, 0.05, (n, 10)) for n in (40, 25, 60)]
    replies = [_reports_reply(m, v) for m, v in zip(messages[:3], vectors, strict=True)]
    replies.append(error_reply(messages[3]))
    metrics = stage.aggregate_evaluate(1, replies)
    everything = np.concatenate(vectors)
    labels = everything.argmax(axis=1)
    extras = stage.round_extras(1)
    assert extras["silhouette"] == pytest.approx(silhouette_score(everything, labels), rel=1e-12)
    assert extras["calinski_harabasz"] == pytest.approx(
        calinski_harabasz_score(everything, labels), rel=1e-12
    )
    assert metrics["silhouette"] == pytest.approx(extras["silhouette"])
    assert extras["cluster_eval_reports"] == 125
    assert extras["cluster_eval_failures"] == 1
    # All four sampled clients (the failed one included) were charged one report's epsilon.
    sampled = [c.client_id for c in stage.sample_clients(1)]
    for client in run.client_ids:
        assert stage.ledger.example_accountant.rounds_participated(client) == (1 if client in sampled else 0)
    assert extras["cluster_eval_epsilon"] == pytest.approx(230260.0)
    # the run writes the stage's ledger beside its own (the stage writes no file)
    ledger = stage.ledger.example_accountant.state_dict()
    assert stage.ledgers() == {"privacy_ledger_evaluation.json": ledger}  # FedAvg itself has none
    assert not (tmp_path / "privacy_ledger_evaluation.json").exists()


def test_clustering_scores_are_undefined_for_one_cluster_and_subsample_is_sklearns():
    one = clustering_scores(np.tile([[0.9, 0.1]], (5, 1)))
    assert one.silhouette is None
    assert one.calinski_harabasz is None
    assert one.clusters == 1
    rng = np.random.default_rng(1)
    reports = rng.dirichlet(np.full(4, 0.2), size=300)
    labels = reports.argmax(axis=1)
    scores = clustering_scores(reports, eval_types=["SILHOUETTE_SCORE"], silhouette_sample_size=100, seed=5)
    assert scores.calinski_harabasz is None
    assert scores.silhouette == silhouette_score(reports, labels, sample_size=100, random_state=5)


def test_accounting_is_separate_composes_per_round_and_corrects_the_document(tmp_path):
    overrides = [
        *STAGE,
        "strategy=dp_fedavg",
        "strategy.noise_multiplier=1.0",
        "evaluation.cluster_client_num=6",
        "evaluation.laplace_eval_eps=3",
    ]
    stage = LaplaceEvalStage(DPFedAvgStrategy(build_run_context(overrides, tmp_path)))
    arrays = stage.initial_arrays()
    for server_round in (1, 2, 3):
        list(stage.configure_train(server_round, arrays, ConfigRecord(), grid=None))
        stage.aggregate_train(server_round, [])
        messages = list(stage.configure_evaluate(server_round, arrays, ConfigRecord(), grid=None))
        stage.aggregate_evaluate(server_round, [error_reply(m) for m in messages])
    # rounds[].epsilon is the total per client: training plus every evaluated client's 6-ish
    # vectors x 3 evaluations at epsilon 3 each (client level); epsilon_training is training alone.
    report = stage.report_round(3)  # what the platform reads: only the contract
    training = stage.inner.epsilon()
    assert report.training_epsilon == training
    sizes = {info.client_id: info.num_examples for info in stage.run.roster}
    evaluation_basic = 3 * 3.0 * max(sizes.values())
    assert stage.ledger.client_epsilon() <= evaluation_basic + 1e-6
    assert report.epsilon.epsilon <= training.epsilon + evaluation_basic + 1e-6
    assert report.epsilon.epsilon > training.epsilon
    assert set(stage.ledgers()) == {"privacy_ledger.json", "privacy_ledger_evaluation.json"}
    assert not hasattr(stage, "noise_multiplier")  # only the contract is forwarded, by name
    extras = report.extras
    assert extras["cluster_eval_epsilon_per_report"] == pytest.approx(3.0)
    assert extras["cluster_eval_epsilon"] <= 9.0 + 1e-9  # 3 evaluations, basic composition 9
    assert extras["cluster_eval_epsilon"] > 8.5
    assert "update_norm_median" not in extras  # un-noised: only in the training strategy's diagnostics
    assert "update_norm_median" in report.diagnostics  # the training strategy's, outside the guarantee
    summary = stage.report_run(stage.initial_arrays()).privacy.summary
    assert summary["unit"] == stage.inner.privacy_unit
    assert summary["evaluation"]["max_evaluations_per_client"] == 3
    assert summary["evaluation"]["epsilon_cumulative_basic"] == pytest.approx(9.0)
    # The document's sensitivity 1 halves the noise: the report says so and charges twice the epsilon.
    with pytest.warns(SensitivityWarning, match="460520"):
        document = LaplaceEvalStage(
            FedAvgStrategy(build_run_context([*DOCUMENT, "evaluation.sensitivity=1"], tmp_path))
        )
    assert document.plan.scale == pytest.approx(1 / 230260)
    assert document.plan.epsilon_per_report == pytest.approx(460520)
    clear = LaplaceEvalStage(
        FedAvgStrategy(build_run_context([*STAGE, "evaluation.privacy_eval_type=NOT_ENCRYPT"], tmp_path))
    )
    messages = list(clear.configure_evaluate(1, arrays, ConfigRecord(), grid=None))
    assert LAPLACE_EVAL_EPS not in messages[0].content.config_records[keys.CONFIG]
    clear.aggregate_evaluate(1, [error_reply(m) for m in messages])
    assert clear.round_extras(1)["cluster_eval_epsilon"] is None  # clear reports: no finite guarantee
    assert clear.ledger.example_accountant.events == []


def test_stage_keeps_federated_evaluation_and_routes_replies(tmp_path):
    run = build_run_context(
        [*STAGE, "evaluation.federated_fraction=0.5", "evaluation.cluster_client_num=3"], tmp_path
    )
    inner = FedAvgStrategy(run)
    marker = ArrayRecord({"w": Array(np.zeros(3, dtype=np.float32))})
    inner.arrays_for_evaluation = lambda arrays: marker  # e.g. a BNN binarizes what is evaluated
    stage = LaplaceEvalStage(inner)
    messages = list(stage.configure_evaluate(1, stage.initial_arrays(), ConfigRecord(), grid=None))
    algorithms = [m.content.config_records[keys.CONFIG][keys.ALGORITHM] for m in messages]
    assert algorithms == ["fedavg"] * 3 + ["laplace_eval"] * 3
    assert messages[-1].content.array_records[keys.ARRAYS] is marker
    for message in messages:  # as the grid does when it sends them
        set_message_id(message, uuid.uuid4().hex)
    federated = [
        reply_to(m, metrics={keys.NUM_EXAMPLES: 10, keys.EVAL_LOSS: 1.0, keys.EVAL_ACCURACY: 0.5})
        for m in messages[:3]
    ]
    vectors = np.eye(10)[np.arange(30) % 10] * 0.9 + 0.01
    ours = [
        _reports_reply(messages[3], vectors),
        _reports_reply(messages[4], vectors),
        error_reply(messages[5]),
    ]
    metrics = stage.aggregate_evaluate(1, federated + ours)
    assert metrics["federated-eval-accuracy"] == pytest.approx(0.5)
    assert stage.round_extras(1)["cluster_eval_reports"] == 60
    assert stage.round_extras(1)["cluster_eval_failures"] == 1


def test_invalid_stage_settings_fail_in_one_line():
    cases = {
        "evaluation.privacy_eval_type=ENCRYPT": "evaluation.privacy_eval_type",
        "evaluation.sensitivity=0.5": "evaluation.sensitivity",
        "evaluation.laplace_eval_eps=0": "evaluation.laplace_eval_eps",
        "evaluation.eval_type=[SILHOUETTE]": "evaluation.eval_type",
        "evaluation.cluster_client_num=0": "evaluation.cluster_client_num",
        "evaluation.stage=nope": "evaluation.stage",
    }
    for override, key in cases.items():
        with pytest.raises(ConfigError) as caught:
            validate_config(compose_config([*STAGE, override]), check_data=False)
        assert caught.value.key == key
        assert "\n" not in str(caught.value)


# ------------------------------------------------------------------ a real simulation of both modes


@pytest.mark.simulation
def test_simulation_in_both_modes(simulate):
    common = [*FAST, INLINE, "evaluation=laplace_eval", "evaluation.cluster_client_num=4"]
    clear = simulate([*common, "evaluation.privacy_eval_type=NOT_ENCRYPT"], name="clear")
    noised = simulate([*common, "evaluation.laplace_eval_eps=1"], name="laplace")
    for results in (clear, noised):
        assert results["status"] == "completed"
        assert [r["cluster_eval_clients"] for r in results["rounds"]] == [4, 4]
        assert all(r["cluster_eval_failures"] == 0 for r in results["rounds"])
        assert all(r["epsilon"] is None for r in results["rounds"])  # FedAvg trains without privacy
        assert all(r["evaluate_upload_bytes"] > 0 for r in results["rounds"])
    # The evaluation does not touch training: same losses (up to the order in which replies are
    # averaged), different (noised) scores.
    assert [r["train_loss"] for r in clear["rounds"]] == pytest.approx(
        [r["train_loss"] for r in noised["rounds"]], rel=1e-5
    )
    assert [r["silhouette"] for r in clear["rounds"]] != [r["silhouette"] for r in noised["rounds"]]
    assert all(r["cluster_eval_epsilon"] is None for r in clear["rounds"])
    assert [r["cluster_eval_epsilon"] for r in noised["rounds"]] == pytest.approx([1.0, 2.0], rel=1e-4)
    assert noised["privacy"]["evaluation"]["epsilon_per_report"] == pytest.approx(1.0)
    assert clear["privacy"]["evaluation"]["epsilon_per_report"] is None
    assert noised["privacy"]["evaluation"]["unit"].startswith("one local example's inference result")
    # the run writes the stage's ledger (every evaluation round's event) beside the training's
    ledger = json.loads((Path(noised["_output_dir"]) / "privacy_ledger_evaluation.json").read_text())
    assert [event["server_round"] for event in ledger["events"]] == [1, 2]
    assert not (Path(clear["_output_dir"]) / "privacy_ledger_evaluation.json").exists()
