"""The ``flwr`` command line's internals dpfl's deployment scripts and tests use (flwr 1.41).

* :func:`default_flower_config`: the ``config.toml`` the ``flwr`` CLI writes into a fresh Flower home
  (``flwr.cli.constant.DEFAULT_FLOWER_CONFIG_TOML``), which ``scripts/local_deployment.py`` extends
  with a connection;
* :func:`build_fab`: the FAB ``flwr run`` builds from an app directory (``flwr.cli.build``);
* :func:`install_fab`: what a SuperLink or SuperNode does with it before running it
  (``flwr.cli.install``: unpack, verify the manifest's hashes, install).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def default_flower_config() -> str:
    """The text of a fresh Flower home's ``config.toml``."""
    from flwr.cli.constant import DEFAULT_FLOWER_CONFIG_TOML

    return str(DEFAULT_FLOWER_CONFIG_TOML)


def build_fab(app_dir: Path) -> Any:
    """What ``flwr run`` builds from ``app_dir`` (bytes and hash, as Flower returns them)."""
    from flwr.cli.build import build_fab_from_disk

    return build_fab_from_disk(app_dir)


def install_fab(fab: bytes, directory: Path) -> Path:
    """Install ``fab`` into ``directory`` as a SuperLink does before it runs the ServerApp; the app's path."""
    from flwr.cli.install import install_from_fab

    return Path(install_from_fab(fab, install_dir=directory, skip_prompt=True))
