"""Flower's console handler (``flwr.common.logger.console_handler``, flwr 1.41) and its logger.

Flower logs through its logger ``flwr`` with a console handler of its own; a run filters what that
handler prints (one line per failing client) while it runs. Under ``flwr run`` a ServerApp that
raises gets Flower's traceback and a four-line exit message (:func:`one_line_app_failures`).
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


class OneLineAppFailures(logging.Filter):
    """Drops Flower's traceback of an exception of ``kinds`` and keeps the first line of the exit message.

    ``flwr-simulation`` (and a deployment's ``flwr-serverapp``) log an exception the ServerApp raised
    with its traceback ("Simulation raised an exception"), then ``flwr_exit``'s message ("Exit Code:
    700", a blank line, a help text, a link). The app already logged the reason as one line.
    """

    def __init__(self, kinds: tuple[type[BaseException], ...]) -> None:
        super().__init__()
        self.kinds = kinds
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether ``record`` is logged (an exit message after a dropped failure: its first line only)."""
        if record.exc_info and isinstance(record.exc_info[1], self.kinds):
            self.seen = True
            return False
        text = record.getMessage()
        if self.seen and text.startswith("Exit Code:"):
            record.msg, record.args = f"{text.splitlines()[0]} (the ServerApp failed: see the line above)", ()
        return True


def one_line_app_failures(*kinds: type[BaseException]) -> None:
    """Flower logs a ServerApp's exception of ``kinds`` in this process as one line (idempotent)."""
    logger = logging.getLogger("flwr")
    if not any(isinstance(f, OneLineAppFailures) for f in logger.filters):
        logger.addFilter(OneLineAppFailures(kinds))
