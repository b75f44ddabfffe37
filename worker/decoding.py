"""Turn a Kafka record value into a TicketEvent, or say precisely why it cannot be one.

Valid tickets take one pass through a reused typed msgspec decoder. Only when that fails do we parse again
without types to find the first problem and name its field: that message goes into the dead letter's
``triage.error.message`` header, where an operator has to understand it without the original producer at hand.

`decode_ticket` raises nothing but `DecodeError`, whatever the bytes: a record that could make it raise
anything else would stop the worker on every restart. Nesting deeper than `MAX_NESTING_DEPTH` is refused
before any parser recurses into it, and anything a library raises unexpectedly becomes `undecodable`.
"""

from __future__ import annotations

import datetime
import re
from typing import Literal, get_args

import msgspec

from worker.messages import DEADLINE_METADATA_KEY, MAX_TICKET_ID_CHARS, RFC3339_PATTERN, TicketEvent

DecodeErrorType = Literal[
    "too_large",
    "invalid_utf8",
    "invalid_json",
    "not_an_object",
    "missing_field",
    "empty_field",
    "too_long",
    "wrong_type",
    "invalid_timestamp",
    "null_value",
    "too_deeply_nested",
    "undecodable",
    "empty_ticket",
    # Schema Registry input formats (worker/contracts/input.py).
    "invalid_wire_format",
    "unknown_schema",
    "schema_mismatch",
]

# Tickets need two levels (the object and `metadata`). msgspec recurses once per level and raises
# RecursionError near Python's recursion limit, minus whatever the caller's stack already uses: a fixed,
# much lower bound makes the answer the same in every caller.
MAX_NESTING_DEPTH = 64
# Error messages go into a Kafka header and logs: they quote at most this much of any input.
MAX_MESSAGE_CHARS = 300
_EXCERPT_CHARS = 60

_DECODER = msgspec.json.Decoder(TicketEvent)
_OPTIONAL_STRINGS = ("subject", "customer_id", "channel")
# ASCII digits only, and no newline after the offset (which `$` alone would let through).
_RFC3339 = re.compile(RFC3339_PATTERN, re.ASCII)
# A JSON string, or an unterminated one running to the end: brackets inside strings do not nest.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\Z)', re.DOTALL)
# RFC 8259 §8.1: a parser may ignore a byte order mark; some Windows tools write one.
_UTF8_BOM = b"\xef\xbb\xbf"
_NOT_BRACKET = bytes(byte for byte in range(256) if byte not in b"[]{}")
_OPENERS = frozenset(b"[{")


class DecodeError(Exception):
    """The value is not a ticket; `error_type` is a stable machine name, `message` names the field."""

    def __init__(self, error_type: DecodeErrorType, message: str) -> None:
        message = _clip(message, MAX_MESSAGE_CHARS)
        super().__init__(f"{error_type}: {message}")
        self.error_type: DecodeErrorType = error_type
        self.message = message


# Why the Schema Registry gave no answer about a record (`RegistryUnavailable.cause`): a stable machine name
# for the log, readiness and the metrics' `cause` label.
RegistryCause = Literal[
    # Refused the connection, timed out, answered 5xx, 408 or 429: away or overloaded.
    "outage",
    # Answered 401 or 403: it refuses our credentials (rotated?) or their rights (an ACL changed).
    "credentials",
    # Any other answer that says nothing about the record: a 400, a 404 that is not "no such schema id" (a
    # wrong path in schema_registry.url), a body that is not the registry's JSON (a proxy's page).
    "registry_error",
]
REGISTRY_CAUSES: tuple[RegistryCause, ...] = get_args(RegistryCause)


class RegistryUnavailable(Exception):
    """The Schema Registry gave no answer about the record (see `RegistryCause`): retry the record, never
    dead-letter it. `cause` names why, `message` says what happened and what to check, with no secret in it;
    `str()` is "cause: message", as for `DecodeError`. Here, beside `DecodeError`, so that the pipeline can
    tell the two apart without importing the contracts room (worker/contracts/input.py raises it)."""

    def __init__(self, cause: RegistryCause, message: str) -> None:
        message = _clip(message, MAX_MESSAGE_CHARS)
        super().__init__(f"{cause}: {message}")
        self.cause: RegistryCause = cause
        self.message = message


def decode_ticket(value: bytes | None, max_value_bytes: int) -> TicketEvent:
    """Decode one record value; raises DecodeError, and only DecodeError, for anything that is not a valid
    TicketEvent."""
    try:
        return _decode(value, max_value_bytes)
    except DecodeError:
        raise
    except Exception as error:  # a library failing in a way we did not foresee: one dead letter, not a crash
        raise DecodeError(
            "undecodable", f"the decoder failed on this value: {type(error).__name__}: {_describe(error)}"
        ) from None


def _decode(value: bytes | None, max_value_bytes: int) -> TicketEvent:
    if value is None:
        raise DecodeError("null_value", "value is null (a tombstone), expected a JSON ticket")
    if not value:
        raise DecodeError("invalid_json", "value is empty (0 bytes), expected a JSON ticket")
    value = value.removeprefix(_UTF8_BOM)
    if len(value) > max_value_bytes:
        raise DecodeError(
            "too_large",
            f"value is {len(value)} bytes, over the {max_value_bytes}-byte limit (pipeline.max_value_bytes)",
        )
    # msgspec checks the UTF-8 of the strings it keeps, not of unknown fields it skips.
    if not value.isascii():
        try:
            value.decode("utf-8")
        except UnicodeDecodeError as bad:
            raise DecodeError(
                "invalid_utf8", f"value is not valid UTF-8: {bad.reason} at byte {bad.start}"
            ) from None
    # Counting brackets is a fast C scan; only a value with many of them needs the exact depth.
    if value.count(b"[") + value.count(b"{") > MAX_NESTING_DEPTH and _too_deep(value):
        raise DecodeError(
            "too_deeply_nested",
            f"value nests arrays or objects more than {MAX_NESTING_DEPTH} levels deep",
        )
    try:
        event = _DECODER.decode(value)
    except msgspec.DecodeError as error:
        raise _diagnose(value, error) from None
    if event.created_at is not None:
        _check_timestamp(event.created_at)
    if event.metadata and DEADLINE_METADATA_KEY in event.metadata:
        _check_timestamp(event.metadata[DEADLINE_METADATA_KEY], f"metadata.{DEADLINE_METADATA_KEY}")
    if not has_text(event):
        # Refused here, before the model: a model asked about nothing still names an intent, confidently.
        raise DecodeError("empty_ticket", "`body` and `subject` are empty or whitespace: no text to classify")
    return event


def has_text(event: TicketEvent) -> bool:
    """Whether the ticket has any text to classify (a body or a subject that is not only whitespace)."""
    return bool(event.body.strip() or (event.subject or "").strip())


def _too_deep(value: bytes) -> bool:
    """Whether brackets outside strings nest deeper than MAX_NESTING_DEPTH (stops at the first level over)."""
    depth = 0
    for byte in _STRING.sub(b"", value).translate(None, _NOT_BRACKET):
        if byte in _OPENERS:
            depth += 1
            if depth > MAX_NESTING_DEPTH:
                return True
        else:
            depth -= 1
    return False


def rfc3339_moment(text: str) -> datetime.datetime:
    """The instant an RFC 3339 date-time names; ValueError if `text` is not one.

    RFC 3339 §5.6: `T` and `Z` in either case, fractional seconds of any length, an offset required (`Z` or
    ±hh:mm); the calendar is checked too (no 2024-02-30, no hour 24, no offset +24:00). A leap second (:60)
    is refused, as Python's datetime cannot hold it. This one function is both what the decoder accepts and
    what a deadline is read with, so no value can pass the one and be ignored by the other."""
    if not _RFC3339.fullmatch(text):
        raise ValueError(f"not an RFC 3339 date-time: {text!r}")
    try:
        # msgspec's parser takes either case of T and Z (Python 3.11's fromisoformat refuses a lower-case z).
        moment = msgspec.convert(text, datetime.datetime)
    except msgspec.ValidationError as error:
        raise ValueError(f"not an RFC 3339 date-time: {text!r}") from error
    if moment.tzinfo is None:  # the pattern requires an offset; kept as a guard
        raise ValueError(f"an RFC 3339 date-time needs an offset: {text!r}")
    return moment


def _check_timestamp(text: str, field: str = "created_at") -> None:
    """The Struct's pattern checks the shape (offset required); `rfc3339_moment` the rest."""
    try:
        rfc3339_moment(text)
    except ValueError:
        raise DecodeError(
            "invalid_timestamp",
            f"`{field}` must be an RFC 3339 timestamp like 2024-05-01T12:30:00Z, got {_show(text)}",
        ) from None


def _diagnose(value: bytes, error: Exception) -> DecodeError:
    """Re-read a rejected value without types and explain the first thing wrong with it."""
    try:
        document = msgspec.json.decode(value)
    except msgspec.DecodeError as bad:
        # The library's own words, as it wrote them: an operator may search for them.
        return DecodeError("invalid_json", f"value is not valid JSON: {bad}")
    if not isinstance(document, dict):
        return DecodeError("not_an_object", f"value must be a JSON object, got {_json_type(document)}")
    for name in ("ticket_id", "body"):
        if name not in document:
            return DecodeError("missing_field", f"required field `{name}` is missing")
        if not isinstance(document[name], str):
            return _wrong_type(name, "a string", document[name])
    if document["ticket_id"] == "":
        return DecodeError("empty_field", "`ticket_id` must not be empty")
    if len(document["ticket_id"]) > MAX_TICKET_ID_CHARS:
        return DecodeError(
            "too_long",
            f"`ticket_id` has {len(document['ticket_id'])} characters, over {MAX_TICKET_ID_CHARS}",
        )
    for name in (*_OPTIONAL_STRINGS, "created_at"):
        field = document.get(name)
        if field is not None and not isinstance(field, str):
            return _wrong_type(name, "a string or null", field)
    created_at = document.get("created_at")
    if created_at is not None:
        try:
            _check_timestamp(created_at)
        except DecodeError as bad:
            return bad
    metadata = document.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict):
            return _wrong_type("metadata", "an object of strings or null", metadata)
        for key, item in metadata.items():
            if not isinstance(item, str):
                return _wrong_type(f"metadata.{_clip(key, _EXCERPT_CHARS)}", "a string", item)
    # Every rule above mirrors the Struct; reaching here means they drifted apart. Keep msgspec's words.
    return DecodeError("wrong_type", str(error).replace("`", ""))


def _wrong_type(field: str, expected: str, got: object) -> DecodeError:
    return DecodeError("wrong_type", f"`{field}` must be {expected}, got {_json_type(got)}")


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def _show(text: str) -> str:
    shown = msgspec.json.encode(text[:_EXCERPT_CHARS]).decode()
    return shown if len(text) <= _EXCERPT_CHARS else shown[:-1] + '..."'


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _describe(error: Exception) -> str:
    """The exception's text, short and printable; an exception whose str() itself fails still gets a dead
    letter."""
    try:
        text = str(error)
    except Exception:
        return "(no description)"
    return _clip(text, _EXCERPT_CHARS * 2).encode("utf-8", "backslashreplace").decode("utf-8")
