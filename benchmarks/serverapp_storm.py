"""ServerApp storm: many runs submitted at once to one SuperLink on a busy machine.

Starts a local deployment (``scripts/local_deployment.py``: a SuperLink and two SuperNodes,
digits IID, insecure), optionally keeps ``--busy`` CPU-bound loops running beside it (the load of
other work on a shared machine), submits ``--runs`` one-round FedAvg runs at once (one ``flwr run``
per thread),
and samples every second how many ``flwr-serverapp`` processes exist, until every run finished
or ``--deadline`` passed. Then it counts the SuperLink's task-token authentication failures
(a ServerApp that reported after its run had been handed to another process) and stops
everything it started, by process id.

It stops early when more than ``--cap`` ServerApp processes exist (a storm, before it takes
the machine's memory). ``--slots N`` starts the SuperLink behind dpfl's launch gate with N slots
(the default of ``local_deployment.start``); ``--slots none`` without it (Flower's own policy)::

    .venv/bin/python benchmarks/serverapp_storm.py --slots none --runs 12 --busy 2
    .venv/bin/python benchmarks/serverapp_storm.py --slots 2 --runs 12 --busy 2
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
_spec = importlib.util.spec_from_file_location("local_deployment", ROOT / "scripts" / "local_deployment.py")
assert _spec is not None
assert _spec.loader is not None
local_deployment = importlib.util.module_from_spec(_spec)
sys.modules["local_deployment"] = local_deployment
_spec.loader.exec_module(local_deployment)
import make_device_data  # noqa: E402  (scripts/, on the path above)

DATA = ["dataset=digits", "partition=iid", "num_clients=2"]
RUN = [*DATA, "clients_per_round=2", "num_rounds=1", "local_epochs=1", "simulation.timeout=1800"]
BUSY_LOOP = "while True: pass"


def serverapp_processes() -> int:
    """How many ``flwr-serverapp`` processes exist on the machine (gate or real)."""
    count = 0
    for process in psutil.process_iter(["cmdline"]):
        if local_deployment.runs_program(process.info["cmdline"] or [], "flwr-serverapp"):
            count += 1
    return count


def measure(*, slots: int | None, runs: int, busy: int, deadline_s: float, cap: int) -> dict[str, object]:
    """One storm; the numbers it reports."""
    with tempfile.TemporaryDirectory(prefix="dpfl-storm-") as tmp:
        root = Path(tmp)
        files = make_device_data.write_device_files(root / "devices", DATA)
        app = local_deployment.stage_app(ROOT, root / "app" / "dpfl")
        cli_env = {**local_deployment.os.environ, "FLWR_HOME": str(root / "cli-home")}
        loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(busy)]
        deployment = None
        try:
            deployment = local_deployment.start(
                root / "federation",
                data_files=files,
                secure=False,
                port=local_deployment.free_port(),
                connection="dpfl-storm",
                cli_env=cli_env,
                die_with_parent=True,
                serverapp_slots=slots,
            )
            started = time.monotonic()

            def submit(index: int) -> int:
                config = (
                    f"overrides={json.dumps(shlex.join(RUN))} "
                    f"output-dir={json.dumps(str(root / 'results' / str(index)))}"
                )
                answer = local_deployment.json_output(
                    local_deployment.flwr(
                        ["run", str(app), "dpfl-storm", "--run-config", config, "--format", "json"],
                        env=cli_env,
                    )
                )
                return int(answer["run-id"])

            # all at once, as several users (or the deployment tests) would: the runs are pending together
            with ThreadPoolExecutor(max_workers=runs) as pool:
                run_ids = list(pool.map(submit, range(runs)))
            submitted_s = time.monotonic() - started
            peak, statuses, next_poll, capped_at = 0, {}, 0.0, None
            while time.monotonic() - started < deadline_s:
                peak = max(peak, serverapp_processes())
                if peak > cap:  # a storm: stop before it takes the machine's memory
                    capped_at = round(time.monotonic() - started, 1)
                    break
                if time.monotonic() >= next_poll:
                    listing = local_deployment.json_output(
                        local_deployment.flwr(["ls", "dpfl-storm", "--format", "json"], env=cli_env)
                    )
                    statuses = {int(r["run-id"]): str(r["status"]) for r in listing["runs"]}
                    if all(statuses.get(i, "").startswith("finished") for i in run_ids):
                        break
                    next_poll = time.monotonic() + 10.0
                time.sleep(1.0)
            elapsed = time.monotonic() - started
            done = all(s.startswith("finished") for s in [statuses.get(i, "?") for i in run_ids])
            log = (root / "federation" / "logs" / "superlink.log").read_text(errors="replace")
            finished = [statuses.get(i, "?") for i in run_ids]
            return {
                "slots": slots,
                "runs": runs,
                "busy_loops": busy,
                "submit_s": round(submitted_s, 1),
                "all_finished_s": round(elapsed, 1) if done else None,
                "completed": sum(s == "finished:completed" for s in finished),
                "peak_serverapp_processes": peak,
                "token_auth_failures": log.count("authentication failed"),
                "stopped_above_cap_at_s": capped_at,
                "statuses": sorted(set(finished)),
            }
        finally:
            for loop in loops:
                loop.kill()
            if deployment is not None:
                deployment.stop()


def main(argv: list[str]) -> int:
    """Measure one storm and print its numbers as one JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", default="2", help="gate slots, or 'none' for no gate")
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--busy", type=int, default=2, help="CPU-bound loops beside the deployment")
    parser.add_argument("--deadline", type=float, default=1200.0, help="seconds to wait for the runs")
    parser.add_argument("--cap", type=int, default=60, help="stop when more ServerApp processes exist")
    args = parser.parse_args(argv)
    slots = None if args.slots == "none" else int(args.slots)
    numbers = measure(slots=slots, runs=args.runs, busy=args.busy, deadline_s=args.deadline, cap=args.cap)
    print(json.dumps(numbers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
