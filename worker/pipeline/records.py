"""What the pipeline writes: one TriageResult per ticket (classified or fallback), and its Kafka key.

Results are keyed by the input record's key (or, when it has none, the ticket id), so every record about one
ticket — and, with a customer key, about one customer — lands in the same output partition, in order.
"""

from __future__ import annotations

import msgspec

from worker.classification import Classification
from worker.messages import SCHEMA_VERSION, SourcePosition, TicketEvent, TriageResult, utc_timestamp

_ENCODER = msgspec.json.Encoder()


def triage_result(
    event: TicketEvent, answer: Classification, source: SourcePosition, classified_at: str | None = None
) -> TriageResult:
    """The output record for one answered ticket (the answer may itself be a fallback); `classified_at`
    defaults to now."""
    return TriageResult(
        schema_version=SCHEMA_VERSION,
        ticket_id=event.ticket_id,
        intent=answer.intent,
        priority=answer.priority,
        confidence=answer.confidence,
        fallback=answer.fallback,
        fallback_reason=answer.fallback_reason,
        scores=answer.scores,
        model=answer.model,
        latency_ms=max(0.0, answer.latency_ms),
        classified_at=classified_at or utc_timestamp(),
        source=source,
        truncated=answer.truncated,
        taxonomy=answer.taxonomy,
    )


def encode_result(result: TriageResult) -> bytes:
    return _ENCODER.encode(result)


def result_key(input_key: bytes | None, event: TicketEvent) -> bytes:
    """The input record's key, or the ticket id when the input had none."""
    return input_key if input_key is not None else event.ticket_id.encode("utf-8")
