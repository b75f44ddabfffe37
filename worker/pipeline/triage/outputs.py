"""What the pipeline writes for a ticket: its triage record, or a dead letter, handed to the guarantee.

- `result(work, answer, made_at)`: the `TriageResult` in the output format (`output.format`), keyed by the
  input key (or the ticket id, where the key holds personal data), with the input's headers that
  `privacy.carry_headers` names, their personal data redacted, carried up to `pipeline.max_header_bytes`; then
  every side topic (`ResultWatcher`: the shadow, the review) is told of it, with the
  same key and headers. Side topics never hold the record or a commit back.
- `dead_letter(work, error_type, message)`: the original record with the reason, its personal data masked
  where `dead_letter.redact` asks (`records.py`).

How and when each output reaches Kafka is the guarantee's (`guarantees.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import structlog

from worker.classification import Classification
from worker.messages import TriageResult
from worker.pipeline.metrics import PipelineMetrics
from worker.pipeline.side_topics.side_topic import ResultWatcher, WrittenResult
from worker.pipeline.triage.records import (
    DeadLetterRedaction,
    carried_headers,
    dead_letter,
    result_key,
    triage_result,
)
from worker.pipeline.work import Output, Work
from worker.privacy.values import CarriedMetadata
from worker.settings import DeadLetterSettings, PrivacySettings, TopicSettings

_log = structlog.get_logger("worker.pipeline")

# Fallback reasons that mean the ticket's deadline passed (its trace says `deadline_expired`).
_PAST_DEADLINE = frozenset({"overloaded", "expired_on_arrival", "deadline_exceeded"})


class Outputs:
    """Builds each record's output and hands it to `write` (the guarantee's): results to `topics.output`
    carrying the input headers `privacy` lets through, up to `max_header_bytes`; dead letters to
    `topics.dead_letter`, redacted as `privacy` and `dead_letter` say."""

    def __init__(
        self,
        topics: TopicSettings,
        privacy: PrivacySettings,
        dead_letter: DeadLetterSettings,
        max_header_bytes: int,
        encode: Callable[[TriageResult], bytes],
        write: Callable[[Work, Output], None],
        side_topics: Sequence[ResultWatcher],
        metrics: PipelineMetrics,
    ) -> None:
        self._output_topic = topics.output
        self._dead_letter_topic = topics.dead_letter
        self._max_header_bytes = max_header_bytes
        self.redact_as(privacy, dead_letter)
        self._encode, self._write = encode, write
        self._side_topics = side_topics
        self._metrics = metrics

    def redact_as(self, privacy: PrivacySettings, dead_letter: DeadLetterSettings) -> None:
        """Write every output from now on redacted as `privacy` and `dead_letter` say (a hot reload's, from
        its thread): one reference replaced, so an output is written wholly as before or wholly as after."""
        carried = CarriedMetadata(privacy.copy_redactor(), privacy.carry_headers)
        self._redaction = (carried, DeadLetterRedaction.configured(privacy, dead_letter))

    def result(self, work: Work, answer: Classification, made_at: str = "") -> None:
        event, scan = work.event, work.scan
        assert event is not None and scan is not None  # a ticket: set by the intake
        carried = self._redaction[0]
        value = self._encode(triage_result(event, answer, work.source, made_at or None, scan.kinds))
        key = result_key(work.key, event, carried)
        headers, left_off = carried_headers(carried.headers(work.headers), self._max_header_bytes)
        if left_off:
            self._metrics.headers_left_off += left_off
            _log.debug("headers_left_off", partition=work.partition, offset=work.offset, count=left_off)
        if answer.out_of_scope:
            self._metrics.out_of_scope += 1
        if answer.fallback:
            reason = answer.fallback_reason or "unknown"
            work.trace.outcome("deadline_expired" if reason in _PAST_DEADLINE else "fallback", reason)
        work.trace.begin("produce", topic=self._output_topic)
        self._write(work, Output(self._output_topic, key, value, work.trace.headers(headers)))
        if self._side_topics:
            written = WrittenResult(event, scan, answer, work.source, key, headers, made_at or None)
            for side in self._side_topics:
                side.written(written)

    def dead_letter(self, work: Work, error_type: str, message: str) -> None:
        self._metrics.dead_letter(error_type)
        _log.debug(
            "dead_lettered",
            topic=work.topic,
            partition=work.partition,
            offset=work.offset,
            error_type=error_type,
        )
        letter = dead_letter(work, self._dead_letter_topic, error_type, message, self._redaction[1])
        work.trace.outcome("dead_letter", error_type)  # its type only: the message may quote the value
        work.trace.begin("produce", topic=self._dead_letter_topic)
        self._write(work, dataclasses.replace(letter, headers=work.trace.headers(letter.headers)))
