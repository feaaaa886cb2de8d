"""The one seam to Flower's and Hydra's private APIs (flwr 1.41.0, hydra-core 1.3.8).

Everything dpfl needs from Flower or Hydra that is not public API lives in this package, split by
mechanism, so an upgrade touches these modules and ``tests/test_flower_engine.py`` /
``tests/test_config.py`` (which pin the versions) say what broke; ``tests/test_repository.py``
checks that no module outside it imports a private name. Each patch says which Flower behaviour it
replaces and why:

* :mod:`~fl_app.engine.dispatch`: the simulation engine's message dispatcher and reply store
  (one walk over the stored messages instead of one per node; adaptive polling; push/store signals);
* :mod:`~fl_app.engine.batching`: the engine's worker threads and actor (several messages per Ray task);
* :mod:`~fl_app.engine.pool`: the Ray backend's actor pool (each actor holds two messages; a
  by-reference ClientApp loader);
* :mod:`~fl_app.engine.launch`: running the engine in this process (``_run_simulation``, Ray started
  first, the actor count capped);
* :mod:`~fl_app.engine.inline`: a backend that runs the clients in this process instead of on Ray's
  actors (``simulation.backend=inline``);
* :mod:`~fl_app.engine.processes`: a backend that runs them in worker processes forked from this one
  (``simulation.backend=processes``);
* :mod:`~fl_app.engine.messages`: message sizes, reply ids and senders, the task identity;
* :mod:`~fl_app.engine.logs`: Flower's console handler;
* :mod:`~fl_app.engine.tooling`: the ``flwr`` CLI's FAB builder and config file;
* :mod:`~fl_app.engine.secagg`: SecAgg+'s client mod, with masks from the whole agreed key, and the
  primitives the server's side of the protocol needs;
* :mod:`~fl_app.engine.hydra`: Hydra's global state and its basic sweeper's job split.

One patch lives outside this package: ``dpfl_env.py`` (imported by the environment's ``.pth`` at the
start of every interpreter) serialises ``flwr.cli.install.validate_and_install`` with a file lock,
because Flower's own ``flwr-serverapp`` and ``flwr-clientapp`` processes install the run's FAB before
any dpfl code loads, and two of them installing one FAB at once race (a half-copied app folder).

The engine patches run in the process that runs the simulation engine: the driver of
``python -m fl_app`` and the ``flwr-simulation`` process of ``flwr run`` (the ServerApp module
installs them; the engine starts its dispatcher only after Ray is up, seconds later).
"""

from __future__ import annotations

#: The Flower release pyproject.toml pins (the private APIs this package uses were written against it).
FLOWER_VERSION = "1.41.0"
#: Releases checked to have the same private APIs: the suite passed on 1.42.0, whose changes
#: (tracing removed, a token count for compacted context) touch no module this package uses.
SUPPORTED_FLOWER_VERSIONS = ("1.41.0", "1.42.0")
#: The simulation engine's module (imported by every process that runs the engine).
SIMULATION_ENGINE_MODULE = "flwr.server.superlink.fleet.vce.vce_api"


def flower_version() -> str:
    """The installed Flower release (imported here: the engine's vectorised trainer needs no Flower)."""
    import flwr

    return str(flwr.__version__)
