#!/usr/bin/env bash
# Stop the background SuperLink that the first `flwr run .` started (and the simulations it may
# still be running). Flower has no command for this. Uses $FLWR_HOME (default ~/.flwr), the same
# as `flwr run`; only this user's SuperLink for that home is stopped, by process id
# (scripts/local_deployment.py stop-flwr-superlink).
set -eu
here="$(cd "$(dirname "$0")" && pwd)"
python="${here}/../.venv/bin/python"
[ -x "$python" ] || python="python3"
exec "$python" "${here}/local_deployment.py" stop-flwr-superlink
