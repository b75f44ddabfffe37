"""The consumer loop: consume → decode → dispatch → classify → produce → commit, on one thread.

One thread owns the consumer, the producer and the offset tracker; the model runs in the inference pool
(other processes or threads), so a slow model never stops this loop from polling. Each turn of the loop:

1. serves the producer's delivery reports (a record is *done* only once the broker acknowledged it);
2. takes the pool's answers and produces one TriageResult per ticket;
3. turns tickets whose deadline passed while they waited for the model into `overloaded` fallbacks;
4. hands waiting tickets to the pool, at most `dispatch_window` at a time (the rest wait here, where their
   deadline is watched);
5. commits the highest contiguous done offset + 1 of each partition (periodically, or early when done work
   piles up), asynchronously;
6. pauses every assigned partition at `max_in_flight` and resumes below the low-water mark, but *always*
   polls, so the group never evicts the worker however slow the model is;
7. polls a batch no larger than the free capacity, decodes it, dead-letters what is not a ticket and queues
   the rest with its deadline.

Rebalances (cooperative-sticky by default): nothing new is taken from revoked partitions; the tickets
already taken from them (queued ones go to the model first) get up to `revoke_timeout_ms` to finish while
the loop keeps serving the pool and the producer, done offsets are committed synchronously, and only then
does the callback return, so the new owner starts where this worker stopped (no redone work within the
timeout). Answers that arrive later for a revoked partition are *discarded*, not
produced: the partition's new owner re-reads them from the committed offset, so producing them too would
only add duplicates. Lost partitions (the group moved on without us) are forgotten without a commit.

Delivery: the producer is idempotent with acks=all and retries by itself until `delivery.timeout.ms`. A
delivery that still fails stops that partition: its commit position never passes the failed offset, it is
paused, and the failure is logged; the other partitions continue, and a restart or rebalance re-reads it.

Shutdown (first SIGTERM/SIGINT): stop taking new records, finish the tickets already taken within
`shutdown_timeout_ms`, flush the producer, commit synchronously, close the consumer (leaving the group) and
the pool; exit code 0. A second signal exits at once; anything not committed is re-read by the next owner.
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import confluent_kafka
import structlog

from worker.config import Settings
from worker.decoding import DecodeError, decode_ticket
from worker.inference.engine import ClassifyRequest
from worker.inference.prompt import ticket_text
from worker.kafka.clients import ClientErrorLog, consumer_config, create_consumer, create_producer
from worker.kafka.dead_letters import dead_letter_headers
from worker.messages import FallbackReason, Priority, SourcePosition, TicketEvent
from worker.pipeline.deadlines import ticket_deadline
from worker.pipeline.inflight import Flow, InFlightGate
from worker.pipeline.metrics import PipelineMetrics
from worker.pipeline.offsets import OffsetTracker, PartitionOffsets, TopicPartitionKey
from worker.pipeline.records import (
    ClassificationLike,
    encode_result,
    fallback_result,
    result_key,
    triage_result,
)

_log = structlog.get_logger("worker.pipeline")

# While work is in flight the loop waits at most this long on any one queue, so that delivery reports,
# commit confirmations and model answers are all picked up promptly.
_BUSY_WAIT_S = 0.01
# An asynchronous commit whose confirmation has not come back after this long no longer holds back the next.
_COMMIT_STALE_S = 10.0

Headers = list[tuple[str, bytes | None]]


class Classifier(Protocol):
    """What the loop needs from the inference pool: non-blocking submit, polling for answers."""

    @property
    def model_id(self) -> str: ...

    def submit(self, request: ClassifyRequest) -> None: ...

    def poll(self, timeout: float) -> Sequence[tuple[int, ClassificationLike]]: ...


@dataclass(frozen=True)
class Fallback:
    """What an `overloaded` record says when the model is not asked (the taxonomy's fallback label)."""

    intent: str
    priority: Priority


@dataclass(eq=False, slots=True)
class _Work:
    """One record taken from Kafka, from poll until its offset is committed."""

    state: PartitionOffsets
    topic: str
    partition: int
    offset: int
    key: bytes | None
    headers: Headers | None
    polled_at: float
    deadline: float
    event: TicketEvent | None = None

    @property
    def source(self) -> SourcePosition:
        return SourcePosition(topic=self.topic, partition=self.partition, offset=self.offset)


class Pipeline:
    """Runs the loop until `request_stop()`; `run()` returns the process exit code."""

    def __init__(
        self,
        settings: Settings,
        classifier: Classifier,
        fallback: Fallback,
        dispatch_window: int,
        metrics_interval_s: float = 10.0,
        client_logger: logging.Logger | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._pipeline = settings.pipeline
        self._topics = settings.topics
        self._error_log = ClientErrorLog("worker")
        self._consumer = create_consumer(
            settings, on_error=self.on_client_error, on_commit=self.on_commit, logger=client_logger
        )
        self._producer = create_producer(settings, on_error=self.on_client_error, logger=client_logger)
        self._classifier = classifier
        self._fallback = fallback
        self._window = max(1, dispatch_window)
        self._metrics_interval_s = metrics_interval_s
        self._clock = clock
        self._cooperative = "cooperative" in consumer_config(settings)["partition.assignment.strategy"]
        self._tracker = OffsetTracker()
        self._gate = InFlightGate(self._pipeline.max_in_flight, self._pipeline.resume_threshold)
        self.metrics = PipelineMetrics()
        self._queue: collections.deque[_Work] = collections.deque()
        self._at_model: dict[int, _Work] = {}
        self._unacked: dict[int, _Work] = {}
        self._ids = itertools.count()
        # Work of revoked/lost partitions still at the model or awaiting acknowledgement: counted as in
        # flight (it holds memory) until its answer or delivery report arrives.
        self._orphans = 0
        self._paused: set[TopicPartitionKey] = set()
        self._blocked: set[TopicPartitionKey] = set()
        self._stopping = False
        self._stop_by: float | None = None
        self._fatal: str | None = None
        now = clock()
        self._last_commit = now
        self._commit_sent_at: float | None = None
        self._last_metrics = now

    # -- public ---------------------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Begin a graceful shutdown at the next turn of the loop (safe from a signal handler)."""
        self._stopping = True

    def on_client_error(self, error: confluent_kafka.KafkaError) -> None:
        """error_cb of both clients: transient errors are the client's to retry; fatal ones end the run."""
        if error.fatal():
            self._fatal = f"{error.name()}: {error.str()}"
            _log.error("kafka_fatal_error", code=error.name(), reason=error.str())
        else:
            self._error_log(error)

    def run(self) -> int:
        self._consumer.subscribe(
            [self._topics.input],
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )
        _log.info(
            "pipeline_started",
            input=self._topics.input,
            output=self._topics.output,
            dead_letter=self._topics.dead_letter,
            group=self._pipeline.group_id,
            max_in_flight=self._pipeline.max_in_flight,
            resume_below=self._pipeline.resume_threshold,
            deadline_ms=self._pipeline.deadline_ms,
            dispatch_window=self._window,
            model=self._classifier.model_id,
        )
        while not self._stopping and self._fatal is None:
            self._turn()
        return self._shutdown()

    # -- the loop -------------------------------------------------------------------------------------------

    def _turn(self) -> None:
        self._service(wait_s=0.0)
        capacity = self._gate.capacity()
        busy = bool(self._at_model)
        idle = not busy and len(self._tracker) == 0 and self._orphans == 0
        wait_s = self._pipeline.poll_timeout_ms / 1000.0 if idle else _BUSY_WAIT_S
        # Even with no capacity (partitions paused) the consumer is polled: that keeps the member alive.
        messages = self._consumer.consume(
            num_messages=max(1, min(self._pipeline.poll_batch_size, capacity)),
            timeout=0.0 if busy else wait_s,
        )
        self._take(messages)
        if busy:
            self._collect(wait_s)
        self._maybe_log_metrics()

    def _service(self, wait_s: float) -> None:
        """Everything but polling the consumer: reports, answers, expiry, dispatch, commit, flow control."""
        self._producer.poll(0)
        self._collect(wait_s)
        self._expire_queued()
        self._dispatch()
        self._maybe_commit()
        self._apply_flow()

    def _take(self, messages: list[confluent_kafka.Message]) -> None:
        now = self._clock()
        wall = time.time()
        for message in messages:
            error = message.error()
            if error is not None:
                self._consumer_error(error)
                continue
            topic, partition, offset = message.topic(), message.partition(), message.offset()
            if topic is None or partition is None or offset is None:
                continue
            state = self._tracker.get((topic, partition))
            if state is None:
                continue  # revoked while the batch was in flight; its next owner reads it
            if not state.track(offset):
                self.metrics.redelivered += 1
                continue
            self.metrics.consumed += 1
            headers = _headers(message)
            work = _Work(
                state=state,
                topic=topic,
                partition=partition,
                offset=offset,
                key=message.key(),
                headers=headers,
                polled_at=now,
                deadline=now + self._pipeline.deadline_ms / 1000.0,
            )
            value = message.value()
            try:
                event = decode_ticket(value, self._pipeline.max_value_bytes)
            except DecodeError as problem:
                self._dead_letter(work, value, problem)
                continue
            work.event = event
            work.deadline = ticket_deadline(now, wall, self._pipeline.deadline_ms, event.metadata)
            self._queue.append(work)
        self._update_gauge()

    def _consumer_error(self, error: confluent_kafka.KafkaError) -> None:
        if error.code() == confluent_kafka.KafkaError._MAX_POLL_EXCEEDED:
            self.metrics.max_poll_exceeded += 1
            _log.error("max_poll_interval_exceeded", reason=error.str())
        elif error.fatal():
            self.on_client_error(error)
        else:
            _log.warning("consumer_error", code=error.name(), reason=error.str())

    # -- classification -------------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        while self._queue and len(self._at_model) < self._window:
            work = self._queue.popleft()
            event = work.event
            assert event is not None  # only tickets are queued
            if self._clock() >= work.deadline:
                self._produce_fallback(work, event, "overloaded")
                continue
            self.metrics.queue_wait.observe(self._clock() - work.polled_at)
            request_id = next(self._ids)
            self._at_model[request_id] = work
            self._classifier.submit(ClassifyRequest(request_id, ticket_text(event), work.deadline))

    def _expire_queued(self) -> None:
        """Tickets whose deadline passed while they waited for the model get `overloaded`, without it."""
        if not self._queue:
            return
        now = self._clock()
        if all(work.deadline > now for work in self._queue):
            return
        waiting: collections.deque[_Work] = collections.deque()
        for work in self._queue:
            if work.deadline <= now and work.event is not None:
                self._produce_fallback(work, work.event, "overloaded")
            else:
                waiting.append(work)
        self._queue = waiting

    def _collect(self, wait_s: float) -> None:
        if not self._at_model:
            return
        for request_id, answer in self._classifier.poll(wait_s):
            work = self._at_model.pop(request_id, None)
            if work is None:
                continue
            self.metrics.model_latency.observe(answer.latency_ms / 1000.0)
            if not self._tracker.is_current(work.state):
                self._orphans -= 1
                self.metrics.discarded_after_revoke += 1
                continue
            assert work.event is not None
            if answer.fallback:
                self.metrics.fallback[answer.fallback_reason or "unknown"] += 1
            else:
                self.metrics.classified += 1
            self._produce(
                work, self._topics.output, result_key(work.key, work.event), self._encode(work, answer)
            )

    def _encode(self, work: _Work, answer: ClassificationLike) -> bytes:
        assert work.event is not None
        return encode_result(triage_result(work.event, answer, work.source))

    def _produce_fallback(self, work: _Work, event: TicketEvent, reason: FallbackReason) -> None:
        self.metrics.fallback[reason] += 1
        record = fallback_result(
            event,
            reason,
            self._fallback.intent,
            self._fallback.priority,
            self._classifier.model_id,
            (self._clock() - work.polled_at) * 1000.0,
            work.source,
        )
        self._produce(work, self._topics.output, result_key(work.key, event), encode_result(record))

    def _dead_letter(self, work: _Work, value: bytes | None, error: DecodeError) -> None:
        self.metrics.dead_letter(error.error_type)
        headers = dead_letter_headers(
            work.headers, error.error_type, error.message, work.topic, work.partition, work.offset
        )
        _log.debug(
            "dead_lettered",
            topic=work.topic,
            partition=work.partition,
            offset=work.offset,
            error_type=error.error_type,
        )
        self._produce(work, self._topics.dead_letter, work.key, value, headers)

    # -- producing and delivery -----------------------------------------------------------------------------

    def _produce(
        self,
        work: _Work,
        topic: str,
        key: bytes | None,
        value: bytes | None,
        headers: Headers | None = None,
    ) -> None:
        delivery_id = next(self._ids)
        self._unacked[delivery_id] = work
        on_delivery = functools.partial(self._on_delivery, delivery_id)
        # The client takes any str/bytes/None values; our lists only hold bytes/None (list is invariant).
        record_headers = cast("list[tuple[str, str | bytes | None]] | None", headers or work.headers)
        while True:
            try:
                self._producer.produce(
                    topic, value=value, key=key, headers=record_headers, on_delivery=on_delivery
                )
                return
            except BufferError:
                # The client's local queue is full (the broker is slow or away): let it drain, keep serving.
                self._producer.poll(_BUSY_WAIT_S)

    def _on_delivery(self, delivery_id: int, error: confluent_kafka.KafkaError | None, _msg: Any) -> None:
        work = self._unacked.pop(delivery_id, None)
        if work is None:
            return
        current = self._tracker.is_current(work.state)
        if not current:
            self._orphans -= 1
        if error is None:
            self.metrics.produced += 1
            self.metrics.end_to_end.observe(self._clock() - work.polled_at)
            work.state.done(work.offset)
            return
        self.metrics.delivery_failed += 1
        work.state.fail(work.offset)
        _log.error(
            "delivery_failed",
            topic=work.topic,
            partition=work.partition,
            offset=work.offset,
            code=error.name(),
            reason=error.str(),
            effect="partition stopped: never committed past this offset until a restart or rebalance",
        )
        if current:
            key = (work.topic, work.partition)
            self._blocked.add(key)
            self._pause([key])

    # -- commits --------------------------------------------------------------------------------------------

    def _maybe_commit(self) -> None:
        now = self._clock()
        if self._commit_sent_at is not None and now - self._commit_sent_at < _COMMIT_STALE_S:
            return
        due = now - self._last_commit >= self._pipeline.commit_interval_ms / 1000.0
        # Done but uncommitted work holds in-flight slots: commit early when it fills half of them.
        crowded = self._tracker.uncommitted_done() * 2 >= self._pipeline.max_in_flight
        if not (due or crowded):
            return
        positions = self._tracker.commit_positions()
        self._last_commit = now
        if not positions:
            return
        for key, position in positions.items():
            state = self._tracker.get(key)
            if state is not None:
                state.commit_requested(position)
        self._commit_sent_at = now
        self._consumer.commit(offsets=_topic_partitions(positions), asynchronous=True)

    def on_commit(self, error: confluent_kafka.KafkaError | None, partitions: list[Any]) -> None:
        """commit_cb of the consumer: confirmed positions release their offsets (and in-flight slots)."""
        self._commit_sent_at = None
        for tp in partitions:
            state = self._tracker.get((tp.topic, tp.partition))
            if state is None or tp.offset < 0:
                continue
            if error is not None or tp.error is not None:
                state.commit_failed(tp.offset)
            else:
                self.metrics.committed += state.committed(tp.offset)
        if error is not None and error.code() != confluent_kafka.KafkaError._NO_OFFSET:
            self.metrics.commit_failed += 1
            _log.warning("commit_failed", code=error.name(), reason=error.str())
        self._update_gauge()

    def _commit_now(self, states: Sequence[PartitionOffsets]) -> None:
        """Synchronous commit of the done prefix of `states` (on revoke and at shutdown)."""
        positions = {state.key: pos for state in states if (pos := state.position) is not None}
        if not positions:
            return
        try:
            results = self._consumer.commit(offsets=_topic_partitions(positions), asynchronous=False)
        except confluent_kafka.KafkaException as error:
            self.metrics.commit_failed += 1
            _log.warning("commit_failed", reason=str(error), partitions=sorted(positions))
            return
        by_key = {state.key: state for state in states}
        for tp in results or ():
            state = by_key.get((tp.topic, tp.partition))
            if state is not None and tp.error is None and tp.offset >= 0:
                self.metrics.committed += state.committed(tp.offset)
        _log.info("committed", positions={f"{t}[{p}]": pos for (t, p), pos in sorted(positions.items())})

    # -- flow control ---------------------------------------------------------------------------------------

    def _update_gauge(self) -> None:
        flow = self._gate.update(len(self._tracker) + self._orphans)
        self.metrics.in_flight = self._gate.in_flight
        self.metrics.in_flight_max = self._gate.max_seen
        self.metrics.paused = self._gate.paused
        if flow is not Flow.KEEP:
            _log.debug(flow.value, in_flight=self._gate.in_flight)

    def _apply_flow(self) -> None:
        """Make the consumer's paused partitions match the gate (and shutdown, and blocked partitions)."""
        self._update_gauge()
        if self._gate.paused or self._stopping:
            self._pause([state.key for state in self._tracker])
        else:
            self._resume([key for key in self._paused if key not in self._blocked])

    def _pause(self, keys: Sequence[TopicPartitionKey]) -> None:
        fresh = [key for key in keys if key not in self._paused]
        if fresh:
            self._consumer.pause(_topic_partitions(dict.fromkeys(fresh, -1001)))
            self._paused.update(fresh)

    def _resume(self, keys: Sequence[TopicPartitionKey]) -> None:
        if keys:
            self._consumer.resume(_topic_partitions(dict.fromkeys(keys, -1001)))
            self._paused.difference_update(keys)

    # -- rebalance ------------------------------------------------------------------------------------------

    def _on_assign(self, consumer: confluent_kafka.Consumer, partitions: list[Any]) -> None:
        keys = [(tp.topic, tp.partition) for tp in partitions]
        for key in keys:
            self._tracker.assign(key)
            self._blocked.discard(key)
            self._paused.discard(key)
        _log.info("partitions_assigned", partitions=_names(keys))
        if not partitions:
            return
        # Assign here rather than after the callback, so the partitions' pause state is set before the first
        # fetch: librdkafka keeps a partition paused across unassign/assign (seen after a lost assignment),
        # so one that comes back is resumed explicitly unless the gate wants it paused.
        if self._cooperative:
            consumer.incremental_assign(partitions)
        else:
            consumer.assign(partitions)
        if self._gate.paused or self._stopping:
            self._pause(keys)
        else:
            consumer.resume(partitions)

    def _on_revoke(self, consumer: confluent_kafka.Consumer, partitions: list[Any]) -> None:
        keys = {(tp.topic, tp.partition) for tp in partitions}
        if not keys:
            return
        self.metrics.revoked += len(keys)
        started = self._clock()
        # Their queued tickets go to the model first. They must finish, not be dropped: dead letters and
        # answers for later offsets may already be written, and the new owner would write them again.
        leaving = [work for work in self._queue if (work.topic, work.partition) in keys]
        if leaving:
            staying = [work for work in self._queue if (work.topic, work.partition) not in keys]
            self._queue = collections.deque(leaving + staying)
        states = [state for key in keys if (state := self._tracker.get(key)) is not None]
        waiting = {id(state) for state in states}

        def pending() -> int:
            return sum(
                1
                for work in itertools.chain(self._queue, self._at_model.values(), self._unacked.values())
                if id(work.state) in waiting
            )

        limit = started + self._pipeline.revoke_timeout_ms / 1000.0
        if self._stop_by is not None:
            limit = min(limit, self._stop_by)
        while pending() and self._clock() < limit:
            self._producer.poll(_BUSY_WAIT_S if not self._at_model else 0)
            self._collect(_BUSY_WAIT_S)
            self._expire_queued()
            self._dispatch()
        left = pending()
        # Tickets that did not make it are left to the new owner; those at the model or the producer are
        # still counted (orphans) until their answer or report arrives.
        self._queue = collections.deque(
            work for work in self._queue if (work.topic, work.partition) not in keys
        )
        self._orphans += sum(
            1
            for work in itertools.chain(self._at_model.values(), self._unacked.values())
            if id(work.state) in waiting
        )
        self._commit_now(states)
        self._tracker.revoke(keys)
        self._paused.difference_update(keys)
        self._blocked.difference_update(keys)
        self._update_gauge()
        _log.info(
            "partitions_revoked",
            partitions=_names(keys),
            drained_ms=round((self._clock() - started) * 1000.0),
            unfinished=left,
        )

    def _on_lost(self, _consumer: confluent_kafka.Consumer, partitions: list[Any]) -> None:
        keys = {(tp.topic, tp.partition) for tp in partitions}
        self.metrics.lost += len(keys)
        self._queue = collections.deque(
            work for work in self._queue if (work.topic, work.partition) not in keys
        )
        states = {id(state) for key in keys if (state := self._tracker.get(key)) is not None}
        self._orphans += sum(
            1
            for work in itertools.chain(self._at_model.values(), self._unacked.values())
            if id(work.state) in states
        )
        self._tracker.revoke(keys)
        self._paused.difference_update(keys)
        self._blocked.difference_update(keys)
        self._update_gauge()
        _log.warning(
            "partitions_lost", partitions=_names(keys), effect="not committed; the new owner redoes them"
        )

    # -- shutdown -------------------------------------------------------------------------------------------

    def _shutdown(self) -> int:
        started = self._clock()
        limit = started + self._pipeline.shutdown_timeout_ms / 1000.0
        self._stop_by = limit
        _log.info("pipeline_stopping", in_flight=self._gate.in_flight, reason=self._fatal or "signal")
        # Stop fetching, but keep polling: the member must stay in the group while in-flight work finishes.
        self._pause([state.key for state in self._tracker])
        while (
            (self._queue or self._at_model or self._unacked) and self._clock() < limit and self._fatal is None
        ):
            self._service(wait_s=_BUSY_WAIT_S if self._at_model else 0.0)
            self._consumer.consume(num_messages=1, timeout=0.0 if self._at_model else _BUSY_WAIT_S)
        unfinished = len(self._queue) + len(self._at_model)
        remaining = max(0.0, limit - self._clock())
        not_flushed = self._producer.flush(remaining) if self._fatal is None else len(self._producer)
        self._commit_now(list(self._tracker))
        self._consumer.close()
        self._log_metrics("final")
        if self._fatal is not None:
            _log.error("pipeline_failed", reason=self._fatal)
            return 1
        _log.info(
            "pipeline_stopped",
            unfinished=unfinished,
            not_flushed=not_flushed,
            took_ms=round((self._clock() - started) * 1000.0),
        )
        return 0

    # -- metrics --------------------------------------------------------------------------------------------

    def _maybe_log_metrics(self) -> None:
        now = self._clock()
        self.metrics.turned(now, self._consumer, self._tracker, self._paused, self._blocked)
        if now - self._last_metrics >= self._metrics_interval_s:
            self._log_metrics("interval")

    def _log_metrics(self, kind: str) -> None:
        self._last_metrics = self._clock()
        _log.info("metrics", kind=kind, blocked_partitions=_names(self._blocked), **self.metrics.snapshot())


def _topic_partitions(positions: dict[TopicPartitionKey, int]) -> list[confluent_kafka.TopicPartition]:
    return [
        confluent_kafka.TopicPartition(topic, partition, offset)
        for (topic, partition), offset in positions.items()
    ]


def _headers(message: confluent_kafka.Message) -> Headers | None:
    """A consumed record's headers as a list (a consumer gives bytes values; None for a null header)."""
    raw = message.headers()
    if raw is None:
        return None
    pairs = raw.items() if isinstance(raw, dict) else raw
    return [(name, value.encode("utf-8") if isinstance(value, str) else value) for name, value in pairs]


def _names(keys: Sequence[TopicPartitionKey] | set[TopicPartitionKey]) -> list[str]:
    return [f"{topic}[{partition}]" for topic, partition in sorted(keys)]
