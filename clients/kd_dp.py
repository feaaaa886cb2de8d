"""KD-DP clients: local DP-SGD for large-data (teacher) and general clients; the special pseudo-client.

Tan, Xu, Wang, Luo, "Differential Privacy Federated Learning Method Based on
Knowledge Distillation", Computer Science (计算机科学) 51(6A), 2024. The design
and every choice are documented in :mod:`strategies.kd_dp`; in short:

* :class:`KDDPTeacherClient` (``kd_dp_teacher``): a large-data client in the
  teacher stage. It trains the received teacher model with DP-SGD
  (:func:`fl_app.privacy.dp_sgd.dp_sgd_train`) at the noise multiplier,
  sampling rate, clip norm and step count the server sends, and returns the
  model. Record-level DP holds *before* the model leaves the device.
* :class:`KDDPGeneralClient` (``kd_dp_general``): a general client in the
  student stage; the same local DP-SGD at the general clients' calibration.
* :class:`SpecialPseudoClient`: the "special client", run by the server
  (the public split lives there). It labels the public images with the DP
  teacher (post-processing), perturbs every pseudo-label once by k-ary
  randomized response at ``epsilon_special`` (label-DP) and then trains like a
  client on those fixed noisy labels in every student round.

A DP-SGD client replies with its model, its (public) number of examples and
an echo of the mechanism parameters it applied, nothing else: no training
loss or accuracy, which would be un-noised functions of its data. Batch
sampling and noise come from :meth:`FederatedClient.noise_generator` (OS
entropy on devices), because amplification by sampling needs the sampling to
be secret.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
import torch
from flwr.app import ArrayRecord, Message
from torch import nn
from torch.nn import functional as F  # noqa: N812 - the conventional name

from clients import register_client
from clients.base import FederatedClient
from fl_app import keys
from fl_app.learning.model_spec import ModelSpec
from fl_app.learning.optim import SGD
from fl_app.learning.training import load_arrays, model_to_arrays, predict_proba, to_tensor, train_local
from fl_app.privacy.dp_sgd import dp_sgd_train
from fl_app.privacy.events import RandomizedResponse
from fl_app.privacy.mechanisms import randomized_response_labels

# ---------------------------------------------------------------- wire protocol: this algorithm's keys
KDDP_NOISE_MULTIPLIER = "kd-dp-noise-multiplier"  # z of local DP-SGD (noise std z * C on the sum)
KDDP_SAMPLING_RATE = "kd-dp-sampling-rate"  # q: Poisson sampling rate of every local example per step
KDDP_STEPS = "kd-dp-steps"  # DP-SGD steps this round
KDDP_CLIP = "kd-dp-clip"  # C: per-example L2 clip norm
KDDP_STAGE = "kd-dp-stage"  # "teacher" | "student"; replies echo the four mechanism keys above


TEACHER_STAGE = "teacher"
STUDENT_STAGE = "student"


class KDDPClient(FederatedClient):
    """Local DP-SGD on the client's own data with the server's mechanism parameters."""

    stage: ClassVar[str] = ""
    #: DP-SGD (fl_app.privacy.dp_sgd) computes per-example gradients in numpy: CPU only.
    uses_gpu = False

    def local_sgd(self) -> None:
        """DP-SGD with per-example clipping and noise (:meth:`train`): no standard local SGD."""
        return None

    def train(self) -> Message:
        """Run the round's DP-SGD steps and return the model (and public numbers only)."""
        stage = str(self.config.get(KDDP_STAGE, ""))
        if stage != self.stage:
            raise ValueError(f"{type(self).__name__} runs in the {self.stage!r} stage, got {stage!r}")
        noise_multiplier = float(self.config[KDDP_NOISE_MULTIPLIER])
        sampling_rate = float(self.config[KDDP_SAMPLING_RATE])
        steps = int(self.config[KDDP_STEPS])
        clip = float(self.config[KDDP_CLIP])
        data = self.local_data()
        model = self.global_model()
        dp_sgd_train(
            model,
            data.x,
            data.y,
            noise_multiplier=noise_multiplier,
            clip=clip,
            sampling_rate=sampling_rate,
            steps=steps,
            lr=float(self.config[keys.LR]),
            momentum=float(self.config.get(keys.MOMENTUM, 0.0)),
            rng=self.noise_generator(f"kd-dp-{self.stage}-dp-sgd"),
        )
        return self.reply(
            arrays=model_to_arrays(model),
            metrics={
                keys.NUM_EXAMPLES: len(data),
                KDDP_NOISE_MULTIPLIER: noise_multiplier,
                KDDP_SAMPLING_RATE: sampling_rate,
                KDDP_STEPS: steps,
                KDDP_CLIP: clip,
            },
        )


@register_client("kd_dp_teacher")
class KDDPTeacherClient(KDDPClient):
    """A large-data client: trains the teacher with local DP-SGD (teacher stage only)."""

    stage = TEACHER_STAGE


@register_client("kd_dp_general")
class KDDPGeneralClient(KDDPClient):
    """A general client: trains the student with local DP-SGD (student stage only)."""

    stage = STUDENT_STAGE


def pseudo_labels(teacher: nn.Module, x: np.ndarray) -> np.ndarray:
    """The teacher's predicted class for every row of ``x`` (a post-processing of the teacher)."""
    return np.asarray(np.argmax(predict_proba(teacher, x), axis=1), dtype=np.int64)


class SpecialPseudoClient:
    """The public split with label-DP pseudo-labels, trained on the server as one more client.

    Parameters
    ----------
    x : np.ndarray
        The public images (public data: no privacy needed for them).
    labels : np.ndarray
        The labels it trains on: randomized-response outputs (or the teacher's
        labels themselves when ``epsilon`` is ``None``).
    epsilon : float or None
        Per-label randomized-response epsilon that produced ``labels``.
    num_classes : int
        ``C``.
    agreement : float
        Share of ``labels`` equal to the teacher's label (a function of the DP
        teacher and of the randomized-response noise only).

    """

    def __init__(
        self, x: np.ndarray, labels: np.ndarray, *, epsilon: float | None, num_classes: int, agreement: float
    ) -> None:
        if len(x) != len(labels) or len(labels) == 0:
            raise ValueError(f"need as many labels as images (>= 1), got {len(labels)} and {len(x)}")
        self.x = x
        self.labels = np.asarray(labels, dtype=np.int64)
        self.epsilon = epsilon
        self.num_classes = num_classes
        self.agreement = agreement

    def __len__(self) -> int:
        return len(self.labels)

    @classmethod
    def from_teacher(
        cls,
        teacher: nn.Module,
        public_x: np.ndarray,
        *,
        epsilon: float | None,
        num_classes: int,
        rng: np.random.Generator,
    ) -> SpecialPseudoClient:
        """Label ``public_x`` with ``teacher`` and perturb each label once at ``epsilon`` (label-DP).

        The true labels of the public split are never read: only the images
        and the teacher go in. Randomized response keeps a label with
        probability ``beta = (e^eps - 1) / (e^eps - 1 + C)`` and otherwise
        draws a class uniformly (:func:`~fl_app.privacy.mechanisms.randomized_response_labels`),
        so each pseudo-label is ``eps``-label-DP under replacement.
        """
        teacher_labels = pseudo_labels(teacher, public_x)
        if epsilon is None:
            labels = teacher_labels
        else:
            mechanism = RandomizedResponse(float(epsilon), int(num_classes))
            labels = randomized_response_labels(
                labels=teacher_labels,
                keep_probability=mechanism.keep_probability,
                num_classes=int(num_classes),
                rng=rng,
            )
        agreement = float(np.mean(labels == teacher_labels)) if len(labels) else math.nan
        return cls(public_x, labels, epsilon=epsilon, num_classes=num_classes, agreement=agreement)

    @property
    def keep_probability(self) -> float:
        """``beta`` of the randomized response that produced the labels (1 without it)."""
        if self.epsilon is None:
            return 1.0
        return RandomizedResponse(float(self.epsilon), int(self.num_classes)).keep_probability

    def train_from(
        self,
        spec: ModelSpec,
        start: ArrayRecord,
        *,
        sgd: Mapping[str, Any],
        rng: np.random.Generator,
        correction: bool,
    ) -> tuple[ArrayRecord, float]:
        """One student round: a copy of the model ``start`` trained as :meth:`train`; its arrays, mean loss.

        ``sgd`` gives the run's ``local_epochs``, ``batch_size``, ``lr`` and ``momentum``.
        """
        model = spec.build()
        load_arrays(model, start)
        loss = self.train(
            model,
            epochs=int(sgd["local_epochs"]),
            batch_size=int(sgd["batch_size"]),
            lr=float(sgd["lr"]),
            momentum=float(sgd["momentum"]),
            rng=rng,
            correction=correction,
        )
        return model_to_arrays(model), loss

    def train(
        self,
        model: nn.Module,
        *,
        epochs: int,
        batch_size: int,
        lr: float,
        momentum: float,
        rng: np.random.Generator,
        correction: bool = True,
    ) -> float:
        """Local SGD on the fixed noisy labels (post-processing of the label release); mean loss.

        With ``correction`` (and label noise) the loss is the likelihood of the
        *observed* label under the known randomized response, ``-log(beta p_y +
        (1 - beta) / C)`` with ``p = softmax(model(x))`` (forward loss correction,
        Patrini et al., CVPR 2017): the model keeps estimating the teacher's
        label distribution instead of the flattened noisy one. Without it: plain
        cross-entropy on the noisy labels.
        """
        beta = self.keep_probability
        if not correction or beta >= 1.0:
            return train_local(
                model,
                self.x,
                self.labels,
                epochs=epochs,
                batch_size=batch_size,
                lr=lr,
                momentum=momentum,
                rng=rng,
            )
        model.train()
        optimizer = SGD(model.parameters(), lr=lr, momentum=momentum)
        inputs, targets = to_tensor(self.x), torch.from_numpy(self.labels)
        log_keep, log_uniform = math.log(beta), math.log((1.0 - beta) / self.num_classes)
        total, batches = 0.0, 0
        for _ in range(epochs):
            order = torch.from_numpy(rng.permutation(len(targets)))
            for start in range(0, len(targets), batch_size):
                index = order[start : start + batch_size]
                log_p = F.log_softmax(model(inputs[index]), dim=1).gather(1, targets[index].unsqueeze(1))
                observed = torch.logaddexp(log_p + log_keep, torch.full_like(log_p, log_uniform))
                loss = -observed.mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total += float(loss.detach())
                batches += 1
        return total / max(batches, 1)
