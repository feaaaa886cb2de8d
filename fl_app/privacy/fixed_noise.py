"""Noise a setting fixes instead of calibrating it to the budget, and the epsilon it will reach.

A private run whose noise is fixed by a setting (``strategy.noise_multiplier=0.067``) does not spend
``privacy.epsilon``: its header and ``privacy.fixed_noise`` in results.json say which setting fixes it
and the epsilon the planned rounds reach, computed before round 1 by the accountant's composition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fl_app.privacy.calibration import gaussian_epsilon


@dataclass(frozen=True)
class FixedNoise:
    """Noise a setting fixes instead of calibrating it to ``privacy.epsilon``, computed before round 1.

    Attributes
    ----------
    setting : str
        The setting and its value (``strategy.noise_multiplier=0.067``).
    planned_epsilon : float | None
        The worst client's epsilon at ``privacy.delta`` once the planned rounds have run, from the
        accountant's composition of the mechanisms they will record (None: no finite guarantee).
    rounds : int
        The planned rounds (``num_rounds``).

    """

    setting: str
    planned_epsilon: float | None
    rounds: int

    @classmethod
    def gaussian(
        cls,
        setting: str,
        *,
        noise_multiplier: float,
        sampling_rate: float,
        participations: int,
        rounds: int,
        delta: float,
        method: str,
        value: float | None = None,
    ) -> FixedNoise:
        """A worst client's ``participations`` Gaussian releases (Poisson-sampled when the rate is below 1).

        ``setting`` names the key that fixes the noise, shown with ``value`` (default: the multiplier);
        a multiplier of 0 has no finite epsilon. The epsilon is the accountant's composition
        (:func:`~fl_app.privacy.calibration.gaussian_epsilon`, ``method``) at ``delta``.
        """
        reached = None
        if noise_multiplier > 0:
            reached = gaussian_epsilon(
                noise_multiplier=noise_multiplier,
                sampling_rate=sampling_rate,
                rounds=max(participations, 1),
                delta=delta,
                method=method,
            )
        shown = noise_multiplier if value is None else value
        return cls(f"{setting}={shown:g}", reached, rounds)

    def text(self, *, epsilon: float, delta: float) -> str:
        """The header's words: what fixes the noise, that the budget is not used, what the rounds reach."""
        reached = (
            "no finite epsilon" if self.planned_epsilon is None else f"epsilon={self.planned_epsilon:.4g}"
        )
        return (
            f"noise fixed by {self.setting}, not calibrated to the training's epsilon={epsilon:g}: the "
            f"{self.rounds} planned rounds reach {reached} at delta={delta:g}"
        )

    def as_dict(self, *, epsilon: float) -> dict[str, Any]:
        """``privacy.fixed_noise`` of results.json."""
        return {
            "setting": self.setting,
            "planned_epsilon": self.planned_epsilon,
            "planned_rounds": self.rounds,
            "privacy_epsilon_not_used": epsilon,
        }
