#!/usr/bin/env bash
# Set up dpfl on a fresh machine: a virtual environment in .venv, the pinned
# dependencies (CPU torch), the project itself (editable), and the default data
# set where it can be fetched. Idempotent: re-running only checks.
#
# The data step (python -m fl_app.data.fetch) looks in /usr/share/datasets and
# ~/.cache/dpfl; when Fashion-MNIST is in neither and this runs as root with
# apt-get, it installs Debian's dataset-fashion-mnist package (it says so first);
# DPFL_NO_SYSTEM_PACKAGES=1 bash scripts/setup.sh never touches system packages.
# Otherwise it downloads the files into ~/.cache/dpfl (DPFL_DATA_HOME).
#
# Each step says what it does before it starts (the installs take minutes on a fresh machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
step() { echo "setup [${SECONDS} s]: $*"; }
if [ ! -x .venv/bin/python ]; then
    step "creating the virtual environment .venv with $PYTHON ..."
    "$PYTHON" -m venv .venv
fi
# torch first and alone: with the exact pin pip takes the CPU wheel; a looser
# request would let pip pick a newer, CUDA-linked build.
step "installing torch 2.13.0, CPU build (the largest download; quick when already installed) ..."
.venv/bin/python -m pip install --quiet --disable-pip-version-check "torch==2.13.0"
step "installing dpfl (editable) and its pinned dependencies: flwr, ray, datasets, hydra, the test tools ..."
.venv/bin/python -m pip install --quiet --disable-pip-version-check -e ".[dev]"
step "fetching the default data set, Fashion-MNIST ..."
.venv/bin/python -m fl_app.data.fetch fashion_mnist
step "done: run .venv/bin/python -m fl_app, or .venv/bin/python -m pytest -q"
