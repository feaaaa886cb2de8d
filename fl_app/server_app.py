"""The Flower ServerApp (``fl_app.server_app:app``): wiring to :func:`fl_app.run.server.run_federation`."""

import sys

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fl_app.config.settings import RunSettings
from fl_app.engine import SIMULATION_ENGINE_MODULE
from fl_app.engine.launch import install_engine_patches
from fl_app.engine.logs import one_line_app_failures
from fl_app.run.lifecycle import RunFailed
from fl_app.run.server import run_federation

# Under `flwr run` with a simulation federation, the engine runs in the process that loads this
# module (``flwr-simulation``, which has imported the engine already). A deployment's ServerApp
# process and `flwr run`'s check of the app's references have no engine to patch.
if SIMULATION_ENGINE_MODULE in sys.modules:
    install_engine_patches()

# Under `flwr run` the ServerApp raises RunFailed to make Flower record the run as failed, after it
# logged the reason as one line: Flower's traceback and exit text would bury it.
one_line_app_failures(RunFailed)

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Compose the configuration from the run config and run the configured strategy."""
    run_federation(grid, context)


def server_app_for(settings: RunSettings) -> ServerApp:
    """A ServerApp that runs ``settings``, validated already (``python -m fl_app``'s jobs).

    The settings travel in the object, not in a module global: the local simulation hands this
    ServerApp to Flower's engine, which runs it in the same process.
    """
    validated = ServerApp()

    @validated.main()
    def run_validated(grid: Grid, context: Context) -> None:
        run_federation(grid, context, settings)

    return validated
