"""The client of Flower's strategies run by dpfl: FedAvg's local SGD, plus FedProx's proximal term.

Flower's ``FedProx`` (``flwr.serverapp.strategy``) sends ``proximal-mu`` in the train config and
leaves the term to the client (its docstring): local training then minimises
``loss + mu/2 ||w - w_t||^2`` (Li et al., "Federated Optimization in Heterogeneous Networks",
MLSys 2020, Algorithm 2), with ``w_t`` the received model. Without the key it is FedAvg's client.

Flower's client-side DP wrappers (``DifferentialPrivacyClientSideFixedClipping``, ``...Adaptive...``)
leave the clipping to a mod of the ClientApp: when the train config names one (:data:`CLIPPING_MOD`,
set by dpfl's adapter), the reply goes through Flower's own ``fixedclipping_mod`` or
``adaptiveclipping_mod`` (it clips ``w_k - w_t`` to the ``clipping_norm`` the wrapper put in the
config; the adaptive one adds the ``norm_bit``). Every reply also carries :data:`UNIFORM_WEIGHT`
(1), a weight any Flower strategy can average by (``weighted_by_key``): uniform weighting.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from flwr.app import Message
from flwr.clientapp.mod import adaptiveclipping_mod, fixedclipping_mod

from clients import register_client
from clients.fedavg import FedAvgClient
from fl_app.learning.train_results import TrainResult
from fl_app.learning.training import LocalSGD

#: Flower's FedProx config key (``flwr.serverapp.strategy.FedProx.configure_train``).
PROXIMAL_MU = "proximal-mu"
#: dpfl's train-config key naming the Flower mod a client-side DP wrapper needs (a key of :data:`MODS`).
CLIPPING_MOD = "clipping-mod"
#: The reply metric that is 1 for every client: uniform weights for a Flower strategy's average.
UNIFORM_WEIGHT = "uniform-weight"
#: Flower's client mods of central DP with client-side clipping (``flwr.clientapp.mod``), by name.
MODS = {"fixedclipping_mod": fixedclipping_mod, "adaptiveclipping_mod": adaptiveclipping_mod}


@register_client("flower")
class FlowerClient(FedAvgClient):
    """Local SGD on the received model (with the proximal term when the config asks), the model back."""

    def local_sgd(self) -> LocalSGD:
        """The train config's SGD with FedProx's ``proximal-mu`` from the Flower strategy (0: FedAvg)."""
        return replace(super().local_sgd(), proximal_mu=max(float(self.config.get(PROXIMAL_MU, 0.0)), 0.0))

    def train_result(self) -> TrainResult:
        """FedAvg's result (with the proximal term when the config asks), and the uniform weight."""
        result = super().train_result()
        return TrainResult(result.arrays, {**(result.metrics or {}), UNIFORM_WEIGHT: 1})

    def train(self) -> Message:
        """The reply, through Flower's clipping mod when the train config names one."""
        name = self.config.get(CLIPPING_MOD)
        if name is None:
            return super().train()
        if str(name) not in MODS:
            raise ValueError(f"unknown {CLIPPING_MOD} {name!r}; known: {', '.join(MODS)}")
        logger = logging.getLogger("flwr")
        level = logger.level
        logger.setLevel(max(level, logging.WARNING))  # the mod's line per message: "clipped by value ..."
        try:
            return MODS[str(name)](self.message, self.context, lambda _msg, _ctx: FedAvgClient.train(self))
        finally:
            logger.setLevel(level)
