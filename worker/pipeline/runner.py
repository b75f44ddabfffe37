"""The consumer loop: consume → decode → dispatch → classify → produce → commit, on one thread.

One thread owns the consumer, the producer and the offset tracker; the model runs in the inference pool
(other processes or threads), so a slow model never stops this loop from polling. Each turn of the loop:

1. serves the producer's delivery reports (a record is *done* only once the broker acknowledged it);
2. takes the pool's answers and produces one TriageResult per ticket (with the cascade, see `cascade.py`,
   sends the tickets the model is unsure of to the escalation stage when the gate lets them, and takes
   that stage's answers);
3. turns tickets whose deadline passed while they waited for the model into `overloaded` fallbacks;
4. hands waiting tickets to the pool earliest deadline first (`pipeline.scheduling`), at most
   `dispatch_window` at a time (the rest wait here, where their deadline is watched); while the pool is busy,
   a ticket that cannot finish before its deadline given the pool's recent latency is answered `overloaded`;
5. commits the highest contiguous done offset + 1 of each partition (see `guarantees.py`);
6. at `max_in_flight` stops polling while a commit frees slots; when the bound holds for longer (a slow
   model) pauses every partition and polls again, so the group never evicts the worker; resumes below the
   low-water mark;
7. polls records up to the free capacity, one per poll (see `_poll_records`), decodes each, dead-letters
   what is not a ticket and queues the rest with its deadline. In a Schema Registry format (`input.format`)
   a record the registry cannot answer for is not taken: its partition waits at it (`registry_wait.py`).

Rebalances (cooperative-sticky by default): nothing new is taken from revoked partitions; the tickets already
taken from them (queued ones go to the model first) get up to `revoke_timeout_ms` to finish, done offsets are
committed synchronously, and only then does the callback return, so the new owner starts where this worker
stopped. Later answers for a revoked partition are *discarded*: its new owner re-reads them from the committed
offset. Lost partitions (the group moved on without us) are forgotten without a commit.

How outputs are written and progress committed is the delivery guarantee's (`guarantees.py`: at-least-once
or exactly-once, behind one seam; the loop has no branch on which). The producer is idempotent with acks=all
and retries by itself until `delivery.timeout.ms`; a delivery that still fails stops that partition (its
commit position never passes the failed offset) while the others continue.

Shutdown (first SIGTERM/SIGINT): stop taking new records, finish the tickets already taken within
`shutdown_timeout_ms`, flush the producer, commit synchronously, close the consumer (leaving the group) and
the pool; exit code 0. A second signal exits at once; anything not committed is re-read by the next owner.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import confluent_kafka
import msgspec
import structlog

from worker.classification import (
    Classification,
    Classifier,
    ClassifyRequest,
    FallbackLabel,
    fallback_answer,
    ticket_text,
)
from worker.config import Settings
from worker.decoding import DecodeError, RegistryUnavailable, decode_ticket
from worker.errors import UserError
from worker.kafka import errors
from worker.kafka.clients import (
    ClientFactory,
    KafkaClients,
    consumer_config,
    incremental_assignment,
    record_headers,
)
from worker.kafka.starts import StartPositions
from worker.messages import FallbackReason, TicketEvent, TriageResult, utc_timestamp
from worker.pipeline.cascade import Cascade
from worker.pipeline.deadlines import ticket_deadline
from worker.pipeline.guarantees import Failure, guarantee_for, names
from worker.pipeline.inflight import Flow, InFlightGate, PausedPartitions
from worker.pipeline.latency import LatencyEstimate
from worker.pipeline.ledger import Output, Work
from worker.pipeline.metrics import PipelineMetrics, RegistryState
from worker.pipeline.offsets import OffsetTracker
from worker.pipeline.records import carried_headers, dead_letter, encode_result, result_key, triage_result
from worker.pipeline.registry_wait import RegistryWait
from worker.pipeline.review import Review
from worker.pipeline.shadow import Shadow

_log = structlog.get_logger("worker.pipeline")

# While work is in flight the loop waits at most this long on any one queue, so that delivery reports,
# commit confirmations and model answers are all picked up promptly.
_BUSY_WAIT_S = 0.01
# How long the bound may hold before the partitions are paused. Shorter pauses cost more than they save:
# librdkafka refetches a resumed partition only about a second later. Longer delays rebalance callbacks.
_FULL_BEFORE_PAUSE_S = 0.5
# Results are keyed by the input key: a bound keeps every result small (see `guarantees.smaller`).
MAX_KEY_BYTES = 4096
# librdkafka's default max.poll.interval.ms.
_LIBRDKAFKA_MAX_POLL_MS = 300000
# The longest background commits hold back polling in a row (see `_may_poll`).
_COMMIT_BEFORE_POLL_S = 1.0


class TicketDecoding(Protocol):
    """What the pipeline needs of `worker.contracts.input.TicketDecoder` (built by the cli room from
    `input.*` and `schema_registry.*`): a TicketEvent, or DecodeError (dead letter), or RegistryUnavailable
    (the record is retried, see registry_wait.py)."""

    def decode(self, value: bytes | None, topic: str) -> TicketEvent: ...


class Pipeline:
    """Runs the loop until `request_stop()`; `run()` returns the process exit code.

    `settings` gives the topics and the pipeline's limits; `classifier` answers the tickets (any object with
    the `Classifier` contract); `fallback` is the label of records the model did not answer; at most
    `dispatch_window` tickets are at the classifier at once. `clients` builds the Kafka consumer and
    producer (default: from `settings`). The side topics, when given, never hold back a result or a commit:
    `shadow` is offered every classified ticket (shadow.py), `review` every result written (review.py).
    `decoder` reads record values that are not plain JSON tickets (`input.format`, `input.fields`); None:
    plain JSON, `decode_ticket`. `result_encoder` writes triage records in another format than JSON
    (`output.format`); the side topics stay JSON.
    """

    def __init__(
        self,
        settings: Settings,
        classifier: Classifier,
        fallback: FallbackLabel,
        dispatch_window: int,
        clients: ClientFactory | None = None,
        metrics_interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        shadow: Shadow | None = None,
        cascade: Cascade | None = None,
        review: Review | None = None,
        decoder: TicketDecoding | None = None,
        result_encoder: Callable[[TriageResult], bytes] | None = None,
    ) -> None:
        self._pipeline = settings.pipeline
        self._decoder = decoder
        self._input_format = settings.input.format
        self._encode_result = result_encoder or encode_result
        self._topics = settings.topics
        clients = clients or KafkaClients(settings)
        self._failure = Failure()
        self._consumer = clients.consumer(self._failure.client_error)
        self._classifier = classifier
        self._fallback = fallback
        self._window = max(1, dispatch_window)
        self._metrics_interval_s = metrics_interval_s
        self._clock = clock
        consumer_options = consumer_config(settings)
        self._cooperative = incremental_assignment(consumer_options)
        # The revoke callback runs inside a poll: draining must end well before the group's poll deadline.
        max_poll_s = int(consumer_options.get("max.poll.interval.ms", _LIBRDKAFKA_MAX_POLL_MS)) / 1000.0
        self._revoke_drain_s = min(self._pipeline.revoke_timeout_ms / 1000.0, max_poll_s / 2)
        self._tracker = OffsetTracker()
        self._gate = InFlightGate(
            self._pipeline.max_in_flight, self._pipeline.resume_threshold, _FULL_BEFORE_PAUSE_S
        )
        self.metrics = PipelineMetrics.for_deadline(settings.pipeline.deadline_ms / 1000.0)
        self._shadow, self._review, self._cascade = shadow, review, cascade
        self._redactor = settings.privacy.redactor()
        self._redact_input = settings.inference.redact_input
        self._redact_dead_letters = settings.dead_letter.redact
        self._side_topics: list[Shadow | Review] = [side for side in (shadow, review) if side is not None]
        self.metrics.shadow = shadow.metrics if shadow is not None else None
        self.metrics.review = review.metrics if review is not None else None
        self.metrics.escalation = cascade.metrics if cascade is not None else None
        self._paused = PausedPartitions(self._consumer)
        # Every assigned partition starts at an offset the worker looked up itself (worker/kafka/starts.py).
        self._starts = StartPositions(self._consumer, consumer_options["auto.offset.reset"], clock)
        # Partitions held at a record the Schema Registry could not answer for (registry_wait.py).
        self.metrics.registry = RegistryState() if decoder is not None else None
        self._registry = RegistryWait(
            self._consumer, self._paused.pause, self.metrics.registry or RegistryState(), clock
        )
        consumer, pause = self._consumer, self._paused.pause
        self._guarantee = guarantee_for(
            settings, clients, consumer, self._tracker, self.metrics, clock, pause, self._failure
        )
        self._ledger = self._guarantee.ledger
        self._latency = LatencyEstimate()
        self._stopping = False
        self._stop_by: float | None = None
        now = clock()
        self._last_poll = now
        self._last_metrics = now

    # -- public ---------------------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Begin a graceful shutdown at the next turn of the loop (safe from a signal handler)."""
        self._stopping = True

    def run(self) -> int:
        try:
            self._guarantee.start()
        except UserError:
            self._consumer.close()
            raise
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
            scheduling=self._pipeline.scheduling,
            dispatch_window=self._window,
            model=self._classifier.model_id,
            guarantee=self._pipeline.guarantee,
            input_format=self._input_format,
            escalation=None if self._cascade is None else self._cascade.model_id,
            escalate_below=None if self._cascade is None else self._cascade.escalate_below,
        )
        while not self._stopping and self._failure.reason is None:
            self._turn()
        return self._shutdown()

    # -- the loop -------------------------------------------------------------------------------------------

    def _turn(self) -> None:
        self._service(wait_s=0.0)
        busy = self._ledger.at_model + self._ledger.at_escalation > 0
        if self._may_poll():
            idle = not busy and len(self._tracker) == 0 and self._ledger.orphans == 0
            wait_s = self._pipeline.poll_timeout_ms / 1000.0 if idle else _BUSY_WAIT_S
            # With partitions paused (no capacity) the poll only serves callbacks and keeps the member alive.
            self._last_poll = self._clock()
            self._poll_records(
                max(1, min(self._pipeline.poll_batch_size, self._gate.capacity())), 0.0 if busy else wait_s
            )
        elif not busy:
            self._guarantee.wait(_BUSY_WAIT_S)
        if busy:
            self._collect(_BUSY_WAIT_S)
        self._maybe_log_metrics()

    def _may_poll(self) -> bool:
        """Poll when the gate allows it (room for records, or partitions paused) and no background commit is
        on its way. Rebalance callbacks run inside a poll, and a commit from another thread waits until they
        return, so it could land after the revoke's own commit and move the position back. Commits never
        hold polls back for longer than `_COMMIT_BEFORE_POLL_S` in a row (slow or failing commits during a
        broker outage), to keep the member alive.
        """
        settled = not self._guarantee.committing or self._clock() - self._last_poll >= _COMMIT_BEFORE_POLL_S
        return settled and self._gate.may_poll()

    def _service(self, wait_s: float) -> None:
        """Everything but polling the consumer: the records' progress, commits, flow control."""
        self._serve_work(wait_s)
        self._guarantee.advance()
        self._starts.resolve()
        self._registry.due()
        self._update_gauge()
        if self._gate.paused or self._stopping:
            self._paused.pause(state.key for state in self._tracker)
        else:
            self._paused.resume_all_but(
                self._tracker.blocked().keys() | self._starts.held | self._registry.held.keys()
            )

    def _serve_work(self, wait_s: float) -> None:
        """Move taken records forward: delivery reports, model answers, expiry, dispatch. Waits up to
        `wait_s` for an answer, or for a report when nothing is at the model."""
        if self._ledger.at_model or self._ledger.at_escalation:
            self._guarantee.serve(0)
            self._collect(wait_s)
        else:
            self._guarantee.serve(wait_s)
        # Tickets whose deadline passed while they waited for the model get `overloaded`, without it.
        for work in self._ledger.expired(self._clock()):
            self._write_result(work, self._fallback_for(work, "overloaded"))
        self._dispatch()
        for side in self._side_topics:
            side.serve()

    def _poll_records(self, limit: int, timeout: float) -> None:
        """Take up to `limit` records, waiting up to `timeout` for the first, each one before the next poll.

        One record per poll, never a `consume()` batch: rebalance callbacks run inside a poll and may seek a
        partition back (an exactly-once redo) or give it a fresh offset state (assign after lost), and
        librdkafka drops the records fetched before that only while they are still queued. A batch can hand
        back records it dequeued before the callback ran; the first of them would start the partition's
        new state at a later offset than the seek, and the records in between, fetched again, would be
        skipped as re-deliveries while the next commit passed them: tickets committed with no output
        (issue #25, reproduced in tests/test_pipeline_memory.py).
        """
        message = self._consumer.poll(timeout)
        now, wall = self._clock(), time.time()  # one clock read per poll round, not per record
        taken = 0
        while message is not None:
            self._take(message, now, wall)
            taken += 1
            message = self._consumer.poll(0.0) if taken < limit else None
        self._update_gauge()

    def _take(self, message: confluent_kafka.Message, now: float, wall: float) -> None:
        error = message.error()
        if error is not None:
            if error.code() == confluent_kafka.KafkaError._MAX_POLL_EXCEEDED:
                self.metrics.max_poll_exceeded += 1
                _log.error("max_poll_interval_exceeded", reason=error.str())
            elif errors.consumer_fatal(error):
                self._failure.client_error(error)
            else:
                _log.warning("consumer_error", code=error.name(), reason=error.str())
            return
        topic, partition, offset = message.topic(), message.partition(), message.offset()
        if topic is None or partition is None or offset is None:
            return
        state = self._tracker.get((topic, partition))
        if state is None:
            return  # not owned (a record fetched for a partition revoked since); its owner reads it
        decoded: TicketEvent | DecodeError | None = None
        if self._decoder is not None:
            # Decoded before it is tracked: a record the registry cannot answer for is not taken at all.
            if (topic, partition) in self._registry.held:
                return  # fetched before its partition was held and sought back: it is read again
            key = message.key()
            # A re-delivery is skipped below; a key over the limit is dead-lettered below, unread.
            if state.is_new(offset) and (key is None or len(key) <= MAX_KEY_BYTES):
                try:
                    decoded = self._decoder.decode(message.value(), topic)
                except DecodeError as problem:
                    decoded = problem  # the registry answered (or was not needed): a dead letter below
                except RegistryUnavailable as unavailable:
                    if not self._registry.hold((topic, partition), offset, str(unavailable)):
                        self._failure.set(f"cannot seek {topic}[{partition}] back to {offset}")
                    return
                self._registry.answered((topic, partition))
        if not state.track(offset):
            # Never expected: the partition's state starts where its fetch does (see `_poll_records`).
            self.metrics.redelivered += 1
            _log.warning("record_skipped", topic=topic, partition=partition, offset=offset)
            return
        self.metrics.consumed += 1
        work = Work(
            state=state,
            topic=topic,
            partition=partition,
            offset=offset,
            key=message.key(),
            headers=record_headers(message),
            polled_at=now,
            deadline=now + self._pipeline.deadline_ms / 1000.0,
            value=message.value(),
        )
        self._ledger.taken(work)
        if work.key is not None and len(work.key) > MAX_KEY_BYTES:
            reason = f"key is {len(work.key)} bytes, over the {MAX_KEY_BYTES}-byte limit"
            self._dead_letter(work, "key_too_large", reason)
            return
        try:
            if decoded is None:
                event = decode_ticket(work.value, self._pipeline.max_value_bytes)
            elif isinstance(decoded, DecodeError):
                raise decoded
            else:
                event = decoded
            deadline = ticket_deadline(now, wall, self._pipeline.deadline_ms, event.metadata)
        except DecodeError as problem:
            self._dead_letter(work, problem.error_type, problem.message)
            return
        except Exception as error:  # no record may stop the worker, whatever a library raises
            # The log's redacting processor masks the ticket's personal data in the traceback's messages.
            _log.exception("record_failed", topic=topic, partition=partition, offset=offset)
            self._dead_letter(work, "internal_error", f"{type(error).__name__}: {error}")
            return
        # Personal data is looked for once per ticket: every copy made of it later takes this scan.
        scan = work.scan = self._redactor.scan(event.subject, event.body)
        if scan.kinds:
            self.metrics.pii_tickets += 1
            self.metrics.pii_found.update(dict(scan.counts))
        if self._redact_input:  # the model, the shadow and the cascade get the redacted ticket
            event = msgspec.structs.replace(event, subject=scan.subject, body=scan.body)
        work.event = event
        work.deadline = deadline
        if deadline <= now:  # the producer's deadline_at passed already: no model time, not `overloaded`
            self._write_result(work, self._fallback_for(work, "expired_on_arrival"))
            return
        self._ledger.wait(work)

    # -- classification -------------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        while self._ledger.at_model < self._window and (work := self._ledger.next_waiting()) is not None:
            event = work.event
            assert event is not None  # only tickets wait for the model
            # A ticket the model would most likely not finish in time is answered now. With nothing at the
            # model it is tried anyway: that costs no other ticket model time and keeps the estimate learning.
            expected_s = self._latency.expected_s if self._ledger.at_model else 0.0
            if self._clock() + expected_s >= work.deadline:
                self._write_result(work, self._fallback_for(work, "overloaded"))
                continue
            self.metrics.queue_wait.observe(self._clock() - work.polled_at)
            request_id = self._ledger.to_model(work)
            self._classifier.submit(
                ClassifyRequest(request_id, ticket_text(event.subject, event.body), work.deadline)
            )

    def _collect(self, wait_s: float) -> None:
        """Take the answers of the model (waiting up to `wait_s` for one) and of the escalation stage."""
        if self._ledger.at_model:
            self._take_answers(self._classifier.poll(wait_s))
            wait_s = 0.0
        if self._cascade is not None and self._ledger.at_escalation:
            self._take_escalations(self._cascade.poll(wait_s, self._clock))

    def _take_answers(self, answers: Sequence[tuple[int, Classification]]) -> None:
        made_at = utc_timestamp() if answers else ""  # one clock read per batch, not per record
        for request_id, answer in answers:
            work = self._ledger.answered(request_id)
            if work is None:
                continue
            self.metrics.model_latency.observe(answer.latency_ms / 1000.0)
            self._latency.observe(answer)
            if work.orphan:
                self.metrics.discarded_after_revoke += 1
                continue
            if answer.fallback:
                self.metrics.fallback[answer.fallback_reason or "unknown"] += 1
            else:
                self.metrics.classified += 1
            written = answer if self._cascade is None else self._escalate_or_stand(work, answer)
            if written is not None:  # None: at the escalation stage, its record waits for that answer
                self._write_result(work, written, made_at)

    def _escalate_or_stand(self, work: Work, first: Classification) -> Classification | None:
        """The cascade's gate for a ticket the first stage answered (see worker/pipeline/cascade.py): the
        answer to write now, or None when the ticket went to the escalation stage (its record waits)."""
        assert self._cascade is not None and work.event is not None
        if not self._cascade.unsure(first):
            return self._cascade.first_stands(first)
        now = self._clock()
        ledger = self._ledger
        pressed = self._cascade.first_stage_pressed(
            now, ledger.waiting, ledger.earliest_waiting_deadline(), self._latency.expected_s
        )
        if (skipped := self._cascade.gate(work.deadline - now, now, pressed)) is not None:
            return self._cascade.first_stands(first, skipped)
        request_id = ledger.to_escalation(work, first)
        self._cascade.submit(
            ClassifyRequest(request_id, ticket_text(work.event.subject, work.event.body), work.deadline), now
        )
        return None

    def _take_escalations(self, answers: Sequence[tuple[int, Classification]]) -> None:
        assert self._cascade is not None
        made_at = utc_timestamp() if answers else ""
        for request_id, answer in answers:
            work = self._ledger.escalation_answered(request_id)
            if work is None:
                continue
            if work.orphan:
                self.metrics.discarded_after_revoke += 1
                continue
            assert work.first is not None
            self._write_result(work, self._cascade.escalated(work.first, answer), made_at)

    def _fallback_for(self, work: Work, reason: FallbackReason) -> Classification:
        self.metrics.fallback[reason] += 1
        if reason == "overloaded" and self._cascade is not None:
            self._cascade.first_stage_shed(self._clock())
        latency_ms = (self._clock() - work.polled_at) * 1000.0
        return fallback_answer(reason, self._fallback, self._classifier.model_id, latency_ms)

    def _write_result(self, work: Work, answer: Classification, made_at: str = "") -> None:
        event = work.event
        assert event is not None
        scan = work.scan
        assert scan is not None  # set with the event
        value = self._encode_result(triage_result(event, answer, work.source, made_at or None, scan.kinds))
        key = result_key(work.key, event)
        headers, left_off = carried_headers(work.headers, self._pipeline.max_header_bytes)
        if left_off:
            self.metrics.headers_left_off += left_off
            _log.debug("headers_left_off", partition=work.partition, offset=work.offset, count=left_off)
        self._guarantee.write(work, Output(self._topics.output, key, value, headers))
        if self._shadow is not None and not answer.fallback:
            self._shadow.offer(event, work.source, key, headers, answer, scan.kinds)
        if self._review is not None:
            self._review.consider(event, scan, answer, work.source, key, headers, made_at or None)

    def _dead_letter(self, work: Work, error_type: str, message: str) -> None:
        self.metrics.dead_letter(error_type)
        _log.debug(
            "dead_lettered",
            topic=work.topic,
            partition=work.partition,
            offset=work.offset,
            error_type=error_type,
        )
        topic = self._topics.dead_letter
        letter = dead_letter(work, topic, error_type, message, self._redactor, self._redact_dead_letters)
        self._guarantee.write(work, letter)

    # -- flow control ---------------------------------------------------------------------------------------

    def _update_gauge(self) -> None:
        flow = self._gate.update(len(self._tracker) + self._ledger.orphans, self._clock())
        self.metrics.in_flight = self._gate.in_flight
        self.metrics.in_flight_max = self._gate.max_seen
        self.metrics.paused = self._gate.paused
        if flow is not Flow.KEEP:
            _log.debug(flow.value, in_flight=self._gate.in_flight)

    # -- rebalance ------------------------------------------------------------------------------------------

    def _on_assign(self, consumer: confluent_kafka.Consumer, partitions: list[Any]) -> None:
        keys = [(tp.topic, tp.partition) for tp in partitions]
        for key in keys:
            self._tracker.assign(key)
        self._paused.forget(keys)
        self._registry.forget(keys)
        self._guarantee.assigned(keys)
        _log.info("partitions_assigned", partitions=names(keys))
        if not partitions:
            return
        # Assign here rather than after the callback, each partition with its start, so that its pause
        # state is set before the first fetch: librdkafka keeps a partition paused across unassign/assign
        # (seen after a lost assignment), so one that comes back is resumed explicitly unless the gate
        # wants it paused or its start is not known yet (held).
        starts = self._starts.assignment(partitions)
        if self._cooperative:
            consumer.incremental_assign(starts)
        else:
            consumer.assign(starts)
        held = [key for key in keys if key in self._starts.held]
        if self._gate.paused or self._stopping:
            self._paused.pause(keys)
        else:
            self._paused.pause(held)
            if resumed := [tp for tp in partitions if (tp.topic, tp.partition) not in self._starts.held]:
                consumer.resume(resumed)

    def _on_revoke(self, consumer: confluent_kafka.Consumer, partitions: list[Any]) -> None:
        keys = {(tp.topic, tp.partition) for tp in partitions}
        if not keys:
            return
        self.metrics.revoked += len(keys)
        started = self._clock()
        limit = started + self._revoke_drain_s
        if self._stop_by is not None:
            limit = min(limit, self._stop_by)
        self._guarantee.settle(limit)
        # Their waiting tickets go to the model first. They must finish, not be dropped: dead letters and
        # answers for later offsets may already be written, and the new owner would write them again.
        self._ledger.first_to_model(keys)
        states = [state for key in keys if (state := self._tracker.get(key)) is not None]
        self._guarantee.give_up_at = limit
        # Not while outputs no longer go out (a doomed exactly-once transaction): waiting is pointless.
        while self._ledger.pending(keys) and self._guarantee.producing and self._clock() < limit:
            self._serve_work(_BUSY_WAIT_S)
        self._guarantee.give_up_at = self._stop_by
        left = self._ledger.pending(keys)
        # Tickets that did not make it are left to the new owner; those at the model or the producer are
        # still counted (orphans) until their answer or report arrives.
        self._ledger.give_up(keys)
        self._guarantee.commit_now(states, limit)
        self._tracker.revoke(keys)
        self._paused.forget(keys)
        self._starts.forget(keys)
        self._registry.forget(keys)
        self._update_gauge()
        _log.info(
            "partitions_revoked",
            partitions=names(keys),
            drained_ms=round((self._clock() - started) * 1000.0),
            unfinished=left,
        )

    def _on_lost(self, _consumer: confluent_kafka.Consumer, partitions: list[Any]) -> None:
        keys = {(tp.topic, tp.partition) for tp in partitions}
        self.metrics.lost += len(keys)
        self._guarantee.lost(keys)
        self._ledger.give_up(keys)
        self._tracker.revoke(keys)
        self._paused.forget(keys)
        self._starts.forget(keys)
        self._registry.forget(keys)
        self._update_gauge()
        _log.warning(
            "partitions_lost", partitions=names(keys), effect="not committed; the new owner redoes them"
        )

    # -- shutdown -------------------------------------------------------------------------------------------

    def _shutdown(self) -> int:
        started = self._clock()
        limit = started + self._pipeline.shutdown_timeout_ms / 1000.0
        self._stop_by = self._guarantee.give_up_at = limit
        reason = self._failure.reason or "signal"
        _log.info("pipeline_stopping", in_flight=self._gate.in_flight, reason=reason)
        # Stop fetching, but keep polling: the member must stay in the group while in-flight work finishes.
        self._paused.pause(state.key for state in self._tracker)
        while not self._ledger.is_empty() and self._clock() < limit and self._failure.reason is None:
            self._service(wait_s=_BUSY_WAIT_S)
            if self._may_poll():
                self._last_poll = self._clock()
                self._consumer.poll(0.0)  # paused: serves callbacks; a record is left to the next owner
        unfinished = self._ledger.waiting + self._ledger.at_model + self._ledger.at_escalation
        not_flushed = self._guarantee.stop(limit)
        self._consumer.close()
        for side in self._side_topics:  # after the last commit: side topics never hold one back
            side.close(max(0.0, limit - self._clock()))
        self._log_metrics("final")
        if self._failure.reason is not None:
            _log.error("pipeline_failed", reason=self._failure.reason)
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
        self.metrics.turned(now, self._consumer, self._tracker, self._paused.keys)
        if now - self._last_metrics >= self._metrics_interval_s:
            self._log_metrics("interval")

    def _log_metrics(self, kind: str) -> None:
        self._last_metrics = self._clock()
        blocked = {f"{t}[{p}]": offset for (t, p), offset in sorted(self._tracker.blocked().items())}
        ledger = self._ledger
        # Where the in-flight records are: waiting, at the model, at the producer, held for order; orphans;
        # escalated (last, so that readers of the first five keep their meaning).
        where = [
            ledger.waiting, ledger.at_model, ledger.at_producer, ledger.held, ledger.orphans,
            ledger.at_escalation,
        ]  # fmt: skip
        _log.info(
            "metrics", kind=kind, blocked_partitions=blocked, in_flight_at=where, **self.metrics.snapshot()
        )
