"""The large-cohort convention (``strategy.noise_cohort_size``): its noise, its refusals, its statements.

A run with ``strategy.noise_cohort_size=M`` simulates a deployment with Poisson cohorts of ``M``: the
noise on the sum of its own cohort of ``m`` has std ``z C m / M``, ``z`` and the epsilon are the
deployment's, and every place that prints the epsilon (the header, ``results.json``, the last line,
TensorBoard, MLflow, W&B, the report) says that it holds for that deployment, not for the run's model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import FAST, INLINE, build_run_context, reply_to, settings_of, simulate_in_process
from flwr.app import Array, ArrayRecord, ConfigRecord
from tracked import mlflow_run, mlflow_store, offline_wandb, wandb_run

from fl_app import keys
from fl_app.config.checks import ConfigError
from fl_app.config.compose import compose_config
from fl_app.config.validation import validate_config
from fl_app.learning.model_spec import ModelSpec
from fl_app.privacy.calibration import dp_fedavg_noise_multiplier, gaussian_epsilon
from fl_app.privacy.events import SampledGaussian
from fl_app.report.tracking import TrackedRun, make_tracker
from fl_app.run.results import RunRecorder
from strategies.dp_fedavg import DPFedAvgStrategy

#: 20 digits clients, fixed cohorts of 4, noise for cohorts of 16.
SMALL = ["dataset=digits", "num_clients=20", "clients_per_round=4", "num_rounds=3", "strategy=dp_fedavg"]
LARGE = [*SMALL, "strategy.sampling=fixed", "strategy.noise_cohort_size=16"]
STATEMENT = (
    "simulates a deployment with cohorts of 16: the epsilon holds for that deployment, not for this run's "
    "model"
)
SHAPE = (300, 300)  # 90,000 noise draws a round: the std measured to about 0.3 %


def _arrays(value: float) -> ArrayRecord:
    return ArrayRecord({"w": Array(np.full(SHAPE, value, dtype=np.float64))})


def released_noise(strategy: DPFedAvgStrategy, server_round: int = 1) -> np.ndarray:
    """The change of the model in a round where every client returns it unchanged: the noise / m."""
    start = _arrays(0.0)
    messages = list(strategy.configure_train(server_round, start, ConfigRecord(), grid=None))
    replies = [reply_to(m, arrays=_arrays(0.0), metrics={keys.NUM_EXAMPLES: 5}) for m in messages]
    arrays, _ = strategy.aggregate_train(server_round, replies)
    return arrays["w"].numpy().ravel() - 0.0


def test_the_noise_on_the_sum_is_z_c_m_over_m(tmp_path: Path) -> None:
    """Through the strategy: the sum of the 4 updates meets noise z C 4/16; the average z C / 16."""
    z, clip = 2.0, 0.5
    common = [f"strategy.noise_multiplier={z}", f"strategy.clip={clip}"]
    strategy = DPFedAvgStrategy(build_run_context([*LARGE, *common], tmp_path / "large"))
    noise = released_noise(strategy)
    m = len(strategy.replies.selected(1))
    assert m == 4 and strategy.denominator == 4
    on_the_sum = float(np.std(noise * m))
    assert on_the_sum == pytest.approx(z * clip * 4 / 16, rel=0.02)
    assert float(np.std(noise)) == pytest.approx(z * clip / 16, rel=0.02)  # the deployment's average
    # the same run without the option: the sum meets z C, four times more (a 2x error is far outside)
    plain = DPFedAvgStrategy(build_run_context([*SMALL, "strategy.sampling=fixed", *common], tmp_path / "p"))
    assert float(np.std(released_noise(plain) * 4)) == pytest.approx(z * clip, rel=0.02)


def test_the_accountant_charges_the_deployments_rounds_to_every_client(tmp_path: Path) -> None:
    """z is calibrated for Poisson cohorts of 16 of the 20 clients (q = 0.8); every client is charged."""
    strategy = DPFedAvgStrategy(build_run_context([*LARGE, "privacy.epsilon=4"], tmp_path))
    z = dp_fedavg_noise_multiplier(epsilon=4.0, delta=1e-5, sampling_rate=0.8, rounds=3, method="pld")
    assert strategy.noise_multiplier == pytest.approx(z)
    assert strategy.sum_noise_multiplier == pytest.approx(z * 4 / 16)
    for server_round in (1, 2, 3):
        released_noise(strategy, server_round)
    expected = gaussian_epsilon(noise_multiplier=z, sampling_rate=0.8, rounds=3, delta=1e-5, method="pld")
    assert strategy.epsilon().epsilon == pytest.approx(expected, rel=1e-9)
    assert expected <= 4.0
    events = strategy.accountant.events
    assert [e.server_round for e in events] == [1, 2, 3]
    assert all(e.participants is None and e.mechanism == SampledGaussian(z, 0.8) for e in events)
    assert not strategy.secret_cohort  # the run's own cohorts are public (seeded, fixed size)


def test_a_deployment_population_sets_the_rate(tmp_path: Path) -> None:
    """``strategy.noise_population``: cohorts of 16 of 1,600 clients (q = 0.01)."""
    run = build_run_context([*LARGE, "strategy.noise_population=1600", "privacy.epsilon=2"], tmp_path)
    strategy = DPFedAvgStrategy(run)
    assert strategy.deployment.rate == pytest.approx(0.01)
    assert strategy.noise_multiplier == pytest.approx(
        dp_fedavg_noise_multiplier(epsilon=2.0, delta=1e-5, sampling_rate=0.01, rounds=3, method="pld")
    )


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (["strategy.noise_cohort_size=16"], "strategy.noise_cohort_size", "needs strategy.sampling=fixed"),
        (
            ["strategy.sampling=balanced", "strategy.noise_cohort_size=16"],
            "strategy.noise_cohort_size",
            "fixed",
        ),
        (["strategy.sampling=fixed", "strategy.noise_cohort_size=4"], "strategy.noise_cohort_size", "exceed"),
        (["strategy.sampling=fixed", "strategy.noise_cohort_size=40"], "num_clients", "hold a cohort"),
        (
            ["strategy.sampling=fixed", "strategy.noise_cohort_size=40", "strategy.noise_population=30"],
            "strategy.noise_population",
            "hold a cohort",
        ),
        (["strategy.noise_population=100"], "strategy.noise_population", "set strategy.noise_cohort_size"),
        (
            ["strategy.sampling=fixed", "strategy.noise_cohort_size=16", "privacy.canaries=4"],
            "privacy.canaries",
            "must be 0",
        ),
        (["strategy.sampling=fixed", "strategy.noise_cohort_size=2.5"], "strategy.noise_cohort_size", ""),
    ],
)
def test_refused_before_anything_starts(overrides: list[str], key: str, says: str) -> None:
    """Secret (Poisson) or planned cohorts, a noise cohort not above the cohort, a population too small."""
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as raised:
        validate_config(compose_config([*SMALL, *overrides]))
    assert says in str(raised.value)


def test_refused_on_real_devices(tmp_path: Path) -> None:
    """On devices the cohort is the deployment's own: noise scaled down for a larger one is refused."""
    run = build_run_context(LARGE, tmp_path)
    devices = [dataclasses.replace(info, device=True) for info in run.roster]
    with pytest.raises(ConfigError, match=r"strategy\.noise_cohort_size.*simulation convention"):
        DPFedAvgStrategy(dataclasses.replace(run, roster=devices))


def test_the_header_and_the_results_say_whose_epsilon_it_is(tmp_path: Path, caplog: Any) -> None:
    strategy = DPFedAvgStrategy(build_run_context(LARGE, tmp_path))
    with caplog.at_level(logging.INFO, logger="flwr"):
        strategy.describe()
    privacy_line = next(line for line in caplog.messages if "privacy: unit=" in line)
    assert privacy_line.endswith(STATEMENT)
    released_noise(strategy)
    report = strategy.report_run(_arrays(0.0)).privacy.as_dict()
    assert report["total"]["holds_for"] == STATEMENT
    deployment = report["simulated_deployment"]
    assert deployment["statement"] == STATEMENT and deployment["noise_cohort_size"] == 16
    assert deployment["sampling_rate"] == pytest.approx(0.8)
    assert "no epsilon of this run covers its model" in deployment["this_run"]
    plain = DPFedAvgStrategy(build_run_context([*SMALL, "strategy.sampling=fixed"], tmp_path / "plain"))
    assert "holds_for" not in plain.report_run(_arrays(0.0)).privacy.as_dict()["total"]


def _tracked(out: Path, tracking: list[str], **keys: str) -> dict[str, Any]:
    """A two-round record of a large-cohort run through a RunRecorder and the named trackers."""
    settings = settings_of([*LARGE, *(f"{k.replace('__', '.')}={v}" for k, v in keys.items())])
    tracked = TrackedRun("dp_fedavg seed 42", dict(settings.config), settings.tracker)
    tracker = make_tracker(tracking, out, config_text=settings.to_yaml(), run=tracked)
    recorder = RunRecorder(out, settings, tracker=tracker)
    recorder.add_initial({"accuracy": 0.1, "loss": 2.3})
    for step in (1, 2):
        recorder.add_round({"round": step, "accuracy": 0.5, "loss": 1.0, "epsilon": 0.5 * step})
    privacy = {
        "unit": "one client",
        "mechanism": "Gaussian",
        "total": {"epsilon": 1.0, "holds_for": STATEMENT},
    }
    return recorder.finalize(
        strategy="dp_fedavg",
        privacy=privacy,
        final_extras={},
        arrays=None,
        model_spec=ModelSpec("mlp", (1, 8, 8), 10),
        ledger=None,
        wall_s=1.0,
    )


def tensorboard_text(log_dir: Path, tag: str) -> str:
    """The text TensorBoard holds under ``tag`` (read with its own event reader)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    events.Reload()
    (event,) = events.Tensors(f"{tag}/text_summary")
    return event.tensor_proto.string_val[0].decode()


def test_tensorboard_and_mlflow_say_it(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    uri = mlflow_store(tmp_path_factory, tmp_path / "store")
    _tracked(tmp_path / "run", ["tensorboard", "mlflow"], tracker__mlflow_uri=uri)
    assert f"privacy.total.holds_for: {STATEMENT}" in tensorboard_text(
        tmp_path / "run" / "tensorboard", "final"
    )
    assert mlflow_run(tmp_path / "run")["tags"]["dpfl.privacy.holds_for"] == STATEMENT


@pytest.mark.subprocess  # W&B's core runs as a service process
def test_wandb_says_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    offline_wandb(monkeypatch, tmp_path / "wandb_home")
    _tracked(tmp_path / "run", ["wandb"])
    assert wandb_run(tmp_path / "run")["summary"]["privacy.total.holds_for"] == STATEMENT


def test_the_report_gives_such_runs_their_own_table(tmp_path: Path) -> None:
    """A deployment's epsilon is not comparable with a run's: its own heading says whose it is."""
    from fl_app.report.sweep import main as report

    for name, holds_for in (("deployment", STATEMENT), ("own", None)):
        results = json.loads(json.dumps(_tracked(tmp_path / "runs" / name, [])))
        results["strategy"] = "dp_fedavg"
        if holds_for is None:  # a run of its own epsilon: another configuration
            del results["privacy"]["total"]["holds_for"]
            results["config"]["strategy"]["noise_cohort_size"] = None
        (tmp_path / "runs" / name / "results.json").write_text(json.dumps(results))
    report(["--out", str(tmp_path / "report"), str(tmp_path / "runs")])
    text = (tmp_path / "report" / "report.md").read_text()
    headings = [line for line in text.splitlines() if line.startswith("### Privacy unit:")]
    assert sorted(headings) == ["### Privacy unit: one client", f"### Privacy unit: one client; {STATEMENT}"]


@pytest.mark.simulation  # a whole run (inline: no Ray), the platform's header, files and last line
def test_a_run_says_it_everywhere(tmp_path: Path) -> None:
    overrides = [
        *FAST,
        INLINE,
        "strategy=dp_fedavg",
        "strategy.sampling=fixed",
        "strategy.noise_cohort_size=5",
        "strategy.noise_population=50",
        "tracking=tensorboard",
    ]
    statement = STATEMENT.replace("cohorts of 16", "cohorts of 5")
    results = simulate_in_process(overrides, tmp_path / "run", None)
    assert results["status"] == "completed"
    assert results["privacy"]["total"]["holds_for"] == statement
    z = results["privacy"]["noise_multiplier"]
    spent = gaussian_epsilon(noise_multiplier=z, sampling_rate=0.1, rounds=2, delta=1e-5, method="pld")
    assert results["final"]["epsilon"] == pytest.approx(spent, rel=1e-9)
    log = (tmp_path / "run" / "run.log").read_text().splitlines()
    assert any("privacy: unit=" in line and line.endswith(statement) for line in log)
    assert any("dpfl: finished" in line and statement in line for line in log)
    assert statement in tensorboard_text(tmp_path / "run" / "tensorboard", "final")


def test_dp_flower_takes_it_too(tmp_path: Path) -> None:
    """``dp_flower`` (DP-FedAvg's release under a Flower server step, e.g. pfl's adaptive optimiser)."""
    from strategies.dp_flower import DPFlowerStrategy

    overrides = [*LARGE, "strategy=dp_flower", "strategy.noise_multiplier=2.0"]
    strategy = DPFlowerStrategy(build_run_context(overrides, tmp_path))
    assert strategy.sum_noise_multiplier == pytest.approx(2.0 * 4 / 16)
    assert strategy.epsilon_holds_for() == STATEMENT
