"""Decoding: valid tickets come through; every kind of bad input is rejected with the field named."""

from __future__ import annotations

import pytest

from worker.decoding import DecodeError, decode_ticket
from worker.messages import TicketEvent

LIMIT = 1024


def test_valid_ticket_with_optional_and_unknown_fields() -> None:
    value = (
        '{"ticket_id": "T-1", "body": "My card was charged twice ✓", "subject": "Refund",'
        ' "customer_id": "C-9", "channel": "email", "created_at": "2024-05-01T12:30:00.5+02:00",'
        ' "metadata": {"region": "eu"}, "producer_only": {"nested": [1, 2]}}'
    ).encode()
    assert decode_ticket(value, LIMIT) == TicketEvent(
        ticket_id="T-1",
        body="My card was charged twice ✓",
        subject="Refund",
        customer_id="C-9",
        channel="email",
        created_at="2024-05-01T12:30:00.5+02:00",
        metadata={"region": "eu"},
    )


def test_minimal_ticket_and_empty_body_are_valid() -> None:
    event = decode_ticket(b'{"ticket_id": "T-2", "body": ""}', LIMIT)
    assert (event.ticket_id, event.body, event.metadata) == ("T-2", "", None)


def test_value_exactly_at_the_limit_is_accepted() -> None:
    value = b'{"ticket_id": "T-3", "body": "' + b"x" * 100 + b'"}'
    assert decode_ticket(value, len(value)).body == "x" * 100


@pytest.mark.parametrize(
    ("value", "error_type", "message"),
    [
        (None, "null_value", "value is null (a tombstone)"),
        (b'{"ticket_id": "T", "body": "' + b"x" * LIMIT + b'"}', "too_large", "over the 1024-byte limit"),
        (b'{"ticket_id": "T", "body": "caf\xe9"}', "invalid_utf8", "not valid UTF-8: invalid continuation"),
        (b'{"ticket_id": "T", "body": "ok", "extra": "\xff"}', "invalid_utf8", "at byte 43"),
        (b'{"ticket_id": "T", "body": "ok"', "invalid_json", "not valid JSON: input data was truncated"),
        (b"", "invalid_json", "not valid JSON"),
        (b'["T", "body"]', "not_an_object", "must be a JSON object, got array"),
        (b'"just text"', "not_an_object", "got string"),
        (b"null", "not_an_object", "got null"),
        (b'{"body": "hello"}', "missing_field", "required field `ticket_id` is missing"),
        (b'{"ticket_id": "T"}', "missing_field", "required field `body` is missing"),
        (b'{"ticket_id": "", "body": "hello"}', "empty_field", "`ticket_id` must not be empty"),
        (b'{"ticket_id": 17, "body": "hello"}', "wrong_type", "`ticket_id` must be a string, got integer"),
        (b'{"ticket_id": "T", "body": 5}', "wrong_type", "`body` must be a string, got integer"),
        (b'{"ticket_id": "T", "body": null}', "wrong_type", "`body` must be a string, got null"),
        (
            b'{"ticket_id": "T", "body": "b", "subject": ["a"]}',
            "wrong_type",
            "`subject` must be a string or null",
        ),
        (b'{"ticket_id": "T", "body": "b", "metadata": "x"}', "wrong_type", "`metadata` must be an object"),
        (
            b'{"ticket_id": "T", "body": "b", "metadata": {"ok": "1", "foo": true}}',
            "wrong_type",
            "`metadata.foo` must be a string, got boolean",
        ),
        (b'{"ticket_id": "T", "body": "b", "created_at": 1714566600}', "wrong_type", "`created_at` must be"),
        (
            b'{"ticket_id": "T", "body": "b", "created_at": "yesterday"}',
            "invalid_timestamp",
            '`created_at` must be an RFC 3339 timestamp like 2024-05-01T12:30:00Z, got "yesterday"',
        ),
        (  # no UTC offset: a local time is ambiguous
            b'{"ticket_id": "T", "body": "b", "created_at": "2024-05-01T12:30:00"}',
            "invalid_timestamp",
            "`created_at`",
        ),
        (
            b'{"ticket_id": "T", "body": "b", "created_at": "2024-02-30T00:00:00Z"}',
            "invalid_timestamp",
            "02-30",
        ),
    ],
)
def test_bad_input_is_rejected_with_a_precise_reason(
    value: bytes | None, error_type: str, message: str
) -> None:
    with pytest.raises(DecodeError) as caught:
        decode_ticket(value, LIMIT)
    assert caught.value.error_type == error_type
    assert message in caught.value.message


def test_size_limit_is_checked_before_parsing() -> None:
    """A huge value is refused on its length alone, even when it is not JSON at all."""
    with pytest.raises(DecodeError) as caught:
        decode_ticket(b"\xff" * 2048, LIMIT)
    assert caught.value.error_type == "too_large"
    assert caught.value.message == "value is 2048 bytes, over the 1024-byte limit (pipeline.max_value_bytes)"
