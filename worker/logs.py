"""structlog setup shared by the long-running commands: readable console lines or one JSON object per line.

Logs go to stderr so that a command's stdout stays its output (results, tables). The JSON format is what
log shippers and the end-to-end tests read; every event has `event`, `level` and `timestamp`.

librdkafka retries a broker that is away by itself and says so at every attempt, every ~50 ms per client
and broker thread (about 450 lines in 20 s from one worker). Its lines and errors therefore go through a
`Throttle`: one line per cause and `REPEAT_INTERVAL_S`, carrying how many it stands for.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Hashable
from typing import TextIO

import structlog

from worker.privacy.redaction import Redactor
from worker.settings import LogSettings, PrivacySettings


def configure_logging(settings: LogSettings, privacy: PrivacySettings, stream: TextIO | None = None) -> None:
    """Route structlog events at or above the set level to `stream` (default stderr), every string in them
    (tracebacks included) with its personal data redacted (`privacy.log_redactor()`: every kind, none kept,
    phone numbers of `privacy.phone_region`): whatever a log line quotes of a ticket, at any level, the log
    never holds it in clear (docs/privacy.md)."""
    level = logging.getLevelName(settings.level.upper())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if settings.format == "json"
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.format_exc_info,
            # Before the level and the timestamp: those are the worker's own, and a timestamp's digit run
            # would send every line through the phone number matcher for nothing.
            RedactingProcessor(privacy.log_redactor()),
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(stream) if stream else _CurrentStderrLogger,
        cache_logger_on_first_use=False,
    )


class RedactingProcessor:
    """A structlog processor that redacts personal data of every kind in each string of an event, nested
    ones too; numbers are left alone (counts and offsets are not personal data, and a phone number written
    as an int would be the code's own choice). Runs after the level filter: events left out cost nothing."""

    def __init__(self, redactor: Redactor) -> None:
        self._redactor = redactor

    def __call__(
        self, _logger: object, _method: str, event: structlog.typing.EventDict
    ) -> structlog.typing.EventDict:
        return {key: self._redacted(value) for key, value in event.items()}

    def _redacted(self, value: object) -> object:
        if isinstance(value, str):
            return self._redactor.redact(value)
        if isinstance(value, dict):
            return {key: self._redacted(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self._redacted(item) for item in value]
        return value


class _CurrentStderrLogger:
    """Writes to whatever `sys.stderr` is at each call, not the one seen at configuration time: test runners
    and the demo swap stderr, and a logger bound to a closed stream would fail every later log call."""

    def __init__(self, *_args: object) -> None:
        pass

    def msg(self, message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


# How often one cause of librdkafka's lines or errors is logged at most.
REPEAT_INTERVAL_S = 10.0
# Causes remembered at most; beyond it those not logged within the interval are forgotten (with their
# counts): lines that vary in more than numbers must not grow the table without bound.
_MAX_CAUSES = 256


class Throttle:
    """Admits one line per cause (a key) and interval, counting the ones it holds back meanwhile; the next
    line admitted for that cause carries the count. Thread-safe: librdkafka's callbacks run on whichever
    thread serves its client. The count of the last interval of an outage waits for the cause's next line."""

    def __init__(
        self, interval_s: float = REPEAT_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._causes: dict[Hashable, tuple[float, int]] = {}  # cause → (last admitted at, held back since)

    def admit(self, cause: Hashable, force: bool = False) -> int | None:
        """None: hold this line back (it is counted). Otherwise log it, with the returned number of lines
        of this cause held back since the last one. `force` admits it whatever the interval (fatal errors)."""
        now = self._clock()
        with self._lock:
            logged_at, held = self._causes.get(cause, (now - self._interval_s, 0))
            if now - logged_at < self._interval_s and not force:
                self._causes[cause] = (logged_at, held + 1)
                return None
            if cause not in self._causes and len(self._causes) >= _MAX_CAUSES:
                self._forget_before(now - self._interval_s)
            self._causes[cause] = (now, 0)
            return held

    def _forget_before(self, instant: float) -> None:
        self._causes = {cause: entry for cause, entry in self._causes.items() if entry[0] >= instant}


# librdkafka's line, as confluent-kafka's `logger` gets it: "FAIL [rdkafka#consumer-1] [thrd:host:9092/1]:
# host:9092/1: Connect to ipv4#10.0.0.7:9092 failed: Connection refused (after 0ms in state CONNECT)".
_LIBRDKAFKA_LINE = re.compile(r"(?P<facility>\S+) \[[^]]*\] (?:\[thrd:[^]]*\]: )?(?P<text>.*)", re.S)
# What differs between two reports of one cause: the broker thread that saw it ("host:9092/1: ",
# "GroupCoordinator: host:9092: "), librdkafka's timing and own count, and any number (ports, ids, counts).
_BROKER_PREFIX = re.compile(r"^(?:GroupCoordinator(?:/\d+)?: )?(?:\w+://)?\S+:\d+(?:/\w+)?: ")
_TIMING_SUFFIX = re.compile(r" \(after \d+ms in state \w+(?:, \d+ identical error\(s\) suppressed)?\)$")
_NUMBER = re.compile(r"\d+")


def librdkafka_cause(message: str) -> tuple[str, str]:
    """(facility, cause) of one of librdkafka's lines: lines that differ only in the client or broker thread
    that reported them, in librdkafka's timing or in numbers (addresses, ports, counts) are one cause, so a
    broker that is away is one line per interval, not one per attempt of each client and thread."""
    parsed = _LIBRDKAFKA_LINE.fullmatch(message)
    if parsed is None:
        return "", _NUMBER.sub("#", message)
    text = _TIMING_SUFFIX.sub("", _BROKER_PREFIX.sub("", parsed["text"]))
    return parsed["facility"], _NUMBER.sub("#", text)


class LibrdkafkaHandler(logging.Handler):
    """Forwards stdlib records (librdkafka's, via confluent-kafka's `logger` option) to structlog, one per
    cause, level and interval (see `librdkafka_cause`), whichever of the process's clients reported it."""

    def __init__(self, throttle: Throttle) -> None:
        super().__init__()
        self._throttle = throttle

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        facility, cause = librdkafka_cause(message)
        # The level belongs to the cause: an info line left out by the log level must not hold back an error.
        held = self._throttle.admit((record.levelno, facility, cause))
        if held is not None:
            structlog.get_logger(record.name).log(
                record.levelno, "librdkafka", facility=facility, message=message, suppressed_since_last=held
            )


def librdkafka_logger() -> logging.Logger:
    """A logger for the `logger` client option, so librdkafka's lines come out in the configured format,
    rate-limited per cause, instead of raw ``%4|...`` lines on stderr. Every client of a process shares it.
    A client that is not polled (an admin client) queues its lines until its `poll` serves them."""
    logger = logging.getLogger("librdkafka")
    if not any(isinstance(handler, LibrdkafkaHandler) for handler in logger.handlers):
        logger.addHandler(LibrdkafkaHandler(Throttle()))
        logger.propagate = False
        logger.setLevel(logging.DEBUG)
    return logger
