"""Unit tests of the input formats and the field mapping (worker/contracts/input.py) against the client's
in-process `mock://` registry: they prove the decoding rules, not a real registry."""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest

pytest.importorskip("fastavro", reason="the avro extra of confluent-kafka is not installed")

import httpx2
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.error import SchemaRegistryError
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, wrappers_pb2

from worker.contracts.input import (
    RegistryUnavailable,
    TicketDecoder,
    decoder_for,
    map_fields,
    registry_outcome,
)
from worker.decoding import DecodeError, decode_ticket
from worker.dev import local_broker
from worker.errors import UserError
from worker.settings import load_settings

TOPIC = "helpdesk.tickets"
LIMIT = 1_000_000
# A helpdesk export's own shape: none of TicketEvent's names, the customer nested.
HELPDESK_AVRO = json.dumps(
    {
        "type": "record",
        "name": "HelpdeskTicket",
        "fields": [
            {"name": "id", "type": "string"},
            {"name": "description", "type": "string"},
            {"name": "title", "type": ["null", "string"], "default": None},
            {
                "name": "requester",
                "type": {
                    "type": "record",
                    "name": "Requester",
                    "fields": [{"name": "email", "type": "string"}],
                },
            },
            {"name": "priority_hint", "type": "int"},
        ],
    }
)
MAPPING = {"ticket_id": "id", "body": "description", "subject": "title", "customer_id": "requester.email"}
HELPDESK_RECORD: dict[str, Any] = {
    "id": "HD-1",
    "description": "I was charged twice",
    "title": "Billing",
    "requester": {"email": "ana@example.com"},
    "priority_hint": 2,
}


def _ctx() -> SerializationContext:
    return SerializationContext(TOPIC, MessageField.VALUE)


@pytest.fixture
def registry() -> Any:
    # A fresh in-process registry per test: mock:// clients with the same URL share state.
    return SchemaRegistryClient.new_client({"url": f"mock://{id(object())}"})


def test_avro_ticket_with_mapped_nested_fields_decodes(registry: Any) -> None:
    value = AvroSerializer(registry, HELPDESK_AVRO)(HELPDESK_RECORD, _ctx())
    event = TicketDecoder("avro", MAPPING, LIMIT, registry).decode(value, TOPIC)
    assert (event.ticket_id, event.body, event.subject, event.customer_id) == (
        "HD-1",
        "I was charged twice",
        "Billing",
        "ana@example.com",
    )


def test_json_schema_ticket_decodes_and_a_failing_payload_is_a_schema_mismatch(registry: Any) -> None:
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"id": {"type": "string"}, "description": {"type": "string"}},
            "required": ["id", "description"],
        }
    )
    good = JSONSerializer(schema, registry)({"id": "J-1", "description": "reset my password"}, _ctx())
    decoder = TicketDecoder("json_schema", {"ticket_id": "id", "body": "description"}, LIMIT, registry)
    assert decoder.decode(good, TOPIC).body == "reset my password"
    # Same schema id, a payload its schema refuses (`id` must be a string).
    bad = good[:5] + b'{"id": 5, "description": "x"}'
    with pytest.raises(DecodeError) as caught:
        decoder.decode(bad, TOPIC)
    assert caught.value.error_type == "schema_mismatch"


@pytest.mark.parametrize(
    ("value", "error_type"),
    [
        (b'{"ticket_id": "t", "body": "plain json on an avro topic"}', "invalid_wire_format"),
        (b"\x00\x00", "invalid_wire_format"),
        (None, "null_value"),
    ],
)
def test_bad_registry_input_is_a_dead_letter_with_its_reason(
    registry: Any, value: bytes | None, error_type: str
) -> None:
    with pytest.raises(DecodeError) as caught:
        TicketDecoder("avro", MAPPING, LIMIT, registry).decode(value, TOPIC)
    assert caught.value.error_type == error_type


def test_truncated_avro_payload_is_a_schema_mismatch(registry: Any) -> None:
    value = AvroSerializer(registry, HELPDESK_AVRO)(HELPDESK_RECORD, _ctx())
    with pytest.raises(DecodeError) as caught:
        TicketDecoder("avro", MAPPING, LIMIT, registry).decode(value[:9], TOPIC)
    assert caught.value.error_type == "schema_mismatch"


def test_a_missing_mapped_field_names_both_names() -> None:
    with pytest.raises(DecodeError) as caught:
        map_fields({"id": "x"}, {"ticket_id": "id", "body": "description"})
    assert caught.value.error_type == "missing_field"
    assert "`body`" in caught.value.message and "`description`" in caught.value.message


def test_mapped_plain_json_keeps_the_plain_rules() -> None:
    decoder = TicketDecoder("json", {"ticket_id": "id", "body": "text.en"}, LIMIT)
    assert decoder.decode(b'{"id": "7", "text": {"en": "hello"}}', TOPIC).body == "hello"
    with pytest.raises(DecodeError) as caught:
        decoder.decode(b'{"id": "7", "text": {"en": "  "}}', TOPIC)
    assert caught.value.error_type == "empty_ticket"
    with pytest.raises(DecodeError) as caught:
        decoder.decode(b'{"id": ', TOPIC)
    assert caught.value.error_type == "invalid_json"


def test_mapped_plain_json_reads_a_bom_and_refuses_deep_nesting_as_a_dead_letter() -> None:
    decoder = TicketDecoder("json", {"ticket_id": "id", "body": "description"}, LIMIT)
    assert decoder.decode(b'\xef\xbb\xbf{"id": "7", "description": "hi"}', TOPIC).ticket_id == "7"
    deep = b'{"id": "7", "description": "hi", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(DecodeError) as caught:
        decoder.decode(deep, TOPIC)
    assert caught.value.error_type == "too_deeply_nested"


def test_an_unreachable_registry_is_retried_not_dead_lettered() -> None:
    # Port 9 (discard) on loopback: nothing listens, the connection is refused at once.
    client = SchemaRegistryClient({"url": "http://127.0.0.1:9", "timeout": 2})
    with pytest.raises(RegistryUnavailable):
        TicketDecoder("avro", MAPPING, LIMIT, client).decode(b"\x00\x00\x00\x00\x01\x02a", TOPIC)


# -- what each answer of the registry means for the record (docs/schema-registry.md) ------------------------

# What an HTTP layer in front of the registry may echo back in the body of a refusal: our own request header.
ECHOED_CREDENTIALS = "Basic " + base64.b64encode(b"triage:s3cret").decode()


@pytest.mark.parametrize(
    ("error", "cause"),
    [
        # Credentials rotated, an ACL changed: the record is fine, our access is not.
        (SchemaRegistryError(401, 40101, f"Unauthorized: {ECHOED_CREDENTIALS}"), "credentials"),
        (
            SchemaRegistryError(403, 40301, f"User cannot access the resource: {ECHOED_CREDENTIALS}"),
            "credentials",
        ),
        # Away or overloaded.
        (SchemaRegistryError(500, 50001, f"Backend data store: {ECHOED_CREDENTIALS}"), "outage"),
        (SchemaRegistryError(503, -1, "Unknown Schema Registry Error: b'<html>...</html>'"), "outage"),
        (SchemaRegistryError(408, 408, "Request Timeout"), "outage"),
        (SchemaRegistryError(429, 42901, "Rate limit exceeded"), "outage"),
        (httpx2.ConnectError("[Errno 111] Connection refused"), "outage"),
        (httpx2.ReadTimeout("timed out"), "outage"),
        (ConnectionResetError(104, "Connection reset by peer"), "outage"),
        # Answers that say nothing about the record: a bad request, a 404 that is not "no such schema id"
        # (schema_registry.url without the API's path: Apicurio answers this one), a reference's subject gone,
        # and bodies the client cannot read as the registry's (a proxy's page, an empty object).
        (SchemaRegistryError(400, 40001, f"Bad Request: {ECHOED_CREDENTIALS}"), "registry_error"),
        (
            SchemaRegistryError(404, 404, "RESTEASY003210: Could not find resource for full path"),
            "registry_error",
        ),
        (SchemaRegistryError(404, 40401, "Subject 'refs-value' not found."), "registry_error"),
        (SchemaRegistryError(422, 42202, "Invalid version"), "registry_error"),
        (
            SchemaRegistryError(407, -1, f"Unknown Schema Registry Error: b'{ECHOED_CREDENTIALS}'"),
            "registry_error",
        ),
        (json.JSONDecodeError("Expecting value", "<html>", 0), "registry_error"),
        (KeyError("schema"), "registry_error"),
    ],
)
def test_a_registry_answer_that_says_nothing_about_the_record_holds_it_with_its_cause(
    error: BaseException, cause: str
) -> None:
    outcome = registry_outcome(error, 7)
    assert isinstance(outcome, RegistryUnavailable)
    assert outcome.cause == cause
    assert str(outcome) == f"{cause}: {outcome.message}"
    # Never an answer's body: whatever stands in front of the registry may echo our request in it.
    assert "s3cret" not in outcome.message and ECHOED_CREDENTIALS not in outcome.message


def test_only_no_such_schema_id_dead_letters_the_record() -> None:
    # Confluent's answer, and Apicurio's and Karapace's (tests/contracts/test_registry_e2e.py asks Apicurio).
    outcome = registry_outcome(SchemaRegistryError(404, 40403, "Schema 7 not found"), 7)
    assert isinstance(outcome, DecodeError)
    assert (outcome.error_type, outcome.message) == (
        "unknown_schema",
        "schema id 7 is not in the schema registry",
    )


def test_the_cause_is_named_where_the_operator_looks() -> None:
    refused = registry_outcome(SchemaRegistryError(401, 40101, "Unauthorized"), 7)
    assert refused.message.startswith("schema registry refuses our credentials (401): check ")
    assert "schema_registry.basic_auth_user_info" in refused.message
    assert "schema_registry.url" in registry_outcome(SchemaRegistryError(404, 404, "no such path"), 7).message
    # Its status and error code say what is wrong with it; its words are not quoted (they may echo us).
    overloaded = registry_outcome(SchemaRegistryError(500, 50001, "backend store"), 7).message
    assert overloaded == "schema registry unavailable or overloaded (answered 500, error code 50001)"


@pytest.mark.parametrize(
    ("failure", "cause"),
    [
        (SchemaRegistryError(401, 40101, "Unauthorized"), "credentials"),
        (SchemaRegistryError(403, 40301, "Forbidden"), "credentials"),
        (SchemaRegistryError(400, 400, "Bad Request"), "registry_error"),
        # A proxy's 200 page where the registry's JSON should be: the client fails to parse it.
        (json.JSONDecodeError("Expecting value", "<html>", 0), "registry_error"),
    ],
)
def test_a_registry_that_refuses_us_or_answers_garbage_never_dead_letters_a_valid_record(
    registry: Any, failure: BaseException, cause: str
) -> None:
    value = AvroSerializer(registry, HELPDESK_AVRO)(HELPDESK_RECORD, _ctx())
    client = _failing(failure)  # a registry that has not seen the schema yet and fails when asked
    decoder = TicketDecoder("avro", MAPPING, LIMIT, client)
    with pytest.raises(RegistryUnavailable) as caught:
        decoder.decode(value, TOPIC)
    assert caught.value.cause == cause
    # Once it answers, the same record decodes.
    client.get_schema = registry.get_schema
    assert decoder.decode(value, TOPIC).ticket_id == "HD-1"


def _failing(error: BaseException) -> Any:
    """An in-process registry whose every schema lookup fails with `error`."""
    client: Any = SchemaRegistryClient.new_client({"url": f"mock://{id(object())}"})

    def fail(*_args: Any, **_kwargs: Any) -> Any:
        raise error

    client.get_schema = fail
    return client


# -- bytes fields and empty strings ------------------------------------------------------------------------

BYTES_AVRO = json.dumps(
    {
        "type": "record",
        "name": "MailTicket",
        "fields": [
            {"name": "id", "type": "string"},
            {"name": "raw_body", "type": "bytes"},
            {"name": "headers", "type": {"type": "map", "values": "bytes"}},
        ],
    }
)
BYTES_MAPPING = {"ticket_id": "id", "body": "raw_body", "metadata": "headers"}


def test_an_avro_bytes_field_mapped_to_the_body_is_read_as_utf8_text_not_base64(registry: Any) -> None:
    text = "Mi tarjeta fue robada, ¿qué hago?"
    value = AvroSerializer(registry, BYTES_AVRO)(
        {"id": "M-1", "raw_body": text.encode(), "headers": {"lang": b"es"}}, _ctx()
    )
    ticket = TicketDecoder("avro", BYTES_MAPPING, LIMIT, registry).decode(value, TOPIC)
    assert (ticket.body, ticket.metadata) == (text, {"lang": "es"})


def test_avro_bytes_that_are_not_utf8_text_are_a_dead_letter_naming_the_field(registry: Any) -> None:
    serialize = AvroSerializer(registry, BYTES_AVRO)
    decoder = TicketDecoder("avro", BYTES_MAPPING, LIMIT, registry)
    latin1 = serialize({"id": "M-2", "raw_body": "carte volée".encode("latin-1"), "headers": {}}, _ctx())
    with pytest.raises(DecodeError) as caught:
        decoder.decode(latin1, TOPIC)
    assert caught.value.error_type == "invalid_utf8"
    assert caught.value.message.startswith(
        "`body` (mapped to `raw_body`, input.fields.body) holds bytes that are not UTF-8 text"
    )
    header = serialize({"id": "M-3", "raw_body": b"hello", "headers": {"x": b"\xff"}}, _ctx())
    with pytest.raises(DecodeError) as caught:
        decoder.decode(header, TOPIC)
    assert caught.value.error_type == "invalid_utf8" and "`metadata.x`" in caught.value.message


def _support_ticket_class() -> Any:
    """A producer's Protobuf message with text in `bytes` fields, built at run time (no protoc):
    support.SupportTicket {string id = 1; string subject = 2; string text = 3; bytes raw_text = 4;
    Note note = 5; map<string, bytes> tags = 6; google.protobuf.BytesValue wrapped = 7;} with
    Note {bytes body = 1;}."""
    string, raw, message, optional, repeated = 9, 12, 11, 1, 3  # FieldDescriptorProto numbers
    proto = descriptor_pb2.FileDescriptorProto(name="support_units.proto", package="support", syntax="proto3")
    proto.dependency.append(wrappers_pb2.DESCRIPTOR.name)
    proto.message_type.add(name="Note").field.add(name="body", number=1, type=raw, label=optional)
    ticket = proto.message_type.add(name="SupportTicket")
    for number, (name, kind) in enumerate([("id", string), ("subject", string), ("text", string)], 1):
        ticket.field.add(name=name, number=number, type=kind, label=optional)
    ticket.field.add(name="raw_text", number=4, type=raw, label=optional)
    ticket.field.add(name="note", number=5, type=message, label=optional, type_name=".support.Note")
    entry = ticket.nested_type.add(name="TagsEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=string, label=optional)
    entry.field.add(name="value", number=2, type=raw, label=optional)
    ticket.field.add(
        name="tags", number=6, type=message, label=repeated, type_name=".support.SupportTicket.TagsEntry"
    )
    ticket.field.add(
        name="wrapped", number=7, type=message, label=optional, type_name=".google.protobuf.BytesValue"
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(descriptor_pb2.FileDescriptorProto.FromString(wrappers_pb2.DESCRIPTOR.serialized_pb))
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("support.SupportTicket"))


SupportTicket = _support_ticket_class()


def _protobuf(registry: Any, **fields: Any) -> bytes:
    serialize = ProtobufSerializer(SupportTicket, registry, {"use.deprecated.format": False})
    return bytes(serialize(SupportTicket(**fields), _ctx()) or b"")


def test_a_protobuf_ticket_with_a_subject_and_an_empty_body_is_a_ticket_as_in_plain_json(
    registry: Any,
) -> None:
    decoder = TicketDecoder("protobuf", {"ticket_id": "id", "body": "text"}, LIMIT, registry, SupportTicket)
    ticket = decoder.decode(_protobuf(registry, id="P-1", subject="Card stolen", text=""), TOPIC)
    assert (ticket.ticket_id, ticket.subject, ticket.body) == ("P-1", "Card stolen", "")
    # With no text at all, the plain-JSON rule: `empty_ticket`, as for {"ticket_id": "P-2", "body": ""}.
    with pytest.raises(DecodeError) as caught:
        decoder.decode(_protobuf(registry, id="P-2"), TOPIC)
    with pytest.raises(DecodeError) as plain:
        decode_ticket(b'{"ticket_id": "P-2", "body": ""}', LIMIT)
    assert caught.value.error_type == plain.value.error_type == "empty_ticket"


def test_protobuf_bytes_mapped_to_ticket_fields_are_read_as_utf8_text_or_a_dead_letter(registry: Any) -> None:
    text = "Mi tarjeta fue robada, ¿qué hago?"
    top = TicketDecoder(
        "protobuf",
        {"ticket_id": "id", "body": "raw_text", "metadata": "tags"},
        LIMIT,
        registry,
        SupportTicket,
    )
    ticket = top.decode(_protobuf(registry, id="P-3", raw_text=text.encode(), tags={"lang": b"es"}), TOPIC)
    assert (ticket.body, ticket.metadata) == (text, {"lang": "es"})
    nested = TicketDecoder(
        "protobuf", {"ticket_id": "id", "body": "note.body"}, LIMIT, registry, SupportTicket
    )
    assert nested.decode(_protobuf(registry, id="P-4", note={"body": text.encode()}), TOPIC).body == text
    wrapped = TicketDecoder(
        "protobuf", {"ticket_id": "id", "body": "wrapped"}, LIMIT, registry, SupportTicket
    )
    assert wrapped.decode(_protobuf(registry, id="P-6", wrapped={"value": text.encode()}), TOPIC).body == text
    with pytest.raises(DecodeError) as caught:
        nested.decode(_protobuf(registry, id="P-5", note={"body": b"\xff\xfe"}), TOPIC)
    assert caught.value.error_type == "invalid_utf8" and "`note.body`" in caught.value.message


def test_a_mapping_naming_no_ticket_field_is_refused(registry: Any) -> None:
    with pytest.raises(ValueError, match="descripton"):
        TicketDecoder("avro", {"descripton": "x"}, LIMIT, registry)


# -- the decoder the settings describe (decoder_for) --------------------------------------------------------


def test_plain_json_without_a_mapping_keeps_the_plain_decoder_and_a_mapping_gets_one() -> None:
    plain = load_settings(env={})
    assert decoder_for(plain.input, plain.schema_registry, plain.pipeline.max_value_bytes) is None
    settings = load_settings(env={}, overrides={"input.fields.body": "description"})
    mapped = decoder_for(settings.input, settings.schema_registry, settings.pipeline.max_value_bytes)
    assert mapped is not None
    ticket = mapped.decode(b'{"ticket_id": "T-1", "description": "card declined"}', TOPIC)
    assert (ticket.ticket_id, ticket.body) == ("T-1", "card declined")


def test_a_protobuf_message_class_that_does_not_import_is_refused_in_one_line() -> None:
    settings = load_settings(
        env={},
        overrides={
            "input.format": "protobuf",
            "schema_registry.url": "http://127.0.0.1:8081",
            "input.protobuf_message": "no_such_module_here:Ticket",
        },
    )
    with pytest.raises(UserError) as caught:
        decoder_for(settings.input, settings.schema_registry, settings.pipeline.max_value_bytes)
    assert str(caught.value).startswith(
        "config error: input.protobuf_message: cannot import no_such_module_here:Ticket"
    )


def test_an_unreachable_registry_is_retried_at_once_and_its_credentials_never_show() -> None:
    """A port nothing listens on: the client must not retry by itself (its sleeps would hold the consumer
    loop), and the reason the pipeline logs names no credential."""
    secret = "s3cret-registry-password"
    settings = load_settings(
        env={},
        overrides={
            "input.format": "avro",
            "schema_registry.url": f"http://svc:{secret}@127.0.0.1:{local_broker.free_port()}",
        },
    )
    decoder = decoder_for(settings.input, settings.schema_registry, settings.pipeline.max_value_bytes)
    assert decoder is not None
    started = time.monotonic()
    with pytest.raises(RegistryUnavailable) as caught:
        decoder.decode(b"\x00\x00\x00\x00\x01\x02", TOPIC)
    assert time.monotonic() - started < 5.0
    assert secret not in str(caught.value)
