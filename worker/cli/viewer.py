"""Reading the output and dead-letter topics as a person would: one line per triage record or dead letter.

`watch` and `demo` print through here, so a record looks the same wherever it is shown.
"""

from __future__ import annotations

import time
import uuid

import confluent_kafka
import msgspec

from worker.errors import UserError
from worker.kafka import dead_letters
from worker.kafka.clients import create_consumer
from worker.messages import TriageResult
from worker.settings import Settings

_TOPIC_READY_TIMEOUT_S = 30.0
# Errors of a topic created a moment ago, before its partitions have a leader.
_LEADER_PENDING = frozenset(
    {
        confluent_kafka.KafkaError.NOT_LEADER_FOR_PARTITION,
        confluent_kafka.KafkaError.LEADER_NOT_AVAILABLE,
        confluent_kafka.KafkaError.UNKNOWN_TOPIC_OR_PART,
    }
)


def open_viewer(settings: Settings, from_beginning: bool) -> confluent_kafka.Consumer:
    """A consumer of the output and dead-letter topics, by assignment (no group membership, no commits), from
    their beginning or from their current end (only what arrives from now on)."""
    # Through the worker's client options, so SASL/TLS settings apply here too.
    consumer = create_consumer(
        settings.kafka, settings.pipeline, overrides={"group.id": f"triage-viewer-{uuid.uuid4().hex[:8]}"}
    )
    partitions = []
    for topic in (settings.topics.output, settings.topics.dead_letter):
        metadata = consumer.list_topics(topic, timeout=15).topics[topic]
        if metadata.error is not None:
            consumer.close()
            raise UserError(
                f"topic {topic} does not exist; create the topics with `triage-worker topics create`"
            )
        for partition in metadata.partitions:
            key = confluent_kafka.TopicPartition(topic, partition)
            start = confluent_kafka.OFFSET_BEGINNING if from_beginning else _end_offset(consumer, key)
            partitions.append(confluent_kafka.TopicPartition(topic, partition, start))
    consumer.assign(partitions)
    return consumer


def _end_offset(consumer: confluent_kafka.Consumer, partition: confluent_kafka.TopicPartition) -> int:
    """The partition's end offset, retried while a just-created topic has no leader yet."""
    give_up = time.monotonic() + _TOPIC_READY_TIMEOUT_S
    while True:
        try:
            _, high = consumer.get_watermark_offsets(partition, timeout=5)
            return int(high)
        except confluent_kafka.KafkaException as error:
            if not error.args[0].retriable() and error.args[0].code() not in _LEADER_PENDING:
                raise
            if time.monotonic() > give_up:
                raise UserError(
                    f"topic {partition.topic} has no leader after {_TOPIC_READY_TIMEOUT_S:.0f} s: "
                    f"{error.args[0].str()}"
                ) from None
            time.sleep(0.2)


def decode_result(message: confluent_kafka.Message) -> TriageResult | None:
    """The triage record in an output-topic message, None when it is not one."""
    value = message.value()
    if value is None:
        return None
    try:
        return msgspec.json.decode(value, type=TriageResult)
    except msgspec.DecodeError:
        return None


def result_line(result: TriageResult, text: str = "") -> str:
    """ticket id, intent, priority, confidence (or the fallback's reason), latency, and the ticket's text
    when the caller knows it."""
    label = f"FALLBACK:{result.fallback_reason}" if result.fallback else f"{result.confidence:.2f}"
    line = (
        f"  {result.ticket_id:<16} {result.intent:<28.28} {result.priority:<8} {label:<10} "
        f"{result.latency_ms:6.0f} ms"
    )
    return f"{line}  {text[:48]!r}" if text else line


def dead_letter_line(message: confluent_kafka.Message) -> str:
    """Where the record came from and why it was dead-lettered, from its `triage.*` headers."""
    raw = message.headers() or []
    pairs = raw.items() if isinstance(raw, dict) else raw
    headers = {k: v.decode(errors="replace") for k, v in pairs if isinstance(v, bytes)}
    topic, partition = headers.get(dead_letters.SOURCE_TOPIC), headers.get(dead_letters.SOURCE_PARTITION)
    where = f"{topic}[{partition}]@{headers.get(dead_letters.SOURCE_OFFSET)}"
    reason = f"{headers.get(dead_letters.ERROR_TYPE)}: {headers.get(dead_letters.ERROR_MESSAGE, '')[:70]}"
    return f"  DEAD LETTER      {where}  {reason}"
