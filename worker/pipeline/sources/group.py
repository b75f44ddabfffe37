"""Group mode's source: a consumer group's assigned partitions, read one record per poll.

- **Ownership and order.** Each assigned partition has its offset state (`offsets.PartitionOffsets`, shared
  with the delivery guarantee, which commits its finished prefix). A record of a partition not owned any
  more, or one read again after a seek, is skipped.
- **One record per poll**, never a `consume()` batch: rebalance callbacks run inside a poll and may seek a
  partition back (an exactly-once redo) or give it a fresh offset state (assign after lost), and librdkafka
  drops the records fetched before that only while they are still queued. A batch can hand back records it
  dequeued before the callback ran; the first of them would start the partition's new state at a later
  offset than the seek, and the records in between, fetched again, would be skipped as re-deliveries while
  the next commit passed them: tickets committed with no output (issue #25,
  tests/pipeline/test_pipeline_memory.py).
- **Start positions** the worker looked up itself (`worker/kafka/starts.py`); a partition whose committed
  offset is not known yet stays paused.
- **Holding back** a record the Schema Registry cannot answer for: its partition is paused and sought back to
  it, and nothing at or after it is tracked, so the commit position never passes it; `resume` lets the
  partition fetch it again.
- **Rebalances** (cooperative-sticky by default): an assignment is applied in the callback with each
  partition's start and pause state; a revoke asks the loop to drain the partitions (`Loop.revoking`, at most
  `revoke_timeout_ms`, and half of `max.poll.interval.ms`) before the callback returns; a loss gives them up.
- **Pausing** for the in-flight bound and at shutdown, and keeping a partition whose delivery failed for good
  paused until a restart or rebalance (`blocked`).
- **Staying out of the group** although the broker answers ends the run (`RejoinWatch`): librdkafka can stop
  looking for its group coordinator after an outage longer than the session timeout, and nothing the
  consumer's API offers starts it again.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable
from typing import Any

import confluent_kafka
import structlog

from worker.kafka import errors
from worker.kafka.clients import incremental_assignment, partitions_of, record_headers
from worker.kafka.commits import TopicPartitionKey
from worker.kafka.starts import StartPositions
from worker.pipeline.failure import Failure, names
from worker.pipeline.metrics import PipelineMetrics
from worker.pipeline.seams import HandBack, Loop, Record
from worker.pipeline.settlements.offsets import OffsetTracker
from worker.pipeline.work import Work

_log = structlog.get_logger("worker.pipeline")

# librdkafka's default max.poll.interval.ms and session.timeout.ms.
_LIBRDKAFKA_MAX_POLL_MS = 300000
_LIBRDKAFKA_SESSION_MS = 45000
# How long a consumer may stay out of its group while the broker answers it: four session timeouts, and at
# least two minutes. After an outage longer than the session timeout it rejoins within seconds (6.3-8.6 s
# after the local broker was ready again, in 28 tries with a 6 s session timeout); the floor leaves room for
# a group coordinator still loading its partitions on a loaded broker (seen for a minute in chaos runs).
_REJOIN_SESSIONS = 4
_REJOIN_AT_LEAST_S = 120.0
# The longest a check that the broker answers holds the loop; made only while out of the group.
_ANSWER_TIMEOUT_S = 1.0


class PausedPartitions:
    """The partitions this worker paused: for the bound (all), at shutdown (all), held back, or because a
    record of theirs failed for good (`blocked`, kept paused until a restart or rebalance)."""

    def __init__(self, consumer: confluent_kafka.Consumer) -> None:
        self._consumer = consumer
        self.keys: set[TopicPartitionKey] = set()

    def pause(self, keys: Iterable[TopicPartitionKey]) -> None:
        fresh = [key for key in keys if key not in self.keys]
        if fresh:
            self._consumer.pause(partitions_of(fresh))
            self.keys.update(fresh)

    def resume_all_but(self, blocked: Collection[TopicPartitionKey]) -> None:
        resumed = [key for key in self.keys if key not in blocked]
        if resumed:
            self._consumer.resume(partitions_of(resumed))
            self.keys.difference_update(resumed)

    def forget(self, keys: Iterable[TopicPartitionKey]) -> None:
        """No longer owned (revoked, lost) or assigned afresh (resumed explicitly by the caller)."""
        self.keys.difference_update(keys)


class RejoinWatch:
    """Ends the run (`Failure`, exit 1) when the consumer has had no member id for `_REJOIN_SESSIONS` session
    timeouts (at least `_REJOIN_AT_LEAST_S`) during which the broker answered its metadata requests, so that
    the worker's supervisor restarts it and a fresh consumer joins the group.

    Why not a rejoin in process: after a broker outage longer than the session timeout, librdkafka 2.16 was
    seen (once, under load) never to send a JoinGroup again while the loop turned and liveness held. Its group
    state machine has a state that only a FindCoordinator answer leaves (wait-coord), and an answer can be
    dropped when the broker it was sent to is decommissioned at that moment, which librdkafka does to its
    bootstrap broker when the broker comes back (see also librdkafka #5456, #5511). Re-subscribing,
    committing or fetching committed offsets do not leave that state; only a new consumer does. Out of the
    group nothing is assigned, so nothing is lost: the next member starts from the committed offsets. While
    the broker is away it does not answer and nothing is counted."""

    def __init__(
        self, consumer: confluent_kafka.Consumer, topic: str, session_timeout_s: float, failure: Failure
    ) -> None:
        self._consumer, self._topic, self._failure = consumer, topic, failure
        self._session_timeout_s = session_timeout_s
        self._bound_s = max(_REJOIN_AT_LEAST_S, _REJOIN_SESSIONS * session_timeout_s)
        # While out of the group: when the broker was last asked, and since when it has answered every time.
        self._asked_at: float | None = None
        self._answering_since: float | None = None

    def check(self, now: float) -> None:
        """At most one metadata request per session timeout, and only while the consumer has no member id."""
        if self._consumer.memberid():
            self._asked_at = self._answering_since = None
            return
        if self._asked_at is not None and now - self._asked_at < self._session_timeout_s:
            return
        self._asked_at = now
        if not self._broker_answers():
            self._answering_since = None
        elif self._answering_since is None:
            self._answering_since = now
        elif (waited := now - self._answering_since) >= self._bound_s:
            self._answering_since = None
            _log.error(
                "group_rejoin_forced",
                out_of_group_s=round(waited),
                reason="no member id although the broker answers: librdkafka stopped rejoining the group",
                effect="the run ends (exit 1); a restart joins the group afresh, nothing was assigned",
            )
            self._failure.set(f"out of the consumer group for {waited:.0f}s while the broker answered")

    def _broker_answers(self) -> bool:
        try:
            self._consumer.list_topics(self._topic, timeout=_ANSWER_TIMEOUT_S)
        except confluent_kafka.KafkaException:
            return False
        return True


class GroupSource:
    """A consumer group's partitions (see the module docstring). `consumer` is shared with the guarantee
    (commits, seeks on a redo); so are `tracker` and `paused`."""

    def __init__(
        self,
        consumer: confluent_kafka.Consumer,
        consumer_options: dict[str, str],
        topic: str,
        group: str,
        revoke_timeout_s: float,
        tracker: OffsetTracker,
        paused: PausedPartitions,
        metrics: PipelineMetrics,
        failure: Failure,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._consumer = consumer
        self._topic, self._group = topic, group
        self._cooperative = incremental_assignment(consumer_options)
        # The revoke callback runs inside a poll: draining must end well before the group's poll deadline.
        max_poll_s = int(consumer_options.get("max.poll.interval.ms", _LIBRDKAFKA_MAX_POLL_MS)) / 1000.0
        self._revoke_drain_s = min(revoke_timeout_s, max_poll_s / 2)
        self._tracker = tracker
        self._paused = paused
        self._metrics = metrics
        self._failure = failure
        self._clock = clock
        self._starts = StartPositions(consumer, consumer_options["auto.offset.reset"], clock)
        session_ms = int(consumer_options.get("session.timeout.ms", _LIBRDKAFKA_SESSION_MS))
        self._rejoin_watch = RejoinWatch(consumer, topic, session_ms / 1000.0, failure)
        # Partitions held back at a record the Schema Registry could not answer for.
        self._held: set[TopicPartitionKey] = set()
        self._loop: Loop | None = None
        self._pausing_all = False

    # -- seams.Source ---------------------------------------------------------------------------------------

    def open(self, loop: Loop) -> None:
        self._loop = loop
        self._consumer.subscribe(
            [self._topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
        )

    def may_take(self) -> bool:
        return True  # paused partitions make a poll serve callbacks only, which keeps the member alive

    def read(self, room: int, wait_s: float, take: Callable[[Record], None]) -> None:
        """Up to `room` polls, waiting up to `wait_s` for the first, each record taken before the next poll
        (see the module docstring). With every partition paused a poll only serves callbacks."""
        polled = 0
        message = self._consumer.poll(wait_s)
        while message is not None:
            polled += 1
            if (record := self._record(message)) is not None:
                take(record)
            message = self._consumer.poll(0.0) if polled < room else None

    def work(self, record: Record, now: float, deadline: float) -> Work | None:
        state = self._tracker.get(record.partition_key)
        if state is None or record.partition_key in self._held:
            return None
        if not state.track(record.offset):
            # Never expected: the partition's state starts where its fetch does (see the module docstring).
            self._metrics.redelivered += 1
            _log.warning(
                "record_skipped", topic=record.topic, partition=record.partition, offset=record.offset
            )
            return None
        return record.taken(state, now, deadline)

    def hold_back(self, record: Record) -> bool:
        """Pause the partition and seek it back to `record`; a seek that fails stops the run (going on would
        skip the record; a restart re-reads it from the committed offset)."""
        key = record.partition_key
        self._held.add(key)
        self._paused.pause([key])
        try:
            self._consumer.seek(confluent_kafka.TopicPartition(key[0], key[1], record.offset))
        except confluent_kafka.KafkaException as problem:
            _log.error(
                "schema_registry_seek_failed",
                partition=names([key])[0],
                offset=record.offset,
                reason=errors.describe(problem),
            )
            self._failure.set(f"cannot seek {key[0]}[{key[1]}] back to {record.offset}")
        return True

    def resume(self, key: TopicPartitionKey) -> None:
        self._held.discard(key)

    def hand_back(self, work: Work) -> HandBack:
        return HandBack.ANSWER  # a record belongs to its partition: no other member reads it out of order

    def maintain(self, now: float) -> None:
        self._starts.resolve()
        self._rejoin_watch.check(now)
        if self._pausing_all:
            self._paused.pause(state.key for state in self._tracker)
        else:
            self._paused.resume_all_but(self._tracker.blocked().keys() | self._starts.held | self._held)
        self._metrics.turned(now, self._consumer, self._tracker, self._paused.keys)

    def pause_all(self) -> None:
        self._pausing_all = True
        self._paused.pause(state.key for state in self._tracker)

    def resume_all(self) -> None:
        self._pausing_all = False

    def in_flight(self) -> int:
        return len(self._tracker)

    @property
    def exhausted(self) -> bool:
        return False

    @property
    def rebalances(self) -> bool:
        return True

    def stop_taking(self) -> None:
        self.pause_all()

    def poll_while_stopping(self) -> None:
        self._consumer.poll(0.0)  # paused: serves callbacks; a record is left to the next owner

    def stop(self, limit: float) -> None:
        self._consumer.close()

    def described(self) -> dict[str, object]:
        return {"consume": "group", "input": self._topic, "group": self._group}

    def logged(self) -> dict[str, object]:
        blocked = self._tracker.blocked()
        return {"blocked_partitions": {f"{t}[{p}]": offset for (t, p), offset in sorted(blocked.items())}}

    # -- reading --------------------------------------------------------------------------------------------

    def _record(self, message: confluent_kafka.Message) -> Record | None:
        """The record of a polled message, or None: an error (logged, or the run's failure), a record of a
        partition not owned, held back or taken already."""
        error = message.error()
        if error is not None:
            if error.code() == confluent_kafka.KafkaError._MAX_POLL_EXCEEDED:
                self._metrics.max_poll_exceeded += 1
                _log.error("max_poll_interval_exceeded", reason=error.str())
            elif errors.consumer_fatal(error):
                self._failure.client_error(error)
            else:
                _log.warning("consumer_error", code=error.name(), reason=error.str())
            return None
        topic, partition, offset = message.topic(), message.partition(), message.offset()
        if topic is None or partition is None or offset is None:
            return None
        state = self._tracker.get((topic, partition))
        if state is None:
            return None  # not owned (fetched for a partition revoked since): its owner reads it
        if (topic, partition) in self._held:
            return None  # fetched before its partition was held and sought back: it is read again
        if not state.is_new(offset):
            self._metrics.redelivered += 1
            _log.warning("record_skipped", topic=topic, partition=partition, offset=offset)
            return None
        return Record(topic, partition, offset, message.key(), message.value(), record_headers(message))

    # -- rebalance ------------------------------------------------------------------------------------------

    def _on_assign(self, consumer: confluent_kafka.Consumer, partitions: list[Any]) -> None:
        assert self._loop is not None
        keys = [(tp.topic, tp.partition) for tp in partitions]
        for key in keys:
            self._tracker.assign(key)
        self._paused.forget(keys)
        self._held.difference_update(keys)
        self._loop.assigned(keys)
        _log.info("partitions_assigned", partitions=names(keys))
        if not partitions:
            return
        # Assign here rather than after the callback, each partition with its start, so that its pause
        # state is set before the first fetch: librdkafka keeps a partition paused across unassign/assign
        # (seen after a lost assignment), so one that comes back is resumed explicitly unless the loop
        # wants it paused or its start is not known yet (held).
        starts = self._starts.assignment(partitions)
        if self._cooperative:
            consumer.incremental_assign(starts)
        else:
            consumer.assign(starts)
        held = [key for key in keys if key in self._starts.held]
        if self._loop.holding_back:
            self._paused.pause(keys)
        else:
            self._paused.pause(held)
            if resumed := [tp for tp in partitions if (tp.topic, tp.partition) not in self._starts.held]:
                consumer.resume(resumed)

    def _on_revoke(self, _consumer: confluent_kafka.Consumer, partitions: list[Any]) -> None:
        assert self._loop is not None
        keys = {(tp.topic, tp.partition) for tp in partitions}
        if not keys:
            return
        started = self._clock()
        left = self._loop.revoking(keys, self._revoke_drain_s)
        self._forget(keys)
        _log.info(
            "partitions_revoked",
            partitions=names(keys),
            drained_ms=round((self._clock() - started) * 1000.0),
            unfinished=left,
        )

    def _on_lost(self, _consumer: confluent_kafka.Consumer, partitions: list[Any]) -> None:
        assert self._loop is not None
        keys = {(tp.topic, tp.partition) for tp in partitions}
        self._loop.lost(keys)
        self._forget(keys)
        _log.warning(
            "partitions_lost", partitions=names(keys), effect="not committed; the new owner redoes them"
        )

    def _forget(self, keys: set[TopicPartitionKey]) -> None:
        """After a revoke or a loss: nothing of `keys` is tracked, paused or held any more."""
        self._tracker.revoke(keys)
        self._paused.forget(keys)
        self._starts.forget(keys)
        self._held.difference_update(keys)
