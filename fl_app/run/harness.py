"""A strategy outside a simulation: its run context and rounds on constructed replies.

Strategy tests, privacy audits and benchmarks (``benchmarks/canary_power.py``) build a strategy the
way the platform does, with the real data set and a synthetic roster (node id ``1000 + client id``,
the partitions' real sizes), and drive its server code with replies they construct, without Ray or
Flower's engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fl_app import keys
from fl_app.config.compose import compose_config
from fl_app.config.validation import typed_settings
from fl_app.data.federated import federated_data
from fl_app.privacy.rng import RandomSource
from fl_app.run.context import RunContext
from fl_app.run.roster import ClientInfo
from fl_app.run.server import noise_source, run_model_spec
from strategies.arrays import flat_vector, split_vector


def run_context_for(overrides: Sequence[str], output_dir: Path) -> RunContext:
    """The RunContext of ``overrides``: typed settings, real data, a synthetic roster.

    The settings are read as validation reads them (:func:`fl_app.config.validation.typed_settings`: each
    group's own checks, not the environment's); node ids are ``1000 + partition id`` and sizes are
    the real partition sizes; the privacy randomness is the platform's
    (:func:`fl_app.run.server.noise_source`).
    """
    settings = typed_settings(compose_config(list(overrides)))
    data = federated_data(settings.data)
    roster = [ClientInfo(i, 1000 + i, size) for i, size in enumerate(data.client_sizes())]
    model_spec = run_model_spec(settings, data)
    return RunContext(
        settings=settings,
        roster=roster,
        data=data,
        model_spec=model_spec,
        randomness=RandomSource(seed=settings.seed),
        noise=noise_source(settings),
        output_dir=output_dir,
    )


def reply_with(message: Message, arrays: ArrayRecord, metrics: dict[str, Any] | None = None) -> Message:
    """A client's reply to ``message`` carrying ``arrays`` (as the ClientApp returns it)."""
    content = RecordDict({keys.ARRAYS: arrays, keys.METRICS: MetricRecord(metrics or {})})
    return Message(content=content, reply_to=message)


def random_update_rounds(strategy: Any, rounds: int, *, norm: float, seed: int = 0) -> ArrayRecord:
    """``rounds`` rounds in which every selected client returns the model moved by ``norm`` at random.

    Each reply is the round's global model plus a vector of L2 norm ``norm`` in a uniformly random
    direction (with ``norm`` above the clip, every update is clipped). Returns the last model.
    """
    arrays = strategy.initial_arrays()
    rng = np.random.default_rng(seed)
    for server_round in range(1, rounds + 1):
        base = flat_vector(arrays)
        like = [arrays[n].numpy() for n in arrays]
        replies = []
        for message in strategy.configure_train(server_round, arrays, ConfigRecord(), grid=None):
            step = rng.standard_normal(base.size)
            parts = split_vector(base + norm * step / np.linalg.norm(step), like)
            record = ArrayRecord(
                {n: Array(p.astype(np.float32)) for n, p in zip(arrays.keys(), parts, strict=True)}
            )
            replies.append(reply_with(message, record))
        arrays, _ = strategy.aggregate_train(server_round, replies)
    return arrays
