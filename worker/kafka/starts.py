"""Where each newly assigned partition starts: the group's committed offset, looked up by the worker itself.

librdkafka looks up a new partition's committed offset by itself unless it is told where to start, and one
of its paths starts the partition from `auto.offset.reset` although the group has a committed offset: while
a transaction that holds offsets of the group is still open (an exactly-once worker killed between
`send_offsets_to_transaction` and its commit), the broker answers UNSTABLE_OFFSET_COMMIT and librdkafka
retries; when the assignment changes meanwhile (another rebalance) or the coordinator connection goes down,
the answer is dropped and the partition is started with no offset, so `earliest` re-reads committed work
(exactly-once chaos, seed 29: 8,478 duplicates) and `latest` skips unread tickets. Seen in librdkafka 2.16
(`rd_kafka_assignment_apply_offsets`: the UNSTABLE partition goes back to the pending list with the offset
the broker answered, -1, where a stale-epoch one is reset to "stored"); reproduced with bare clients in
`tests/kafka/test_start_positions.py`.

So the worker never lets librdkafka pick: every partition is assigned with an explicit start.

- `assignment(partitions)` (in the assign callback): one lookup of the committed offsets (librdkafka's
  `committed()` waits for stable offsets). Found: start there; none committed: `auto.offset.reset`'s
  logical offset. Not answered in time (a transaction holds them, the coordinator is away): the partition
  is assigned at its end as a placeholder and *held*: the caller keeps it paused, nothing is read from it.
- `resolve()` (every turn of the loop): for held partitions, another short lookup now and then; once
  answered, the partition is sought to its committed offset and released (the caller resumes it).
- `forget(keys)`: revoked or lost partitions are no longer held.

A hold that outlasts every live transaction is a *hanging* one: the broker keeps offsets of a transaction
its coordinator no longer knows (seen on Kafka 4.4.0 after a broker restart in exactly-once chaos, seed 53:
three partitions held for 27 minutes, until `kafka-transactions.sh abort` ended it; they then went on at
once, nothing lost or written twice). Only an operator can end it, so after `HANGING_AFTER_S` the worker
says so, with how.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import confluent_kafka
import structlog

from worker.kafka import errors
from worker.kafka.commits import TopicPartitionKey

_log = structlog.get_logger("worker.kafka")

# The lookup in the assign callback: answered in one round trip unless a transaction holds the offsets.
ASSIGN_LOOKUP_S = 1.0
# A held partition's next lookups: short, and not on every turn of the loop.
RETRY_LOOKUP_S = 0.2
RETRY_EVERY_S = 0.5
# A worker's transaction ends within its transaction.timeout.ms (10 s unless configured) after its producer
# dies; held six times that long, the partitions wait for a transaction nobody will end. Said again every
# `HANGING_REPEAT_S` while it lasts.
HANGING_AFTER_S = 60.0
HANGING_REPEAT_S = 600.0
HANGING_REMEDY = (
    "an open transaction holds the group's committed offsets of these partitions; if no producer of the "
    "group is in a transaction this long, it is hanging: find it with `kafka-transactions.sh "
    "--bootstrap-server <broker> find-hanging --broker-id <id>` and end it with its `abort` "
    "(docs/operations.md#a-hanging-transaction)"
)
# librdkafka's names for auto.offset.reset, and where each starts a partition the group never committed.
_NO_COMMIT_START = {
    "smallest": confluent_kafka.OFFSET_BEGINNING,
    "earliest": confluent_kafka.OFFSET_BEGINNING,
    "beginning": confluent_kafka.OFFSET_BEGINNING,
    "largest": confluent_kafka.OFFSET_END,
    "latest": confluent_kafka.OFFSET_END,
    "end": confluent_kafka.OFFSET_END,
}


class StartPositions:
    """Explicit start offsets for a group consumer's assignments (see the module docstring)."""

    def __init__(
        self,
        consumer: Any,
        auto_offset_reset: str,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._consumer = consumer
        # "error" (or anything librdkafka knows and we do not): let librdkafka look it up and raise.
        reset = auto_offset_reset.strip().lower()
        self._no_commit = _NO_COMMIT_START.get(reset, confluent_kafka.OFFSET_STORED)
        self._clock = clock
        self.held: set[TopicPartitionKey] = set()
        self._next_try = 0.0
        self._held_since = 0.0  # when `held` last stopped being empty
        self._next_warning = 0.0

    def assignment(self, partitions: Sequence[Any]) -> list[confluent_kafka.TopicPartition]:
        """`partitions` with their start offsets, for `incremental_assign`/`assign`; those whose committed
        offset is not known yet are placed at their end and added to `held`."""
        keys = [(tp.topic, tp.partition) for tp in partitions]
        none_held_before = not self.held
        found = self._lookup(keys, ASSIGN_LOOKUP_S)
        starts = []
        for key in keys:
            if key in found:
                starts.append(confluent_kafka.TopicPartition(*key, found[key]))
            else:
                self.held.add(key)
                starts.append(confluent_kafka.TopicPartition(*key, confluent_kafka.OFFSET_END))
        if self.held:
            if none_held_before:
                self._held_since = self._clock()
                self._next_warning = self._held_since + HANGING_AFTER_S
            self._next_try = self._clock() + RETRY_EVERY_S
            _log.info("partitions_held", partitions=_names(self.held), reason="committed offsets unknown yet")
        return starts

    def resolve(self) -> list[TopicPartitionKey]:
        """Seek the held partitions whose committed offsets are known now; returns those released."""
        if not self.held or self._clock() < self._next_try:
            return []
        self._next_try = self._clock() + RETRY_EVERY_S
        released = []
        for key, start in self._lookup(sorted(self.held), RETRY_LOOKUP_S).items():
            try:
                self._consumer.seek(confluent_kafka.TopicPartition(*key, start))
            except confluent_kafka.KafkaException as problem:
                # _STATE: librdkafka has not started the partition's fetcher yet; the next round seeks it.
                _log.debug("held_seek_retried", partition=_names([key]), reason=errors.describe(problem))
                continue
            self.held.discard(key)
            released.append(key)
        if released:
            _log.info("partitions_released", partitions=_names(released))
        elif self.held and self._clock() >= self._next_warning:
            self._next_warning = self._clock() + HANGING_REPEAT_S
            _log.warning(
                "partitions_held_long",
                partitions=_names(self.held),
                held_s=round(self._clock() - self._held_since),
                reason=HANGING_REMEDY,
            )
        return released

    def forget(self, keys: Iterable[TopicPartitionKey]) -> None:
        self.held.difference_update(keys)

    def _lookup(self, keys: Sequence[TopicPartitionKey], timeout_s: float) -> dict[TopicPartitionKey, int]:
        """Start offsets of `keys` the group coordinator answered (stable offsets only) in `timeout_s`."""
        if not keys:
            return {}
        try:
            answered = self._consumer.committed(
                [confluent_kafka.TopicPartition(*key) for key in keys], timeout=timeout_s
            )
        except confluent_kafka.KafkaException as problem:
            _log.debug("committed_offsets_not_answered", reason=errors.describe(problem))
            return {}
        return {
            (tp.topic, tp.partition): tp.offset if tp.offset >= 0 else self._no_commit
            for tp in answered
            if tp.error is None
        }


def _names(keys: Iterable[TopicPartitionKey]) -> list[str]:
    return [f"{topic}[{partition}]" for topic, partition in sorted(keys)]
