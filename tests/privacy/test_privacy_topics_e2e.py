"""Issue #43, items 6 to 8, on the real broker: a worker pipeline (run in this process, answering at once: the
model is not what is tested) with every ticket sent to review and to a shadow, `dead_letter.redact = true`
and `privacy.keep = ["phone"]`, given a ticket whose key, headers and text hold identifiers in the forms the
detector missed (no-break, narrow no-break and thin spaces between digit groups, a Punycode domain) and
records that are no tickets, with identifiers behind JSON escapes, behind the Schema Registry's framing, and
in a binary value. No identifier may reach the output, review, shadow or dead-letter topics in clear, but
the phone number `privacy.keep` leaves to the reviewers, on the review topic's text only.

Then with the real Schema Registry: a JSON Schema ticket dead-lettered (`missing_field`: the worker's field
mapping was wrong) and redacted still decodes with its schema once the mapping is fixed, as a replay of it
would be: the framing is kept."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import confluent_kafka
import msgspec
import pytest
from doubles import InstantClassifier, Running

from tools.harness import Topics, make_topics, read_topic, settings_for, wait_until_committed
from worker.app.doors import TriageParts, group_pipeline
from worker.app.stages import start_review
from worker.classification import FallbackLabel
from worker.contracts.input import decoder_for
from worker.dev.local_registry import LocalRegistry
from worker.kafka.clients import ClientErrorLog, create_producer, record_headers
from worker.kafka.dead_letters import ERROR_TYPE, OMITTED_BYTES, REDACTED
from worker.messages import ReviewRecord, TriageResult
from worker.pipeline.side_topics.shadow import Shadow

pytestmark = [pytest.mark.kafka]

FALLBACK = FallbackLabel("unclassified", "Medium")
TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
KEPT = "+44 20 7946 0958"  # `privacy.keep = ["phone"]`: in clear on the review topic's text only
TICKET = {
    "ticket_id": "T-1",
    "subject": f"refund, call me on {KEPT}",
    "body": "card 4111\u202f1111\u202f1111\u202f1111, "
    "IBAN GB82\u2009WEST\u20091234\u20095698\u20097654\u200932, or write to john@xn--fsq.xn--fiqs8s",
}
TICKET_HEADERS: list[tuple[str, str | bytes | None]] = [
    ("traceparent", TRACEPARENT),
    ("reply-to", b"jane.doe@example.com"),
    ("card", "5555\u00a05555\u00a05555\u00a04444".encode()),
    ("phone", KEPT.encode()),
]
# Magic byte 0 and a schema id: the Schema Registry's wire format.
FRAMING = b"\x00\x00\x00\x01\x2c"
POISON = {
    # JSON Schema framing, identifiers behind JSON escapes: a worker reading plain JSON refuses it.
    b"P-framed": FRAMING
    + rb'{"ticket_id": "P-1", "body": "card \u0034539 1488 0343 6467, jo\u0040example.com"}',
    # Not JSON (no closing brace): text, escapes and all.
    b"P-text": rb'{"ticket_id": "P-2", "body": "IBAN DE89 3704 0044 0532 0130 00, ssn 123\u002d45-6789, '
    rb"call +44 20 7946 0958",
    # Avro behind the framing: a length byte (`,`) glued to the card.
    b"P-avro": FRAMING + b"\x08T-96,6011 0009 9013 9424 ok\x06",
}
# Every identifier above, as written and as a reader decodes it; the kept number is checked on its own.
IDENTIFIERS = [
    "jane.doe@example.com",
    "4111\u202f1111\u202f1111\u202f1111",
    "5555\u00a05555\u00a05555\u00a04444",
    "GB82\u2009WEST",
    "john@xn--fsq",
    "xn--fiqs8s",
    "4539 1488 0343 6467",
    "\\u0034539 1488",
    "jo@example.com",
    "jo\\u0040example.com",
    "DE89 3704 0044 0532 0130 00",
    "123-45-6789",
    "123\\u002d45-6789",
    "6011 0009 9013 9424",
]


def _texts(message: confluent_kafka.Message) -> Iterator[str]:
    """A record's key, value (raw and, where it is JSON behind a framing or not, with its escapes resolved)
    and header names and values, as text."""
    value = message.value() or b""
    for raw in (message.key() or b"", value):
        yield raw.decode("utf-8", errors="replace")
    for payload in (value, value[len(FRAMING) :]):
        with contextlib.suppress(ValueError):
            yield json.dumps(json.loads(payload), ensure_ascii=False)
    for name, header in record_headers(message) or []:
        yield f"{name}: {(header or b'').decode('utf-8', errors='replace')}"


def _leaks(messages: Iterable[confluent_kafka.Message], identifiers: list[str]) -> list[str]:
    return [i for message in messages for text in _texts(message) for i in identifiers if i in text]


def _publish(bootstrap: str, topic: str) -> None:
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap})
    ticket = json.dumps(TICKET, ensure_ascii=False).encode()
    producer.produce(topic, ticket, key=b"jane.doe@example.com", headers=TICKET_HEADERS)
    for key, value in POISON.items():
        producer.produce(topic, value, key=key, headers=[("reply-to", b"jane.doe@example.com")])
    assert producer.flush(30) == 0


def test_no_identifier_reaches_a_topic_in_clear_through_keys_headers_separators_or_dead_letters(
    kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    topics: Topics = make_topics(unique_topic, partitions=1)
    review, shadow = unique_topic("review", partitions=1), unique_topic("shadow", partitions=1)
    settings = settings_for(
        kafka_bootstrap,
        topics,
        **{
            "pipeline.group_id": f"privacy-topics-{uuid.uuid4().hex[:8]}",
            "dead_letter.redact": "true",
            "privacy.keep": "phone",
            "review.threshold": "1.0",  # every classified ticket goes to review
            "topics.review": review,
            "topics.shadow": shadow,
        },
    )
    _publish(kafka_bootstrap, topics.input)
    producer = create_producer(settings.kafka, ClientErrorLog("shadow-producer"))
    side = Shadow(InstantClassifier(), 8, producer, shadow, 60.0)
    parts = TriageParts(InstantClassifier(), FALLBACK, 64, shadow=side, review=start_review(settings))
    pipeline = group_pipeline(settings, parts)
    worker = Running(pipeline, settings.pipeline.group_id)
    try:
        wait_until_committed(kafka_bootstrap, worker.group, topics.input, timeout=90)
    finally:
        assert worker.stop() == 0

    (output,) = read_topic(kafka_bootstrap, topics.output)
    (reviewed,) = read_topic(kafka_bootstrap, review)
    (shadowed,) = read_topic(kafka_bootstrap, shadow)
    letters = {message.key(): message for message in read_topic(kafka_bootstrap, topics.dead_letter)}
    assert _leaks([output, reviewed, shadowed, *letters.values()], IDENTIFIERS) == []
    assert _leaks([output, shadowed, *letters.values()], [KEPT]) == []

    # The triage record and its copies: keyed by the ticket id (the key was an e-mail address), the
    # headers redacted, trace context intact.
    carried = [
        ("traceparent", TRACEPARENT),
        ("reply-to", b"[email]"),
        ("card", "[card ••••4444]".encode()),
        ("phone", b"[phone]"),
    ]
    for message in (output, reviewed, shadowed):
        assert (message.key(), record_headers(message)) == (b"T-1", carried)
    result = msgspec.json.decode(output.value() or b"", type=TriageResult)
    assert result.pii == ["email", "iban", "card_number", "phone"]
    record = msgspec.json.decode(reviewed.value() or b"", type=ReviewRecord)
    assert record.subject == f"refund, call me on {KEPT}"
    assert record.body == "card [card ••••1111], IBAN [iban], or write to [email]"

    # Dead letters: every key and header redacted, each value by its wire format.
    assert set(letters) == set(POISON)
    framed = letters[b"P-framed"]
    assert (framed.value() or b"")[:5] == FRAMING
    assert json.loads((framed.value() or b"")[5:]) == {
        "ticket_id": "P-1",
        "body": "card [card ••••6467], [email]",
    }
    text = letters[b"P-text"].value() or b""
    assert text == b'{"ticket_id": "P-2", "body": "IBAN [iban], ssn [ssn], call [phone]'
    dropped = letters[b"P-avro"]
    assert dropped.value() is None
    headers = {name: value for name, value in record_headers(dropped) or []}
    assert headers[OMITTED_BYTES] == str(len(POISON[b"P-avro"])).encode()
    forms = {key: dict(record_headers(letter) or [])[REDACTED] for key, letter in letters.items()}
    assert forms == {b"P-framed": b"json", b"P-text": b"text", b"P-avro": b"dropped"}


# -- the Schema Registry -------------------------------------------------------------------------------------

HELPDESK_JSON = {
    "type": "object",
    "properties": {"id": {"type": "string"}, "text": {"type": "string"}, "email": {"type": "string"}},
    "required": ["id", "text"],
}


def test_a_redacted_json_schema_dead_letter_still_decodes_with_its_schema(
    schema_registry: LocalRegistry, kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.json_schema import JSONSerializer
    from confluent_kafka.serialization import MessageField, SerializationContext

    topics = make_topics(unique_topic, partitions=1)
    client: Any = SchemaRegistryClient({"url": schema_registry.url})
    serialize = JSONSerializer(json.dumps(HELPDESK_JSON), client)
    registered = serialize({"id": "X", "text": "x"}, SerializationContext(topics.input, MessageField.VALUE))
    framing = bytes(registered or b"")[:5]  # the schema id the registry gave
    text = rb"card \u0034111 1111 1111 1111, mail jo\u0040example.com"
    payload = b'{"id": "J-1", "text": "' + text + b'", "email": "a@b.example"}'
    producer = confluent_kafka.Producer({"bootstrap.servers": kafka_bootstrap})
    producer.produce(topics.input, framing + payload, key=b"J-1")
    assert producer.flush(30) == 0
    wrong = {"input.fields.ticket_id": "id", "input.fields.body": "description"}  # the producer's is `text`
    settings = settings_for(
        kafka_bootstrap,
        topics,
        **{
            "pipeline.group_id": f"privacy-registry-{uuid.uuid4().hex[:8]}",
            "input.format": "json_schema",
            "schema_registry.url": schema_registry.url,
            "dead_letter.redact": "true",
            **wrong,
        },
    )
    pipeline = group_pipeline(
        settings,
        TriageParts(
            InstantClassifier(),
            FALLBACK,
            64,
            decoder=decoder_for(settings.input, settings.schema_registry, settings.pipeline.max_value_bytes),
        ),
    )
    worker = Running(pipeline, settings.pipeline.group_id)
    try:
        wait_until_committed(kafka_bootstrap, worker.group, topics.input, timeout=90)
    finally:
        assert worker.stop() == 0

    (letter,) = read_topic(kafka_bootstrap, topics.dead_letter)
    assert dict(record_headers(letter) or [])[ERROR_TYPE] == b"missing_field"
    value = letter.value() or b""
    assert value[:5] == framing and b"\\u0034" not in value and b"jo@example.com" not in value
    fixed = msgspec.structs.replace(
        settings, input=msgspec.structs.replace(settings.input, fields={"ticket_id": "id", "body": "text"})
    )
    decoder = decoder_for(fixed.input, fixed.schema_registry, fixed.pipeline.max_value_bytes)
    assert decoder is not None
    ticket = decoder.decode(value, topics.input)
    assert (ticket.ticket_id, ticket.body) == ("J-1", "card [card ••••1111], mail [email]")
