"""dpfl: differentially private federated learning on Flower.

Importing the package first runs the process set-up (Flower environment
switches and the torchvision operator shim), so any process that imports
``fl_app`` (including Ray workers that unpickle the ClientApp) is ready.
"""

from fl_app import _process_setup  # noqa: F401  (must run before torchvision loads)

__all__: list[str] = []
