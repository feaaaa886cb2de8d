"""``simulation.client_gpus``: Ray's GPU share per client, and clients that train on CUDA.

This machine has no GPU: the tests check what reaches Ray and the clients, and that the CPU path
(the default) is unchanged; the CUDA path itself is not exercised here.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    FAST,
    build_run_context,
    make_context,
    make_message,
    numpy_close,
    settings_of,
    spec_config,
)

from clients.fedavg import FedAvgClient
from clients.kd_dp import KDDPTeacherClient
from fl_app import keys
from fl_app.config.compose import compose_config
from fl_app.config.validation import ConfigError, validate_common
from fl_app.engine.simulation import backend_config
from fl_app.learning.model_spec import ModelSpec
from fl_app.learning.training import model_to_arrays
from strategies.base import base_train_config


def test_client_gpus_needs_a_cuda_device_and_a_share_in_0_1(monkeypatch):
    with pytest.raises(ConfigError, match=r"simulation.client_gpus=2.*\[0.0, 1.0\]"):
        validate_common(compose_config([*FAST, "simulation.client_gpus=2"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="no CUDA device"):
        validate_common(compose_config([*FAST, "simulation.client_gpus=0.5"]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    validate_common(compose_config([*FAST, "simulation.client_gpus=0.5"]))
    # a cluster's nodes may have GPUs that the driver's machine lacks: Ray schedules them
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    validate_common(compose_config([*FAST, "simulation.client_gpus=0.5", "simulation.ray_address=auto"]))


def test_client_gpus_reach_ray_and_the_train_config(tmp_path):
    assert backend_config(settings_of(FAST))["client_resources"] == {"num_cpus": 1.0, "num_gpus": 0.0}
    gpu = [*FAST, "simulation.client_gpus=0.25"]
    assert backend_config(settings_of(gpu))["client_resources"]["num_gpus"] == 0.25
    # the CPU default adds no key (messages and their metered bytes stay what they were)
    cpu_record = base_train_config(build_run_context(FAST, tmp_path), client="fedavg", server_round=1)
    assert keys.DEVICE not in cpu_record
    gpu_record = base_train_config(build_run_context(gpu, tmp_path), client="fedavg", server_round=1)
    assert gpu_record[keys.DEVICE] == "cuda"


def _client(kind, device: str | None):
    config = spec_config(FAST)
    if device is not None:
        config[keys.DEVICE] = device
    return kind(make_message(config), make_context())


def test_clients_train_on_cuda_only_when_asked_able_and_present(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _client(FedAvgClient, "cuda").device == torch.device("cuda")
    assert _client(FedAvgClient, None).device == torch.device("cpu")  # not asked
    assert _client(KDDPTeacherClient, "cuda").device == torch.device("cpu")  # DP-SGD in numpy
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _client(FedAvgClient, "cuda").device == torch.device("cpu")  # asked, but no device here


def test_a_cuda_request_without_a_device_trains_on_the_cpu_as_before(monkeypatch):
    """Byte for byte the same reply with and without the request on a machine without CUDA."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = spec_config(FAST)
    initial = model_to_arrays(ModelSpec.from_json(str(config[keys.MODEL_SPEC])).build())
    replies = []
    for device in (None, "cuda"):
        message_config = dict(config, **({} if device is None else {keys.DEVICE: device}))
        client = FedAvgClient(make_message(message_config, initial), make_context())
        replies.append(client.train().content.array_records[keys.ARRAYS])
    assert numpy_close(replies[0], replies[1], rtol=0, atol=0)
