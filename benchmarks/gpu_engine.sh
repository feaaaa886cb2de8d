#!/usr/bin/env bash
# dpfl's whole engine (python -m fl_app, simulation.backend=inline) on a machine with one
# NVIDIA GPU that has torch with CUDA but neither Flower, Hydra nor Ray and no network.
#
# What travels with the checkout (both ignored by git, named in the call's carry):
#   .whl/      the wheels python -m fl_app imports that such a machine lacks, and py-spy for
#              benchmarks/round_phases.py (cp312; list and download command in
#              docs/benchmarks/engine_gpu.md), installed with --no-deps into /tmp/site;
#   .gpudata/  Fashion-MNIST's four IDX files (dataset.data_dir).
# Ray: Flower's simulation modules import it, the inline backend never calls it; a stand-in module
# written below answers the imports and raises on any use (so a run that reached Ray would fail).
#
# Usage: OUT=folder bash benchmarks/gpu_engine.sh            (on the GPU machine; ONLY="run names" for some;
#        PROFILE=1 adds benchmarks/engine_cuda_profile.py's runs of the 1000-client cohort, ONLY=none alone;
#        SWEEP=1 adds 8 runs of the 1000-client task at once on the one GPU, and one alone)
#        LOCAL=1 OUT=folder bash benchmarks/gpu_engine.sh    (here: .venv's python, the CPU, fewer rounds)
# Every run is bounded; the rows (round times, accuracy, CPU by phase) land in $OUT/engine_gpu.tgz
# and one line per run on stdout.
set -u
OUT=${OUT:-/tmp/gpu_engine}
RUNS=/tmp/gpu_engine_runs
rm -rf "$RUNS"; mkdir -p "$OUT" "$RUNS"
if [ "${LOCAL:-0}" = 1 ]; then
  PY=.venv/bin/python; GPU=0; SCALE=2
else
  PY=python3; GPU=1; SCALE=1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$RUNS/gpu.txt"
fi
mkdir -p /tmp/raystub/ray/util /tmp/raystub/ray/actor
cat > /tmp/raystub/ray/__init__.py <<'EOF'
"""Stand-in for Ray where it is not installed: Flower's modules import it; simulation.backend=inline never uses it."""
class ObjectRef: ...
def _absent(*args, **kwargs):
    raise RuntimeError("Ray is not installed on this machine (run with simulation.backend=inline)")
def remote(*args, **kwargs):
    return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else (lambda target: target)
init = get = wait = nodes = shutdown = kill = available_resources = cluster_resources = _absent
def is_initialized():
    return False
EOF
echo "class ActorPool: ..." > /tmp/raystub/ray/util/actor_pool.py
touch /tmp/raystub/ray/util/__init__.py
printf "class RayActorError(Exception): ...\nclass RayTaskError(Exception): ...\nclass GetTimeoutError(Exception): ...\n" > /tmp/raystub/ray/exceptions.py
printf "def exit_actor():\n    raise SystemExit\n" > /tmp/raystub/ray/actor/__init__.py
if [ "$GPU" = 1 ]; then export PYTHONPATH=/tmp/raystub:/tmp/site:$PWD PATH=/tmp/site/bin:$PATH; fi
$PY -c "import fl_app.__main__, fl_app.engine.inline, strategies, clients" || { echo "imports failed"; exit 1; }
$PY -c "import torch, flwr, hydra, fl_app.__main__, fl_app.engine.inline, strategies, clients; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'flwr', flwr.__version__)" | tee -a "$RUNS/gpu.txt"

DATA="dataset=fashion_mnist dataset.data_dir=$PWD/.gpudata/fashion-mnist"
# pfl_compare's cross-device task (N = 1000, 100 per round) and its 10x (N = 10,000, 1000 per round:
# a Dirichlet(0.5) split of 60,000 examples into 10,000 clients of at least 2 fails, so IID there)
SMALL="$DATA partition=dirichlet num_clients=1000 clients_per_round=100 model=mlp local_epochs=1 batch_size=32 lr=0.1 evaluation.test_subset=2000 seed=42 simulation.messages_per_task=100"
LARGE="$DATA partition=iid num_clients=10000 clients_per_round=1000 local_epochs=1 batch_size=32 lr=0.1 evaluation.test_subset=2000 seed=42 simulation.messages_per_task=1000"
DP="strategy=dp_fedavg strategy.sampling=poisson strategy.clip=1.0 privacy.epsilon=8 privacy.delta=1e-5 privacy.diagnostics=true"
one() {  # name, rounds, overrides...  (ONLY="name name": just those runs)
  local name=$1 rounds=$2; shift 2
  case " ${ONLY:-$name} " in *" $name "*) ;; *) return ;; esac
  local started=$SECONDS
  timeout 150 $PY -P benchmarks/round_phases.py --top 8 --json "$RUNS/$name.phases.json" -- "$@" \
    simulation.backend=inline num_rounds="$rounds" output_dir="$RUNS/$name" > "$RUNS/$name.log" 2>&1
  local rc=$?
  cp "$RUNS/$name/results.json" "$RUNS/$name.results.json" 2>/dev/null
  $PY - "$RUNS/$name.results.json" "$name" "$rc" "$((SECONDS - started))" <<'EOF'
import json, statistics, sys
path, name, rc, wall = sys.argv[1:]
try:
    r = json.load(open(path))
except OSError:
    print(f"{name}: rc {rc}, {wall} s, no results"); sys.exit()
rounds = r["rounds"]
times = [x["round_s"] for x in rounds if x.get("round_s") is not None]
secret = r.get("outside_guarantee", {}).get("rounds", [])  # a Poisson cohort's rounds (diagnostics)
times = times or [x["secret_cohort_round_s"] for x in secret if "secret_cohort_round_s" in x]
med = statistics.median(times[1:] or times) if times else float("nan")
print(f"{name}: rc {rc}, {wall} s, {len(rounds)} rounds, median round after the first {med:.4f} s, "
      f"first {times[0] if times else float('nan'):.3f} s, accuracy {r['final']['accuracy']:.4f}, "
      f"loss {r['final']['loss']:.5f}, epsilon {r['final'].get('epsilon')}")
EOF
  grep -E "^wall|^  [a-zA-Z]|^ +[0-9.]+ s " "$RUNS/$name.log" | head -22 | sed 's/^/    /'
}
GPUS="simulation.client_gpus=$GPU"
one small_fedavg_cohort $((10 / SCALE)) $SMALL strategy=fedavg $GPUS simulation.vectorise=true
one small_fedavg_loop $((10 / SCALE)) $SMALL strategy=fedavg $GPUS simulation.vectorise=false
one large_fedavg_cohort $((6 / SCALE)) $LARGE model=mlp strategy=fedavg $GPUS simulation.vectorise=true
one small_dp_cohort $((10 / SCALE)) $SMALL $DP $GPUS simulation.vectorise=true
one small_dp_loop $((10 / SCALE)) $SMALL $DP $GPUS simulation.vectorise=false
one large_cnn_cohort $((4 / SCALE)) $LARGE model=cnn strategy=fedavg $GPUS simulation.vectorise=true
# FedAvg's and DP-FedAvg's rounds above go in bulk (simulation.bulk=auto: one message for the cohort,
# trained as one computation, fl_app/engine/bulk.py); the same as packed messages of 16 clients
one large_fedavg_packed $((6 / SCALE)) $LARGE model=mlp strategy=fedavg $GPUS simulation.vectorise=true simulation.bulk=false
one small_fedavg_packed $((10 / SCALE)) $SMALL strategy=fedavg $GPUS simulation.vectorise=true simulation.bulk=false
# and with one message per client, as before 2026-11-27
one small_fedavg_cohort_permsg $((10 / SCALE)) $SMALL strategy=fedavg $GPUS simulation.vectorise=true simulation.pack_messages=false
one large_fedavg_cohort_permsg $((6 / SCALE)) $LARGE model=mlp strategy=fedavg $GPUS simulation.vectorise=true simulation.pack_messages=false
one small_dp_cohort_permsg $((10 / SCALE)) $SMALL $DP $GPUS simulation.vectorise=true simulation.pack_messages=false
if [ "$GPU" = 1 ]; then  # the same process's CPU (16 cores), one client at a time
  one small_fedavg_cpu16 10 $SMALL strategy=fedavg simulation.client_gpus=0 simulation.client_cpus=16 simulation.vectorise=false
fi
if [ "${SWEEP:-0}" = 1 ]; then  # SWEEP=1: 8 runs of the 1000-client MLP task at once on the one GPU
  started=$SECONDS
  for k in 1 2 3 4 5 6 7 8; do
    timeout 400 $PY -m fl_app $LARGE model=mlp strategy=fedavg $GPUS simulation.vectorise=true seed=$k \
      simulation.backend=inline num_rounds=$((20 / SCALE)) output_dir="$RUNS/sweep_$k" > "$RUNS/sweep_$k.log" 2>&1 &
  done
  wait
  echo "sweep of 8 x $((20 / SCALE)) rounds at once: $((SECONDS - started)) s"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader 2>/dev/null | sed 's/^/  memory after: /'
  started=$SECONDS
  one sweep_alone $((20 / SCALE)) $LARGE model=mlp strategy=fedavg $GPUS simulation.vectorise=true seed=1
  echo "one run alone: $((SECONDS - started)) s (the sweep's runs per hour against one at a time)"
fi
if [ "${PROFILE:-0}" = 1 ]; then  # the GPU's own timings of the 1000-client cohort, pinned and pageable copies
  for repeat in 1 2; do
    for variant in pinned pageable; do
      name="profile_${variant}_$repeat"; flag=""; [ "$variant" = pageable ] && flag=--pageable
      timeout 240 $PY -P benchmarks/engine_cuda_profile.py $flag --json "$RUNS/$name.json" -- $LARGE model=mlp \
        strategy=fedavg $GPUS simulation.vectorise=true simulation.backend=inline num_rounds=$((4 / SCALE)) \
        output_dir="$RUNS/$name" > "$RUNS/$name.log" 2>&1
      echo "$name: rc $?"; $PY -c "import json,sys; d=json.load(open(sys.argv[1])); print('  ', d['median_round_s'], d['device_s_by_kind'])" "$RUNS/$name.json"
    done
  done
fi
tar -czf "$OUT/engine_gpu.tgz" -C "$RUNS" --exclude='*/final_model.npz' --exclude='*/private_server_state.pkl' .
echo done
