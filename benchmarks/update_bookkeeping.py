"""A client's update bookkeeping per message: Flower's ``Array.numpy()`` decodes against reading in place.

``FederatedClient.local_update`` (FedAvg+LDP's and distributed DP's clients) returned ``w_k - w_t``
after encoding the trained model into a reply record and decoding it again, and decoded the
received arrays twice more with Flower's ``Array.numpy()`` (it parses the ``.npy`` header in Python
and copies the data); NbAFL's client encoded and decoded its trained model the same way. Now the
received arrays are read in place (``fl_app.learning.training.array_values``) and the trained ones straight
from the model. This times both bodies around the same model load on the MLP of Fashion-MNIST
(0.44 MB), one torch thread, interleaved, after checking that they return the same arrays:

    python -P benchmarks/update_bookkeeping.py [--repeats 3] [--number 1000]
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fl_app.learning.models import MLP
from fl_app.learning.training import array_values, load_arrays, model_state, model_to_arrays


def main() -> int:
    """Print the microseconds per message of the old and the new bookkeeping."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--number", type=int, default=1000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = MLP((1, 28, 28), 10)
    received = model_to_arrays(model)
    names = list(received.keys())

    def before() -> list[np.ndarray]:
        for name in names:
            np.issubdtype(received[name].numpy().dtype, np.floating)
        load_arrays(model, received)
        trained = model_to_arrays(model)
        return [trained[n].numpy().astype(np.float64) - received[n].numpy().astype(np.float64) for n in names]

    def after() -> list[np.ndarray]:
        start = {name: array_values(received[name]) for name in names}
        for name in names:
            np.issubdtype(start[name].dtype, np.floating)
        load_arrays(model, received)
        trained = model_state(model)
        return [trained[n].astype(np.float64) - start[n].astype(np.float64) for n in names]

    assert all(np.array_equal(a, b) for a, b in zip(before(), after(), strict=True))
    for repeat in range(args.repeats):
        old = timeit.timeit(before, number=args.number) / args.number * 1e6
        new = timeit.timeit(after, number=args.number) / args.number * 1e6
        print(f"repeat {repeat + 1}: before {old:.0f} us per message, after {new:.0f} us ({old / new:.1f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
