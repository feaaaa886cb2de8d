"""The quick example of every strategy (``python -m fl_app +experiment=quick strategy=<name>``): its config.

Each strategy declares its quick example (``Declaration(quick=QuickExample(...))``). Here: it composes,
validates and yields to the command line. ``tests/test_simulations.py`` runs each as a real simulation.
"""

from __future__ import annotations

import pytest

from fl_app.config.compose import compose_config
from fl_app.config.validation import validate_config
from strategies import STRATEGIES

QUICK = "+experiment=quick"


@pytest.mark.parametrize("name", sorted(STRATEGIES.names()))
def test_quick_example_composes_validates_and_yields_to_the_command_line(name: str) -> None:
    cfg = compose_config([QUICK, f"strategy={name}"])
    validate_config(cfg)
    assert cfg.strategy.name == name
    assert cfg.dataset.name == "fashion_mnist"
    assert cfg.evaluation.test_subset == 2000
    plain = compose_config([f"strategy={name}"])
    assert (cfg.num_clients, cfg.num_rounds) != (plain.num_clients, plain.num_rounds)
    # the command line wins over the example's own settings
    mine = compose_config([QUICK, f"strategy={name}", "num_rounds=3", "batch_size=7", "seed=5"])
    assert (mine.num_rounds, mine.batch_size, mine.seed) == (3, 7, 5)
    assert mine.num_clients == cfg.num_clients
