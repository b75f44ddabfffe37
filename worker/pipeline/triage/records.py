"""What the pipeline writes: one TriageResult per ticket (classified or fallback), its Kafka key and the
input headers it carries; or a dead letter: the record as taken, with the `triage.*` headers.

Results are keyed by the input record's key (or, when it has none, the ticket id), so every record about one
ticket — and, with a customer key, about one customer — lands in the same output partition, in order.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from worker.classification import Classification
from worker.kafka.dead_letters import dead_letter_headers
from worker.messages import SCHEMA_VERSION, PiiKind, SourcePosition, TicketEvent, TriageResult, utc_timestamp
from worker.pipeline.work import Headers, Output, Work
from worker.privacy.redaction import Redactor

_ENCODER = msgspec.json.Encoder()


def triage_result(
    event: TicketEvent,
    answer: Classification,
    source: SourcePosition,
    classified_at: str | None = None,
    pii: Sequence[PiiKind] = (),
) -> TriageResult:
    """The output record for one answered ticket (the answer may itself be a fallback); `classified_at`
    defaults to now; `pii` the kinds of personal data found in the ticket (its `TicketScan.kinds`)."""
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
        pii=list(pii),
        stage=answer.stage,
        first_intent=answer.first_intent,
        first_confidence=answer.first_confidence,
        escalation_skipped=answer.escalation_skipped,
        taxonomy=answer.taxonomy,
    )


def encode_result(result: TriageResult) -> bytes:
    return _ENCODER.encode(result)


def result_key(input_key: bytes | None, event: TicketEvent) -> bytes:
    """The input record's key, or the ticket id when the input had none."""
    return input_key if input_key is not None else event.ticket_id.encode("utf-8")


def carried_headers(headers: Headers | None, budget: int) -> tuple[Headers | None, int]:
    """The input headers a triage record (and its shadow and review copies) carries: in order, as long as
    their names and values fit in `budget` bytes (`pipeline.max_header_bytes`); the rest are left off, and
    their count is returned. Without a bound one ticket with a megabyte of headers made a record its topic
    refused, and its partition stopped (issue #31). Dead letters keep every header: replay needs them."""
    if not headers:
        return headers, 0
    kept: Headers = []
    used = 0
    for name, value in headers:
        size = len(name.encode("utf-8", errors="replace")) + len(value or b"")
        if used + size > budget:
            break
        kept.append((name, value))
        used += size
    return kept, len(headers) - len(kept)


def dead_letter(
    work: Work, topic: str, error_type: str, message: str, redactor: Redactor, redact_value: bool
) -> Output:
    """The dead letter of `work`'s record: its key, value and headers as taken, plus the `triage.*` headers
    that say why (`error_type`, `message`) and where it came from. The message is the worker's own words but
    may quote the value, so its personal data is always redacted; the value only with `redact_value`
    (`dead_letter.redact`: replay needs the original)."""
    message = redactor.redact(message)
    headers = dead_letter_headers(work.headers, error_type, message, work.topic, work.partition, work.offset)
    value = redacted_value(work.value, redactor) if redact_value and work.value else work.value
    return Output(topic, work.key, value, headers)


_ANY_JSON = msgspec.json.Decoder()


def redacted_value(value: bytes, redactor: Redactor) -> bytes:
    """A record value with its personal data redacted: in every string of a JSON document (so that escapes
    such as `\\u0034` hide nothing), otherwise in its text as UTF-8 (undecodable bytes replaced)."""
    try:
        document = _ANY_JSON.decode(value)
    except msgspec.DecodeError:
        return redactor.redact(value.decode("utf-8", errors="replace")).encode("utf-8")
    return _ENCODER.encode(redact_strings(document, redactor))


def redact_strings(document: object, redactor: Redactor) -> object:
    """`document` (decoded JSON) with every string in it, keys included, redacted."""
    if isinstance(document, str):
        return redactor.redact(document)
    if isinstance(document, list):
        return [redact_strings(item, redactor) for item in document]
    if isinstance(document, dict):
        return {redactor.redact(str(k)): redact_strings(v, redactor) for k, v in document.items()}
    return document
