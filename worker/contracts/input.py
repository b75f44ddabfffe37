"""Tickets in the formats Kafka shops publish: plain JSON, or Avro / JSON Schema / Protobuf in the Confluent
wire format (magic byte 0, a 4-byte big-endian schema id, the payload) with the schema in a Schema Registry;
and the producer's own field names mapped onto `TicketEvent`'s.

The contract of `TicketDecoder.decode`, whatever the bytes:
- a `TicketEvent`, validated by the same rules as plain JSON tickets (`worker.decoding.decode_ticket`: one
  source of truth for what a ticket is), or
- `DecodeError` (the record is a dead letter; its reason names the problem: `invalid_wire_format` for a value
  that is not in the wire format, `unknown_schema` for a schema id the registry does not know,
  `schema_mismatch` for a payload its own schema rejects, `missing_field` for a mapped field that is
  absent), or
- `RegistryUnavailable` when the registry could not answer (refused, timed out, 5xx, 429): the record is fine
  and must be retried later, never dead-lettered.

The mapping (`fields`) names, for a `TicketEvent` field, the dotted path in the producer's record that holds
it (`{"body": "description", "customer_id": "requester.email"}`); fields not named are read under their own
name. Only the fields of `TicketEvent` are read: the rest of a producer's record is ignored, as unknown JSON
fields are.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from worker.config import REGISTRY_FORMATS, InputFormat, Settings
from worker.decoding import DecodeError, RegistryUnavailable, decode_ticket
from worker.errors import UserError
from worker.messages import TicketEvent

__all__ = [
    "REGISTRY_FORMATS",
    "DecodeError",
    "InputFormat",
    "RegistryUnavailable",
    "TicketDecoder",
    "decoder_for",
]

# Confluent wire format: magic byte 0 then the schema id (4 bytes, big-endian), then the payload.
WIRE_MAGIC = 0
WIRE_HEADER_BYTES = 5
# RFC 8259 §8.1, as for plain tickets (worker/decoding.py).
_UTF8_BOM = b"\xef\xbb\xbf"
_TICKET_FIELDS = tuple(field.name for field in msgspec.structs.fields(TicketEvent))


def resolve_path(document: Mapping[str, Any], path: str) -> tuple[bool, Any]:
    """(found, value) of a dotted `path` in nested mappings; a segment through a non-mapping is not found."""
    current: Any = document
    for segment in path.split("."):
        if not isinstance(current, Mapping) or segment not in current:
            return False, None
        current = current[segment]
    return True, current


def map_fields(document: Mapping[str, Any], fields: Mapping[str, str]) -> dict[str, Any]:
    """The producer's record seen with `TicketEvent`'s field names. A field the mapping names must be present
    (else DecodeError `missing_field`, naming both names); unmapped fields are copied when present."""
    ticket: dict[str, Any] = {}
    for name in _TICKET_FIELDS:
        path = fields.get(name)
        if path is None:
            if name in document:
                ticket[name] = document[name]
            continue
        found, value = resolve_path(document, path)
        if not found:
            # Optional ticket fields may be absent from a given record; required ones never.
            if name in ("ticket_id", "body"):
                raise DecodeError(
                    "missing_field", f"`{name}` is mapped to `{path}` (input.fields.{name}), which is missing"
                )
            continue
        ticket[name] = value
    return ticket


def _ticket_from_document(document: object, fields: Mapping[str, str], max_value_bytes: int) -> TicketEvent:
    if not isinstance(document, Mapping):
        raise DecodeError("not_an_object", f"the record must be an object, got {type(document).__name__}")
    # Re-encoded as JSON so that exactly the plain-JSON rules (types, timestamps, empty ticket) apply.
    try:
        canonical = msgspec.json.encode(map_fields(document, fields))
    except RecursionError:
        raise DecodeError("too_deeply_nested", "a ticket field nests too deeply to re-encode") from None
    except (TypeError, msgspec.EncodeError) as error:
        raise DecodeError("wrong_type", f"a ticket field holds a value JSON cannot carry: {error}") from None
    return decode_ticket(canonical, max_value_bytes)


def _registry_unavailable(error: Exception) -> bool:
    """Whether `error` from the registry client means "ask again later" rather than "this record is bad"."""
    status = getattr(error, "http_status_code", None)
    if isinstance(status, int) and status > 0:
        return status >= 500 or status in (408, 429)
    # The client's HTTP layer (httpx, or its fork httpx2) raises its own transport errors; match by name so
    # that either works.
    names = {cls.__name__ for cls in type(error).__mro__}
    return bool(names & {"TransportError", "TimeoutException", "ConnectionError", "TimeoutError", "OSError"})


Deserialize = Callable[[bytes, Any], Any]


class TicketDecoder:
    """Decodes record values of one input format (see the module's contract)."""

    def __init__(
        self,
        input_format: InputFormat,
        fields: Mapping[str, str],
        max_value_bytes: int,
        registry: Any = None,
        protobuf_message_type: type | None = None,
        secrets: Sequence[str] = (),
    ) -> None:
        """`registry`: a confluent-kafka `SchemaRegistryClient`, required by the registry formats.
        `protobuf_message_type`: the generated message class for `protobuf` (the client's Protobuf
        deserializer needs one). `secrets`: the registry's credentials, blanked out of every message the
        client's errors end up in (dead letters, logs)."""
        unknown = set(fields) - set(_TICKET_FIELDS)
        if unknown:
            raise ValueError(f"input.fields names no TicketEvent field: {', '.join(sorted(unknown))}")
        self.input_format = input_format
        self._secrets = [secret for secret in secrets if secret]
        self._fields = dict(fields)
        self._max_value_bytes = max_value_bytes
        self._deserialize: Deserialize | None = None
        if input_format in REGISTRY_FORMATS:
            if registry is None:
                raise ValueError(f"input format {input_format} needs schema_registry.url")
            self._deserialize = _deserializer(input_format, registry, protobuf_message_type)

    def decode(self, value: bytes | None, topic: str) -> TicketEvent:
        """One record value → TicketEvent; raises DecodeError (dead letter) or RegistryUnavailable (retry),
        nothing else, whatever the bytes."""
        try:
            return self._decode(value, topic)
        except DecodeError as error:
            if self._secrets:
                raise DecodeError(error.error_type, self._masked(error.message)) from None
            raise
        except RegistryUnavailable as error:
            raise RegistryUnavailable(self._masked(str(error))) from None
        except Exception as error:  # a library failing in a way we did not foresee: one dead letter
            raise DecodeError(
                "undecodable",
                self._masked(f"the decoder failed on this value: {type(error).__name__}: {error}"),
            ) from None

    def _masked(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _decode(self, value: bytes | None, topic: str) -> TicketEvent:
        if self._deserialize is None:
            if not self._fields:
                return decode_ticket(value, self._max_value_bytes)
            return self._decode_mapped_json(value)
        if value is None:
            raise DecodeError("null_value", "value is null (a tombstone), expected a ticket")
        if len(value) > self._max_value_bytes:
            raise DecodeError(
                "too_large",
                f"value is {len(value)} bytes, over the {self._max_value_bytes}-byte limit "
                "(pipeline.max_value_bytes)",
            )
        # Checked here: given another first byte the client's deserializers guess at other framings and fail
        # with messages that do not say what is wrong.
        if len(value) < WIRE_HEADER_BYTES or value[0] != WIRE_MAGIC:
            first = f"0x{value[0]:02x}" if value else "nothing"
            raise DecodeError(
                "invalid_wire_format",
                f"value is not in the Schema Registry wire format ({len(value)} bytes, first byte {first}, "
                f"expected 0x00 and a 4-byte schema id) for input format {self.input_format}",
            )
        schema_id = int.from_bytes(value[1:WIRE_HEADER_BYTES], "big")
        document = self._registry_decode(value, topic, schema_id)
        return _ticket_from_document(document, self._fields, self._max_value_bytes)

    def _registry_decode(self, value: bytes, topic: str, schema_id: int) -> object:
        from confluent_kafka.schema_registry.error import SchemaRegistryError
        from confluent_kafka.serialization import MessageField, SerializationContext

        assert self._deserialize is not None
        try:
            return self._deserialize(value, SerializationContext(topic, MessageField.VALUE))
        except SchemaRegistryError as error:
            if _registry_unavailable(error):
                raise RegistryUnavailable(f"schema registry: {error}") from error
            if error.http_status_code == 404:
                raise DecodeError(
                    "unknown_schema", f"schema id {schema_id} is not in the schema registry"
                ) from None
            raise DecodeError("schema_mismatch", f"schema id {schema_id}: {error}") from None
        except Exception as error:  # the payload does not match its writer's schema, whatever the library
            if _registry_unavailable(error):
                raise RegistryUnavailable(f"schema registry: {error}") from error
            raise DecodeError(
                "schema_mismatch",
                f"payload does not match its schema (id {schema_id}): {type(error).__name__}: {error}",
            ) from None

    def _decode_mapped_json(self, value: bytes | None) -> TicketEvent:
        if value is None or len(value) > self._max_value_bytes:
            return decode_ticket(value, self._max_value_bytes)  # raises null_value or too_large
        value = value.removeprefix(_UTF8_BOM)
        try:
            document = msgspec.json.decode(value)
        except Exception:  # not JSON, nested too deeply, ...: the plain decoder names the problem
            decode_ticket(value, self._max_value_bytes)
            raise
        return _ticket_from_document(document, self._fields, self._max_value_bytes)


def _deserializer(input_format: str, registry: Any, message_type: type | None) -> Deserialize:
    """The client's own deserializer for a format, reading with the writer's schema from the registry."""
    if input_format == "avro":
        from confluent_kafka.schema_registry.avro import AvroDeserializer

        avro: Deserialize = AvroDeserializer(registry)
        return avro
    if input_format == "json_schema":
        from confluent_kafka.schema_registry.json_schema import JSONDeserializer

        # Validates the payload against the writer's schema: a failing payload is a `schema_mismatch`.
        json_schema: Deserialize = JSONDeserializer(None, schema_registry_client=registry)
        return json_schema
    from confluent_kafka.schema_registry.protobuf import ProtobufDeserializer
    from google.protobuf.json_format import MessageToDict

    if message_type is None:
        raise ValueError("input format protobuf needs the ticket's generated message class")
    inner = ProtobufDeserializer(message_type, {"use.deprecated.format": False}, registry)

    def protobuf(value: bytes, ctx: Any) -> object:
        message = inner(value, ctx)
        return MessageToDict(message, preserving_proto_field_name=True) if message is not None else None

    return protobuf


def decoder_for(settings: Settings) -> TicketDecoder | None:
    """The decoder `settings.input` describes, with its registry client; None for plain JSON without a field
    mapping, which the pipeline decodes as it always has (`decode_ticket`). Raises UserError (one line) when
    the Protobuf message class cannot be imported."""
    chosen = settings.input
    if chosen.format == "json" and not chosen.fields:
        return None
    registry: Any = None
    message_type: type | None = None
    secrets = settings.schema_registry.secrets()
    if chosen.format in REGISTRY_FORMATS:
        from confluent_kafka.schema_registry import SchemaRegistryClient

        registry = SchemaRegistryClient(settings.schema_registry.client_config())
    if chosen.format == "protobuf":
        assert chosen.protobuf_message is not None  # the settings refuse protobuf without it
        message_type = protobuf_class(chosen.protobuf_message)
    return TicketDecoder(
        chosen.format, chosen.fields, settings.pipeline.max_value_bytes, registry, message_type, secrets
    )


def protobuf_class(name: str) -> type:
    """The generated message class "module:Class" names (`input.protobuf_message`); UserError otherwise."""
    module_name, _, attribute = name.partition(":")
    try:
        found: Any = importlib.import_module(module_name)
        for part in attribute.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError) as error:
        raise UserError(f"config error: input.protobuf_message: cannot import {name}: {error}") from None
    from google.protobuf.message import Message

    if not isinstance(found, type) or not issubclass(found, Message):
        raise UserError(f"config error: input.protobuf_message: {name} is not a Protobuf message class")
    return found
