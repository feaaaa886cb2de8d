"""dp_fedavg: what its quick example's run must show (``tests/test_simulations.py`` runs it)."""

from __future__ import annotations

from typing import Any

import pytest

# ------------------------------------------------------------------ its quick example (test_simulations)


def check_quick_example(results: dict[str, Any], example: Any) -> None:
    """What its quick example's run must show beyond the common checks (tests/test_simulations.py)."""
    privacy = results["privacy"]
    assert privacy["unit"].startswith("one client")
    # Poisson cohorts, seeded as every simulation's (reproducible from the published config;
    # the epsilon describes a deployment in which the coins are secret)
    assert privacy["sampling"] == "poisson" and privacy["sampling_rate"] == pytest.approx(0.1)
    assert privacy["randomness"]["source"] == "seeded"
    # their sizes are not published (a function of the secret coins): only outside the guarantee
    assert all("clients" not in r for r in results["rounds"])
    sizes = [r["secret_cohort_clients"] for r in results["outside_guarantee"]["rounds"]]
    assert len(sizes) == len(results["rounds"])
    assert len(set(sizes)) > 1 and all(50 <= size <= 150 for size in sizes)
