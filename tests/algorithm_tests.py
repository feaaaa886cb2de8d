"""What an algorithm's own test module (``tests/test_<name>.py``) adds to the suite's generic tests.

An algorithm is its home (docs/contributing/adding-an-algorithm.md): its strategy, client, conf and
test module. The suite's generic tests iterate over the registered algorithms and take what each
one's test module declares:

* ``check_quick_example(results, example)``: what its quick example's run must show beyond the common
  checks of ``tests/test_simulations.py`` (the cohort, the reports, the epsilon against an independent
  computation);
* ``PRIVACY_AUDIT = (audit, rounds_per_input, least_fraction)``: its one-round end-to-end audit
  (``tests/test_privacy_end_to_end.py``), required for a private algorithm.

No test keeps a list of algorithms: a new one is found through its registration and this module.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType
from typing import Any

TESTS = Path(__file__).resolve().parent


def own_test_module(name: str) -> ModuleType | None:
    """``tests/test_<name>.py``, imported as pytest imports it (None when the algorithm has none)."""
    if not (TESTS / f"test_{name}.py").exists():
        return None
    return importlib.import_module(f"test_{name}")


def declared(name: str, attribute: str) -> Any:
    """``attribute`` of the algorithm's own test module, or None."""
    module = own_test_module(name)
    return None if module is None else getattr(module, attribute, None)
