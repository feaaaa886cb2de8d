"""Hydra's non-public APIs (hydra-core 1.3.8; ``tests/test_config.py`` pins it).

dpfl composes a job's configuration itself, before Hydra creates any directory, so that a bad value
is one line and nothing is written. Two things it needs are not in Hydra's public API:

* :func:`compose_fresh`: a composition from ``conf/`` that also works inside a running
  ``@hydra.main`` job (Hydra's global state is set aside and put back:
  ``hydra.initialize.get_gh_backup`` / ``restore_gh_from_backup``, ``GlobalHydra.clear``);
* :func:`sweep_jobs`: the override list of every job of a multirun, as Hydra's basic sweeper
  makes them (``hydra._internal.core_plugins.basic_sweeper.BasicSweeper.split_arguments``).

A Hydra upgrade must revisit this module; nothing else in dpfl imports Hydra's internals
(``tests/test_repository.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import hydra
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.initialize import get_gh_backup, restore_gh_from_backup
from omegaconf import DictConfig

#: The Hydra release whose non-public APIs this module was written against.
HYDRA_VERSION = "1.3.8"


def hydra_version() -> str:
    """The installed Hydra release."""
    return str(hydra.__version__)


def compose_fresh(
    config_dir: Path, config_name: str, overrides: Sequence[str], *, with_hydra: bool = False
) -> DictConfig:
    """Compose ``config_name`` from ``config_dir`` with ``overrides`` (unresolved, as Hydra returns it).

    Inside a ``python -m fl_app`` job Hydra is already initialised: its state is set aside, the
    configuration composed afresh, and the state put back. ``with_hydra`` keeps the ``hydra`` node
    (its sweeper parameters, for :func:`sweep_jobs`).
    """
    backup = get_gh_backup()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir), version_base="1.3"):
            return compose(config_name=config_name, overrides=list(overrides), return_hydra_config=with_hydra)
    finally:
        restore_gh_from_backup(backup)


def sweep_jobs(preset: Sequence[str], command_line: Sequence[str]) -> list[list[str]]:
    """The override list of every job of a multirun, in the order Hydra's basic sweeper runs them.

    ``preset`` are the composed ``hydra.sweeper.params`` as ``key=a,b`` strings, ``command_line`` the
    command's overrides; as in Hydra's ``BasicSweeper``, the preset comes first and the command line
    wins for the same key.
    """
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    parsed = parser.parse_overrides(list(preset)) + parser.parse_overrides(list(command_line))
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def sweep_fixed(command_line: Sequence[str]) -> list[str]:
    """The overrides of ``command_line`` that are not sweeps (``key=a,b``, ranges, choices)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(list(command_line))
    return [item.input_line for item in parsed if not item.is_sweep_override() and item.input_line]
