"""Distributed-DP client: train, clip, rotate, quantize, add Skellam noise, upload mod 2^b via SecAgg+.

The device half of ``strategy=dp_fedavg_secagg`` (the server and the papers:
:mod:`strategies.dp_fedavg_secagg`). The train message arrives inside Flower's SecAgg+ protocol
(:func:`fl_app.engine.secagg.secure_aggregation_mod`, Flower's ``secaggplus_mod`` with dpfl's
masks, applied by :func:`fl_app.client_app.train` to every message of the protocol), whose collect
stage calls this client: it trains locally, encodes its update with
:func:`fl_app.privacy.distributed.encode_update` (clip to C, randomized Hadamard rotation from the
round's public seed, scale, conditional randomized rounding, Skellam noise of the local variance,
mod ``2^b``) and hands the integers in ``[0, 2^b)`` to the mod, which adds the masks. The rounding and
the noise come from :meth:`noise_generator` (OS entropy on a device).

A train message outside the protocol is refused: this client never uploads its vector unmasked.
The reply carries no loss and no example count (the count is fixed at 1, which makes
the weighting of Flower's reply layout the identity), only the mechanism parameters it applied (the
server rejects a client that applied others).
"""

from __future__ import annotations

import json

import numpy as np
from flwr.app import Message
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

from clients import register_client
from clients.base import FederatedClient
from fl_app.engine.secagg import RECORD_KEY_CONFIGS, fitres_to_recorddict
from fl_app.learning.records import config_record
from fl_app.privacy.distributed import SkellamPlan, encode_update, rotation_signs

# ---------------------------------------------------------------- wire protocol: this algorithm's keys
SECAGG_PLAN = "ddp-plan"  # the SkellamPlan as JSON (clip, bits, dim, scale, bounds, local variance)
ROTATION_SEED = "ddp-rotation-seed"  # the round's public seed of the Hadamard signs
#: The mechanism parameters a reply echoes (fitres metrics), checked by the server.
ECHOED = ("clip", "bits", "dim", "scale", "l2_sensitivity", "local_variance")


@register_client("dp_fedavg_secagg")
class DistributedDPClient(FederatedClient):
    """Encodes its noisy, quantized update for secure aggregation."""

    def train(self) -> Message:
        """One round inside SecAgg+'s collect stage: train, encode, reply in the layout the mod reads."""
        if config_record(self.message.content, RECORD_KEY_CONFIGS) is None:
            raise RuntimeError(
                "dp_fedavg_secagg uploads only inside the SecAgg+ protocol; this train message is outside it"
            )
        plan = SkellamPlan.from_json(json.loads(str(self.config[SECAGG_PLAN])))
        update = np.concatenate(
            [a.ravel() for a in self.train_locally().update(self.incoming_arrays()).values()]
        )
        if update.size > plan.dim:
            raise ValueError(f"the model has {update.size} parameters, more than the plan's {plan.dim}")
        signs = rotation_signs(seed=int(self.config[ROTATION_SEED]), dim=plan.dim)
        encoded = encode_update(update, plan=plan, signs=signs, rng=self.noise_generator("ddp-encoding"))
        fitres = FitRes(
            status=Status(code=Code.OK, message=""),
            parameters=ndarrays_to_parameters([encoded.astype(np.int64)]),
            num_examples=1,
            metrics={key: getattr(plan, key) for key in ECHOED},
        )
        return Message(content=fitres_to_recorddict(fitres, keep_input=False), reply_to=self.message)
