"""The consumer loop: consume → decode → dispatch → classify → produce → commit, on one thread.

One thread owns the consumer, the producer and the offset tracker; the model runs in the inference pool
(other processes or threads), so a slow model never stops this loop from polling. Each turn of the loop:

1. serves the producer's delivery reports (a record is *done* only once the broker acknowledged it);
2. takes the pool's answers and produces one TriageResult per ticket;
3. turns tickets whose deadline passed while they waited for the model into `overloaded` fallbacks;
4. hands waiting tickets to the pool earliest deadline first (`pipeline.scheduling`), at most
   `dispatch_window` at a time (the rest wait here, where their deadline is watched); while the pool is busy,
   a ticket that cannot finish before its deadline given the pool's recent latency is answered `overloaded`;
5. commits the highest contiguous done offset + 1 of each partition (periodically, or early when done work
   fills half of the bound) on the committer's thread, and applies the outcomes of earlier commits;
6. at `max_in_flight` stops polling while a commit frees slots; when the bound holds for longer (a slow
   model) pauses every assigned partition and polls again, so the group never evicts the worker however
   slow the model is; resumes below the low-water mark;
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

Exactly-once (`pipeline.guarantee = "exactly_once"`): a "commit" is a transaction holding the outputs of
every offset it commits, and nothing else (`transactions.py`). So each partition's outputs are produced in
input order (held in the ledger until the records before them are produced), nothing is produced while a
commit is on its way, and a commit is sent only once every record of the transaction has been
acknowledged. A transaction that cannot commit is aborted and its work *redone*: every owned partition is
sought back to its first uncommitted offset. A lost partition aborts the open transaction (its outputs
would duplicate the new owner's). A record the broker refuses every time cannot be redone forever: a dead
letter is redone smaller, anything else stops its partition at its last commit (as a failed delivery does
in at-least-once mode). A fenced producer (another worker with the same transactional id) ends the run.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import confluent_kafka
import structlog

from worker.classification import (
    Classifier,
    ClassifyRequest,
    FallbackLabel,
    fallback_answer,
    ticket_text,
)
from worker.config import Settings
from worker.decoding import DecodeError, decode_ticket
from worker.errors import UserError
from worker.kafka.clients import (
    ClientErrorLog,
    ClientFactory,
    KafkaClients,
    consumer_config,
    exactly_once,
    produce,
)
from worker.kafka.dead_letters import OMITTED_BYTES, dead_letter_headers
from worker.messages import FallbackReason, TicketEvent, utc_timestamp
from worker.pipeline.committer import (
    CommitOutcome,
    Committer,
    consumer_commit,
    describe,
    topic_partitions,
)
from worker.pipeline.deadlines import ticket_deadline
from worker.pipeline.inflight import Flow, InFlightGate
from worker.pipeline.latency import LatencyEstimate
from worker.pipeline.ledger import Headers, Ledger, Output, Work
from worker.pipeline.metrics import PipelineMetrics
from worker.pipeline.offsets import OffsetTracker, PartitionOffsets, TopicPartitionKey
from worker.pipeline.records import encode_result, result_key, triage_result
from worker.pipeline.shadow import Shadow
from worker.pipeline.transactions import TransactionFailed, Transactions, stops_worker

_log = structlog.get_logger("worker.pipeline")

# While work is in flight the loop waits at most this long on any one queue, so that delivery reports,
# commit confirmations and model answers are all picked up promptly.
_BUSY_WAIT_S = 0.01
_QUEUE_FULL = confluent_kafka.KafkaError._QUEUE_FULL
# How long the bound may hold before the partitions are paused. Shorter pauses cost more than they save:
# librdkafka refetches a resumed partition only about a second later. Longer delays rebalance callbacks.
_FULL_BEFORE_PAUSE_S = 0.5
# Results are keyed by the input key: a bound keeps every result small (see `_write_smaller`).
MAX_KEY_BYTES = 4096
# How often a dead letter written smaller is sent before its partition stops (see `_write_smaller`).
_SHRUNK_DEAD_LETTER_TRIES = 3
# librdkafka's default max.poll.interval.ms.
_LIBRDKAFKA_MAX_POLL_MS = 300000
# The longest background commits hold back polling in a row (see `_may_poll`).
_COMMIT_BEFORE_POLL_S = 1.0
# Exactly-once: a commit still on its way after this long is stuck in librdkafka (every call in it has a 10 s
# timeout and retries stop after 20 s; see `_replace_stuck_producer`).
_STUCK_COMMIT_S = 30.0
# Exactly-once: how long a failed transaction waits for its other records' reports before it is aborted.
_REPORTS_BEFORE_ABORT_S = 1.0
# Exactly-once: delivery errors that a redo would meet again (the record itself is refused).
_REFUSED_RECORD = frozenset(
    {
        confluent_kafka.KafkaError.MSG_SIZE_TOO_LARGE,
        confluent_kafka.KafkaError.INVALID_MSG,
        confluent_kafka.KafkaError.INVALID_RECORD,
        confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED,
    }
)


class Pipeline:
    """Runs the loop until `request_stop()`; `run()` returns the process exit code.

    `settings` gives the topics and the pipeline's limits; `classifier` answers the tickets (any object with
    the `Classifier` contract); `fallback` is the label of records the model did not answer; at most
    `dispatch_window` tickets are at the classifier at once. `clients` builds the Kafka consumer and
    producer (default: from `settings`). `shadow`, when given, is offered every classified ticket (see
    worker/pipeline/shadow.py: it never holds back a result or a commit).
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
    ) -> None:
        self._settings = settings
        self._pipeline = settings.pipeline
        self._topics = settings.topics
        self._error_log = ClientErrorLog("worker")
        clients = clients or KafkaClients(settings)
        self._clients = clients
        self._consumer = clients.consumer(self.on_client_error)
        self._producer = clients.producer(self._on_producer_error)
        self._transactions: Transactions | None = None
        if exactly_once(settings):
            self._transactions = Transactions(self._producer, self._consumer)
            self._committer = Committer(self._transactions.commit)
        else:
            self._committer = Committer(consumer_commit(self._consumer))
        self._classifier = classifier
        self._fallback = fallback
        self._window = max(1, dispatch_window)
        self._metrics_interval_s = metrics_interval_s
        self._clock = clock
        consumer_options = consumer_config(settings)
        self._cooperative = "cooperative" in consumer_options["partition.assignment.strategy"]
        # The revoke callback runs inside a poll: draining must end well before the group's poll deadline.
        max_poll_s = int(consumer_options.get("max.poll.interval.ms", _LIBRDKAFKA_MAX_POLL_MS)) / 1000.0
        self._revoke_drain_s = min(self._pipeline.revoke_timeout_ms / 1000.0, max_poll_s / 2)
        self._tracker = OffsetTracker()
        self._gate = InFlightGate(
            self._pipeline.max_in_flight, self._pipeline.resume_threshold, _FULL_BEFORE_PAUSE_S
        )
        self.metrics = PipelineMetrics.for_deadline(settings.pipeline.deadline_ms / 1000.0)
        self._shadow = shadow
        if shadow is not None:
            self.metrics.shadow = shadow.metrics
        self._ledger = Ledger(self._pipeline.scheduling, in_order=self._transactions is not None)
        self._latency = LatencyEstimate()
        # Exactly-once: no records go into the transaction (a commit is due or on its way); why it must be
        # aborted; dead letters to write smaller when redone (source position → tries); partitions stopped
        # at their last commit because a record of theirs is refused every time.
        self._closing = False
        self._abort_reason: str | None = None
        self._abort_by = 0.0
        self._commit_sent_at = 0.0
        # Exactly-once: why the producer must be replaced at the next turn (a fatal error it cannot survive).
        self._replace_reason: str | None = None
        # Producers and committers left behind by `_replace_stuck_producer`: a thread is still inside them.
        self._abandoned: list[object] = []
        self._redo_smaller: dict[tuple[str, int, int], int] = {}
        self._poisoned: set[TopicPartitionKey] = set()
        self._paused: set[TopicPartitionKey] = set()
        self._stopping = False
        self._stop_by: float | None = None
        # While revoking or stopping: the instant a produce stops waiting for room in the client's queue.
        self._give_up_at: float | None = None
        self._fatal: str | None = None
        now = clock()
        self._last_commit = now
        self._last_poll = now
        # A failed commit is retried after a commit interval, not at once (a broker outage fails them all).
        self._retry_commit_at = now
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

    def _on_producer_error(self, error: confluent_kafka.KafkaError) -> None:
        """error_cb of the producer: as `on_client_error`, but in exactly-once mode a fatal error that a new
        producer can recover from replaces the producer instead of ending the run."""
        if error.fatal() and self._transactions is not None:
            self._producer_failed(f"{error.name()}: {error.str()}", stops_worker(error))
        else:
            self.on_client_error(error)

    def _producer_failed(self, reason: str, stop: bool) -> None:
        """Exactly-once: the producer is unusable. Fenced (another live worker has our transactional id) or
        not authorized: stop. Anything else: a new producer takes over at the next turn."""
        if not stop:
            self._replace_reason = self._replace_reason or reason
        elif self._fatal is None:
            self._fatal = reason
            _log.error(
                "transactions_failed",
                reason=reason,
                effect="stopping: another worker may use the same pipeline.transactional_id",
            )

    def run(self) -> int:
        if self._transactions is not None:
            try:
                self._transactions.init()
            except TransactionFailed as problem:
                self._committer.close()
                self._consumer.close()
                raise UserError(f"Kafka: cannot start transactions (exactly_once): {problem}") from None
            self._transactions.begin()
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
        )
        while not self._stopping and self._fatal is None:
            self._turn()
        return self._shutdown()

    # -- the loop -------------------------------------------------------------------------------------------

    def _turn(self) -> None:
        self._service(wait_s=0.0)
        busy = self._ledger.at_model > 0
        if self._may_poll():
            idle = not busy and len(self._tracker) == 0 and self._ledger.orphans == 0
            wait_s = self._pipeline.poll_timeout_ms / 1000.0 if idle else _BUSY_WAIT_S
            # With partitions paused (no capacity) the poll only serves callbacks and keeps the member alive.
            self._last_poll = self._clock()
            messages = self._consumer.consume(
                num_messages=max(1, min(self._pipeline.poll_batch_size, self._gate.capacity())),
                timeout=0.0 if busy else wait_s,
            )
            self._take(messages)
        elif not busy:
            # Nothing at the model: slots come back with the commit on its way or with delivery reports.
            if self._committer.busy:
                self._committer.wait_idle(_BUSY_WAIT_S)
            else:
                self._poll_producer(_BUSY_WAIT_S)
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
        return self._commit_settled() and self._gate.may_poll()

    def _commit_settled(self) -> bool:
        return not self._committer.busy or self._clock() - self._last_poll >= _COMMIT_BEFORE_POLL_S

    def _service(self, wait_s: float) -> None:
        """Everything but polling the consumer: the records' progress, commits, flow control."""
        self._serve_work(wait_s)
        # All reports of a doomed transaction come first (bounded): they name the records the broker refuses.
        aborting = self._abort_reason is not None and not self._committer.busy
        if aborting and (not self._ledger.at_producer or self._clock() >= self._abort_by):
            self._abort_and_redo()
        stuck = self._transactions is not None and self._committer.busy
        if stuck and self._clock() - self._commit_sent_at >= _STUCK_COMMIT_S:
            self._replace_reason = f"commit on its way for {_STUCK_COMMIT_S:.0f} s"
        if self._replace_reason is not None and self._fatal is None:
            self._replace_stuck_producer(self._replace_reason)
        self._apply_commit_outcomes()
        self._maybe_commit()
        self._apply_flow()

    def _serve_work(self, wait_s: float) -> None:
        """Move taken records forward: delivery reports, model answers, expiry, dispatch. Waits up to
        `wait_s` for an answer, or for a report when nothing is at the model."""
        if self._ledger.at_model:
            self._poll_producer(0)
            self._collect(wait_s)
        else:
            self._poll_producer(wait_s)
        self._expire_waiting()
        self._dispatch()
        if self._shadow is not None:
            self._shadow.serve()

    def _poll_producer(self, timeout: float) -> None:
        """Serve delivery reports. A fatal producer error is raised here too (confluent-kafka raises it from
        poll): fenced by a newer worker with the same transactional id, it ends the run like any fatal one."""
        try:
            self._producer.poll(timeout)
        except confluent_kafka.KafkaException as problem:
            if self._transactions is not None:
                self._producer_failed(describe(problem), stops_worker(problem))
            elif self._fatal is None:
                self._fatal = describe(problem)
                _log.error("kafka_fatal_error", reason=self._fatal)

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
            work = Work(
                state=state,
                topic=topic,
                partition=partition,
                offset=offset,
                key=message.key(),
                headers=headers,
                polled_at=now,
                deadline=now + self._pipeline.deadline_ms / 1000.0,
            )
            self._ledger.taken(work)
            value = message.value()
            if work.key is not None and len(work.key) > MAX_KEY_BYTES:
                reason = f"key is {len(work.key)} bytes, over the {MAX_KEY_BYTES}-byte limit"
                self._dead_letter(work, value, "key_too_large", reason)
                continue
            try:
                event = decode_ticket(value, self._pipeline.max_value_bytes)
                deadline = ticket_deadline(now, wall, self._pipeline.deadline_ms, event.metadata)
            except DecodeError as problem:
                self._dead_letter(work, value, problem.error_type, problem.message)
                continue
            except Exception as error:  # no record may stop the worker, whatever a library raises
                _log.exception("record_failed", topic=topic, partition=partition, offset=offset)
                self._dead_letter(work, value, "internal_error", f"{type(error).__name__}: {error}")
                continue
            work.event = event
            work.deadline = deadline
            self._ledger.wait(work)
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
        while self._ledger.at_model < self._window and (work := self._ledger.next_waiting()) is not None:
            event = work.event
            assert event is not None  # only tickets wait for the model
            # A ticket the model would most likely not finish in time is answered now. With nothing at the
            # model it is tried anyway: that costs no other ticket model time and keeps the estimate learning.
            expected_s = self._latency.expected_s if self._ledger.at_model else 0.0
            if self._clock() + expected_s >= work.deadline:
                self._produce_fallback(work, event, "overloaded")
                continue
            self.metrics.queue_wait.observe(self._clock() - work.polled_at)
            request_id = self._ledger.to_model(work)
            self._classifier.submit(ClassifyRequest(request_id, ticket_text(event), work.deadline))

    def _expire_waiting(self) -> None:
        """Tickets whose deadline passed while they waited for the model get `overloaded`, without it."""
        for work in self._ledger.expired(self._clock()):
            assert work.event is not None
            self._produce_fallback(work, work.event, "overloaded")

    def _collect(self, wait_s: float) -> None:
        if not self._ledger.at_model:
            return
        answers = self._classifier.poll(wait_s)
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
            assert work.event is not None
            if answer.fallback:
                self.metrics.fallback[answer.fallback_reason or "unknown"] += 1
            else:
                self.metrics.classified += 1
            self._produce_result(
                work, work.event, encode_result(triage_result(work.event, answer, work.source, made_at))
            )
            if self._shadow is not None and not answer.fallback:
                key = result_key(work.key, work.event)
                self._shadow.offer(work.event, work.source, key, work.headers, answer)

    def _produce_fallback(self, work: Work, event: TicketEvent, reason: FallbackReason) -> None:
        self.metrics.fallback[reason] += 1
        latency_ms = (self._clock() - work.polled_at) * 1000.0
        answer = fallback_answer(reason, self._fallback, self._classifier.model_id, latency_ms)
        self._produce_result(work, event, encode_result(triage_result(event, answer, work.source)))

    def _dead_letter(self, work: Work, value: bytes | None, error_type: str, message: str) -> None:
        self.metrics.dead_letter(error_type)
        headers = dead_letter_headers(
            work.headers, error_type, message, work.topic, work.partition, work.offset
        )
        _log.debug(
            "dead_lettered",
            topic=work.topic,
            partition=work.partition,
            offset=work.offset,
            error_type=error_type,
        )
        output = Output(self._topics.dead_letter, work.key, value, headers)
        # Kept until committed: librdkafka can fail the next transaction too (measured: after a refused
        # record and an abort, the next commit fails with OUT_OF_ORDER_SEQUENCE_NUMBER), so a redo may repeat.
        tries = self._redo_smaller.get((work.topic, work.partition, work.offset), 0)
        if tries:  # exactly-once redo of a dead letter the broker refused as too large
            output = self._smaller(work, output, tries)
        self._produce(work, output)

    # -- producing and delivery -----------------------------------------------------------------------------

    def _produce_result(self, work: Work, event: TicketEvent, value: bytes) -> None:
        self._produce(work, Output(self._topics.output, result_key(work.key, event), value, work.headers))

    def _produce(self, work: Work, output: Output) -> None:
        """Write `output` for `work`: at once, or in order (exactly-once) once the records before it are."""
        if self._transactions is None:
            self._send(work, output)
        else:
            self._ledger.hold(work, output)
            self._release(work.state)

    def _release(self, state: PartitionOffsets | None = None) -> None:
        """Exactly-once: produce the held outputs that may go (of `state`'s partition, or of all), unless the
        transaction takes no records."""
        if not self._closing and self._abort_reason is None:
            for work in self._ledger.release(state):
                assert work.output is not None
                self._send(work, work.output)

    def _send(self, work: Work, output: Output) -> None:
        delivery_id = self._ledger.to_broker(work)
        on_delivery = functools.partial(self._on_delivery, delivery_id, output)
        try:
            # A full local queue (the broker is slow or away) is waited out, bounded on revoke and shutdown.
            produce(
                self._producer,
                output.topic,
                output.value,
                output.key,
                output.headers,
                on_delivery,
                self._give_up_at,
            )
        except BufferError:
            self._on_delivery(delivery_id, output, confluent_kafka.KafkaError(_QUEUE_FULL), None)
        except confluent_kafka.KafkaException as refused:
            # Refused before queueing (e.g. over message.max.bytes): the same path as a failed delivery,
            # except that the transaction (exactly-once) never saw it.
            self._on_delivery(delivery_id, output, refused.args[0], None, queued=False)

    def _on_delivery(
        self,
        delivery_id: int,
        output: Output,
        error: confluent_kafka.KafkaError | None,
        _msg: Any,
        queued: bool = True,
    ) -> None:
        work = self._ledger.delivered(delivery_id)
        if work is None:
            return
        if error is None:
            self.metrics.produced += 1
            self.metrics.end_to_end.observe(self._clock() - work.polled_at)
            work.state.done(work.offset)
            return
        too_large = error.code() == confluent_kafka.KafkaError.MSG_SIZE_TOO_LARGE
        if self._transactions is not None and (queued or not too_large):
            self._failed_in_transaction(work, output, error)
            return
        if too_large and self._write_smaller(work, output):
            return
        work.state.fail(work.offset)
        self._delivery_failed(work, error, "never committed past this offset until a restart or rebalance")
        if not work.orphan:
            self._pause([work.partition_key])

    def _write_smaller(self, work: Work, output: Output) -> bool:
        """A dead letter too large for its topic (it carries the original value, key and headers) must not
        stop its partition: write it with its `triage.*` headers only; they point at the original in the
        source topic. The broker refuses a whole batch for one large record, so the small one is sent again
        a few times before giving up. False for results: decoding bounds their size, so a result refused as
        too large means a misconfigured output topic."""
        if output.topic != self._topics.dead_letter or output.shrunk >= _SHRUNK_DEAD_LETTER_TRIES:
            return False
        self._send(work, self._smaller(work, output, output.shrunk + 1))
        return True

    def _smaller(self, work: Work, output: Output, shrunk: int) -> Output:
        """`output` (a dead letter) with its `triage.*` headers only, and the size of what was left out."""
        headers = output.headers or []
        kept = [(n, v) for n, v in headers if n.startswith("triage.") and n != OMITTED_BYTES]
        omitted = output.omitted or (
            len(output.value or b"")
            + len(output.key or b"")
            + sum(len(n) + len(v or b"") for n, v in headers if not n.startswith("triage."))
        )
        kept.append((OMITTED_BYTES, str(omitted).encode("ascii")))
        _log.warning(
            "dead_letter_shrunk", partition=work.partition, offset=work.offset, omitted_bytes=omitted
        )
        return Output(output.topic, None, None, kept, omitted, shrunk)

    def _failed_in_transaction(self, work: Work, output: Output, error: confluent_kafka.KafkaError) -> None:
        """Exactly-once: one failed record fails its transaction, which is aborted and redone. A record the
        broker refuses every time must not be redone forever: a dead letter is redone smaller (a few
        times); anything else stops its partition at its last commit. The refusal may be reported after
        the abort (its record is an orphan by then): it still counts for the redo."""
        _log.debug(
            "delivery_failed_in_transaction", offset=work.offset, code=error.name(), orphan=work.orphan
        )
        if error.code() in _REFUSED_RECORD:
            smaller = error.code() == confluent_kafka.KafkaError.MSG_SIZE_TOO_LARGE
            if (
                smaller
                and output.topic == self._topics.dead_letter
                and output.shrunk < _SHRUNK_DEAD_LETTER_TRIES
            ):
                self._redo_smaller[(work.topic, work.partition, work.offset)] = output.shrunk + 1
            else:
                self._poisoned.add(work.partition_key)
                self._delivery_failed(work, error, "at its last commit until a restart or rebalance")
        if self._abort_reason is None and not work.orphan:
            self._abort_reason = f"delivery of offset {work.offset} failed: {error.name()}"
            self._abort_by = self._clock() + _REPORTS_BEFORE_ABORT_S

    def _delivery_failed(self, work: Work, error: confluent_kafka.KafkaError, stopped: str) -> None:
        self.metrics.delivery_failed += 1
        _log.error(
            "delivery_failed",
            topic=work.topic,
            partition=work.partition,
            offset=work.offset,
            code=error.name(),
            reason=error.str(),
            effect=f"partition stopped: {stopped}",
        )

    # -- commits --------------------------------------------------------------------------------------------

    def _maybe_commit(self) -> None:
        now = self._clock()
        if self._committer.busy or now < self._retry_commit_at:
            return  # one commit at a time: that also caps the rate at one per broker round trip
        due = now - self._last_commit >= self._pipeline.commit_interval_ms / 1000.0
        # Done but uncommitted work holds in-flight slots: commit early when it fills half of them.
        crowded = self._tracker.uncommitted_done() * 2 >= self._pipeline.max_in_flight
        if not (due or crowded or self._closing):
            return
        if self._transactions is not None:
            # The transaction takes no more records; its offsets are known once all of them are acknowledged.
            self._closing = True
            if self._ledger.at_producer or self._abort_reason is not None:
                return
        positions = self._tracker.commit_positions()
        self._last_commit = now
        if not positions:
            # Nothing was written (every output goes with its offset): the open transaction goes on.
            self._closing = False
            self._release()
            return
        for key, position in positions.items():
            state = self._tracker.get(key)
            if state is not None:
                state.commit_requested(position)
        self._commit_sent_at = now
        self._committer.submit(positions)

    def _apply_commit_outcomes(self) -> None:
        """Confirmed positions release their offsets (and in-flight slots); failed ones may be sent again."""
        outcomes = self._committer.results()
        for outcome in outcomes:
            self._apply_commit_outcome(outcome)
        if outcomes:
            self._update_gauge()

    def _apply_commit_outcome(self, outcome: CommitOutcome) -> None:
        if outcome.fatal:
            self._producer_failed(f"transaction failed: {outcome.error}", stop=True)
            return
        if outcome.aborted:
            self._redo(outcome.error or "commit failed")
            return
        if outcome.unsettled:
            self._replace_stuck_producer(outcome.error or "commit failed")
            return
        for key, position in outcome.confirmed.items():
            if (state := self._tracker.get(key)) is not None:
                self.metrics.committed += state.committed(position)
        if self._redo_smaller and outcome.confirmed:
            self._redo_smaller = {
                (t, p, offset): tries
                for (t, p, offset), tries in self._redo_smaller.items()
                if offset >= outcome.confirmed.get((t, p), -1)
            }
        for key, position in outcome.failed.items():
            if (state := self._tracker.get(key)) is not None:
                state.commit_failed(position)
        if outcome.failed:
            self._retry_commit_at = self._clock() + self._pipeline.commit_interval_ms / 1000.0
            self.metrics.commit_failed += 1
            _log.warning("commit_failed", reason=outcome.error, partitions=_names(set(outcome.failed)))
        if self._transactions is not None:
            self.metrics.transactions += 1
            self._reopen()

    def _reopen(self) -> None:
        """Exactly-once: begin the next transaction and produce what was held meanwhile."""
        if self._transactions is not None and self._closing:
            try:
                self._transactions.begin()
            except confluent_kafka.KafkaException as problem:  # fenced or fatal meanwhile
                self._producer_failed(describe(problem), stops_worker(problem))
                return
            self._closing = False
            self._release()

    def _abort_and_redo(self) -> None:
        reason = self._abort_reason or "aborted"
        assert self._transactions is not None
        failed = self._transactions.abort()
        if failed is None:
            self._redo(reason)
        elif failed.fatal:
            self._producer_failed(f"transaction abort failed: {failed.reason}", stop=True)
        else:
            self._replace_stuck_producer(f"{reason}; abort failed: {failed.reason}")

    def _replace_stuck_producer(self, reason: str) -> None:
        """Exactly-once: a transaction neither committed nor aborted. Seen here: a commit call that never
        returns, because librdkafka ignores the call's timeout when its cached group coordinator went away
        (confluentinc/librdkafka#5456 and #5511), after a broker restart; and an abort that times out
        after the broker refused records. A new producer with the same transactional id fences the old one
        and ends its transaction; the work is redone from the group's committed offsets, which say whether
        that transaction committed after all. The old producer is left alone: a thread may still be in it."""
        _log.error(
            "transaction_stuck",
            reason=reason,
            effect="a new transactional producer takes over; the work is redone from the committed offsets",
        )
        self._replace_reason = None
        self._abandoned.append((self._producer, self._committer))
        self._producer = self._clients.producer(self._on_producer_error)
        self._transactions = Transactions(self._producer, self._consumer)
        self._committer = Committer(self._transactions.commit)
        self._ledger.forget_produced()
        states = list(self._tracker)
        try:
            self._transactions.init()
            wanted = [confluent_kafka.TopicPartition(*state.key) for state in states]
            committed = self._consumer.committed(wanted, timeout=30.0) if wanted else []
        except (TransactionFailed, confluent_kafka.KafkaException) as problem:
            # A restart recovers the same way (init_transactions, then the committed offsets).
            self._fatal = f"cannot replace the stuck transactional producer: {problem}"
            return
        self._redo(reason, {(tp.topic, tp.partition): tp.offset for tp in committed})

    def _redo(self, reason: str, committed: dict[TopicPartitionKey, int] | None = None) -> None:
        """After an abort: every owned partition starts again at its first uncommitted offset (the aborted
        transaction's records are never read, so nothing is lost and nothing is written twice), or at the
        group's `committed` offset where the outcome of the last commit is not known here."""
        assert self._transactions is not None
        self._abort_reason = None
        self.metrics.transactions_aborted += 1
        states = list(self._tracker)
        self._ledger.give_up({state.key for state in states})
        redo_from: dict[str, int] = {}
        for state in states:
            start = state.first_uncommitted
            if start is None:
                continue
            if committed is not None and committed.get(state.key, -1) >= 0:
                start = committed[state.key]
            blocked = state.key in self._poisoned
            self._tracker.restart(state.key, start, blocked)
            redo_from[f"{state.key[0]}[{state.key[1]}]"] = start
            try:
                self._consumer.seek(confluent_kafka.TopicPartition(*state.key, start))
            except confluent_kafka.KafkaException as problem:
                # Going on would skip the records between `start` and the fetch position: a restart
                # re-reads them from the committed offset instead.
                self._fatal = f"cannot seek {state.key[0]}[{state.key[1]}] back to {start}: {problem}"
                _log.error("redo_failed", reason=self._fatal)
                return
            if blocked:
                self._pause([state.key])
        _log.warning("transaction_aborted", reason=reason, redo_from=redo_from)
        self._closing = True
        self._last_commit = self._clock()
        self._reopen()
        self._update_gauge()

    def _commit_now(self, states: Sequence[PartitionOffsets]) -> None:
        """Synchronous commit of the done prefix of `states` on this thread (on revoke and at shutdown).

        Not through the committer: inside a rebalance callback only this thread's commit goes through.
        """
        self._apply_commit_outcomes()
        positions = {state.key: pos for state in states if (pos := state.position) is not None}
        if not positions:
            return
        try:
            results = self._consumer.commit(offsets=topic_partitions(positions), asynchronous=False)
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

    def _settle_commit(self, limit: float) -> None:
        """Wait (until `limit`) for the commit on its way, and apply its outcome."""
        self._committer.wait_idle(max(0.0, limit - self._clock()))
        self._apply_commit_outcomes()

    def _commit_transaction_now(self, limit: float) -> None:
        """Exactly-once, on revoke and at shutdown: commit the open transaction on this thread, once every
        record in it is acknowledged; abort it (and redo its work) when that does not happen by `limit`."""
        assert self._transactions is not None
        self._settle_commit(limit)
        if self._fatal is not None or self._committer.busy:
            return  # the commit on its way holds the transaction; its outcome is applied later
        self._closing = True
        while self._ledger.at_producer and self._abort_reason is None and self._clock() < limit:
            self._poll_producer(_BUSY_WAIT_S)
        if self._ledger.at_producer or self._abort_reason is not None:
            self._abort_reason = self._abort_reason or "records not acknowledged in time"
            self._abort_and_redo()
            return
        self._last_commit = self._clock()
        outcome = self._transactions.commit(self._tracker.commit_positions())
        self._apply_commit_outcome(outcome)
        if outcome.confirmed:
            positions = {f"{t}[{p}]": pos for (t, p), pos in sorted(outcome.confirmed.items())}
            _log.info("committed", positions=positions)

    # -- flow control ---------------------------------------------------------------------------------------

    def _update_gauge(self) -> None:
        flow = self._gate.update(len(self._tracker) + self._ledger.orphans, self._clock())
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
        elif self._paused:
            blocked = self._blocked()
            self._resume([key for key in self._paused if key not in blocked])

    def _pause(self, keys: Sequence[TopicPartitionKey]) -> None:
        fresh = [key for key in keys if key not in self._paused]
        if fresh:
            self._consumer.pause(topic_partitions(dict.fromkeys(fresh, confluent_kafka.OFFSET_INVALID)))
            self._paused.update(fresh)

    def _resume(self, keys: Sequence[TopicPartitionKey]) -> None:
        if keys:
            self._consumer.resume(topic_partitions(dict.fromkeys(keys, confluent_kafka.OFFSET_INVALID)))
            self._paused.difference_update(keys)

    # -- rebalance ------------------------------------------------------------------------------------------

    def _on_assign(self, consumer: confluent_kafka.Consumer, partitions: list[Any]) -> None:
        keys = [(tp.topic, tp.partition) for tp in partitions]
        for key in keys:
            self._tracker.assign(key)
            self._paused.discard(key)
            self._poisoned.discard(key)  # a new assignment tries its records again
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
        limit = started + self._revoke_drain_s
        if self._stop_by is not None:
            limit = min(limit, self._stop_by)
        if self._transactions is not None:
            # A transaction commit on its way blocks new records; draining needs them.
            self._settle_commit(limit)
        # Their waiting tickets go to the model first. They must finish, not be dropped: dead letters and
        # answers for later offsets may already be written, and the new owner would write them again.
        self._ledger.first_to_model(keys)
        states = [state for key in keys if (state := self._tracker.get(key)) is not None]
        self._give_up_at = limit
        while self._ledger.pending(keys) and self._clock() < limit:
            self._serve_work(_BUSY_WAIT_S)
        self._give_up_at = self._stop_by
        left = self._ledger.pending(keys)
        # Tickets that did not make it are left to the new owner; those at the model or the producer are
        # still counted (orphans) until their answer or report arrives.
        self._ledger.give_up(keys)
        if self._transactions is None:
            self._commit_now(states)
        else:
            # The transaction holds records of every owned partition: it commits (or aborts) as a whole.
            self._commit_transaction_now(limit)
        self._tracker.revoke(keys)
        self._paused.difference_update(keys)
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
        # Exactly-once: the open transaction holds outputs of these partitions, which their new owner writes
        # again.
        if self._transactions is not None and keys and self._abort_reason is None:
            self._abort_reason, self._abort_by = "partitions lost", self._clock()
        self._ledger.give_up(keys)
        self._tracker.revoke(keys)
        self._paused.difference_update(keys)
        self._update_gauge()
        _log.warning(
            "partitions_lost", partitions=_names(keys), effect="not committed; the new owner redoes them"
        )

    # -- shutdown -------------------------------------------------------------------------------------------

    def _shutdown(self) -> int:
        started = self._clock()
        limit = started + self._pipeline.shutdown_timeout_ms / 1000.0
        self._stop_by = self._give_up_at = limit
        _log.info("pipeline_stopping", in_flight=self._gate.in_flight, reason=self._fatal or "signal")
        # Stop fetching, but keep polling: the member must stay in the group while in-flight work finishes.
        self._pause([state.key for state in self._tracker])
        while not self._ledger.is_empty() and self._clock() < limit and self._fatal is None:
            self._service(wait_s=_BUSY_WAIT_S)
            if self._commit_settled():  # see `_may_poll`
                self._last_poll = self._clock()
                self._consumer.consume(num_messages=1, timeout=0.0)
        unfinished = self._ledger.waiting + self._ledger.at_model
        if self._transactions is not None:
            if self._fatal is None:
                self._commit_transaction_now(limit)
            not_flushed = len(self._producer)
        else:
            remaining = max(0.0, limit - self._clock())
            not_flushed = self._producer.flush(remaining) if self._fatal is None else len(self._producer)
            # The last background commit must land before the final one, never after it.
            self._committer.wait_idle(max(0.0, limit - self._clock()))
            self._commit_now(list(self._tracker))
        self._committer.close()
        self._consumer.close()
        if self._shadow is not None:  # after the last commit: the shadow never holds one back
            self._shadow.close(max(0.0, limit - self._clock()))
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
        self.metrics.turned(now, self._consumer, self._tracker, self._paused)
        if now - self._last_metrics >= self._metrics_interval_s:
            self._log_metrics("interval")

    def _log_metrics(self, kind: str) -> None:
        self._last_metrics = self._clock()
        blocked = {f"{t}[{p}]": offset for (t, p), offset in sorted(self._blocked().items())}
        ledger = self._ledger
        # Where the in-flight records are: waiting, at the model, at the producer, held for order; orphans.
        where = [ledger.waiting, ledger.at_model, ledger.at_producer, ledger.held, ledger.orphans]
        _log.info(
            "metrics", kind=kind, blocked_partitions=blocked, in_flight_at=where, **self.metrics.snapshot()
        )

    def _blocked(self) -> dict[TopicPartitionKey, int]:
        """Owned partitions stopped by a delivery that failed for good, with the offset they stop at."""
        return {state.key: at for state in self._tracker if (at := state.blocked_at) is not None}


def _headers(message: confluent_kafka.Message) -> Headers | None:
    """A consumed record's headers as a list (a consumer gives bytes values; None for a null header)."""
    raw = message.headers()
    if raw is None:
        return None
    pairs = raw.items() if isinstance(raw, dict) else raw
    return [(name, value.encode("utf-8") if isinstance(value, str) else value) for name, value in pairs]


def _names(keys: Sequence[TopicPartitionKey] | set[TopicPartitionKey]) -> list[str]:
    return [f"{topic}[{partition}]" for topic, partition in sorted(keys)]
