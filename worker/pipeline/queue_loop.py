"""Queue mode's loop: a share group's batch is taken, classified, written and acknowledged, then the next.

`pipeline.consume = "queue"` reads the input through a share group (Kafka >= 4.2): any number of workers
share one partition, each record is locked to one of them and acknowledged on its own. The loop reuses the
group loop's parts (`intake.py`, `dispatch_queue.py`, `requests.py`, `model_stage.py`, `outputs.py`, the side
topics, `PipelineMetrics`); only reading and acknowledging differ.

It is batch-synchronous because of the share consumer's explicit-acknowledgement rule: every record of a poll
must be acknowledged before the next poll (else it raises), so there is no poll while a ticket is at work.
Each turn:

1. polls a batch (the broker hands out whole producer batches: `max.poll.records` is only a hint);
2. takes records from the batch into the model stage while fewer than `max_in_flight` are at work and the
   record can still finish inside its lock (`lock_budget.py`); each ticket's deadline starts when it is
   taken, as group mode's starts at its poll. A record delivered `delivery_count_limit` times is
   dead-lettered (`delivery_count_exceeded`) instead: a poison ticket that kills the model process would
   otherwise be archived by the broker without a trace;
3. serves model answers and delivery reports until every record of the batch has an outcome, and
   acknowledges each (`acknowledgements.py`): ACCEPT once its triage record is acknowledged by the broker,
   REJECT once its dead letter is, RELEASE when the worker cannot finish it: a producer error, a model
   process that died (`model_error`), a Schema Registry that cannot answer for it, the lock running out
   (records not taken in time, and unfinished ones when the lock is about to end), shutdown;
4. sends the acknowledgements (`commit_async`) and polls again at once: while it holds no records the
   client fetches in the background, and the lock of what it fetches is already running.

Shutdown: stop taking from the batch, finish the taken tickets within `shutdown_timeout_ms`, release the rest,
send the acknowledgements synchronously, close. A crash (kill -9) releases the worker's records at once
(the broker sees the connection close); each of them has been delivered once more.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence

import confluent_kafka
import structlog

from worker.classification import Classification, Classifier, FallbackLabel
from worker.config import Settings
from worker.decoding import DecodeError, RegistryUnavailable
from worker.errors import UserError
from worker.kafka.clients import record_headers
from worker.kafka.commits import TopicPartitionKey
from worker.kafka.dead_letters import DELIVERY_COUNT_EXCEEDED
from worker.kafka.share_groups import (
    NO_SHARE_GROUPS,
    ShareClientFactory,
    ShareClients,
    ShareGroup,
    delivery_timeout_ms,
)
from worker.messages import TicketEvent, TriageResult
from worker.pipeline.acknowledgements import Acknowledgement, Acknowledging
from worker.pipeline.cascade import Cascade
from worker.pipeline.dispatch_queue import DispatchQueue
from worker.pipeline.guarantees import Failure
from worker.pipeline.intake import MAX_KEY_BYTES, Intake, TicketDecoding
from worker.pipeline.lock_budget import LockBudget
from worker.pipeline.metrics import PartitionGauges, PipelineMetrics, QueueMetrics, RegistryState
from worker.pipeline.model_stage import ModelStage
from worker.pipeline.offsets import PartitionOffsets
from worker.pipeline.outputs import Outputs
from worker.pipeline.records import encode_result
from worker.pipeline.requests import ModelRequests
from worker.pipeline.review import Review
from worker.pipeline.shadow import Shadow
from worker.pipeline.side_topic import ResultWatcher
from worker.pipeline.work import Work

_log = structlog.get_logger("worker.pipeline")

# While tickets are at work the loop waits at most this long on any one queue.
_BUSY_WAIT_S = 0.01
# How long the acknowledgements of the last batch may take at shutdown.
_LAST_COMMIT_S = 10.0
_UNSUPPORTED_VERSION = confluent_kafka.KafkaError.UNSUPPORTED_VERSION


def refuse_exactly_once(settings: Settings) -> None:
    """Queue mode has no transactions to put the acknowledgements in: exactly-once is refused."""
    if settings.pipeline.guarantee == "exactly_once":
        raise UserError(
            'config error: pipeline.guarantee = "exactly_once" cannot be used with pipeline.consume = '
            '"queue": share groups have no transactional acknowledgements'
        )


def lock_budget(settings: Settings, group: ShareGroup) -> LockBudget:
    """The lock arithmetic for `settings` (the producer's delivery timeout as the clients will have it)."""
    return LockBudget(
        lock_s=group.lock_ms / 1000.0,
        deadline_s=settings.pipeline.deadline_ms / 1000.0,
        delivery_s=delivery_timeout_ms(settings) / 1000.0,
    )


class QueuePipeline:
    """Runs queue mode's loop until `request_stop()`; `run()` returns the process exit code. The same
    parameters as `runner.Pipeline`, plus `group` (the share group's lock and delivery limit, read at start:
    `share_groups.prepare_share_group`); `settings` as `share_groups.queue_settings` made them."""

    def __init__(
        self,
        settings: Settings,
        classifier: Classifier,
        fallback: FallbackLabel,
        dispatch_window: int,
        group: ShareGroup,
        clients: ShareClientFactory | None = None,
        metrics_interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        shadow: Shadow | None = None,
        cascade: Cascade | None = None,
        review: Review | None = None,
        decoder: TicketDecoding | None = None,
        result_encoder: Callable[[TriageResult], bytes] | None = None,
    ) -> None:
        refuse_exactly_once(settings)
        self._budget = lock_budget(settings, group)
        self._budget.check()
        self._pipeline = settings.pipeline
        self._topic = settings.topics.input
        self._settings = settings
        self._group = group
        self._decoder = decoder
        self._clock = clock
        self._metrics_interval_s = metrics_interval_s
        clients = clients or ShareClients(settings)
        self._failure = Failure()
        self._consumer = clients.share_consumer(self._on_consumer_error)
        self._no_share_groups = False
        self.metrics = PipelineMetrics.for_deadline(settings.pipeline.deadline_ms / 1000.0)
        self.metrics.queue = self._counts = QueueMetrics()
        self.metrics.registry = RegistryState() if decoder is not None else None
        self.metrics.shadow = shadow.metrics if shadow is not None else None
        self.metrics.review = review.metrics if review is not None else None
        self.metrics.escalation = cascade.metrics if cascade is not None else None
        self._intake = Intake(settings, self.metrics)
        self._side_topics: list[ResultWatcher] = [side for side in (shadow, review) if side is not None]
        self._queue = DispatchQueue(self._pipeline.scheduling)
        self._requests = ModelRequests()
        # While stopping: the instant a produce stops waiting for room in the client's queue.
        self._give_up_at: float | None = None
        self._acks = Acknowledging(
            settings, clients, self.metrics, clock, self._failure, self._settle, lambda: self._give_up_at
        )
        self._outputs = Outputs(
            settings, result_encoder or encode_result, self._acks.write, self._side_topics, self.metrics
        )
        self._model = ModelStage(
            classifier, cascade, dispatch_window, fallback, self._queue, self._requests, self.metrics, clock,
            self._answered,
        )  # fmt: skip
        # The batch at hand: records not taken yet, and taken ones without an outcome (with their message).
        self._backlog: collections.deque[confluent_kafka.Message] = collections.deque()
        self._unsettled: dict[Work, confluent_kafka.Message] = {}
        # A Work needs a partition's offset state; queue mode commits no offsets, so these only name it.
        self._partitions: dict[TopicPartitionKey, PartitionOffsets] = {}
        self._stopping = False
        self._stop_by: float | None = None
        self._last_metrics = clock()

    # -- public ---------------------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """Begin a graceful shutdown at the next turn of the loop (safe from a signal handler)."""
        self._stopping = True

    def run(self) -> int:
        self._consumer.subscribe([self._topic])
        _log.info(
            "pipeline_started",
            consume="queue",
            input=self._topic,
            output=self._settings.topics.output,
            dead_letter=self._settings.topics.dead_letter,
            group=self._pipeline.group_id,
            max_in_flight=self._pipeline.max_in_flight,
            deadline_ms=self._pipeline.deadline_ms,
            scheduling=self._pipeline.scheduling,
            record_lock_ms=self._group.lock_ms,
            delivery_count_limit=self._group.delivery_count_limit,
            delivery_timeout_ms=round(self._budget.delivery_s * 1000),
            **self._model.described(),
        )
        try:
            while not self._stopping and self._failure.reason is None:
                self._turn()
        except UserError:
            self._consumer.close()
            raise
        return self._shutdown()

    # -- the loop -------------------------------------------------------------------------------------------

    def _turn(self) -> None:
        lock_from = self._clock()
        batch = self._poll()
        if batch:
            self._counts.batches += 1
            self._backlog.extend(batch)
            self._finish_batch(lock_from)
            self._consumer.commit_async()
        self._tick()

    def _tick(self) -> None:
        """The loop is alive (what /healthz watches); the metrics line when it is due."""
        now = self.metrics.loop_turned_at = self._clock()
        if now - self._last_metrics >= self._metrics_interval_s:
            self._log_metrics("interval")

    def _on_consumer_error(self, error: confluent_kafka.KafkaError) -> None:
        if error.code() == _UNSUPPORTED_VERSION:
            self._no_share_groups = True
        else:
            self._failure.client_error(error)

    def _poll(self) -> list[confluent_kafka.Message]:
        """A batch of records (errors in it logged and left out). A broker without share groups is refused
        in one line: the share consumer's first poll raises a fatal UNSUPPORTED_VERSION there (measured; its
        error callback may say so first)."""
        try:
            messages = self._consumer.poll(self._pipeline.poll_timeout_ms / 1000.0)
        except confluent_kafka.KafkaException as problem:
            error = problem.args[0] if problem.args else None
            if self._no_share_groups or (
                isinstance(error, confluent_kafka.KafkaError) and error.code() == _UNSUPPORTED_VERSION
            ):
                raise UserError(f"queue mode: {NO_SHARE_GROUPS}") from None
            if isinstance(error, confluent_kafka.KafkaError):
                if error.code() == confluent_kafka.KafkaError._MAX_POLL_EXCEEDED:
                    self.metrics.max_poll_exceeded += 1
                    _log.error("max_poll_interval_exceeded", reason=error.str())
                    return []
                if error.fatal():
                    self._failure.client_error(error)
                    return []
            _log.warning("consumer_error", reason=str(problem))
            time.sleep(self._pipeline.poll_timeout_ms / 1000.0)  # the client retries; no busy loop meanwhile
            return []
        if self._no_share_groups:
            raise UserError(f"queue mode: {NO_SHARE_GROUPS}")
        if not self.metrics.partitions.member:
            # A share consumer names no member id or partitions: a poll that raised nothing (the first one
            # raises where the broker has no share groups) is what /readyz takes for "joined".
            self.metrics.partitions = PartitionGauges(member=True)
        batch = []
        for message in messages or ():
            error = message.error()
            if error is None:
                batch.append(message)
            elif error.code() == _UNSUPPORTED_VERSION:
                raise UserError(f"queue mode: {NO_SHARE_GROUPS}")
            elif error.fatal():
                self._failure.client_error(error)
            else:
                _log.warning("consumer_error", code=error.name(), reason=error.str())
        return batch

    def _finish_batch(self, lock_from: float) -> None:
        """Take, classify, write and settle every record of the batch (see the module docstring)."""
        expires_at = self._budget.expires_at(lock_from)
        while self._backlog or self._unsettled:
            now = self._clock()
            if self._stopping and self._stop_by is None:
                self._stop_by = self._give_up_at = now + self._pipeline.shutdown_timeout_ms / 1000.0
            if self._failure.reason is not None or now >= min(expires_at, self._stop_by or expires_at):
                why = "stopping" if self._failure.reason or self._stopping else "record lock ending"
                self._release_all(why)
                return
            if not self._stopping and self._budget.may_take(lock_from, now):
                self._take_from_backlog(now)
            elif self._backlog:
                self._release(list(self._backlog), "stopping" if self._stopping else "record lock ending")
                self._backlog.clear()
            self._serve(_BUSY_WAIT_S)
            self._update_gauge()
            self._tick()

    def _take_from_backlog(self, now: float) -> None:
        wall = time.time()
        while self._backlog and len(self._unsettled) < self._pipeline.max_in_flight:
            self._take(self._backlog.popleft(), now, wall)

    def _serve(self, wait_s: float) -> None:
        """Delivery reports, model answers, expiry and dispatch, as group mode's `_serve_work`."""
        if self._requests:
            self._acks.serve(0)
            self._model.collect(wait_s)
        else:
            self._acks.serve(wait_s)
        for work in self._queue.expired(self._clock()):
            self._outputs.result(work, self._model.fallback_for(work, "overloaded"))
        self._model.dispatch()
        for side in self._side_topics:
            side.serve()

    def _take(self, message: confluent_kafka.Message, now: float, wall: float) -> None:
        topic, partition, offset = message.topic(), message.partition(), message.offset()
        if topic is None or partition is None or offset is None:
            self._acknowledge(message, Acknowledgement.RELEASE)
            return
        key = (topic, partition)
        state = self._partitions.get(key) or self._partitions.setdefault(key, PartitionOffsets(key))
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
        self.metrics.consumed += 1
        self._unsettled[work] = message
        deliveries = message.delivery_count() or 1
        if deliveries >= self._group.delivery_count_limit:
            self._counts.delivery_count_exceeded += 1
            reason = (
                f"delivered {deliveries} times (the limit is {self._group.delivery_count_limit}); "
                "no try ended with a triage record"
            )
            self._outputs.dead_letter(work, DELIVERY_COUNT_EXCEEDED, reason)
            return
        decoded: TicketEvent | DecodeError | None = None
        if self._decoder is not None and (work.key is None or len(work.key) <= MAX_KEY_BYTES):
            try:
                decoded = self._decoder.decode(work.value, topic)
            except DecodeError as problem:
                decoded = problem
            except RegistryUnavailable as unavailable:
                _log.warning("registry_unavailable", offset=offset, reason=str(unavailable), effect="release")
                self._settle(work, Acknowledgement.RELEASE)
                return
        if (rejected := self._intake.ticket(work, decoded, now, wall)) is not None:
            self._outputs.dead_letter(work, *rejected)
            return
        if work.deadline <= now:
            self._outputs.result(work, self._model.fallback_for(work, "expired_on_arrival"))
            return
        self._queue.wait(work)

    def _answered(self, work: Work, answer: Classification, made_at: str) -> None:
        """The model stage's answer: written, unless the model process died under it (`model_error`): then
        the record is released for another try, and a poison ticket that kills every process it meets
        reaches the delivery limit and the dead-letter topic."""
        if answer.fallback and answer.fallback_reason == "model_error":
            self._settle(work, Acknowledgement.RELEASE)
            return
        self._outputs.result(work, answer, made_at)

    # -- acknowledging --------------------------------------------------------------------------------------

    def _settle(self, work: Work, outcome: Acknowledgement) -> None:
        message = self._unsettled.pop(work, None)
        if message is not None:
            self._acknowledge(message, outcome)

    def _acknowledge(self, message: confluent_kafka.Message, outcome: Acknowledgement) -> None:
        self._consumer.acknowledge(message, outcome.value)
        if outcome is Acknowledgement.ACCEPT:
            self._counts.accepted += 1
        elif outcome is Acknowledgement.REJECT:
            self._counts.rejected += 1
        else:
            self._counts.released += 1

    def _release(self, messages: Sequence[confluent_kafka.Message], why: str) -> None:
        for message in messages:
            self._acknowledge(message, Acknowledgement.RELEASE)
        if messages:
            _log.info("records_released", count=len(messages), reason=why)

    def _release_all(self, why: str) -> None:
        """Release the batch's records without an outcome; their later answers and reports are ignored."""
        unfinished = list(self._unsettled)
        keys = {work.partition_key for work in unfinished}
        self._model.give_up(keys)
        self._acks.abandon(unfinished)
        self._release([*self._unsettled.values(), *self._backlog], why)
        self._unsettled.clear()
        self._backlog.clear()

    # -- shutdown and metrics -------------------------------------------------------------------------------

    def _update_gauge(self) -> None:
        self.metrics.in_flight = len(self._unsettled)
        self.metrics.in_flight_max = max(self.metrics.in_flight_max, self.metrics.in_flight)

    def _shutdown(self) -> int:
        started = self._clock()
        # A stop inside a batch began counting there (`_finish_batch`).
        limit = self._stop_by or started + self._pipeline.shutdown_timeout_ms / 1000.0
        reason = self._failure.reason or "signal"
        _log.info("pipeline_stopping", in_flight=len(self._unsettled), reason=reason)
        if self._unsettled or self._backlog:  # a stop between polls leaves nothing; inside a batch, see there
            self._release_all("stopping")
        not_flushed = self._acks.stop(limit)
        try:
            self._consumer.commit_sync(_LAST_COMMIT_S)
        except confluent_kafka.KafkaException as problem:
            _log.warning("acknowledgements_not_sent", reason=str(problem), effect="records redelivered")
        self._consumer.close()
        for side in self._side_topics:
            side.close(max(0.0, limit - self._clock()))
        self._log_metrics("final")
        if self._failure.reason is not None:
            _log.error("pipeline_failed", reason=self._failure.reason)
            return 1
        _log.info(
            "pipeline_stopped", not_flushed=not_flushed, took_ms=round((self._clock() - started) * 1000.0)
        )
        return 0

    def _log_metrics(self, kind: str) -> None:
        self._last_metrics = self._clock()
        requests = self._requests
        where = [
            len(self._queue), requests.at_model, self._acks.deliveries.at_producer, 0, requests.orphans,
            requests.at_escalation,
        ]  # fmt: skip
        _log.info("metrics", kind=kind, in_flight_at=where, **self.metrics.snapshot())
