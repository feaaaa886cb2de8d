"""Write one data file per device from a partition, to try a deployment with real data.

Usage::

    python scripts/make_device_data.py OUT_DIR [key=value ...]

The overrides are the Hydra overrides of the run (``dataset``, ``partition``,
``num_clients``, ``seed`` and the dataset's own keys matter). The script writes
``OUT_DIR/device<i>.npz`` (arrays ``x`` and ``y``, the format
:func:`fl_app.data.local.load_local_dataset` reads) for every client
``i = 0 .. num_clients-1``: exactly the examples client ``i`` holds in a
simulation with the same overrides. Start SuperNode ``i`` with
``--node-config 'data-path="OUT_DIR/device<i>.npz"'`` and run the server with
the same ``dataset``/``partition``/``num_clients``/``seed``: the server keeps
the test split and the unlabeled public split, the devices hold the rest.

Example::

    python scripts/make_device_data.py devices dataset=digits partition=iid num_clients=3
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from fl_app.config.compose import compose_config
from fl_app.config.settings import RunSettings
from fl_app.config.validation import locate_data, require_int, validate_data_options
from fl_app.data.federated import federated_data


def write_device_files(out_dir: Path, overrides: Sequence[str]) -> list[Path]:
    """Write ``device<i>.npz`` for every client of the configured partition; return the paths."""
    cfg = compose_config(list(overrides))
    require_int("num_clients", cfg.num_clients, minimum=1)
    validate_data_options(cfg)
    settings = RunSettings.from_config(cfg)
    locate_data(settings)
    data = federated_data(settings.data)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for client in range(int(cfg.num_clients)):
        part = data.client(client)
        path = out_dir / f"device{client}.npz"
        np.savez(path, x=part.x, y=part.y)
        paths.append(path)
    return paths


def main(argv: Sequence[str]) -> int:
    """Command line entry point."""
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        print(__doc__.split("Usage::", 1)[1].split("The overrides", 1)[0].strip(), file=sys.stderr)
        return 2
    out_dir = Path(argv[0]).expanduser()
    try:
        paths = write_device_files(out_dir, argv[1:])
    except (HydraException, OmegaConfBaseException, ValueError) as error:
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    for path in paths:
        with np.load(path) as archive:
            shape = archive["x"].shape
        print(f"{path.resolve()}: {shape[0]} examples of shape {tuple(shape[1:])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
