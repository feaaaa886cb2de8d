"""NbAFL client: local training, whole-model clipping, Gaussian noise before the upload.

Wei et al., "Federated Learning with Differential Privacy: Algorithms and
Performance Analysis", IEEE TIFS 15, 2020 (arXiv 1911.00222), Algorithm 1, client
side: train the received global model ``w^(t-1)`` on the local data (optionally
with the FedProx term ``mu/2 ||w - w^(t-1)||^2`` of the document's local
objective), clip the whole parameter vector ``w_i <- w_i / max(1, ||w_i|| / C)``
(all arrays together), add ``n ~ N(0, sigma_U^2 I)`` with
``sigma_U = c L Delta s_U / epsilon`` (computed by the server,
:mod:`strategies.nbafl`) and upload ``w_i + n``.

Only the noised parameters and the (public) data set size leave the client: no
training loss or norm, which would be un-noised functions of the local data.
The noise comes from :meth:`~clients.base.FederatedClient.noise_generator`
(OS entropy on real devices or with ``privacy.secure_rng=true``).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from clients import register_client
from clients.base import FederatedClient
from fl_app import keys
from fl_app.learning.train_results import TrainResult
from fl_app.learning.training import LocalSGD
from fl_app.privacy.mechanisms import clip_l2, gaussian_mechanism

# ---------------------------------------------------------------- wire protocol: this algorithm's keys
NBAFL_CLIP = "nbafl-clip"  # C: L2 bound of a client's whole uploaded parameter vector
NBAFL_SIGMA_UP = "nbafl-sigma-up"  # sigma_U: std of the uplink Gaussian noise per coordinate
NBAFL_MU = "nbafl-mu"  # FedProx proximal coefficient mu of local training (0: plain SGD)


@register_client("nbafl")
class NbAFLClient(FederatedClient):
    """Trains, clips the model to norm C, adds N(0, sigma_U^2) per coordinate, uploads."""

    def local_sgd(self) -> LocalSGD:
        """The train config's SGD with the proximal coefficient ``strategy.mu`` (0: plain SGD)."""
        return replace(super().local_sgd(), proximal_mu=max(float(self.config.get(NBAFL_MU, 0.0)), 0.0))

    def train_result(self) -> TrainResult:
        """One round: local (proximal) SGD, clip, noise; the upload is the noised model and the data size."""
        clip = float(self.config[NBAFL_CLIP])
        sigma = float(self.config[NBAFL_SIGMA_UP])
        data = self.local_data()
        trained = self.train_locally().state
        names = list(trained)
        clipped, _ = clip_l2(arrays=[trained[name] for name in names], max_norm=clip)
        rng = self.noise_generator("nbafl-uplink")
        noised = [gaussian_mechanism(values=array, sigma=sigma, rng=rng) for array in clipped]
        return TrainResult(
            arrays={name: np.asarray(values) for name, values in zip(names, noised, strict=True)},
            metrics={keys.NUM_EXAMPLES: len(data)},
        )
