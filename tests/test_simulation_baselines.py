"""Short real simulations of the baselines (Ray-backed Flower simulation engine)."""

from __future__ import annotations

import pytest
from conftest import DP_FEDAVG_RUN, FEDAVG_RUN

pytestmark = pytest.mark.simulation


def test_fedavg_and_dp_fedavg_simulations(shared_simulation):
    fedavg = shared_simulation(FEDAVG_RUN)
    assert fedavg["status"] == "completed"
    assert [r["round"] for r in fedavg["rounds"]] == [1, 2, 3]
    assert all(r["epsilon"] is None for r in fedavg["rounds"])
    assert fedavg["final"]["accuracy"] > fedavg["initial"]["accuracy"]
    assert all(r["upload_bytes"] > 0 and r["clients"] == 3 for r in fedavg["rounds"])

    private = shared_simulation(DP_FEDAVG_RUN)
    epsilons = [r["epsilon"] for r in private["rounds"]]
    assert epsilons == sorted(epsilons)
    assert 0 < private["final"]["epsilon"] <= 8.0
    assert private["privacy"]["unit"].startswith("one client")
