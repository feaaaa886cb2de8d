"""``python -m fl_app.data.fetch [fashion_mnist|mnist ...] [--strict]``: get the IDX data sets.

For each data set: if it is already where dpfl looks (Debian package path, the
dpfl cache), nothing happens; otherwise, for Fashion-MNIST, Debian's
``dataset-fashion-mnist`` package is installed when this runs as root with
``apt-get`` available (it works offline from a Debian mirror), saying so first;
``--no-system-packages`` (or ``DPFL_NO_SYSTEM_PACKAGES=1``, which ``scripts/setup.sh``
passes on) skips that; then the official mirrors are tried (online machines). What
cannot be found is reported in one line with the remedy; ``--strict`` makes that an
exit status of 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from fl_app.data.sources import IDX_DATASETS, DataNotFoundError, resolve_idx_folder

DEBIAN_PACKAGES: dict[str, str] = {"fashion_mnist": "dataset-fashion-mnist"}


#: Set to 1 to never install a system package.
NO_SYSTEM_PACKAGES_ENV = "DPFL_NO_SYSTEM_PACKAGES"


def _apt_install(package: str) -> bool:
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        return False
    print(
        f"installing the Debian package {package} with apt-get (running as root; skip with "
        f"{NO_SYSTEM_PACKAGES_ENV}=1 or --no-system-packages)",
        file=sys.stderr,
    )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", package]
    if subprocess.run(command, env=env, capture_output=True).returncode == 0:
        return True
    subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
    return subprocess.run(command, env=env, capture_output=True).returncode == 0


def fetch(name: str, *, system_packages: bool = True) -> Path | None:
    """Make ``name`` available; return its folder, or None (after printing why)."""
    try:
        return resolve_idx_folder(name, data_dir=None, download=False)
    except DataNotFoundError:
        pass
    if system_packages and name in DEBIAN_PACKAGES and _apt_install(DEBIAN_PACKAGES[name]):
        try:
            return resolve_idx_folder(name, data_dir=None, download=False)
        except DataNotFoundError:
            pass
    try:
        return resolve_idx_folder(name, data_dir=None, download=True)
    except DataNotFoundError as error:
        print(f"fetch {name}: {error}", file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(prog="python -m fl_app.data.fetch", description=__doc__)
    parser.add_argument(
        "names",
        nargs="*",
        default=["fashion_mnist"],
        metavar="NAME",
        help=f"data sets to fetch, of {', '.join(IDX_DATASETS)} (default fashion_mnist)",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when a data set is missing")
    parser.add_argument(
        "--no-system-packages",
        action="store_true",
        help=f"never install a Debian package (also: {NO_SYSTEM_PACKAGES_ENV}=1)",
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.names if name not in IDX_DATASETS]
    if unknown:
        parser.error(f"unknown data set {unknown[0]!r}; allowed: {', '.join(IDX_DATASETS)}")
    missing = 0
    system_packages = not (args.no_system_packages or os.environ.get(NO_SYSTEM_PACKAGES_ENV) == "1")
    for name in args.names:
        folder = fetch(name, system_packages=system_packages)
        if folder is not None:
            print(f"{name}: {folder}")
        else:
            missing += 1
    return 1 if (missing and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
