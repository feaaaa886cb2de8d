"""CPU per train message, client side and server side, without Flower's engine (one thread).

A strategy's real ``configure_train`` messages for one round, each with its node's Context, run
through the engine's ``run_jobs`` (every message through the ClientApp, as an actor runs a batch; no
Ray, no pickling, no Flower engine), then the strategy's ``aggregate_train`` on the replies. Prints
the process CPU per message of each side for rounds 2-4 (round 1 warms up the data and the model);
``--profile`` adds a cProfile of round 6 (the profiler's overhead inflates Python-heavy frames).
What a Flower message per client costs beside training, where issue 58's goals need under 0.1 ms::

    python -P benchmarks/message_path.py [--population 1000] [--cohort 100] [--dataset fashion_mnist]
        [--strategy fedavg] [--profile] [OVERRIDE ...]     # e.g. simulation.vectorise=true
    python -P benchmarks/message_path.py --steps 300      # a member's pieces from the tight loop up
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fl_app import keys
from fl_app.client_app import app
from fl_app.engine.batching import run_jobs
from fl_app.engine.messages import set_task_identity
from fl_app.learning.training import array_values, load_arrays, model_state, train_local
from fl_app.privacy.rng import make_generator
from fl_app.run.harness import run_context_for
from strategies import STRATEGIES


def node_context(message: Message, population: int) -> Context:
    """The Context the simulation gives the message's node (partition id = node id - 1000)."""
    node = int(message.metadata.dst_node_id)
    config = {keys.NODE_PARTITION_ID: node - 1000, keys.NODE_NUM_PARTITIONS: population}
    return Context(run_id=77, node_id=node, node_config=config, state=RecordDict(), run_config={})


def one_round(strategy: Any, arrays: Any, server_round: int, population: int) -> tuple[float, float, int]:
    """Client-side and server-side CPU seconds of one round, and its number of messages."""
    messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid=None))
    jobs = [(message, node_context(message, population)) for message in messages]
    started = time.process_time()
    outcomes = run_jobs(lambda: app, jobs)
    clients_done = time.process_time()
    strategy.aggregate_train(server_round, [outcome[1] for outcome in outcomes if outcome[0] == "reply"])
    return clients_done - started, time.process_time() - clients_done, len(messages)


def cohort_round(strategy: Any, arrays: Any, server_round: int, population: int) -> tuple[float, float, int]:
    """:func:`one_round` with the round sent as packed messages (``fl_app/engine/packed.py``)."""
    from fl_app.engine import packed as pack_messages
    from fl_app.engine.messages import set_message_id

    messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid=None))
    partitions = {int(m.metadata.dst_node_id): int(m.metadata.dst_node_id) - 1000 for m in messages}
    started = time.process_time()
    packed = pack_messages.pack(messages, partitions=partitions, summand=strategy.reply_summand(server_round))
    ids = [f"cohort-{i}" for i in range(len(packed))]
    for cohort, message_id in zip(packed, ids, strict=True):
        set_message_id(cohort.message, message_id)
    outcomes = run_jobs(lambda: app, [(c.message, node_context(c.message, population)) for c in packed])
    clients_done = time.process_time()
    replies = pack_messages.unpack([o[1] for o in outcomes if o[0] == "reply"], packed, ids)
    strategy.aggregate_train(server_round, replies)
    return clients_done - started, time.process_time() - clients_done, len(messages)


def floor_round(strategy: Any, arrays: Any, server_round: int) -> tuple[float, int]:
    """CPU seconds of the same round's work without messages, and its number of clients.

    What a cohort that crossed the engine as one message would still do per member on this CPU: the
    global model loaded into the process's model (``clients.base.process_model``, ``load_arrays``), the
    member's local SGD (its data, its ``data-order`` generator, the train config's settings) and its
    weighted model added to a float64 sum array by array (as ``WeightedModel.add_to``); then the mean.
    The difference to :func:`cohort_round` is the most such a design could take off.
    """
    from clients.base import process_model

    messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid=None))
    run, config = strategy.run, messages[0].content.config_records[keys.CONFIG]
    started = time.process_time()
    model = process_model(run.model_spec.to_json())
    totals = {name: np.zeros(arrays[name].shape, dtype=np.float64) for name in arrays}
    weight = 0.0
    for message in messages:
        client = int(message.metadata.dst_node_id) - 1000
        data = run.data.client(client)
        load_arrays(model, arrays)
        rng = make_generator(
            seed=int(config[keys.SEED]), secure=False, purpose="data-order", client=client,
            server_round=server_round,
        )  # fmt: skip
        train_local(
            model, data.x, data.y, epochs=int(config[keys.LOCAL_EPOCHS]),
            batch_size=int(config[keys.BATCH_SIZE]), lr=float(config[keys.LR]), rng=rng,
        )  # fmt: skip
        add_weighted(totals, model, len(data))
        weight += len(data)
    for total in totals.values():
        total /= weight
    return time.process_time() - started, len(messages)


def add_weighted(totals: dict[str, np.ndarray], model: Any, weight: float) -> None:
    """Add ``weight`` times the model's state to the float64 sums array by array (as ``WeightedModel``)."""
    for name, values in model_state(model).items():
        totals[name] += values.astype(np.float64) * weight


def tight_round(strategy: Any, arrays: Any, server_round: int) -> tuple[float, int]:
    """CPU seconds of the same clients' local SGD as the tightest loop, and its number of clients.

    One model whose parameters take the global values in place (``torch._foreach_copy_``), each
    client's examples as tensors made before the clock starts, plain SGD steps on
    ``torch.autograd.grad``, the weighted sum in float64 tensors: the floor of issue 58's CPU goal
    (``benchmarks/cross_device_cpu.py``'s ``loop`` arm, per client).
    """
    from benchmarks.cross_device_cpu import example_tensors, tight_client

    messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid=None))
    run, config = strategy.run, messages[0].content.config_records[keys.CONFIG]
    clients = [int(message.metadata.dst_node_id) - 1000 for message in messages]
    tensors = {client: example_tensors(run.data.client(client)) for client in clients}
    model = run.model_spec.build()
    start = [torch.from_numpy(array_values(arrays[name]).copy()) for name in arrays]
    params = list(model.parameters())
    sums = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    sgd = (int(config[keys.LOCAL_EPOCHS]), int(config[keys.BATCH_SIZE]), float(config[keys.LR]))
    orders = torch.Generator().manual_seed(server_round)
    started = time.process_time()
    for client in clients:
        tight_client(model, params, start, tensors[client], sgd=sgd, orders=orders, sums=sums)
    return time.process_time() - started, len(clients)


#: :func:`client_steps`' variants, each one piece of dpfl's client more than the one before.
STEPS = (
    "tight loop",
    "+ train_local for the SGD steps",
    "+ load_arrays for the global model",
    "+ model_state and the float64 term in numpy",
    "+ the data-order generator",
)


def client_steps(strategy: Any, arrays: Any, clients: Sequence[int], repeats: int) -> list[float]:
    """CPU ms per client of :data:`STEPS`, interleaved client by client (the variants in rotating order).

    From the tight loop's client (:func:`benchmarks.cross_device_cpu.tight_client`) to dpfl's work for a
    member without its messages, one piece at a time, on a process model as the clients use it
    (:func:`clients.base.process_model`): where the CPU between them goes.
    """
    from benchmarks.cross_device_cpu import example_tensors, tight_client
    from clients.base import process_model

    run = strategy.run
    config = next(iter(strategy.configure_train(3, arrays, ConfigRecord(), grid=None))).content[keys.CONFIG]
    sgd = (int(config[keys.LOCAL_EPOCHS]), int(config[keys.BATCH_SIZE]), float(config[keys.LR]))
    model = process_model(run.model_spec.to_json())
    params = list(model.parameters())
    names = list(arrays.keys())
    start = [torch.from_numpy(array_values(arrays[name]).copy()) for name in names]
    sums = [torch.zeros_like(p, dtype=torch.float64) for p in params]
    totals = {name: np.zeros(arrays[name].shape, dtype=np.float64) for name in names}
    data = {c: run.data.client(c) for c in clients}
    tensors = {c: example_tensors(data[c]) for c in clients}
    orders = torch.Generator().manual_seed(0)

    def variant(level: int, client: int) -> None:
        if level == 0:
            tight_client(model, params, start, tensors[client], sgd=sgd, orders=orders, sums=sums)
            return
        if level >= 2:
            load_arrays(model, arrays)
        else:
            with torch.no_grad():
                torch._foreach_copy_(params, start)
        x, y = data[client].x, data[client].y
        seed = int(config[keys.SEED])
        rng = (
            make_generator(seed=seed, secure=False, purpose="data-order", client=client, server_round=3)
            if level >= 4
            else np.random.default_rng(client)
        )
        train_local(model, x, y, epochs=sgd[0], batch_size=sgd[1], lr=sgd[2], rng=rng)
        if level >= 3:
            add_weighted(totals, model, len(y))
        else:
            with torch.no_grad():
                for total, parameter in zip(sums, params, strict=True):
                    total.add_(parameter, alpha=len(y))

    spent = [0.0] * len(STEPS)
    for level in range(len(STEPS)):  # warm-up
        for client in clients[:20]:
            variant(level, client)
    for _ in range(repeats):
        for position, client in enumerate(clients):
            for shift in range(len(STEPS)):
                level = (position + shift) % len(STEPS)
                began = time.process_time()
                variant(level, client)
                spent[level] += time.process_time() - began
    return [total / (repeats * len(clients)) * 1e3 for total in spent]


def main() -> int:
    """Print the CPU per message of each side."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--population", type=int, default=1000)
    parser.add_argument("--cohort", type=int, default=100)
    parser.add_argument("--dataset", default="fashion_mnist")
    parser.add_argument("--strategy", default="fedavg")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--cohort-messages", action="store_true", help="profile the cohort-message round")
    parser.add_argument(
        "--steps", type=int, default=0, metavar="CLIENTS", help="only the client's pieces (client_steps)"
    )
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    torch.set_num_threads(1)
    set_task_identity(run_id=77)
    partition = "partition=iid" if args.dataset == "digits" else "partition=dirichlet"
    overrides = [
        f"dataset={args.dataset}",
        partition,
        f"num_clients={args.population}",
        f"clients_per_round={args.cohort}",
        "model=mlp",
        "local_epochs=1",
        "batch_size=32",
        "lr=0.1",
        "seed=42",
        f"strategy={args.strategy}",
        *args.overrides,
    ]
    strategy = STRATEGIES.get(args.strategy)(run_context_for(overrides, Path(tempfile.mkdtemp())))
    arrays = strategy.initial_arrays()
    if args.steps:
        sampled = np.random.default_rng(0).choice(args.population, args.steps, replace=False)
        clients = [int(c) for c in sampled]
        for step, ms in zip(STEPS, client_steps(strategy, arrays, clients, repeats=3), strict=True):
            print(f"{step}: {ms:.3f} ms per client")
        return 0
    one_round(strategy, arrays, 1, args.population)
    for server_round in range(2, 5):
        client_s, server_s, count = one_round(strategy, arrays, server_round, args.population)
        print(
            f"round {server_round}: {count} messages, client side {client_s / count * 1e3:.3f} ms "
            f"per message, server side {server_s / count * 1e3:.3f} ms per reply"
        )
    for repeat in range(1, 4):  # interleaved: the machine's speed drifts within minutes
        cohort_s, server_s, count = cohort_round(strategy, arrays, 2 + repeat, args.population)
        floor_s, _ = floor_round(strategy, arrays, 2 + repeat)
        tight_s, _ = tight_round(strategy, arrays, 2 + repeat)
        print(
            f"repeat {repeat}, per member: as packed messages {cohort_s / count * 1e3:.3f} ms client side "
            f"(+ {server_s / count * 1e3:.3f} ms server side); the same work without messages "
            f"{floor_s / count * 1e3:.3f} ms; the tight loop {tight_s / count * 1e3:.3f} ms"
        )
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        (cohort_round if args.pack_messages else one_round)(strategy, arrays, 6, args.population)
        profile.disable()
        pstats.Stats(profile).sort_stats("cumulative").print_stats(40)
    return 0


if __name__ == "__main__":
    sys.exit(main())
