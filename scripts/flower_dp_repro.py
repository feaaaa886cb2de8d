"""Minimal reproductions: where what Flower's DP wrappers state does not hold (flwr 1.41).

Run ``python scripts/flower_dp_repro.py`` (a few seconds). Each part drives Flower's own wrapper
objects directly (no dpfl strategy, no training: one client's update is a fixed vector) and prints
what Flower states beside what the release shows. docs/algorithms/flower_dp.md explains each.

1. The noise comes from numpy's global generator: a ServerApp that seeds numpy (for reproducible
   runs) makes every noise draw known to whoever knows the seed; the update comes back exactly.
2. A client-side wrapper's epsilon is printed whether or not the clients clipped.
3. The adaptive wrappers size the noise with the clipping norm they have just moved, not the one the
   updates were clipped to; an audit of one round finds more than the stated noise multiplier allows.
4. The clipping divides by the update's norm: a client whose update is exactly zero stops the round.
"""

# ruff: noqa: NPY002 (Flower's wrappers draw from numpy's global generator: the script seeds that one)
from __future__ import annotations

import math

import dp_accounting as dpa
import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import NeighboringRelation, PrivacyConfig, RdpAccountant, SamplingMethod
from flwr.serverapp import strategy as fs

from fl_app.engine.messages import task_identity
from fl_app.privacy.audit import audit_epsilon

D = 100  # model size
DELTA = 1e-5


class OneNode:
    """The grid of a federation of one node."""

    def get_node_ids(self) -> list[int]:
        """The one node."""
        return [1]


def average() -> fs.FedAvg:
    """Flower's FedAvg, every client weight 1 (the accountant refuses unequal ones)."""
    return fs.FedAvg(fraction_evaluate=0.0, min_train_nodes=1, min_available_nodes=1, weighted_by_key="w")


def accountant() -> RdpAccountant:
    """Flower's accountant as its fixed-clipping wrappers take it (no amplification)."""
    config = PrivacyConfig(DELTA, 10, NeighboringRelation.ADD_OR_REMOVE_ONE, SamplingMethod.NO_AMPLIFICATION)
    return RdpAccountant(config)


def one_round(wrapper: fs.Strategy, update: np.ndarray, server_round: int = 1) -> np.ndarray:
    """The model the wrapper releases when the one client sends ``0 + update``."""
    start = ArrayRecord({"w": Array(np.zeros(D, dtype=np.float32))})
    (message,) = wrapper.configure_train(server_round, start, ConfigRecord(), OneNode())
    content = RecordDict(
        {"arrays": ArrayRecord({"w": Array(update.astype(np.float32))}), "metrics": MetricRecord({"w": 1})}
    )
    if "clipping_norm" in message.content["config"]:  # a client-side adaptive wrapper wants the bit
        content["metrics"]["norm_bit"] = int(
            np.linalg.norm(update) > message.content["config"]["clipping_norm"]
        )
    released, _ = wrapper.aggregate_train(server_round, [Message(content, reply_to=message)])
    return released["w"].numpy()


def seeded_numpy() -> None:
    """1. The noise of a process that seeds numpy's global generator."""
    wrapper = fs.DifferentialPrivacyServerSideFixedClipping(average(), 1.0, 1.0, 1, accountant=accountant())
    secret = np.random.default_rng(7).normal(size=D)
    secret *= 0.9 / np.linalg.norm(secret)  # within the clipping norm
    np.random.seed(42)  # as a ServerApp that seeds numpy for reproducible runs
    released = one_round(wrapper, secret)
    np.random.seed(42)  # whoever knows the seed replays Flower's draw (std z C / m = 1)
    replayed = released - np.random.normal(0, 1.0, D).astype(np.float32)
    print(
        f"1. Flower's epsilon {wrapper.privacy_spent().epsilon:.2f} (delta {DELTA:g}); knowing numpy's seed, "
        f"the client's update comes back to {np.max(np.abs(replayed - secret)):.1e}: no epsilon holds"
    )


def unclipped_clients() -> None:
    """2. A client-side wrapper whose client did not clip."""
    wrapper = fs.DifferentialPrivacyClientSideFixedClipping(average(), 1.0, 1.0, 1, accountant=accountant())
    update = np.full(D, 10.0)  # a client without fixedclipping_mod: norm 100, the clipping norm 1
    released = one_round(wrapper, update)
    print(
        f"2. Flower's epsilon {wrapper.privacy_spent().epsilon:.2f} (delta {DELTA:g}) for a release that "
        f"moved the model by {np.linalg.norm(released):.0f}, noise std 1 per coordinate: the clipping it "
        "assumes did not happen and nothing checked"
    )


def adaptive(lr: float, quantile: float, rounds: int) -> None:
    """One round of the server-side adaptive wrapper, the client's update clipped (world 0) or zero (1)."""
    settings = {"initial_clipping_norm": 0.1, "target_clipped_quantile": quantile, "clip_norm_lr": lr}
    first = fs.DifferentialPrivacyServerSideAdaptiveClipping(
        average(), 1.0, 1, clipped_count_stddev=0.6, **settings
    )
    before = first.clipping_norm
    one_round(first, np.full(D, 0.1))  # norm 1: clipped to 0.1
    print(
        f"3. adaptive, clip_norm_lr={lr}, target_clipped_quantile={quantile}: noise multiplier 1 stated "
        f"({first.noise_multiplier:.3f} on the model); the update was clipped to {before:g}, the noise "
        f"sized for {first.clipping_norm:.4g} (x{first.clipping_norm / before:.3f})"
    )
    direction = np.full(D, 0.1) / math.sqrt(D * 0.01)
    outputs = []
    for world, update in enumerate((np.full(D, 0.1), np.full(D, 1e-12))):  # (exactly 0: see 4.)
        values = []
        for trial in range(rounds):
            np.random.seed(2 * trial + world)  # fresh noise per repetition
            wrapper = fs.DifferentialPrivacyServerSideAdaptiveClipping(
                average(), 1.0, 1, clipped_count_stddev=0.6, **settings
            )
            values.append(float(one_round(wrapper, update) @ direction))
        outputs.append(np.asarray(values))
    found = audit_epsilon(outputs_a=outputs[0], outputs_b=outputs[1], delta=0.1, discrete=False)
    pld = dpa.pld.PLDAccountant()
    pld.compose(dpa.GaussianDpEvent(1.0))
    print(
        f"   {rounds} rounds on each neighbour: epsilon >= {found.epsilon_lower_bound:.2f} (99% confidence) "
        f"at delta 0.1, where noise multiplier 1 allows {pld.get_epsilon(0.1):.2f}"
    )


class Nodes(OneNode):
    """The grid of a federation of ``count`` nodes."""

    def __init__(self, count: int) -> None:
        self.count = count

    def get_node_ids(self) -> list[int]:
        """Nodes 1..count."""
        return list(range(1, self.count + 1))


def adaptive_defaults(clients: int, rounds: int) -> None:
    """Flower's defaults (lr 0.2, quantile 0.5, count std m / 20), every update longer than the norm."""
    np.random.seed(0)
    wrapper = fs.DifferentialPrivacyServerSideAdaptiveClipping(average(), 1.0, clients)
    start = ArrayRecord({"w": Array(np.zeros(D, dtype=np.float32))})
    ratios = []
    for server_round in range(1, rounds + 1):
        messages = wrapper.configure_train(server_round, start, ConfigRecord(), Nodes(clients))
        before = wrapper.clipping_norm
        replies = [
            Message(
                RecordDict(
                    {
                        "arrays": ArrayRecord({"w": Array(np.full(D, 0.1, np.float32))}),
                        "metrics": MetricRecord({"w": 1}),
                    }
                ),
                reply_to=m,
            )
            for m in messages
        ]
        wrapper.aggregate_train(server_round, replies)
        ratios.append(wrapper.clipping_norm / before)
    print(
        f"   Flower's defaults, {clients} clients, every update clipped: each round's noise is "
        f"{np.mean(ratios):.3f} of what the norm the updates were clipped to needs; the norm moves away "
        f"from its target (0.1 -> {wrapper.clipping_norm:.4f} in {rounds} rounds, where Andrew et al.'s rule "
        "raises it while more than the target fraction is clipped)"
    )


def zero_update() -> None:
    """4. A client whose update is exactly zero."""
    wrapper = fs.DifferentialPrivacyServerSideFixedClipping(average(), 1.0, 1.0, 1, accountant=accountant())
    try:
        one_round(wrapper, np.zeros(D))
        print("4. a zero update was aggregated")
    except ZeroDivisionError as error:
        print(f"4. a client whose update is exactly zero: ZeroDivisionError ({error}) in Flower's clipping")


if __name__ == "__main__":
    with task_identity(run_id=1):
        seeded_numpy()
        unclipped_clients()
        adaptive(lr=3.0, quantile=0.0, rounds=2000)
        adaptive_defaults(clients=100, rounds=20)
        zero_update()
