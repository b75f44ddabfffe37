"""Issue #43, items 6 and 7, pure logic: what the worker's copies of a record keep of its raw bytes. A
redacted dead letter's value by its wire format (JSON Schema framing, JSON, text, binary), its key and
headers, the worker's own words about it whatever `privacy.keep` says; a triage record's key and the input
headers it carries; and settings that promise a redaction with nothing to detect, refused at start. On the
real broker: tests/privacy/test_privacy_topics_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from worker.app.application import with_zero_shot_review
from worker.cli.cli import main
from worker.errors import UserError
from worker.kafka.dead_letters import ERROR_MESSAGE, OMITTED_BYTES, REDACTED, REPLAY_COUNT, read_dead_letter
from worker.messages import SourcePosition, TicketEvent
from worker.pipeline.triage.records import DeadLetterRedaction, result_key
from worker.privacy.values import CarriedMetadata, redact_value
from worker.replay.outcomes import ReplayOutcome
from worker.replay.selection import ReplayOptions, not_kept, why_not_replayed
from worker.settings import PrivacySettings, Settings, load_settings

# Magic byte 0, schema id 300: the Schema Registry's wire format, as its JSON Schema serializer writes it.
FRAMING = b"\x00\x00\x00\x01\x2c"
SOURCE = SourcePosition(topic="tickets.raw", partition=2, offset=41)
# Identifiers behind JSON escapes: `\u0034` is "4", `\u0040` is "@".
ESCAPED_BODY = rb"card \u0034111111111111111, mail jo\u0040example.com"


def _settings(**env: str) -> Settings:
    return load_settings(env={"TRIAGE_DEAD_LETTER__REDACT": "true", **env})


def test_a_json_schema_framed_value_is_redacted_as_json_behind_its_framing() -> None:
    """The value was redacted as text: escapes hid the card and the address, and the framing was lost in the
    re-encoding; now the JSON after the 5-byte header is parsed, and the header kept for any reader."""
    payload = b'{"ticket_id": "T-1", "body": "' + ESCAPED_BODY + b'", "customer": 4111111111111111}'
    value, form = redact_value(FRAMING + payload, _settings().privacy.copy_redactor())
    assert form == "json" and value is not None and value[:5] == FRAMING
    assert json.loads(value[5:]) == {
        "ticket_id": "T-1",
        "body": "card [card ••••1111], mail [email]",
        "customer": "[card ••••1111]",  # a card sent as a JSON number
    }


def test_a_value_that_is_not_json_is_redacted_as_text_with_its_escapes_decoded() -> None:
    redactor = _settings().privacy.copy_redactor()
    broken = b'{"ticket_id": "T-1", "body": "' + ESCAPED_BODY  # not JSON: no closing quote or brace
    assert redact_value(broken, redactor) == (
        '{"ticket_id": "T-1", "body": "card [card ••••1111], mail [email]'.encode(),
        "text",
    )
    # Bytes that are not UTF-8 stay as they were, the text around them redacted.
    assert redact_value(b"latin-1 caf\xe9: 4111 1111 1111 1111", redactor) == (
        b"latin-1 caf\xe9: " + "[card ••••1111]".encode(),
        "text",
    )


def test_a_binary_value_is_left_out_and_replay_says_why_instead_of_sending_a_null() -> None:
    """Avro behind the wire format's header: a length byte (`,`) glued to the card hides it from any search
    of the bytes, so the value is dropped rather than kept in clear."""
    avro = FRAMING + b"\x08T-96,4111 1111 1111 1111 ok\x06"
    settings = _settings()
    key, value, headers = DeadLetterRedaction.configured(settings.privacy, settings.dead_letter).letter(
        b"T-96", avro, [(REPLAY_COUNT, b"1")], "schema_mismatch", "payload does not match", SOURCE
    )
    assert (key, value) == (b"T-96", None)
    assert dict(headers)[OMITTED_BYTES] == str(len(avro)).encode()
    info = read_dead_letter(headers)
    assert (info.redacted, info.omitted_bytes, info.replay_count) == ("dropped", len(avro), 1)
    assert why_not_replayed(info, ReplayOptions("tickets.dlq", "replay")) is ReplayOutcome.SHRUNK
    assert "left out by dead_letter.redact" in not_kept(info)


def test_privacy_keep_applies_to_the_review_topic_only_never_to_dead_letters() -> None:
    settings = _settings(TRIAGE_PRIVACY__KEEP="email")
    value = b'{"ticket_id": "", "body": "mail jane.doe@example.com"}'
    message = 'empty field; the record began {"ticket_id": "", "body": "mail jane.doe@example.com"'
    key, letter, headers = DeadLetterRedaction.configured(settings.privacy, settings.dead_letter).letter(
        b"jane.doe@example.com",
        value,
        [("reply-to", b"jane.doe@example.com")],
        "empty_field",
        message,
        SOURCE,
    )
    written = b"".join([key or b"", letter or b"", *(v or b"" for _, v in headers)])
    assert b"jane.doe@example.com" not in written
    assert dict(headers)["reply-to"] == b"[email]" and dict(headers)[REDACTED] == b"json"


def test_the_error_message_is_redacted_whatever_privacy_keep_and_detect_say() -> None:
    """`triage.error.message` is the worker's own words: every kind, none kept, even without
    `dead_letter.redact`."""
    settings = load_settings(env={"TRIAGE_PRIVACY__KEEP": "email", "TRIAGE_PRIVACY__DETECT": "email"})
    message = r"bad value: {\"body\": \"jo\u0040example.com, 4111 1111 1111 1111\""
    key, value, headers = DeadLetterRedaction.configured(settings.privacy, settings.dead_letter).letter(
        b"k", b"{", None, "invalid_json", message, SOURCE
    )
    assert (key, value) == (b"k", b"{")  # as taken: replay needs the original
    assert (
        dict(headers)[ERROR_MESSAGE] or b""
    ).decode() == r"bad value: {\"body\": \"[email], [card ••••1111]\""


@pytest.mark.parametrize(
    ("sets", "refused_because"),
    [
        (
            ["dead_letter.redact=true", "inference.redact_input=false"],
            "dead_letter.redact = true (from command line)",
        ),
        ([], "inference.redact_input = true (the default)"),
        (
            ["inference.redact_input=false", "review.fallbacks=true"],
            "review.fallbacks = true (from command line)",
        ),
    ],
)
def test_detecting_nothing_where_a_setting_promises_redaction_is_refused_at_start(
    sets: list[str], refused_because: str, capsys: pytest.CaptureFixture[str]
) -> None:
    arguments = ["config", "show", "--set", "privacy.detect="]
    for setting in sets:
        arguments += ["--set", setting]
    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and error.startswith(
        "triage-worker: error: config error: privacy.detect: [] "
    )
    assert refused_because in error


def test_detecting_nothing_is_refused_where_a_zero_shot_model_turns_review_on(tmp_path: Path) -> None:
    folder = tmp_path / "day0"
    folder.mkdir()
    (folder / "VERSION").write_text("zero-shot\n")
    env = {"TRIAGE_PRIVACY__DETECT": "", "TRIAGE_INFERENCE__REDACT_INPUT": "false"}
    settings = load_settings(env={**env, "TRIAGE_INFERENCE__MODEL": str(folder)})
    refused = r"^config error: privacy.detect: \[\] detects nothing, so the review topic"
    with pytest.raises(UserError, match=refused):
        with_zero_shot_review(settings)


def test_detecting_nothing_is_accepted_where_nothing_promises_redaction() -> None:
    settings = load_settings(env={"TRIAGE_PRIVACY__DETECT": "", "TRIAGE_INFERENCE__REDACT_INPUT": "false"})
    assert settings.privacy.detect == []


def test_a_triage_record_carries_no_personal_data_in_its_key_or_headers() -> None:
    """Input headers and keys were copied unscanned into the triage record and from there to the review and
    shadow topics (`reply-to: jane.doe@example.com`, `card: 4111 1111 1111 1111`)."""
    carried = CarriedMetadata(PrivacySettings(keep=["email"]).copy_redactor(), ["*"])
    headers = [
        ("traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
        ("reply-to", b"jane.doe@example.com"),
        ("card", b"4111\xc2\xa01111\xc2\xa01111\xc2\xa01111"),  # no-break spaces, UTF-8
        ("trace-id", b"\x9f\x00\x01"),  # binary: kept as it is
        ("empty", None),
    ]
    assert carried.headers(headers) == [
        headers[0],
        ("reply-to", b"[email]"),
        ("card", "[card ••••1111]".encode()),
        headers[3],
        headers[4],
    ]
    event = TicketEvent(ticket_id="T-7", body="hello")
    assert result_key(b"jane.doe@example.com", event, carried) == b"T-7"
    assert result_key(b"+44 20 7946 0958", event, carried) == b"T-7"
    assert result_key(b"customer-123456", event, carried) == b"customer-123456"


def test_privacy_carry_headers_names_the_headers_carried_besides_the_worker_s_own() -> None:
    settings = load_settings(env={"TRIAGE_PRIVACY__CARRY_HEADERS": "traceparent, TraceState"})
    carried = CarriedMetadata(settings.privacy.copy_redactor(), settings.privacy.carry_headers)
    headers = [
        ("traceparent", b"00-1"),
        ("customer-name", b"Jane Doe"),  # no kind the detector knows: only the list keeps it out
        ("tracestate", b"k=v"),
        ("triage.replay_count", b"2"),
    ]
    assert carried.headers(headers) == [headers[0], headers[2], headers[3]]
    nothing = CarriedMetadata(settings.privacy.copy_redactor(), [])
    assert nothing.headers(headers) == [headers[3]]
