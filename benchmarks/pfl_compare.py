"""dpfl beside pfl-research (Apple's ``pfl==0.6.0``) on the same cross-device task, interleaved.

Usage (from the repository root; ``bash scripts/setup_pfl_env.sh`` first, which builds ``.venv-pfl``)::

    .venv/bin/python -P benchmarks/pfl_compare.py run [--rounds 100] [--repeats 1] [--out DIR]
        [--configs fedavg,dp_fedavg] [--write-doc]
    .venv/bin/python -P benchmarks/pfl_compare.py table [--out DIR] [--write-doc]

The task, dpfl's cross-device shape: Fashion-MNIST, Dirichlet(0.5) label split over N = 1000 clients
(about 48 examples each, 20 % of the training split held back as dpfl's public split), 100 clients per
round, the MLP 784-128-64-10, 1 local epoch of batch 32, client SGD lr 0.1, server lr 1 (plain
averaging), evaluation after every round on a seeded subset of 2,000 test images. Two configurations:

* ``fedavg``: non-private FedAvg, a fixed cohort of 100 distinct clients per round, the average
  weighted by the clients' example counts (dpfl's ``strategy.weighting=num_examples``);
* ``dp_fedavg``: DP-FedAvg, Poisson cohorts (q = 0.1), each client's update clipped to L2 norm 1,
  Gaussian noise of std ``z`` on the sum, divided by the fixed denominator qN = 100, ``z`` calibrated
  with the PLD accountant for (epsilon 8, delta 1e-5) after ``--rounds`` rounds.

Both frameworks train on the IDENTICAL data: ``export`` (run with dpfl's venv) writes every client's
rows of dpfl's partition (``fl_app.data.federated``), the 2,000 evaluation rows
(``fl_app.run.server.evaluation_arrays``) and dpfl's initial model (``Strategy.initial_arrays``) to an
``.npz``; the pfl side (``pfl-run``, run with ``.venv-pfl/bin/python``) reads it. The cohorts, the
order of the examples and the DP noise are drawn independently by each framework.

``run`` writes the partition file once (its time is reported, not charged to either side), computes
the noise multipliers each framework calibrates for (epsilon, delta, rounds, q) under PLD and RDP
(dpfl: ``fl_app.privacy.calibration.dp_fedavg_noise_multiplier``; pfl: ``PLDPrivacyAccountant`` and
``RDPPrivacyAccountant``), then for each repeat and configuration runs pfl, then dpfl, each as a
subprocess whose wall time (launch to exit) it measures from outside. Per run it records the median
round time of rounds 2..R (dpfl: ``rounds[].round_s``, or for Poisson cohorts, whose durations dpfl
does not publish, ``outside_guarantee.rounds[].secret_cohort_round_s`` with
``privacy.diagnostics=true``; pfl: the time between the ends of successive rounds, central evaluation
included as in dpfl), the whole-command time, the time outside the rounds and the final accuracy.
pfl runs in its simulated backend in one process with ONE torch thread; dpfl runs with its defaults,
which on this 2-core machine are two Ray actors of one CPU each.

``runs.json`` (every run, the noise multipliers, the commands) and ``table.md`` go to ``--out``;
``--write-doc`` also replaces the generated block of ``docs/benchmarks/pfl_research.md``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve()
DPFL_PYTHON = ROOT / ".venv" / "bin" / "python"
PFL_PYTHON = ROOT / ".venv-pfl" / "bin" / "python"
DOC = ROOT / "docs" / "benchmarks" / "pfl_research.md"
BEGIN = "<!-- PFL_COMPARE:BEGIN (benchmarks/pfl_compare.py --write-doc) -->"
END = "<!-- PFL_COMPARE:END -->"

NUM_CLIENTS = 1000
CLIENTS_PER_ROUND = 100
SAMPLING_RATE = CLIENTS_PER_ROUND / NUM_CLIENTS
LOCAL_EPOCHS = 1
BATCH_SIZE = 32
LR = 0.1
TEST_SUBSET = 2000
EVAL_BATCH = 256  # dpfl's fl_app.learning.training.EVAL_BATCH
EPSILON = 8.0
DELTA = 1e-5
CLIP = 1.0
SEED = 42
CONFIGS = ("fedavg", "dp_fedavg")
#: What ``runs.json`` keeps of a pfl run's ``results.json``.
PFL_RESULT_KEYS = (
    "round_s",
    "clients",
    "initial_accuracy",
    "final_accuracy",
    "final_loss",
    "noise_multiplier",
    "phases",
    "torch_threads",
)

#: The dpfl overrides of the task, shared by both configurations (and by the partition export).
TASK = (
    "dataset=fashion_mnist",
    "partition=dirichlet",
    f"num_clients={NUM_CLIENTS}",
    f"clients_per_round={CLIENTS_PER_ROUND}",
    "model=mlp",
    f"local_epochs={LOCAL_EPOCHS}",
    f"batch_size={BATCH_SIZE}",
    f"lr={LR}",
    f"evaluation.test_subset={TEST_SUBSET}",
    f"seed={SEED}",
)
#: Each configuration's own dpfl overrides. ``privacy.diagnostics=true`` only makes dpfl write the
#: Poisson rounds' durations (and update-norm statistics) to ``outside_guarantee``.
CONFIG_OVERRIDES: dict[str, tuple[str, ...]] = {
    "fedavg": ("strategy=fedavg",),
    "dp_fedavg": (
        "strategy=dp_fedavg",
        "strategy.sampling=poisson",
        f"strategy.clip={CLIP}",
        f"privacy.epsilon={EPSILON:g}",
        f"privacy.delta={DELTA:g}",
        "privacy.diagnostics=true",
    ),
}


# --------------------------------------------------------------------------------------------------
# dpfl side (run with .venv/bin/python)
# --------------------------------------------------------------------------------------------------


def dpfl_command(config: str, rounds: int, output_dir: Path) -> list[str]:
    """The dpfl command line of one run.

    Parameters
    ----------
    config : str
        ``"fedavg"`` or ``"dp_fedavg"``.
    rounds : int
        Number of rounds.
    output_dir : Path
        The run's output directory (must not hold an earlier run).

    Returns
    -------
    list[str]
        The argument vector, starting with dpfl's interpreter.

    """
    return [
        str(DPFL_PYTHON),
        "-m",
        "fl_app",
        *CONFIG_OVERRIDES[config],
        *TASK,
        f"num_rounds={rounds}",
        f"output_dir={output_dir}",
    ]


def export_partition(path: Path, overrides: Sequence[str] = TASK) -> dict[str, Any]:
    """Write dpfl's split of ``overrides`` to ``path`` (``.npz``) for the pfl side.

    Parameters
    ----------
    path : Path
        The file to write.
    overrides : Sequence[str]
        dpfl overrides that fix the data set, partition, number of clients, seed, evaluation subset
        and model.

    Returns
    -------
    dict[str, Any]
        A summary: number of clients, their sizes (min, mean, max), evaluation rows, parameter names.

    Notes
    -----
    The arrays: ``x`` and ``y``, every client's examples concatenated in client order (images as
    dpfl stores them, ``uint8`` scaled by 1/255 for training); ``offsets`` (client ``i`` owns rows
    ``offsets[i]:offsets[i + 1]``); ``rows``, the same rows as indices into the training split;
    ``x_eval`` and ``y_eval``, the server's seeded evaluation subset; ``param_names`` and
    ``param_<k>``, dpfl's initial global model in ``state_dict`` order; ``meta``, a JSON string.

    """
    from fl_app.run.harness import run_context_for
    from fl_app.run.server import evaluation_arrays
    from strategies import STRATEGIES

    with tempfile.TemporaryDirectory() as scratch:
        run = run_context_for([*overrides, "strategy=fedavg"], Path(scratch))
        initial = STRATEGIES.get("fedavg")(run).initial_arrays()
    data = run.data
    client_rows = [np.asarray(rows, dtype=np.int64) for rows in data.client_rows]
    rows = np.concatenate(client_rows) if client_rows else np.zeros(0, dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in client_rows])]).astype(np.int64)
    subset = run.settings.evaluation.test_subset
    x_eval, y_eval = evaluation_arrays(data, subset=subset, randomness=run.randomness)
    names = list(initial.keys())
    params = {f"param_{k}": initial[name].numpy() for k, name in enumerate(names)}
    sizes = np.diff(offsets)
    meta = {
        "overrides": list(overrides),
        "num_clients": len(client_rows),
        "num_classes": data.num_classes,
        "input_shape": list(data.input_shape),
        "evaluated_on": data.evaluation_split,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as handle:  # a file object: np.savez would append .npz to a str path
        np.savez(
            handle,
            x=data.arrays.x_train[rows],
            y=np.asarray(data.arrays.y_train[rows], dtype=np.int64),
            rows=rows,
            offsets=offsets,
            x_eval=x_eval,
            y_eval=np.asarray(y_eval, dtype=np.int64),
            param_names=np.array(names),
            meta=np.array(json.dumps(meta)),
            **params,
        )
    return {
        "clients": len(client_rows),
        "client_size_min": int(sizes.min()),
        "client_size_mean": float(sizes.mean()),
        "client_size_max": int(sizes.max()),
        "examples": len(rows),
        "eval_rows": len(y_eval),
        "params": names,
    }


def dpfl_noise(*, epsilon: float, delta: float, rounds: int, sampling_rate: float) -> dict[str, Any]:
    """The noise multipliers dpfl calibrates for a Poisson-sampled Gaussian run, PLD and RDP.

    Parameters
    ----------
    epsilon, delta : float
        The target budget.
    rounds : int
        Number of rounds (compositions).
    sampling_rate : float
        Poisson sampling probability q.

    Returns
    -------
    dict[str, Any]
        ``{"pld": z, "rdp": z, "pld_s": seconds, "rdp_s": seconds}``.

    """
    from fl_app.privacy.calibration import dp_fedavg_noise_multiplier

    out: dict[str, Any] = {}
    for method in ("rdp", "pld"):
        start = time.perf_counter()
        out[method] = dp_fedavg_noise_multiplier(
            epsilon=epsilon, delta=delta, sampling_rate=sampling_rate, rounds=rounds, method=method
        )
        out[f"{method}_s"] = time.perf_counter() - start
    return out


def dpfl_run_summary(output_dir: Path) -> dict[str, Any]:
    """Round times, accuracy and noise multiplier of a dpfl run, from its ``results.json``.

    Parameters
    ----------
    output_dir : Path
        The run's output directory.

    Returns
    -------
    dict[str, Any]
        ``status``, ``round_s`` (one per round), ``initial_accuracy``, ``final_accuracy``,
        ``final_loss``, ``noise_multiplier`` (None for a non-private run), ``wall_s`` (dpfl's own
        count, from its first log line) and ``clients`` (per round, where published or in
        ``outside_guarantee``).

    """
    results = json.loads((output_dir / "results.json").read_text())
    rounds = results["rounds"]
    hidden = {r["round"]: r for r in (results.get("outside_guarantee") or {}).get("rounds", [])}
    round_s, clients = [], []
    for entry in rounds:
        extra = hidden.get(entry["round"], {})
        round_s.append(entry.get("round_s", extra.get("secret_cohort_round_s")))
        clients.append(entry.get("clients", extra.get("secret_cohort_clients")))
    return {
        "status": results["status"],
        "round_s": round_s,
        "clients": clients,
        "initial_accuracy": results["initial"]["accuracy"],
        "final_accuracy": results["final"]["accuracy"],
        "final_loss": results["final"]["loss"],
        "final_epsilon": results["final"].get("epsilon"),
        "noise_multiplier": (results.get("privacy") or {}).get("noise_multiplier"),
        "wall_s": results["final"].get("wall_s"),
    }


# --------------------------------------------------------------------------------------------------
# pfl side (run with .venv-pfl/bin/python; imports nothing from dpfl)
# --------------------------------------------------------------------------------------------------


def pfl_noise(*, epsilon: float, delta: float, rounds: int, sampling_rate: float) -> dict[str, Any]:
    """The noise multipliers pfl 0.6.0's accountants calibrate, PLD and RDP.

    Parameters
    ----------
    epsilon, delta : float
        The target budget.
    rounds : int
        Number of rounds (``num_compositions``).
    sampling_rate : float
        ``sampling_probability`` (pfl's accountants compose a Poisson-sampled Gaussian).

    Returns
    -------
    dict[str, Any]
        ``{"pld": z, "rdp": z, "pld_s": seconds, "rdp_s": seconds}``.

    """
    import logging

    from pfl.privacy import PLDPrivacyAccountant, RDPPrivacyAccountant

    logging.getLogger("absl").setLevel(logging.ERROR)
    out: dict[str, Any] = {}
    for method, cls in (("rdp", RDPPrivacyAccountant), ("pld", PLDPrivacyAccountant)):
        start = time.perf_counter()
        accountant = cls(
            num_compositions=rounds,
            sampling_probability=sampling_rate,
            mechanism="gaussian",
            epsilon=epsilon,
            delta=delta,
        )
        out[method] = float(accountant.noise_parameter)
        out[f"{method}_s"] = time.perf_counter() - start
    return out


def pfl_run(
    *,
    data_path: Path,
    config: str,
    rounds: int,
    output_dir: Path,
    seed: int,
    threads: int = 1,
) -> dict[str, Any]:
    """Train the task in pfl-research's simulated backend and write ``results.json`` to ``output_dir``.

    Parameters
    ----------
    data_path : Path
        The ``.npz`` written by :func:`export_partition`.
    config : str
        ``"fedavg"`` or ``"dp_fedavg"``.
    rounds : int
        Number of central iterations.
    output_dir : Path
        Where ``results.json`` goes.
    seed : int
        Seed of this side's cohorts and example orders (:class:`numpy.random.Generator`); pfl's own
        seeds (the DP noise) come from its internal random state.
    threads : int
        torch intra-op threads (1: one core).

    Returns
    -------
    dict[str, Any]
        What ``results.json`` holds: per-round times, accuracies, cohort sizes, set-up phases,
        the noise multiplier.

    """
    start = time.perf_counter()
    import torch

    torch.set_num_threads(threads)
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints, WeightByUser
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDatasetBase
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics, StringMetricName, Weighted, get_overall_value
    from pfl.model.pytorch import PyTorchModel
    from pfl.privacy import CentrallyAppliedPrivacyMechanism, GaussianMechanism, PLDPrivacyAccountant
    from torch.nn import functional as F  # noqa: N812

    phases: dict[str, float] = {"import_s": time.perf_counter() - start}

    mark = time.perf_counter()
    archive = np.load(data_path)
    x_all = archive["x"].astype(np.float32) / np.float32(255.0)  # dpfl's to_tensor: uint8 / 255
    y_all = archive["y"].astype(np.int64)
    offsets = archive["offsets"]
    users = [(x_all[a:b], y_all[a:b]) for a, b in itertools.pairwise(offsets)]
    x_eval = archive["x_eval"].astype(np.float32) / np.float32(255.0)
    y_eval = archive["y_eval"].astype(np.int64)
    names = [str(n) for n in archive["param_names"]]
    initial = {name: torch.from_numpy(archive[f"param_{k}"].copy()) for k, name in enumerate(names)}
    num_clients = len(users)
    phases["load_s"] = time.perf_counter() - mark

    rng = np.random.default_rng(seed)

    class MLP(torch.nn.Module):
        """dpfl's ``MLP`` (784-128-64-10, same parameter names) with pfl's ``loss``/``metrics``."""

        def __init__(self, features: int, num_classes: int) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Flatten(),
                torch.nn.Linear(features, 128),
                torch.nn.ReLU(),
                torch.nn.Linear(128, 64),
                torch.nn.ReLU(),
                torch.nn.Linear(64, num_classes),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            """Class logits."""
            return self.net(x)

        def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            """Mean cross-entropy of a training batch (dpfl's ``train_local``)."""
            self.train()
            return F.cross_entropy(self(x), y.long())  # pfl hands every array over as float32

        @torch.no_grad()
        def metrics(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
            """Summed loss and correct predictions of an evaluation batch, weighted by its size."""
            self.eval()
            logits, y = self(x), y.long()
            return {
                "loss": Weighted(float(F.cross_entropy(logits, y, reduction="sum")), len(y)),
                "accuracy": Weighted(float((logits.argmax(dim=1) == y).sum()), len(y)),
            }

    class CohortDataset(FederatedDatasetBase):
        """The exported clients, served as cohorts drawn by ``cohort()`` (fixed-size or Poisson).

        pfl's own samplers draw ``cohort_size`` users with replacement from the global numpy state;
        this one draws each round's cohort with an explicit generator and ignores ``cohort_size``, so
        Poisson cohorts vary in size as dpfl's do. Each participation gets a fresh order of the
        client's examples (dpfl shuffles every epoch; pfl's ``Dataset`` does not).
        """

        def __init__(self, cohort: Callable[[], np.ndarray]) -> None:
            super().__init__()
            self._cohort = cohort
            self.sizes: list[int] = []

        def _user(self, uid: int) -> Dataset:
            x, y = users[uid]
            order = rng.permutation(len(y))
            return Dataset((x[order], y[order]), user_id=str(uid))

        def __next__(self) -> tuple[Dataset, int]:
            uid = int(rng.integers(num_clients))
            return self._user(uid), int(rng.integers(2**32))

        def get_cohort(self, cohort_size: int) -> Iterator[tuple[Dataset, int]]:
            chosen = self._cohort()
            self.sizes.append(len(chosen))
            for uid in chosen:
                yield self._user(int(uid)), int(rng.integers(2**32))

    def fixed_cohort() -> np.ndarray:
        return rng.choice(num_clients, size=CLIENTS_PER_ROUND, replace=False)

    def poisson_cohort() -> np.ndarray:
        return np.flatnonzero(rng.random(num_clients) < SAMPLING_RATE)

    class FedAvg(FederatedAveraging):
        """pfl's FederatedAveraging without per-user evaluation, optionally with a fixed denominator."""

        def __init__(self, denominator: float | None) -> None:
            super().__init__()
            self.denominator = denominator

        def get_next_central_contexts(self, *args: Any, **kwargs: Any) -> Any:
            import dataclasses

            contexts, model, metrics = super().get_next_central_contexts(*args, **kwargs)
            if contexts is not None:  # dpfl evaluates no client; pfl would evaluate each before and after
                contexts = tuple(dataclasses.replace(c, do_evaluation=False) for c in contexts)
            return contexts, model, metrics

        def process_aggregated_statistics(
            self, central_context: Any, aggregate_metrics: Any, model: Any, statistics: Any
        ) -> Any:
            if self.denominator is not None:  # DP-FedAvg: sum / (q N), not sum / cohort size
                statistics.weight = self.denominator
            return super().process_aggregated_statistics(
                central_context, aggregate_metrics, model, statistics
            )

    eval_params = NNEvalHyperParams(local_batch_size=EVAL_BATCH)
    eval_set = Dataset((x_eval, y_eval))
    history: dict[str, Any] = {"round_s": [], "accuracy": [], "loss": []}

    def evaluate(model: Any) -> tuple[float, float]:
        metrics = model.evaluate(eval_set, lambda n: StringMetricName(n), eval_params)
        by_name = {str(name): get_overall_value(value) for name, value in metrics}
        return by_name["accuracy"], by_name["loss"]

    class Recorder(TrainingProcessCallback):
        """Central evaluation after every round and the rounds' durations (evaluation included)."""

        def on_train_begin(self, *, model: Any) -> Metrics:
            history["initial_accuracy"], history["initial_loss"] = evaluate(model)
            self.last = time.perf_counter()
            return Metrics()

        def after_central_iteration(
            self, aggregate_metrics: Any, model: Any, *, central_iteration: int
        ) -> tuple[bool, Metrics]:
            accuracy, loss = evaluate(model)
            now = time.perf_counter()
            history["round_s"].append(now - self.last)
            history["accuracy"].append(accuracy)
            history["loss"].append(loss)
            self.last = now
            return False, Metrics()

    mark = time.perf_counter()
    noise_multiplier = None
    if config == "dp_fedavg":
        accountant = PLDPrivacyAccountant(
            num_compositions=rounds,
            sampling_probability=SAMPLING_RATE,
            mechanism="gaussian",
            epsilon=EPSILON,
            delta=DELTA,
        )
        noise_multiplier = float(accountant.noise_parameter)
        mechanism = GaussianMechanism.from_privacy_accountant(accountant=accountant, clipping_bound=CLIP)
        postprocessors: list[Any] = [WeightByUser(), CentrallyAppliedPrivacyMechanism(mechanism)]
        training = CohortDataset(poisson_cohort)
        algorithm = FedAvg(denominator=SAMPLING_RATE * num_clients)
    elif config == "fedavg":
        postprocessors = [WeightByDatapoints()]
        training = CohortDataset(fixed_cohort)
        algorithm = FedAvg(denominator=None)
    else:
        raise ValueError(f"unknown config {config!r}")
    phases["calibrate_s"] = time.perf_counter() - mark

    mark = time.perf_counter()
    features = int(np.prod(archive["x"].shape[1:]))
    network = MLP(features, int(json.loads(str(archive["meta"]))["num_classes"]))
    network.load_state_dict(initial)
    model = PyTorchModel(
        model=network,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(network.parameters(), lr=1.0),
    )
    backend = SimulatedBackend(training_data=training, val_data=training, postprocessors=postprocessors)
    algorithm_params = NNAlgorithmParams(
        central_num_iterations=rounds,
        evaluation_frequency=1,
        train_cohort_size=CLIENTS_PER_ROUND,
        val_cohort_size=None,
    )
    train_params = NNTrainHyperParams(
        local_batch_size=BATCH_SIZE, local_num_epochs=LOCAL_EPOCHS, local_learning_rate=LR
    )
    phases["setup_s"] = time.perf_counter() - mark

    mark = time.perf_counter()
    algorithm.run(
        algorithm_params=algorithm_params,
        backend=backend,
        model=model,
        model_train_params=train_params,
        model_eval_params=eval_params,
        callbacks=[Recorder()],
    )
    phases["train_s"] = time.perf_counter() - mark
    phases["in_process_s"] = time.perf_counter() - start

    results = {
        "framework": "pfl",
        "config": config,
        "rounds": rounds,
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "noise_multiplier": noise_multiplier,
        "clients": training.sizes,
        "round_s": history["round_s"],
        "accuracy": history["accuracy"],
        "loss": history["loss"],
        "initial_accuracy": history["initial_accuracy"],
        "initial_loss": history["initial_loss"],
        "final_accuracy": history["accuracy"][-1],
        "final_loss": history["loss"][-1],
        "phases": phases,
    }
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "results.json").write_text(json.dumps(results, indent=1))
    return results


# --------------------------------------------------------------------------------------------------
# The interleaved comparison (any interpreter; the two sides run as subprocesses)
# --------------------------------------------------------------------------------------------------


def timed(command: Sequence[str], log: Path) -> tuple[float, int]:
    """Run ``command`` from the repository root, output to ``log``; its wall time and exit status.

    Parameters
    ----------
    command : Sequence[str]
        The argument vector.
    log : Path
        File that receives the command's stdout and stderr.

    Returns
    -------
    tuple[float, int]
        Seconds from launch to exit, and the exit status.

    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as handle:
        start = time.perf_counter()
        done = subprocess.run(list(command), cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, check=False)
        wall = time.perf_counter() - start
    return wall, done.returncode


def json_from(command: Sequence[str]) -> dict[str, Any]:
    """Run a helper subcommand of this script and parse the JSON object on its last output line."""
    done = subprocess.run(list(command), cwd=ROOT, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_after_first(values: Sequence[float | None]) -> float | None:
    """Median of rounds 2..R (the first round pays warm-up); None if there are none."""
    rest = [v for v in values[1:] if v is not None]
    return statistics.median(rest) if rest else None


def run_comparison(
    *, rounds: int, repeats: int, out: Path, configs: Sequence[str], seed: int
) -> dict[str, Any]:
    """Export the split, calibrate on both sides, then run pfl and dpfl interleaved; write ``runs.json``.

    Parameters
    ----------
    rounds : int
        Rounds of every run (and of the noise calibration).
    repeats : int
        Runs per framework and configuration.
    out : Path
        Output folder (``partition.npz``, ``runs/``, ``logs/``, ``runs.json``, ``table.md``).
    configs : Sequence[str]
        Configurations, in the order they run within a repeat.
    seed : int
        Base seed of the pfl side's cohorts (repeat ``r`` uses ``seed + r``).

    Returns
    -------
    dict[str, Any]
        The record written to ``runs.json``.

    """
    for python in (DPFL_PYTHON, PFL_PYTHON):
        if not python.exists():
            hint = " (bash scripts/setup_pfl_env.sh)" if python == PFL_PYTHON else ""
            raise SystemExit(f"{python} is missing{hint}")
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    data = out / "partition.npz"
    me = [str(SCRIPT)]
    export_cmd = [str(DPFL_PYTHON), "-P", *me, "export", "--data", str(data)]
    start = time.perf_counter()
    export = json_from(export_cmd)
    export["wall_s"] = time.perf_counter() - start
    print(
        f"exported dpfl's split: {export['clients']} clients, {export['examples']} examples, "
        f"{export['eval_rows']} evaluation rows ({export['wall_s']:.1f} s)",
        flush=True,
    )
    noise_args = ["--rounds", str(rounds)]
    noise = {
        "dpfl": json_from([str(DPFL_PYTHON), "-P", *me, "noise-dpfl", *noise_args]),
        "pfl": json_from([str(PFL_PYTHON), "-P", *me, "noise-pfl", *noise_args]),
    }
    print(f"noise multipliers: {json.dumps(noise)}", flush=True)
    runs: list[dict[str, Any]] = []
    for repeat in range(1, repeats + 1):
        for config in configs:
            tag = f"{stamp}-{config}-{repeat}"
            pfl_dir = out / "runs" / f"pfl-{tag}"
            pfl_cmd = [
                str(PFL_PYTHON),
                "-P",
                *me,
                "pfl-run",
                "--data",
                str(data),
                "--config",
                config,
                "--rounds",
                str(rounds),
                "--output-dir",
                str(pfl_dir),
                "--seed",
                str(seed + repeat),
            ]
            runs.append(
                one_run(
                    ("pfl", config, repeat),
                    pfl_cmd,
                    out / "logs" / f"pfl-{tag}.log",
                    lambda d=pfl_dir: pfl_run_summary(d),
                )
            )
            dpfl_dir = out / "runs" / f"dpfl-{tag}"
            runs.append(
                one_run(
                    ("dpfl", config, repeat),
                    dpfl_command(config, rounds, dpfl_dir),
                    out / "logs" / f"dpfl-{tag}.log",
                    lambda d=dpfl_dir: dpfl_run_summary(d),
                )
            )
    record = {
        "task": {
            "dataset": "fashion_mnist",
            "partition": "dirichlet(0.5)",
            "num_clients": NUM_CLIENTS,
            "clients_per_round": CLIENTS_PER_ROUND,
            "sampling_rate": SAMPLING_RATE,
            "model": "mlp 784-128-64-10",
            "local_epochs": LOCAL_EPOCHS,
            "batch_size": BATCH_SIZE,
            "lr": LR,
            "server_lr": 1.0,
            "test_subset": TEST_SUBSET,
            "epsilon": EPSILON,
            "delta": DELTA,
            "clip": CLIP,
            "rounds": rounds,
            "repeats": repeats,
            "configs": list(configs),
        },
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": sys.version.split()[0],
        },
        "code": code_state(),
        "threads": "pfl: simulated backend, one process, torch.set_num_threads(1); dpfl: its defaults "
        f"(Ray actors of one CPU each, {os.cpu_count()} on this machine)",
        "export": export,
        "noise": noise,
        "runs": runs,
    }
    (out / "runs.json").write_text(json.dumps(record, indent=1))
    return record


def relative(command: Sequence[str]) -> list[str]:
    """``command`` with paths below the repository root written relative to it (for the record)."""
    prefix = f"{ROOT}{os.sep}"
    return [arg.replace(prefix, "") for arg in command]


def code_state() -> dict[str, Any]:
    """The commit dpfl ran from, and the files of dpfl's code that differed from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return done.stdout.rstrip("\n") if done.returncode == 0 else ""

    changed = git("status", "--porcelain", "--", "fl_app", "strategies", "clients", "conf")
    return {"commit": git("rev-parse", "HEAD"), "uncommitted": [line[3:] for line in changed.splitlines()]}


def pfl_run_summary(output_dir: Path) -> dict[str, Any]:
    """What ``runs.json`` keeps of a pfl run (:data:`PFL_RESULT_KEYS` of its ``results.json``)."""
    result = json.loads((output_dir / "results.json").read_text())
    return {key: result[key] for key in PFL_RESULT_KEYS}


def one_run(
    key: tuple[str, str, int], command: Sequence[str], log: Path, read: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """Run one framework's command, timed from outside, and summarise it.

    Parameters
    ----------
    key : tuple[str, str, int]
        Framework, configuration, repeat.
    command : Sequence[str]
        The command line.
    log : Path
        Its output.
    read : Callable[[], dict[str, Any]]
        Reads the run's results once the command succeeded.

    Returns
    -------
    dict[str, Any]
        The run's record (printed as one progress line).

    """
    load_before = os.getloadavg()[0]
    wall, code = timed(command, log)
    framework, config, repeat = key
    record: dict[str, Any] = {
        "framework": framework,
        "config": config,
        "repeat": repeat,
        "command": relative(command),
        "command_s": wall,
        "exit": code,
        "load_1min": [load_before, os.getloadavg()[0]],
    }
    if code == 0:
        record |= read()
    record = summarise(record)
    print(progress(record), flush=True)
    return record


def summarise(record: dict[str, Any]) -> dict[str, Any]:
    """Add the median round (rounds 2..R), the sum of the rounds and the time outside them."""
    round_s = record.get("round_s") or []
    if round_s and all(v is not None for v in round_s):
        record["median_round_s"] = median_after_first(round_s)
        record["rounds_total_s"] = float(sum(round_s))
        record["outside_rounds_s"] = record["command_s"] - record["rounds_total_s"]
    return record


def progress(run: dict[str, Any]) -> str:
    """One line per finished run."""
    if run.get("exit"):
        return f"{run['framework']} {run['config']} #{run['repeat']}: FAILED (exit {run['exit']})"
    return (
        f"{run['framework']:>4} {run['config']:<9} #{run['repeat']}: command {run['command_s']:.1f} s, "
        f"median round {run.get('median_round_s') or float('nan'):.3f} s, "
        f"accuracy {run.get('final_accuracy') or float('nan'):.4f}"
    )


def table_lines(record: dict[str, Any]) -> list[str]:
    """The Markdown tables of a ``runs.json`` record (ratios are dpfl / pfl: above 1, dpfl is slower).

    Parameters
    ----------
    record : dict[str, Any]
        What :func:`run_comparison` wrote.

    Returns
    -------
    list[str]
        Lines: the runs table, its notes, then the noise-multiplier table.

    """

    def num(value: float | None, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    def ratio(a: float | None, b: float | None) -> str:
        return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"

    task = record["task"]
    by_key = {(r["framework"], r["config"], r["repeat"]): r for r in record["runs"]}
    header = [
        "configuration",
        "repeat",
        "round s pfl",
        "round s dpfl",
        "round ratio",
        "command s pfl",
        "command s dpfl",
        "command ratio",
        "outside rounds s pfl / dpfl",
        "accuracy pfl",
        "accuracy dpfl",
        "z pfl / dpfl",
    ]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for config in task["configs"]:
        for repeat in range(1, task["repeats"] + 1):
            p, d = by_key.get(("pfl", config, repeat), {}), by_key.get(("dpfl", config, repeat), {})
            noise = (
                f"{num(p.get('noise_multiplier'), 4)} / {num(d.get('noise_multiplier'), 4)}"
                if config != "fedavg"
                else "-"
            )
            cells = [
                "non-private FedAvg" if config == "fedavg" else f"DP-FedAvg, eps {task['epsilon']:g}",
                repeat,
                num(p.get("median_round_s"), 3),
                num(d.get("median_round_s"), 3),
                ratio(d.get("median_round_s"), p.get("median_round_s")),
                num(p.get("command_s"), 1),
                num(d.get("command_s"), 1),
                ratio(d.get("command_s"), p.get("command_s")),
                f"{num(p.get('outside_rounds_s'), 1)} / {num(d.get('outside_rounds_s'), 1)}",
                num(p.get("final_accuracy"), 4),
                num(d.get("final_accuracy"), 4),
                noise,
            ]
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    failed = [r for r in record["runs"] if r.get("exit")]
    lines += [
        "",
        f"{task['rounds']} rounds, {task['repeats']} repeat(s), run interleaved (pfl, then dpfl, per "
        "configuration). Round: median of rounds 2..R, central evaluation on the 2,000 images included; "
        "command: launch to exit of the whole command, measured from outside; outside rounds: command "
        "minus the sum of all rounds. Ratios are dpfl / pfl (above 1: dpfl takes longer). "
        f"Threads: {record['threads']}. z: the noise multiplier each run used (PLD-calibrated).",
    ]
    if failed:
        lines.append(
            "Failed runs: " + ", ".join(f"{r['framework']} {r['config']} #{r['repeat']}" for r in failed)
        )
    loads = [x for r in record["runs"] for x in r.get("load_1min", [])]
    if loads:
        lines.append(
            f"1-minute load average before and after each run: {min(loads):.1f} to {max(loads):.1f} "
            f"({record['machine']['cpus']} CPUs)."
        )
    code = record.get("code")
    if code:
        dirty = ", ".join(code["uncommitted"]) or "none"
        lines.append(f"dpfl at commit {code['commit'][:7]}; uncommitted changes to its code: {dirty}.")
    phased = [r for r in record["runs"] if r.get("phases")]
    if phased:
        lines += [
            "",
            "pfl outside its rounds (seconds; interpreter: start-up and exit, the rest measured inside):",
        ]
        lines += [""] + [pfl_phases_line(r) for r in phased]
    noise = record["noise"]
    lines += [
        "",
        f"Noise multiplier z for (epsilon {task['epsilon']:g}, delta {task['delta']:g}) after "
        f"{task['rounds']} Poisson-sampled Gaussian rounds at q = {task['sampling_rate']:g} "
        "(calibration time in brackets):",
        "",
        "| accountant | dpfl (dp-accounting 0.6.0) | pfl 0.6.0 (dp-accounting 0.5.0) | dpfl / pfl |",
        "|---|---|---|---|",
    ]
    for method, name in (("pld", "PLD"), ("rdp", "RDP")):
        d, p = noise["dpfl"][method], noise["pfl"][method]
        lines.append(
            f"| {name} | {d:.5f} ({noise['dpfl'][method + '_s']:.1f} s) | {p:.5f} "
            f"({noise['pfl'][method + '_s']:.1f} s) | {d / p:.5f} |"
        )
    return lines


def pfl_phases_line(run: dict[str, Any]) -> str:
    """One pfl run's time outside the rounds, phase by phase (a Markdown list item)."""
    phases = run["phases"]
    interpreter = run["command_s"] - phases["in_process_s"]
    evaluation = phases["train_s"] - run.get("rounds_total_s", 0.0)
    return (
        f"- {run['config']} #{run['repeat']}: interpreter {interpreter:.1f}, torch + pfl imports "
        f"{phases['import_s']:.1f}, loading the split {phases['load_s']:.1f}, noise calibration "
        f"{phases['calibrate_s']:.1f}, model and backend {phases['setup_s']:.1f}, initial evaluation "
        f"and the rest of the loop {evaluation:.1f}"
    )


def write_table(record: dict[str, Any], out: Path, *, write_doc: bool) -> list[str]:
    """Write ``table.md`` to ``out`` (and the doc's generated block with ``write_doc``); return its lines."""
    lines = table_lines(record)
    (out / "table.md").write_text("\n".join(lines) + "\n")
    if write_doc:
        sys.path.insert(0, str(ROOT))
        from benchmarks.tables import replace_generated_block

        if not replace_generated_block(DOC, lines, begin=BEGIN, end=END):
            raise SystemExit(f"{DOC} lacks the markers {BEGIN} / {END}")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``run``, ``table``; helpers ``export``, ``noise-dpfl``, ``noise-pfl``, ``pfl-run``."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="the interleaved comparison")
    run.add_argument("--rounds", type=int, default=100)
    run.add_argument("--repeats", type=int, default=1)
    run.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: fedavg,dp_fedavg")
    run.add_argument("--seed", type=int, default=SEED, help="base seed of the pfl side's cohorts")
    run.add_argument("--out", type=Path, default=ROOT / "outputs" / "pfl_compare")
    run.add_argument("--write-doc", action="store_true", help=f"replace the generated block of {DOC.name}")
    table = sub.add_parser("table", help="re-render table.md from --out/runs.json")
    table.add_argument("--out", type=Path, default=ROOT / "outputs" / "pfl_compare")
    table.add_argument("--write-doc", action="store_true")
    export = sub.add_parser("export", help="(dpfl venv) write dpfl's split to --data")
    export.add_argument("--data", type=Path, required=True)
    for name in ("noise-dpfl", "noise-pfl"):
        noise = sub.add_parser(name, help=f"({name.split('-')[1]} venv) the calibrated noise multipliers")
        noise.add_argument("--rounds", type=int, default=100)
    pfl = sub.add_parser("pfl-run", help="(pfl venv) one pfl-research run")
    pfl.add_argument("--data", type=Path, required=True)
    pfl.add_argument("--config", choices=CONFIGS, required=True)
    pfl.add_argument("--rounds", type=int, default=100)
    pfl.add_argument("--output-dir", type=Path, required=True)
    pfl.add_argument("--seed", type=int, default=SEED)
    pfl.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    budget = {"epsilon": EPSILON, "delta": DELTA, "sampling_rate": SAMPLING_RATE}
    if args.command == "export":
        sys.path.insert(0, str(ROOT))
        print(json.dumps(export_partition(args.data)))
    elif args.command == "noise-dpfl":
        sys.path.insert(0, str(ROOT))
        print(json.dumps(dpfl_noise(rounds=args.rounds, **budget)))
    elif args.command == "noise-pfl":
        print(json.dumps(pfl_noise(rounds=args.rounds, **budget)))
    elif args.command == "pfl-run":
        result = pfl_run(
            data_path=args.data,
            config=args.config,
            rounds=args.rounds,
            output_dir=args.output_dir,
            seed=args.seed,
            threads=args.threads,
        )
        print(json.dumps({k: result[k] for k in ("final_accuracy", "noise_multiplier", "phases")}))
    elif args.command == "run":
        configs = [c for c in args.configs.split(",") if c]
        unknown = sorted(set(configs) - set(CONFIGS))
        if unknown:
            parser.error(f"unknown configurations {unknown}; allowed: {', '.join(CONFIGS)}")
        record = run_comparison(
            rounds=args.rounds, repeats=args.repeats, out=args.out, configs=configs, seed=args.seed
        )
        print("\n".join(write_table(record, args.out, write_doc=args.write_doc)))
    elif args.command == "table":
        record = json.loads((args.out / "runs.json").read_text())
        print("\n".join(write_table(record, args.out, write_doc=args.write_doc)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
