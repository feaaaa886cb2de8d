"""Typed values read from a frozen configuration, once per configuration object.

A run's configuration is frozen (:func:`fl_app.config.freeze`: resolved and read-only) before
anything reads it, so what is read from it (:class:`fl_app.run_settings.RunSettings`, a strategy's
:class:`strategies.settings.StrategySettings`) is a pure function of the object. Reading goes
through OmegaConf's node machinery (about 1 ms for the run's settings); a strategy reads them in
its check and again in its constructor, and an audit builds thousands of strategies from one
configuration. :func:`read_once` keeps the value beside the object while the object lives; a
configuration that is not read-only is read every time (it may still change).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable
from typing import TypeVar

from omegaconf import DictConfig, OmegaConf

T = TypeVar("T")

_READ: dict[tuple[int, Hashable], tuple[weakref.ref[DictConfig], object]] = {}
_LOCK = threading.Lock()


def read_once(cfg: DictConfig, what: Hashable, read: Callable[[DictConfig], T]) -> T:
    """``read(cfg)``, computed once per read-only ``cfg`` object and ``what`` (a key naming the reader).

    Parameters
    ----------
    cfg : DictConfig
        The configuration; only a read-only one (``OmegaConf.is_readonly``) is remembered.
    what : Hashable
        What is read (e.g. the settings class): one value per ``(cfg, what)``.
    read : Callable[[DictConfig], T]
        The reader; an exception it raises is raised again on every call (nothing is kept).

    Returns
    -------
    T
        The value, the same object on every call for the same live ``cfg`` and ``what``.

    """
    if not OmegaConf.is_readonly(cfg):
        return read(cfg)
    slot = (id(cfg), what)
    with _LOCK:
        kept = _READ.get(slot)
    if kept is not None and kept[0]() is cfg:
        return kept[1]  # type: ignore[return-value]
    value = read(cfg)

    def forget(_: weakref.ref[DictConfig], slot: tuple[int, Hashable] = slot) -> None:
        with _LOCK:
            _READ.pop(slot, None)

    with _LOCK:
        _READ[slot] = (weakref.ref(cfg, forget), value)
    return value
