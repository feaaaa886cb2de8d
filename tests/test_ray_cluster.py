"""A simulation on a two-node Ray cluster (``simulation.ray_address``), exercised on this machine.

Two Ray nodes of one CPU each (``ray.cluster_utils.Cluster``: a head and a worker node, each with its
own raylet and object store, as on two machines) share this machine. A run joins the cluster with
``simulation.ray_address``; with ``simulation.client_cpus=1`` Flower starts one client actor per CPU,
so its two actors must land on the two nodes. The run must give the same results as the same seeded
run on a private single-node Ray (``tests/data/golden_rounds.json``, recorded on one node), and the
test stops the cluster and checks that none of its processes is left.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FEDAVG_RUN, TWO_ACTORS, ray_process_ids

from fl_app.engine.batching import BatchingActor

pytestmark = pytest.mark.simulation
ROOT = Path(__file__).resolve().parent.parent
#: FEDAVG_RUN's rounds as a single-node run recorded them (the golden file of test_flower_engine).
GOLDEN = Path(__file__).parent / "data" / "golden_rounds.json"


def client_actor_nodes(address: str) -> dict[str, str]:
    """Actor id -> node id of every Flower client actor the cluster's GCS remembers (dead ones too)."""
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        table = ray._private.state.actors()  # the GCS actor table: no dashboard needed
    finally:
        ray.shutdown()
    return {
        actor_id: info["Address"]["NodeID"]
        for actor_id, info in table.items()
        if info.get("ActorClassName", "").endswith(BatchingActor.__name__)
    }


def test_simulation_on_a_two_node_cluster_uses_both_nodes_and_matches_one_node(tmp_path: Path) -> None:
    from ray.cluster_utils import Cluster

    before = ray_process_ids()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        output = tmp_path / "two-nodes"
        completed = subprocess.run(
            [
                sys.executable,
                "-m",
                "fl_app",
                *FEDAVG_RUN,
                TWO_ACTORS,
                f"simulation.ray_address={cluster.address}",
                "simulation.client_cpus=1",
                f"output_dir={output}",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert completed.returncode == 0, completed.stderr[-3000:]
        nodes = client_actor_nodes(cluster.address)
        assert len(set(nodes.values())) == 2, nodes  # the client actors ran on both nodes
        assert {node.node_id for node in [cluster.head_node, *cluster.worker_nodes]} == set(nodes.values())
    finally:
        cluster.shutdown()
    assert ray_process_ids() <= before, "processes of the two-node cluster are still running"
    joined = json.loads((output / "results.json").read_text())
    assert joined["status"] == "completed"
    golden = json.loads(GOLDEN.read_text())["runs"]["fedavg"]  # made with FEDAVG_RUN's overrides
    assert len(joined["rounds"]) == len(golden)
    for got, want in zip(joined["rounds"], golden, strict=True):
        assert {k: got[k] for k in want if k != "loss"} == {k: v for k, v in want.items() if k != "loss"}
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
        assert got["clients"] == 3 and got["failures"] == 0
