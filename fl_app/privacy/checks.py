"""Argument checks shared by the privacy modules (one message style, ``ValueError``)."""

from __future__ import annotations

import math
from numbers import Real


def require_positive(name: str, value: float) -> None:
    """``value`` is a finite number > 0."""
    if not (isinstance(value, Real) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def require_non_negative(name: str, value: float) -> None:
    """``value`` is a finite number >= 0."""
    if not (isinstance(value, Real) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def require_probability(name: str, value: float) -> None:
    """``value`` is in the open interval (0, 1) (a delta)."""
    if not (isinstance(value, Real) and 0 < value < 1):
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")


def require_positive_int(name: str, value: int) -> None:
    """``value`` is an integer >= 1 (a bool is not)."""
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
