"""Counters, gauges and latency histograms of the pipeline.

They are plain numbers updated by the single consumer thread, so the hot path costs an integer add (a
histogram adds a bisect). Two readers take them from there: the `metrics` log event at an interval and at
shutdown (JSON logs feed any collector, and the end-to-end tests read them, e.g. `in_flight_max` and
`rss_bytes`), and the Prometheus exporter (`worker/telemetry/`), which reads them at scrape time from
its HTTP thread. Values that need the consumer (partition state, lag, group membership) are copied into an
immutable `PartitionGauges` on the consumer thread about once a second, so a scrape never touches the
consumer and the consumer never waits for a scrape.
"""

from __future__ import annotations

import bisect
import collections
import os
import time
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import confluent_kafka

from worker.decoding import REGISTRY_CAUSES, RegistryCause
from worker.kafka.commits import TopicPartitionKey
from worker.pipeline.settlements.offsets import PartitionOffsets
from worker.pipeline.tracing import TraceIds

# Seconds: from a 1 ms model step to a deadline overrun. 2.0 is the default deadline: an alert on "p99 above
# the deadline" must sit on a bucket bound, or histogram_quantile interpolates across the deadline and the
# alert fires (or not) on a guess. `latency_buckets` adds the configured deadline when it is another value.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# How often the loop copies partition state and lag for the exporter.
GAUGE_INTERVAL_S = 1.0


def latency_buckets(deadline_s: float | None = None) -> tuple[float, ...]:
    """The latency buckets, with the configured deadline as one of their bounds."""
    if deadline_s is None:
        return LATENCY_BUCKETS_S
    return tuple(sorted({*LATENCY_BUCKETS_S, deadline_s}))


def current_rss_bytes() -> int | None:
    """This process's resident set size now (not the peak), or None where /proc is not available."""
    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            resident_pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


class TracedObservation(NamedTuple):
    """A sampled ticket's latency observation, exported with its bucket as an OpenMetrics exemplar: its
    trace's ids, the seconds observed and when (Unix time: Prometheus then keeps it once, not per scrape)."""

    trace_ids: TraceIds
    seconds: float
    at: float


class LatencyHistogram:
    """Fixed-bucket histogram written by one thread and read by another (a scrape copies the counts). Each
    bucket also keeps the latest observation of a sampled ticket that fell in it (its exemplar)."""

    __slots__ = ("_counts", "_sum", "_traced", "bounds")

    def __init__(self, bounds: Sequence[float] = LATENCY_BUCKETS_S) -> None:
        self.bounds = tuple(bounds)
        # One count per bucket (not cumulative); the last one holds observations above every bound.
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0
        self._traced: list[TracedObservation | None] = [None] * (len(self.bounds) + 1)

    def observe(self, seconds: float, trace_ids: TraceIds | None = None) -> None:
        """Count `seconds`; `trace_ids` (a sampled ticket's, see `TicketTrace.trace_ids`) become its bucket's
        exemplar. Without them (tracing off, a ticket not sampled) nothing else is done."""
        # bisect_left puts a value equal to a bound into that bound's bucket, as Prometheus' `le` says.
        bucket = bisect.bisect_left(self.bounds, seconds)
        self._counts[bucket] += 1
        self._sum += seconds
        if trace_ids is not None:
            self._traced[bucket] = TracedObservation(trace_ids, seconds, time.time())

    def snapshot(self) -> tuple[list[int], float]:
        """Per-bucket counts (the last is +Inf only) and the sum of observations."""
        return list(self._counts), self._sum

    def exemplars(self) -> list[TracedObservation | None]:
        """Per bucket, as `snapshot`'s counts: the latest sampled ticket's observation in it, if any."""
        return list(self._traced)


@dataclass(frozen=True)
class PartitionGauges:
    """Partition state as the consumer thread last saw it; replaced whole, never mutated."""

    assigned: tuple[TopicPartitionKey, ...] = ()
    paused: tuple[TopicPartitionKey, ...] = ()
    blocked: tuple[TopicPartitionKey, ...] = ()
    # Log end offset (as of the last fetch) minus the next offset this worker will read; partitions whose
    # end offset is not known yet are left out.
    lag: tuple[tuple[TopicPartitionKey, int], ...] = ()
    # Joined the consumer group (has a member id).
    member: bool = False


# Why a ticket offered to the shadow got no shadow answer (the label values of its `dropped` counter).
SHADOW_DROP_REASONS: tuple[str, ...] = ("full", "shutdown")


@dataclass
class ShadowMetrics:
    """The shadow model's side of things (see side_topics/shadow.py); written by the loop's thread."""

    # Tickets the primary classified and offered to the shadow; those not taken, by why (`full`: the shadow
    # was at its bound; `shutdown`: still at the shadow when the worker stopped).
    offered: int = 0
    dropped: collections.Counter[str] = field(default_factory=collections.Counter)
    # Shadow classifications that named the primary's intent, and those that did not, by (primary, shadow).
    agreed: int = 0
    disagreed: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    # Shadow answers that were fallbacks (deadline, model error, ...), by reason: not compared.
    fallback: collections.Counter[str] = field(default_factory=collections.Counter)
    # Side records the broker acknowledged, and those it did not (or that were never sent).
    produced: int = 0
    delivery_failed: int = 0
    outstanding: int = 0
    # The shadow model's own time per ticket, comparable with `PipelineMetrics.model_latency`.
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)

    def compared(self, primary_intent: str, shadow_intent: str) -> None:
        if primary_intent == shadow_intent:
            self.agreed += 1
        else:
            self.disagreed[(primary_intent, shadow_intent)] += 1

    def snapshot(self) -> dict[str, Any]:
        disagreed = sum(self.disagreed.values())
        compared = self.agreed + disagreed
        return {
            "offered": self.offered,
            "dropped": dict(self.dropped),
            "agreed": self.agreed,
            "disagreed": disagreed,
            "agreement": round(self.agreed / compared, 4) if compared else None,
            "top_disagreements": {f"{p}->{s}": n for (p, s), n in self.disagreed.most_common(5)},
            "fallback": dict(self.fallback),
            "produced": self.produced,
            "delivery_failed": self.delivery_failed,
            "outstanding": self.outstanding,
        }


# Escalated tickets end one of these ways: the stage named another intent, the same one, or no answer.
ESCALATION_OUTCOMES = ("changed", "confirmed", "failed")
# Why a ticket under the threshold was not escalated (the gate's reasons, see triage/cascade.py).
SKIP_REASONS = ("deadline", "overloaded")


@dataclass
class EscalationMetrics:
    """The cascade's escalation stage (see triage/cascade.py); written by the loop's thread."""

    # Escalated tickets by (outcome, the first stage's intent).
    escalated: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    # Tickets under the threshold the gate kept at the first stage, by reason.
    skipped: collections.Counter[str] = field(default_factory=collections.Counter)
    outstanding: int = 0
    # Submit → answer as the loop sees it (what the gate's p95 is taken from), and the stage's model time.
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    model_latency: LatencyHistogram = field(default_factory=LatencyHistogram)

    @classmethod
    def starting(cls, intents: Iterable[str]) -> EscalationMetrics:
        """Every series known in advance at 0, so that a rate() sees the first escalation."""
        metrics = cls()
        metrics.escalated.update({(o, i): 0 for o in ESCALATION_OUTCOMES for i in intents})
        metrics.skipped.update(dict.fromkeys(SKIP_REASONS, 0))
        return metrics

    def outcome(self, first_intent: str, outcome: str) -> None:
        self.escalated[(outcome, first_intent)] += 1

    def snapshot(self) -> dict[str, Any]:
        by_outcome: collections.Counter[str] = collections.Counter()
        for (outcome, _), count in self.escalated.items():
            by_outcome[outcome] += count
        return {
            "escalated": dict(by_outcome),
            "skipped": dict(self.skipped),
            "outstanding": self.outstanding,
        }


@dataclass
class ReviewMetrics:
    """Results sent to the review topic (see side_topics/review.py); written by the loop's thread."""

    # By (intent, reason): `low_confidence` or `fallback`.
    sent: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    # Review records the broker acknowledged, and those it did not (or that were never sent).
    produced: int = 0
    delivery_failed: int = 0

    def snapshot(self) -> dict[str, Any]:
        by_intent: collections.Counter[str] = collections.Counter()
        for (intent, _), count in self.sent.items():
            by_intent[intent] += count
        return {
            "sent": sum(self.sent.values()),
            "top_intents": dict(by_intent.most_common(5)),
            "produced": self.produced,
            "delivery_failed": self.delivery_failed,
        }


@dataclass
class RegistryState:
    """The Schema Registry as the pipeline sees it (registry input formats only): `outage` says why it is
    taken as down (None: answering) and `cause` names that reason's kind (`RegistryCause`: outage,
    credentials, registry_error), `waiting` the partitions held at a record it gave no answer about,
    `retries_by_cause` how many times a record was held back for it, by cause
    (worker/pipeline/registry_wait.py)."""

    outage: str | None = None
    cause: RegistryCause | None = None
    waiting: tuple[TopicPartitionKey, ...] = ()
    retries_by_cause: dict[RegistryCause, int] = field(
        default_factory=lambda: dict.fromkeys(REGISTRY_CAUSES, 0)
    )

    @property
    def retries(self) -> int:
        return sum(self.retries_by_cause.values())

    def snapshot(self) -> dict[str, Any]:
        return {
            "outage": self.outage,
            "cause": self.cause,
            "waiting": [f"{t}[{p}]" for t, p in self.waiting],
            "retries": self.retries,
            "retries_by_cause": dict(self.retries_by_cause),
        }


@dataclass
class QueueMetrics:
    """Queue mode (a share group): how the records were acknowledged, and the batches polled."""

    accepted: int = 0
    released: int = 0
    rejected: int = 0
    # Of the released: records never taken (the lock left no time for them; each cost a delivery).
    released_untried: int = 0
    # Records dead-lettered on their last delivery: the model process died under them, or the Schema Registry
    # could not answer for them.
    delivery_count_exceeded: int = 0
    batches: int = 0
    # What a poll asks for (max.poll.records), from the measured rate.
    fetch_size: int = 0

    def snapshot(self) -> dict[str, Any]:
        return {
            "accepted": self.accepted,
            "released": self.released,
            "released_untried": self.released_untried,
            "rejected": self.rejected,
            "delivery_count_exceeded": self.delivery_count_exceeded,
            "batches": self.batches,
            "fetch_size": self.fetch_size,
        }


@dataclass
class PipelineMetrics:
    consumed: int = 0
    # Records re-delivered for an offset already being processed (after a seek back); skipped.
    redelivered: int = 0
    classified: int = 0
    # Results answered "none of these" (the encoder stage's out-of-scope intent; among `classified`).
    out_of_scope: int = 0
    fallback: collections.Counter[str] = field(default_factory=collections.Counter)
    dead_lettered: int = 0
    dead_lettered_by_type: collections.Counter[str] = field(default_factory=collections.Counter)
    # Personal data found in tickets, by kind (docs/privacy.md), and the tickets that had any.
    pii_found: collections.Counter[str] = field(default_factory=collections.Counter)
    pii_tickets: int = 0
    # Records (results and dead letters) the broker acknowledged.
    produced: int = 0
    delivery_failed: int = 0
    # Offsets released by a commit the broker confirmed.
    committed: int = 0
    commit_failed: int = 0
    # Exactly-once: transactions committed, and aborted (their work redone).
    transactions: int = 0
    transactions_aborted: int = 0
    # Results of partitions revoked or lost while their ticket was at the model: the new owner redoes them.
    discarded_after_revoke: int = 0
    # Input headers left off triage records (over `pipeline.max_header_bytes`).
    headers_left_off: int = 0
    revoked: int = 0
    lost: int = 0
    max_poll_exceeded: int = 0
    in_flight: int = 0
    in_flight_max: int = 0
    paused: bool = False
    # Poll → broker acknowledgement of the ticket's record; the model's own time; waiting for a context.
    end_to_end: LatencyHistogram = field(default_factory=LatencyHistogram)
    model_latency: LatencyHistogram = field(default_factory=LatencyHistogram)
    queue_wait: LatencyHistogram = field(default_factory=LatencyHistogram)
    # time.monotonic() of the loop's last turn (None before the first): what /healthz watches.
    loop_turned_at: float | None = None
    partitions: PartitionGauges = field(default_factory=PartitionGauges)
    # Partitions a hanging transaction is suspected to hold (exactly-once: worker/pipeline/hanging.py).
    hanging: tuple[TopicPartitionKey, ...] = ()
    # Set when a shadow model runs, when results go to review, and when the cascade runs.
    shadow: ShadowMetrics | None = None
    review: ReviewMetrics | None = None
    escalation: EscalationMetrics | None = None
    # Set when the input format reads a Schema Registry.
    registry: RegistryState | None = None
    # Set in queue mode.
    queue: QueueMetrics | None = None
    _gauges_at: float = float("-inf")

    def dead_letter(self, error_type: str) -> None:
        self.dead_lettered += 1
        self.dead_lettered_by_type[error_type] += 1

    def turned(
        self,
        now: float,
        consumer: confluent_kafka.Consumer,
        assigned: Iterable[PartitionOffsets],
        paused: Collection[TopicPartitionKey],
    ) -> None:
        """Called by the loop each turn: marks it alive, and about once a second copies partition state.

        Only local consumer calls (cached watermarks, positions, member id): no broker round trip.
        """
        self.loop_turned_at = now
        if now - self._gauges_at < GAUGE_INTERVAL_S:
            return
        self._gauges_at = now
        states = list(assigned)
        keys = sorted(state.key for state in states)
        lag: list[tuple[TopicPartitionKey, int]] = []
        try:
            positions = (
                consumer.position([confluent_kafka.TopicPartition(t, p) for t, p in keys]) if keys else []
            )
            for tp in positions:
                _, high = consumer.get_watermark_offsets(tp, cached=True)
                # Before the first fetch either is negative (unknown): left out rather than shown as 0.
                if high >= 0 and tp.offset >= 0:
                    lag.append(((tp.topic, tp.partition), max(0, high - tp.offset)))
        except confluent_kafka.KafkaException:
            pass  # a partition the client does not know (yet): lag is left out; a gauge never stops the loop
        self.partitions = PartitionGauges(
            assigned=tuple(keys),
            paused=tuple(sorted(paused)),
            blocked=tuple(sorted(state.key for state in states if state.blocked_at is not None)),
            lag=tuple(lag),
            member=bool(consumer.memberid()),
        )

    @classmethod
    def for_deadline(cls, deadline_s: float) -> PipelineMetrics:
        """Metrics whose latency histograms have the ticket deadline as a bucket bound."""
        bounds = latency_buckets(deadline_s)
        return cls(
            end_to_end=LatencyHistogram(bounds),
            model_latency=LatencyHistogram(bounds),
            queue_wait=LatencyHistogram(bounds),
        )

    def snapshot(self) -> dict[str, Any]:
        return {
            "consumed": self.consumed,
            "redelivered": self.redelivered,
            "classified": self.classified,
            "out_of_scope": self.out_of_scope,
            "fallback": dict(self.fallback),
            "dead_lettered": self.dead_lettered,
            "pii_tickets": self.pii_tickets,
            "pii_found": dict(self.pii_found),
            "produced": self.produced,
            "delivery_failed": self.delivery_failed,
            "committed": self.committed,
            "commit_failed": self.commit_failed,
            "transactions": self.transactions,
            "transactions_aborted": self.transactions_aborted,
            "discarded_after_revoke": self.discarded_after_revoke,
            "partitions_revoked": self.revoked,
            "partitions_lost": self.lost,
            "max_poll_exceeded": self.max_poll_exceeded,
            "in_flight": self.in_flight,
            "in_flight_max": self.in_flight_max,
            "paused": self.paused,
            "rss_bytes": current_rss_bytes(),
            **({"shadow": self.shadow.snapshot()} if self.shadow is not None else {}),
            **({"escalation": self.escalation.snapshot()} if self.escalation is not None else {}),
            **({"review": self.review.snapshot()} if self.review is not None else {}),
            **({"schema_registry": self.registry.snapshot()} if self.registry is not None else {}),
            **({"queue": self.queue.snapshot()} if self.queue is not None else {}),
        }
