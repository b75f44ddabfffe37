"""The Avro schema of `TriageResult` (generated, worker/contracts/avro_schema.py) stays BACKWARD compatible
with the last released one (`schemas/released/`), as judged by the real Schema Registry the project starts:
a change to the contract that would make consumers unable to read older records fails here.

At a release, copy `schemas/triage_result.avsc` to `schemas/released/triage_result-<version>.avsc`."""

from __future__ import annotations

import copy
import io
import json
import uuid
from typing import Any

import msgspec
import pytest

from tools import REPO

pytest.importorskip("fastavro", reason="the avro extra of confluent-kafka is not installed")

import fastavro
from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

from worker.contracts.avro_schema import avro_schema
from worker.dev.local_registry import LocalRegistry
from worker.messages import SourcePosition, TriageResult

RELEASED = sorted((REPO / "schemas" / "released").glob("triage_result-*.avsc"))


def _latest_released() -> dict[str, Any]:
    assert RELEASED, "schemas/released/ holds no released TriageResult schema"
    # Versions sort as their numbers, not as text (0.10.0 after 0.9.0).
    newest = max(RELEASED, key=lambda p: tuple(int(n) for n in p.stem.split("-")[1].split(".")))
    released: dict[str, Any] = json.loads(newest.read_text(encoding="utf-8"))
    return released


def test_a_triage_record_round_trips_through_its_generated_avro_schema() -> None:
    result = TriageResult(
        schema_version=1,
        ticket_id="t-1",
        intent="card_arrival",
        priority="High",
        confidence=0.91,
        fallback=False,
        fallback_reason=None,
        scores={"card_arrival": 0.91, "lost_or_stolen_card": 0.05},
        model="triage-mini",
        latency_ms=12.5,
        classified_at="2026-12-03T01:00:00Z",
        source=SourcePosition(topic="tickets", partition=0, offset=7),
        truncated=False,
        pii=["email"],
        stage="first",
    )
    schema = fastavro.parse_schema(avro_schema(TriageResult))
    record = msgspec.to_builtins(result)
    buffer = io.BytesIO()
    fastavro.schemaless_writer(buffer, schema, record)
    buffer.seek(0)
    read = fastavro.schemaless_reader(buffer, schema)
    assert isinstance(read, dict)
    # Fields the JSON record omits (omit_defaults) read back as null; every other one as it was written.
    assert {k: v for k, v in read.items() if v is not None or k in record} == record
    assert read["taxonomy"] is None


@pytest.fixture(scope="module")
def registry(schema_registry: LocalRegistry) -> SchemaRegistryClient:
    return SchemaRegistryClient({"url": schema_registry.url})


def _backward_compatible(client: SchemaRegistryClient, candidate: dict[str, Any]) -> bool:
    subject = f"triage-result-compat-{uuid.uuid4().hex[:8]}-value"
    client.register_schema(subject, Schema(json.dumps(_latest_released()), "AVRO"))
    client.set_compatibility(subject, "BACKWARD")
    compatible: bool = client.test_compatibility(subject, Schema(json.dumps(candidate), "AVRO"))
    return compatible


@pytest.mark.slow
def test_the_contract_is_backward_compatible_with_the_last_released_schema(
    registry: SchemaRegistryClient,
) -> None:
    assert _backward_compatible(registry, avro_schema(TriageResult)), (
        "TriageResult's Avro schema is not BACKWARD compatible with the last released one: consumers on the "
        "new schema could not read records already written. Add fields as optional (`X | None = None`)."
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "break_it",
    [
        pytest.param(
            lambda s: s["fields"].append({"name": "region", "type": "string"}), id="new-required-field"
        ),
        pytest.param(lambda s: s["fields"][4].update(type="string"), id="confidence-becomes-a-string"),
    ],
)
def test_the_check_refuses_a_breaking_change(registry: SchemaRegistryClient, break_it: Any) -> None:
    """The check above can fail: the same registry check refuses the changes that break old records."""
    broken = copy.deepcopy(avro_schema(TriageResult))
    assert broken["fields"][4]["name"] == "confidence"
    break_it(broken)
    assert not _backward_compatible(registry, broken)
