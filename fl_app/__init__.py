"""dpfl: differentially private federated learning on Flower.

Importing the package first runs the process set-up (Flower environment
switches and the torchvision operator shim), so any process that imports
``fl_app`` (including Ray workers that unpickle the ClientApp) is ready.

``from fl_app import run_experiment, ConfigError`` is the Python API (:mod:`fl_app.api`): a bad
value raises :class:`ConfigError` (``.key``, ``.value``, ``.allowed``) before anything is written.
"""

from typing import Any

from fl_app.engine import process_setup as _process_setup  # noqa: F401  (must run before torchvision loads)

__all__ = ["ConfigError", "run_experiment"]


def __getattr__(name: str) -> Any:
    """``fl_app.run_experiment`` (the Python API, :mod:`fl_app.api`), imported on first use."""
    if name == "run_experiment":
        from fl_app.api import run_experiment

        return run_experiment
    if name == "ConfigError":
        from fl_app.config.checks import ConfigError

        return ConfigError
    raise AttributeError(f"module 'fl_app' has no attribute {name!r}")
