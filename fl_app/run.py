"""The ServerApp's body: compose, validate, build the strategy, run it, write results.

Both entry points end here: ``flwr run .`` through ``fl_app.server_app:app`` and
``python -m fl_app`` through :mod:`fl_app.simulation`, which starts the same
ServerApp with the overrides in its run config.
"""

from __future__ import annotations

import datetime as dt
import logging
import math
import sys
import time
from collections.abc import Sequence
from logging import ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fl_app import keys
from fl_app.checkpoint import (
    CHECKPOINT_FILE,
    Checkpoint,
    load_checkpoint,
    remove_checkpoint,
    restore_rng_states,
    rng_states,
    save_checkpoint,
)
from fl_app.config import (
    RUN_CONFIG_OUTPUT_DIR,
    compose_config,
    overrides_from_run_config,
    with_values,
)
from fl_app.config_checks import ConfigError
from fl_app.data.federated import DataSpec, FederatedData, federated_data
from fl_app.engine.dispatch import is_in_memory_grid, simulated_partitions
from fl_app.engine.logs import colour_only_at_a_terminal, console_filter
from fl_app.files import WriteFailed, one_modification_time, write_failed
from fl_app.fingerprint import config_fingerprint
from fl_app.lifecycle import (
    DIVERGENCE_FACTOR,
    Outcome,
    RunFailed,
    RunStopped,
    as_requested_stop,
    driver_reports_outcome,
    record_outcome,
    take_outcome,
)
from fl_app.metering import MeteredGrid
from fl_app.model_spec import ModelSpec
from fl_app.output_claim import claim_output_dir
from fl_app.privacy.canaries import HEADER_NOTE as CANARY_HEADER
from fl_app.privacy.rng import RandomSource, derive_noise_seed
from fl_app.results import (
    LEDGER_FILE,
    RunRecorder,
    chance_accuracy,
    short_unit,
    write_json,
)
from fl_app.resume import checkpoint_overrides
from fl_app.roster import ClientInfo, discover_roster, on_devices
from fl_app.round_loop import check_round, run_rounds
from fl_app.run_context import RunContext, output_path
from fl_app.run_log import PublishedLogFilter, one_line_console, run_log_handler, withheld_from_file
from fl_app.run_settings import RunSettings
from fl_app.timeline import mark
from fl_app.tracking import make_tracker
from fl_app.validation import validate_config
from strategies import EVALUATION_STAGES, STRATEGIES
from strategies.contract import Strategy

LOG_FILE = "run.log"


def evaluation_stage(cfg: DictConfig) -> Any | None:
    """The evaluation stage class ``evaluation.stage`` names (checked by ``validate_config``), or None."""
    name = cfg.evaluation.get("stage")
    return None if name is None else EVALUATION_STAGES.get(str(name))


def run_federation(grid: Grid, context: Context, composed: DictConfig | None = None) -> None:
    """ServerApp main: execute the run's configuration.

    ``composed``: a local simulation's job, composed and validated once (``python -m fl_app``);
    otherwise (``flwr run``, deployments) it is composed from the run config's overrides.
    """
    overrides = overrides_from_run_config(context.run_config)
    try:
        cfg = composed
        if cfg is None:
            cfg = compose_config(overrides)
            validate_config(cfg)
    except (HydraException, OmegaConfBaseException, ValueError) as error:
        # One line, nothing written. Under `flwr run` the ServerApp then raises, so that
        # `flwr ls` lists the run as failed (Flower adds its traceback to the run's log).
        line = " ".join(str(error).split())
        log(ERROR, "invalid configuration, nothing was run: %s", line)
        if not driver_reports_outcome():
            raise RunFailed(f"invalid configuration, nothing was run: {line}") from None
        return
    configured = str(context.run_config.get(RUN_CONFIG_OUTPUT_DIR, "") or "")
    if configured:
        output_dir = output_path(configured)
    elif cfg.output_dir is not None:
        output_dir = output_path(cfg.output_dir)
    else:
        stamp = dt.datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
        output_dir = output_path(f"outputs/flwr/{stamp}-{context.run_id}")
    try:
        with claim_output_dir(output_dir, resume=cfg.get("resume") is not None):
            execute(grid, cfg, output_dir, overrides=overrides)
    except ConfigError as error:  # another run holds the directory (or wrote there)
        log(ERROR, "nothing was run: %s", error)
        if not driver_reports_outcome():
            raise RunFailed(f"nothing was run: {error}") from None
        record_outcome(Outcome("failed", 2, str(error), str(output_dir)))
        return
    if not driver_reports_outcome():
        outcome = take_outcome()
        if outcome is not None and outcome.exit_code:
            raise RunFailed(f"run {outcome.status}: {outcome.reason} (results in {outcome.output_dir})")


def simulated_roster(grid: Grid, data: FederatedData) -> dict[int, tuple[int, int]] | None:
    """In a simulation, each node's (partition id, data set size) without asking the nodes.

    The engine numbered the nodes (:func:`fl_app.engine.dispatch.simulated_partitions`) and this
    process holds the same split as the clients (the same :class:`DataSpec`). None in a deployment.
    """
    partitions = simulated_partitions(grid)
    if partitions is None:
        return None
    sizes = data.client_sizes()
    if sorted(partitions.values()) != list(range(len(sizes))):
        return None
    return {node: (partition, sizes[partition]) for node, partition in partitions.items()}


def evaluation_arrays(
    data: FederatedData, *, subset: int | None, randomness: RandomSource
) -> tuple[np.ndarray, np.ndarray]:
    """The server's evaluation examples: the test split, or the validation split when the spec has one.

    ``subset`` keeps a fixed seeded subset of that many examples (``evaluation.test_subset``).
    """
    split = data.evaluation()
    if data.evaluation_split == "validation":
        log(
            INFO,
            "dpfl: evaluating on the validation split (%d rows of the training split that belong to no "
            "client); the test split is not read",
            len(split.y),
        )
    x, y = split.x, split.y
    if subset is not None and subset < len(y):
        rows = np.sort(randomness.generator("test-subset").choice(len(y), size=int(subset), replace=False))
        x, y = x[rows], y[rows]
    return x, y


def noise_source(cfg: DictConfig) -> RandomSource:
    """Privacy randomness of a run: OS entropy, ``privacy.noise_seed``, or a seed derived from the config.

    The default (``privacy.noise_seed: null``) is not ``seed`` itself: it is derived from ``seed`` *and*
    the configuration, so that two runs of a sweep never share a noise stream. It is still
    reproducible from the published configuration, which the results say (``privacy.randomness``).
    """
    settings = RunSettings.from_config(cfg)
    if settings.privacy.secure_rng:
        return RandomSource(seed=None, secure=True)
    if settings.privacy.noise_seed is not None:
        return RandomSource(seed=settings.privacy.noise_seed, secure=False)
    return RandomSource(
        seed=derive_noise_seed(seed=settings.seed, fingerprint=config_fingerprint(cfg)), secure=False
    )


def with_secure_noise(cfg: DictConfig) -> DictConfig:
    """``cfg`` with ``privacy.secure_rng=true`` and ``privacy.noise_seed=null``.

    Used when the roster shows real devices: they draw their noise from OS
    entropy whatever the server says, and the server's own noise (e.g.
    DP-FedAvg's) must not come from a seed anyone reading the configuration
    knows. The results then record the setting that was in force.
    """
    if cfg.privacy.noise_seed is not None:
        log(WARNING, "privacy.noise_seed=%s ignored: real devices use OS entropy", cfg.privacy.noise_seed)
    return with_values(cfg, {"privacy.secure_rng": True, "privacy.noise_seed": None})


def effective_config(cfg: DictConfig, roster: list[ClientInfo]) -> DictConfig:
    """The configuration in force once the roster is known: OS entropy whenever it holds real devices."""
    if on_devices(roster) and not cfg.privacy.secure_rng:
        log(INFO, "dpfl: the clients are real devices: noise from OS entropy (privacy.secure_rng=true)")
        return with_secure_noise(cfg)
    return cfg


def make_run_context(
    cfg: DictConfig,
    *,
    roster: list[ClientInfo],
    data: FederatedData,
    data_spec: DataSpec,
    model_spec: ModelSpec,
    output_dir: Path,
) -> RunContext:
    """The strategy's RunContext for the configuration in force (see :func:`effective_config`).

    ``randomness`` (initialisation, public schedules) comes from ``seed``; ``noise`` (every privacy
    draw, and secret cohorts) from :func:`noise_source` of the published configuration. An evaluation
    stage that takes its budget out of ``privacy.epsilon`` gives the training strategy the rest
    (the stage's ``training_config``).
    """
    cfg = effective_config(cfg, roster)
    stage = evaluation_stage(cfg)
    run_cfg = cfg
    if stage is not None:
        run_cfg = stage.training_config(cfg)
    return RunContext(
        cfg=run_cfg,
        roster=roster,
        data=data,
        data_spec=data_spec,
        model_spec=model_spec,
        randomness=RandomSource(seed=RunSettings.from_config(cfg).seed),
        noise=noise_source(cfg),
        output_dir=output_dir,
    )


def diagnostics_enabled(cfg: DictConfig, *, devices: bool) -> bool:
    """Whether the run writes its ``outside_guarantee`` block: ``privacy.diagnostics``, never on devices."""
    wanted = RunSettings.from_config(cfg).privacy.diagnostics
    if wanted and devices:
        log(WARNING, "privacy.diagnostics=true ignored: nothing outside the guarantee is written on devices")
    return wanted and not devices


def execute(
    grid: Grid, cfg: DictConfig, output_dir: Path, *, overrides: Sequence[str] = ()
) -> dict[str, Any] | None:
    """Run one federated training as configured and write its results into ``output_dir``.

    Returns the results, or None when the run stopped before it had anything to write. How the
    run ended is also recorded for the driver (:func:`fl_app.lifecycle.take_outcome`).
    """
    output_dir.mkdir(parents=True, exist_ok=True)
    colour_only_at_a_terminal()
    handler, published = run_log_handler(output_dir / LOG_FILE)
    flower_logger = logging.getLogger("flwr")
    flower_logger.addHandler(handler)
    # Flower's logger has its own console handler. In Flower's simulation process
    # something also configures the root logger (seen under `flwr run`: every line
    # again as "INFO:flwr:..."), so keep Flower's records off the root while we run.
    propagate, flower_logger.propagate = flower_logger.propagate, False
    try:
        with console_filter(one_line_console):
            return _execute(grid, cfg, output_dir, list(overrides), published)
    except RunStopped as stopped:  # stopped before the first round: nothing but run.log to write
        stop = as_requested_stop(stopped)
        log(ERROR, "dpfl: run %s before its first round: %s", stop.status, stop)
        record_outcome(Outcome(stop.status, stop.exit_code, str(stop), str(output_dir)))
        return None
    finally:
        flower_logger.propagate = propagate
        flower_logger.removeHandler(handler)
        handler.close()
        if published.secret_cohort:  # the files' times would say when each round ended
            one_modification_time(output_dir, when=time.time())


def _execute(
    grid: Grid, cfg: DictConfig, output_dir: Path, overrides: list[str], published: PublishedLogFilter
) -> dict[str, Any] | None:
    started = time.monotonic()
    mark("server_app")
    log(
        INFO,
        "dpfl: strategy=%s dataset=%s partition=%s, output in %s",
        cfg.strategy.name,
        cfg.dataset.name,
        cfg.partition.name,
        output_dir,
    )
    settings = RunSettings.from_config(cfg)
    data_spec = DataSpec.from_config(cfg)
    data = federated_data(data_spec)
    mark("data")
    strategy_class = STRATEGIES.get(settings.strategy)
    model_spec = ModelSpec(
        strategy_class.declaration.model_name(cfg, data.input_shape), data.input_shape, data.num_classes
    )
    metered = MeteredGrid(grid)
    roster = discover_roster(
        metered,
        expected=settings.num_clients,
        timeout=settings.simulation.timeout,
        config=ConfigRecord({keys.DATA_SPEC: data_spec.to_json(), keys.SEED: settings.seed}),
        simulated=(lambda: simulated_roster(grid, data)) if is_in_memory_grid(grid) else None,
    )
    setup_traffic = metered.take()
    mark("roster")
    cfg = effective_config(cfg, roster)
    run = make_run_context(
        cfg, roster=roster, data=data, data_spec=data_spec, model_spec=model_spec, output_dir=output_dir
    )
    resumed = load_checkpoint(output_dir, run) if settings.resume else None
    if resumed is not None:
        strategy = resumed.strategy
        restore_rng_states(resumed.rng)
        arrays = resumed.arrays
        log(INFO, "dpfl: %s", resume_text(resumed.completed_round, settings.num_rounds, output_dir))
    else:
        strategy = strategy_class(run)
        stage = evaluation_stage(cfg)
        if stage is not None:
            strategy = stage(strategy)
        arrays = strategy.initial_arrays()
    randomness = strategy.randomness()
    published.secret_cohort = randomness.secret_cohort  # run.log then withholds what depends on the cohort
    if strategy.declaration.is_private(cfg):  # a non-private run has no privacy randomness to describe
        log(INFO, "dpfl: %s", randomness.describe())
    if run.canaries:
        log(INFO, "dpfl: %s", CANARY_HEADER.format(count=run.canaries))
    recorder = RunRecorder(
        output_dir,
        cfg,
        diagnostics=diagnostics_enabled(cfg, devices=randomness.devices),
        tracker=make_tracker(
            settings.tracking,
            output_dir,
            config_text=OmegaConf.to_yaml(cfg),
            secret_cohort=randomness.secret_cohort,
        ),
    )
    x_test, y_test = evaluation_arrays(
        data, subset=settings.evaluation.test_subset, randomness=run.randomness
    )
    reporter = RoundReporter(
        strategy,
        metered,
        recorder,
        x_test,
        y_test,
        num_rounds=settings.num_rounds,
        every=settings.evaluation.every,
        max_failure_fraction=settings.simulation.max_failure_fraction,
        overrides=checkpoint_overrides(overrides),
        fingerprint=config_fingerprint(cfg, ignore=("num_rounds",)),
        started=started,
    )
    if resumed is not None:
        recorder.restore(resumed.recorder)
        reporter.resume_after(resumed.completed_round, arrays, elapsed_s=resumed.elapsed_s)
        first_round = resumed.completed_round + 1
    else:
        strategy.describe()
        reporter(0, arrays)
        first_round = 1
    status, reason = "completed", ""
    mark("round_1")
    try:
        arrays = run_rounds(
            strategy,
            metered,
            arrays,
            first_round=first_round,
            num_rounds=settings.num_rounds,
            timeout=settings.simulation.timeout,
            after_round=reporter,
        )
    except RunStopped as stopped:
        stop = as_requested_stop(stopped)  # workers killed by the group's signal: still the stop
        status, reason = stop.status, str(stop)
        arrays = reporter.last_arrays
        abandoned = metered.take()
        recorder.stopped = {"reason": reason, "after_round": reporter.completed_round}
        if reporter.completed_round > 0:  # a checkpoint exists: the run can continue
            recorder.stopped["resume"] = f"python -m fl_app resume={output_dir}"
            recorder.stopped["private_state"] = private_state_text(strategy, output_dir)
        if not randomness.secret_cohort:  # a secret cohort's replies would tell its size
            recorder.stopped["abandoned_round_replies"] = int(abandoned.get("train_replies", 0))
        exit_code = stop.exit_code
    else:
        exit_code = 0
    mark("rounds_done")
    failures = recorder.failures
    if status == "completed" and failures:
        status = "completed_with_failures"
    silent = reporter.never_contributed() if status == "completed_with_failures" else []
    run_report = strategy.report_run(arrays)
    report = run_report.privacy
    privacy = report.as_dict()
    empirical = report.empirical_epsilon
    if empirical is not None:
        log(
            INFO,
            "dpfl: empirical epsilon %.3g (%d%% interval %.3g..%.3g) from %d canaries, beside the "
            "accountant's %s",
            empirical["epsilon"],
            round(100 * empirical["confidence"]),
            empirical["low"],
            empirical["high"],
            empirical["canaries"],
            _fmt(report.total.epsilon, "inf"),
        )
    try:
        ledgers = strategy.ledgers()
        for name, ledger in ledgers.items():
            write_json(output_dir / name, ledger)
        results = recorder.finalize(
            strategy=settings.strategy,
            status=status,
            privacy=privacy,
            final_extras={
                **run_report.final,
                "epsilon_training": report.total.per_stage.get("training"),
                "chance_accuracy": chance_accuracy(y_test),
                "setup_bytes": int(
                    setup_traffic.get("query_download_bytes", 0) + setup_traffic.get("query_upload_bytes", 0)
                ),
                # with a secret cohort: no count of failures (it depends on the cohorts), sizes per client
                **(
                    reporter.secret_traffic.per_client()
                    if randomness.secret_cohort
                    else {"failures": failures}
                ),
            },
            arrays=arrays,
            model_spec=model_spec,
            ledger=ledgers.get(LEDGER_FILE),
            wall_s=reporter.elapsed(),
        )
    except OSError as error:  # a full disk: the last checkpoint (if any) stays whole
        failure = error if isinstance(error, WriteFailed) else write_failed(output_dir / "results", error)
        can_resume = reporter.completed_round > 0
        log(
            ERROR,
            "dpfl: run %s after round %d, but its results could not be written: %s%s",
            status,
            reporter.completed_round,
            failure,
            f"; free space, then continue with: python -m fl_app resume={output_dir}" if can_resume else "",
        )
        state = private_state_text(strategy, output_dir) if can_resume else None
        record_outcome(Outcome("failed", 1, str(failure), str(output_dir), state))
        return None
    mark("results_written")
    if status.startswith("completed") and strategy.declaration.is_private(cfg):
        remove_checkpoint(output_dir)  # a private run cannot be extended; keep no server secrets
    stopped = recorder.stopped or {}
    if silent:  # every round ran, but some client's data never reached the model: the command exits 1
        exit_code, reason = 1, silent_text(silent, reporter.client_rounds)
    record_outcome(Outcome(status, exit_code, reason, str(output_dir), stopped.get("private_state")))
    if exit_code and not silent:
        resume = (
            f"; continue with: python -m fl_app resume={output_dir} ({recorder.stopped['private_state']})"
            if recorder.stopped and "resume" in recorder.stopped
            else "; nothing to resume (no round completed)"
        )
        log(
            ERROR,
            "dpfl: run %s after round %d: %s; results in %s%s",
            status,
            reporter.completed_round,
            reason,
            output_dir,
            resume,
        )
        return results
    spent = epsilon_text(
        results["final"]["epsilon"],
        run.delta,
        per=short_unit(report.total.unit),
        note=(
            "privacy randomness from OS entropy"
            if randomness.secure
            else "seeded simulation: reproducible from the published config"
        ),
    )
    why = reason or "their errors: the lines above"
    with_failures = f" with {failures} failed client replies ({why})" if failures else ""
    line = finished_line(results, spent, output_dir, with_failures)
    # with a secret cohort, failures tell about it: the console (the operator) shows them, run.log not
    withheld = finished_line(results, spent, output_dir, "") if randomness.secret_cohort else None
    log(INFO, "%s", line, extra=withheld_from_file(withheld))
    warn_if_diverged(results)
    return results


def finished_line(results: dict[str, Any], privacy: str, output_dir: Path, failures: str) -> str:
    """The last line of a completed run (``failures``: what to say about failed clients, or "")."""
    final = results["final"]
    return (
        f"dpfl: finished {len(results['rounds'])} rounds in {format_duration(final['wall_s'])}{failures}; "
        f"final accuracy {_fmt(final['accuracy'])} (best {_fmt(final['best_accuracy'])} in round "
        f"{final['best_round']}), {privacy}; results in {output_dir}"
    )


def silent_text(clients: list[int], client_rounds: dict[int, list[int]]) -> str:
    """Which clients failed in every round they were selected for (``RoundReporter.never_contributed``)."""
    shown = ", ".join(f"{c} ({client_rounds[c][0]} of {client_rounds[c][0]})" for c in clients[:5])
    more = f" and {len(clients) - 5} more" if len(clients) > 5 else ""
    return (
        f"client {shown}{more} failed in every round it was selected for: its data never reached the "
        "model (its error: the lines above)"
    )


def resume_text(completed_round: int, num_rounds: int, output_dir: Path) -> str:
    """What a resumed run says first: the rounds it continues after, or that it only writes the results."""
    if completed_round >= num_rounds:
        return (
            f"finishing the run in {output_dir}: its {completed_round} rounds are done (it stopped before "
            "its results were written); writing them"
        )
    return f"resuming after round {completed_round} from {output_dir}"


def warn_if_diverged(results: dict[str, Any]) -> None:
    """A WARNING line when the run diverged (``final.diverged``): its accuracy says little then."""
    final = results["final"]
    if final.get("diverged"):
        log(
            WARNING,
            "dpfl: this run diverged: final loss %s against %s for the initial model (more than %gx); "
            "its accuracy (chance level %s) describes a broken model: lower lr or the noise, or "
            "raise the clipping/budget",
            _fmt(final["loss"]),
            _fmt(results["initial"].get("loss")),
            DIVERGENCE_FACTOR,
            _fmt(final.get("chance_accuracy")),
        )


def private_state_text(strategy: Strategy, output_dir: Path) -> str:
    """What the interrupt line and ``stopped.private_state`` say about the checkpoint file."""
    held = strategy.private_state()
    return (
        f"{output_dir / CHECKPOINT_FILE} is the server's private state"
        f"{': it holds ' + held if held else ''}; readable by its owner only, never publish it; it is "
        "removed when the run completes"
    )


class TrafficTotals:
    """Bytes and messages of train rounds summed over a run, for sizes per client (:meth:`per_client`)."""

    #: Per-client sizes are rounded to this many bytes: a reply's serialised size can differ by a few
    #: bytes between clients (its metrics), and a published size must not depend on who replied.
    ROUNDING = 1000

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def add(self, traffic: dict[str, float]) -> None:
        """Add one round's counters (:meth:`fl_app.metering.MeteredGrid.take`)."""
        for key in ("train_upload_bytes", "train_replies", "train_download_bytes", "train_messages"):
            self.totals[key] = self.totals.get(key, 0.0) + float(traffic.get(key, 0.0))

    def per_client(self) -> dict[str, int | None]:
        """``upload_bytes_per_client`` / ``download_bytes_per_client``: a train reply's and message's size."""

        def size(total: str, count: str) -> int | None:
            if not self.totals.get(count):
                return None
            mean = self.totals[total] / self.totals[count]
            return int(round(mean / self.ROUNDING) * self.ROUNDING)

        return {
            "upload_bytes_per_client": size("train_upload_bytes", "train_replies"),
            "download_bytes_per_client": size("train_download_bytes", "train_messages"),
        }


#: A client selected for at least this many rounds that failed in every one of them never contributed:
#: the run then exits with status 1 (its results are written, ``completed_with_failures``).
SILENT_ROUNDS = 2


class RoundReporter:
    """Flower's ``evaluate_fn``: evaluate, account, meter, log and record each round."""

    def __init__(
        self,
        strategy: Strategy,
        grid: MeteredGrid,
        recorder: RunRecorder,
        x_test: np.ndarray,
        y_test: np.ndarray,
        *,
        num_rounds: int,
        every: int,
        max_failure_fraction: float = 1.0,
        overrides: list[str] | None = None,
        fingerprint: str = "",
        started: float | None = None,
    ) -> None:
        self.strategy = strategy
        self.grid = grid
        self.recorder = recorder
        self.x_test, self.y_test = x_test, y_test
        self.num_rounds = num_rounds
        self.every = every
        self.max_failure_fraction = max_failure_fraction
        self.overrides = list(overrides or [])
        self.fingerprint = fingerprint
        #: When this session began (the run's first log line): ``wall_s`` counts from there.
        self.started = time.monotonic() if started is None else started
        self.last = time.monotonic()
        self.durations: list[float] = []
        self.completed_round = 0
        self.last_arrays: ArrayRecord | None = None
        self.earlier_s = 0.0  # wall time of the run's earlier sessions (resume)
        #: Bytes and messages of the rounds whose cohort is secret (per-client sizes in ``final``).
        self.secret_traffic = TrafficTotals()
        #: Client id -> [rounds it was selected for, rounds it failed in], over this session's rounds
        #: (never published; a resumed run counts from its resume on).
        self.client_rounds: dict[int, list[int]] = {}

    def tally(self, selected: Sequence[int], failed: Sequence[int]) -> None:
        """Count a round for each selected client, and a failure for each failed one."""
        for client in selected:
            counts = self.client_rounds.setdefault(client, [0, 0])
            counts[0] += 1
            counts[1] += client in failed

    def never_contributed(self) -> list[int]:
        """Clients selected in :data:`SILENT_ROUNDS` rounds or more that failed in every one of them."""
        counts = self.client_rounds.items()
        return sorted(c for c, (rounds, failed) in counts if rounds >= SILENT_ROUNDS and failed == rounds)

    def elapsed(self) -> float:
        """Seconds the run has taken so far (over all its sessions)."""
        return self.earlier_s + time.monotonic() - self.started

    def resume_after(self, completed_round: int, arrays: ArrayRecord, *, elapsed_s: float) -> None:
        """Continue counting after a checkpoint of ``completed_round``."""
        self.completed_round = completed_round
        self.last_arrays = arrays
        self.earlier_s = elapsed_s
        self.grid.take()
        self.last = time.monotonic()

    def checkpoint(self, server_round: int, arrays: ArrayRecord) -> None:
        """Write the privacy ledger and the checkpoint of a completed round (both atomically)."""
        run = self.strategy.run
        for name, ledger in self.strategy.ledgers().items():
            write_json(run.output_dir / name, ledger)
        save_checkpoint(
            run.output_dir,
            Checkpoint(
                completed_round=server_round,
                num_rounds=self.num_rounds,
                status="incomplete" if server_round < self.num_rounds else "completed",
                overrides=self.overrides,
                fingerprint=self.fingerprint,
                arrays=arrays,
                strategy=self.strategy,
                recorder=self.recorder.state(),
                elapsed_s=self.elapsed(),
                rng=rng_states(),
            ),
            run,
        )

    def __call__(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """Called before round 1 (round 0) and, by :func:`fl_app.round_loop.run_rounds`, after every round."""
        if server_round == 0:
            loss, accuracy = self.strategy.evaluate_global(arrays, self.x_test, self.y_test)
            self.recorder.add_initial({"accuracy": accuracy, "loss": loss})
            self.grid.take()
            self.last = time.monotonic()
            self.last_arrays = arrays
            return MetricRecord({"accuracy": accuracy, "loss": loss})
        report = self.strategy.report_round(server_round)
        # A round that broke the failure rule is neither recorded nor checkpointed: a resumed run
        # repeats it instead of continuing from its degraded model.
        check_round(
            server_round,
            clients=report.clients,
            failures=len(report.failures),
            reasons=list(report.failure_reasons),
            max_failure_fraction=self.max_failure_fraction,
            secret_cohort=report.secret_cohort,
        )
        evaluate = server_round % self.every == 0 or server_round == self.num_rounds
        loss, accuracy = (
            self.strategy.evaluate_global(arrays, self.x_test, self.y_test) if evaluate else (None, None)
        )
        traffic = self.grid.take()
        now = time.monotonic()
        self.durations.append(now - self.last)
        record: dict[str, Any] = {
            "round": server_round,
            "accuracy": accuracy,
            "loss": loss,
            **report.privacy_fields(),
        }
        cohort = {  # functions of the round's cohort
            "upload_bytes": int(traffic.get("train_upload_bytes", 0)),
            "download_bytes": int(traffic.get("train_download_bytes", 0)),
            "upload_array_bytes": int(traffic.get("train_upload_array_bytes", 0)),
            "download_array_bytes": int(traffic.get("train_download_array_bytes", 0)),
            "clients": report.clients,
            "failures": len(report.failures),
            "wall_s": self.elapsed(),
            "round_s": now - self.last,
        }
        if traffic.get("evaluate_messages"):
            cohort["evaluate_upload_bytes"] = int(traffic.get("evaluate_upload_bytes", 0))
            cohort["evaluate_download_bytes"] = int(traffic.get("evaluate_download_bytes", 0))
        diagnostics = dict(report.diagnostics)
        self.recorder.failures += len(report.failures)
        self.tally(report.selected, report.failures)
        if report.secret_cohort:
            # A secret cohort's size, failures, bytes and duration would tell model observers about
            # the coins amplification by sampling rests on: outside the guarantee only.
            self.secret_traffic.add(traffic)
            diagnostics = {f"secret_cohort_{key}": value for key, value in cohort.items()} | diagnostics
        else:
            record.update(cohort)
        record.update(report.extras)
        self.recorder.add_round(record)
        self.recorder.add_diagnostics(server_round, diagnostics)
        self.last = now
        self.completed_round = server_round
        self.last_arrays = arrays
        self.checkpoint(server_round, arrays)
        remaining = float(np.mean(self.durations)) * (self.num_rounds - server_round)
        line = (
            f"dpfl round {server_round}/{self.num_rounds}: "
            f"{progress_bar(server_round, self.num_rounds) + ' ' if interactive() else ''}"
            f"accuracy {_fmt(accuracy)}, loss {_fmt(loss)}, "
            f"{epsilon_text(record['epsilon'], self.strategy.run.delta)}"
        )
        timing = f" | elapsed {format_duration(self.elapsed())}, remaining ~{format_duration(remaining)}"
        # With a secret cohort a round's duration tells its size: the console (the operator, who
        # draws the cohort) shows it, run.log (beside the published results) does not.
        log(INFO, "%s", line + timing, extra=withheld_from_file(line if report.secret_cohort else None))
        metrics = {
            k: float(v)
            for k, v in (("accuracy", accuracy), ("loss", loss), ("epsilon", record["epsilon"]))
            if v is not None
        }
        return MetricRecord(metrics)


def epsilon_text(epsilon: float | None, delta: float, *, per: str = "", note: str = "") -> str:
    """``epsilon 3.911 per client in total (delta 1e-05; note)``, or ``not private``."""
    if epsilon is None:
        return "not private"
    unit = f" per {per} in total" if per else ""
    return f"epsilon {_fmt(epsilon)}{unit} (delta {delta:g}{'; ' + note if note else ''})"


def _fmt(value: float | None, missing: str = "-") -> str:
    if value is None:
        return missing
    if isinstance(value, float) and math.isnan(value):
        return "nan (diverged?)"  # a NaN loss: the model broke (lr, noise, clipping); said at once
    return f"{value:.4g}"


def progress_bar(done: int, total: int, *, width: int = 20) -> str:
    """``[########------------]``: ``done`` of ``total`` as a bar of ``width`` cells."""
    filled = 0 if total <= 0 else min(width, round(width * done / total))
    return "[" + "#" * filled + "-" * (width - filled) + "]"


def interactive() -> bool:
    """Whether a person watches the output (stderr is a terminal): then progress lines carry a bar."""
    return sys.stderr.isatty()


def format_duration(seconds: float) -> str:
    """``H:MM:SS`` of a duration in seconds."""
    return str(dt.timedelta(seconds=round(seconds)))
