"""Where the run configuration lives (``conf/``) and which config groups it has.

Standard library only: ``dpfl --help`` reads it without importing Hydra, Flower or torch.
"""

from __future__ import annotations

from pathlib import Path

CONF_DIR: Path = Path(__file__).resolve().parents[2] / "conf"


def config_groups(conf: Path = CONF_DIR) -> dict[str, list[str]]:
    """Each config group (a folder of ``conf/`` with YAML files) and its options (file stems).

    Folders without YAML files of their own (``conf/examples/``, chosen through the ``example`` group)
    are not groups a user selects.
    """
    groups = {folder.name: sorted(p.stem for p in folder.glob("*.yaml")) for folder in sorted(conf.iterdir())}
    return {group: options for group, options in groups.items() if options}
