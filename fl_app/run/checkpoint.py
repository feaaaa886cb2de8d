"""Checkpoints after every round, and ``resume=<output dir>``.

After each completed round the server writes ``private_server_state.pkl`` into the output
directory, atomically (a temporary file, then a rename) and readable by its owner only (mode
0600): the round number, the global model, the strategy object without what only lives within a
round (its accountant, schedules, momentum, buffers: everything it carries from round to round;
:meth:`strategies.base.FederatedStrategy.for_checkpoint` drops the cohorts, replies and un-noised
statistics of finished rounds), the results so far, the process RNG states, and the overrides the
run was composed from. Every per-round generator of dpfl is derived from (seed, purpose, round), so
the next round draws exactly what it would have drawn without the interruption.

The strategy is pickled without the run's context: the configuration, the data,
the random sources and every :class:`~fl_app.run.roster.ClientInfo` are stored as
references (:meth:`pickle.Pickler.persistent_id`) and re-bound to the resumed
run's (node ids change between simulations; client ids do not).

The file is the server's *private* state, named for it: some strategies must carry un-noised
aggregates to continue exactly (DP-FTRL: the running sum of the current tree's clipped updates;
the strategy is stored as :meth:`~strategies.base.FederatedStrategy.for_checkpoint` returns it). It is not a
result to publish: the report, tensorboard and the benchmark exports read named result files only,
the interrupt line says what it holds, and it is removed when a private run completes (such a run
cannot be extended: see :func:`fl_app.run.resume.validate_resume`). A run of an earlier version wrote
``checkpoint.pkl`` (:data:`LEGACY_FILE`), which is still read.

A run pickles each round's checkpoint when the round ends and writes it (with ``fsync``) on a
background thread while the next round runs (:class:`CheckpointWriter`): one write at a time, each
round's after the previous one's. A process killed during a write keeps the previous round's
checkpoint; a failed write (a full disk) ends the run at the next round's checkpoint or at the end.
A run whose cohorts are secret writes it into a spare created before round 1, exchanged with the
file (:class:`~fl_app.run.files.UndatedFiles`): no file of such a run is born while its rounds run.
"""

from __future__ import annotations

import io
import pickle
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from flwr.app import Array, ArrayRecord

from fl_app.data.text_vocabulary import CHOICE_KEY
from fl_app.run.context import RunContext
from fl_app.run.files import UndatedFiles, WriteFailed, write_atomically, write_failed
from fl_app.run.roster import ClientInfo

CHECKPOINT_FILE = "private_server_state.pkl"
#: The name earlier versions wrote (read when :data:`CHECKPOINT_FILE` is absent).
LEGACY_FILE = "checkpoint.pkl"
#: Owner read/write only: the file holds the server's private state.
FILE_MODE = 0o600
FORMAT = 1
#: The checkpoint fields readable without the run (:func:`read_header`).
HEADER_KEYS = ("completed_round", "num_rounds", "overrides", "fingerprint", "status")
#: The header's key naming the plug-in module that holds the strategy (:func:`plugin_of`), if one does.
PLUGIN_KEY = "plugin"


@dataclass
class Checkpoint:
    """What a resumed run needs (see the module docstring)."""

    completed_round: int
    num_rounds: int
    status: str
    overrides: list[str]
    fingerprint: str
    arrays: Any
    strategy: Any
    recorder: dict[str, Any]
    elapsed_s: float
    rng: dict[str, Any] = field(default_factory=dict)
    #: The stateful clients' records (:class:`fl_app.engine.client_states.ClientStates`), None: none kept.
    client_states: Any = None


def _context_members(run: RunContext) -> dict[int, str]:
    members = {"run": run, "settings": run.settings, "data": run.data, "roster": run.roster}
    members.update({"noise": run.noise, "randomness": run.randomness, "model_spec": run.model_spec})
    return {id(value): name for name, value in members.items()}


class _Pickler(pickle.Pickler):
    def __init__(self, stream: io.BytesIO, run: RunContext) -> None:
        super().__init__(stream, protocol=pickle.HIGHEST_PROTOCOL)
        self._members = _context_members(run)

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, Array):  # its data may be a view of a received message
            return (_rebuild_array, (obj.dtype, tuple(obj.shape), obj.stype, bytes(obj.data)))
        if isinstance(obj, ArrayRecord):  # Flower caches serialisation state in it
            return (ArrayRecord, (dict(obj.items()),))
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, ClientInfo):
            return ("client", obj.client_id)
        name = self._members.get(id(obj))
        return None if name is None else ("run", name)


def _rebuild_array(dtype: str, shape: tuple[int, ...], stype: str, data: bytes) -> Array:
    return Array(dtype=dtype, shape=shape, stype=stype, data=data)


class _Unpickler(pickle.Unpickler):
    def __init__(self, stream: io.BytesIO, run: RunContext) -> None:
        super().__init__(stream)
        self._run = run
        self._clients = {info.client_id: info for info in run.roster}

    def persistent_load(self, pid: Any) -> Any:
        kind, name = pid
        if kind == "client":
            return self._clients[int(name)]
        return self._run if name == "run" else getattr(self._run, name)


def rng_states() -> dict[str, Any]:
    """The process-wide torch RNG state (dropout in server-side training), for exact resumption.

    dpfl draws nothing from numpy's or Python's global generators (every draw has its own
    generator, derived per purpose and round), so they need no saving.
    """
    return {"torch": torch.get_rng_state()}


def restore_rng_states(states: dict[str, Any]) -> None:
    """Put back what :func:`rng_states` saved."""
    if "torch" in states:
        torch.set_rng_state(states["torch"])


def save_checkpoint(
    output_dir: Path, checkpoint: Checkpoint, run: RunContext, *, writer: CheckpointWriter | None = None
) -> Path:
    """Write the checkpoint atomically, readable by its owner only; return its path.

    With a ``writer`` the checkpoint is pickled now and written on the writer's thread
    (:meth:`CheckpointWriter.settle` waits for it); without one it is written before this returns.
    When the write fails (a full disk) the previous checkpoint stays and
    :class:`~fl_app.run.files.WriteFailed` ends the run with one line.

    The file holds two pickles: a small header (format, round, overrides, fingerprint) that
    :func:`read_header` reads without touching the rest, then the whole checkpoint.
    """
    header = {"format": FORMAT, **{key: getattr(checkpoint, key) for key in HEADER_KEYS}}
    header[PLUGIN_KEY] = plugin_of(checkpoint.strategy)
    header[CHOICE_KEY] = run.settings.data.dataset.get(CHOICE_KEY)  # a resumed run keeps its vocabulary
    stream = io.BytesIO()
    pickle.dump(header, stream, protocol=pickle.HIGHEST_PROTOCOL)
    content = dict(checkpoint.__dict__)
    keep = getattr(checkpoint.strategy, "for_checkpoint", None)  # without what only lives within a round
    if keep is not None:
        content["strategy"] = keep()
    _Pickler(stream, run).dump(content)
    if writer is None:
        write_checkpoint(output_dir, stream.getvalue())
    else:
        writer.write(output_dir, stream.getvalue())
    return output_dir / CHECKPOINT_FILE


def write_checkpoint(output_dir: Path, data: bytes, files: UndatedFiles | None = None) -> None:
    """Write a pickled checkpoint atomically with ``fsync`` (a full disk: ``WriteFailed``).

    ``files``: the run's files, when they are created before round 1 (a secret cohort's run).
    """
    if files is not None and files.active:
        files.rewrite(output_dir / CHECKPOINT_FILE, data, mode=FILE_MODE, sync=True)
    else:
        write_atomically(output_dir / CHECKPOINT_FILE, data, mode=FILE_MODE, sync=True)
    (output_dir / LEGACY_FILE).unlink(missing_ok=True)  # a resumed run of an earlier version


class CheckpointWriter:
    """Writes a run's checkpoints on a background thread, one at a time and in order.

    :meth:`write` first waits for the write before it (and raises its failure), so a round's
    checkpoint is written while the next round runs and never overtakes the previous one.
    """

    def __init__(self, files: UndatedFiles | None = None) -> None:
        #: The run's files (a secret cohort's: the checkpoint's spares were made before round 1).
        self.files = files
        self._thread: threading.Thread | None = None
        self._failure: Exception | None = None

    def write(self, output_dir: Path, data: bytes) -> None:
        """Start writing ``data`` as ``output_dir``'s checkpoint, once the previous write is done."""
        self.settle()
        self._thread = threading.Thread(
            target=self._write, args=(output_dir, data), name="dpfl-checkpoint", daemon=False
        )
        self._thread.start()

    def settle(self) -> None:
        """Wait for the write in flight; raise its failure (``WriteFailed``: a full disk)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def _write(self, output_dir: Path, data: bytes) -> None:
        try:
            write_checkpoint(output_dir, data, self.files)
        except WriteFailed as failure:  # a full disk: raised by the next settle
            self._failure = failure
        except OSError as error:  # the earlier version's file could not be removed
            self._failure = write_failed(output_dir / LEGACY_FILE, error)
        except Exception as error:  # a bug: raised where the run waits for the write, not lost here
            self._failure = error


def state_path(output_dir: Path) -> Path:
    """The checkpoint file of ``output_dir``: :data:`CHECKPOINT_FILE`, or an earlier version's."""
    path = output_dir / CHECKPOINT_FILE
    legacy = output_dir / LEGACY_FILE
    return legacy if not path.exists() and legacy.exists() else path


def read_header(output_dir: Path) -> dict[str, Any]:
    """The checkpoint's plain fields (:data:`HEADER_KEYS`, the plug-in, the vocabulary), not the strategy.

    Raises
    ------
    FileNotFoundError
        When ``output_dir`` holds no checkpoint.
    ValueError
        When the file is not a dpfl checkpoint of this format.

    """
    path = state_path(output_dir)
    with path.open("rb") as handle:
        try:
            header = pickle.load(handle)
        except Exception as error:  # a truncated or foreign file
            raise ValueError(f"{path} is not a readable dpfl checkpoint ({type(error).__name__})") from error
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"{path} is not a dpfl checkpoint of format {FORMAT}")
    return {key: header[key] for key in HEADER_KEYS} | {
        PLUGIN_KEY: header.get(PLUGIN_KEY),
        CHOICE_KEY: header.get(CHOICE_KEY),
    }


def plugin_of(strategy: Any) -> dict[str, Any] | None:
    """The plug-in module that holds ``strategy``'s class, and every module ``DPFL_PLUGINS`` named.

    None for a strategy of the app's own packages that no plug-in module holds. A resumed run needs
    the module again (:func:`fl_app.run.resume.expand_resume` says so when it is missing).
    """
    from fl_app.config.registry import PLUGIN_PACKAGES, plugin_modules

    inner = getattr(strategy, "inner", strategy)  # an evaluation stage's training strategy
    module, loaded = type(inner).__module__, plugin_modules()
    named = any(module == name or module.startswith(f"{name}.") for name in loaded)
    if not named and module.split(".")[0] in PLUGIN_PACKAGES:
        return None
    declaration = getattr(inner, "declaration", None)
    return {"strategy": getattr(declaration, "name", None), "module": module, "modules": loaded}


def load_checkpoint(output_dir: Path, run: RunContext) -> Checkpoint:
    """Read the checkpoint and bind its strategy to ``run``."""
    stream = io.BytesIO(state_path(output_dir).read_bytes())
    pickle.load(stream)  # the header
    return Checkpoint(**_Unpickler(stream, run).load())


def remove_checkpoint(output_dir: Path) -> None:
    """Delete the checkpoint of a completed run (its writer settled: no write of it in flight)."""
    (output_dir / CHECKPOINT_FILE).unlink(missing_ok=True)
    (output_dir / LEGACY_FILE).unlink(missing_ok=True)
