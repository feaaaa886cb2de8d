"""Ray's start on a loaded machine: timeouts long enough, and a failure that says how to run without Ray.

Nothing here waits on a loaded machine: Ray's start is simulated (a start that fails with Ray's own
error; a ``ray.init`` that records what it was started with and asks for the raylet's registration).
"""

from __future__ import annotations

import time

import pytest

from fl_app.engine import launch, ray_session
from fl_app.run.lifecycle import RunFailed

#: Ray 2.55's error when the raylet does not register within its fixed 30 s.
NODE_TIMED_OUT = (
    "The current node timed out during startup. This could happen because some of the raylet failed to "
    "startup or the GCS has become overloaded."
)


def test_a_failed_ray_start_says_in_the_same_line_that_the_processes_backend_needs_no_ray(monkeypatch):
    def fails(init_args):
        raise Exception(NODE_TIMED_OUT)

    monkeypatch.setattr(ray_session, "start_ray", fails)
    monkeypatch.setattr(ray_session, "import_ray_modules", lambda: None)
    session = ray_session.RaySession()
    args = {"address": "ray://nowhere:1"}  # not a private instance: no watchdog, nothing to kill
    with pytest.raises(RunFailed) as failed:
        session.ready(args)
    session.end()
    assert str(failed.value) == (
        f"Ray did not start: {NODE_TIMED_OUT}; simulation.backend=processes runs the clients without Ray"
    )


def test_ray_starts_with_the_timeouts_a_loaded_machine_needs(monkeypatch):
    """Ray's GCS-request and worker-registration timeouts, and its wait for the raylet, are 300 s."""
    import ray
    from ray._private import services

    for name in launch.RAY_TIMEOUT_VARIABLES:  # unset here, and as they were after the test
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    monkeypatch.setenv("PYTHONPATH", "")
    asks: list[float] = []

    def registers_at_the_fourth_ask(gcs_address, node_id):
        asks.append(time.monotonic())
        if len(asks) < 4:
            raise RuntimeError("node not found")  # what Ray's get_node says before the raylet registers
        return {"node_id": node_id}

    seen: dict[str, object] = {}

    def init(**kwargs):  # what ray._private.node.Node does: ask until the raylet has registered
        seen.update({name: launch.os.environ.get(name) for name in launch.RAY_TIMEOUT_VARIABLES})
        seen["node"] = services.get_node("127.0.0.1:6379", "abc")

    monkeypatch.setattr(services, "get_node", registers_at_the_fourth_ask)
    monkeypatch.setattr(launch, "REGISTRATION_POLL_S", 0.01)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    launch.start_ray({"address": "local"})
    assert ray_session.START_TIMEOUT_S > launch.RAY_START_TIMEOUT_S == 300.0  # dpfl waits longer than Ray
    assert seen == {
        "RAY_gcs_server_request_timeout_seconds": "300",
        "RAY_worker_register_timeout_seconds": "300",
        "node": {"node_id": "abc"},
    }
    assert len(asks) == 4 and services.get_node is registers_at_the_fourth_ask  # put back after the start
    # a setting the user made is kept
    assert launch.ray_start_environment({"RAY_gcs_server_request_timeout_seconds": "90"}) == {
        "RAY_worker_register_timeout_seconds": "300"
    }


def test_the_wait_for_the_raylet_ends_at_its_timeout_with_rays_own_error(monkeypatch):
    from ray._private import services

    def never(gcs_address, node_id):
        raise RuntimeError("node not found")

    monkeypatch.setattr(services, "get_node", never)
    monkeypatch.setattr(launch, "REGISTRATION_POLL_S", 0.01)
    began = time.monotonic()
    with launch.raylet_registration_wait(0.3), pytest.raises(RuntimeError, match="node not found"):
        services.get_node("127.0.0.1:6379", "abc")
    assert 0.3 <= time.monotonic() - began < 10
