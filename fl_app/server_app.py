"""The Flower ServerApp (``fl_app.server_app:app``): thin wiring to :func:`fl_app.run.run_federation`."""

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fl_app.flower_engine import install_engine_patches
from fl_app.run import run_federation

# Under `flwr run` the simulation engine runs in the process that loads this module.
install_engine_patches()

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Compose the configuration from the run config and run the configured strategy."""
    run_federation(grid, context)
