"""What the pipeline writes: one TriageResult per ticket (classified or fallback), its Kafka key and the
input headers it carries; or a dead letter: the record as taken (or redacted, with `dead_letter.redact`),
with the `triage.*` headers.

Results are keyed by the input record's key (or, when it has none or it holds personal data, the ticket id),
so every record about one ticket — and, with a customer key, about one customer — lands in the same output
partition, in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from worker.classification import Classification
from worker.kafka.dead_letters import OMITTED_BYTES, REDACTED_DROPPED, dead_letter_headers
from worker.messages import SCHEMA_VERSION, PiiKind, SourcePosition, TicketEvent, TriageResult, utc_timestamp
from worker.pipeline.work import Headers, Output, Work
from worker.privacy.redaction import Redactor
from worker.privacy.values import CarriedMetadata, redact_bytes, redact_headers, redact_value
from worker.settings import DeadLetterSettings, PrivacySettings

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
    scoped = answer.out_of_scope
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
        # "None of these" only: every other record stays byte for byte what it was (omit_defaults).
        out_of_scope=True if scoped else None,
        out_of_scope_reason="no_similar_training_ticket" if scoped else None,
        nearest_intent=answer.nearest_intent if scoped else None,
        nearest_confidence=answer.nearest_confidence if scoped else None,
    )


def encode_result(result: TriageResult) -> bytes:
    return _ENCODER.encode(result)


def result_key(input_key: bytes | None, event: TicketEvent, carried: CarriedMetadata) -> bytes:
    """The input record's key, or the ticket id when the input had none or its key holds personal data (the
    key goes to every copy of the result: an e-mail address there would be in clear on each topic)."""
    if input_key is None or carried.key_is_personal(input_key):
        return event.ticket_id.encode("utf-8")
    return input_key


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


@dataclass(frozen=True, slots=True)
class DeadLetterRedaction:
    """What a dead letter redacts (docs/privacy.md#dead-letters): the worker's message always, with `words`
    (every kind, none kept: it may quote the value); the record's key, value and headers with `record`
    (`privacy.detect`'s kinds, none kept) where `dead_letter.redact` asks, else (None) they stay as taken,
    for replay."""

    words: Redactor
    record: Redactor | None

    @classmethod
    def configured(cls, privacy: PrivacySettings, dead_letter: DeadLetterSettings) -> DeadLetterRedaction:
        """The redaction `privacy` and `dead_letter` ask for."""
        return cls(privacy.log_redactor(), privacy.copy_redactor() if dead_letter.redact else None)

    def letter(
        self,
        key: bytes | None,
        value: bytes | None,
        headers: Headers | None,
        error_type: str,
        message: str,
        source: SourcePosition,
    ) -> tuple[bytes | None, bytes | None, Headers]:
        """The dead letter's key, value and headers for a record taken at `source`: as taken (or redacted),
        plus the `triage.*` headers that say why (`error_type`, `message`) and where it came from."""
        message = self.words.redact(message)
        where = (source.topic, source.partition, source.offset)
        if self.record is None:
            return key, value, dead_letter_headers(headers, error_type, message, *where)
        redactor = self.record
        redacted, form = redact_value(value, redactor) if value else (value, "text")
        key = None if key is None else redact_bytes(key, redactor)
        letter = dead_letter_headers(
            redact_headers(headers or (), redactor), error_type, message, *where, redacted=form
        )
        if form == REDACTED_DROPPED:
            assert value is not None  # only a value is dropped
            letter.append((OMITTED_BYTES, str(len(value)).encode("ascii")))
        return key, redacted, letter


def dead_letter(
    work: Work, topic: str, error_type: str, message: str, redaction: DeadLetterRedaction
) -> Output:
    """The dead letter of `work`'s record (`DeadLetterRedaction.letter`) for `topic`."""
    letter = redaction.letter(work.key, work.value, work.headers, error_type, message, work.source)
    return Output(topic, *letter)
