"""What a replay reads and which dead letters it picks: the options (`ReplayOptions`), the checks made before
anything is read (`check_error_types`, `check_source`), why a record is passed over (`why_not_replayed`), the
dead-letter ranges planned at start (`plan_partitions`), and the replay's own group and transactional id,
which `reset_group` puts back to the beginning."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any, Protocol

from confluent_kafka import TopicPartition

from worker.errors import UserError
from worker.kafka.clients import create_consumer, kafka_call
from worker.kafka.dead_letters import ERROR_TYPES, REDACTED_DROPPED, DeadLetterInfo
from worker.replay.outcomes import PartitionPlan, ReplayOutcome
from worker.settings import PipelineSettings

DEFAULT_MAX_REPLAYS = 3
METADATA_TIMEOUT_S = 10.0


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
    """One replay: which dead letters, filtered how, sent where, how fast. See `worker.app.replay.Replay`."""

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


def default_group(dlq_topic: str) -> str:
    """The replay's own consumer group: never the worker's, so their committed positions never mix."""
    return f"triage-replay.{dlq_topic}"


def replay_transactional_id(pipeline: PipelineSettings, group: str) -> str:
    """The exactly_once replay's ``transactional.id``: ``<pipeline.transactional_id>-replay-<group>``, or
    ``<pipeline.group_id>-replay-<group>`` when no id is set.

    Never a worker's id (a replay would fence the worker), and without the host name the worker's default id
    carries: a rerun of the same replay from any host takes the id over, so `init_transactions` fences the
    earlier run and aborts the transaction a ``kill -9`` left open at once, instead of holding read_committed
    readers back until ``transaction.timeout.ms``. Two replays of one group at a time are never right; with
    one id the second fences the first.
    """
    prefix = pipeline.transactional_id or pipeline.group_id
    return f"{prefix}-replay-{group}"


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


def reset_group(
    kafka: Mapping[str, str], pipeline: PipelineSettings, dlq_topic: str, group: str, dry_run: bool
) -> list[GroupReset]:
    """Put replay group `group` back to the beginning of `dlq_topic` (unless `dry_run`), so that a replay can
    be redone: every dead letter still in the topic is then new to the group, those it replayed too. `kafka`
    and `pipeline`: the `[kafka]` options and the pipeline's section its consumer is made with.

    Only this topic's positions change (commits of the earliest offsets still there), whatever else the group
    holds. A replay of the group running meanwhile would commit its own progress over the reset."""
    consumer = kafka_call(
        "create a consumer",
        lambda: create_consumer(
            kafka, pipeline, overrides={"group.id": group, "isolation.level": "read_uncommitted"}
        ),
        kafka,
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
                kafka,
            )
        return resets
    finally:
        consumer.close()
