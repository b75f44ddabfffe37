"""The review topic: results a person should check are also written, with the ticket's text, to a side
topic (`topics.review`), where `triage-worker review` shows them to a reviewer.

A classified result goes there when its confidence is under `review.threshold` (or, with a threshold set,
when it was answered "none of these": `out_of_scope`); a fallback (no model answer) when `review.fallbacks`
is on. The primary output is untouched: the record on the review topic is the same
TriageResult plus the ticket's subject and body (`ReviewRecord`), with personal data redacted (the ticket's
`TicketScan`, docs/privacy.md), written at least once through its own
producer, off the critical path, exactly as the shadow's side records are (see `side_topic.py`).
"""

from __future__ import annotations

import confluent_kafka
import msgspec
import structlog

from worker.classification import Classification
from worker.messages import ReviewReason, ReviewRecord, SourcePosition, TicketEvent
from worker.pipeline.metrics import ReviewMetrics
from worker.pipeline.side_topics.side_topic import SideTopic, WrittenResult
from worker.pipeline.triage.records import encode_result, triage_result
from worker.pipeline.work import Headers
from worker.privacy.redaction import TicketScan
from worker.settings import ReviewSettings

_log = structlog.get_logger("worker.review")


def review_reason(settings: ReviewSettings, answer: Classification) -> ReviewReason | None:
    """Why `answer` goes to review, or None when it does not."""
    if answer.fallback:
        return "fallback" if settings.fallbacks else None
    if settings.threshold is not None and answer.out_of_scope:
        return "out_of_scope"  # a kind of ticket the taxonomy lacks: what reviewers most need to see
    if settings.threshold is not None and answer.confidence < settings.threshold:
        return "low_confidence"
    return None


def review_record(
    event: TicketEvent,
    scan: TicketScan,
    answer: Classification,
    source: SourcePosition,
    reason: ReviewReason,
    classified_at: str | None = None,
) -> ReviewRecord:
    """The review copy of `event`'s result: its text is the scan's, redacted (never the event's own)."""
    result = triage_result(event, answer, source, classified_at, scan.kinds)
    return ReviewRecord(
        **msgspec.structs.asdict(result), review_reason=reason, subject=scan.subject, body=scan.body
    )


class Review:
    """Writes the results that `settings` send to review to `topic` with `producer` (its own)."""

    def __init__(self, settings: ReviewSettings, producer: confluent_kafka.Producer, topic: str) -> None:
        self._settings = settings
        self.metrics = ReviewMetrics()
        self._side = SideTopic(producer, topic, self.metrics, "review")

    def review_as(self, settings: ReviewSettings) -> None:
        """Send the results written from now on to review as `settings` say (a hot reload's, from its
        thread; off: none is sent, the producer stays)."""
        self._settings = settings

    def consider(
        self,
        event: TicketEvent,
        scan: TicketScan,
        answer: Classification,
        source: SourcePosition,
        key: bytes,
        headers: Headers | None,
        classified_at: str | None = None,
    ) -> None:
        """A result the pipeline wrote: sent to review too when it should be, with the text of `scan`."""
        reason = review_reason(self._settings, answer)
        if reason is None:
            return
        self.metrics.sent[(answer.intent, reason)] += 1
        record = review_record(event, scan, answer, source, reason, classified_at)
        self._side.write(encode_result(record), key, headers)

    def written(self, result: WrittenResult) -> None:
        self.consider(
            result.event,
            result.scan,
            result.answer,
            result.source,
            result.key,
            result.headers,
            result.made_at,
        )

    def serve(self) -> None:
        self._side.serve()

    def close(self, flush_s: float) -> None:
        """At shutdown, after the primary's last commit: `flush_s` for the records not yet acknowledged."""
        not_flushed = self._side.close(flush_s)
        _log.info("review_stopped", not_flushed=not_flushed, **self.metrics.snapshot())
