"""A partition held because an open transaction keeps the group's committed offsets unstable: the worker
waits (it must not guess a start), and once the hold outlasts any live transaction it tells the operator,
with how to end a hanging one (worker/kafka/starts.py)."""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

import confluent_kafka
from structlog.testing import capture_logs

from worker.kafka.starts import HANGING_AFTER_S, HANGING_REPEAT_S, StartPositions

PARTITIONS = [confluent_kafka.TopicPartition("tickets", 0), confluent_kafka.TopicPartition("tickets", 1)]


class _UnstableOffsets:
    """A consumer whose group coordinator answers UNSTABLE_OFFSET_COMMIT (librdkafka retries it until the
    call's timeout) until `stable`, then offset 42 for every partition."""

    def __init__(self) -> None:
        self.stable = False
        self.seeks: list[tuple[str, int, int]] = []

    def committed(self, partitions: list[Any], timeout: float = -1) -> list[Any]:
        if not self.stable:
            raise confluent_kafka.KafkaException(
                confluent_kafka.KafkaError(
                    confluent_kafka.KafkaError._TIMED_OUT, "Failed to get committed offsets"
                )
            )
        return [confluent_kafka.TopicPartition(tp.topic, tp.partition, 42) for tp in partitions]

    def seek(self, partition: Any) -> None:
        self.seeks.append((partition.topic, partition.partition, partition.offset))


def _held_long(logs: Sequence[MutableMapping[str, Any]]) -> list[MutableMapping[str, Any]]:
    return [line for line in logs if line["event"] == "partitions_held_long"]


def _said(logs: Sequence[MutableMapping[str, Any]]) -> list[str]:
    """What an operator sees at the default level: info and above."""
    return [line["event"] for line in logs if line["log_level"] != "debug"]


def test_a_hold_past_any_live_transaction_is_named_with_its_remedy_then_repeated_rarely() -> None:
    consumer, now = _UnstableOffsets(), [1000.0]
    starts = StartPositions(consumer, "earliest", clock=lambda: now[0])
    with capture_logs() as logs:
        starts.assignment(PARTITIONS)
        for step in range(1, int(HANGING_AFTER_S) * 2):  # a loop turn a second, for two minutes
            now[0] = 1000.0 + step
            assert starts.resolve() == []
    (warning,) = _held_long(logs)  # once, not every turn
    assert warning["log_level"] == "warning"
    assert warning["partitions"] == ["tickets[0]", "tickets[1]"]
    assert warning["held_s"] == HANGING_AFTER_S
    assert "kafka-transactions.sh" in warning["reason"] and "find-hanging" in warning["reason"]
    assert consumer.seeks == []  # nothing read from a partition whose start is unknown

    with capture_logs() as logs:
        now[0] = 1000.0 + HANGING_AFTER_S + HANGING_REPEAT_S
        starts.resolve()
    assert len(_held_long(logs)) == 1  # while it lasts, said again every HANGING_REPEAT_S

    consumer.stable = True  # an operator aborted the hanging transaction
    with capture_logs() as logs:
        now[0] += 1.0
        assert starts.resolve() == [("tickets", 0), ("tickets", 1)]
    assert consumer.seeks == [("tickets", 0, 42), ("tickets", 1, 42)]
    assert _said(logs) == ["partitions_released"]


def test_a_short_hold_while_a_dead_worker_s_transaction_times_out_says_nothing_more() -> None:
    consumer, now = _UnstableOffsets(), [0.0]
    starts = StartPositions(consumer, "earliest", clock=lambda: now[0])
    with capture_logs() as logs:
        starts.assignment(PARTITIONS)
        for step in range(1, 20):  # the transaction ends within its 10 s timeout
            now[0] = float(step)
            starts.resolve()
        consumer.stable = True
        now[0] = 20.0
        starts.resolve()
    assert _held_long(logs) == []
    assert _said(logs) == ["partitions_held", "partitions_released"]
