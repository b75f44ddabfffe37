"""Dead-letter header contract: what the worker adds to a record it cannot decode, and how replay reads it.

A dead letter is the original record, key, value and headers untouched (with `dead_letter.redact`, their
personal data redacted: ``triage.redacted``), plus the ``triage.*`` headers below, so an operator can see why
it failed and where it came from, fix the producer or the worker, and replay it.
``schemas/dead_letter.md`` is generated from `HEADER_DOCS` (``triage-worker schemas --write``).
"""

from __future__ import annotations

import datetime
import re
import typing
from collections.abc import Sequence

import msgspec

from worker.decoding import DecodeErrorType
from worker.messages import utc_timestamp

ERROR_TYPE = "triage.error.type"
ERROR_MESSAGE = "triage.error.message"
SOURCE_TOPIC = "triage.source.topic"
SOURCE_PARTITION = "triage.source.partition"
SOURCE_OFFSET = "triage.source.offset"
FAILED_AT = "triage.failed_at"
REPLAY_COUNT = "triage.replay_count"
# Only on a dead letter whose original record did not fit in the dead-letter topic, or whose value
# `dead_letter.redact` left out.
OMITTED_BYTES = "triage.omitted.bytes"
# Only on a dead letter `dead_letter.redact` redacted: how (`worker.privacy.values.RedactedForm`).
REDACTED = "triage.redacted"
REDACTED_DROPPED = "dropped"

HEADER_DOCS: tuple[tuple[str, str], ...] = (
    (ERROR_TYPE, "Stable machine name of the failure, e.g. `invalid_json`, `missing_field`, `too_large`."),
    (ERROR_MESSAGE, "Human-readable reason naming the field, UTF-8, at most 1024 bytes (cut with `…`)."),
    (SOURCE_TOPIC, "Topic the record was consumed from."),
    (SOURCE_PARTITION, "Partition it was consumed from (decimal)."),
    (SOURCE_OFFSET, "Offset it had there (decimal)."),
    (
        FAILED_AT,
        "When the worker gave up on it: RFC 3339 UTC with milliseconds, e.g. 2024-05-01T12:30:00.123Z.",
    ),
    (
        REPLAY_COUNT,
        "How many times it was replayed before this failure (decimal; 0 when first dead-lettered).",
    ),
)
DEAD_LETTER_HEADERS: frozenset[str] = frozenset(name for name, _ in HEADER_DOCS)
OPTIONAL_HEADER_DOCS: tuple[tuple[str, str], ...] = (
    (
        OMITTED_BYTES,
        "Only when the record did not fit in the dead-letter topic (it was written with no key, no value "
        "and only the `triage.*` headers), or when `dead_letter.redact` left its value out "
        "(`triage.redacted` is `dropped`): the size in bytes of what was left out. The original is still at "
        "`triage.source.*` within the source topic's retention. `replay` never republishes such a dead "
        "letter: it reports it as `shrunk`.",
    ),
    (
        REDACTED,
        "Only with `dead_letter.redact = true`: the key, the value and the header values carry the record's "
        "personal data redacted, not as the producer sent them, and this says how the value was: `json` (a "
        "JSON document, behind the Schema Registry's 5-byte header if it had one, every string redacted), "
        "`text`, or `dropped` (binary, such as Avro or Protobuf: left out). See docs/privacy.md.",
    ),
)
# Error types the pipeline writes itself (the decoder's are `worker.decoding.DecodeErrorType`).
PIPELINE_ERROR_DOCS: tuple[tuple[str, str], ...] = (
    ("internal_error", "an unexpected exception while decoding the record; the message names it"),
    ("key_too_large", "a record key over 4096 bytes (results are keyed by it)"),
    (
        "result_refused",
        "Kafka refused the ticket's triage record itself (e.g. too large for the output topic); the message "
        "names Kafka's error",
    ),
    (
        "delivery_count_exceeded",
        "queue mode: the share group delivered the record as often as its delivery limit allows (each try "
        "ended without a record: the model process died, the worker stopped or crashed); the message says "
        "how often",
    ),
)
RESULT_REFUSED = "result_refused"
DELIVERY_COUNT_EXCEEDED = "delivery_count_exceeded"
# Every `triage.error.type` this worker writes: what `replay --error-type` can select.
ERROR_TYPES: tuple[str, ...] = (*typing.get_args(DecodeErrorType), *(name for name, _ in PIPELINE_ERROR_DOCS))

# Kafka headers travel in every fetch of the record; cap the one free-text header.
MAX_MESSAGE_BYTES = 1024
_ELLIPSIS = "…"

# Kafka's own rule for topic names; a dead letter naming anything else was not written by this worker.
_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")
# Counts and offsets fit in 64 bits; longer digit runs are not ours (and int() refuses > 4300 digits).
_MAX_DIGITS = 19

# As confluent-kafka's Message.headers() gives them: a header may be present with no value (None).
Headers = Sequence[tuple[str, bytes | None]]


class DeadLetterInfo(msgspec.Struct, kw_only=True, frozen=True):
    """The ``triage.*`` headers of a dead letter, parsed."""

    error_type: str
    error_message: str
    topic: str
    partition: int
    offset: int
    failed_at: str
    replay_count: int
    # `triage.omitted.bytes`: the dead letter was written without its key, value and own headers (or, where
    # `redacted` is "dropped", without its value), which were this large; None for a whole one. Such a record
    # cannot be replayed: there is nothing left to send.
    omitted_bytes: int | None = None
    # `triage.redacted`: how `dead_letter.redact` redacted the record; None when it is as taken.
    redacted: str | None = None


class DeadLetterHeaderError(ValueError):
    """A record lacks a dead-letter header or has a malformed one (it was not written by this worker)."""


def truncate_message(message: str, limit: int = MAX_MESSAGE_BYTES) -> str:
    """`message` cut to at most `limit` UTF-8 bytes on a character boundary, ending in `…` when cut.

    Lone surrogates (from an exception's text, say) cannot be UTF-8: they are written as `\\udcff` escapes.
    """
    encoded = _utf8(message)
    if len(encoded) <= limit:
        return encoded.decode("utf-8")
    room = limit - len(_ELLIPSIS.encode("utf-8"))
    return encoded[:room].decode("utf-8", errors="ignore") + _ELLIPSIS


def _utf8(text: str) -> bytes:
    return text.encode("utf-8", errors="backslashreplace")


def _text(value: bytes | None) -> str:
    return "" if value is None else value.decode("utf-8", errors="replace")


def _decimal(text: str) -> int | None:
    return int(text) if text.isascii() and text.isdigit() and len(text) <= _MAX_DIGITS else None


def _last(headers: Headers, name: str) -> bytes | None:
    """Kafka allows a header name more than once; the last one wins, as in most clients' lookups."""
    found: bytes | None = None
    for key, value in headers:
        if key == name:
            found = value
    return found


def dead_letter_headers(
    original_headers: Headers | None,
    error_type: str,
    message: str,
    topic: str,
    partition: int,
    offset: int,
    replay_count: int = 0,
    failed_at: datetime.datetime | None = None,
    redacted: str | None = None,
) -> list[tuple[str, bytes | None]]:
    """Headers for the dead letter of a record: its own headers untouched, then the ``triage.*`` ones, and
    `triage.redacted` last when the record was `redacted` (see `OPTIONAL_HEADER_DOCS`).

    ``triage.*`` headers left by an earlier failure (a replayed dead letter failing again) are dropped so they
    don't pile up, but the replay count they carry is kept: the larger of it and `replay_count` is written.
    An earlier `triage.redacted` stays unless this one is redacted too: the value it describes is the same.
    """
    originals = list(original_headers or ())
    carried = _decimal(_text(_last(originals, REPLAY_COUNT)))
    count = replay_count if carried is None else max(replay_count, carried)
    stamp = utc_timestamp(failed_at)
    replaced = DEAD_LETTER_HEADERS if redacted is None else DEAD_LETTER_HEADERS | {REDACTED}
    return [
        *((name, value) for name, value in originals if name not in replaced),
        (ERROR_TYPE, _utf8(error_type)),
        (ERROR_MESSAGE, truncate_message(message).encode("utf-8")),
        (SOURCE_TOPIC, _utf8(topic)),
        (SOURCE_PARTITION, str(partition).encode("ascii")),
        (SOURCE_OFFSET, str(offset).encode("ascii")),
        (FAILED_AT, stamp.encode("ascii")),
        (REPLAY_COUNT, str(count).encode("ascii")),
        *(() if redacted is None else ((REDACTED, _utf8(redacted)),)),
    ]


def read_dead_letter(headers: Headers | None) -> DeadLetterInfo:
    """Parse the ``triage.*`` headers of a dead letter; DeadLetterHeaderError names a missing or bad one."""
    present = list(headers or ())
    text: dict[str, str] = {}
    for name in DEAD_LETTER_HEADERS:
        value = _last(present, name)
        if value is None:
            raise DeadLetterHeaderError(f"not a dead letter of this worker: header {name} is missing")
        text[name] = _text(value)
    numbers: dict[str, int] = {}
    for name in (SOURCE_PARTITION, SOURCE_OFFSET, REPLAY_COUNT):
        number = _decimal(text[name])
        if number is None:
            raise DeadLetterHeaderError(f"header {name} must be a decimal number, got {text[name][:40]!r}")
        numbers[name] = number
    omitted: int | None = None
    if (omitted_text := _last(present, OMITTED_BYTES)) is not None:
        omitted = _decimal(_text(omitted_text))
        if omitted is None:
            raise DeadLetterHeaderError(
                f"header {OMITTED_BYTES} must be a decimal number, got {_text(omitted_text)[:40]!r}"
            )
    if not _TOPIC_NAME.fullmatch(text[SOURCE_TOPIC]):
        raise DeadLetterHeaderError(
            f"header {SOURCE_TOPIC} must be a Kafka topic name, got {text[SOURCE_TOPIC][:40]!r}"
        )
    return DeadLetterInfo(
        error_type=text[ERROR_TYPE],
        error_message=text[ERROR_MESSAGE],
        topic=text[SOURCE_TOPIC],
        partition=numbers[SOURCE_PARTITION],
        offset=numbers[SOURCE_OFFSET],
        failed_at=text[FAILED_AT],
        replay_count=numbers[REPLAY_COUNT],
        omitted_bytes=omitted,
        redacted=None if (redacted := _last(present, REDACTED)) is None else _text(redacted),
    )


def replay_headers(headers: Headers | None) -> list[tuple[str, bytes | None]]:
    """Headers for putting a dead letter back on the input topic: the original ones, replay count + 1.

    The ``triage.error.*``/``triage.source.*`` headers go (they describe the old failure); the incremented
    ``triage.replay_count`` stays so a record that fails again is dead-lettered with its history.
    """
    present = list(headers or ())
    count = read_dead_letter(present).replay_count + 1
    return [
        *((name, value) for name, value in present if name not in DEAD_LETTER_HEADERS),
        (REPLAY_COUNT, str(count).encode("ascii")),
    ]
