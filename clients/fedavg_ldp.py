"""FedAvg+LDP client: local SGD, clip the update, add Gaussian noise on the device, upload.

The baseline of PrivateKT (Qi, Wu et al., Nature Communications 2023): FedAvg
(McMahan et al., AISTATS 2017, ClientUpdate) whose upload is protected by
local DP. The update ``Delta = w - w_t`` is clipped to L2 norm C and gets
``N(0, (z 2C)^2)`` noise per coordinate (2C: L2 sensitivity of a clipped
update when the client's whole data set may change), drawn from
:meth:`noise_generator` (OS entropy on real devices). The reply holds the
noisy update only: no loss, no example count.
"""

from __future__ import annotations

from clients import register_client
from clients.base import FederatedClient
from fl_app.learning.train_results import TrainResult
from fl_app.learning.training import array_values
from fl_app.privacy.mechanisms import local_gaussian_update

# ---------------------------------------------------------------- wire protocol: this algorithm's keys
LDP_CLIP = "ldp-clip"  # C: L2 bound of a client's model update
LDP_NOISE_MULTIPLIER = "ldp-noise-multiplier"  # z: Gaussian std = z * 2C per coordinate


@register_client("fedavg_ldp")
class FedAvgLDPClient(FederatedClient):
    """Uploads a clipped, locally noised model update."""

    def train_result(self) -> TrainResult:
        """One round: train, clip, noise; the upload is the noisy update alone (no metrics record)."""
        received = self.incoming_arrays()
        update = self.train_locally().update(received)
        names = list(update)
        noised = local_gaussian_update(
            update=list(update.values()),
            clip=float(self.config[LDP_CLIP]),
            noise_multiplier=float(self.config[LDP_NOISE_MULTIPLIER]),
            rng=self.noise_generator("ldp-update-noise"),
        )
        dtypes = [array_values(received[name]).dtype for name in names]
        arrays = {n: v.astype(t) for n, v, t in zip(names, noised, dtypes, strict=True)}
        return TrainResult(arrays, metrics=None)
