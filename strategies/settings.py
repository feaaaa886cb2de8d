"""Typed strategy settings: the ``strategy`` config group, read and checked once, by declaration.

Each strategy declares its settings as a frozen dataclass beside its class (as Meta's FLSim puts a
typed config beside each algorithm), one field per key of its ``conf/strategy/<name>.yaml``, each
with the check that key must pass::

    @dataclass(frozen=True)
    class DPFTRLSettings(StrategySettings):
        clip: float = positive()
        noise_multiplier: float | None = positive(optional=True)
        restart: str = one_of(RESTARTS)

:meth:`StrategySettings.from_config` reads every field from ``cfg.strategy``, runs its check
(which raises :class:`fl_app.config.validation.ConfigError` naming the key, the value and what is
allowed) and then :meth:`StrategySettings.check` for constraints between keys and with the run's
typed settings. Validation reads them once (:func:`fl_app.config.validation.typed_settings`) into
:attr:`fl_app.config.settings.RunSettings.strategy_settings`, which the strategy is built with, so a
setting is checked in one place and the strategy reads typed values (no ``float(cfg.strategy.x)``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Self

from omegaconf import DictConfig, ListConfig, OmegaConf

from fl_app.config.checks import (
    ConfigError,
    require_bool,
    require_choice,
    require_int,
    require_positive,
    require_range,
)
from fl_app.config.settings import RunSettings

#: The metadata key of a field's check: ``check(key, value) -> value``.
CHECK = "check"

Check = Callable[[str, Any], Any]


def setting(check: Check, *, optional: bool = False, default: Any = MISSING) -> Any:
    """A settings field whose value must pass ``check`` (``None`` also passes when ``optional``).

    ``default``: the value when the config lacks the key (a run configured before it existed).
    """

    def run(key: str, value: Any) -> Any:
        return None if optional and value is None else check(key, value)

    return field(default=default, metadata={CHECK: run})


def positive(*, optional: bool = False, default: Any = MISSING) -> Any:
    """A number > 0."""
    return setting(require_positive, optional=optional, default=default)


def non_negative(*, optional: bool = False) -> Any:
    """A finite number >= 0."""

    def check(key: str, value: Any) -> float:
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or value < 0
        ):
            raise ConfigError(
                key, value, "must be null or a number >= 0" if optional else "must be a number >= 0"
            )
        return float(value)

    return setting(check, optional=optional)


def between(
    low: float,
    high: float,
    *,
    low_open: bool = False,
    high_open: bool = False,
    optional: bool = False,
    default: Any = MISSING,
) -> Any:
    """A number in ``[low, high]`` (``low_open``/``high_open``: the end excluded)."""
    return setting(
        lambda key, value: require_range(key, value, low, high, low_open=low_open, high_open=high_open),
        optional=optional,
        default=default,
    )


def integer(*, minimum: int | None = None, maximum: int | None = None, optional: bool = False) -> Any:
    """An integer within optional bounds."""
    return setting(
        lambda key, value: require_int(key, value, minimum=minimum, maximum=maximum), optional=optional
    )


def one_of(options: Iterable[str], *, optional: bool = False, default: Any = MISSING) -> Any:
    """One of a fixed set of names."""
    allowed = tuple(options)
    return setting(lambda key, value: require_choice(key, value, allowed), optional=optional, default=default)


def names(options: Iterable[str]) -> Any:
    """One of ``options`` or a non-empty list of them (read as a tuple)."""
    allowed = tuple(options)

    def check(key: str, value: Any) -> tuple[str, ...]:
        chosen = (value,) if isinstance(value, str) else value
        if not isinstance(chosen, list | tuple) or not chosen:
            raise ConfigError(key, value, f"must name one or more of {', '.join(allowed)}")
        return tuple(require_choice(key, name, allowed) for name in chosen)

    return setting(check)


def flag(*, optional: bool = False) -> Any:
    """True or false."""
    return setting(require_bool, optional=optional)


def anything() -> Any:
    """A value checked only by :meth:`StrategySettings.check` (lists, names checked against the run)."""
    return setting(lambda key, value: value)


@dataclass(frozen=True)
class StrategySettings:
    """The base of every strategy's settings (see the module docstring)."""

    #: The config group the settings are read from.
    section: ClassVar[str] = "strategy"
    #: The ``privacy.budget_scope`` values supported (``total`` alone when calibrated for the whole
    #: run; None: not checked here).
    budget_scopes: ClassVar[tuple[str, ...] | None] = ("total", "per_round")

    @classmethod
    def from_config(cls, cfg: DictConfig, run: RunSettings | None = None) -> Self:
        """Read and check ``cfg.<section>`` (raises :class:`ConfigError`; undeclared keys are not read).

        Called once, by validation (:func:`fl_app.config.validation.typed_settings`); :meth:`check` then sees
        the run's typed settings ``run`` (read from ``cfg`` when not given).
        """
        if cls.budget_scopes is not None:
            require_choice("privacy.budget_scope", cfg.privacy.budget_scope, cls.budget_scopes)
        section = cfg[cls.section]
        values: dict[str, Any] = {}
        for item in fields(cls):
            key = f"{cls.section}.{item.name}"
            if item.name not in section:
                if item.default is MISSING and item.default_factory is MISSING:
                    raise ConfigError(key, None, cls.missing_text(str(cfg.strategy.get("name"))))
                values[item.name] = item.default if item.default is not MISSING else item.default_factory()
                continue
            value = section[item.name]
            if isinstance(value, DictConfig | ListConfig):
                value = OmegaConf.to_container(value, resolve=True)
            values[item.name] = item.metadata[CHECK](key, value) if CHECK in item.metadata else value
        settings = cls(**values)
        if run is None and type(settings).check is not StrategySettings.check:
            run = RunSettings.from_config(cfg)  # the run's typed settings, for checks across keys
        settings.check(run)  # type: ignore[arg-type]
        return settings

    @classmethod
    def missing_text(cls, strategy: str) -> str:
        """What to say about a key the config lacks (override; ``strategy``: the run's algorithm)."""
        return f"missing: a key strategy={strategy} requires"

    def check(self, run: RunSettings) -> None:
        """Constraints between settings or with the rest of the run (override; raise :class:`ConfigError`)."""
