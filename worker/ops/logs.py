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
        logger_factory=structlog.PrintLoggerFactory(stream or sys.stderr),
        cache_logger_on_first_use=False,
    )
