"""What the console and ``run.log`` show: one line per failing client, and what a published log withholds.

Flower logs through its own logger (``flwr``) with its own console handler; a run adds a file handler
for ``run.log`` in its output directory (:func:`run_log_handler`). ``run.log`` sits beside the results
and is published with them, so it must not hold what the results withhold: with a secret cohort
(amplification by sampling), each round's duration and every line about a failed client would tell
model observers about the cohort. Such a record carries :data:`FILE_TEXT` in its ``extra``: the text
``run.log`` gets instead (an empty string: nothing). The console (the operator, who draws the cohort)
shows the full line.

Clock times are cohort-dependent too: the stamps of two round lines give the round's duration, which
follows the secret cohort's size. Once the run knows its cohort is secret
(:attr:`PublishedLogFilter.secret_cohort`), ``run.log``'s lines carry no clock time
(:data:`UNSTAMPED`); one line says so.
"""

from __future__ import annotations

import logging
from pathlib import Path

#: ``extra`` key of a log record: the text ``run.log`` gets instead of the console's ("" for none).
FILE_TEXT = "dpfl_file_text"
#: ``extra`` key of a log record meant for ``run.log`` only (the console drops it).
FILE_ONLY = "dpfl_file_only"
#: ``run.log``'s line format: with the clock time, and without it (a secret cohort's run).
STAMPED = "%(asctime)s %(levelname)s %(message)s"
UNSTAMPED = "%(levelname)s %(message)s"
#: The line ``run.log`` gets where its clock times stop.
NO_CLOCK_TIMES = (
    "dpfl: run.log carries no clock times from here on: the cohorts are secret, and a round's duration "
    "follows its cohort's size (the console shows them)"
)


def withheld_from_file(text: str | None = "") -> dict[str, str | None]:
    """``extra=`` of a record whose ``run.log`` line is ``text`` (default: no line in ``run.log``)."""
    return {FILE_TEXT: text}


class RunLogFormatter(logging.Formatter):
    """``run.log``'s format; a record carrying :data:`FILE_TEXT` is written with that text instead."""

    def __init__(self) -> None:
        super().__init__(STAMPED)

    def stop_stamping(self) -> None:
        """Format every later line without its clock time."""
        self._style._fmt = self._fmt = UNSTAMPED

    def format(self, record: logging.LogRecord) -> str:
        """The record's line, with its file text when it has one (the record itself is not changed)."""
        text = getattr(record, FILE_TEXT, None)
        if text is None:
            return super().format(record)
        copy = logging.makeLogRecord(record.__dict__)
        copy.msg, copy.args = text, ()
        return super().format(copy)


class PublishedLogFilter(logging.Filter):
    """Drops from ``run.log`` the records withheld from it (:data:`FILE_TEXT` empty).

    With :attr:`secret_cohort` set, also the errors Flower's engine logs for a failing client (their
    number and timing follow the secret cohort), and every later line loses its clock time.
    """

    def __init__(self, formatter: RunLogFormatter | None = None) -> None:
        super().__init__()
        self.formatter = formatter
        self._secret_cohort = False

    @property
    def secret_cohort(self) -> bool:
        """Whether the run's cohorts are secret (then ``run.log`` withholds what depends on them)."""
        return self._secret_cohort

    @secret_cohort.setter
    def secret_cohort(self, secret: bool) -> None:
        if secret and not self._secret_cohort and self.formatter is not None:
            logging.getLogger("flwr").info(NO_CLOCK_TIMES, extra={FILE_ONLY: True})
            self.formatter.stop_stamping()
        self._secret_cohort = secret

    def filter(self, record: logging.LogRecord) -> bool:
        """Whether ``record`` goes to ``run.log``."""
        if getattr(record, FILE_TEXT, None) == "":
            return False
        return not (self.secret_cohort and record.levelno >= logging.ERROR and not _from_dpfl(record))


#: The directories of dpfl's own packages (records logged from elsewhere are Flower's or Ray's).
_DPFL_ROOTS = tuple(
    str(Path(__file__).resolve().parents[2] / name) for name in ("fl_app", "strategies", "clients")
)
#: dpfl's seam to Flower's engine, which logs a failing client's error and traceback on Flower's behalf.
_ENGINE = str(Path(__file__).resolve().parents[1] / "engine")


def _from_dpfl(record: logging.LogRecord) -> bool:
    """Whether the record was logged by dpfl's own code (not by Flower's or Ray's, nor for them)."""
    path = str(Path(record.pathname).resolve())
    return path.startswith(_DPFL_ROOTS) and not path.startswith(_ENGINE)


def run_log_handler(path: Path) -> tuple[logging.FileHandler, PublishedLogFilter]:
    """The ``run.log`` handler and its filter (set ``secret_cohort`` once the strategy is known)."""
    handler = logging.FileHandler(path)
    formatter = RunLogFormatter()
    handler.setFormatter(formatter)
    published = PublishedLogFilter(formatter)
    handler.addFilter(published)
    return handler, published


def one_line_console(record: logging.LogRecord) -> bool:
    """Console filter: a failing client is one line (Flower logs its exception and traceback).

    Tracebacks are dropped from the console and multi-line errors cut to their first line;
    ``run.log`` keeps everything it may publish.
    """
    if getattr(record, FILE_ONLY, False):
        return False
    if record.levelno >= logging.ERROR:
        text = record.getMessage()
        if text.startswith("Traceback (most recent call last)"):
            return False
        if "\n" in text.strip():
            record.msg, record.args = text.strip().splitlines()[0], ()
    return True
