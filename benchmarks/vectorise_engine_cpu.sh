#!/usr/bin/env bash
# simulation.vectorise in the whole engine on this machine's CPU: the cross-device DP-FedAvg task
# (Fashion-MNIST, 1000 clients, 100 per round, MLP, 1 epoch, 10 rounds, epsilon 8), 50 messages per Ray
# task, the loop and the vectorised path interleaved, twice (docs/benchmarks/cohort_training.md).
# Usage: bash benchmarks/vectorise_engine_cpu.sh [OUT_PREFIX]
set -u
OUT=${1:-/tmp/vectorise}
for rep in 1 2; do
  for v in false true; do
    rm -rf "${OUT}_${v}_${rep}"
    /usr/bin/time -f "vectorise=$v rep=$rep %e s wall" python -m fl_app strategy=dp_fedavg dataset=fashion_mnist \
      num_clients=1000 clients_per_round=100 num_rounds=10 local_epochs=1 privacy.epsilon=8 \
      simulation.messages_per_task=50 simulation.vectorise=$v output_dir="${OUT}_${v}_${rep}" 2>&1 \
      | grep -E "finished|wall"
  done
done
