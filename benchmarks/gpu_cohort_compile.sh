#!/usr/bin/env bash
# An experiment on the GPU: the torch-only round with each step's vmap(grad(loss)) compiled
# (benchmarks/cohort_round.py --compile), cohorts of 100 and 1000 MLP clients. torch + CUDA + numpy only.
# Usage: OUT=folder bash benchmarks/gpu_cohort_compile.sh
set -u
OUT=${OUT:-/tmp/gpu_cohort}
mkdir -p "$OUT"
PY=${PYTHON:-python}
step() { echo "== $*"; timeout 100 "$@" 2>&1 | grep -v -E '^  (mlp|cnn) .* round [1-9]' | tail -8 ; }
step $PY -P benchmarks/cohort_round.py --device cuda --population 1000 --cohort 100 --models mlp --paths cohort --rounds 5 --compile --json "$OUT/round_cuda_100_compiled.json"
step $PY -P benchmarks/cohort_round.py --device cuda --population 10000 --cohort 1000 --models mlp --paths cohort --rounds 5 --compile --json "$OUT/round_cuda_1000_compiled.json"
echo done
