"""The usual round of a private algorithm: :class:`FederatedStrategy` with an accountant and canaries.

:class:`PrivateStrategy` adds to the usual round what a finite epsilon needs:

* ``self.accountant`` (:class:`~fl_app.privacy.accountant.PrivacyAccountant`, or None when a run of
  the algorithm is not private): the events the strategy records, one per mechanism use per round,
  naming every *selected* client (a failure never makes the accounting optimistic), composed per
  client; its state is ``privacy_ledger.json``;
* :attr:`secret_cohort`: set when the accounting credits amplification by sampling (nothing that
  depends on the cohort is then published, and failures are logged to the console only);
* the canaries (``privacy.canaries``, :mod:`fl_app.privacy.canaries`): sampled like clients, or in the
  rounds of the accounted worst client (:meth:`canary_patterns`), their uploads clipped (and noised)
  with the clients' (:meth:`canary_uploads`), the one-shot estimate from the final model;

and the privacy report's hooks: :meth:`epsilon`, :meth:`privacy_summary`, :meth:`cohort_randomness`,
:meth:`budget_text`, :meth:`cohort_text`, :meth:`fixed_noise` (noise a setting fixes instead of the
calibration to ``privacy.epsilon``: the header and ``privacy.fixed_noise`` then say so, with the epsilon
the planned rounds reach). Central DP's first step, the sum of clipped updates, is
:meth:`clipped_update_sum`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message
from flwr.serverapp import Grid

from fl_app.learning.sums import ClippedUpdate
from fl_app.learning.training import array_values
from fl_app.privacy.accountant import LEDGER_FILE, PrivacyAccountant
from fl_app.privacy.canaries import CanaryPopulation
from fl_app.privacy.composition import EpsilonReport
from fl_app.privacy.fixed_noise import FixedNoise
from fl_app.privacy.mechanisms import clip_l2
from fl_app.run.context import RunContext
from strategies.arrays import flat_vector, split_vector
from strategies.base import FederatedStrategy, Replies
from strategies.contract import JSON
from strategies.settings import StrategySettings


class PrivateStrategy(FederatedStrategy):
    """The usual round with an accountant, canaries and the privacy report (module docstring)."""

    def __init__(self, run: RunContext, settings: StrategySettings | None = None) -> None:
        super().__init__(run, settings)
        self.accountant: PrivacyAccountant | None = None
        self.canaries: CanaryPopulation | None = None
        self._initial_vector: np.ndarray | None = None

    @property
    def secret_cohort(self) -> bool:
        """Whether the accounting relies on the cohort being secret (amplification by sampling)."""
        return self.replies.secret_cohort

    @secret_cohort.setter
    def secret_cohort(self, value: bool) -> None:
        self.replies.secret_cohort = bool(value)

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """The usual round's messages; before the first, the canaries (when asked for and supported)."""
        count = self.run.settings.privacy.canaries
        if self._initial_vector is None and count and self.declaration.canaries is None:
            self._initial_vector = flat_vector(arrays)  # the canaries' cosines are against the total change
            self.canaries = CanaryPopulation(
                count=count,
                rate=self.run.clients_per_round / self.run.num_clients,
                dimension=self._initial_vector.size,
                randomness=self.run.randomness,
                patterns=self.canary_patterns(count),
            )
        return super().configure_train(server_round, arrays, config, grid)

    def ledgers(self) -> dict[str, dict[str, JSON]]:
        """``privacy_ledger.json``: the accountant's events (none when the run is not private)."""
        return {} if self.accountant is None else {LEDGER_FILE: self.accountant.state_dict()}

    # ------------------------------------------------------------------ central DP

    def clipped_update_sum(
        self, replies: Replies, *, max_norm: float, server_round: int | None = None
    ) -> tuple[list[str], list[np.ndarray], list[np.ndarray], list[float]]:
        """The central-DP step every update-clipping strategy starts with.

        Returns the array names, the round's global arrays in float64, the float64 sum of the
        valid replies' updates ``w_k - w_t`` each clipped to L2 norm ``max_norm``
        (:func:`fl_app.privacy.mechanisms.clip_l2`'s arithmetic), and each reply's update norm
        before clipping (un-noised: never release it), in client order. Summed by ``replies.sum``:
        plain replies and packed messages' partial sums (each member's update clipped where it ran,
        with the bound this strategy sent and checks) give the same sum. With ``server_round`` and
        canaries (``privacy.canaries``), the canaries sampled in that round join the sum after the
        clients, through the same clipping; their norms are not returned.
        """
        names = list(self.round_global.keys())
        reference = [array_values(self.round_global[name]).astype(np.float64) for name in names]
        clients = replies.sum(ClippedUpdate(clip=max_norm))
        total = [clients.arrays[name] for name in names]
        if server_round is not None:
            for upload in self.canary_uploads(server_round, clip=max_norm, like=reference):
                clipped, _ = clip_l2(arrays=upload, max_norm=max_norm)
                for t, c in zip(total, clipped, strict=True):
                    t += c
        return names, reference, total, clients.per_member.get("norm", [])

    # ------------------------------------------------------------------ canaries

    def canary_uploads(
        self, server_round: int, *, clip: float, like: list[np.ndarray]
    ) -> list[list[np.ndarray]]:
        """The uploads of the canaries sampled in ``server_round``, shaped like ``like`` (none if off)."""
        if self.canaries is None:
            return []
        return [
            split_vector(self.canaries.upload(k, clip=clip), like)
            for k in self.canaries.sampled(server_round)
        ]

    def canary_patterns(self, count: int) -> list[frozenset[int]] | None:
        """The rounds each canary takes part in under a planned schedule (None: sampled like clients).

        Sampled cohorts (Poisson) need none: canaries are sampled at the cohort rate. A strategy
        whose schedule is planned returns, for each canary, the rounds of a client its epsilon is
        about (:func:`fl_app.privacy.canaries.worst_client_patterns`): a canary that took part
        more often, or in a worse pattern, would measure a larger release than any real client's.
        """
        return None

    def empirical_privacy(self, final: ArrayRecord) -> dict[str, JSON] | None:
        """``privacy.empirical_epsilon``: the canaries' one-shot estimate from the final model (None: off)."""
        if self.canaries is None or self._initial_vector is None:
            return None
        estimate = self.canaries.estimate(
            flat_vector(final) - self._initial_vector,
            delta=self.run.settings.privacy.delta,
            rng=self.run.randomness.generator("canary-bootstrap"),
        )
        return estimate.to_json()

    # ------------------------------------------------------------------ the privacy report's hooks

    def epsilon(self) -> EpsilonReport | None:
        """Cumulative epsilon of the worst client at ``privacy.delta`` (None: not private).

        The rounds' ``epsilon``: it must cover everything the run released about a client.
        """
        if self.accountant is None:
            return None
        return self.accountant.epsilon(delta=self.run.settings.privacy.delta)

    def privacy_summary(self) -> dict[str, JSON]:
        """The results file's ``privacy`` object: unit, mechanism, accountant (override to add details)."""
        accountant = "none"
        if self.accountant is not None:
            accountant = (
                f"{self.accountant.method} (dp-accounting 0.6.0): per-client composition of the "
                "recorded events (each names the clients whose data it touched, or all clients); "
                "min with basic composition for pure-epsilon mechanisms; the worst client is reported"
            )
        return {"unit": self.privacy_unit, "mechanism": self.mechanism_name, "accountant": accountant}

    def cohort_randomness(self) -> str:
        """Where the clients of a round come from (``privacy.randomness.cohort``)."""
        return super()._cohort_randomness()

    def cohort_text(self) -> str:
        """How many clients a round selects, for the run's header."""
        if self.secret_cohort:
            return (
                f"secret Poisson cohorts of {self.run.clients_per_round} of {self.run.num_clients} clients "
                "per round in expectation (their sizes are not published)"
            )
        return super()._cohort_text()

    def epsilon_holds_for(self) -> str | None:
        """Whose epsilon :meth:`epsilon` is when not this run's (``privacy.total.holds_for``; None: it is).

        A run that simulates a larger deployment (its noise calibrated for cohorts it does not draw)
        returns the sentence every place that prints its epsilon says with it.
        """
        return None

    def fixed_noise(self) -> FixedNoise | None:
        """The noise a setting fixes instead of the calibration to ``privacy.epsilon`` (None: calibrated).

        An algorithm with such a setting returns it with the epsilon its planned rounds reach
        (:meth:`planned_noise` computes it once, before round 1).
        """
        return None

    def planned_gaussian(
        self,
        setting: str,
        *,
        noise_multiplier: float,
        sampling_rate: float,
        participations: int,
        value: float | None = None,
    ) -> FixedNoise:
        """:meth:`FixedNoise.gaussian` over this run's planned rounds, at its delta and accountant."""
        privacy = self.run.settings.privacy
        return FixedNoise.gaussian(
            setting,
            noise_multiplier=noise_multiplier,
            sampling_rate=sampling_rate,
            participations=participations,
            rounds=self.run.settings.num_rounds,
            delta=privacy.delta,
            method=privacy.accountant,
            value=value,
        )

    def planned_noise(self) -> FixedNoise | None:
        """:meth:`fixed_noise`, computed once (the header's, before round 1; results.json's the same)."""
        if not hasattr(self, "_planned_noise"):
            self._planned_noise = self.fixed_noise()
        return self._planned_noise

    def budget_text(self) -> str:
        """The budget asked for, for the run's header (override where it is not in the unit).

        Noise fixed by a setting is said instead, with the epsilon the planned rounds reach.
        """
        privacy = self.run.settings.privacy
        fixed = self.planned_noise()
        if fixed is not None:
            return fixed.text(epsilon=privacy.epsilon, delta=privacy.delta)
        return (
            f"budget epsilon={privacy.epsilon:g} delta={privacy.delta:g} "
            f"(privacy.budget_scope={privacy.budget_scope})"
        )

    def _epsilon(self) -> EpsilonReport | None:
        return self.epsilon()

    def _empirical_privacy(self, final: ArrayRecord) -> dict[str, JSON] | None:
        return self.empirical_privacy(final)

    def _privacy_summary(self) -> dict[str, Any]:
        fixed = self.planned_noise()
        if fixed is None:
            return self.privacy_summary()
        return {
            **self.privacy_summary(),
            "fixed_noise": fixed.as_dict(epsilon=self.run.settings.privacy.epsilon),
        }

    def _cohort_randomness(self) -> str:
        return self.cohort_randomness()

    def _cohort_text(self) -> str:
        return self.cohort_text()

    def _budget_text(self) -> str:
        return self.budget_text()

    def _epsilon_holds_for(self) -> str | None:
        return self.epsilon_holds_for()
