"""The ServerApp's body: the run's typed settings in, its rounds, its results out.

Both entry points end here: ``flwr run .`` through ``fl_app.server_app:app`` (which composes and
validates the run config's overrides in :func:`run_federation`) and ``python -m fl_app`` through
:mod:`fl_app.engine.simulation`, which hands the ServerApp the settings its preflight validated. A run is
three steps, each a function: :func:`prepare` (the data, the roster, the settings in force, the run
context, the strategy or its checkpoint, the recorder), :func:`play` (the rounds, until the last or a
stop) and :func:`finish` (the privacy report, the results and ledgers, how the run ended, its last
line). Nothing here reads the composed ``DictConfig``: only :class:`~fl_app.config.settings.RunSettings`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import time
from collections.abc import Sequence
from logging import DEBUG, ERROR, INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.common import log
from flwr.serverapp import Grid
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from clients import CLIENTS
from fl_app import keys
from fl_app.config.checks import ConfigError
from fl_app.config.compose import RUN_CONFIG_OUTPUT_DIR, compose_config, overrides_from_run_config
from fl_app.config.settings import RunSettings
from fl_app.config.validation import validate_config
from fl_app.data.federated import NATURAL, FederatedData, describe_client, federated_data
from fl_app.engine.client_states import ClientStates
from fl_app.engine.dispatch import is_in_memory_grid, simulated_partitions
from fl_app.engine.logs import colour_only_at_a_terminal, console_filter
from fl_app.engine.metering import MeteredGrid
from fl_app.engine.processes import worker_count
from fl_app.learning.model_spec import ModelSpec
from fl_app.privacy.canaries import HEADER_NOTE as CANARY_HEADER
from fl_app.privacy.rng import RandomSource, derive_noise_seed
from fl_app.report.tracking import TrackedRun, make_tracker
from fl_app.run.checkpoint import Checkpoint, load_checkpoint, remove_checkpoint, restore_rng_states
from fl_app.run.context import RunContext, output_path
from fl_app.run.files import WriteFailed, one_modification_time, remove_spares, write_failed
from fl_app.run.lifecycle import (
    Outcome,
    RunFailed,
    RunInterrupted,
    RunStopped,
    as_requested_stop,
    driver_reports_outcome,
    record_outcome,
    take_outcome,
)
from fl_app.run.log import PublishedLogFilter, one_line_console, run_log_handler, withheld_from_file
from fl_app.run.output_claim import claim_output_dir
from fl_app.run.reporter import RoundReporter
from fl_app.run.results import (
    LEDGER_FILE,
    RunRecorder,
    chance_accuracy,
    short_unit,
    write_json,
    write_unstarted_results,
)
from fl_app.run.resume import checkpoint_overrides
from fl_app.run.roster import ClientInfo, discover_roster, on_devices
from fl_app.run.round_loop import run_rounds
from fl_app.run.round_path import announce_round_path, bulk_refusal, round_path
from fl_app.run.sweep_names import run_name
from fl_app.run.text import (
    epsilon_text,
    finished_line,
    fmt,
    private_state_text,
    resume_text,
    silent_text,
    subset_text,
    vocabulary_text,
    warn_if_diverged,
)
from fl_app.run.timeline import mark
from fl_app.run.vocabulary import stage_for
from strategies import EVALUATION_STAGES, STRATEGIES
from strategies.contract import Declaration, Strategy
from strategies.reporting import Randomness, RunReport

LOG_FILE = "run.log"


def evaluation_stage(settings: RunSettings) -> Any | None:
    """The evaluation stage class ``evaluation.stage`` names (checked by validation), or None.

    A text run (which validation refuses any evaluation stage) gets its vocabulary's stage
    (:mod:`fl_app.run.vocabulary`: a DP vocabulary charged with the training, or its assumption stated).
    """
    name = settings.evaluation.stage
    return stage_for(settings) if name is None else EVALUATION_STAGES.get(name)


def run_federation(grid: Grid, context: Context, settings: RunSettings | None = None) -> None:
    """ServerApp main: execute the run's configuration.

    ``settings``: a local simulation's job, composed and validated once (``python -m fl_app``);
    otherwise (``flwr run``, deployments) the run config's overrides are composed and validated here.
    """
    overrides = overrides_from_run_config(context.run_config)
    try:
        if settings is None:
            settings = validate_config(compose_config(overrides))
    except (HydraException, OmegaConfBaseException, ValueError) as error:
        # One line, nothing written. Under `flwr run` the ServerApp then raises, so that
        # `flwr ls` lists the run as failed (Flower adds its traceback to the run's log).
        line = " ".join(str(error).split())
        log(ERROR, "invalid configuration, nothing was run: %s", line)
        if not driver_reports_outcome():
            raise RunFailed(f"invalid configuration, nothing was run: {line}") from None
        return
    output_dir = run_output_dir(settings, context)
    try:
        with claim_output_dir(output_dir, resume=settings.resume is not None):
            execute(grid, settings, output_dir, overrides=overrides)
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


def run_output_dir(settings: RunSettings, context: Context) -> Path:
    """The run config's ``output-dir``, else ``output_dir``, else ``outputs/flwr/<date>/<time>-<run id>``."""
    configured = str(context.run_config.get(RUN_CONFIG_OUTPUT_DIR, "") or "")
    if configured:
        return output_path(configured)
    if settings.output_dir is not None:
        return output_path(settings.output_dir)
    stamp = dt.datetime.now().strftime("%Y-%m-%d/%H-%M-%S")
    return output_path(f"outputs/flwr/{stamp}-{context.run_id}")


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

    ``subset`` keeps a fixed seeded subset of that many examples (``evaluation.test_subset``); a
    larger one than the split keeps it whole and says so.
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
    elif subset is not None and subset > len(y):
        unit = "sequences" if len(data.input_shape) == 1 else "examples"
        log(WARNING, subset_text(subset, data.evaluation_split, len(y), unit))
    return x, y


def note_vocabulary(data: Any, model: ModelSpec) -> None:
    """A WARNING line when a text data set's vocabulary holds fewer words than ``dataset.vocab_size``."""
    shortfall = data.vocabulary_shortfall() if hasattr(data, "vocabulary_shortfall") else None
    if shortfall is None:
        return
    asked = dataclasses.replace(model, num_classes=shortfall[1] + 4)
    log(WARNING, vocabulary_text(shortfall, model.name, (model.parameter_count(), asked.parameter_count())))


def noise_source(settings: RunSettings) -> RandomSource:
    """Privacy randomness of a run: OS entropy, ``privacy.noise_seed``, or a seed derived from the experiment.

    The default (``privacy.noise_seed: null``) is not ``seed`` itself: it is derived from ``seed`` *and*
    the experiment's validated settings (:meth:`~fl_app.config.settings.RunSettings.fingerprint`: not the
    label, tracker, output folder or a number's spelling), so that two runs of a sweep never share a
    noise stream. It is still reproducible from the published configuration, which the results say
    (``privacy.randomness``).
    """
    if settings.privacy.secure_rng:
        return RandomSource(seed=None, secure=True)
    if settings.privacy.noise_seed is not None:
        return RandomSource(seed=settings.privacy.noise_seed, secure=False)
    return RandomSource(
        seed=derive_noise_seed(seed=settings.seed, fingerprint=settings.fingerprint()), secure=False
    )


def with_secure_noise(settings: RunSettings) -> RunSettings:
    """``settings`` with ``privacy.secure_rng=true`` and ``privacy.noise_seed=null``.

    Used when the roster shows real devices: they draw their noise from OS
    entropy whatever the server says, and the server's own noise (e.g.
    DP-FedAvg's) must not come from a seed anyone reading the configuration
    knows. The results then record the setting that was in force.
    """
    if settings.privacy.noise_seed is not None:
        log(
            WARNING, "privacy.noise_seed=%s ignored: real devices use OS entropy", settings.privacy.noise_seed
        )
    return settings.with_values({"privacy.secure_rng": True, "privacy.noise_seed": None})


def effective_settings(settings: RunSettings, roster: list[ClientInfo]) -> RunSettings:
    """The settings in force once the roster is known: OS entropy whenever it holds real devices."""
    if on_devices(roster) and not settings.privacy.secure_rng:
        log(INFO, "dpfl: the clients are real devices: noise from OS entropy (privacy.secure_rng=true)")
        return with_secure_noise(settings)
    return settings


def make_run_context(
    settings: RunSettings,
    *,
    roster: list[ClientInfo],
    data: FederatedData,
    model_spec: ModelSpec,
    output_dir: Path,
    stage: Any | None = None,
) -> RunContext:
    """The strategy's RunContext for the settings in force (:func:`effective_settings`).

    ``randomness`` (initialisation, public schedules) comes from ``seed``; ``noise`` (every privacy
    draw, and secret cohorts) from :func:`noise_source` of the published settings. An evaluation
    stage (``stage``, else the one the settings name) that takes its budget out of
    ``privacy.epsilon`` gives the training strategy the rest (its ``training_settings``).
    """
    settings = effective_settings(settings, roster)
    stage = evaluation_stage(settings) if stage is None else stage
    return RunContext(
        settings=settings if stage is None else stage.training_settings(settings),
        roster=roster,
        data=data,
        model_spec=model_spec,
        randomness=RandomSource(seed=settings.seed),
        noise=noise_source(settings),
        output_dir=output_dir,
    )


def diagnostics_enabled(settings: RunSettings, *, devices: bool) -> bool:
    """Whether the run writes its ``outside_guarantee`` block: ``privacy.diagnostics``, never on devices."""
    wanted = settings.privacy.diagnostics
    if wanted and devices:
        log(WARNING, "privacy.diagnostics=true ignored: nothing outside the guarantee is written on devices")
    return wanted and not devices


def execute(
    grid: Grid, settings: RunSettings, output_dir: Path, *, overrides: Sequence[str] = ()
) -> dict[str, Any] | None:
    """Run one federated training as configured and write its results into ``output_dir``.

    Returns the results, or None when the run stopped before it had anything to write. How the
    run ended is also recorded for the driver (:func:`fl_app.run.lifecycle.take_outcome`).
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
    prepared: Prepared | None = None
    try:
        with console_filter(one_line_console):
            prepared = prepare(grid, settings, output_dir, list(overrides), published)
            return finish(prepared, play(prepared))
    except RunStopped as stopped:  # ended before the first round
        before_first_round(as_requested_stop(stopped), settings, output_dir)
        return None
    finally:
        if prepared is not None:  # no file of the run changes after this returns
            with contextlib.suppress(WriteFailed):  # raised and reported where the run ended
                prepared.reporter.checkpointer.settle()
        flower_logger.propagate = propagate
        flower_logger.removeHandler(handler)
        handler.close()
        remove_spares(output_dir)  # what a secret cohort's rewrites went through
        if published.secret_cohort:  # the files' times would say when each round ended
            one_modification_time(output_dir, when=time.time())


def before_first_round(stop: RunStopped, settings: RunSettings, output_dir: Path) -> None:
    """A run that ended before its first round: its one line, its outcome, and a stop's ``results.json``.

    A stop's results hold no round; a failure writes nothing but run.log (under ``flwr run`` the run is
    failed and holds no results).
    """
    where = f"run.log in {output_dir}"
    if isinstance(stop, RunInterrupted):
        with contextlib.suppress(OSError):  # a full disk: run.log alone says it
            write_unstarted_results(output_dir, settings, status=stop.status, reason=str(stop))
            where = f"results in {output_dir}"
    log(ERROR, "dpfl: run %s before its first round: %s; %s; nothing to resume", stop.status, stop, where)
    record_outcome(Outcome(stop.status, stop.exit_code, str(stop), str(output_dir)))


@dataclasses.dataclass
class Prepared:
    """A run ready for its rounds (:func:`prepare`)."""

    settings: RunSettings
    run: RunContext
    strategy: Strategy
    grid: MeteredGrid
    recorder: RunRecorder
    reporter: RoundReporter
    arrays: ArrayRecord
    first_round: int
    randomness: Randomness
    setup_bytes: int
    y_test: np.ndarray


def run_model_spec(settings: RunSettings, data: Any) -> ModelSpec:
    """The run's network as the clients build it: the algorithm's choice of model for the data."""
    name = STRATEGIES.get(settings.strategy).declaration.model_name(
        settings, data.input_shape, data.num_classes
    )
    return ModelSpec(name, data.input_shape, data.num_classes, data.uncounted_targets)


def prepare(
    grid: Grid, settings: RunSettings, output_dir: Path, overrides: list[str], published: PublishedLogFilter
) -> Prepared:
    """The data, the roster, the settings in force, the strategy (or its checkpoint), the recorder."""
    started = time.monotonic()
    mark("server_app")
    log_start(settings, output_dir)
    data = federated_data(settings.data)
    mark("data")
    declaration = STRATEGIES.get(settings.strategy).declaration
    model_spec = run_model_spec(settings, data)
    note_vocabulary(data, model_spec)
    metered = MeteredGrid(grid)
    roster, setup_bytes = federation(metered, grid, settings, data)
    settings = effective_settings(settings, roster)
    stage = evaluation_stage(settings)
    run = make_run_context(
        settings, roster=roster, data=data, model_spec=model_spec, output_dir=output_dir, stage=stage
    )
    resumed = load_checkpoint(output_dir, run) if settings.resume else None
    if resumed is not None:
        restore_rng_states(resumed.rng)  # the process's generators, as the interrupted run left them
    metered.client_states = client_states(declaration, grid, resumed)
    metered.bulk_shares = (
        shares_for(settings, CLIENTS.get(declaration.client)) if is_in_memory_grid(grid) else 0
    )
    strategy = resumed.strategy if resumed is not None else build_strategy(run, stage)
    randomness = strategy.randomness()
    published.secret_cohort = randomness.secret_cohort  # run.log then withholds what depends on the cohort
    announce(strategy, settings, randomness)
    recorder = make_recorder(settings, output_dir, randomness)
    x_test, y_test = evaluation_arrays(
        data, subset=settings.evaluation.test_subset, randomness=run.randomness
    )
    reporter = make_reporter(strategy, metered, recorder, (x_test, y_test), settings, overrides, started)
    reporter.checkpointer.not_resumable = not_resumable(declaration, roster)
    recorder.prepare_files()  # a secret cohort's run: every file its rounds write is created now
    reporter.checkpointer.prepare_files()
    arrays, first_round = begin(strategy, reporter, recorder, resumed, settings, output_dir)
    path = round_path(
        strategy,
        settings,
        CLIENTS.get(declaration.client),
        simulated=is_in_memory_grid(grid),
        bulk_shares=metered.bulk_shares,
    )
    recorder.engine = announce_round_path(path)
    return Prepared(
        settings,
        run,
        strategy,
        metered,
        recorder,
        reporter,
        arrays,
        first_round,
        randomness,
        setup_bytes,
        y_test,
    )


def log_start(settings: RunSettings, output_dir: Path) -> None:
    """The run's first line: its algorithm, data set, partition and output directory."""
    log(
        INFO,
        "dpfl: strategy=%s dataset=%s partition=%s, output in %s",
        settings.strategy,
        settings.dataset,
        settings.partition,
        output_dir,
    )


def shares_for(settings: RunSettings, client_class: type) -> int:
    """How many bulk messages a packed round goes as (:mod:`fl_app.engine.bulk`): one per worker; 0: none.

    None unless the run allows it (``simulation.bulk``, with packing) and ``client_class`` does exactly
    what FedAvg's client does (:func:`fl_app.run.round_path.bulk_refusal`). One worker inline; the forked
    processes or Ray's actors, as many as the CPUs hold (:func:`fl_app.engine.processes.worker_count`).
    """
    simulation = settings.simulation
    if bulk_refusal(settings, client_class) is not None:
        return 0
    if simulation.backend == "inline":
        return 1
    limit = simulation.max_concurrent_clients
    return worker_count(num_cpus=simulation.num_cpus, client_cpus=simulation.client_cpus, limit=limit)


def client_states(declaration: Declaration, grid: Grid, resumed: Checkpoint | None) -> ClientStates | None:
    """The store of the clients' state between rounds: a simulation's, of a client that keeps state.

    A checkpoint's when the run resumes; None on devices (each keeps its own) or for a stateless client.
    """
    if not CLIENTS.get(declaration.client).keeps_state or not is_in_memory_grid(grid):
        return None
    if resumed is not None and resumed.client_states is not None:
        return resumed.client_states
    return ClientStates()


def not_resumable(declaration: Declaration, roster: Sequence[ClientInfo]) -> str | None:
    """Why ``resume=`` could not continue this run (then no checkpoint is written and none is offered).

    An algorithm that declares it cannot be resumed; a client that keeps state on devices (each
    device's state lives in its node, which a resumed run does not reach). None: it can.
    """
    if declaration.resume is not None:
        return f"strategy={declaration.name} {declaration.resume}"
    if CLIENTS.get(declaration.client).keeps_state and on_devices(roster):
        return "its clients keep state on their devices, which a resumed run cannot reach"
    return None


def federation(
    metered: MeteredGrid, grid: Grid, settings: RunSettings, data: FederatedData
) -> tuple[list[ClientInfo], int]:
    """The roster (simulated nodes known at once, devices asked) and the bytes asking them took."""
    roster = discover_roster(
        metered,
        expected=settings.num_clients,
        timeout=settings.simulation.timeout,
        config=ConfigRecord({keys.DATA_SPEC: settings.data.to_json(), keys.SEED: settings.seed}),
        simulated=(lambda: simulated_roster(grid, data)) if is_in_memory_grid(grid) else None,
    )
    setup = metered.take()
    mark("roster")
    return roster, int(setup.get("query_download_bytes", 0) + setup.get("query_upload_bytes", 0))


def make_reporter(
    strategy: Strategy,
    grid: MeteredGrid,
    recorder: RunRecorder,
    evaluation: tuple[np.ndarray, np.ndarray],
    settings: RunSettings,
    overrides: list[str],
    started: float,
) -> RoundReporter:
    """The round loop's hook: evaluation on ``evaluation``'s examples, the failure rule, checkpoints."""
    return RoundReporter(
        strategy,
        grid,
        recorder,
        *evaluation,
        num_rounds=settings.num_rounds,
        every=settings.evaluation.every,
        max_failure_fraction=settings.simulation.max_failure_fraction,
        overrides=checkpoint_overrides(overrides),
        fingerprint=settings.fingerprint(ignore=("num_rounds",)),
        started=started,
    )


def build_strategy(run: RunContext, stage: Any | None) -> Strategy:
    """The configured strategy, wrapped by its evaluation stage when there is one."""
    strategy = STRATEGIES.get(run.settings.strategy)(run)
    return strategy if stage is None else stage(strategy)


def announce(strategy: Strategy, settings: RunSettings, randomness: Randomness) -> None:
    """The header lines on the privacy randomness (a private run's) and the canaries."""
    if strategy.declaration.is_private(settings):  # a non-private run has no privacy randomness to describe
        log(INFO, "dpfl: %s", randomness.describe())
        details = randomness.as_dict()  # in full: run.log (and results.json's privacy.randomness)
        log(
            DEBUG,
            "dpfl: privacy randomness: %s; noise seed origin: %s",
            details["note"],
            details["noise_seed_origin"],
        )
    if settings.data.partition["name"] == NATURAL:
        log(INFO, "dpfl: a client is %s", describe_client(settings.data))
    if settings.privacy.canaries:
        log(INFO, "dpfl: %s", CANARY_HEADER.format(count=settings.privacy.canaries))


def make_recorder(settings: RunSettings, output_dir: Path, randomness: Randomness) -> RunRecorder:
    """The run's recorder, with its trackers (TensorBoard, MLflow, W&B) when asked for."""
    tracked = TrackedRun(
        name=settings.tracker.run_name or run_name(settings),
        config=dict(settings.config),
        settings=settings.tracker,
        resumed=settings.resume is not None,
    )
    tracker = make_tracker(
        settings.tracking,
        output_dir,
        config_text=settings.to_yaml(),
        secret_cohort=randomness.secret_cohort,
        run=tracked,
    )
    diagnostics = diagnostics_enabled(settings, devices=randomness.devices)
    return RunRecorder(
        output_dir, settings, diagnostics=diagnostics, tracker=tracker, secret_cohort=randomness.secret_cohort
    )


def begin(
    strategy: Strategy,
    reporter: RoundReporter,
    recorder: RunRecorder,
    resumed: Checkpoint | None,
    settings: RunSettings,
    output_dir: Path,
) -> tuple[ArrayRecord, int]:
    """The model and the first round: a checkpoint's, or the initial model evaluated as round 0."""
    if resumed is not None:
        log(INFO, "dpfl: %s", resume_text(resumed.completed_round, settings.num_rounds, output_dir))
        recorder.restore(resumed.recorder)
        reporter.resume_after(resumed.completed_round, resumed.arrays, elapsed_s=resumed.elapsed_s)
        return resumed.arrays, resumed.completed_round + 1
    arrays = strategy.initial_arrays()
    strategy.describe()
    reporter(0, arrays)
    return arrays, 1


@dataclasses.dataclass
class Ending:
    """How the rounds ended (:func:`play`)."""

    status: str
    reason: str
    exit_code: int
    arrays: ArrayRecord


def play(prepared: Prepared) -> Ending:
    """The rounds, until the last one or a stop (whose state goes to the results' ``stopped``)."""
    mark("round_1")
    settings, reporter = prepared.settings, prepared.reporter
    try:
        arrays = run_rounds(
            prepared.strategy,
            prepared.grid,
            prepared.arrays,
            first_round=prepared.first_round,
            num_rounds=settings.num_rounds,
            timeout=settings.simulation.timeout,
            after_round=reporter,
        )
        reporter.checkpointer.settle()
    except RunStopped as stopped:
        stop = as_requested_stop(stopped)  # workers killed by the group's signal: still the stop
        try:
            reporter.checkpointer.settle()  # the last checkpoint on disk before a stop names it
        except WriteFailed as failed:
            stop = failed
        mark("rounds_stopped")
        note_stop(prepared, str(stop))
        assert reporter.last_arrays is not None
        return Ending(stop.status, str(stop), stop.exit_code, reporter.last_arrays)
    mark("rounds_done")
    status = "completed_with_failures" if prepared.recorder.failures else "completed"
    return Ending(status, "", 0, arrays)


def note_stop(prepared: Prepared, reason: str) -> None:
    """The results' ``stopped`` object: why, after which round, how to continue."""
    reporter, output_dir = prepared.reporter, prepared.run.output_dir
    abandoned = prepared.grid.take()
    stopped: dict[str, Any] = {"reason": reason, "after_round": reporter.completed_round}
    refused = reporter.checkpointer.not_resumable
    if refused is not None:
        stopped["not_resumable"] = refused
    elif reporter.completed_round > 0:  # a checkpoint exists: the run can continue
        stopped["resume"] = f"python -m fl_app resume={output_dir}"
        stopped["private_state"] = private_state_text(
            prepared.strategy, output_dir, client_states=prepared.grid.client_states is not None
        )
    if not prepared.randomness.secret_cohort:  # a secret cohort's replies would tell its size
        stopped["abandoned_round_replies"] = int(abandoned.get("train_replies", 0))
    prepared.recorder.stopped = stopped


def finish(prepared: Prepared, ending: Ending) -> dict[str, Any] | None:
    """The privacy report, the results and ledgers, how the run ended and its last line."""
    strategy, output_dir = prepared.strategy, prepared.run.output_dir
    silent = (
        prepared.reporter.clients.never_contributed() if ending.status == "completed_with_failures" else []
    )
    run_report = strategy.report_run(ending.arrays)
    log_empirical(run_report)
    try:
        results = write_results(prepared, ending, run_report)
    except OSError as error:  # a full disk: the last checkpoint (if any) stays whole
        unwritten(prepared, ending.status, error)
        return None
    mark("results_written")
    if ending.status.startswith("completed") and strategy.declaration.is_private(prepared.settings):
        remove_checkpoint(output_dir)  # a private run cannot be extended; keep no server secrets
    exit_code, reason = ending.exit_code, ending.reason
    if silent:  # every round ran, but some client's data never reached the model: the command exits 1
        exit_code, reason = 1, silent_text(silent, prepared.reporter.clients.selected)
    stopped = prepared.recorder.stopped or {}
    record_outcome(
        Outcome(
            ending.status,
            exit_code,
            reason,
            str(output_dir),
            stopped.get("private_state"),
            not_resumable=stopped.get("not_resumable"),
        )
    )
    if exit_code and not silent:
        log_stopped(prepared, ending.status, reason)
    else:
        log_finished(prepared, results, run_report, reason)
    return results


def log_empirical(run_report: RunReport) -> None:
    """The canaries' empirical epsilon beside the accountant's, when the run had canaries."""
    report = run_report.privacy
    empirical = report.empirical_epsilon
    if empirical is None:
        return
    log(
        INFO,
        "dpfl: empirical epsilon %.3g (%d%% interval %.3g..%.3g) from %d canaries, beside the "
        "accountant's %s",
        empirical["epsilon"],
        round(100 * empirical["confidence"]),
        empirical["low"],
        empirical["high"],
        empirical["canaries"],
        fmt(report.total.epsilon, "inf"),
    )


def write_results(prepared: Prepared, ending: Ending, run_report: RunReport) -> dict[str, Any]:
    """The ledgers and results.json (with metrics.csv, the plots and the final model)."""
    strategy, reporter = prepared.strategy, prepared.reporter
    report = run_report.privacy
    ledgers = strategy.ledgers()
    for name, ledger in ledgers.items():
        write_json(prepared.run.output_dir / name, ledger)
    # with a secret cohort: no count of failures and no size measured on the cohorts (each depends on
    # them); the sizes per client go to the diagnostics
    traffic: dict[str, Any] = {"failures": prepared.recorder.failures}
    if prepared.randomness.secret_cohort:
        traffic = {}
        sizes = reporter.secret_traffic.per_client()
        prepared.recorder.add_final_diagnostics({f"secret_cohort_{k}": v for k, v in sizes.items()})
    final_extras = {
        **run_report.final,
        "epsilon_training": report.total.per_stage.get("training"),
        "chance_accuracy": chance_accuracy(prepared.y_test, prepared.run.model_spec.uncounted),
        "setup_bytes": prepared.setup_bytes,
        **traffic,
    }
    return prepared.recorder.finalize(
        strategy=prepared.settings.strategy,
        status=ending.status,
        privacy=report.as_dict(),
        final_extras=final_extras,
        arrays=ending.arrays,
        model_spec=prepared.run.model_spec,
        ledger=ledgers.get(LEDGER_FILE),
        wall_s=reporter.elapsed(),
    )


def unwritten(prepared: Prepared, status: str, error: OSError) -> None:
    """One line when the results could not be written (a full disk), and the outcome."""
    output_dir, completed = prepared.run.output_dir, prepared.reporter.completed_round
    failure = error if isinstance(error, WriteFailed) else write_failed(output_dir / "results", error)
    can_resume = completed > 0 and prepared.reporter.checkpointer.not_resumable is None
    log(
        ERROR,
        "dpfl: run %s after round %d, but its results could not be written: %s%s",
        status,
        completed,
        failure,
        f"; free space, then continue with: python -m fl_app resume={output_dir}" if can_resume else "",
    )
    with_states = prepared.grid.client_states is not None
    state = (
        private_state_text(prepared.strategy, output_dir, client_states=with_states) if can_resume else None
    )
    record_outcome(Outcome("failed", 1, str(failure), str(output_dir), state))


def log_stopped(prepared: Prepared, status: str, reason: str) -> None:
    """The last line of a run that stopped early: why, where its results are, how to continue."""
    stopped, output_dir = prepared.recorder.stopped, prepared.run.output_dir
    resume = (
        f"; continue with: python -m fl_app resume={output_dir} ({stopped['private_state']})"
        if stopped and "resume" in stopped
        else f"; it cannot be resumed: {stopped['not_resumable']}"
        if stopped and "not_resumable" in stopped
        else "; nothing to resume (no round completed)"
    )
    completed = prepared.reporter.completed_round
    log(
        ERROR,
        "dpfl: run %s after round %d: %s; results in %s%s",
        status,
        completed,
        reason,
        output_dir,
        resume,
    )


def log_finished(prepared: Prepared, results: dict[str, Any], run_report: RunReport, reason: str) -> None:
    """The last line of a run whose every round ran (failures on the console only, for secret cohorts)."""
    randomness, output_dir = prepared.randomness, prepared.run.output_dir
    note = (
        "privacy randomness from OS entropy"
        if randomness.secure
        else "seeded simulation: reproducible from the published config"
    )
    holds_for = run_report.privacy.total.holds_for  # a simulated deployment's epsilon says so
    spent = epsilon_text(
        results["final"]["epsilon"],
        prepared.settings.privacy.delta,
        per=short_unit(run_report.privacy.total.unit),
        note=f"{note}; {holds_for}" if holds_for else note,
    )
    failures = prepared.recorder.failures
    why = reason or "their errors: the lines above"
    with_failures = f" with {failures} failed client replies ({why})" if failures else ""
    line = finished_line(results, spent, output_dir, with_failures)
    # with a secret cohort, failures tell about it: the console (the operator) shows them, run.log not
    withheld = finished_line(results, spent, output_dir, "") if randomness.secret_cohort else None
    log(INFO, "%s", line, extra=withheld_from_file(withheld))
    warn_if_diverged(results)
