"""Data sets as local arrays, their public/private split and client partitions."""

#: The ``partition.name`` values (:data:`fl_app.data.partition.PARTITIONERS` has one partitioner per
#: name). Listed here so that validating a configuration does not import the partitioners
#: (flwr-datasets, datasets, pandas, scipy, matplotlib: about 2 s of CPU).
PARTITION_SCHEMES: tuple[str, ...] = (
    "iid",
    "dirichlet",
    "equal_size_dirichlet",
    "linear",
    "exponential",
    "two_tier",
    "natural",
)
