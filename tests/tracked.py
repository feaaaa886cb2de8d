"""What a run's trackers stored, read back through each tracker's own API or schema (for the tests).

* MLflow: its client (``MlflowClient``) on the run's store, the run named in ``mlflow_run.json``.
* W&B: the offline run's ``run-<id>.wandb`` file, a LevelDB-style log of W&B's own protobuf records
  (``wandb.proto.wandb_internal_pb2.Record``); wandb 0.30 has no Python reader of its own (its Go core
  reads them), so the log's framing is read here: a 7-byte header (``:W&B``, magic, version), then
  32 KiB blocks of chunks, each a 4-byte checksum, a 2-byte length and a 1-byte type (1 whole,
  2 first, 3 middle, 4 last).
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK, CHUNK_HEADER = 32768, 7


def offline_wandb(monkeypatch: Any, home: Path) -> None:
    """W&B offline, silent, its caches and settings under ``home`` (never the user's, never the network)."""
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_CACHE_DIR": str(home / "cache"),
        "WANDB_CONFIG_DIR": str(home / "config"),
        "WANDB_DATA_DIR": str(home / "data"),
    }.items():
        monkeypatch.setenv(name, value)


def wandb_records(path: Path) -> Iterator[Any]:
    """The protobuf records of a W&B run file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    position, pending = CHUNK_HEADER, b""
    while position + CHUNK_HEADER <= len(data):
        left = BLOCK - position % BLOCK
        if left < CHUNK_HEADER:  # a block's tail too short for a chunk is padding
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + CHUNK_HEADER])
        pending += data[position + CHUNK_HEADER : position + CHUNK_HEADER + length]
        position += CHUNK_HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_run(output_dir: Path) -> dict[str, Any]:
    """The offline W&B run in ``output_dir``: its config, history rows, summary and the files it keeps."""
    (folder,) = sorted((output_dir / "wandb").glob("offline-run-*"))
    (log,) = folder.glob("run-*.wandb")
    config: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    start = None
    for record in wandb_records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            config |= {item.key: json.loads(item.value_json) for item in record.run.config.update}
            start = record.run.start_time.seconds
        elif kind == "config":
            config |= {item.key: json.loads(item.value_json) for item in record.config.update}
        elif kind == "history":
            row = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            history.append(row)
        elif kind == "summary":
            summary |= {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.summary.update
            }
    files = sorted(str(p.relative_to(folder / "files")) for p in (folder / "files").rglob("*") if p.is_file())
    return {"config": config, "history": history, "summary": summary, "files": files, "start": start}


def mlflow_run(output_dir: Path) -> dict[str, Any]:
    """The MLflow run of ``output_dir``: parameters, metrics ``(step, value, timestamp)``, tags, artifacts."""
    import warnings

    from mlflow.tracking import MlflowClient

    kept = json.loads((output_dir / "mlflow_run.json").read_text())
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        client = MlflowClient(tracking_uri=kept["tracking_uri"])
        run = client.get_run(kept["run_id"])
        histories = {
            key: [(m.step, m.value, m.timestamp) for m in client.get_metric_history(run.info.run_id, key)]
            for key in run.data.metrics
        }
        artifacts = sorted(a.path for a in client.list_artifacts(run.info.run_id))
    return {
        "info": run.info,
        "params": dict(run.data.params),
        "metrics": histories,
        "tags": {k: v for k, v in run.data.tags.items() if not k.startswith("mlflow.")},
        "artifacts": artifacts,
    }


def mlflow_store(tmp_path_factory: Any, directory: Path) -> str:
    """A new, empty MLflow SQLite store in ``directory``; its URI.

    MLflow takes 5-10 s to create a store's tables (its schema migrations): they are made once per test
    process in a template, which each test copies.
    """
    import shutil
    import warnings

    from mlflow.tracking import MlflowClient

    template = Path(tmp_path_factory.getbasetemp()) / "mlflow-template.db"
    if not template.exists():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            MlflowClient(tracking_uri=f"sqlite:///{template}").search_experiments()
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(template, directory / "mlflow.db")
    return f"sqlite:///{directory / 'mlflow.db'}"
