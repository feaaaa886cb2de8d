"""One short real simulation per algorithm: its quick example, and what the run must show end to end.

Each algorithm declares a quick example (``python -m fl_app +experiment=quick strategy=<name>``,
:class:`strategies.contract.QuickExample`): a shape and a budget where it learns. The full examples
(1-2 minutes each, measured values in docs/algorithms/README.md) are too long for the suite, so each
runs here as a real simulation through Flower's engine with fewer rounds (its ``suite_rounds``), its
clients in this process (``INLINE``: what a quick example checks does not depend on where the clients
run; each client class runs in its own processes in tests/test_deploy.py, and the Ray backend is
checked against the golden rounds in tests/test_flower_engine.py), and must still beat
chance clearly (a quick example that stopped learning, a default that diverges or a budget too small
for its shape, fails here), spend the example's budget in the unit its results name and not more, and
show what the algorithm releases, round by round (``check_quick_example`` in the algorithm's own test
module, ``tests/test_<name>.py``: the cohort, the reports, the bytes, the accountant's epsilon against
an independent computation).
"""

from __future__ import annotations

from typing import Any

import pytest
from algorithm_tests import declared
from conftest import INLINE

from fl_app.config.compose import compose_config
from fl_app.run.results import COHORT_FIELDS
from strategies import STRATEGIES
from strategies.contract import QuickExample

pytestmark = pytest.mark.simulation

QUICK = "+experiment=quick"
Results = dict[str, Any]


def _epsilons(results: Results) -> list[float]:
    return [r["epsilon"] for r in results["rounds"]]


def quick_example_of(name: str) -> QuickExample:
    """The algorithm's declared quick example (every registered algorithm has one)."""
    quick = STRATEGIES.get(name).declaration.quick
    assert quick is not None, f"{name} declares no quick example"
    return quick


@pytest.mark.parametrize("name", sorted(STRATEGIES.names()))
def test_quick_example_learns_within_its_budget(simulate, name: str) -> None:
    quick = quick_example_of(name)
    example = compose_config([QUICK, f"strategy={name}", *quick.suite_overrides])  # what the run ran
    results = simulate(
        [QUICK, f"strategy={name}", f"num_rounds={quick.suite_rounds}", *quick.suite_overrides, INLINE]
    )
    assert results["status"] == "completed"
    final = results["final"]
    assert final["rounds"] == quick.suite_rounds
    assert [r["round"] for r in results["rounds"]] == list(range(1, quick.suite_rounds + 1))
    if "secret" in results["privacy"]["randomness"]["cohort"]:  # nothing published follows the cohort
        assert all(not set(COHORT_FIELDS) & set(r) for r in results["rounds"]), results["rounds"][0]
        assert "failures" not in final and "upload_bytes_per_client" not in final
    else:
        assert all(r["failures"] == 0 and r["clients"] > 0 for r in results["rounds"])
    assert final["accuracy"] >= quick.beats_chance, (name, final)
    if results["privacy"]["unit"] != "none":
        epsilons = _epsilons(results)
        assert epsilons == sorted(epsilons) and epsilons[-1] == final["epsilon"]
        budget = float(example.privacy.epsilon)
        if example.strategy.get("calibration") == "per_coordinate":
            # DPFL-BNN's example states its budget in the document's unit, one weight coordinate; the
            # headline (client-level) epsilon is far larger and must say so
            assert final["epsilon_per_coordinate"] <= budget * (1 + 1e-6), (name, final)
            assert final["epsilon"] > 100 * budget, (name, final)
        elif example.strategy.get("unit") == "document_record":
            # NbAFL's example calibrates the document's record-level reading; the run's (client-level)
            # epsilon of that noise is far larger and is the headline
            assert final["epsilon_document_record"] <= budget * (1 + 1e-6), (name, final)
            assert final["epsilon"] > 100 * budget, (name, final)
        else:
            # the example's budget, spent in the unit the results name, and not more
            assert 0 < final["epsilon"] <= budget * (1 + 1e-6), (name, final)
    check = declared(name, "check_quick_example")  # what its own test module adds (tests/test_<name>.py)
    if check is not None:
        check(results, example)
