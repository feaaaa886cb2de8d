"""The Flower ServerApp (``fl_app.server_app:app``): thin wiring to :func:`fl_app.run.run_federation`."""

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fl_app.run import run_federation

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Compose the configuration from the run config and run the configured strategy."""
    run_federation(grid, context)
