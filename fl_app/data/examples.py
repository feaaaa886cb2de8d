"""What a client holds, and which data sets are text: the leaf the data modules share.

:mod:`fl_app.data.federated` (images, any split) and :mod:`fl_app.data.text` (token arrays
read by user offset) both hand clients a :class:`ClientDataset`; neither imports the other
for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: The text data sets (:mod:`fl_app.data.text`).
TEXT_DATASETS: tuple[str, ...] = ("shakespeare", "stackoverflow")
#: Each text data set's user column when ``partition.column`` is null.
DEFAULT_USER_COLUMNS = {"shakespeare": "character_id", "stackoverflow": "client_id"}


@dataclass(frozen=True)
class ClientDataset:
    """One client's examples: inputs ``x`` and targets ``y`` (labels, or next tokens)."""

    x: np.ndarray
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.y)


def concatenated_ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``arange(starts[0], starts[0] + sizes[0])``, then the next range, ..., as one ``int64`` array.

    Built in one pass (no array per range): the rows of many clients stored as ranges of one array.
    """
    starts, sizes = np.asarray(starts, dtype=np.int64), np.asarray(sizes, dtype=np.int64)
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if len(ends) else 0
    return np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - sizes), sizes)
