"""A user's algorithm, defined in this module, run end to end through the platform.

What a user writes to add an algorithm, and nothing more: typed settings (a dataclass), a client (local
work and the reply), a strategy (a :class:`~strategies.contract.Declaration` and ``aggregate_train``),
and the settings' defaults in Hydra's store. The platform finds the strategy by name, composes and
validates ``strategy=plugin_shrink``, sends the client's ``module:class`` reference with every train
message (a simulation's actors import this module to find it), and writes the results as for any
algorithm. Kept free of pytest fixtures at import: the actors import it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, MetricRecord

from clients.base import FederatedClient
from fl_app import keys
from fl_app.learning.training import state_to_arrays
from strategies import STRATEGIES, register_strategy, store_strategy_config
from strategies.base import FederatedStrategy
from strategies.contract import Declaration
from strategies.settings import StrategySettings, between

NAME = "plugin_shrink"
#: The metric the plug-in client adds to its replies (so the test sees that it ran, not FedAvg's).
MARKER = "plugin-client"


@dataclass(frozen=True)
class ShrinkSettings(StrategySettings):
    """``strategy.shrink``: how far the global model moves toward the clients' average each round."""

    shrink: float = between(0.0, 1.0, low_open=True)


class ShrinkClient(FederatedClient):
    """Local SGD on the received model; the trained model goes back with a marker."""

    def train(self) -> Message:
        """One round of local training."""
        trained = self.train_locally()
        return self.reply(
            arrays=state_to_arrays(trained.state),
            metrics={keys.NUM_EXAMPLES: len(self.local_data()), MARKER: 1.0},
        )


class ShrinkStrategy(FederatedStrategy):
    """``w <- w + shrink (mean of the clients' models - w)``: FedAvg with a server step size (not private)."""

    declaration = Declaration(
        name=NAME,
        paper="a test's algorithm",
        unit="none",
        mechanism="none",
        client="tests.test_plugin:ShrinkClient",  # the module:class reference the actors import
        settings=ShrinkSettings,
    )
    settings: ShrinkSettings

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Move toward the uniform mean of the valid replies' models."""
        valid, _ = self.replies.split(server_round, replies)
        if not valid or not all(MARKER in reply.content.metric_records[keys.METRICS] for _, reply in valid):
            return None, None
        start = self.round_global
        new = {}
        for name in start:
            mean = np.mean(
                [reply.content.array_records[keys.ARRAYS][name].numpy() for _, reply in valid], axis=0
            )
            old = start[name].numpy()
            new[name] = Array((old + self.settings.shrink * (mean - old)).astype(old.dtype))
        self.moved = len(valid)
        return ArrayRecord(new), MetricRecord()

    def round_extras(self, server_round: int) -> dict[str, int]:
        """How many plug-in replies moved the model this round."""
        return {"plugin_replies": getattr(self, "moved", 0)}


store_strategy_config(NAME, shrink=0.5)


@pytest.fixture
def registered() -> Iterator[None]:
    """The strategy registered for this test only (other tests list every registered algorithm)."""
    register_strategy(NAME)(ShrinkStrategy)
    yield
    STRATEGIES.unregister(NAME)


def test_a_users_algorithm_runs_end_to_end_through_the_platform(simulate, tmp_path, registered):
    from fl_app.config.compose import compose_config
    from fl_app.config.validation import ConfigError, validate_config
    from strategies.contract import Strategy
    from tests.conftest import FAST, build_run_context

    # composed and validated like any algorithm: its settings are typed and checked
    cfg = compose_config([*FAST, f"strategy={NAME}"])
    assert cfg.strategy.shrink == 0.5
    validate_config(cfg, check_data=False)
    with pytest.raises(ConfigError, match=r"strategy.shrink=0"):
        validate_config(compose_config([*FAST, f"strategy={NAME}", "strategy.shrink=0"]), check_data=False)
    strategy = STRATEGIES.get(NAME)(build_run_context([*FAST, f"strategy={NAME}"], tmp_path))
    assert isinstance(strategy, Strategy)  # the contract, nothing more

    results = simulate([*FAST, f"strategy={NAME}", "num_rounds=3", "strategy.shrink=0.8"])
    assert results["status"] == "completed" and results["strategy"] == NAME
    assert [r["plugin_replies"] for r in results["rounds"]] == [3, 3, 3]  # the plug-in client answered
    assert results["final"]["accuracy"] > results["initial"]["accuracy"] + 0.05  # it learns
    assert results["privacy"]["unit"] == "none" and results["final"]["epsilon"] is None
