#!/usr/bin/env bash
# The vectorised trainer's GPU rows in one call (a machine with torch + CUDA and numpy; no Flower, Ray or Hydra needed).
# Usage: OUT=folder bash benchmarks/gpu_cohort.sh   (each step bounded; the rows land in $OUT/*.json)
set -u
OUT=${OUT:-/tmp/gpu_cohort}
mkdir -p "$OUT"
PY=${PYTHON:-python}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, numpy; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'numpy', numpy.__version__)" | tee -a "$OUT/gpu.txt"
step() { echo "== $*"; timeout 150 "$@" 2>&1 | grep -v '^  ' ; }
step $PY -P benchmarks/cohort_round.py --device cuda --population 10000 --cohort 1000 --models mlp,cnn --paths cohort --rounds 5 --json "$OUT/round_cuda_1000.json"
step $PY -P benchmarks/cohort_round.py --device cuda --population 1000 --cohort 100 --models mlp,cnn --paths cohort,loop --rounds 5 --json "$OUT/round_cuda_100.json"
step $PY -P benchmarks/cohort_round.py --device cuda --population 10000 --cohort 1000 --models mlp --paths loop --rounds 1 --json "$OUT/round_cuda_1000_loop.json"
step $PY -P benchmarks/cohort_training.py --device cuda --clients 100,1000 --models mlp --epochs 1,5 --chunks auto,all --repeats 3 --json "$OUT/training_cuda_mlp.json"
step $PY -P benchmarks/cohort_training.py --device cuda --clients 100,1000 --models cnn --epochs 1 --chunks auto,all --repeats 2 --json "$OUT/training_cuda_cnn.json"
OMP_NUM_THREADS=16 step $PY -P benchmarks/cohort_round.py --device cpu --population 10000 --cohort 1000 --models mlp --paths cohort --rounds 3 --json "$OUT/round_cpu16_1000.json"
OMP_NUM_THREADS=16 step $PY -P benchmarks/cohort_round.py --device cpu --population 1000 --cohort 100 --models mlp --paths cohort,loop --rounds 3 --json "$OUT/round_cpu16_100.json"
echo done
