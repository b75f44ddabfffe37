"""Side topics: records *about* tickets (the shadow model's answers, results sent to review) written next
to the primary output, at least once and off the critical path.

A side record goes through a producer of its own and is counted neither in flight nor in the offsets:
no commit ever waits for one, and none takes part in the primary's transactions or flushes. A record that
cannot be queued at once (the local queue is full) is dropped and counted, never waited for; delivery
failures are counted, never retried. Where the primary redoes a ticket (a crash, a rebalance, an aborted
transaction), its side records are written again: readers count each source position once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import confluent_kafka
import structlog

from worker.classification import Classification
from worker.kafka.clients import produce
from worker.messages import SourcePosition, TicketEvent
from worker.pipeline.work import Headers
from worker.privacy.redaction import TicketScan

_log = structlog.get_logger("worker.side_topic")


@dataclass(frozen=True, slots=True)
class WrittenResult:
    """A triage record the pipeline wrote, as a side topic sees it: the ticket (`scan`: its personal data),
    the answer, where the ticket came from, the record's key and headers, and when it was made (None: now)."""

    event: TicketEvent
    scan: TicketScan
    answer: Classification
    source: SourcePosition
    key: bytes
    headers: Headers | None
    made_at: str | None


class ResultWatcher(Protocol):
    """A side topic of the pipeline (the shadow, the review): told of every result written, served once per
    turn of the loop, closed after the last commit. It never holds a result or a commit back."""

    def written(self, result: WrittenResult) -> None: ...
    def serve(self) -> None: ...
    def close(self, flush_s: float) -> None: ...


class DeliveryCounts(Protocol):
    """Where a side topic's outcomes are counted (a metrics object)."""

    produced: int
    delivery_failed: int


class SideTopic:
    """Writes records to `topic` with `producer` (its own), counting outcomes in `counts`; `name` prefixes
    its log events."""

    def __init__(
        self, producer: confluent_kafka.Producer, topic: str, counts: DeliveryCounts, name: str
    ) -> None:
        self._producer = producer
        self.topic = topic
        self._counts = counts
        self._name = name

    def write(self, value: bytes, key: bytes | None, headers: Headers | None) -> None:
        try:
            # Never waits for room in a full local queue: a record that cannot be queued now is dropped.
            produce(self._producer, self.topic, value, key, headers, self._on_delivery, give_up_at=0.0)
        except (BufferError, confluent_kafka.KafkaException) as error:
            self._counts.delivery_failed += 1
            _log.debug(f"{self._name}_record_not_sent", reason=str(error))

    def serve(self) -> None:
        """Serve delivery reports (never waits)."""
        self._producer.poll(0)

    def close(self, flush_s: float) -> int:
        """Give the records already produced up to `flush_s` to be acknowledged; those that were not are
        counted as failed deliveries, and their number returned."""
        not_flushed: int = self._producer.flush(flush_s)
        self._counts.delivery_failed += not_flushed
        return not_flushed

    def _on_delivery(self, error: confluent_kafka.KafkaError | None, _message: Any) -> None:
        if error is None:
            self._counts.produced += 1
        else:
            self._counts.delivery_failed += 1
            _log.debug(f"{self._name}_delivery_failed", code=error.name(), reason=error.str())
