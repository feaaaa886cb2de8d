"""The ServerApp's body: compose, validate, build the strategy, run it, write results.

Both entry points end here: ``flwr run .`` through ``fl_app.server_app:app`` and
``python -m fl_app`` through :mod:`fl_app.simulation`, which starts the same
ServerApp with the overrides in its run config.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import time
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid
from flwr.supercore import log
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fl_app import keys
from fl_app.config import RUN_CONFIG_OUTPUT_DIR, compose_config, freeze, overrides_from_run_config
from fl_app.data.federated import DataSpec, federated_data
from fl_app.metering import MeteredGrid
from fl_app.models import ModelSpec
from fl_app.privacy.rng import RandomSource
from fl_app.registry import Registry
from fl_app.results import RunRecorder
from fl_app.roster import discover_roster, on_devices
from fl_app.run_context import RunContext, output_path
from fl_app.validation import require_choice, validate_config
from strategies import STRATEGIES
from strategies.base import FederatedStrategy

LOG_FILE = "run.log"

#: Evaluation stages: classes in ``strategies/`` decorated ``@register_evaluation_stage(name)`` that
#: wrap the built strategy when ``evaluation.stage`` names them (absent or null: no stage). A stage
#: has a classmethod ``validate_config(cfg)`` and is built as ``Stage(strategy)``.
EVALUATION_STAGES: Registry[Any] = Registry("evaluation stage", "strategies")
register_evaluation_stage = EVALUATION_STAGES.register


def evaluation_stage(cfg: DictConfig) -> Any | None:
    """The (validated) evaluation stage class ``evaluation.stage`` names, or None."""
    name = cfg.evaluation.get("stage")
    if name is None:
        return None
    stage = EVALUATION_STAGES.get(require_choice("evaluation.stage", name, EVALUATION_STAGES.names()))
    stage.validate_config(cfg)
    return stage


def run_federation(grid: Grid, context: Context) -> None:
    """ServerApp main: compose the configuration from the run config and execute it."""
    overrides = overrides_from_run_config(context.run_config)
    try:
        cfg = compose_config(overrides)
        validate_config(cfg)
        evaluation_stage(cfg)
    except (HydraException, OmegaConfBaseException, ValueError) as error:
        # One line, no traceback, nothing written. (Under `flwr run` a raised
        # exception would print a traceback and SystemExit is swallowed.)
        log(ERROR, "invalid configuration, nothing was run: %s", " ".join(str(error).split()))
        return
    configured = str(context.run_config.get(RUN_CONFIG_OUTPUT_DIR, "") or "")
    if configured:
        output_dir = output_path(configured)
    elif cfg.output_dir is not None:
        output_dir = output_path(cfg.output_dir)
    else:
        stamp = dt.datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
        output_dir = output_path(f"outputs/flwr/{stamp}-{context.run_id}")
    execute(grid, cfg, output_dir)


def noise_source(cfg: DictConfig) -> RandomSource:
    """Privacy-noise randomness of a run: OS entropy, or the noise seed (default: ``seed``)."""
    if cfg.privacy.secure_rng:
        return RandomSource(seed=None, secure=True)
    seed = cfg.privacy.noise_seed if cfg.privacy.noise_seed is not None else cfg.seed
    return RandomSource(seed=int(seed), secure=False)


def with_secure_noise(cfg: DictConfig) -> DictConfig:
    """``cfg`` with ``privacy.secure_rng=true`` and ``privacy.noise_seed=null``.

    Used when the roster shows real devices: they draw their noise from OS
    entropy whatever the server says, and the server's own noise (e.g.
    DP-FedAvg's) must not come from a seed anyone reading the configuration
    knows. The results then record the setting that was in force.
    """
    if cfg.privacy.noise_seed is not None:
        log(WARNING, "privacy.noise_seed=%s ignored: real devices use OS entropy", cfg.privacy.noise_seed)
    container = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(container, dict)
    container["privacy"]["secure_rng"] = True
    container["privacy"]["noise_seed"] = None
    return freeze(OmegaConf.create(container))


def execute(grid: Grid, cfg: DictConfig, output_dir: Path) -> dict[str, Any]:
    """Run one federated training as configured and write its results into ``output_dir``."""
    output_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(output_dir / LOG_FILE)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    flower_logger = logging.getLogger("flwr")
    flower_logger.addHandler(handler)
    # Flower's logger has its own console handler. In Flower's simulation process
    # something also configures the root logger (seen under `flwr run`: every line
    # again as "INFO:flwr:..."), so keep Flower's records off the root while we run.
    propagate, flower_logger.propagate = flower_logger.propagate, False
    try:
        return _execute(grid, cfg, output_dir)
    finally:
        flower_logger.propagate = propagate
        flower_logger.removeHandler(handler)
        handler.close()


def _execute(grid: Grid, cfg: DictConfig, output_dir: Path) -> dict[str, Any]:
    started = time.monotonic()
    log(
        INFO,
        "dpfl: strategy=%s dataset=%s partition=%s, output in %s",
        cfg.strategy.name,
        cfg.dataset.name,
        cfg.partition.name,
        output_dir,
    )
    data_spec = DataSpec.from_config(cfg)
    data = federated_data(data_spec)
    strategy_class = STRATEGIES.get(str(cfg.strategy.name))
    model_spec = ModelSpec(
        strategy_class.resolve_model(cfg, data.input_shape), data.input_shape, data.num_classes
    )
    metered = MeteredGrid(grid)
    roster = discover_roster(
        metered,
        expected=int(cfg.num_clients),
        timeout=float(cfg.simulation.timeout),
        config=ConfigRecord({keys.DATA_SPEC: data_spec.to_json(), keys.SEED: int(cfg.seed)}),
    )
    setup_traffic = metered.take()
    if on_devices(roster) and not cfg.privacy.secure_rng:
        log(INFO, "dpfl: the clients are real devices: noise from OS entropy (privacy.secure_rng=true)")
        cfg = with_secure_noise(cfg)
    run = RunContext(
        cfg=cfg,
        roster=roster,
        data=data,
        data_spec=data_spec,
        model_spec=model_spec,
        randomness=RandomSource(seed=int(cfg.seed)),
        noise=noise_source(cfg),
        output_dir=output_dir,
    )
    strategy = strategy_class(run)
    stage = evaluation_stage(cfg)
    if stage is not None:
        strategy = stage(strategy)
    recorder = RunRecorder(output_dir, cfg)
    test = data.test()
    x_test, y_test = test.x, test.y
    if cfg.evaluation.test_subset is not None and cfg.evaluation.test_subset < len(y_test):
        rows = run.randomness.generator("test-subset").choice(
            len(y_test), size=int(cfg.evaluation.test_subset), replace=False
        )
        x_test, y_test = x_test[np.sort(rows)], y_test[np.sort(rows)]
    reporter = RoundReporter(
        strategy,
        metered,
        recorder,
        x_test,
        y_test,
        num_rounds=int(cfg.num_rounds),
        every=int(cfg.evaluation.every),
    )
    result = strategy.start(
        grid=metered,
        initial_arrays=strategy.initial_arrays(),
        num_rounds=int(cfg.num_rounds),
        timeout=float(cfg.simulation.timeout),
        evaluate_fn=reporter,
    )
    final_arrays = result.arrays if len(result.arrays) else None
    results = recorder.finalize(
        strategy=str(cfg.strategy.name),
        privacy=strategy.privacy_summary(),
        final_extras={
            **strategy.final_extras(),
            "setup_bytes": int(
                setup_traffic.get("query_download_bytes", 0) + setup_traffic.get("query_upload_bytes", 0)
            ),
        },
        arrays=final_arrays,
        model_spec=model_spec,
        ledger=None if strategy.accountant is None else strategy.accountant.state_dict(),
        wall_s=time.monotonic() - started,
    )
    log(
        INFO,
        "dpfl: finished %d rounds in %s; final accuracy %s, epsilon %s; results in %s",
        len(results["rounds"]),
        _clock(time.monotonic() - started),
        _fmt(results["final"]["accuracy"]),
        _fmt(results["final"]["epsilon"]),
        output_dir,
    )
    return results


class RoundReporter:
    """Flower's ``evaluate_fn``: evaluate, account, meter, log and record each round."""

    def __init__(
        self,
        strategy: FederatedStrategy,
        grid: MeteredGrid,
        recorder: RunRecorder,
        x_test: np.ndarray,
        y_test: np.ndarray,
        *,
        num_rounds: int,
        every: int,
    ) -> None:
        self.strategy = strategy
        self.grid = grid
        self.recorder = recorder
        self.x_test, self.y_test = x_test, y_test
        self.num_rounds = num_rounds
        self.every = every
        self.started = self.last = time.monotonic()
        self.durations: list[float] = []

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Called by ``Strategy.start`` before round 1 (round 0) and after every round."""
        if server_round == 0:
            loss, accuracy = self.strategy.evaluate_global(arrays, self.x_test, self.y_test)
            self.recorder.initial = {"accuracy": accuracy, "loss": loss}
            self.grid.take()
            self.started = self.last = time.monotonic()
            return MetricRecord({"accuracy": accuracy, "loss": loss})
        evaluate = server_round % self.every == 0 or server_round == self.num_rounds
        loss, accuracy = (
            self.strategy.evaluate_global(arrays, self.x_test, self.y_test) if evaluate else (None, None)
        )
        epsilon = self.strategy.epsilon()
        traffic = self.grid.take()
        now = time.monotonic()
        self.durations.append(now - self.last)
        record: dict[str, Any] = {
            "round": server_round,
            "accuracy": accuracy,
            "loss": loss,
            "epsilon": None if epsilon is None else epsilon.epsilon,
            "epsilon_method": None if epsilon is None else epsilon.method,
            "epsilon_rdp": None if epsilon is None else epsilon.rdp,
            "epsilon_pld": None if epsilon is None else epsilon.pld,
            "epsilon_basic": None if epsilon is None else epsilon.basic,
            "upload_bytes": int(traffic.get("train_upload_bytes", 0)),
            "download_bytes": int(traffic.get("train_download_bytes", 0)),
            "upload_array_bytes": int(traffic.get("train_upload_array_bytes", 0)),
            "download_array_bytes": int(traffic.get("train_download_array_bytes", 0)),
            "clients": len(self.strategy.selected(server_round)),
            "failures": len(self.strategy.round_failures(server_round)),
            "wall_s": now - self.started,
            "round_s": now - self.last,
        }
        if traffic.get("evaluate_messages"):
            record["evaluate_upload_bytes"] = int(traffic.get("evaluate_upload_bytes", 0))
            record["evaluate_download_bytes"] = int(traffic.get("evaluate_download_bytes", 0))
        record.update(self.strategy.round_extras(server_round))
        self.recorder.add_round(record)
        self.last = now
        remaining = float(np.mean(self.durations)) * (self.num_rounds - server_round)
        log(
            INFO,
            "dpfl round %d/%d: accuracy %s, loss %s, epsilon %s (delta %g) | elapsed %s, remaining ~%s",
            server_round,
            self.num_rounds,
            _fmt(accuracy),
            _fmt(loss),
            _fmt(record["epsilon"], "inf (not private)"),
            self.strategy.run.delta,
            _clock(now - self.started),
            _clock(remaining),
        )
        metrics = {
            k: float(v)
            for k, v in (("accuracy", accuracy), ("loss", loss), ("epsilon", record["epsilon"]))
            if v is not None
        }
        return MetricRecord(metrics)


def _fmt(value: float | None, missing: str = "-") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return missing
    return f"{value:.4g}"


def _clock(seconds: float) -> str:
    return str(dt.timedelta(seconds=round(seconds)))
