"""Flower's SecAgg+ (flwr 1.41.0): the client mod, its message keys and the primitives the server needs.

dpfl's distributed-DP strategy (:mod:`strategies.dp_fedavg_secagg`) runs the server side of the
SecAgg+ protocol (Bell, Bonawitz, Gascon, Lepoint, Raykova, CCS 2020) in its own round, with the
same messages as Flower's ``SecAggPlusWorkflow`` so that the clients run Flower's
``secaggplus_mod`` unchanged. What it needs of Flower beyond the public API is here: the stage and
key names, Shamir's secret sharing, the key agreement, the mask generator and the conversion of a
legacy ``FitRes`` into the record layout ``secaggplus_mod`` reads a client's reply in. No
cryptography is written in dpfl.

One patch (:func:`share_in_the_callers_thread`, applied on import, so in every process that runs the
ClientApp or the strategy): Flower's Shamir secret sharing (``create_shares``, ``combine_shares``)
opens a thread pool for every secret it splits or joins and maps pycryptodome's ``Shamir`` over the
secret's 16-byte chunks in it. That code is pure Python and holds the GIL, so the threads run one
after another; what the pool adds is starting and joining up to ``cpu_count`` threads per call, two
calls per client and round on the devices and one per client on the server. The patch gives the
module an executor that maps in the caller's thread: the same calls in the same order, the same
shares (their randomness is pycryptodome's ``get_random_bytes`` either way). Measured: the one-round
SecAgg+ audit (tests/test_privacy_end_to_end.py, 1,600 in-process rounds of 2 clients) spent 36 s of
its 110 s in the pools.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import flwr.common.secure_aggregation.crypto.shamir as shamir
from flwr.client.mod import secaggplus_mod
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
from flwr.compat.common.recorddict_compat import fitres_to_recorddict
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

__all__ = [
    "RECORD_KEY_CONFIGS",
    "Key",
    "Stage",
    "bytes_to_private_key",
    "bytes_to_public_key",
    "combine_shares",
    "fitres_to_recorddict",
    "generate_shared_key",
    "pseudo_rand_gen",
    "secaggplus_mod",
]


class InlineExecutor:
    """A ``ThreadPoolExecutor`` stand-in whose ``map`` runs every call in the caller's thread, in order."""

    def __init__(self, max_workers: int | None = None) -> None:
        self.max_workers = max_workers

    def __enter__(self) -> InlineExecutor:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def map(self, function: Callable[..., Any], *iterables: Iterable[Any]) -> Iterator[Any]:
        """``function`` over the items, as ``Executor.map`` yields them (results in order)."""
        return iter([function(*items) for items in zip(*iterables, strict=False)])


def share_in_the_callers_thread() -> None:
    """Make Flower's Shamir secret sharing run without a thread pool per call (idempotent)."""
    if getattr(shamir, "ThreadPoolExecutor", None) is not None:
        shamir.ThreadPoolExecutor = InlineExecutor


share_in_the_callers_thread()
