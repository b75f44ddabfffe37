"""Replay's source: the planned ranges of the dead-letter topic, read once, each partition to its end.

- **Planned at start** (`open`, after the settlement started: an exactly-once run has fenced an earlier one
  and aborted the transaction it left open, so the group's committed positions are stable): each partition
  from the group's committed position (or the selection's start) to the end offset it has now
  (`selection.plan_partitions`); the partitions are assigned at their start, not subscribed: no group
  membership, no rebalance.
- **Finite**: a partition is read until its end offset, its end-of-partition event, or its first record
  dead-lettered after `--until` (left for a later run); the run ends once every partition is read
  (`exhausted`) and every record it waits for has its outcome. Dead letters that arrive meanwhile wait for
  the next run.
- **Paced** by `--rate` (`TokenBucket`, from the start of the reading): a record is read only while a token is
  there; the stage spends one on each record it republishes (`republished`), so records passed over cost
  none. A dry run publishes nothing, and is not paced.
- **In flight** are the records taken whose outcome the run still waits for; the stage and its reports say
  when the run is done with one (`done_with`): its outcome is final, or it is left unsettled on purpose, for
  a later run (the commit position then stays before it). A partition the run gives up (`stop_reading`,
  `pause`), or all of them (`end`: `--limit` reached), is read no more; an exactly-once redo reads every
  partition again from its last commit (`read_again`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import confluent_kafka
from confluent_kafka import KafkaError, TopicPartition

from worker.errors import UserError
from worker.kafka.clients import record_headers
from worker.kafka.commits import TopicPartitionKey
from worker.pipeline.seams import Loop, Record
from worker.pipeline.settlements.offsets import OffsetTracker
from worker.pipeline.sources.without_group import WithoutGroup
from worker.pipeline.work import Work
from worker.replay.outcomes import PartitionPlan
from worker.replay.selection import ReplayOptions, plan_partitions


class TokenBucket:
    """Rate limit: ``rate`` tokens per second, bursts of at most ``burst`` (a tenth of a second's worth).

    A small burst keeps the long-run rate exact while letting the replay catch up after short stalls
    (a slow poll, a commit), so the rate holds within a few percent over any run of a few seconds.
    """

    def __init__(self, rate: float, now: float) -> None:
        self._rate = rate
        self._burst = max(1.0, rate / 10)
        self._tokens = 1.0
        self._stamp = now

    def ready(self, now: float) -> bool:
        """Whether a token is there at `now` (none is taken)."""
        self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now
        return self._tokens >= 1.0

    def take(self) -> None:
        """Spend the token `ready` found."""
        self._tokens -= 1.0


class ReplaySource(WithoutGroup):
    """The dead-letter ranges `options` select (see the module docstring). `consumer` is the replay's own
    (assigned here, committed through by the guarantee); `tracker` is shared with the guarantee; `planned`
    hears of the plan before anything is read. Outside any group (`WithoutGroup`): partitions assigned, a dead
    letter's headers need no registry, no model answers it."""

    def __init__(
        self,
        consumer: confluent_kafka.Consumer,
        options: ReplayOptions,
        tracker: OffsetTracker,
        planned: Callable[[list[PartitionPlan]], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._consumer = consumer
        self._options = options
        self._topic = options.dlq_topic
        self._until_ms = int(options.until.timestamp() * 1000) if options.until is not None else None
        self._tracker = tracker
        self._planned = planned
        self._clock = clock
        self._rate = None if options.dry_run else options.rate
        self._bucket: TokenBucket | None = None
        self._loop: Loop | None = None
        self._starts: dict[int, int] = {}
        self._ends: dict[int, int] = {}
        # Partitions left to read.
        self._active: set[int] = set()
        # Records taken whose outcome the run still waits for: what is in flight.
        self._awaited: set[Work] = set()

    # -- seams.Source ---------------------------------------------------------------------------------------

    def open(self, loop: Loop) -> None:
        self._loop = loop
        plan = plan_partitions(self._consumer, self._options)
        self._planned(plan)
        for item in plan:
            self._tracker.assign((self._topic, item.partition))
            self._starts[item.partition] = item.start
            self._ends[item.partition] = item.end
            if item.start < item.end:
                self._active.add(item.partition)
        if self._active:
            self._consumer.assign(
                [TopicPartition(self._topic, p, self._starts[p]) for p in sorted(self._active)]
            )
        if self._rate is not None:
            self._bucket = TokenBucket(self._rate, self._clock())

    def may_take(self) -> bool:
        """Partitions are left to read, the loop wants records (not at its bound, not stopping), and the rate
        allows one more."""
        assert self._loop is not None  # opened
        if not self._active or self._loop.holding_back:
            return False
        return self._bucket is None or self._bucket.ready(self._clock())

    def read(self, room: int, wait_s: float, take: Callable[[Record], None]) -> None:
        for count in range(room):
            if count and not self.may_take():
                return
            message = self._consumer.poll(wait_s if count == 0 else 0.0)
            if message is None:
                return
            if (record := self._record(message)) is not None:
                take(record)

    def work(self, record: Record, now: float, deadline: float) -> Work | None:
        state = self._tracker.get(record.partition_key)
        if state is None or not state.track(record.offset):
            return None
        work = record.taken(state, now, deadline)
        self._awaited.add(work)
        return work

    def in_flight(self) -> int:
        return len(self._awaited)

    @property
    def exhausted(self) -> bool:
        return not self._active

    def stop_taking(self) -> None:
        pass  # `may_take` asks the loop, which says it stops

    def stop(self, limit: float) -> None:
        self._consumer.close()

    def described(self) -> dict[str, object]:
        return {"input": self._topic, "group": self._options.group}

    # -- what the stage and its reports tell it ------------------------------------------------------------

    def republished(self) -> None:
        """A record taken is republished: it spends a token of `--rate`."""
        if self._bucket is not None:
            self._bucket.take()

    def done_with(self, work: Work) -> None:
        """The run waits for `work` no more: its outcome is final, or it is left for a later run."""
        self._awaited.discard(work)

    def stop_reading(self, partition: int) -> None:
        """Read no more of `partition` in this run (unless a redo reads it again)."""
        self._active.discard(partition)

    def pause(self, keys: Sequence[TopicPartitionKey]) -> None:
        """The guarantee stopped these partitions for good: nothing more of them is fetched or read."""
        self._consumer.pause([TopicPartition(topic, partition) for topic, partition in keys])
        for _, partition in keys:
            self.stop_reading(partition)

    def end(self) -> None:
        """Read nothing more in this run (`--limit` is reached), unless a redo reads again."""
        self._active.clear()

    def read_again(self, committed: dict[int, int]) -> None:
        """An exactly-once redo sought every partition back to its last commit (`committed`: the positions
        confirmed so far): what was taken since is read, and settled, again."""
        self._awaited.clear()
        self._active = {p for p, end in self._ends.items() if committed.get(p, self._starts[p]) < end}

    # -- reading --------------------------------------------------------------------------------------------

    def _record(self, message: confluent_kafka.Message) -> Record | None:
        """The record of a polled message, or None: an event (a partition's end), a passing error, a record of
        a partition read to its end, or one past it (its end offset, `--until`), which ends its partition."""
        error = message.error()
        partition = message.partition()
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                if partition is not None:
                    self._active.discard(partition)
                return None
            if error.fatal():
                raise UserError(f"Kafka: consumer failed: {error.str()}")
            return None  # Transient; librdkafka retries by itself.
        offset = message.offset()
        if partition is None or offset is None or partition not in self._active:
            return None
        if offset >= self._ends[partition] or (
            self._until_ms is not None and message.timestamp()[1] > self._until_ms
        ):
            self._active.discard(partition)
            return None
        return Record(self._topic, partition, offset, message.key(), message.value(), record_headers(message))
