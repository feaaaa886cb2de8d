#!/usr/bin/env bash
# The cross-device FedAvg task (benchmarks/pfl_compare.py's: N = 1000, 100 per round, the MLP,
# 30 rounds) with the per-client loop (simulation.vectorise=false) and the vectorised trainer (true), both
# with packed messages (the default), inline and on Ray, interleaved; REPEATS=2 by default.
# Prints one line per command: median round after the first, the command's wall time, the machine's
# busy CPU over it (/proc/stat: Ray's processes escape getrusage), final accuracy and loss.
# Usage (repository root, a quiet machine): bash benchmarks/vectorise_cohort_messages.sh
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/vectorise_cohort_messages}
mkdir -p "$OUT"
TASK="strategy=fedavg dataset=fashion_mnist partition=dirichlet num_clients=1000 clients_per_round=100 model=mlp local_epochs=1 batch_size=32 lr=0.1 evaluation.test_subset=2000 seed=42 num_rounds=30"
busy() { awk '/^cpu /{print $2+$3+$4+$7+$8}' /proc/stat; }
for rep in $(seq "${REPEATS:-2}"); do
  for arm in "inline-loop:simulation.backend=inline simulation.vectorise=false" \
             "inline-vec:simulation.backend=inline simulation.vectorise=true" \
             "ray-loop:simulation.vectorise=false" "ray-vec:simulation.vectorise=true"; do
    name=${arm%%:*}; overrides=${arm#*:}; out=$OUT/$name-$rep; rm -rf "$out"
    before=$(busy); started=$(date +%s.%N)
    # shellcheck disable=SC2086 # the overrides are words
    timeout 600 env -u OMP_NUM_THREADS .venv/bin/python -m fl_app $TASK $overrides output_dir="$out" > "$out.log" 2>&1
    ended=$(date +%s.%N); after=$(busy)
    .venv/bin/python - "$out" "$name" "$rep" "$started" "$ended" "$before" "$after" <<'PY'
import json, statistics, sys
out, name, rep, started, ended, before, after = sys.argv[1:]
r = json.load(open(out + "/results.json"))
median = statistics.median(x["round_s"] for x in r["rounds"][1:])
print(f"{name} rep {rep}: median round {median:.4f} s, command {float(ended) - float(started):.1f} s, "
      f"machine CPU {(float(after) - float(before)) / 100:.1f} s, accuracy {r['final']['accuracy']:.4f} "
      f"loss {r['final']['loss']:.5f}")
PY
  done
done
