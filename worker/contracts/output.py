"""Triage records in Avro, in the Schema Registry wire format (`output.format = "avro"`).

The schema is the one generated from `TriageResult` (`avro_schema`, the same as schemas/triage_result.avsc,
which `tests/contracts/test_contract_compatibility.py` keeps BACKWARD compatible). It is registered once, at
start, under the output topic's value subject (`<topic>-value`, the client's default `TopicNameStrategy`, so
confluent-kafka's `AvroDeserializer` and other consumers find it); each record is then written with that id
by fastavro, with no registry call per record: a registry outage after start never holds a result back.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from typing import Any

import msgspec

from worker.contracts.avro_schema import avro_schema
from worker.errors import UserError
from worker.messages import TriageResult
from worker.settings import OutputSettings, SchemaRegistrySettings

ResultEncoder = Callable[[TriageResult], bytes]


def result_encoder_for(
    output: OutputSettings, registry_settings: SchemaRegistrySettings, output_topic: str, registry: Any = None
) -> ResultEncoder | None:
    """The encoder `output.format` asks for, with its schema registered under `output_topic`'s value subject;
    None for JSON (the pipeline's own encoder). `registry`: a `SchemaRegistryClient` (default: one from
    `registry_settings`). Raises UserError (one line, credentials masked) when the schema cannot be
    registered."""
    if output.format == "json":
        return None
    import fastavro
    from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

    schema = avro_schema(TriageResult)
    client = registry or SchemaRegistryClient(registry_settings.client_config())
    subject = f"{output_topic}-value"
    try:
        schema_id = int(client.register_schema(subject, Schema(json.dumps(schema), "AVRO")))
    except Exception as error:  # refused, incompatible with the subject's schema, unreachable, ...
        reason = f"{type(error).__name__}: {error}"
        for secret in registry_settings.secrets():
            reason = reason.replace(secret, "***")
        raise UserError(
            f"schema registry: cannot register the output schema under {subject}: {reason}"
        ) from None
    parsed = fastavro.parse_schema(schema)
    header = b"\x00" + schema_id.to_bytes(4, "big")

    def encode(result: TriageResult) -> bytes:
        buffer = io.BytesIO()
        buffer.write(header)
        fastavro.schemaless_writer(buffer, parsed, msgspec.to_builtins(result))
        return buffer.getvalue()

    return encode
