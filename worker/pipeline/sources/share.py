"""Queue mode's source: a share group's batches, each record locked to this worker and settled on its own.

`pipeline.consume = "queue"` reads the input through a share group (Kafka >= 4.2): any number of workers share
one partition. The share consumer's explicit-acknowledgement rule shapes this source: every record of a poll
must be acknowledged before the next poll (else it raises), so it polls a batch, keeps it as a backlog, hands
the loop records from it while they can still finish inside their lock (`lock_budget.py`), and polls again
only once every record of the batch is settled (`acknowledge`), sending the acknowledgements first.

What a share group charges a delivery for — each time a record is acquired, its delivery count goes up, and
at the group's limit the broker archives it — is spent on tries only, never on the worker's own pacing or on
an outage (issue #43):

- **Ask for no more than can be done.** The consumer's `max.poll.records` is what this worker finishes
  within one ticket deadline at its measured rate (`FetchSize`); when that moves by half or double, the
  consumer is made anew between two batches (measured: a new member of an existing group has its first
  records in 10-50 ms). librdkafka 2.16 has neither the strict record limit (KIP-1206) nor lock renewal
  (KIP-1222), and the broker hands out whole producer batches, so a batch may still hold more than can be
  done: then the records delivered most often are taken first.
- **A record on its last delivery is never released** (the broker would archive it without a trace; issue
  #55): it is taken before the others; once the lock leaves no model time, or the worker stops taking, one
  still in the backlog is taken at once, whatever the in-flight bound, and answered with the `overloaded`
  fallback (`Record.answer_now`), as group mode answers a ticket that waited past its deadline (one held
  back for the registry gets its dead letter instead); a taken one still without an answer when the window
  to deliver inside the lock closes, or halfway through the shutdown time, is answered so without waiting
  for the model (`Loop.answer_now`); one whose triage record fails is dead-lettered
  (`acknowledgements.py`). Other records not taken in time are released (counted as `released_untried`).
- **A Schema Registry that cannot answer** holds the records of its partition back in the backlog (the loop
  probes the registry on a backoff, `registry_wait.py`); no new batch is polled meanwhile, so an outage
  costs at most the one delivery of the batch at hand, whose lock ends while the registry is away.
- **A model process that died** under a record: it is released for another try (another worker may well
  classify it), unless it is the record's last delivery. A model that raised is answered `model_error`.

Shutdown: the backlog's last deliveries are answered at once and the rest of it released, the taken records
finish within the loop's shutdown time (last deliveries answered halfway through it), the rest is released,
the acknowledgements are sent synchronously, and the consumer closed. A crash (kill -9) releases the
worker's records at once (the broker sees the connection close).
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import confluent_kafka
import structlog

from worker.errors import UserError
from worker.kafka.clients import record_headers
from worker.kafka.commits import TopicPartitionKey
from worker.kafka.share_groups import NO_SHARE_GROUPS, ShareGroup
from worker.pipeline.failure import Failure
from worker.pipeline.metrics import PartitionGauges, PipelineMetrics, QueueMetrics
from worker.pipeline.seams import HandBack, Loop, Record
from worker.pipeline.settlements.offsets import PartitionOffsets
from worker.pipeline.sources.lock_budget import LockBudget
from worker.pipeline.work import Work

_log = structlog.get_logger("worker.pipeline")

# How long the acknowledgements of the last batch may take at shutdown.
_LAST_COMMIT_S = 10.0
# The consumer is made anew for another fetch size at most this often.
_REFETCH_EVERY_S = 10.0
# Acknowledgements made are sent at least this often while the batch is still at work (the client sends
# them only on a commit, the next poll or close): a kill -9 then redoes only what was settled since.
_SEND_EVERY_S = 0.5
_UNSUPPORTED_VERSION = confluent_kafka.KafkaError.UNSUPPORTED_VERSION

ErrorCallback = Callable[[confluent_kafka.KafkaError], None]
# Makes the share consumer: (its error callback, max.poll.records).
ShareConsumerFactory = Callable[[ErrorCallback, int], confluent_kafka.ShareConsumer]


class Acknowledgement(enum.Enum):
    """How a record is acknowledged (the share consumer's `AcknowledgeType`)."""

    ACCEPT = confluent_kafka.AcknowledgeType.ACCEPT
    RELEASE = confluent_kafka.AcknowledgeType.RELEASE
    REJECT = confluent_kafka.AcknowledgeType.REJECT


@dataclass
class FetchSize:
    """How many records a poll asks for: what this worker finishes within one ticket deadline at the rate it
    measured on the last batches, between `smallest` (the model's window) and `largest` (`max_in_flight`).
    `fixed`: the user set `max.poll.records`; it is left as it is."""

    smallest: int
    largest: int
    deadline_s: float
    current: int
    fixed: bool = False

    @classmethod
    def starting(cls, smallest: int, largest: int, deadline_s: float, given: int | None) -> FetchSize:
        if given is not None:
            return cls(given, given, deadline_s, given, fixed=True)
        smallest = max(1, min(smallest, largest))
        return cls(smallest, largest, deadline_s, min(largest, 2 * smallest))

    def wanted(self, finished: int, busy_s: float) -> int:
        """The size for a batch whose `finished` records took `busy_s` from the first take to the last
        outcome (one batch's rate: records per second of busy time)."""
        if self.fixed or finished <= 0:
            return self.current
        rate = finished / max(busy_s, 1e-3)
        return max(self.smallest, min(self.largest, round(rate * self.deadline_s)))

    def moves(self, wanted: int) -> bool:
        """Whether `wanted` is far enough from the current size to make the consumer anew (half or double)."""
        return not self.fixed and (wanted >= 2 * self.current or 2 * wanted <= self.current)


class _Batch:
    """The batch at hand: when its lock started, and what was taken for the model from it (for the rate)."""

    def __init__(self, lock_from: float) -> None:
        self.lock_from = lock_from
        self.first_take: float | None = None
        self.last_outcome: float | None = None
        self.to_model = 0


class ShareSource:
    """A share group's records (see the module docstring). `make_consumer(on_error, max_poll_records)` builds
    the share consumer; `group` holds the lock and delivery limit read at start (`prepare_share_group`)."""

    def __init__(
        self,
        make_consumer: ShareConsumerFactory,
        topic: str,
        group_id: str,
        group: ShareGroup,
        budget: LockBudget,
        fetch: FetchSize,
        poll_timeout_s: float,
        metrics: PipelineMetrics,
        failure: Failure,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._make_consumer = make_consumer
        self._topic, self._group_id, self._group = topic, group_id, group
        self._budget, self._fetch = budget, fetch
        self._poll_timeout_s = poll_timeout_s
        self._metrics = metrics
        self._counts = metrics.queue = QueueMetrics(fetch_size=fetch.current)
        self._failure = failure
        self._clock = clock
        self._no_share_groups = False
        self._consumer = make_consumer(self._on_consumer_error, fetch.current)
        self._last_refetch = clock()
        self._loop: Loop | None = None
        # The batch at hand: records not taken yet (last deliveries first), and taken ones without an outcome.
        self._batch: _Batch | None = None
        self._backlog: collections.deque[Record] = collections.deque()
        self._unsettled: dict[Work, confluent_kafka.Message] = {}
        # Partitions held back for the Schema Registry: their records stay in the backlog.
        self._held: set[TopicPartitionKey] = set()
        # A Work needs a partition's offset state; queue mode commits no offsets, so these only name it.
        self._partitions: dict[TopicPartitionKey, PartitionOffsets] = {}
        self._taking = True
        # While stopping: when the taken records on their last delivery that have no answer yet get one
        # without the model (halfway through the shutdown time: the other half delivers it).
        self._stop_answer_at: float | None = None
        # Taken records on their last delivery answered without the model already (`_answer_last_deliveries`).
        self._answered_now: set[Work] = set()
        # Acknowledgements made and not sent yet, and when they were last sent.
        self._unsent = 0
        self._last_sent = clock()

    # -- seams.Source ---------------------------------------------------------------------------------------

    def open(self, loop: Loop) -> None:
        self._loop = loop
        self._consumer.subscribe([self._topic])

    def may_take(self) -> bool:
        if not self._taking:
            return False
        if self._batch is None:
            return not self._held  # a new batch only once the registry answers again
        return any(record.partition_key not in self._held for record in self._backlog)

    def read(self, room: int, wait_s: float, take: Callable[[Record], None]) -> None:
        if self._batch is None:
            self._poll(wait_s)
            if self._batch is None:
                return
        taken = self._from_backlog(room)
        while taken:
            record = taken.popleft()
            if record.partition_key in self._held:
                # The take before held its partition back for the registry: the rest waits in the backlog.
                self._backlog.extendleft(reversed([record, *taken]))
                return
            take(record)

    def work(self, record: Record, now: float, deadline: float) -> Work | None:
        key = record.partition_key
        state = self._partitions.get(key)
        if state is None:
            state = self._partitions[key] = PartitionOffsets(key)
        work = record.taken(state, now, deadline)
        self._unsettled[work] = record.handle
        if self._batch is not None and record.answer_now is None:
            self._batch.to_model += 1
            if self._batch.first_take is None:
                self._batch.first_take = now
        return work

    def hold_back(self, record: Record) -> bool:
        if record.answer_now is not None:
            return False  # its last delivery, with its lock ending: it is answered now, not held
        self._held.add(record.partition_key)
        self._backlog.appendleft(record)
        return True

    def resume(self, key: TopicPartitionKey) -> None:
        self._held.discard(key)

    def hand_back(self, work: Work) -> HandBack:
        message = self._unsettled.get(work)
        if message is None:
            return HandBack.RELEASED  # released already (its lock ended): nothing more to write
        if self._last_delivery(message):
            return HandBack.DEAD_LETTER
        self.acknowledge(work, Acknowledgement.RELEASE)
        return HandBack.RELEASED

    def last_delivery(self, work: Work) -> bool:
        """Whether `work`'s record is on its last delivery (False once it is settled or released)."""
        message = self._unsettled.get(work)
        return message is not None and self._last_delivery(message)

    def maintain(self, now: float) -> None:
        batch = self._batch
        if batch is None:
            return
        self._answer_last_deliveries(batch, now)
        if now >= self._budget.expires_at(batch.lock_from):
            self._release_all("record lock ending")
        if not self._unsettled and not self._backlog:
            self._close_batch(now)
        elif self._unsent and now - self._last_sent >= _SEND_EVERY_S:
            self._send(now)

    def pause_all(self) -> None:
        pass  # the in-flight bound holds taking back by itself: a share consumer has nothing to pause

    def resume_all(self) -> None:
        pass

    def in_flight(self) -> int:
        return len(self._unsettled)

    @property
    def exhausted(self) -> bool:
        return False

    @property
    def rebalances(self) -> bool:
        return False  # a share consumer has no rebalance callbacks

    def poll_while_stopping(self) -> None:
        pass  # heartbeats run in librdkafka's background thread; a poll would refuse with records unsettled

    def stop_taking(self) -> None:
        """Shutdown began: records on their last delivery in the backlog are answered at once (`overloaded`:
        the shutdown leaves them no model time; released, the broker would archive them without a trace),
        the rest of the backlog is released; taken ones on their last delivery still without an answer
        halfway through the shutdown time are answered then (`maintain`)."""
        self._taking = False
        assert self._loop is not None
        now, stop_by = self._clock(), self._loop.stop_by
        if stop_by is not None:
            self._stop_answer_at = now + max(0.0, stop_by - now) / 2
        if self._batch is not None:
            self._answer_last_deliveries(self._batch, now)
        if self._backlog:
            self._release_backlog("stopping")

    def stop(self, limit: float) -> None:
        self._taking = False
        last = [work for work, message in self._unsettled.items() if self._last_delivery(message)]
        if last:  # answered, but not acknowledged in time: the broker's own net (its dead-letter topic)
            _log.warning(
                "last_deliveries_released",
                count=len(last),
                reason="stopping: their outputs were not acknowledged within the shutdown time",
                effect="the broker archives them (to its dead-letter topic where one is configured)",
            )
        self._release_all("stopping")
        try:
            self._consumer.commit_sync(_LAST_COMMIT_S)
        except confluent_kafka.KafkaException as problem:
            _log.warning("acknowledgements_not_sent", reason=str(problem), effect="records redelivered")
        self._consumer.close()

    def described(self) -> dict[str, object]:
        return {
            "consume": "queue",
            "input": self._topic,
            "group": self._group_id,
            "record_lock_ms": self._group.lock_ms,
            "delivery_count_limit": self._group.delivery_count_limit,
            "broker_dead_letter_topic": self._group.dead_letter_topic,
            "broker_dead_letter": self._group.dead_letter,
            "delivery_timeout_ms": round(self._budget.delivery_s * 1000),
            "fetch_size": self._fetch.current,
        }

    def logged(self) -> dict[str, object]:
        return {}

    # -- acknowledging (the settlement's outcomes) --------------------------------------------------------

    def acknowledge(self, work: Work, outcome: Acknowledgement) -> None:
        """Settle `work`: ACCEPT (its triage record was acknowledged), REJECT (its dead letter was), RELEASE
        (another try). Records released already (their lock ended) are left as they are."""
        message = self._unsettled.pop(work, None)
        if message is None:
            return
        self._consumer.acknowledge(message, outcome.value)
        self._unsent += 1
        if outcome is Acknowledgement.ACCEPT:
            self._counts.accepted += 1
        elif outcome is Acknowledgement.REJECT:
            self._counts.rejected += 1
        else:
            self._counts.released += 1
        if self._batch is not None:
            self._batch.last_outcome = self._clock()

    # -- batches --------------------------------------------------------------------------------------------

    def _poll(self, wait_s: float) -> None:
        """Poll a batch into the backlog, last deliveries first; its lock is counted from the poll's start
        (the client fetches in the background only while it holds no unacknowledged records)."""
        lock_from = self._clock()
        messages = self._read(wait_s)
        if not messages:
            return
        self._counts.batches += 1
        self._batch = _Batch(lock_from)
        records = [_record(message) for message in messages]
        records.sort(key=lambda record: -(record.handle.delivery_count() or 1))
        self._backlog.extend(records)

    def _read(self, wait_s: float) -> list[confluent_kafka.Message]:
        """A batch of records (errors in it logged and left out). A broker without share groups is refused
        in one line: the share consumer's first poll raises a fatal UNSUPPORTED_VERSION there (measured; its
        error callback may say so first)."""
        try:
            messages = self._consumer.poll(wait_s)
        except confluent_kafka.KafkaException as problem:
            error = problem.args[0] if problem.args else None
            if self._no_share_groups or (
                isinstance(error, confluent_kafka.KafkaError) and error.code() == _UNSUPPORTED_VERSION
            ):
                raise UserError(f"queue mode: {NO_SHARE_GROUPS}") from None
            if isinstance(error, confluent_kafka.KafkaError):
                if error.code() == confluent_kafka.KafkaError._MAX_POLL_EXCEEDED:
                    self._metrics.max_poll_exceeded += 1
                    _log.error("max_poll_interval_exceeded", reason=error.str())
                    return []
                if error.fatal():
                    self._failure.client_error(error)
                    return []
            _log.warning("consumer_error", reason=str(problem))
            time.sleep(self._poll_timeout_s)  # the client retries; no busy loop meanwhile
            return []
        if self._no_share_groups:
            raise UserError(f"queue mode: {NO_SHARE_GROUPS}")
        if not self._metrics.partitions.member:
            # A share consumer names no member id or partitions: a poll that raised nothing (the first one
            # raises where the broker has no share groups) is what /readyz takes for "joined".
            self._metrics.partitions = PartitionGauges(member=True)
        batch = []
        for message in messages or ():
            error = message.error()
            if error is None:
                if None not in (message.topic(), message.partition(), message.offset()):
                    batch.append(message)
                continue
            if error.code() == _UNSUPPORTED_VERSION:
                raise UserError(f"queue mode: {NO_SHARE_GROUPS}")
            if error.fatal():
                self._failure.client_error(error)
            else:
                _log.warning("consumer_error", code=error.name(), reason=error.str())
        return batch

    def _from_backlog(self, room: int) -> collections.deque[Record]:
        """Records the lock still allows, up to `room`. Once it allows no more model time: last deliveries are
        answered at once while their answer can still be delivered inside the lock; the rest is released."""
        batch = self._batch
        assert batch is not None
        now = self._clock()
        taken: collections.deque[Record] = collections.deque()
        kept: collections.deque[Record] = collections.deque()
        may_take = self._budget.may_take(batch.lock_from, now)
        released: list[Record] = []
        while self._backlog:
            record = self._backlog.popleft()
            if record.partition_key in self._held or len(taken) >= room:
                kept.append(record)
            elif may_take:
                taken.append(record)
            elif self._last_delivery(record.handle):  # never released: answered, even late
                record.answer_now = "overloaded"
                taken.append(record)
            else:
                released.append(record)
        self._backlog = kept
        if released:
            self._release_records(released, "record lock: no time left to take them")
        return taken

    def _answer_last_deliveries(self, batch: _Batch, now: float) -> None:
        """Records on their last delivery are never released (the broker would archive them without a
        trace). Once the lock allows no more model time (or the worker stops taking), those in the backlog
        are taken at once, whatever the in-flight bound, and answered `overloaded` (they need no model time;
        one held back for the registry gets its dead letter, `TriageStage.cannot_hold`). Once the window to
        deliver an answer inside the lock closes (or halfway through the shutdown time), the taken ones
        still without an answer are answered `overloaded` without waiting for the model."""
        assert self._loop is not None
        if self._backlog and not (self._taking and self._budget.may_take(batch.lock_from, now)):
            last = [record for record in self._backlog if self._last_delivery(record.handle)]
            if last:
                self._backlog = collections.deque(
                    record for record in self._backlog if not self._last_delivery(record.handle)
                )
                why = "record lock: no model time left" if self._taking else "stopping"
                _log.info("last_deliveries_answered", count=len(last), reason=why)
                for record in last:
                    record.answer_now = "overloaded"
                    self._loop.take(record)
        answer_by = self._budget.answer_by(batch.lock_from)
        if self._stop_answer_at is not None:
            answer_by = min(answer_by, self._stop_answer_at)
        if now >= answer_by:
            due = [
                work
                for work, message in self._unsettled.items()
                if work not in self._answered_now and self._last_delivery(message)
            ]
            if due:
                self._answered_now.update(due)
                self._loop.answer_now(due, "overloaded")

    def _close_batch(self, now: float) -> None:
        """Every record of the batch is settled: the acknowledgements go out, and the next poll may ask for
        another size."""
        batch = self._batch
        assert batch is not None
        self._batch = None
        self._answered_now.clear()
        self._send(now)
        if batch.first_take is None or batch.last_outcome is None:
            return
        wanted = self._fetch.wanted(batch.to_model, batch.last_outcome - batch.first_take)
        if self._fetch.moves(wanted) and now - self._last_refetch >= _REFETCH_EVERY_S:
            self._refetch(wanted, now)

    def _send(self, now: float) -> None:
        """Send the acknowledgements made so far (records still at work stay acquired)."""
        self._unsent, self._last_sent = 0, now
        try:
            self._consumer.commit_async()
        except confluent_kafka.KafkaException as problem:
            _log.warning(
                "acknowledgements_not_sent", reason=str(problem), effect="sent with the next commit or poll"
            )

    def _refetch(self, size: int, now: float) -> None:
        """A new consumer asking for `size` records a poll (the old one holds no records: its batch is
        settled and acknowledged)."""
        _log.info("fetch_size_changed", previous=self._fetch.current, size=size)
        try:
            self._consumer.commit_sync(_LAST_COMMIT_S)
        except confluent_kafka.KafkaException as problem:
            _log.warning("acknowledgements_not_sent", reason=str(problem), effect="records redelivered")
        self._consumer.close()
        self._fetch.current = self._counts.fetch_size = size
        self._consumer = self._make_consumer(self._on_consumer_error, size)
        self._consumer.subscribe([self._topic])
        self._last_refetch = now

    def _release_all(self, why: str) -> None:
        """Every record of the batch at hand goes back to the group: the taken ones without an outcome (the
        loop gives them up: their later answers and reports change nothing) and the backlog."""
        if self._unsettled:
            assert self._loop is not None
            unfinished = list(self._unsettled)
            self._loop.abandon(unfinished, why)
            for work in unfinished:
                self.acknowledge(work, Acknowledgement.RELEASE)
        if self._backlog:
            self._release_backlog(why)

    def _release_backlog(self, why: str) -> None:
        records = list(self._backlog)
        self._backlog.clear()
        self._release_records(records, why)

    def _release_records(self, records: Sequence[Record], why: str) -> None:
        """Records never taken go back to the group: another member, or this one's next poll, takes them."""
        for record in records:
            self._consumer.acknowledge(record.handle, Acknowledgement.RELEASE.value)
        self._unsent += len(records)
        self._counts.released += len(records)
        self._counts.released_untried += len(records)
        if self._batch is not None:
            self._batch.last_outcome = self._clock()
        _log.info("records_released", count=len(records), reason=why)

    def _last_delivery(self, message: confluent_kafka.Message) -> bool:
        return int(message.delivery_count() or 1) >= self._group.delivery_count_limit

    def _on_consumer_error(self, error: confluent_kafka.KafkaError) -> None:
        if error.code() == _UNSUPPORTED_VERSION:
            self._no_share_groups = True
        else:
            self._failure.client_error(error)


def _record(message: confluent_kafka.Message) -> Record:
    """A polled message as the loop's record, the message as its handle (to acknowledge it by)."""
    topic, partition, offset = message.topic(), message.partition(), message.offset()
    assert topic is not None and partition is not None and offset is not None  # `_read` kept only such
    return Record(topic, partition, offset, message.key(), message.value(), record_headers(message), message)
