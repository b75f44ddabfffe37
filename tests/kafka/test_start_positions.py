"""Where a newly assigned partition starts while an open transaction holds the group's committed offsets
(issue #30: exactly-once chaos with seed 29 re-read 8,478 committed tickets; worker/kafka/starts.py).

A worker killed between `send_offsets_to_transaction` and its commit leaves such a transaction; here it is
left open on purpose (a long `transaction.timeout.ms`) and aborted when the test says so. Against a real
broker: first librdkafka alone, then the worker.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import confluent_kafka
import pytest

from tools.harness import Worker, audit, end_offsets, make_topics, publish, wait_until_committed

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


def _commit(bootstrap: str, group: str, positions: dict[tuple[str, int], int]) -> None:
    """A plain group commit, retried while a new group's coordinator is being set up."""
    consumer = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        wanted = [confluent_kafka.TopicPartition(t, p, o) for (t, p), o in positions.items()]
        deadline = time.monotonic() + 30
        while True:
            try:
                consumer.commit(offsets=wanted, asynchronous=False)
                return
            except confluent_kafka.KafkaException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    finally:
        consumer.close()


@contextmanager
def _open_transaction(
    bootstrap: str, group: str, positions: dict[tuple[str, int], int]
) -> Iterator[confluent_kafka.Producer]:
    """A transaction holding `positions` as the group's offsets, left open (as by a worker killed before its
    commit) until the caller aborts it; aborted on the way out in any case."""
    producer = confluent_kafka.Producer(
        {
            "bootstrap.servers": bootstrap,
            "transactional.id": f"dead-{group}",
            "transaction.timeout.ms": 120000,
        }
    )
    producer.init_transactions(30)
    producer.begin_transaction()
    member = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        offsets = [confluent_kafka.TopicPartition(t, p, o) for (t, p), o in positions.items()]
        producer.send_offsets_to_transaction(offsets, member.consumer_group_metadata(), 30)
        yield producer
    finally:
        member.close()
        with contextlib.suppress(confluent_kafka.KafkaException):  # already aborted by the test
            producer.abort_transaction(30)


def _halfway(bootstrap: str, topic: str) -> dict[tuple[str, int], int]:
    return {(topic, p): end // 2 for p, end in end_offsets(bootstrap, topic).items()}


def test_librdkafka_alone_starts_such_a_partition_at_the_beginning_when_its_assignment_changes(
    kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    """Why the worker sets every start itself: a bare consumer of the group, assigned two partitions whose
    committed offsets (50) an open transaction holds, waits; a second member joins (the first keeps one
    partition), and the first starts its partition at offset 0 (auto.offset.reset) although 50 is committed.
    If this test fails, librdkafka no longer does that and worker/kafka/starts.py says more than it must."""
    topic = unique_topic("raw", partitions=2)
    producer = confluent_kafka.Producer({"bootstrap.servers": kafka_bootstrap})
    for partition in (0, 1):
        for index in range(100):
            producer.produce(topic, f"{partition}-{index}".encode(), partition=partition)
    producer.flush(30)
    group = f"bare-{uuid.uuid4().hex[:8]}"
    _commit(kafka_bootstrap, group, {(topic, p): 50 for p in (0, 1)})
    config = {
        "bootstrap.servers": kafka_bootstrap,
        "group.id": group,
        "partition.assignment.strategy": "cooperative-sticky",
        "auto.offset.reset": "earliest",
        "enable.auto.commit": False,
        "isolation.level": "read_committed",
    }
    first_offsets: dict[tuple[str, int], int] = {}

    def take(consumer: confluent_kafka.Consumer, name: str, seconds: float) -> None:
        until = time.monotonic() + seconds
        while time.monotonic() < until:
            message = consumer.poll(0.05)
            if message is None or message.error() is not None:
                continue
            partition = message.partition()
            if partition is not None:
                first_offsets.setdefault((name, partition), message.offset() or 0)

    with _open_transaction(kafka_bootstrap, group, {(topic, p): 60 for p in (0, 1)}):
        first = confluent_kafka.Consumer(config)
        second = confluent_kafka.Consumer(config)
        try:
            first.subscribe([topic])
            take(first, "first", 6)
            assert first_offsets == {}  # librdkafka waits while the offsets are unstable...
            second.subscribe([topic])
            until = time.monotonic() + 10
            while time.monotonic() < until and not first_offsets:
                take(first, "first", 0.2)
                take(second, "second", 0.2)
        finally:
            first.close()
            second.close()
    # ...until the assignment changes: then the partition the first member kept starts from the beginning.
    assert list(first_offsets.values()) == [0], first_offsets


def test_exactly_once_workers_start_where_the_group_committed_while_a_dead_worker_s_transaction_is_open(
    kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    """The same situation with two exactly-once workers: the first is assigned both partitions while a dead
    worker's transaction holds their offsets, the second joins (the assignment changes), then the transaction
    ends. Nothing below the group's committed offsets is written again; everything above once."""
    topics = make_topics(unique_topic, partitions=2)
    publish(kafka_bootstrap, topics, 400, malformed_ratio=0.1, seed=30)
    group = f"triage-test-{uuid.uuid4().hex[:8]}"
    committed = _halfway(kafka_bootstrap, topics.input)
    _commit(kafka_bootstrap, group, committed)

    def settings(member: str) -> dict[str, str]:
        return {"pipeline.guarantee": "exactly_once", "pipeline.transactional_id": f"{group}-{member}"}

    workers: list[Worker] = []
    try:
        with _open_transaction(kafka_bootstrap, group, {k: o + 10 for k, o in committed.items()}) as dead:
            first = Worker(kafka_bootstrap, topics, group, tmp_path, "first", settings("first"))
            workers.append(first)
            first.wait_for("partitions_held", timeout=90)
            second = Worker(kafka_bootstrap, topics, group, tmp_path, "second", settings("second"))
            workers.append(second)
            deadline = time.monotonic() + 90
            while not any(event["partitions"] for event in second.events("partitions_assigned")):
                assert time.monotonic() < deadline, "the second worker got no partition"
                time.sleep(0.2)
            time.sleep(3)  # librdkafka would have started the first worker's partition over by now
            dead.abort_transaction(30)
        wait_until_committed(kafka_bootstrap, group, topics.input, timeout=180, worker=first)
        for worker in workers:
            assert worker.stop() == 0
    finally:
        for worker in workers:
            worker.kill()

    report = audit(kafka_bootstrap, topics)
    below = [p for p in report.inputs if p[1] < committed[(topics.input, p[0])]]
    rewritten = sorted(p for p in below if p in report.copies)
    assert rewritten == [], f"{len(rewritten)} committed inputs written again, first {rewritten[:5]}"
    above = [p for p in report.inputs if p[1] >= committed[(topics.input, p[0])]]
    assert [p for p in above if p in report.lost] == []
    assert report.duplicates == 0
    assert report.misrouted == []
