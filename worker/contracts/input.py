"""Tickets in the formats Kafka shops publish: plain JSON, or Avro / JSON Schema / Protobuf in the Confluent
wire format (magic byte 0, a 4-byte big-endian schema id, the payload) with the schema in a Schema Registry;
and the producer's own field names mapped onto `TicketEvent`'s.

The contract of `TicketDecoder.decode`, whatever the bytes:
- a `TicketEvent`, validated by the same rules as plain JSON tickets (`worker.decoding.decode_ticket`: one
  source of truth for what a ticket is), or
- `DecodeError` (the record is a dead letter; its reason names the problem: `invalid_wire_format` for a value
  that is not in the wire format, `unknown_schema` for a schema id the registry does not know (its 404 with
  error code 40403, and nothing else), `schema_mismatch` for a payload its own schema rejects,
  `missing_field` for a mapped field that is absent, `invalid_utf8` for a `bytes` field mapped to a ticket
  field that is not UTF-8 text), or
- `RegistryUnavailable` for every other failure of a call to the registry, whatever the client raised for it
  (`cause`: `outage` when refused, timed out, 5xx, 408, 429; `credentials` for 401 and 403;
  `registry_error` for any other answer): the record is fine and must be retried later, never
  dead-lettered.

A `bytes` value (Avro `bytes` or `fixed`, Protobuf `bytes`) read into a ticket field is UTF-8 text: decoded
strictly, never passed on as the base64 a JSON encoder would make of it (the model would classify base64,
and the personal-data detector would find nothing in it).

The mapping (`fields`) names, for a `TicketEvent` field, the dotted path in the producer's record that holds
it (`{"body": "description", "customer_id": "requester.email"}`); fields not named are read under their own
name. Only the fields of `TicketEvent` are read: the rest of a producer's record is ignored, as unknown JSON
fields are.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, MutableSequence, Sequence
from typing import Any

import msgspec

from worker.decoding import DecodeError, RegistryUnavailable, decode_ticket
from worker.errors import UserError
from worker.messages import TicketEvent
from worker.settings import REGISTRY_FORMATS, InputFormat, InputSettings, SchemaRegistrySettings

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
    (else DecodeError `missing_field`, naming both names); unmapped fields are copied when present. A `bytes`
    value, of a field or of a `metadata` entry, is read as UTF-8 text (else DecodeError `invalid_utf8`)."""
    ticket: dict[str, Any] = {}
    for name in _TICKET_FIELDS:
        path = fields.get(name)
        if path is None:
            if name in document:
                ticket[name] = _text_of_bytes(document[name], name, None)
            continue
        found, value = resolve_path(document, path)
        if not found:
            # Optional ticket fields may be absent from a given record; required ones never.
            if name in ("ticket_id", "body"):
                raise DecodeError(
                    "missing_field", f"`{name}` is mapped to `{path}` (input.fields.{name}), which is missing"
                )
            continue
        ticket[name] = _text_of_bytes(value, name, path)
    return ticket


def _text_of_bytes(value: object, name: str, path: str | None) -> object:
    """`value` with its bytes (the value itself, or the entries of `metadata`) decoded as UTF-8; anything
    else as it is, for the ticket's rules to judge. `path`: where the mapping read `name` from (None: under
    its own name), for the message."""
    if isinstance(value, bytes | bytearray):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError as bad:
            mapped = "" if path is None else f" (mapped to `{path}`, input.fields.{name.partition('.')[0]})"
            raise DecodeError(
                "invalid_utf8",
                f"`{name}`{mapped} holds bytes that are not UTF-8 text: {bad.reason} at byte {bad.start}",
            ) from None
    if name == "metadata" and isinstance(value, Mapping):
        return {
            key: _text_of_bytes(item, f"metadata.{key}", None if path is None else f"{path}.{key}")
            for key, item in value.items()
        }
    return value


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


# The registry's error code for "no schema has this id" (Confluent's, and that of the Confluent-compatible
# APIs of Apicurio and Karapace): the only answer of the registry that is about the record.
SCHEMA_NOT_FOUND = 40403
# The client's HTTP layer (httpx, or its fork httpx2) raises its own transport errors; matched by name so that
# either works.
_TRANSPORT_ERRORS = frozenset(
    {"TransportError", "TimeoutException", "ConnectionError", "TimeoutError", "OSError"}
)
_CREDENTIALS = "schema_registry.basic_auth_user_info (or the user:password in schema_registry.url)"


def registry_outcome(error: BaseException, schema_id: int) -> DecodeError | RegistryUnavailable:
    """What a failed call to the registry means for the record of schema id `schema_id` (the table in
    docs/schema-registry.md): a dead letter (`unknown_schema`) only when the registry says no schema has
    that id; otherwise the record waits, and the cause says why. Of an answer, only its status and error
    code are quoted, never its body: what sits between us and the registry (a proxy, a gateway) may echo our
    request in it, the Authorization header with its credentials included."""
    status = getattr(error, "http_status_code", None)
    if not isinstance(status, int) or status <= 0:  # no answer, or one the client could not read
        if {cls.__name__ for cls in type(error).__mro__} & _TRANSPORT_ERRORS:
            return RegistryUnavailable(
                "outage", f"schema registry unreachable: {type(error).__name__}: {error}"
            )
        return RegistryUnavailable(
            "registry_error",
            f"schema registry gave an answer the client cannot read ({type(error).__name__}): check that "
            "schema_registry.url is the registry's Confluent-compatible API",
        )
    code = getattr(error, "error_code", None)
    if status == 404 and code == SCHEMA_NOT_FOUND:
        return DecodeError("unknown_schema", f"schema id {schema_id} is not in the schema registry")
    if status == 401:
        return RegistryUnavailable(
            "credentials", f"schema registry refuses our credentials (401): check {_CREDENTIALS}"
        )
    if status == 403:
        return RegistryUnavailable(
            "credentials",
            f"schema registry denies our credentials access (403): check the registry's permissions for the "
            f"user of {_CREDENTIALS}",
        )
    if status >= 500 or status in (408, 429):
        return RegistryUnavailable(
            "outage", f"schema registry unavailable or overloaded (answered {status}, error code {code})"
        )
    return RegistryUnavailable(
        "registry_error",
        f"schema registry answered {status} (error code {code}), which says nothing about the record: check "
        "schema_registry.url (the path of the registry's Confluent-compatible API) and the registry's log",
    )


class _WatchedRegistry:
    """The registry client as the deserializers see it, remembering what its calls raised: a decode that
    fails with one of those (or with an error raised from one) failed on the registry, whatever the client
    raised for it; any other failure is the payload's. A call whose failure the library handles itself (a
    404 for the topic's subject associations reads as "none") is remembered too, but does not escape. Used
    by one decode at a time (`failures` holds the current one's)."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.failures: list[BaseException] = []

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._client, name)
        if not callable(found):
            return found

        def watched(*args: Any, **kwargs: Any) -> Any:
            try:
                return found(*args, **kwargs)
            except Exception as error:
                self.failures.append(error)
                raise

        return watched

    def failure_behind(self, error: BaseException) -> BaseException | None:
        """The failed registry call that `error` is, or was raised from or while handling."""
        seen: set[int] = set()
        current: BaseException | None = error
        while current is not None and id(current) not in seen:
            if any(current is failure for failure in self.failures):
                return current
            seen.add(id(current))
            current = current.__cause__ or current.__context__
        return None


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
        self._registry: _WatchedRegistry | None = None
        if input_format in REGISTRY_FORMATS:
            if registry is None:
                raise ValueError(f"input format {input_format} needs schema_registry.url")
            self._registry = _WatchedRegistry(registry)
            self._deserialize = _deserializer(input_format, self._registry, protobuf_message_type)

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
            raise RegistryUnavailable(error.cause, self._masked(error.message)) from None
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
        from confluent_kafka.serialization import MessageField, SerializationContext

        assert self._deserialize is not None and self._registry is not None
        self._registry.failures.clear()
        try:
            return self._deserialize(value, SerializationContext(topic, MessageField.VALUE))
        except Exception as error:
            failure = self._registry.failure_behind(error)
            if failure is not None:
                raise registry_outcome(failure, schema_id) from None
            # The registry answered every call: the payload does not match its writer's schema.
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
        if message is None:
            return None
        # proto3 writes no empty string: without printing the fields that have no presence, an empty `body`
        # would read as a missing one, though a ticket may have an empty body beside its subject.
        document = MessageToDict(
            message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        _restore_bytes(message, document)
        return document

    return protobuf


def _restore_bytes(message: Any, document: dict[str, Any]) -> None:
    """Put back into `document` (MessageToDict's rendering of `message`) the bytes of the `bytes` fields it
    wrote as base64 text, in nested messages, lists and maps too: a `bytes` field read into a ticket field
    is then decoded as UTF-8 or refused, as Avro's is (`map_fields`)."""
    for field in message.DESCRIPTOR.fields:
        if field.name not in document:
            continue
        value, rendered = getattr(message, field.name), document[field.name]
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            entry = field.message_type.fields_by_name["value"]
            keys = {key: _json_map_key(key) for key in value}
            document[field.name] = {keys[key]: _raw(entry, value[key], rendered[keys[key]]) for key in value}
        elif isinstance(value, MutableSequence):  # a repeated field (bytes are no mutable sequence)
            document[field.name] = [
                _raw(field, item, shown) for item, shown in zip(value, rendered, strict=True)
            ]
        else:
            document[field.name] = _raw(field, value, rendered)


def _raw(field: Any, value: Any, rendered: Any) -> Any:
    """One value of `field` as `_restore_bytes` keeps it: bytes as bytes, messages with their bytes put back,
    the rest as MessageToDict rendered it (well-known types such as Timestamp as their JSON)."""
    from google.protobuf.descriptor import FieldDescriptor

    if field.type == FieldDescriptor.TYPE_BYTES:
        return value
    if field.message_type is None:
        return rendered
    if field.message_type.full_name == "google.protobuf.BytesValue":
        return value.value
    if isinstance(rendered, dict) and not field.message_type.full_name.startswith("google.protobuf."):
        _restore_bytes(value, rendered)
    return rendered


def _json_map_key(key: object) -> str:
    """A map key as MessageToDict writes it."""
    if isinstance(key, bool):
        return "true" if key else "false"
    return str(key)


def decoder_for(
    chosen: InputSettings, registry_settings: SchemaRegistrySettings, max_value_bytes: int
) -> TicketDecoder | None:
    """The decoder the input section `chosen` describes, with a client of the registry `registry_settings`
    names, refusing values over `max_value_bytes`; None for plain JSON without a field mapping, which the
    pipeline decodes as it always has (`decode_ticket`). Raises UserError (one line) when the Protobuf
    message class cannot be imported."""
    if chosen.format == "json" and not chosen.fields:
        return None
    registry: Any = None
    message_type: type | None = None
    secrets = registry_settings.secrets()
    if chosen.format in REGISTRY_FORMATS:
        from confluent_kafka.schema_registry import SchemaRegistryClient

        registry = SchemaRegistryClient(registry_settings.client_config())
    if chosen.format == "protobuf":
        assert chosen.protobuf_message is not None  # the settings refuse protobuf without it
        message_type = protobuf_class(chosen.protobuf_message)
    return TicketDecoder(chosen.format, chosen.fields, max_value_bytes, registry, message_type, secrets)


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
