"""The consumer loop: consume → decode → dispatch → classify → produce → commit, on one thread.

One thread owns the consumer, the producer and the offset tracker; the model runs in the inference pool
(other processes or threads), so a slow model never stops this loop from polling. Each turn of the loop:

1. serves the producer's delivery reports (a record is *done* only once the broker acknowledged it);
2. takes the model's answers and writes one TriageResult per ticket (`model_stage.py`, `outputs.py`; with
   a cascade, unsure answers go on to the escalation stage first);
3. answers `overloaded` the tickets whose deadline passed while they waited, without the model;
4. hands waiting tickets to the model earliest deadline first, at most `dispatch_window` at a time
   (`dispatch_queue.py`, `model_stage.py`);
5. commits the highest contiguous done offset + 1 of each partition (see `guarantees.py`);
6. at `max_in_flight` stops polling while a commit frees slots; when the bound holds for longer (a slow
   model) pauses every partition and polls again, so the group never evicts the worker; resumes below the
   low-water mark;
7. polls records up to the free capacity, one per poll (see `_poll_records`), reads each (`intake.py`),
   dead-letters what is not a ticket and queues the rest with its deadline. In a Schema Registry format
   (`input.format`) a record the registry cannot answer for is not taken: its partition waits at it
   (`registry_wait.py`).

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
from collections.abc import Callable
from typing import Any

import confluent_kafka
import structlog

from worker.classification import Classifier, FallbackLabel
from worker.config import Settings
from worker.decoding import DecodeError, RegistryUnavailable
from worker.errors import UserError
from worker.kafka import errors
from worker.kafka.clients import (
    ClientFactory,
    KafkaClients,
    consumer_config,
    incremental_assignment,
    record_headers,
)
from worker.kafka.commits import TopicPartitionKey
from worker.kafka.starts import StartPositions
from worker.messages import TicketEvent, TriageResult
from worker.pipeline.cascade import Cascade
from worker.pipeline.dispatch_queue import DispatchQueue
from worker.pipeline.guarantees import Failure, GuaranteeWiring, guarantee_for, names
from worker.pipeline.inflight import Flow, InFlightGate, PausedPartitions
from worker.pipeline.intake import MAX_KEY_BYTES, Intake, TicketDecoding
from worker.pipeline.metrics import PipelineMetrics, RegistryState
from worker.pipeline.model_stage import ModelStage, Redone
from worker.pipeline.offsets import OffsetTracker
from worker.pipeline.outputs import Outputs
from worker.pipeline.records import encode_result
from worker.pipeline.registry_wait import RegistryWait
from worker.pipeline.requests import ModelRequests
from worker.pipeline.review import Review
from worker.pipeline.shadow import Shadow
from worker.pipeline.side_topic import ResultWatcher
from worker.pipeline.work import Work

_log = structlog.get_logger("worker.pipeline")

# While work is in flight the loop waits at most this long on any one queue, so that delivery reports,
# commit confirmations and model answers are all picked up promptly.
_BUSY_WAIT_S = 0.01
# How long the bound may hold before the partitions are paused. Shorter pauses cost more than they save:
# librdkafka refetches a resumed partition only about a second later. Longer delays rebalance callbacks.
_FULL_BEFORE_PAUSE_S = 0.5
# librdkafka's default max.poll.interval.ms.
_LIBRDKAFKA_MAX_POLL_MS = 300000
# The longest background commits hold back polling in a row (see `_may_poll`).
_COMMIT_BEFORE_POLL_S = 1.0


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
        self._topics = settings.topics
        clients = clients or KafkaClients(settings)
        self._failure = Failure()
        self._consumer = clients.consumer(self._failure.client_error)
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
        self._intake = Intake(settings, self.metrics)
        self._side_topics: list[ResultWatcher] = [side for side in (shadow, review) if side is not None]
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
        # The tickets waiting for the model, and those at it: the guarantee only sees their outputs.
        self._queue = DispatchQueue(self._pipeline.scheduling)
        self._requests = ModelRequests()
        # While revoking or stopping: the instant a produce stops waiting for room in the client's queue.
        self._give_up_at: float | None = None
        self._guarantee = guarantee_for(
            GuaranteeWiring(
                settings, clients, self._consumer, self._tracker, self.metrics, clock, self._paused.pause,
                self._failure, Redone(self._queue, self._requests), lambda: self._give_up_at,
            )
        )  # fmt: skip
        self._outputs = Outputs(
            settings, result_encoder or encode_result, self._guarantee.write, self._side_topics, self.metrics
        )
        self._model = ModelStage(
            classifier, cascade, dispatch_window, fallback, self._queue, self._requests, self.metrics, clock,
            self._outputs.result,
        )  # fmt: skip
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
            guarantee=self._pipeline.guarantee,
            input_format=self._input_format,
            **self._model.described(),
        )
        while not self._stopping and self._failure.reason is None:
            self._turn()
        return self._shutdown()

    # -- the loop -------------------------------------------------------------------------------------------

    def _turn(self) -> None:
        self._service(wait_s=0.0)
        busy = len(self._requests) > 0
        if self._may_poll():
            idle = not busy and len(self._tracker) == 0 and self._orphans() == 0
            wait_s = self._pipeline.poll_timeout_ms / 1000.0 if idle else _BUSY_WAIT_S
            # With partitions paused (no capacity) the poll only serves callbacks and keeps the member alive.
            self._last_poll = self._clock()
            self._poll_records(
                max(1, min(self._pipeline.poll_batch_size, self._gate.capacity())), 0.0 if busy else wait_s
            )
        elif not busy:
            self._guarantee.wait(_BUSY_WAIT_S)
        if busy:
            self._model.collect(_BUSY_WAIT_S)
        now = self._clock()
        self.metrics.turned(now, self._consumer, self._tracker, self._paused.keys)
        if now - self._last_metrics >= self._metrics_interval_s:
            self._log_metrics("interval")

    def _may_poll(self) -> bool:
        """Poll when the gate allows it and no background commit is on its way: rebalance callbacks run in a
        poll, and a commit from another thread waiting for them could land after the revoke's own and move the
        position back. Never held back longer than `_COMMIT_BEFORE_POLL_S` (keeps the member alive)."""
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
        if self._requests:
            self._guarantee.serve(0)
            self._model.collect(wait_s)
        else:
            self._guarantee.serve(wait_s)
        # Tickets whose deadline passed while they waited for the model get `overloaded`, without it.
        for work in self._queue.expired(self._clock()):
            self._outputs.result(work, self._model.fallback_for(work, "overloaded"))
        self._model.dispatch()
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
        (issue #25, reproduced in tests/pipeline/test_pipeline_memory.py).
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
        self._guarantee.taken(work)
        if (rejected := self._intake.ticket(work, decoded, now, wall)) is not None:
            self._outputs.dead_letter(work, *rejected)
            return
        if work.deadline <= now:  # the producer's deadline_at passed already: no model time, not `overloaded`
            self._outputs.result(work, self._model.fallback_for(work, "expired_on_arrival"))
            return
        self._queue.wait(work)

    # -- flow control ---------------------------------------------------------------------------------------

    def _update_gauge(self) -> None:
        flow = self._gate.update(len(self._tracker) + self._orphans(), self._clock())
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
        self._queue.first_to_model(keys)
        states = [state for key in keys if (state := self._tracker.get(key)) is not None]
        self._give_up_at = limit
        # Not while outputs no longer go out (a doomed exactly-once transaction): waiting is pointless.

        def pending() -> int:
            return self._model.pending(keys) + self._guarantee.deliveries.pending(keys)

        while pending() and self._guarantee.producing and self._clock() < limit:
            self._serve_work(_BUSY_WAIT_S)
        self._give_up_at = self._stop_by
        left = pending()
        # Tickets that did not make it are left to the new owner; those at the model or the producer are
        # still counted (orphans) until their answer or report arrives.
        self._model.give_up(keys)
        self._guarantee.give_up(keys)
        self._guarantee.commit_now(states, limit)
        self._forget(keys)
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
        self._model.give_up(keys)
        self._guarantee.give_up(keys)
        self._forget(keys)
        _log.warning(
            "partitions_lost", partitions=names(keys), effect="not committed; the new owner redoes them"
        )

    def _forget(self, keys: set[TopicPartitionKey]) -> None:
        """After a revoke or a loss: nothing of `keys` is tracked, paused or held any more."""
        self._tracker.revoke(keys)
        self._paused.forget(keys)
        self._starts.forget(keys)
        self._registry.forget(keys)
        self._update_gauge()

    def _orphans(self) -> int:
        """Records of partitions given up, still at a model or the producer (counted as in flight)."""
        return self._model.orphans + self._guarantee.deliveries.orphans

    # -- shutdown -------------------------------------------------------------------------------------------

    def _shutdown(self) -> int:
        started = self._clock()
        limit = started + self._pipeline.shutdown_timeout_ms / 1000.0
        self._stop_by = self._give_up_at = limit
        reason = self._failure.reason or "signal"
        _log.info("pipeline_stopping", in_flight=self._gate.in_flight, reason=reason)
        # Stop fetching, but keep polling: the member must stay in the group while in-flight work finishes.
        self._paused.pause(state.key for state in self._tracker)
        while (
            (self._model or self._guarantee.outstanding)
            and self._clock() < limit
            and self._failure.reason is None
        ):
            self._service(wait_s=_BUSY_WAIT_S)
            if self._may_poll():
                self._last_poll = self._clock()
                self._consumer.poll(0.0)  # paused: serves callbacks; a record is left to the next owner
        unfinished = len(self._model)
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

    def _log_metrics(self, kind: str) -> None:
        self._last_metrics = self._clock()
        blocked = {f"{t}[{p}]": offset for (t, p), offset in sorted(self._tracker.blocked().items())}
        requests, deliveries = self._requests, self._guarantee.deliveries
        # Where the in-flight records are: waiting, at the model, at the producer, held for order; orphans;
        # escalated (last, so that readers of the first five keep their meaning).
        where = [
            len(self._queue), requests.at_model, deliveries.at_producer, deliveries.held, self._orphans(),
            requests.at_escalation,
        ]  # fmt: skip
        _log.info(
            "metrics", kind=kind, blocked_partitions=blocked, in_flight_at=where, **self.metrics.snapshot()
        )
