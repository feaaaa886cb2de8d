"""Clustering-evaluation client: Laplace-protected inference results (local DP).

MindSpore Federated documentation, "Horizontal Federated-Local Differential
Privacy Inference Result Protection": after receiving the global model, the
device runs inference on its local data and uploads the softmax vectors,
each perturbed as ``M(x, eps) = X + Lap(Delta f / eps)`` (i.i.d. per
coordinate, ``privacy_eval_type: LAPLACE``) or in the clear
(``NOT_ENCRYPT``); the server clusters them (:mod:`strategies.laplace_eval`).

The document's ``Delta f = 1`` is wrong for probability vectors (two of them
can differ by 2 in L1); the noise is calibrated with the sensitivity the
server sends (``evaluation.sensitivity``, default 2) and the server accounts
with the true sensitivity 2 whatever was configured.

The reply holds one ArrayRecord with one array, the (noised) vectors of shape
``(n, classes)``: no labels, no loss, no example count beyond what the shape
shows (``n`` = the number of local examples). Noise comes from
:meth:`~clients.base.FederatedClient.noise_generator`: OS entropy on a real
device (the document's ``SecureRandom``) or with ``privacy.secure_rng``,
seeded only in a seeded simulation.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Message, RecordDict

from clients import register_client
from clients.base import FederatedClient
from fl_app.learning.training import predict_proba
from fl_app.privacy.mechanisms import laplace_mechanism, probability_rows

# ---------------------------------------------------------------- wire protocol: this algorithm's keys
PRIVACY_EVAL_TYPE = "privacy-eval-type"  # NOT_ENCRYPT | LAPLACE
LAPLACE_EVAL_EPS = "laplace-eval-eps"  # epsilon of the Laplace mechanism per report (as configured)
EVAL_SENSITIVITY = "eval-sensitivity"  # L1 sensitivity the client calibrates its noise with
INFERENCE_REPORTS = "inference-reports"  # reply ArrayRecord: the (noised) softmax vectors, nothing else


NOT_ENCRYPT = "NOT_ENCRYPT"
LAPLACE = "LAPLACE"
PRIVACY_EVAL_TYPES: tuple[str, ...] = (NOT_ENCRYPT, LAPLACE)
REPORTS_ARRAY = "softmax"


@register_client("laplace_eval")
class LaplaceEvalClient(FederatedClient):
    """Runs the global model on local data and uploads (noised) softmax vectors only."""

    def inference_results(self) -> np.ndarray:
        """Softmax vectors of the received global model on every local example (labels unused).

        Returns
        -------
        np.ndarray
            Shape ``(n, classes)``, float64, each row a probability vector.

        """
        data = self.local_data()
        return probability_rows(values=predict_proba(self.global_model(), data.x))

    def protect(self, vectors: np.ndarray) -> np.ndarray:
        """Apply the configured protection to the vectors (the document's ``M(x, eps)``).

        Parameters
        ----------
        vectors : np.ndarray
            Probability vectors, shape ``(n, classes)``.

        Returns
        -------
        np.ndarray
            ``vectors + Lap(sensitivity / eps)`` per coordinate (``LAPLACE``) or
            the vectors unchanged (``NOT_ENCRYPT``).

        """
        mode = str(self.config[PRIVACY_EVAL_TYPE])
        if mode == NOT_ENCRYPT:
            return vectors
        if mode != LAPLACE:
            raise ValueError(f"{PRIVACY_EVAL_TYPE}={mode!r}: must be one of {', '.join(PRIVACY_EVAL_TYPES)}")
        return laplace_mechanism(
            values=vectors,
            sensitivity=float(self.config[EVAL_SENSITIVITY]),
            epsilon=float(self.config[LAPLACE_EVAL_EPS]),
            rng=self.noise_generator("laplace-eval-noise"),
        )

    def evaluate(self) -> Message:
        """Infer, protect, and reply with the vectors alone."""
        reports = self.protect(self.inference_results())
        content = RecordDict({INFERENCE_REPORTS: ArrayRecord({REPORTS_ARRAY: Array(reports)})})
        return Message(content=content, reply_to=self.message)


def reported_vectors(reply: Message, *, num_classes: int) -> tuple[np.ndarray | None, int]:
    """The ``(n, num_classes)`` vectors of an evaluation reply (None if malformed) and its row count."""
    record = reply.content.array_records.get(INFERENCE_REPORTS)
    vectors = None if record is None or REPORTS_ARRAY not in record else record[REPORTS_ARRAY].numpy()
    rows = int(vectors.shape[0]) if vectors is not None and vectors.ndim >= 1 else 0
    if vectors is None or vectors.ndim != 2 or vectors.shape[1] != num_classes:
        return None, rows
    return np.asarray(vectors, dtype=np.float64), rows
