"""Decoding: valid tickets come through; every kind of bad input is rejected with the field named."""

from __future__ import annotations

import sys
from types import FrameType

import msgspec
import pytest

from worker import decoding
from worker.decoding import MAX_MESSAGE_CHARS, MAX_NESTING_DEPTH, DecodeError, decode_ticket
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
    # An empty body is valid when the subject carries the text (a ticket with no text at all is not: below).
    event = decode_ticket(b'{"ticket_id": "T-2", "subject": "Card stolen", "body": ""}', LIMIT)
    assert (event.ticket_id, event.body, event.metadata) == ("T-2", "", None)


@pytest.mark.parametrize(
    "value",
    [
        b'{"ticket_id": "T", "body": ""}',
        b'{"ticket_id": "T", "body": " \\n\\t", "subject": null}',
        b'{"ticket_id": "T", "body": "", "subject": "\\u3000 "}',
    ],
)
def test_a_ticket_with_no_text_is_refused_before_the_model(value: bytes) -> None:
    with pytest.raises(DecodeError) as caught:
        decode_ticket(value, LIMIT)
    assert caught.value.error_type == "empty_ticket"
    assert caught.value.message == "`body` and `subject` are empty or whitespace: no text to classify"


def test_invalid_json_quotes_the_library_words_unchanged() -> None:
    with pytest.raises(DecodeError) as caught:
        decode_ticket(b'{"ticket_id": "T", x}', LIMIT)
    assert (
        caught.value.message
        == "value is not valid JSON: JSON is malformed: object keys must be strings (byte 19)"
    )


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
        (b'{"ticket_id": "T", "body": "ok"', "invalid_json", "not valid JSON: Input data was truncated"),
        (b"", "invalid_json", "value is empty (0 bytes), expected a JSON ticket"),
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
        (  # issue #31: a deadline the producer asked for is never silently ignored
            b'{"ticket_id": "T", "body": "b", "metadata": {"deadline_at": "garbage"}}',
            "invalid_timestamp",
            '`metadata.deadline_at` must be an RFC 3339 timestamp like 2024-05-01T12:30:00Z, got "garbage"',
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


def test_a_utf8_byte_order_mark_before_the_json_is_ignored() -> None:
    """RFC 8259 lets a parser ignore a BOM (some Windows tools write one); it was reported as `invalid
    character (byte 0)` (issue #31)."""
    event = decode_ticket(b'\xef\xbb\xbf{"ticket_id": "T-BOM", "body": "card blocked"}', LIMIT)
    assert (event.ticket_id, event.body) == ("T-BOM", "card blocked")


def test_size_limit_is_checked_before_parsing() -> None:
    """A huge value is refused on its length alone, even when it is not JSON at all."""
    with pytest.raises(DecodeError) as caught:
        decode_ticket(b"\xff" * 2048, LIMIT)
    assert caught.value.error_type == "too_large"
    assert caught.value.message == "value is 2048 bytes, over the 1024-byte limit (pipeline.max_value_bytes)"


def test_the_100kb_nesting_record_is_a_dead_letter_not_a_crash() -> None:
    """The record of issue 12: 100,000 `[` made msgspec raise RecursionError and killed the worker."""
    with pytest.raises(DecodeError) as caught:
        decode_ticket(b"[" * 100_000, 1_048_576)
    assert caught.value.error_type == "too_deeply_nested"
    assert caught.value.message == f"value nests arrays or objects more than {MAX_NESTING_DEPTH} levels deep"


def _nested_in_unknown_field(depth: int) -> bytes:
    return b'{"ticket_id": "T", "body": "b", "producer": ' + b"[" * depth + b"]" * depth + b"}"


def test_the_depth_limit_counts_every_level_and_ignores_brackets_in_strings() -> None:
    # The object itself is one level, so an unknown field can hold MAX_NESTING_DEPTH - 1 more.
    assert decode_ticket(_nested_in_unknown_field(MAX_NESTING_DEPTH - 1), 1 << 20).ticket_id == "T"
    with pytest.raises(DecodeError) as caught:
        decode_ticket(_nested_in_unknown_field(MAX_NESTING_DEPTH), 1 << 20)
    assert caught.value.error_type == "too_deeply_nested"
    brackets = '[{\\"' * 10_000  # escaped quotes must not end the string early
    value = f'{{"ticket_id": "T", "body": "{brackets}"}}'.encode()
    assert decode_ticket(value, 1 << 20).body == brackets.replace('\\"', '"')


def test_the_same_value_gets_the_same_answer_however_deep_the_callers_stack() -> None:
    """msgspec's own limit shrinks with the caller's stack; the decoder's fixed limit does not."""
    value = _nested_in_unknown_field(MAX_NESTING_DEPTH - 1)

    def at_depth(frames: int) -> TicketEvent | DecodeError:
        if frames:
            return at_depth(frames - 1)
        try:
            return decode_ticket(value, 1 << 20)
        except DecodeError as error:
            return error

    assert at_depth(0) == at_depth(200) == decode_ticket(value, 1 << 20)
    # 20 frames short of Python's recursion limit even this value cannot be parsed: still a DecodeError.
    answer = at_depth(sys.getrecursionlimit() - _stack_depth() - 20)
    assert isinstance(answer, DecodeError)
    assert answer.error_type == "undecodable" and "RecursionError" in answer.message


def _stack_depth() -> int:
    frame: FrameType | None = sys._getframe()
    depth = 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1
    return depth


class _BrokenDecoder:
    def decode(self, value: bytes) -> TicketEvent:
        raise _Unprintable("boom")


class _Unprintable(RuntimeError):
    def __str__(self) -> str:
        raise ValueError("no text either")


def test_any_other_library_failure_becomes_undecodable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(decoding, "_DECODER", _BrokenDecoder())
    with pytest.raises(DecodeError) as caught:
        decode_ticket(b'{"ticket_id": "T", "body": "b"}', LIMIT)
    assert caught.value.error_type == "undecodable"
    assert caught.value.message == "the decoder failed on this value: _Unprintable: (no description)"


def test_messages_never_quote_more_than_a_short_excerpt_of_the_input() -> None:
    key = "k" * 100_000
    value = msgspec.json.encode({"ticket_id": "T", "body": "b", "metadata": {key: 5}})
    with pytest.raises(DecodeError) as caught:
        decode_ticket(value, 1 << 20)
    assert caught.value.error_type == "wrong_type"
    assert caught.value.message.startswith("`metadata.kkk") and "…` must be a string" in caught.value.message
    assert len(caught.value.message) <= MAX_MESSAGE_CHARS and len(str(caught.value)) < 400


@pytest.mark.parametrize(
    ("value", "error_type", "message"),
    [
        # Numbers msgspec cannot hold in a known field: out of range, not a crash in int().
        (b'{"ticket_id": "T", "body": ' + b"9" * 5000 + b"}", "invalid_json", "Integer value out of range"),
        (b'{"ticket_id": "T", "body": 1e999999}', "invalid_json", "Number out of range"),
        (b'{"ticket_id": "T", "body": "\\ud800"}', "invalid_json", "not valid JSON"),  # lone surrogate
        (b'{"ticket_id": "T", "body": "b", "x": "\\udc00x"}', "invalid_json", "invalid utf-16 surrogate"),
        # Duplicate keys: the last one counts, and every one must be valid.
        (b'{"ticket_id": "T", "ticket_id": "", "body": "b"}', "empty_field", "`ticket_id` must not be empty"),
        (b'{"ticket_id": "", "ticket_id": "T", "body": "b"}', "wrong_type", "length >= 1 - at $.ticket_id"),
    ],
)
def test_number_surrogate_and_duplicate_key_edge_cases(value: bytes, error_type: str, message: str) -> None:
    with pytest.raises(DecodeError) as caught:
        decode_ticket(value, 1 << 20)
    assert (caught.value.error_type, message in caught.value.message) == (error_type, True), caught.value


def test_a_huge_number_in_an_unknown_field_is_skipped_like_any_unknown_field() -> None:
    value = b'{"ticket_id": "T", "body": "b", "amount": ' + b"9" * 100_000 + b"}"
    assert decode_ticket(value, 1 << 20).ticket_id == "T"
