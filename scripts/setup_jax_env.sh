#!/usr/bin/env bash
# Set up jax_privacy 2.0.0 with CPU jax in its own virtual environment, .venv-jax
# at the repository root, for benchmarks/blt_jax_privacy.py (the BLT cross-check,
# docs/benchmarks/blt.md). jax_privacy is NOT a dependency of dpfl: it lives only
# here, never in pyproject.toml or .venv. Idempotent: re-running only checks.
#
# jax[cpu] names the CPU build of jaxlib (no CUDA plugin); jax_privacy 2.0.0 needs
# neither torch nor tensorflow, and the check at the end fails if a torch or a
# CUDA package came in anyway.
#
# Usage (from anywhere):  bash scripts/setup_jax_env.sh
#   PYTHON=python3.11 bash scripts/setup_jax_env.sh   # choose the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv-jax
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
CONSTRAINTS="$VENV/jax-constraints.txt"
cat >"$CONSTRAINTS" <<'PINS'
jax_privacy==2.0.0
jax==0.10.2
jaxlib==0.10.2
dp-accounting==0.6.0
numpy==2.4.6
scipy==1.17.1
PINS
"${PIP[@]}" -c "$CONSTRAINTS" "jax[cpu]==0.10.2" "jax_privacy==2.0.0"
"$VENV/bin/python" - <<'PY'
from importlib.metadata import distributions, version

import jax

names = {d.metadata["Name"].lower() for d in distributions()}
unwanted = sorted(n for n in names if n == "torch" or "cuda" in n or n.startswith("nvidia"))
assert not unwanted, f"pulled in: {unwanted}"
assert jax.default_backend() == "cpu", jax.default_backend()
print(f"jax_privacy {version('jax_privacy')}, jax {version('jax')} on {jax.default_backend()}, "
      f"dp-accounting {version('dp-accounting')}, numpy {version('numpy')}: ok ({len(names)} packages)")
PY
