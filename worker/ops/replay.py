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
  letter once, even across a ``kill -9`` and a rerun. The two modes differ only in where progress goes:
  `_GroupOffsets` or `_Transactions`.
* **A finite run.** The end offsets are captured at start; dead letters that arrive meanwhile (perhaps
  replayed records failing again) wait for the next run instead of being chased.

Everything the group passes over counts as done *for that group*: records skipped by a filter or by the
max-replay bound are behind its committed position. A replay with a different selection therefore needs its
own ``--group`` (docs/operations.md shows the workflow).

The time window (``--since``/``--until``) applies to when a record was dead-lettered, i.e. the dead-letter
record's Kafka timestamp: ``--since`` seeks with the broker's time index and ``--until`` ends each partition
at its first later record, which is then left for a later run rather than committed past.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from functools import partial
from typing import Any, Protocol

from confluent_kafka import KafkaError, KafkaException, TopicPartition

from worker.config import MASK, Settings, is_secret_key
from worker.errors import UserError
from worker.kafka.clients import create_consumer, create_producer, exactly_once, kafka_call
from worker.kafka.dead_letters import DeadLetterInfo, read_dead_letter, replay_headers
from worker.pipeline.offsets import PartitionOffsets

Transform = Callable[[bytes], bytes | None]
Header = tuple[str, bytes | None]

DEFAULT_MAX_REPLAYS = 3
METADATA_TIMEOUT_S = 10.0
# Commit confirmed progress at most this often, so a kill re-sends little without a commit per record.
COMMIT_INTERVAL_S = 0.2
# How long a Ctrl-C'd replay waits for in-flight records before committing what was confirmed.
INTERRUPT_DRAIN_S = 30.0


class Outcome(StrEnum):
    """What happened to one dead letter; the values are the summary's and the JSON's count names."""

    REPLAYED = "replayed"
    SKIPPED_FILTER = "skipped_filter"
    SKIPPED_MAX_REPLAYS = "skipped_max_replays"
    TRANSFORM_SKIPPED = "transform_skipped"
    TRANSFORM_FAILED = "transform_failed"
    PUBLISH_FAILED = "publish_failed"
    UNREADABLE = "unreadable"


# Outcomes listed record by record in the report: each one needs a person to look at it.
ATTENTION = frozenset(
    {Outcome.SKIPPED_MAX_REPLAYS, Outcome.TRANSFORM_FAILED, Outcome.PUBLISH_FAILED, Outcome.UNREADABLE}
)


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
    outcome: Outcome
    error_type: str | None
    replay_count: int | None
    target: str | None
    key: bytes | None
    detail: str | None = None


@dataclass
class ReplaySummary:
    """Counts by outcome and by error type, plus the records that need attention."""

    dlq_topic: str
    group: str
    dry_run: bool
    plan: list[PartitionPlan] = field(default_factory=list)
    counts: Counter[Outcome] = field(default_factory=Counter)
    by_error_type: dict[str, Counter[Outcome]] = field(default_factory=dict)
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
        elif report.outcome is Outcome.REPLAYED and self.dry_run:
            self.would_replay.append(report)

    @property
    def failed(self) -> bool:
        return self.counts[Outcome.PUBLISH_FAILED] > 0

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
            "counts": {outcome.value: self.counts[outcome] for outcome in Outcome},
            "by_error_type": {
                error_type: {outcome.value: counts[outcome] for outcome in Outcome}
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


def classify(info: DeadLetterInfo, options: ReplayOptions) -> Outcome | None:
    """Why this dead letter is not replayed (a filter, the max-replay bound), or None if it is selected."""
    if options.error_types and info.error_type not in options.error_types:
        return Outcome.SKIPPED_FILTER
    if options.source_topic is not None and info.topic != options.source_topic:
        return Outcome.SKIPPED_FILTER
    if options.source_partition is not None and info.partition != options.source_partition:
        return Outcome.SKIPPED_FILTER
    if info.replay_count >= options.max_replays:
        return Outcome.SKIPPED_MAX_REPLAYS
    return None


def describe_failure(problem: BaseException, limit: int = 200) -> str:
    """`Type: text` of an exception raised by the ops' code, short and printable whatever it holds (a
    whole record value, lone surrogates, or a __str__ that itself raises)."""
    try:
        text = str(problem)
    except Exception:
        text = "(no description)"
    detail = f"{type(problem).__name__}: {text}".encode("utf-8", "backslashreplace").decode("utf-8")
    return detail if len(detail) <= limit else detail[: limit - 1] + "…"


def apply_transform(transform: Transform, value: bytes) -> bytes | None:
    """Run the ops' fix; None means "skip this record". Raises with a readable message on bad results."""
    result = transform(value)
    if result is not None and not isinstance(result, bytes | bytearray):
        raise TypeError(f"transform returned {type(result).__name__}, expected bytes or None")
    return None if result is None else bytes(result)


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
    metadata = kafka_call(
        "read topic metadata", lambda: consumer.list_topics(topic, timeout=METADATA_TIMEOUT_S)
    )
    topic_metadata = metadata.topics.get(topic)
    if topic_metadata is None or topic_metadata.error is not None or not topic_metadata.partitions:
        raise UserError(
            f"dead-letter topic {topic!r} does not exist (set it with --dlq or topics.dead_letter)"
        )
    partitions = sorted(topic_metadata.partitions)
    wanted = {r.partition: r for r in options.offsets} if options.offsets is not None else None
    if wanted is not None:
        missing = sorted(set(wanted) - set(partitions))
        if missing:
            raise UserError(f"--offsets: {topic} has no partition {', '.join(map(str, missing))}")
        partitions = sorted(wanted)
    committed = {
        tp.partition: tp.offset if tp.offset >= 0 else None
        for tp in kafka_call(
            f"read the committed offsets of group {options.group}",
            lambda: consumer.committed(
                [TopicPartition(topic, p) for p in partitions], timeout=METADATA_TIMEOUT_S
            ),
        )
    }
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


class _Rewind(Exception):
    """The transaction was aborted: nothing of it is published or committed, so its records are read again."""


class _Fatal(Exception):
    """The transactional producer can go no further (fenced, or an error that outlasted the retries); the text
    is one line for the summary and the CLI."""


class _Abortable(Exception):
    """A transactional call failed with an error that requires `abort_transaction` (text: the client's)."""


# How records that were queued or in flight when their transaction was aborted fail.
_PURGED = frozenset({KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT})
# What a producer whose transactional id another one took over hears, depending on the call.
_FENCING = frozenset({KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH})


def _fatal_reason(error: KafkaError, group: str, kafka_config: Mapping[str, str]) -> str:
    """One line for a fatal producer error, fencing named as what it means for a replay; no secret values."""
    text = error.str()
    for key, value in kafka_config.items():
        if value and is_secret_key(key):
            text = text.replace(value, MASK)
    if error.code() in _FENCING:
        return f"fenced: another replay of group {group} took over its transactional id ({text})"
    return f"Kafka: the replay's producer failed: {text}"


class _Commits(Protocol):
    """Where the replay's progress goes. `epoch` changes when records produced before were rolled back."""

    epoch: int

    def start(self) -> None:
        """Called before the plan reads the group's committed offsets."""

    def begin(self) -> None:
        """Called before each record is produced."""

    def refused(self, error: KafkaError) -> None:
        """The client refused to queue a record: raise if the cause is not that record."""

    def report(self, report: RecordReport) -> None:
        """A record settled (or failed): count it now or once its progress is committed."""

    def commit(self, progress: Callable[[], list[TopicPartition]]) -> list[TopicPartition]:
        """Commit `progress()` (the positions past every settled record); return what was committed."""


class _GroupOffsets:
    """at_least_once (and dry runs): progress is committed to the group's offsets, only up to records the
    broker confirmed. A confirmed record is published whatever happens next, so it counts at once, and nothing
    is ever rolled back."""

    epoch = 0

    def __init__(self, consumer: Any, group: str, record: Callable[[RecordReport], None]) -> None:
        self._consumer = consumer
        self._group = group
        self._record = record

    def start(self) -> None:
        pass

    def begin(self) -> None:
        pass

    def refused(self, error: KafkaError) -> None:
        pass

    def report(self, report: RecordReport) -> None:
        self._record(report)

    def commit(self, progress: Callable[[], list[TopicPartition]]) -> list[TopicPartition]:
        offsets = progress()
        if offsets:
            kafka_call(
                f"commit progress for group {self._group}",
                lambda: self._consumer.commit(offsets=offsets, asynchronous=False),
            )
        return offsets


class _Transactions:
    """exactly_once: the records republished since the last commit and the progress past them (and past what
    was skipped meanwhile) commit in one transaction, so the committed position is exactly what readers with
    read_committed see. Reports wait for that commit: an aborted transaction published nothing and its
    records are read again (`_Rewind`), so counting them at delivery would count them twice.

    Errors as librdkafka documents them: retriable ones retry the same call (`kafka_call`, for a while),
    abortable ones abort and raise `_Rewind`, fatal ones (and retries that ran out) raise `_Fatal`.
    """

    def __init__(
        self,
        producer: Any,
        consumer: Any,
        settings: Settings,
        group: str,
        record: Callable[[RecordReport], None],
    ) -> None:
        self._producer = producer
        self._consumer = consumer
        self._kafka_config = settings.kafka
        self._group = group
        self._record = record
        self._open = False
        self._pending: list[RecordReport] = []
        self.epoch = 0

    def start(self) -> None:
        # Fences an earlier run under the same id and aborts its open transaction, whose offsets would
        # otherwise keep the group's committed positions unstable (unreadable) until it times out.
        self._call("start the replay's transactions", self._producer.init_transactions)

    def begin(self) -> None:
        if not self._open:
            self._call("begin a transaction", self._producer.begin_transaction)
            self._open = True

    def refused(self, error: KafkaError) -> None:
        # A transaction in error refuses every record: _STATE when abortable, _FATAL (with no reason) when
        # fenced. Aborting then rewinds, or raises _Fatal with the client's reason.
        if (
            error.code() in (KafkaError._STATE, KafkaError._FATAL)
            or error.fatal()
            or error.txn_requires_abort()
        ):
            self._abort()
            raise _Rewind

    def report(self, report: RecordReport) -> None:
        self._pending.append(report)

    def commit(self, progress: Callable[[], list[TopicPartition]]) -> list[TopicPartition]:
        if self._open:
            # Settle every record of the transaction first, so the offsets sent are past exactly what it
            # holds. Bounded: a transactional producer's message.timeout.ms is at most transaction.timeout.ms.
            self._producer.flush()
        offsets = progress()
        if offsets or self._open:
            self.begin()
            if offsets:
                self._call(
                    f"send progress for group {self._group} to the transaction",
                    lambda: self._producer.send_offsets_to_transaction(
                        offsets, self._consumer.consumer_group_metadata()
                    ),
                )
            self._call("commit the replay's transaction", self._producer.commit_transaction)
            self._open = False
        for report in self._pending:
            self._record(report)
        self._pending.clear()
        return offsets

    def _call(self, what: str, call: Callable[[], Any]) -> Any:
        try:
            return kafka_call(what, partial(self._attempt, call), self._kafka_config)
        except _Abortable:
            self._abort()
            raise _Rewind from None
        except UserError as error:  # retries ran out, or an error neither passing nor abortable
            raise _Fatal(str(error)) from None

    def _attempt(self, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except KafkaException as exception:
            error = exception.args[0] if exception.args else None
            if isinstance(error, KafkaError) and error.txn_requires_abort():
                raise _Abortable(error.str()) from None
            if isinstance(error, KafkaError) and (error.fatal() or error.code() in _FENCING):
                raise _Fatal(_fatal_reason(error, self._group, self._kafka_config)) from None
            raise

    def _abort(self) -> None:
        # First: delivery reports of the aborted records (served while it aborts) then settle nothing.
        self.epoch += 1
        self._pending.clear()
        self._open = False
        abort = partial(self._attempt, self._producer.abort_transaction)
        try:
            kafka_call("abort the replay's transaction", abort, self._kafka_config)
        except (_Abortable, UserError) as error:
            raise _Fatal(f"Kafka: cannot abort the replay's transaction: {error}") from None


class _Replay:
    """One run: reads the planned ranges, republishes selected records, commits confirmed progress."""

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
            "create a consumer", lambda: create_consumer(settings, overrides=consumer_options), settings.kafka
        )
        self.producer: Any = None
        self.commits: _Commits = _GroupOffsets(self.consumer, options.group, self._record)
        if not options.dry_run and exactly_once(settings):
            transactional = replay_transactional_id(settings, options.group)
            self.producer = kafka_call(
                "create a producer",
                lambda: create_producer(settings, transactional=transactional),
                settings.kafka,
            )
            self.commits = _Transactions(self.producer, self.consumer, settings, options.group, self._record)
        elif not options.dry_run:
            self.producer = kafka_call("create a producer", lambda: create_producer(settings), settings.kafka)
        self.trackers: dict[int, PartitionOffsets] = {}
        self.starts: dict[int, int] = {}
        self.ends: dict[int, int] = {}
        self.active: set[int] = set()
        self.selected = 0
        self.selected_committed = 0
        # Records whose publish failed, with why: never tried again in this run, even after a rewind.
        self.failures: dict[tuple[int, int], str] = {}
        self.last_commit = 0.0
        self.committed: dict[int, int] = {}

    def run(self) -> ReplaySummary:
        started = time.monotonic()
        try:
            self._run()
        finally:
            self.summary.elapsed_s = time.monotonic() - started
            self.consumer.close()
        return self.summary

    def _run(self) -> None:
        try:
            self.commits.start()
        except _Fatal as error:
            raise UserError(str(error)) from None
        plan = plan_partitions(self.consumer, self.options)
        self.summary.plan = plan
        if self.observer is not None:
            self.observer.planned(plan)
        for item in plan:
            self.trackers[item.partition] = PartitionOffsets((self.options.dlq_topic, item.partition))
            self.starts[item.partition] = item.start
            self.ends[item.partition] = item.end
            if item.start < item.end:
                self.active.add(item.partition)
        if not self.active:
            return
        self._assign(self.starts)
        bucket = TokenBucket(self.options.rate, time.monotonic()) if self.options.rate else None
        until_ms = int(self.options.until.timestamp() * 1000) if self.options.until else None
        try:
            while True:
                try:
                    self._replay(bucket, until_ms)
                    break
                except _Rewind:
                    if self.summary.interrupted or self.should_stop():
                        self.summary.interrupted = True
                        break  # The aborted records wait for the next run, like any uncommitted ones.
                    self._rewind()
        except _Fatal as stopped:
            self.summary.fatal = str(stopped)
        except KafkaException as exception:
            # poll() and flush() raise a fatal client error themselves, e.g. fenced by another replay.
            cause = exception.args[0] if exception.args else None
            if not (isinstance(cause, KafkaError) and (cause.fatal() or cause.code() in _FENCING)):
                raise
            self.summary.fatal = _fatal_reason(cause, self.options.group, self.kafka_config)
        self.summary.committed = dict(self.committed)

    def _assign(self, positions: dict[int, int]) -> None:
        topic = self.options.dlq_topic
        self.consumer.assign([TopicPartition(topic, p, positions[p]) for p in sorted(self.active)])

    def _rewind(self) -> None:
        """After an aborted transaction: read again from the committed positions, as a rerun would."""
        positions = {p: self.committed.get(p, start) for p, start in self.starts.items()}
        self.active = {p for p, position in positions.items() if position < self.ends[p]}
        self.trackers = {p: PartitionOffsets((self.options.dlq_topic, p)) for p in self.trackers}
        self.selected = self.selected_committed
        self._assign(positions)

    def _replay(self, bucket: TokenBucket | None, until_ms: int | None) -> None:
        try:
            while self.active and not self.should_stop():
                for message in self.consumer.consume(num_messages=100, timeout=0.1):
                    self._handle(message, bucket, until_ms)
                    if not self.active or self.should_stop():
                        break
                    # Not only between batches: a transaction must end well within transaction.timeout.ms.
                    self._commit(force=False)
                self._serve(0)
        except KeyboardInterrupt:
            self.summary.interrupted = True
        self.summary.interrupted = self.summary.interrupted or self.should_stop()
        self._drain(deadline=time.monotonic() + INTERRUPT_DRAIN_S if self.summary.interrupted else None)
        self._commit(force=True)

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
            self._begin_and_settle(message, Outcome.UNREADABLE, None, detail=str(problem))
            return
        skipped = classify(info, self.options)
        if skipped is not None:
            self._begin_and_settle(message, skipped, info)
            return
        if self.options.limit is not None and self.selected >= self.options.limit:
            self.active.clear()
            return
        self.selected += 1
        value: bytes | None = message.value()
        if self.options.transform is not None and value is not None:
            try:
                value = apply_transform(self.options.transform, value)
            # The ops' code: any failure, even sys.exit(), is reported for this record only.
            except (Exception, SystemExit) as problem:
                self._begin_and_settle(
                    message, Outcome.TRANSFORM_FAILED, info, detail=describe_failure(problem)
                )
                return
            if value is None:
                self._begin_and_settle(message, Outcome.TRANSFORM_SKIPPED, info)
                return
        target = self.options.to_topic or info.topic
        report = RecordReport(
            partition, offset, Outcome.REPLAYED, info.error_type, info.replay_count, target, message.key()
        )
        if self.options.dry_run:
            self.trackers[partition].track(offset)
            self._settle(report)
            return
        failure = self.failures.get((partition, offset))
        if failure is not None:  # Read again after a rewind: it fails as it did, without another try.
            self._fail(report, failure)
            return
        if bucket is not None:
            while (wait := bucket.wait_time(time.monotonic())) > 0:
                if self.should_stop():
                    return  # Not begun: the committed position stays before this record.
                self._serve(min(wait, 0.05))
        self.trackers[partition].track(offset)
        headers = replay_headers(message.headers())
        self._produce(target, message.key(), value, headers, report)

    def _produce(
        self, target: str, key: bytes | None, value: bytes | None, headers: list[Header], report: RecordReport
    ) -> None:
        epoch = self.commits.epoch

        def delivered(error: Any, _message: Any) -> None:
            if epoch != self.commits.epoch:
                # Its transaction was aborted and the rewind reads the record again; if the broker refused it
                # (not merely purged by the abort), it is not sent again in this run, or it could loop.
                if error is not None and error.code() not in _PURGED:
                    self.failures[(report.partition, report.offset)] = error.str()
                return
            if error is None:
                self._settle(report)
            else:
                self._fail(report, error.str())

        while True:
            try:
                self.commits.begin()
                self.producer.produce(target, value=value, key=key, headers=headers, on_delivery=delivered)
                break
            except BufferError:  # librdkafka's local queue is full: let deliveries drain it.
                self._serve(0.1)
            except KafkaException as error:  # e.g. an invalid topic name given with --to
                if error.args and isinstance(error.args[0], KafkaError):
                    self.commits.refused(error.args[0])
                self._fail(report, str(error.args[0]) if error.args else str(error))
                break
            except (TypeError, ValueError) as error:  # what the client refuses before queueing (a NUL byte)
                self._fail(report, describe_failure(error))
                break
        self.producer.poll(0)

    def _fail(self, report: RecordReport, detail: str) -> None:
        # Left unsettled, so the committed position stays before it and a rerun retries it; the rest of the
        # partition would be re-sent by that rerun anyway, so stop reading it now.
        self.active.discard(report.partition)
        self.failures[(report.partition, report.offset)] = detail
        failed = RecordReport(
            report.partition,
            report.offset,
            Outcome.PUBLISH_FAILED,
            report.error_type,
            report.replay_count,
            report.target,
            report.key,
            detail,
        )
        self.commits.report(failed)

    def _begin_and_settle(
        self, message: Any, outcome: Outcome, info: DeadLetterInfo | None, detail: str | None = None
    ) -> None:
        self.trackers[message.partition()].track(message.offset())
        self._settle(
            RecordReport(
                message.partition(),
                message.offset(),
                outcome,
                info.error_type if info else None,
                info.replay_count if info else None,
                None,
                message.key(),
                detail,
            )
        )

    def _settle(self, report: RecordReport) -> None:
        self.trackers[report.partition].done(report.offset)
        self.commits.report(report)

    def _record(self, report: RecordReport) -> None:
        self.summary.add(report)
        if self.observer is not None:
            self.observer.settled(report)

    def _serve(self, timeout: float) -> None:
        """Run delivery callbacks (waiting up to `timeout`), then commit what they confirmed."""
        if self.producer is not None:
            self.producer.poll(timeout)
        elif timeout > 0:
            time.sleep(timeout)
        self._commit(force=False)

    def _drain(self, deadline: float | None) -> None:
        while self.producer is not None and len(self.producer) > 0:
            if deadline is not None and time.monotonic() >= deadline:
                return
            self._serve(0.1)

    def _commit(self, force: bool) -> None:
        if self.options.dry_run:
            return
        now = time.monotonic()
        if not force and now - self.last_commit < COMMIT_INTERVAL_S:
            return
        self.last_commit = now
        for tp in self.commits.commit(self._progress):
            self.trackers[tp.partition].committed(tp.offset)
            self.committed[tp.partition] = tp.offset
        self.selected_committed = self.selected

    def _progress(self) -> list[TopicPartition]:
        return [
            TopicPartition(self.options.dlq_topic, partition, position)
            for partition, state in self.trackers.items()
            if (position := state.position) is not None
        ]


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
