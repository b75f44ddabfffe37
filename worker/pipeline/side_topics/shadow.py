"""The shadow model: every ticket the primary classified is classified again by a second model, and that
answer goes to a side topic with the primary's answer alongside, to compare a candidate model on live traffic.

It is off the critical path: the shadow never delays, changes or blocks a primary result or a commit.

- Its model runs in its own pool (its own processes): `submit` never waits for the model, and answers are
  taken with a zero timeout once per turn of the loop.
- Side records go through their own producer (`side_topic.SideTopic`, as the review topic's do) and are
  counted neither in flight nor in the offsets: no commit ever waits for one, and they never take part
  in the primary's transactions or flushes.
- Drop rule: at most `window` shadow requests are outstanding. A ticket offered while the shadow is at that
  bound is not classified by the shadow (counted as dropped, `full`): under load the shadow gives way, never
  the primary. Requests still outstanding when the worker stops are dropped too (`shutdown`), and side records
  the broker has not acknowledged by then are counted as failed deliveries.
- Only tickets the primary *classified* are offered: fallbacks and dead letters have no primary answer to
  compare with. A shadow answer that is itself a fallback is written (the side topic shows it) but not
  compared.
- Rebalances change nothing here: a side record is about a ticket whose primary record was already produced;
  where the new owner redoes that ticket, it writes a second side record, as it writes a second primary one.
- With `pipeline.guarantee = "exactly_once"` the side topic stays at-least-once: its producer is never
  transactional (a transactional one would need the primary's transactions, or fence them), so a ticket
  redone after an aborted transaction has a second side record while its aborted primary one stays unseen.
  `shadow report` counts each source offset once.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import confluent_kafka
import msgspec
import structlog

from worker.classification import Classification, Classifier, ClassifyRequest, ticket_text
from worker.messages import PiiKind, ShadowResult, SourcePosition, TicketEvent, utc_timestamp
from worker.pipeline.metrics import LatencyHistogram, ShadowMetrics, latency_buckets
from worker.pipeline.side_topics.side_topic import SideTopic, WrittenResult
from worker.pipeline.triage.records import encode_result, triage_result
from worker.pipeline.work import Headers

_log = structlog.get_logger("worker.shadow")


@dataclass(frozen=True, slots=True)
class _Offer:
    """What a side record needs once the shadow answers."""

    event: TicketEvent
    source: SourcePosition
    key: bytes
    headers: Headers | None
    primary: Classification
    pii: tuple[PiiKind, ...]


class Shadow:
    """Offers classified tickets to `classifier` (at most `window` outstanding) and writes its answers to
    `topic` with `producer`. Each shadow request gets `budget_s` from its offer, like a ticket's deadline."""

    def __init__(
        self,
        classifier: Classifier,
        window: int,
        producer: confluent_kafka.Producer,
        topic: str,
        budget_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._classifier = classifier
        self._window = max(1, window)
        self._budget_s = budget_s
        self._clock = clock
        self._outstanding: dict[int, _Offer] = {}
        self._ids = itertools.count()
        self.metrics = ShadowMetrics(latency=LatencyHistogram(latency_buckets(budget_s)))
        self._side = SideTopic(producer, topic, self.metrics, "shadow")

    def offer(
        self,
        event: TicketEvent,
        source: SourcePosition,
        key: bytes,
        headers: Headers | None,
        primary: Classification,
        pii: Sequence[PiiKind] = (),
    ) -> None:
        """A ticket the primary classified (`primary`, not a fallback); dropped when the shadow is full."""
        self.metrics.offered += 1
        if len(self._outstanding) >= self._window:
            self.metrics.dropped["full"] += 1
            return
        request_id = next(self._ids)
        self._outstanding[request_id] = _Offer(event, source, key, headers, primary, tuple(pii))
        self.metrics.outstanding = len(self._outstanding)
        deadline = self._clock() + self._budget_s
        self._classifier.submit(ClassifyRequest(request_id, ticket_text(event.subject, event.body), deadline))

    def written(self, result: WrittenResult) -> None:
        """Every classified result is offered (fallbacks are not: the model gave no answer to compare)."""
        if not result.answer.fallback:
            self.offer(
                result.event, result.source, result.key, result.headers, result.answer, result.scan.kinds
            )

    def serve(self) -> None:
        """Take the answers that are ready (no waiting), write their side records, serve delivery reports."""
        if self._outstanding:
            answers = self._classifier.poll(0.0)
            made_at = utc_timestamp() if answers else None  # one clock read per batch
            for request_id, answer in answers:
                offer = self._outstanding.pop(request_id, None)
                if offer is not None:
                    self._answered(offer, answer, made_at)
            self.metrics.outstanding = len(self._outstanding)
        self._side.serve()

    def close(self, flush_s: float) -> None:
        """At shutdown, after the primary's last commit: drop what is still at the model, and give the side
        records already produced up to `flush_s` to be acknowledged."""
        if self._outstanding:
            self.metrics.dropped["shutdown"] += len(self._outstanding)
            self._outstanding.clear()
            self.metrics.outstanding = 0
        not_flushed = self._side.close(flush_s)
        _log.info("shadow_stopped", not_flushed=not_flushed, **self.metrics.snapshot())

    def _answered(self, offer: _Offer, answer: Classification, made_at: str | None) -> None:
        self.metrics.latency.observe(answer.latency_ms / 1000.0)
        if answer.fallback:
            self.metrics.fallback[answer.fallback_reason or "unknown"] += 1
        else:
            self.metrics.compared(offer.primary.intent, answer.intent)
        record = shadow_record(offer.event, answer, offer.source, offer.primary, made_at, offer.pii)
        self._side.write(encode_result(record), offer.key, offer.headers)


def shadow_record(
    event: TicketEvent,
    answer: Classification,
    source: SourcePosition,
    primary: Classification,
    classified_at: str | None = None,
    pii: Sequence[PiiKind] = (),
) -> ShadowResult:
    """The side record: the shadow's TriageResult plus the primary's intent, priority and model."""
    result = triage_result(event, answer, source, classified_at, pii)
    return ShadowResult(
        **msgspec.structs.asdict(result),
        primary_intent=primary.intent,
        primary_priority=primary.priority,
        primary_model=primary.model,
    )
