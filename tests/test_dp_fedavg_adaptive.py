"""dp_fedavg_adaptive: what its quick example's run must show (``tests/test_simulations.py`` runs it)."""

from __future__ import annotations

from typing import Any

import pytest

# ------------------------------------------------------------------ its quick example (test_simulations)


def check_quick_example(results: dict[str, Any], example: Any) -> None:
    """What its quick example's run must show beyond the common checks (tests/test_simulations.py)."""
    privacy = results["privacy"]
    rounds = results["rounds"]
    assert rounds[0]["clip_norm"] == pytest.approx(privacy["initial_clip"]) == pytest.approx(0.1)
    assert privacy["final_clip"] != pytest.approx(privacy["initial_clip"])  # the clip followed the quantile
    assert privacy["bit_noise"] == pytest.approx(example.clients_per_round / 20)  # the paper's m / 20
    assert privacy["randomness"]["source"] == "seeded"  # reproducible from the published config
