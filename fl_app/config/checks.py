"""Configuration errors and the checks that raise them: one line naming the key, the value, what is allowed.

The bottom of the configuration layer: every module that checks a value (the validation of a whole
configuration, the strategies' typed settings, resume) raises :class:`ConfigError` from here, and
this module imports nothing of the project.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A configuration value is not allowed (message: ``key=value: what is allowed``)."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={value!r}: {allowed}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def require_int(key: str, value: Any, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """An integer (not a bool or float) within bounds."""
    bounds = _bounds_text(minimum, maximum)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(key, value, f"must be an integer{bounds}")
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ConfigError(key, value, f"must be an integer{bounds}")
    return value


def require_positive(key: str, value: Any) -> float:
    """A finite number > 0."""
    if not _is_number(value) or value <= 0:
        raise ConfigError(key, value, "must be a number > 0")
    return float(value)


def require_range(
    key: str, value: Any, low: float, high: float, *, low_open: bool = False, high_open: bool = False
) -> float:
    """A finite number in an interval."""
    text = f"must be a number in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if not _is_number(value):
        raise ConfigError(key, value, text)
    if (value < low or (low_open and value == low)) or (value > high or (high_open and value == high)):
        raise ConfigError(key, value, text)
    return float(value)


def require_choice(key: str, value: Any, allowed: Iterable[str]) -> str:
    """One of a fixed set of names."""
    options = list(allowed)
    if value not in options:
        raise ConfigError(key, value, f"must be one of {', '.join(options)}")
    return str(value)


def require_bool(key: str, value: Any) -> bool:
    """True or false."""
    if not isinstance(value, bool):
        raise ConfigError(key, value, "must be true or false")
    return value


def _bounds_text(minimum: int | None, maximum: int | None) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


def require_text(key: str, value: object, what: str) -> str:
    """A non-empty one-line string."""
    if not isinstance(value, str) or not value.strip() or "\n" in value:
        raise ConfigError(key, value, f"must be {what}")
    return value


def validate_split_keys(dataset: Any) -> None:
    """A hub-style data set's ``split``, ``test_split`` (null or a name) and ``test_fraction`` in (0, 1)."""
    require_text("dataset.split", dataset.get("split"), "the training split's name")
    if dataset.get("test_split") is not None:
        require_text("dataset.test_split", dataset.test_split, "null or the test split's name")
    require_range(
        "dataset.test_fraction", dataset.get("test_fraction"), 0.0, 1.0, low_open=True, high_open=True
    )
