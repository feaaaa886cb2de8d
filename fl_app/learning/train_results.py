"""A client's train result before it is encoded as a reply: its arrays, its metrics, its other records.

A client whose train reply is only its trained model and a few numbers (FedAvg's, and the central-DP
baselines' that use it) returns a :class:`TrainResult` from
:meth:`clients.base.FederatedClient.train_result`; its ``train`` reply is :meth:`TrainResult.content`.
A packed message's member (:mod:`fl_app.engine.packed`) hands the result to the strategy's summand
directly instead: encoding 0.44 MB of model into message arrays, weighing the reply and decoding it
again were about a fifth of a member's CPU on the cross-device task (docs/performance.md). The
server reads a plain reply back into the same form (:meth:`TrainResult.of_reply`), so a summand
sees the same numbers either way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

from fl_app import keys
from fl_app.learning.training import array_values, state_to_arrays


@dataclass(frozen=True)
class TrainResult:
    """A train reply's content, decoded: the model's arrays by name, the metrics, other array records.

    ``arrays`` may be views of a process's model (:func:`fl_app.learning.training.model_state`): use them
    before that model trains the next client. ``metrics`` None: the reply has no metrics record
    (FedAvg+LDP's upload is its noisy update alone). ``records``: the algorithm's other uploads, an
    array record each by name (SCAFFOLD's control variate update).
    """

    arrays: Mapping[str, np.ndarray]
    metrics: Mapping[str, int | float] | None
    records: Mapping[str, Mapping[str, np.ndarray]] = field(default_factory=dict)

    def content(self) -> RecordDict:
        """The reply's content: the arrays (as ``state_to_arrays`` makes them), the metrics, the records."""
        content = RecordDict({keys.ARRAYS: state_to_arrays(dict(self.arrays))})
        if self.metrics is not None:
            content[keys.METRICS] = MetricRecord(dict(self.metrics))
        for name, record in self.records.items():
            content[name] = state_to_arrays(dict(record))
        return content

    def metric(self, key: str) -> float:
        """One of the metrics, as a float (``KeyError`` when the reply has none of that name)."""
        if self.metrics is None:
            raise KeyError(key)
        return float(self.metrics[key])

    def checked(self, like: ArrayRecord) -> TrainResult:
        """Itself; ``ValueError`` unless its arrays have the names, order and shapes of ``like``."""
        if not _shaped_like({name: values.shape for name, values in self.arrays.items()}, like):
            raise ValueError("malformed reply: arrays do not match the model")
        return self

    @classmethod
    def of_reply(cls, reply: Message, like: ArrayRecord) -> TrainResult:
        """A plain train reply, read in place; ``ValueError`` unless its arrays are shaped like ``like``."""
        problem = arrays_mismatch(reply, like)
        if problem:
            raise ValueError(f"malformed reply: {problem}")
        records = reply.content.array_records
        received = records[keys.ARRAYS]
        metrics = reply.content.get(keys.METRICS)
        return cls(
            arrays={name: array_values(received[name]) for name in received},
            metrics=dict(metrics) if isinstance(metrics, MetricRecord) else None,  # type: ignore[arg-type]
            records={
                name: {key: array_values(record[key]) for key in record}
                for name, record in records.items()
                if name != keys.ARRAYS
            },
        )


def arrays_mismatch(reply: Message, like: ArrayRecord) -> str:
    """Empty when the reply holds arrays with the names and shapes of ``like``, else what is wrong."""
    if keys.ARRAYS not in reply.content.array_records:
        return "no arrays"
    received = reply.content.array_records[keys.ARRAYS]
    if not _shaped_like({name: array.shape for name, array in received.items()}, like):
        return "arrays do not match the model"
    return ""


def _shaped_like(shapes: Mapping[str, Sequence[int]], like: ArrayRecord) -> bool:
    """Whether ``shapes`` names the arrays of ``like`` in its order, each with its shape."""
    return list(shapes) == list(like.keys()) and all(tuple(shapes[k]) == tuple(like[k].shape) for k in like)
