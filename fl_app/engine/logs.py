"""Flower's console handler (``flwr.common.logger.console_handler``, flwr 1.41).

Flower logs through its logger ``flwr`` with a console handler of its own; a run filters what that
handler prints (one line per failing client) while it runs.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

from flwr.common.logger import console_handler


@contextlib.contextmanager
def console_filter(keep: Callable[[logging.LogRecord], bool]) -> Iterator[None]:
    """Inside: Flower's console handler prints only the records ``keep`` accepts (it may shorten them)."""
    console_handler.addFilter(keep)
    try:
        yield
    finally:
        console_handler.removeFilter(keep)


def colour_only_at_a_terminal() -> None:
    r"""Flower's console lines carry ANSI colour codes only when stderr is a terminal.

    Flower colours its level names unconditionally; redirected to a file or a pipe (CI logs,
    ``> run.txt``) they read as ``\x1b[92mINFO \x1b[0m``.
    """
    stream = getattr(console_handler, "stream", None)
    console_handler.colored = bool(stream is not None and hasattr(stream, "isatty") and stream.isatty())
