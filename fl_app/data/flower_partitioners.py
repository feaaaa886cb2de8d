"""flwr-datasets' partitioners, imported without the package's plotting and metrics modules.

Those load on first use (:mod:`fl_app.data.lazy_import`): importing :mod:`fl_app.data.partition`
costs 2.9-3.5 s of CPU instead of 4.7-5.7 s on the 2-core machine (docs/benchmarks/startup.md).
"""

from fl_app.data.lazy_import import defer_submodules

defer_submodules("flwr_datasets", ("visualization", "metrics"))

from flwr_datasets.partitioner import (  # noqa: E402 - after the deferral, which must come first
    DirichletPartitioner,
    ExponentialPartitioner,
    IidPartitioner,
    LinearPartitioner,
    Partitioner,
)

__all__ = [
    "DirichletPartitioner",
    "ExponentialPartitioner",
    "IidPartitioner",
    "LinearPartitioner",
    "Partitioner",
]
