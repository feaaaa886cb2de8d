"""fedavg: what its quick example's run must show (``tests/test_simulations.py`` runs it)."""

from __future__ import annotations

from typing import Any

# ------------------------------------------------------------------ its quick example (test_simulations)


def check_quick_example(results: dict[str, Any], example: Any) -> None:
    """What its quick example's run must show beyond the common checks (tests/test_simulations.py)."""
    assert all(r["epsilon"] is None for r in results["rounds"])
    assert results["privacy"]["unit"] == "none"
    assert results["final"]["accuracy"] > results["initial"]["accuracy"]
    assert all(r["clients"] == example.clients_per_round and r["upload_bytes"] > 0 for r in results["rounds"])
