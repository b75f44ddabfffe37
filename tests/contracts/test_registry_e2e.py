"""End to end against the real Schema Registry the project starts (`triage-worker registry start`: Apicurio
Registry from Maven Central jars) and the real session broker: tickets serialized by confluent-kafka's own
serializers, carried through Kafka, decoded by the worker's `TicketDecoder` with a producer's field mapping.

This proves the registry, the wire format and the decoder together; the worker's pipeline does not read the
registry formats yet (see docs/messages.md), so no worker runs here."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("fastavro", reason="the avro extra of confluent-kafka is not installed")

from confluent_kafka import Consumer, Producer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from worker.contracts.input import TicketDecoder
from worker.decoding import DecodeError
from worker.dev.local_registry import LocalRegistry

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

HELPDESK_AVRO = json.dumps(
    {
        "type": "record",
        "name": "HelpdeskTicket",
        "fields": [
            {"name": "id", "type": "string"},
            {"name": "description", "type": "string"},
            {
                "name": "requester",
                "type": {
                    "type": "record",
                    "name": "Requester",
                    "fields": [{"name": "email", "type": "string"}],
                },
            },
        ],
    }
)
MAPPING = {"ticket_id": "id", "body": "description", "customer_id": "requester.email"}


def _roundtrip(kafka_config: dict[str, str], topic: str, values: list[bytes]) -> list[bytes]:
    producer = Producer(kafka_config)
    for value in values:
        producer.produce(topic, value)
    assert producer.flush(30) == 0
    consumer = Consumer(
        {**kafka_config, "group.id": f"registry-e2e-{uuid.uuid4().hex[:8]}", "auto.offset.reset": "earliest"}
    )
    consumer.subscribe([topic])
    received: list[bytes] = []
    try:
        while len(received) < len(values):
            message = consumer.poll(30)
            assert message is not None, f"only {len(received)} of {len(values)} records came back"
            assert message.error() is None, message.error()
            record_value = message.value()
            assert record_value is not None, "a record came back without its value"
            received.append(record_value)
    finally:
        consumer.close()
    return received


def test_avro_tickets_through_the_real_registry_and_broker_decode_with_a_mapping(
    schema_registry: LocalRegistry, kafka_config: dict[str, str], unique_topic: Callable[..., str]
) -> None:
    topic = unique_topic("avro-tickets", partitions=1)
    client: Any = SchemaRegistryClient({"url": schema_registry.url})
    serialize = AvroSerializer(client, HELPDESK_AVRO)
    ctx = SerializationContext(topic, MessageField.VALUE)
    records: list[dict[str, Any]] = [
        {"id": f"HD-{n}", "description": f"charged twice ({n})", "requester": {"email": f"c{n}@example.com"}}
        for n in range(3)
    ]
    values = _roundtrip(kafka_config, topic, [serialize(record, ctx) for record in records])

    decoder = TicketDecoder("avro", MAPPING, 1_000_000, client)
    tickets = [decoder.decode(value, topic) for value in values]
    assert [(t.ticket_id, t.body, t.customer_id) for t in tickets] == [
        (r["id"], r["description"], r["requester"]["email"]) for r in records
    ]
    # The serializer registered the producer's schema under the topic's subject in the real registry.
    assert f"{topic}-value" in client.get_subjects()


def test_bad_registry_input_gets_its_reason_from_the_real_registry(
    schema_registry: LocalRegistry, kafka_config: dict[str, str], unique_topic: Callable[..., str]
) -> None:
    topic = unique_topic("bad-tickets", partitions=1)
    client: Any = SchemaRegistryClient({"url": schema_registry.url})
    schema = json.dumps(
        {
            "type": "object",
            "properties": {"id": {"type": "string"}, "description": {"type": "string"}},
            "required": ["id", "description"],
        }
    )
    good = JSONSerializer(schema, client)(
        {"id": "J-1", "description": "reset"}, SerializationContext(topic, MessageField.VALUE)
    )
    never_registered = (2**31 - 1).to_bytes(4, "big")
    values = _roundtrip(
        kafka_config,
        topic,
        [
            b'{"id": "J-2", "description": "plain JSON"}',  # no wire format
            b"\x00" + never_registered + b"{}",  # a schema id the registry never gave out
            good[:5] + b'{"id": 5, "description": "x"}',  # fails its own schema
            good[:5] + b'{"id": "J-3"}',  # lacks a field its schema requires
        ],
    )
    decoder = TicketDecoder("json_schema", {"ticket_id": "id", "body": "description"}, 1_000_000, client)
    reasons = []
    for value in values:
        with pytest.raises(DecodeError) as caught:
            decoder.decode(value, topic)
        reasons.append(caught.value.error_type)
    assert reasons == ["invalid_wire_format", "unknown_schema", "schema_mismatch", "schema_mismatch"]


def _helpdesk_proto_class() -> Any:
    """A producer's Protobuf message, built at run time so the test needs no protoc: helpdesk.HelpdeskTicket
    {string id = 1; string description = 2; Requester requester = 3;} with Requester {string email = 1;}."""
    string, message, optional = 9, 11, 1  # FieldDescriptorProto type and label numbers
    proto = descriptor_pb2.FileDescriptorProto(name="helpdesk.proto", package="helpdesk", syntax="proto3")
    proto.message_type.add(name="Requester").field.add(name="email", number=1, type=string, label=optional)
    ticket = proto.message_type.add(name="HelpdeskTicket")
    ticket.field.add(name="id", number=1, type=string, label=optional)
    ticket.field.add(name="description", number=2, type=string, label=optional)
    ticket.field.add(
        name="requester", number=3, type=message, label=optional, type_name=".helpdesk.Requester"
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("helpdesk.HelpdeskTicket"))


def test_protobuf_tickets_through_the_real_registry_and_broker_decode_with_a_mapping(
    schema_registry: LocalRegistry, kafka_config: dict[str, str], unique_topic: Callable[..., str]
) -> None:
    topic = unique_topic("protobuf-tickets", partitions=1)
    client: Any = SchemaRegistryClient({"url": schema_registry.url})
    helpdesk_ticket = _helpdesk_proto_class()
    serialize = ProtobufSerializer(helpdesk_ticket, client, {"use.deprecated.format": False})
    ctx = SerializationContext(topic, MessageField.VALUE)
    sent = helpdesk_ticket(id="P-1", description="my card was stolen", requester={"email": "p@example.com"})
    (value,) = _roundtrip(kafka_config, topic, [serialize(sent, ctx)])

    decoder = TicketDecoder("protobuf", MAPPING, 1_000_000, client, helpdesk_ticket)
    ticket = decoder.decode(value, topic)
    assert (ticket.ticket_id, ticket.body, ticket.customer_id) == (
        "P-1",
        "my card was stolen",
        "p@example.com",
    )
