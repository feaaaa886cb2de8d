"""Flower's SecAgg+ (flwr 1.41.0): the client mod, its message keys and the primitives the server needs.

dpfl's distributed-DP strategy (:mod:`strategies.dp_fedavg_secagg`) runs the server side of the
SecAgg+ protocol (Bell, Bonawitz, Gascon, Lepoint, Raykova, CCS 2020) in its own round, with the
same messages as Flower's ``SecAggPlusWorkflow`` so that the clients run Flower's
``secaggplus_mod`` unchanged. What it needs of Flower beyond the public API is here: the stage and
key names, Shamir's secret sharing, the key agreement, the mask generator and the conversion of a
legacy ``FitRes`` into the record layout ``secaggplus_mod`` reads a client's reply in. No
cryptography is written in dpfl.
"""

from __future__ import annotations

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
