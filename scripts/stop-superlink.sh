#!/usr/bin/env bash
# Stop the background SuperLink that the first `flwr run .` started (and a
# simulation it may still be running). Flower has no command for this.
# Uses $FLWR_HOME (default ~/.flwr), the same as `flwr run`.
set -u
home="${FLWR_HOME:-$HOME/.flwr}"
pids=$(pgrep -f "flower-superlink .*--database ${home}/local-superlink/state.db" || true)
if [ -z "$pids" ]; then
    echo "no local SuperLink running for FLWR_HOME=${home}"
    exit 0
fi
for pid in $pids; do
    # flwr-simulation processes started by this SuperLink talk to its runtime API port.
    children=$(pgrep -P "$pid" || true)
    kill -TERM "$pid" $children 2>/dev/null || true
done
pkill -TERM -f "flwr-simulation --runtime-api-address 127.0.0.1:39091" 2>/dev/null || true
sleep 2
echo "stopped SuperLink ${pids} (FLWR_HOME=${home})"
