"""A hanging transaction seen from the worker: a partition whose last stable offset (LSO) stays behind its
high watermark longer than any live transaction may stay open.

A transaction left open on a partition holds back every read_committed reader of it at its first offset
until the transaction ends; when the transaction coordinator has lost it (issue 56: Kafka 4.4 left one on
the output partitions and on `__consumer_offsets` while its coordinator listed none ongoing), nothing ever
ends it and the broker's own timeout does not apply. librdkafka offers no describe-producers or
abort-transaction call (KIP-664), so the worker can only see the symptom and say where it is;
`triage-worker broker transactions` lists and aborts it with Kafka's own Java tool.

`HangDetector` is the rule, on readings it is given (tested on generated ones); `TransactionWatch` is the
thread that takes the readings in an exactly-once worker, every `WATCH_INTERVAL_S`:
- the output and dead-letter topics, every partition: LSO (what a read_committed consumer's end offset
  query answers) against the high watermark (a read_uncommitted query), from two consumers of its own that
  join no group;
- the input partitions this worker is assigned (`PartitionGauges.assigned`): the same, for an upstream
  transactional producer. A partition held at its start by a pending transactional offset commit on
  `__consumer_offsets` is `partitions_held_long`'s (worker/kafka/starts.py): a rule here on the position
  being unknown named 16 partitions in the cluster chaos runs that were only slow to start (no hang).

A partition is suspected once the condition has held for `suspect_after_s`: twice `transaction.timeout.ms`
plus `SWEEP_MARGIN_S`, since a transaction whose producer died legitimately holds the LSO until the broker's
timeout abort (its timeout, found by a sweep every 10 s by default). With the worker's 10 s timeout that is
30 s, said within `WATCH_INTERVAL_S` more: under a minute. It logs `hanging_transaction_suspected` once per
partition (and `hanging_transaction_cleared` when it ends) and sets
`triage_hanging_transaction_suspected{topic,partition}`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import confluent_kafka
import structlog

from worker.kafka.clients import ClientErrorLog
from worker.kafka.commits import TopicPartitionKey
from worker.pipeline.metrics import PipelineMetrics

_log = structlog.get_logger("worker.pipeline.hanging")

WATCH_INTERVAL_S = 5.0
# The broker's abort sweep (transaction.abort.timed.out.transaction.cleanup.interval.ms, 10 s by default)
# and time for the markers to be written.
SWEEP_MARGIN_S = 10.0
_QUERY_TIMEOUT_S = 5.0
_METADATA_EVERY_S = 60.0

STABLE_OFFSET_STUCK = "stable_offset_stuck"


def suspect_after_s(transaction_timeout_ms: int) -> float:
    """How long a partition may look held before it is a suspected hang (see the module)."""
    return 2 * transaction_timeout_ms / 1000.0 + SWEEP_MARGIN_S


@dataclass(frozen=True)
class Reading:
    """One partition at one moment: its last stable offset and high watermark (None when the query
    failed)."""

    stable: int | None
    high: int | None


@dataclass(frozen=True)
class Suspect:
    """A partition held back for `held_s` (since `since`, monotonic seconds), and why (`reason`)."""

    key: TopicPartitionKey
    reason: str
    since: float
    held_s: float
    stable: int | None
    high: int | None


@dataclass
class HangDetector:
    """Which partitions have looked held for at least `suspect_after_s`: `observe` takes each round of
    readings and says which partitions became suspects and which stopped being ones."""

    suspect_after_s: float
    # key → (reason, stable offset the hold started at, monotonic time it started)
    _held: dict[TopicPartitionKey, tuple[str, int | None, float]] = field(default_factory=dict)
    # key → the start of the hold it is suspected for
    _suspected: dict[TopicPartitionKey, float] = field(default_factory=dict)

    @property
    def suspected(self) -> frozenset[TopicPartitionKey]:
        return frozenset(self._suspected)

    def observe(
        self, now: float, readings: Mapping[TopicPartitionKey, Reading]
    ) -> tuple[list[Suspect], list[TopicPartitionKey]]:
        """One round: (partitions suspected from now on, partitions no longer suspected). A partition left
        out of `readings` (revoked) is no longer watched; one whose stable offset moved is held anew, if
        at all (the transaction that held it ended)."""
        held: dict[TopicPartitionKey, tuple[str, int | None, float]] = {}
        for key, reading in readings.items():
            reason = _held_reason(reading)
            if reason is None:
                continue
            before = self._held.get(key)
            same = before is not None and before[:2] == (reason, reading.stable)
            held[key] = before if same and before is not None else (reason, reading.stable, now)
        self._held = held
        cleared = sorted(
            key for key, since in self._suspected.items() if held.get(key, ("", 0, -1.0))[2] != since
        )
        for key in cleared:
            del self._suspected[key]
        new: list[Suspect] = []
        for key, (reason, stable, since) in sorted(held.items()):
            if key not in self._suspected and now - since >= self.suspect_after_s:
                self._suspected[key] = since
                new.append(Suspect(key, reason, since, now - since, stable, readings[key].high))
        return new, cleared


def _held_reason(reading: Reading) -> str | None:
    """Why this reading shows a held partition, or None."""
    if reading.stable is not None and reading.high is not None and reading.stable < reading.high:
        return STABLE_OFFSET_STUCK
    return None


class TransactionWatch:
    """The thread that feeds `HangDetector` in an exactly-once worker (see the module); `close` stops it."""

    def __init__(
        self,
        consumer_options: Mapping[str, str],
        input_topic: str,
        written_topics: Iterable[str],
        metrics: PipelineMetrics,
        transaction_timeout_ms: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._input = input_topic
        self._written = list(dict.fromkeys(written_topics))
        self._metrics = metrics
        self._clock = clock
        self.detector = HangDetector(suspect_after_s(transaction_timeout_ms))
        self._committed = self._reader(consumer_options, "read_committed")
        self._uncommitted = self._reader(consumer_options, "read_uncommitted")
        self._partitions: dict[str, list[int]] = {}
        self._metadata_at = float("-inf")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="transaction-watch", daemon=True)

    @staticmethod
    def _reader(consumer_options: Mapping[str, str], isolation: str) -> confluent_kafka.Consumer:
        """A consumer with the worker's connection options (`consumer_config`) that joins no group and only
        asks end offsets, at `isolation` (read_committed: the LSO; read_uncommitted: the high watermark)."""
        return confluent_kafka.Consumer(
            {
                **consumer_options,
                "group.id": "triage-transaction-watch",  # librdkafka wants one; nothing joins or commits
                "enable.auto.commit": "false",
                "isolation.level": isolation,
                "error_cb": ClientErrorLog("consumer"),
            }
        )

    def start(self) -> TransactionWatch:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2 * _QUERY_TIMEOUT_S + WATCH_INTERVAL_S)
        self._committed.close()
        self._uncommitted.close()

    def _run(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            try:
                self.round()
            except Exception:  # a watch never stops the worker; the next round asks again
                _log.exception("transaction_watch_failed")

    def round(self) -> None:
        """Take one round of readings, tell the detector, log what changed and set the metric."""
        now = self._clock()
        new, cleared = self.detector.observe(now, self._readings(now))
        for suspect in new:
            topic, partition = suspect.key
            _log.warning(
                "hanging_transaction_suspected",
                topic=topic,
                partition=partition,
                reason=suspect.reason,
                held_s=round(suspect.held_s, 1),
                last_stable_offset=suspect.stable,
                high_watermark=suspect.high,
                remedy=(
                    f"triage-worker broker transactions find-hanging --topic {topic} --partition {partition}"
                    " (then abort with the start offset it lists)"
                ),
            )
        for topic, partition in cleared:
            _log.info("hanging_transaction_cleared", topic=topic, partition=partition)
        self._metrics.hanging = tuple(sorted(self.detector.suspected))

    def _readings(self, now: float) -> dict[TopicPartitionKey, Reading]:
        keys = [key for key in self._metrics.partitions.assigned if key[0] == self._input]
        keys += [(topic, p) for topic in self._written for p in self._topic_partitions(topic, now)]
        readings: dict[TopicPartitionKey, Reading] = {}
        for key in keys:
            stable, high = self._end(self._committed, key), self._end(self._uncommitted, key)
            readings[key] = Reading(stable, high)
        return readings

    def _topic_partitions(self, topic: str, now: float) -> list[int]:
        if now - self._metadata_at >= _METADATA_EVERY_S:
            try:
                topics = self._uncommitted.list_topics(timeout=_QUERY_TIMEOUT_S).topics
            except confluent_kafka.KafkaException:
                return self._partitions.get(topic, [])
            self._partitions = {name: sorted(meta.partitions) for name, meta in topics.items()}
            self._metadata_at = now
        return self._partitions.get(topic, [])

    @staticmethod
    def _end(consumer: confluent_kafka.Consumer, key: TopicPartitionKey) -> int | None:
        try:
            _, high = consumer.get_watermark_offsets(
                confluent_kafka.TopicPartition(*key), timeout=_QUERY_TIMEOUT_S
            )
        except confluent_kafka.KafkaException:
            return None
        return int(high) if high >= 0 else None
