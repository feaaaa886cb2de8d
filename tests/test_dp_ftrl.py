"""dp_ftrl: what its quick example's run must show (``tests/test_simulations.py`` runs it)."""

from __future__ import annotations

import math
from typing import Any

# ------------------------------------------------------------------ its quick example (test_simulations)


def check_quick_example(results: dict[str, Any], example: Any) -> None:
    """What its quick example's run must show beyond the common checks (tests/test_simulations.py)."""
    privacy = results["privacy"]
    assert privacy["restart"] == "epoch"
    assert all(r["clients"] == example.clients_per_round for r in results["rounds"])
    # a public schedule of fixed cohorts: 10 rounds per pass over 1000 clients, 15 rounds -> twice
    assert privacy["rounds_per_epoch"] == example.num_clients // example.clients_per_round
    assert privacy["max_participations"] == math.ceil(len(results["rounds"]) / privacy["rounds_per_epoch"])
