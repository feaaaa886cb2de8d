"""PrivateKT client: local training, K predicted labels, randomized response, K bytes up.

Qi, Wu et al., "Differentially private knowledge transfer for federated
learning", Nature Communications 2023, Algorithm 1 lines 7-14 and Eq. 2: the
client trains the received Theta_t on its local data, predicts the class of
each of the K knowledge-transfer (KT) samples, replaces each predicted label by
a uniformly random class with probability ``1 - beta`` (beta from the per-label
epsilon the server sends, ``beta = (e^eps - 1) / (e^eps - 1 + C)``; Lemma 1
with ``eps = epsilon / K`` in the per-round reading) and replies with the K
perturbed labels only: one uint8 class index per KT sample, no loss, no example
count (those depend on the private data and are not covered by the
randomized response). The noise comes from :meth:`noise_generator` (OS entropy
on real devices).

The KT samples arrive either as the samples themselves (``KT_SAMPLES``) or, in
a simulation, as row indices into the public split, which a simulated client
rebuilds from the data spec; a client outside a simulation that receives only
indices fails with a message that says to set ``strategy.send_kt_data=true``.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, Message, RecordDict

from clients import register_client
from clients.base import FederatedClient
from fl_app import keys
from fl_app.data.federated import DataSpec, federated_data
from fl_app.learning.training import predict_proba
from fl_app.privacy.events import RandomizedResponse
from fl_app.privacy.mechanisms import randomized_response_labels

# ---------------------------------------------------------------- wire protocol: this algorithm's keys
KT_INDICES = "privatekt-kt-indices"  # list[int]: the round's KT samples as rows of the public split
KT_SAMPLES = "privatekt-kt-samples"  # RecordDict key: ArrayRecord with the KT samples themselves
KT_SAMPLES_ARRAY = "x"  # the array inside KT_SAMPLES, shape (K, *input_shape)
KT_LABEL_EPSILON = "privatekt-label-epsilon"  # per-label randomized-response epsilon
KT_LABELS = "privatekt-labels"  # reply RecordDict key: ArrayRecord holding only the K perturbed labels
KT_LABELS_ARRAY = "labels"  # the array inside KT_LABELS: uint8, shape (K,), K raw bytes
KT_LABELS_STYPE = "raw"  # its serialisation type: the bytes are the labels (no .npy header)


def encode_labels(labels: np.ndarray) -> Array:
    """K class indices as a uint8 Array whose data are exactly K bytes (stype ``raw``)."""
    values = np.asarray(labels)
    if values.ndim != 1 or (values.size and (values.min() < 0 or values.max() > 255)):
        raise ValueError(f"labels must be a 1-D array of class indices in [0, 255], got {values!r}")
    return Array(
        dtype="uint8",
        shape=(int(values.size),),
        stype=KT_LABELS_STYPE,
        data=values.astype(np.uint8).tobytes(),
    )


def decode_labels(array: Array, *, k: int, num_classes: int) -> np.ndarray:
    """Inverse of :func:`encode_labels`, checked: K uint8 class indices below ``num_classes``."""
    if array.stype != KT_LABELS_STYPE or array.dtype != "uint8" or tuple(array.shape) != (k,):
        raise ValueError(
            f"expected {k} raw uint8 labels, got stype={array.stype!r}, dtype={array.dtype!r}, "
            f"shape={array.shape}"
        )
    if len(array.data) != k:
        raise ValueError(f"expected {k} bytes of labels, got {len(array.data)}")
    labels = np.frombuffer(array.data, dtype=np.uint8).astype(np.int64)
    if labels.size and labels.max() >= num_classes:
        raise ValueError(f"label {labels.max()} is not a class (C={num_classes})")
    return labels


@register_client("privatekt")
class PrivateKTClient(FederatedClient):
    """Trains locally and uploads K randomized-response labels."""

    def kt_samples(self) -> np.ndarray:
        """The round's KT samples: sent in the message, or rebuilt from indices in a simulation."""
        records = self.message.content.array_records
        if KT_SAMPLES in records:
            return records[KT_SAMPLES][KT_SAMPLES_ARRAY].numpy()
        if KT_INDICES not in self.config:
            raise ValueError("PrivateKT: the train message carries no knowledge-transfer samples")
        if not self.in_simulation:
            raise ValueError(
                "PrivateKT: the server sent only indices into its public split, which this device "
                "cannot rebuild; run the server with strategy.send_kt_data=true (or leave it null)"
            )
        indices = np.asarray(list(self.config[KT_INDICES]), dtype=np.int64)
        public = federated_data(DataSpec.from_json(str(self.config[keys.DATA_SPEC]))).public_x()
        if indices.size == 0 or indices.min() < 0 or indices.max() >= len(public):
            raise ValueError(f"PrivateKT: KT indices outside the public split of {len(public)} rows")
        return public[indices]

    def train(self) -> Message:
        """Local training, predictions on the KT samples, Eq. 2, reply with the K labels only."""
        samples = self.kt_samples()
        num_classes = self.model_spec().num_classes
        mechanism = RandomizedResponse(float(self.config[KT_LABEL_EPSILON]), num_classes)
        if num_classes > 256:
            raise ValueError(f"PrivateKT: {num_classes} classes do not fit a uint8 label")
        predicted = predict_proba(self.train_locally().model(), samples).argmax(axis=1)
        perturbed = randomized_response_labels(
            labels=predicted,
            keep_probability=mechanism.keep_probability,
            num_classes=num_classes,
            rng=self.noise_generator("privatekt-randomized-response"),
        )
        labels = ArrayRecord({KT_LABELS_ARRAY: encode_labels(perturbed)})
        return Message(content=RecordDict({KT_LABELS: labels}), reply_to=self.message)
