"""How a run's rounds ran (``run.log``'s header line and ``results.json``'s ``engine``).

Oracle: what the engine did. A run's reported path must be the path its rounds took (packed and
bulk messages counted as the ClientApp answers them); each choice is reported with the reason of
the rule that made it. That it does not vary with a secret cohort is checked with everything else a
DP-FedAvg run publishes (``tests/test_privacy_soundness.py``, ``_published``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from conftest import FAST, INLINE, build_run_context

from clients import CLIENTS
from clients.fedavg import FedAvgClient
from fl_app.engine import bulk
from fl_app.engine import packed as pack_messages
from fl_app.engine.workers import forget_workers, record_workers
from fl_app.run.round_path import BULK, DEVICES, PACKED, PER_CLIENT, round_path
from strategies import STRATEGIES


def path_of(tmp_path: Path, *overrides: str, client_class: type | None = None, shares: int = 2) -> Any:
    """The path of a simulated run of ``overrides`` whose engine built two Ray actors."""
    run = build_run_context([*FAST, *overrides], tmp_path)
    strategy = STRATEGIES.get(run.settings.strategy)(run)
    client = client_class or CLIENTS.get(strategy.declaration.client)
    record_workers("ray", 2)
    try:
        return round_path(strategy, run.settings, client, simulated=True, bulk_shares=shares)
    finally:
        forget_workers()


def test_each_choice_is_reported_with_the_reason_of_its_rule(tmp_path: Path) -> None:
    fedavg = path_of(tmp_path, "strategy=fedavg")
    assert (fedavg.messages, fedavg.backend, fedavg.workers, fedavg.vectorised) == (BULK, "ray", 2, False)
    assert "FedAvgClient does exactly what FedAvg's client does" in fedavg.why
    assert fedavg.vectorised_why == "simulation.vectorise=auto with CPU clients"
    scaffold = path_of(tmp_path, "strategy=scaffold", shares=0)
    assert (scaffold.messages, scaffold.why) == (PACKED, "not in bulk: ScaffoldClient keeps state")
    unpacked = path_of(tmp_path, "strategy=fedavg", "simulation.pack_messages=false", shares=0)
    assert (unpacked.messages, unpacked.why) == (PER_CLIENT, "simulation.pack_messages=false")
    privatekt = path_of(tmp_path, "strategy=privatekt", shares=0)
    assert privatekt.messages == PER_CLIENT and privatekt.why.startswith(
        "PrivateKTStrategy reads every reply"
    )
    vectorised = path_of(tmp_path, "strategy=fedavg", "simulation.vectorise=true")
    assert (vectorised.vectorised, vectorised.vectorised_why) == (True, "simulation.vectorise=true")
    own = type("OwnLoop", (FedAvgClient,), {"train_locally": lambda self: None})
    mine = path_of(tmp_path, "strategy=fedavg", "simulation.vectorise=true", client_class=own, shares=0)
    assert mine.vectorised is False and "OwnLoop does not train through the contract" in mine.vectorised_why
    assert "not in bulk: OwnLoop has its own train_locally" in mine.why
    text = fedavg.text()
    assert "rounds: in bulk" in text and "2 workers: Ray's client actors (simulation.backend=ray)" in text


def test_a_deployment_says_its_clients_run_on_their_devices(tmp_path: Path) -> None:
    run = build_run_context([*FAST, "strategy=fedavg"], tmp_path)
    strategy = STRATEGIES.get("fedavg")(run)
    path = round_path(strategy, run.settings, FedAvgClient, simulated=False, bulk_shares=0)
    assert (path.messages, path.backend, path.workers, path.vectorised) == (PER_CLIENT, DEVICES, None, False)


@pytest.mark.simulation
@pytest.mark.parametrize(
    ("strategy", "expected"), [("scaffold", (PACKED, 2, 0)), ("dp_fedavg", (BULK, 0, 2))]
)
def test_the_run_reports_the_path_its_rounds_took(
    strategy: str, expected: tuple[str, int, int], simulate: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inline, two rounds of every client (a fixed cohort: a round of a single client goes as its plain
    message): run.log's header line and results.json's ``engine`` name the path, and the ClientApp
    answered that many packed or bulk messages."""
    answered = {"packed": 0, "bulk": 0}

    def counted(function: Any, key: str) -> Any:
        def counting(*args: Any, **kwargs: Any) -> Any:
            answered[key] += 1
            return function(*args, **kwargs)

        return counting

    monkeypatch.setattr(pack_messages, "answer", counted(pack_messages.answer, "packed"))
    monkeypatch.setattr(bulk, "answer", counted(bulk.answer, "bulk"))
    overrides = [*FAST, INLINE, f"strategy={strategy}", "clients_per_round=1.0", "strategy.sampling=fixed"]
    results = simulate(overrides if strategy == "dp_fedavg" else overrides[:-1], name=strategy)
    messages, packed, in_bulk = expected
    assert (answered["packed"], answered["bulk"]) == (packed, in_bulk)
    engine = results["engine"]
    assert (engine["messages"], engine["backend"], engine["workers"]) == (messages, "inline", 1)
    assert engine["vectorised"] is False
    log = (Path(results["_output_dir"]) / "run.log").read_text()
    lines = [line for line in log.splitlines() if "dpfl: rounds: " in line]
    assert len(lines) == 1 and f"({engine['why']})" in lines[0], lines
    assert log.index("dpfl: rounds: ") < log.index("dpfl round 1/")
