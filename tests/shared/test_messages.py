"""Message contracts: TriageResult round trips, its constraints, and the dead-letter header contract."""

from __future__ import annotations

import datetime

import msgspec
import pytest

from worker.kafka import dead_letters
from worker.kafka.dead_letters import (
    DeadLetterHeaderError,
    DeadLetterInfo,
    dead_letter_headers,
    read_dead_letter,
    replay_headers,
    truncate_message,
)
from worker.messages import SCHEMA_VERSION, SourcePosition, TriageResult


def _result(**changes: object) -> TriageResult:
    result = TriageResult(
        schema_version=SCHEMA_VERSION,
        ticket_id="T-1",
        intent="card_payment_wrong_amount",
        priority="High",
        confidence=0.82,
        fallback=False,
        fallback_reason=None,
        scores={"card_payment_wrong_amount": 0.82, "refund_not_showing_up": 0.11},
        model="triage-mini",
        latency_ms=41.5,
        classified_at="2024-05-01T12:30:00.123Z",
        source=SourcePosition(topic="tickets.raw", partition=2, offset=1234),
        truncated=False,
        pii=[],
    )
    return msgspec.structs.replace(result, **changes)


def test_triage_result_round_trips_through_json() -> None:
    result = _result()
    assert msgspec.json.decode(msgspec.json.encode(result), type=TriageResult) == result


@pytest.mark.parametrize(
    ("field", "bad", "expected"),
    [
        ("priority", "Urgent", "Invalid enum value 'Urgent' - at `$.priority`"),
        ("confidence", 1.5, "Expected `float` <= 1.0 - at `$.confidence`"),
        ("fallback_reason", "timeout", "Invalid enum value 'timeout' - at `$.fallback_reason`"),
        ("classified_at", "today", "at `$.classified_at`"),
        ("ticket_id", "", "Expected `str` of length >= 1 - at `$.ticket_id`"),
        ("pii", ["passport"], "Invalid enum value 'passport' - at `$.pii[0]`"),
    ],
)
def test_consumers_reject_results_outside_the_contract(field: str, bad: object, expected: str) -> None:
    document = msgspec.to_builtins(_result())
    document[field] = bad
    with pytest.raises(msgspec.ValidationError) as caught:
        msgspec.json.decode(msgspec.json.encode(document), type=TriageResult)
    assert expected in str(caught.value)


FAILED_AT = datetime.datetime(2024, 5, 1, 12, 30, 0, 123000, tzinfo=datetime.UTC)


def test_dead_letter_keeps_original_headers_and_adds_the_contract() -> None:
    original = [("trace-id", b"abc"), ("empty", None), ("trace-id", b"def")]
    headers = dead_letter_headers(
        original,
        "missing_field",
        "required field `body` is missing",
        "tickets.raw",
        2,
        99,
        failed_at=FAILED_AT,
    )
    assert headers[:3] == original
    assert dict(headers[3:]) == {
        "triage.error.type": b"missing_field",
        "triage.error.message": b"required field `body` is missing",
        "triage.source.topic": b"tickets.raw",
        "triage.source.partition": b"2",
        "triage.source.offset": b"99",
        "triage.failed_at": b"2024-05-01T12:30:00.123Z",
        "triage.replay_count": b"0",
    }
    assert read_dead_letter(headers) == DeadLetterInfo(
        error_type="missing_field",
        error_message="required field `body` is missing",
        topic="tickets.raw",
        partition=2,
        offset=99,
        failed_at="2024-05-01T12:30:00.123Z",
        replay_count=0,
    )


def test_failed_at_is_utc_even_for_a_local_clock() -> None:
    local = FAILED_AT.astimezone(datetime.timezone(datetime.timedelta(hours=5)))
    headers = dict(dead_letter_headers(None, "invalid_json", "x", "t", 0, 0, failed_at=local))
    assert headers["triage.failed_at"] == b"2024-05-01T12:30:00.123Z"


def test_replayed_record_failing_again_does_not_pile_up_headers() -> None:
    first = dead_letter_headers([("trace-id", b"abc")], "invalid_json", "first", "tickets.raw", 0, 5)
    replayed = replay_headers(first)
    assert replayed == [("trace-id", b"abc"), ("triage.replay_count", b"1")]

    second = dead_letter_headers(replayed, "wrong_type", "second", "tickets.raw", 1, 77)
    names = [name for name, _ in second]
    assert sorted(names) == sorted(["trace-id", *dead_letters.DEAD_LETTER_HEADERS])
    info = read_dead_letter(second)
    assert (info.error_type, info.error_message, info.offset, info.replay_count) == (
        "wrong_type",
        "second",
        77,
        1,
    )


def test_long_error_message_is_cut_to_1_kib_on_a_character_boundary() -> None:
    message = "`metadata.ключ` must be a string, " + "ж" * 2000
    cut = truncate_message(message)
    assert len(cut.encode("utf-8")) <= dead_letters.MAX_MESSAGE_BYTES
    assert cut.endswith("…") and message.startswith(cut[:-1])
    headers = dict(dead_letter_headers(None, "wrong_type", message, "t", 0, 0))
    assert headers["triage.error.message"] == cut.encode("utf-8")
    assert truncate_message("short") == "short"


def test_reading_a_record_that_is_not_a_dead_letter_names_the_missing_header() -> None:
    with pytest.raises(DeadLetterHeaderError, match=r"header triage\.\S+ is missing"):
        read_dead_letter([("trace-id", b"abc")])
    headers = dead_letter_headers(None, "invalid_json", "x", "t", 0, 0)
    broken = [(name, b"-1" if name == "triage.source.offset" else value) for name, value in headers]
    with pytest.raises(
        DeadLetterHeaderError, match=r"triage\.source\.offset must be a decimal number, got '-1'"
    ):
        read_dead_letter(broken)
