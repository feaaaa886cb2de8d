#!/usr/bin/env bash
# The GPU rows of the torch-only round (benchmarks/cohort_round.py): the population's data kept
# on the device (and moved each round, --data host), cohorts of 1000 and 100, MLP and CNN (and the
# per-client loop at 100; add --profile to a line for a torch.profiler table of one round's training). Needs torch with CUDA and numpy only.
# Usage: OUT=folder bash benchmarks/gpu_cohort_round.sh
set -u
OUT=${OUT:-/tmp/gpu_cohort}
mkdir -p "$OUT"
PY=${PYTHON:-python}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
step() { echo "== $*"; timeout 120 "$@" 2>&1 | grep -v -E '^  (mlp|cnn) ' ; }
step $PY -P benchmarks/cohort_round.py --device cuda --population 10000 --cohort 1000 --models mlp,cnn --paths cohort --rounds 5 --json "$OUT/round_cuda_1000_device.json"
step $PY -P benchmarks/cohort_round.py --device cuda --population 1000 --cohort 100 --models mlp,cnn --paths cohort,loop --rounds 5 --json "$OUT/round_cuda_100_device.json"
step $PY -P benchmarks/cohort_round.py --device cuda --population 10000 --cohort 1000 --models mlp --paths cohort --data host --rounds 5 --json "$OUT/round_cuda_1000_mlp_host.json"
echo done
