"""Redacting a record's raw bytes (a dead letter's value, key and header values; a triage record's key and
header values) by what they are on the wire, so that the redacted copy reads as its original did:

- JSON, or JSON behind the 5-byte header of the Confluent wire format (magic byte 0, a 4-byte schema id: the
  Schema Registry's JSON Schema framing): every string of the document, keys included, is redacted once
  the parser has decoded its escapes (`\\u0034`), and so is every integer that is an identifier (a card
  number sent as a number becomes its placeholder, a string); it is written back as JSON behind the same
  header, so that a reader (replay included) decodes it as it decoded the original.
- Text (no control character but tab and line breaks; bytes that are not UTF-8 kept as they are): redacted
  as text, escapes decoded before the search (`Redactor.redact`).
- Anything else is binary: Avro or Protobuf behind the wire format's header, or bytes of no known format.
  It is not redacted but dropped (`None`): without the writer's schema the encoding's own bytes (lengths,
  tags) cannot be told from the text, and a length byte that happens to be a printable character glued to
  an identifier (`6` before `4111111111111111`) hides it from any search of the bytes.

`RedactedForm` names which was done: a dead letter says so in its `triage.redacted` header. Keys and header
values are redacted as text (`redact_bytes`: bytes that are not UTF-8 stay, a binary id is no text);
`CarriedMetadata` says which input headers a triage record carries and whether it may carry the key.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec

from worker.privacy.redaction import Redactor

RedactedForm = Literal["json", "text", "dropped"]
# As a record carries them: a header may be present with no value (None).
Headers = list[tuple[str, bytes | None]]

# Confluent wire format: magic byte 0, then the schema id (4 bytes, big-endian), then the payload.
_WIRE_MAGIC = 0
_WIRE_HEADER_BYTES = 5
_ANY_JSON = msgspec.json.Decoder()
_ENCODER = msgspec.json.Encoder()
# Control characters that text does not hold (tab, line feed and carriage return it does).
_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


def redact_value(value: bytes, redactor: Redactor) -> tuple[bytes | None, RedactedForm]:
    """`value` with what `redactor` hides redacted by its wire format (see the module), and the form; None
    for a binary value, which is dropped."""
    framed = len(value) >= _WIRE_HEADER_BYTES and value[0] == _WIRE_MAGIC
    header, payload = (value[:_WIRE_HEADER_BYTES], value[_WIRE_HEADER_BYTES:]) if framed else (b"", value)
    try:
        return header + _ENCODER.encode(_redacted_document(_ANY_JSON.decode(payload), redactor)), "json"
    except (msgspec.DecodeError, RecursionError):
        pass  # not JSON, or nested deeper than Python recurses: text, or bytes
    # Behind the wire format's header a payload that is not JSON is Avro's or Protobuf's, whatever its bytes.
    text = None if framed else payload.decode("utf-8", errors="surrogateescape")
    if text is None or _CONTROL.search(text) is not None:
        return None, "dropped"
    return redactor.redact(text).encode("utf-8", errors="surrogateescape"), "text"


def _redacted_document(document: object, redactor: Redactor) -> object:
    """`document` (decoded JSON) with every string in it, keys included, redacted, and every integer that
    holds an identifier replaced by its redacted text."""
    if isinstance(document, str):
        return redactor.redact(document)
    if isinstance(document, list):
        return [_redacted_document(item, redactor) for item in document]
    if isinstance(document, dict):
        return {redactor.redact(str(k)): _redacted_document(v, redactor) for k, v in document.items()}
    if isinstance(document, int) and not isinstance(document, bool):
        digits = str(document)
        redacted = redactor.redact(digits)
        return document if redacted == digits else redacted
    return document


def redact_bytes(value: bytes, redactor: Redactor) -> bytes:
    """`value` (a key, a header value) redacted as text, escapes decoded before the search; its bytes that
    are not UTF-8 are kept as they are (a binary id stays the id it was)."""
    text = value.decode("utf-8", errors="surrogateescape")
    redacted = redactor.redact(text)
    return value if redacted == text else redacted.encode("utf-8", errors="surrogateescape")


def redact_headers(headers: Iterable[tuple[str, bytes | None]], redactor: Redactor) -> Headers:
    """Each header's name and value redacted (`redact_bytes`), in order."""
    return [
        (redactor.redact(name), None if value is None else redact_bytes(value, redactor))
        for name, value in headers
    ]


# `privacy.carry_headers`' name for every header.
EVERY_HEADER = "*"
# A header the worker writes itself (`triage.replay_count`, `triage.redacted`, ...): always carried.
_OWN_HEADER_PREFIX = "triage."


class CarriedMetadata:
    """What a copy of a ticket's record (its triage record, and the review and shadow copies of it) takes of
    the input record's key and headers (docs/privacy.md#keys-and-headers): the headers `carry` names (case
    does not matter; `*` names every header) and the worker's own `triage.*`, each name and value with what
    `redactor` finds redacted; and whether the key holds personal data, in which case the copies are keyed
    otherwise."""

    def __init__(self, redactor: Redactor, carry: Iterable[str]) -> None:
        self._redactor = redactor
        names = frozenset(name.lower() for name in carry)
        self._carry = None if EVERY_HEADER in names else names

    def headers(self, headers: Sequence[tuple[str, bytes | None]] | None) -> Headers | None:
        """The headers carried, in order, redacted."""
        if not headers:
            return None if headers is None else []
        carried = (
            (name, value)
            for name, value in headers
            if self._carry is None or name.startswith(_OWN_HEADER_PREFIX) or name.lower() in self._carry
        )
        return redact_headers(carried, self._redactor)

    def key_is_personal(self, key: bytes) -> bool:
        """Whether `key` holds personal data (an e-mail address, a phone number, ...)."""
        return redact_bytes(key, self._redactor) != key
