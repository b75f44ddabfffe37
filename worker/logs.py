"""structlog setup shared by the long-running commands: readable console lines or one JSON object per line.

Logs go to stderr so that a command's stdout stays its output (results, tables). The JSON format is what
log shippers and the end-to-end tests read; every event has `event`, `level` and `timestamp`.
"""

from __future__ import annotations

import logging
import sys
from typing import TextIO

import structlog

from worker.config import LogSettings


def configure_logging(settings: LogSettings, stream: TextIO | None = None) -> None:
    """Route structlog events at or above the set level to `stream` (default stderr)."""
    level = logging.getLevelName(settings.level.upper())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if settings.format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(stream) if stream else _CurrentStderrLogger,
        cache_logger_on_first_use=False,
    )


class _CurrentStderrLogger:
    """Writes to whatever `sys.stderr` is at each call, not the one seen at configuration time: test runners
    and the demo swap stderr, and a logger bound to a closed stream would fail every later log call."""

    def __init__(self, *_args: object) -> None:
        pass

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


class _ToStructlog(logging.Handler):
    """Forwards stdlib records (librdkafka's, via confluent-kafka's `logger` option) to structlog."""

    def emit(self, record: logging.LogRecord) -> None:
        structlog.get_logger(record.name).log(record.levelno, "librdkafka", message=record.getMessage())


def librdkafka_logger() -> logging.Logger:
    """A logger for the `logger` client option, so librdkafka's lines come out in the configured format
    instead of raw ``%4|...`` lines on stderr."""
    logger = logging.getLogger("librdkafka")
    if not any(isinstance(handler, _ToStructlog) for handler in logger.handlers):
        logger.addHandler(_ToStructlog())
        logger.propagate = False
        logger.setLevel(logging.DEBUG)
    return logger
