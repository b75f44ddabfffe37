"""Dead-letter replay: republish what the worker dead-lettered, once the cause is fixed.

Home-made replays are where messages get duplicated, looped forever or lost, so this one is built around
three guarantees:

* **Bounded loops.** Every republished record carries ``triage.replay_count`` = previous + 1. The worker keeps
  that header when it dead-letters the record again, so a record that keeps failing reaches ``max_replays``
  and is then skipped and reported instead of circling between the topics.
* **At-least-once, few duplicates.** Progress is committed under the replay's own consumer group, and only up
  to the last offset whose republished record (and every one before it) the broker confirmed (idempotent
  producer, ``acks=all``). A killed replay resumes there: it re-sends at most what was in flight.
* **Exactly once, when asked.** With ``pipeline.guarantee = "exactly_once"`` the republished records and
  the progress past them are committed in one Kafka transaction (a transactional producer of its own, see
  `replay_transactional_id`), so readers with ``isolation.level=read_committed`` see each selected dead
  letter once, even across a ``kill -9`` and a rerun. Both modes are the pipeline's own delivery
  guarantees (`worker/pipeline/settlements/guarantees.py`): the replay differs from the worker only in what
  it reads and writes.
* **A finite run.** The end offsets are captured at start; dead letters that arrive meanwhile (perhaps
  replayed records failing again) wait for the next run instead of being chased.

Everything the group passes over counts as done *for that group*: records skipped by a filter or by the
max-replay bound are behind its committed position. A replay with a different selection therefore needs its
own ``--group``, or the group put back with `reset_group` (docs/operations.md shows the workflow). Two rules
keep a mistake from costing records: the filters are checked before anything is read (`check_error_types`,
`check_source`), and a run whose selection matched no record commits nothing.

The time window (``--since``/``--until``) applies to when a record was dead-lettered, i.e. the dead-letter
record's Kafka timestamp: ``--since`` seeks with the broker's time index and ``--until`` ends each partition
at its first later record, which is then left for a later run rather than committed past.
"""

from __future__ import annotations

import difflib
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from functools import partial
from typing import Any, Protocol

import msgspec
from confluent_kafka import KafkaError, TopicPartition

from worker.config import Settings, mask_secrets
from worker.errors import UserError
from worker.kafka.clients import create_consumer, create_producer, exactly_once, kafka_call
from worker.kafka.commits import TopicPartitionKey
from worker.kafka.dead_letters import (
    ERROR_TYPES,
    REDACTED_DROPPED,
    DeadLetterInfo,
    read_dead_letter,
    replay_headers,
)
from worker.kafka.errors import PURGED
from worker.logs import librdkafka_logger
from worker.pipeline.failure import Failure
from worker.pipeline.metrics import PipelineMetrics
from worker.pipeline.seams import Settlement
from worker.pipeline.settlements.guarantees import GuaranteeWiring, Observer, guarantee_for
from worker.pipeline.settlements.offsets import OffsetTracker, PartitionOffsets
from worker.pipeline.work import Output, Work
from worker.replay.transforms import TransformFailed, TransformStopped

Header = tuple[str, bytes | None]

DEFAULT_MAX_REPLAYS = 3
METADATA_TIMEOUT_S = 10.0
# Commit confirmed progress at most this often, so a kill re-sends little without a commit per record.
COMMIT_INTERVAL_MS = 200
# How long a Ctrl-C'd replay waits for in-flight records before committing what was confirmed; and one that
# read its whole range (the client's own delivery timeout bounds every record anyway).
INTERRUPT_DRAIN_S = 30.0
FINISH_S = 600.0


class ReplayOutcome(StrEnum):
    """What happened to one dead letter; the values are the summary's and the JSON's count names."""

    REPLAYED = "replayed"
    SKIPPED_FILTER = "skipped_filter"
    SKIPPED_MAX_REPLAYS = "skipped_max_replays"
    # Written without its key, value and headers (too large for the dead-letter topic): nothing to republish.
    SHRUNK = "shrunk"
    TRANSFORM_SKIPPED = "transform_skipped"
    TRANSFORM_FAILED = "transform_failed"
    PUBLISH_FAILED = "publish_failed"
    UNREADABLE = "unreadable"


# Outcomes of records the selection took (they count for --limit).
SELECTED = frozenset(
    {
        ReplayOutcome.REPLAYED,
        ReplayOutcome.TRANSFORM_SKIPPED,
        ReplayOutcome.TRANSFORM_FAILED,
        ReplayOutcome.PUBLISH_FAILED,
    }
)
# Outcomes of records the selection did not match. Until a record matches, the run commits past none of them:
# a run that matched nothing commits nothing, so a filter that was wrong costs a rerun, not the records.
UNMATCHED = frozenset({ReplayOutcome.SKIPPED_FILTER, ReplayOutcome.UNREADABLE})
# Outcomes listed record by record in the report: each one needs a person to look at it.
ATTENTION = frozenset(
    {
        ReplayOutcome.SKIPPED_MAX_REPLAYS,
        ReplayOutcome.SHRUNK,
        ReplayOutcome.TRANSFORM_FAILED,
        ReplayOutcome.PUBLISH_FAILED,
        ReplayOutcome.UNREADABLE,
    }
)


class Transform(Protocol):
    """The ops' repair of one value (`--transform`, run by `worker.replay.transforms.TransformProcess`)."""

    def repair(self, value: bytes) -> bytes | None:
        """The new value, or None to skip the record. Raises TransformFailed (reported for this record, like
        any other outcome) or TransformStopped (the replay was asked to stop: the record is not taken)."""
        ...


@dataclass(frozen=True)
class OffsetRange:
    """Offsets ``start`` to ``end`` - 1 of one dead-letter partition; ``end`` None: up to the end at start."""

    partition: int
    start: int
    end: int | None


@dataclass(frozen=True)
class ReplayOptions:
    """One replay: which dead letters, filtered how, sent where, how fast. See `run_replay`."""

    dlq_topic: str
    group: str
    since: datetime | None = None
    until: datetime | None = None
    offsets: tuple[OffsetRange, ...] | None = None
    error_types: frozenset[str] = frozenset()
    source_topic: str | None = None
    source_partition: int | None = None
    limit: int | None = None
    max_replays: int = DEFAULT_MAX_REPLAYS
    to_topic: str | None = None
    rate: float | None = None
    transform: Transform | None = None
    dry_run: bool = False

    def __post_init__(self) -> None:
        check_error_types(self.error_types)


@dataclass(frozen=True)
class PartitionPlan:
    """Where one dead-letter partition's replay starts (after the group's committed position) and ends."""

    partition: int
    start: int
    end: int
    committed: int | None


@dataclass(frozen=True)
class RecordReport:
    """One dead letter's outcome, as shown in the dry-run listing and the attention list."""

    partition: int
    offset: int
    outcome: ReplayOutcome
    error_type: str | None
    replay_count: int | None
    target: str | None
    key: bytes | None
    detail: str | None = None
    # A shrunk dead letter's `triage.omitted.bytes`: how large the original was that it no longer carries.
    omitted_bytes: int | None = None


@dataclass
class ReplaySummary:
    """Counts by outcome and by error type, plus the records that need attention."""

    dlq_topic: str
    group: str
    dry_run: bool
    plan: list[PartitionPlan] = field(default_factory=list)
    counts: Counter[ReplayOutcome] = field(default_factory=Counter)
    by_error_type: dict[str, Counter[ReplayOutcome]] = field(default_factory=dict)
    attention: list[RecordReport] = field(default_factory=list)
    # Dry runs list every record they would replay, so ops can see exactly what a real run would send.
    would_replay: list[RecordReport] = field(default_factory=list)
    committed: dict[int, int] = field(default_factory=dict)
    interrupted: bool = False
    elapsed_s: float = 0.0
    guarantee: str = "at_least_once"
    # exactly_once: why the transactional producer could go no further (e.g. fenced by another replay).
    fatal: str | None = None

    def add(self, report: RecordReport) -> None:
        self.counts[report.outcome] += 1
        self.by_error_type.setdefault(report.error_type or "(unreadable)", Counter())[report.outcome] += 1
        if report.outcome in ATTENTION:
            self.attention.append(report)
        elif report.outcome is ReplayOutcome.REPLAYED and self.dry_run:
            self.would_replay.append(report)

    @property
    def failed(self) -> bool:
        return self.counts[ReplayOutcome.PUBLISH_FAILED] > 0

    @property
    def matched_nothing(self) -> bool:
        """Records were read and the selection matched none of them: nothing was committed."""
        return bool(self.counts) and all(outcome in UNMATCHED for outcome in +self.counts)

    def to_json(self) -> dict[str, Any]:
        """Plain data for ``--json``: stable keys, every outcome present (0 when none)."""

        def record(report: RecordReport) -> dict[str, Any]:
            return {
                "partition": report.partition,
                "offset": report.offset,
                "outcome": report.outcome.value,
                "error_type": report.error_type,
                "replay_count": report.replay_count,
                "target": report.target,
                "key": printable(report.key),
                "detail": report.detail,
                "omitted_bytes": report.omitted_bytes,
            }

        return {
            "dlq_topic": self.dlq_topic,
            "group": self.group,
            "dry_run": self.dry_run,
            "guarantee": self.guarantee,
            "interrupted": self.interrupted,
            "fatal": self.fatal,
            "elapsed_s": round(self.elapsed_s, 3),
            "partitions": [
                {"partition": p.partition, "start": p.start, "end": p.end, "committed_before": p.committed}
                for p in self.plan
            ],
            "committed": {str(partition): offset for partition, offset in sorted(self.committed.items())},
            "counts": {outcome.value: self.counts[outcome] for outcome in ReplayOutcome},
            "by_error_type": {
                error_type: {outcome.value: counts[outcome] for outcome in ReplayOutcome}
                for error_type, counts in sorted(self.by_error_type.items())
            },
            "attention": [record(report) for report in self.attention],
            "would_replay": [record(report) for report in self.would_replay],
        }


class ReplayObserver(Protocol):
    """Told about the plan and each settled record, so the CLI can draw progress while the replay runs."""

    def planned(self, plan: list[PartitionPlan]) -> None: ...

    def settled(self, report: RecordReport) -> None: ...


def default_group(dlq_topic: str) -> str:
    """The replay's own consumer group: never the worker's, so their committed positions never mix."""
    return f"triage-replay.{dlq_topic}"


def replay_transactional_id(settings: Settings, group: str) -> str:
    """The exactly_once replay's ``transactional.id``: ``<pipeline.transactional_id>-replay-<group>``, or
    ``<pipeline.group_id>-replay-<group>`` when no id is set.

    Never a worker's id (a replay would fence the worker), and without the host name the worker's default id
    carries: a rerun of the same replay from any host takes the id over, so `init_transactions` fences the
    earlier run and aborts the transaction a ``kill -9`` left open at once, instead of holding read_committed
    readers back until ``transaction.timeout.ms``. Two replays of one group at a time are never right; with
    one id the second fences the first.
    """
    prefix = settings.pipeline.transactional_id or settings.pipeline.group_id
    return f"{prefix}-replay-{group}"


# --- pure pieces of the replay -----------------------------------------------------------------------------


def check_error_types(error_types: Iterable[str]) -> None:
    """UserError unless every name is a `triage.error.type` this worker writes: a mistyped one would match no
    dead letter, and is named with the nearest known one."""
    for name in sorted(error_types):
        if name not in ERROR_TYPES:
            raise UserError(
                f"--error-type {_shown(name)} is not an error type of this worker's dead letters"
                f"{_nearest(name, ERROR_TYPES)}; known: {', '.join(ERROR_TYPES)}"
            )


def check_source(topics: Mapping[str, int], options: ReplayOptions) -> None:
    """UserError unless `--source-topic` is a topic of the cluster (`topics`: name → partition count) and
    `--source-partition` one of its partitions. (Without `--source-topic` a partition cannot be checked:
    dead letters may come from any topic.)"""
    topic, partition = options.source_topic, options.source_partition
    if topic is None:
        return
    if topic not in topics:
        known = [name for name in topics if not name.startswith("__")]
        raise UserError(
            f"--source-topic {_shown(topic)} is not a topic of the cluster{_nearest(topic, known)}"
        )
    if partition is not None and partition >= topics[topic]:
        raise UserError(f"--source-partition {partition}: {topic} has partitions 0 to {topics[topic] - 1}")


def _shown(text: str, limit: int = 60) -> str:
    """What the user typed, quoted and short, any odd character escaped."""
    return repr(text if len(text) <= limit else text[: limit - 1] + "…")


def _nearest(text: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(text, known, n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def why_not_replayed(info: DeadLetterInfo, options: ReplayOptions) -> ReplayOutcome | None:
    """Why this dead letter is not replayed (a filter, a shrunk dead letter, the max-replay bound), or None
    if it is selected.

    A shrunk dead letter (`triage.omitted.bytes`: too large, or its value dropped by `dead_letter.redact`) has
    no value left: republishing it would send a null that the worker dead-letters again as `null_value`, and
    its real cause would be gone."""
    if options.error_types and info.error_type not in options.error_types:
        return ReplayOutcome.SKIPPED_FILTER
    if options.source_topic is not None and info.topic != options.source_topic:
        return ReplayOutcome.SKIPPED_FILTER
    if options.source_partition is not None and info.partition != options.source_partition:
        return ReplayOutcome.SKIPPED_FILTER
    if info.omitted_bytes is not None:
        return ReplayOutcome.SHRUNK
    if info.replay_count >= options.max_replays:
        return ReplayOutcome.SKIPPED_MAX_REPLAYS
    return None


def not_kept(info: DeadLetterInfo) -> str:
    """What a person needs for a shrunk dead letter: how much was left out, why, and where the original is."""
    why = (
        "of a binary value (Avro, Protobuf) were left out by dead_letter.redact, which cannot redact it"
        if info.redacted == REDACTED_DROPPED
        else "were too large to keep in the dead-letter topic"
    )
    return (
        f"{info.omitted_bytes} bytes {why}; the original is {info.topic} [{info.partition}] offset "
        f"{info.offset}, within that topic's retention"
    )


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

    def wait_time(self, now: float) -> float:
        """Take a token and return 0, or return how long to wait before one is available (none taken)."""
        self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return 0.0
        return (1.0 - self._tokens) / self._rate


def printable(raw: bytes | None, limit: int = 60) -> str | None:
    if raw is None:
        return None
    text = raw.decode("utf-8", errors="replace")
    return text if len(text) <= limit else text[: limit - 1] + "…"


# --- the replay against Kafka -------------------------------------------------------------------------------


def plan_partitions(consumer: Any, options: ReplayOptions) -> list[PartitionPlan]:
    """Start and end offset per partition: selection start, raised to the group's committed position."""
    topic = options.dlq_topic
    partitions = _dlq_partitions(consumer, topic)
    wanted = {r.partition: r for r in options.offsets} if options.offsets is not None else None
    if wanted is not None:
        missing = sorted(set(wanted) - set(partitions))
        if missing:
            raise UserError(f"--offsets: {topic} has no partition {', '.join(map(str, missing))}")
        partitions = sorted(wanted)
    committed = _committed(consumer, options.group, topic, partitions)
    since_offsets: dict[int, int] = {}
    if options.since is not None:
        millis = int(options.since.timestamp() * 1000)
        for tp in kafka_call(
            "look up offsets by time",
            lambda: consumer.offsets_for_times(
                [TopicPartition(topic, p, millis) for p in partitions], timeout=METADATA_TIMEOUT_S
            ),
        ):
            since_offsets[tp.partition] = tp.offset
    plans = []
    for partition in partitions:
        low, high = kafka_call(
            f"read the offsets of {topic} [{partition}]",
            partial(
                consumer.get_watermark_offsets, TopicPartition(topic, partition), timeout=METADATA_TIMEOUT_S
            ),
        )
        start, end = low, high
        if wanted is not None:
            start = max(start, wanted[partition].start)
            end = min(end, wanted[partition].end if wanted[partition].end is not None else end)
        if partition in since_offsets:
            # -1: no record at or after that time in this partition.
            found = since_offsets[partition]
            start = max(start, found if found >= 0 else high)
        if committed[partition] is not None:
            start = max(start, committed[partition])
        plans.append(PartitionPlan(partition, start, max(start, end), committed[partition]))
    return plans


def _dlq_partitions(consumer: Any, topic: str) -> list[int]:
    metadata = kafka_call(
        "read topic metadata", lambda: consumer.list_topics(topic, timeout=METADATA_TIMEOUT_S)
    )
    topic_metadata = metadata.topics.get(topic)
    if topic_metadata is None or topic_metadata.error is not None or not topic_metadata.partitions:
        raise UserError(
            f"dead-letter topic {topic!r} does not exist (set it with --dlq or topics.dead_letter)"
        )
    return sorted(topic_metadata.partitions)


def _committed(consumer: Any, group: str, topic: str, partitions: list[int]) -> dict[int, int | None]:
    """The group's committed position on each partition; None where it has none."""
    return {
        tp.partition: tp.offset if tp.offset >= 0 else None
        for tp in kafka_call(
            f"read the committed offsets of group {group}",
            lambda: consumer.committed(
                [TopicPartition(topic, p) for p in partitions], timeout=METADATA_TIMEOUT_S
            ),
        )
    }


@dataclass(frozen=True)
class GroupReset:
    """One dead-letter partition of `reset_group`: the group's position before, and the beginning."""

    partition: int
    committed: int | None
    beginning: int

    @property
    def moves(self) -> bool:
        """Whether the position changes (a group with none, or one at the beginning, starts there anyway)."""
        return self.committed is not None and self.committed > self.beginning


def reset_group(settings: Settings, dlq_topic: str, group: str, dry_run: bool) -> list[GroupReset]:
    """Put replay group `group` back to the beginning of `dlq_topic` (unless `dry_run`), so that a replay can
    be redone: every dead letter still in the topic is then new to the group, those it replayed too.

    Only this topic's positions change (commits of the earliest offsets still there), whatever else the group
    holds. A replay of the group running meanwhile would commit its own progress over the reset."""
    consumer = kafka_call(
        "create a consumer",
        lambda: create_consumer(
            settings, overrides={"group.id": group, "isolation.level": "read_uncommitted"}
        ),
        settings.kafka,
    )
    try:
        partitions = _dlq_partitions(consumer, dlq_topic)
        committed = _committed(consumer, group, dlq_topic, partitions)
        resets = []
        for partition in partitions:
            low, _ = kafka_call(
                f"read the offsets of {dlq_topic} [{partition}]",
                partial(
                    consumer.get_watermark_offsets,
                    TopicPartition(dlq_topic, partition),
                    timeout=METADATA_TIMEOUT_S,
                ),
            )
            resets.append(GroupReset(partition, committed[partition], low))
        moved = [TopicPartition(dlq_topic, r.partition, r.beginning) for r in resets if r.moves]
        if moved and not dry_run:
            kafka_call(
                f"commit group {group}'s new positions",
                lambda: consumer.commit(offsets=moved, asynchronous=False),
                settings.kafka,
            )
        return resets
    finally:
        consumer.close()


def fatal_reason(reason: str, fenced: bool, group: str, kafka_config: Mapping[str, str]) -> str:
    """One line for a producer that can go no further, fencing named as what it means for a replay; no
    secret values."""
    reason = mask_secrets(reason, kafka_config)
    if fenced:
        return f"fenced: another replay of group {group} took over its transactional id ({reason})"
    return f"Kafka: the replay's producer failed: {reason}"


@dataclass(frozen=True)
class _ReplayClients:
    """The replay's producer for its guarantee (a `ProducerFactory`: the replay reads with a consumer of its
    own): transactional under the replay's own id in exactly_once."""

    settings: Settings
    transactional: str | None

    def producer(self, on_error: Callable[[KafkaError], None]) -> Any:
        settings, transactional = self.settings, self.transactional
        return kafka_call(
            "create a producer",
            lambda: create_producer(
                settings, on_error=on_error, logger=librdkafka_logger(), transactional=transactional
            ),
            settings.kafka,
        )


class _Replay(Observer):
    """One run: reads the planned ranges, republishes selected records through the pipeline's delivery
    guarantee (`worker/pipeline/settlements/guarantees.py`), and reports each record once its outcome is
    final: at once for skipped records and, at-least-once, for acknowledged ones; exactly-once, when the
    transaction holding it commits (an aborted one is redone, and its records reported then)."""

    def __init__(
        self,
        settings: Settings,
        options: ReplayOptions,
        observer: ReplayObserver | None,
        should_stop: Callable[[], bool],
    ) -> None:
        self.options = options
        self.kafka_config = settings.kafka
        self.observer = observer
        self.should_stop = should_stop
        self.summary = ReplaySummary(
            options.dlq_topic, options.group, options.dry_run, guarantee=settings.pipeline.guarantee
        )
        # The pipeline's client options (user's librdkafka options; no auto-commit; idempotent, acks=all
        # producer), in the replay's own group, with end-of-partition events to know when a range is read.
        consumer_options = {
            "group.id": options.group,
            "enable.partition.eof": "true",
            "isolation.level": "read_committed",
        }
        self.consumer = kafka_call(
            "create a consumer",
            lambda: create_consumer(settings, logger=librdkafka_logger(), overrides=consumer_options),
            settings.kafka,
        )
        self.tracker = OffsetTracker()
        self.failure = Failure()
        self.exactly_once = exactly_once(settings) and not options.dry_run
        self.guarantee: Settlement | None = None
        if not options.dry_run:
            transactional = replay_transactional_id(settings, options.group) if self.exactly_once else None
            # Progress committed often, so a kill re-sends little.
            replay_settings = msgspec.structs.replace(
                settings,
                pipeline=msgspec.structs.replace(settings.pipeline, commit_interval_ms=COMMIT_INTERVAL_MS),
            )
            self.guarantee = guarantee_for(
                GuaranteeWiring(
                    replay_settings,
                    _ReplayClients(settings, transactional),
                    self.consumer,
                    self.tracker,
                    PipelineMetrics(),
                    time.monotonic,
                    self._stop_reading,
                    self.failure,
                    self,
                    # A replay's targets are the original topics: nothing goes to the dead-letter topic
                    # from here (nothing written smaller, a refused record is a failed one in the report).
                    dead_letters=False,
                )
            )
        self.starts: dict[int, int] = {}
        self.ends: dict[int, int] = {}
        self.active: set[int] = set()
        self.selected = 0
        self.selected_committed = 0
        # Records whose publish failed (the report says why): not tried again in this run, even after a redo.
        self.failures: dict[tuple[int, int], RecordReport] = {}
        self.reported_failures: set[tuple[int, int]] = set()
        # Outcomes waiting for the transaction that holds them (exactly-once), and each replayed record's.
        self.pending: list[RecordReport] = []
        self.sent: dict[int, RecordReport] = {}
        self.positions: dict[int, int] = {}
        # Whether the selection matched a record yet; until then the filtered-out and unreadable records
        # read are held (not finished: no commit passes them), partition and offset.
        self.matched = False
        self.held: list[tuple[int, int]] = []

    @property
    def trackers(self) -> dict[int, PartitionOffsets]:
        """The offset state of each planned dead-letter partition."""
        return {state.key[1]: state for state in self.tracker}

    def run(self) -> ReplaySummary:
        started = time.monotonic()
        try:
            self._run()
        finally:
            self.summary.elapsed_s = time.monotonic() - started
            self.consumer.close()
        return self.summary

    def _run(self) -> None:
        if self.options.source_topic is not None:  # before anything else: a typo must cost nothing
            metadata = kafka_call(
                "read the cluster's topics", lambda: self.consumer.list_topics(timeout=METADATA_TIMEOUT_S)
            )
            check_source({name: len(t.partitions) for name, t in metadata.topics.items()}, self.options)
        if self.guarantee is not None:
            # Exactly-once: fences an earlier run under the same id and aborts its open transaction, whose
            # offsets would otherwise keep the group's committed positions unstable until it times out.
            self.guarantee.start()
        plan = plan_partitions(self.consumer, self.options)
        self.summary.plan = plan
        if self.observer is not None:
            self.observer.planned(plan)
        for item in plan:
            self.tracker.assign((self.options.dlq_topic, item.partition))
            self.starts[item.partition] = item.start
            self.ends[item.partition] = item.end
            if item.start < item.end:
                self.active.add(item.partition)
        if not self.active:
            return
        topic = self.options.dlq_topic
        self.consumer.assign([TopicPartition(topic, p, self.starts[p]) for p in sorted(self.active)])
        bucket = TokenBucket(self.options.rate, time.monotonic()) if self.options.rate else None
        until_ms = int(self.options.until.timestamp() * 1000) if self.options.until else None
        try:
            while self._unfinished() and not self.should_stop() and self.failure.reason is None:
                message = self.consumer.poll(0.1 if self.active else 0.0)
                if message is not None:
                    self._handle(message, bucket, until_ms)
                self._serve(0 if self.active else 0.1)
        except KeyboardInterrupt:
            self.summary.interrupted = True
        self.summary.interrupted = self.summary.interrupted or self.should_stop()
        self._finish()

    def _unfinished(self) -> bool:
        """Partitions left to read, or records whose outcome is still open (an abort may yet redo them)."""
        if self.active or self.guarantee is None:
            return bool(self.active)
        return bool(self.guarantee.outstanding or not self.guarantee.producing)

    def _finish(self) -> None:
        """Wait for the records in flight (bounded when interrupted), commit what is confirmed."""
        if self.guarantee is not None:
            wait_s = INTERRUPT_DRAIN_S if self.summary.interrupted else FINISH_S
            limit = time.monotonic() + wait_s
            while self.guarantee.outstanding and time.monotonic() < limit and not self.failure.reason:
                self._serve(0.1)
            self.guarantee.stop(limit)
        if self.exactly_once and not self.matched:
            # No transaction ever held these (nothing matched, nothing was committed): final as they are.
            for report in self.pending:
                self._record(report)
            self.pending.clear()
        self.summary.committed = dict(self.positions)
        if self.failure.reason is not None:
            self.summary.fatal = fatal_reason(
                self.failure.reason, self.failure.fenced, self.options.group, self.kafka_config
            )

    def _handle(self, message: Any, bucket: TokenBucket | None, until_ms: int | None) -> None:
        error = message.error()
        partition = message.partition()
        if error is not None:
            if error.code() == KafkaError._PARTITION_EOF:
                self.active.discard(partition)
                return
            if error.fatal():
                raise UserError(f"Kafka: consumer failed: {error.str()}")
            return  # Transient; librdkafka retries by itself.
        offset = message.offset()
        if partition not in self.active:
            return
        if offset >= self.ends[partition] or (until_ms is not None and message.timestamp()[1] > until_ms):
            self.active.discard(partition)
            return
        try:
            info = read_dead_letter(message.headers() or [])
        except ValueError as problem:
            self._settle(message, ReplayOutcome.UNREADABLE, None, detail=str(problem))
            return
        skipped = why_not_replayed(info, self.options)
        if skipped is not ReplayOutcome.SKIPPED_FILTER:
            self._matched()
        if skipped is not None:
            self._settle(
                message, skipped, info, detail=not_kept(info) if skipped is ReplayOutcome.SHRUNK else None
            )
            return
        if self.options.limit is not None and self.selected >= self.options.limit:
            self.active.clear()
            return
        self.selected += 1
        value: bytes | None = message.value()
        if self.options.transform is not None and value is not None:
            try:
                value = self.options.transform.repair(value)
            except TransformStopped:
                return  # Not taken: the committed position stays before this record.
            except TransformFailed as problem:
                self._settle(message, ReplayOutcome.TRANSFORM_FAILED, info, detail=problem.detail)
                return
            if value is None:
                self._settle(message, ReplayOutcome.TRANSFORM_SKIPPED, info)
                return
        target = self.options.to_topic or info.topic
        report = RecordReport(
            partition,
            offset,
            ReplayOutcome.REPLAYED,
            info.error_type,
            info.replay_count,
            target,
            message.key(),
        )
        if self.guarantee is None:  # dry run
            self.trackers[partition].track(offset)
            self._settle_report(report)
            return
        failure = self.failures.get((partition, offset))
        if failure is not None:  # Read again after a redo: it fails as it did, without another try.
            self._fail(failure)
            return
        if bucket is not None:
            while (wait := bucket.wait_time(time.monotonic())) > 0:
                if self.should_stop():
                    return  # Not taken: the committed position stays before this record.
                self._serve(min(wait, 0.05))
        state = self.trackers[partition]
        state.track(offset)
        now = time.monotonic()
        work = Work(state, self.options.dlq_topic, partition, offset, message.key(), None, now, now)
        self.guarantee.taken(work)
        self.sent[id(work)] = report
        headers = replay_headers(message.headers())
        self.guarantee.write(work, Output(target, message.key(), value, headers))

    # -- what the guarantee says ------------------------------------------------------------------------

    def delivered(self, work: Work, error: KafkaError | None) -> None:
        report = self.sent.pop(id(work))
        if error is None:
            if not work.orphan:
                self._report(report)
            return
        if error.code() in PURGED:
            return  # its transaction was aborted; the redo reads it again
        # Refused: not sent again in this run, or it could loop.
        failed = _failed(report, error.str())
        self.failures[(report.partition, report.offset)] = failed
        if not self.exactly_once:
            self._fail(failed)

    def committed(self, positions: dict[TopicPartitionKey, int]) -> None:
        for (_, partition), position in positions.items():
            self.positions[partition] = position
        if self.exactly_once:
            confirmed = [
                r for r in self.pending if r.offset < positions.get((self.options.dlq_topic, r.partition), 0)
            ]
            self.pending = [r for r in self.pending if r not in confirmed]
            for report in confirmed:
                self._record(report)

    def redone(self, keys: set[TopicPartitionKey]) -> None:
        """The aborted transaction published nothing: its records are read (every partition from its last
        commit, even one read to its end already) and reported again."""
        self.pending.clear()
        self.selected = self.selected_committed
        self.active = {p for p, end in self.ends.items() if self.positions.get(p, self.starts[p]) < end}

    def _stop_reading(self, keys: Sequence[TopicPartitionKey]) -> None:
        """A partition the guarantee stopped (a record of it is refused for good): read no more of it, and
        report its refused records."""
        for _, partition in keys:
            self.consumer.pause([TopicPartition(self.options.dlq_topic, partition)])
            self.active.discard(partition)
            for (failed_partition, offset), failed in sorted(self.failures.items()):
                if failed_partition == partition and (partition, offset) not in self.reported_failures:
                    self._fail(failed)

    # -- outcomes ---------------------------------------------------------------------------------------

    def _fail(self, failed: RecordReport) -> None:
        # Left unsettled, so the committed position stays before it and a rerun retries it; the rest of the
        # partition would be re-sent by that rerun anyway, so stop reading it now.
        self.active.discard(failed.partition)
        self.failures[(failed.partition, failed.offset)] = failed
        self.reported_failures.add((failed.partition, failed.offset))
        self._record(failed)

    def _settle(
        self, message: Any, outcome: ReplayOutcome, info: DeadLetterInfo | None, detail: str | None = None
    ) -> None:
        """A record that needs no output: done at once, or held while the selection matched nothing."""
        self.trackers[message.partition()].track(message.offset())
        report = RecordReport(
            message.partition(),
            message.offset(),
            outcome,
            info.error_type if info else None,
            info.replay_count if info else None,
            None,
            message.key(),
            detail,
            info.omitted_bytes if info else None,
        )
        if outcome in UNMATCHED and not self.matched:
            self.held.append((report.partition, report.offset))
            self._report(report)
        else:
            self._settle_report(report)

    def _matched(self) -> None:
        """The selection matched a record: the records held before it are done (passed over by the group)."""
        if self.matched:
            return
        self.matched = True
        for partition, offset in self.held:
            self.trackers[partition].done(offset)
        self.held.clear()

    def _settle_report(self, report: RecordReport) -> None:
        self.trackers[report.partition].done(report.offset)
        self._report(report)

    def _report(self, report: RecordReport) -> None:
        """Exactly-once: counted once the transaction holding it commits; else at once."""
        if self.exactly_once:
            self.pending.append(report)
        else:
            self._record(report)

    def _record(self, report: RecordReport) -> None:
        if self.exactly_once and report.outcome in SELECTED:
            self.selected_committed += 1
        self.summary.add(report)
        if self.observer is not None:
            self.observer.settled(report)

    def _serve(self, timeout: float) -> None:
        """Run delivery callbacks (waiting up to `timeout`), then commit what they confirmed."""
        if self.guarantee is None:
            if timeout > 0:
                time.sleep(timeout)
            return
        self.guarantee.serve(timeout)
        self.guarantee.advance()


def _failed(report: RecordReport, detail: str) -> RecordReport:
    """`report` (a record sent) as failed, with why."""
    return RecordReport(
        report.partition,
        report.offset,
        ReplayOutcome.PUBLISH_FAILED,
        report.error_type,
        report.replay_count,
        report.target,
        report.key,
        detail,
    )


def run_replay(
    settings: Settings,
    options: ReplayOptions,
    observer: ReplayObserver | None = None,
    should_stop: Callable[[], bool] = lambda: False,
) -> ReplaySummary:
    """Replay the dead letters `options` select; return what happened. Raises UserError on setup problems.

    `should_stop` is polled between records (the CLI sets it on SIGTERM/SIGINT): the replay then stops
    reading, waits for in-flight records, commits what was confirmed and returns a summary marked interrupted.
    """
    return _Replay(settings, options, observer, should_stop).run()
