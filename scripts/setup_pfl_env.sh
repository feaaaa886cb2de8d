#!/usr/bin/env bash
# Set up pfl-research (Apple's pfl 0.6.0) in its own virtual environment,
# .venv-pfl at the repository root, for benchmarks/pfl_compare.py and
# benchmarks/pfl_crosscheck.py. pfl is NOT a dependency of dpfl: it lives only
# here, never in pyproject.toml or .venv. Idempotent: re-running only checks.
#
# pfl-research's benchmark code (not on PyPI) needs, beyond pfl: h5py (its Stack
# Overflow HDF5), PyYAML (its configurations) and, to run its
# dataset/stackoverflow/download_preprocess.py and TFF's task code, TensorFlow
# (the CPU wheel, about 600 MB installed; PFL_WITH_TENSORFLOW=0 skips it, and the
# crosscheck then writes the HDF5 with an independent reader instead).
#
# torch goes in first and alone, with the exact pin, so pip takes the local CPU
# wheel (a looser request would pull a newer, CUDA-linked build and gigabytes
# of CUDA wheels); the constraints file below then keeps every later install
# from moving it. pfl 0.6.0 requires dp-accounting>=0.4,<0.6 (dpfl pins 0.6.0
# in its own .venv), so this environment pins 0.5.0.
#
# Usage (from anywhere):  bash scripts/setup_pfl_env.sh
#   PYTHON=python3.11 bash scripts/setup_pfl_env.sh   # choose the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv-pfl
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
"${PIP[@]}" "torch==2.13.0"
CONSTRAINTS="$VENV/pfl-constraints.txt"
cat >"$CONSTRAINTS" <<'PINS'
torch==2.13.0
pfl==0.6.0
dp-accounting==0.5.0
numpy==2.4.6
scipy==1.17.1
PINS
# pfl's [pytorch] extra is only torch (already installed); name it anyway so pip
# checks it against the pin rather than resolving a new one.
"${PIP[@]}" -c "$CONSTRAINTS" "torch==2.13.0" "pfl[pytorch]==0.6.0" "dp-accounting==0.5.0" numpy
"${PIP[@]}" -c "$CONSTRAINTS" "h5py==3.14.0" "pyyaml==6.0.4" "multiprocess==0.70.19" "tqdm==4.70.1"
if [ "${PFL_WITH_TENSORFLOW:-1}" != "0" ]; then
    "${PIP[@]}" -c "$CONSTRAINTS" "tensorflow-cpu==2.21.0"
fi
"$VENV/bin/python" - <<'PY'
import pfl
import torch
from importlib.metadata import version

assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"pfl {version('pfl')}, torch {torch.__version__}, dp-accounting {version('dp-accounting')}, "
      f"numpy {version('numpy')}: ok")
PY
