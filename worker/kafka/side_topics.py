"""Reading a side topic (the shadow model's, the feedback and review topics) from its beginning to its end
as of now, by assignment: no group is joined and nothing is committed, so a read never disturbs another."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from confluent_kafka import KafkaError, Message, TopicPartition

from worker.errors import UserError
from worker.kafka.admin import existing_topics
from worker.kafka.clients import create_consumer, kafka_call, producer_config
from worker.settings import PipelineSettings

_METADATA_TIMEOUT_S = 10.0
_PROGRESS_EVERY_S = 2.0
# A read that brings no record for this long while records remain below the end offsets gives up.
_STALL_S = 30.0


def read_side_topic(
    kafka: Mapping[str, str],
    pipeline: PipelineSettings,
    topic: str,
    add: Callable[[Message], None],
    progress: Callable[[int, int], None],
    what: str = "side topic",
    hint: str = "set it with --topic or topics.shadow",
) -> None:
    """Feed every record of `topic`, from its beginning to its end offsets as of now, to `add`; `what` and
    `hint` name the topic in the error when it does not exist. `kafka`: the `[kafka]` options; the reader's
    group id is made from `pipeline.group_id`."""
    bootstrap = kafka.get("bootstrap.servers", "?")
    if topic not in existing_topics(producer_config(kafka)):
        raise UserError(f"{what} {topic!r} does not exist on {bootstrap} ({hint})")
    # The user's connection options; a group id only because librdkafka wants one (assign joins no group).
    # End-of-partition events end a partition whose last offsets hold no record (compaction, markers).
    overrides = {"group.id": f"{pipeline.group_id}.side-reader", "enable.partition.eof": "true"}
    consumer = kafka_call(
        "create a consumer", lambda: create_consumer(kafka, pipeline, overrides=overrides), kafka
    )
    try:
        metadata = kafka_call(
            "read topic metadata",
            lambda: consumer.list_topics(topic, timeout=_METADATA_TIMEOUT_S),
            kafka,
        )
        ranges: dict[int, tuple[int, int]] = {}
        for partition in sorted(metadata.topics[topic].partitions):
            ranges[partition] = kafka_call(
                f"read the offsets of {topic} [{partition}]",
                partial(
                    consumer.get_watermark_offsets,
                    TopicPartition(topic, partition),
                    timeout=_METADATA_TIMEOUT_S,
                ),
                kafka,
            )
        ends = {p: high for p, (low, high) in ranges.items() if high > low}
        total = sum(high - low for low, high in ranges.values())
        if not ends:
            return
        consumer.assign([TopicPartition(topic, p, ranges[p][0]) for p in sorted(ends)])
        _consume_until(consumer, ends, total, add, progress)
    finally:
        consumer.close()


def _consume_until(
    consumer: Any,
    ends: dict[int, int],
    total: int,
    add: Callable[[Message], None],
    progress: Callable[[int, int], None],
) -> None:
    read = 0
    last_record = last_progress = time.monotonic()
    while ends:
        for message in consumer.consume(num_messages=500, timeout=0.5):
            error = message.error()
            if error is not None:
                if error.code() == KafkaError._PARTITION_EOF:
                    ends.pop(message.partition(), None)
                    continue
                if error.fatal():
                    raise UserError(f"Kafka: consumer failed: {error.str()}")
                continue  # transient (a broker moving); librdkafka retries by itself
            partition, offset = message.partition(), message.offset()
            if partition not in ends or offset >= ends[partition]:
                continue
            add(message)
            read += 1
            last_record = time.monotonic()
            if offset >= ends[partition] - 1:
                del ends[partition]
        now = time.monotonic()
        if now - last_progress >= _PROGRESS_EVERY_S:
            progress(read, total)
            last_progress = now
        if ends and now - last_record >= _STALL_S:
            left = ", ".join(f"[{p}] up to {end}" for p, end in sorted(ends.items()))
            raise UserError(f"no records for {_STALL_S:.0f}s while reading the side topic (left: {left})")
