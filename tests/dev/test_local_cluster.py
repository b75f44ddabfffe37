"""The three-node local cluster: one node down (even by kill -9) leaves producers with acks=all and
consumers working, as replication factor 3 and min.insync.replicas 2 promise; and a transactional id's
coordinator is the node Kafka's own mapping names."""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient

from worker.dev import local_broker
from worker.kafka.admin import TopicSpec, create_topics


def _quiet(_line: str) -> None:
    pass


def _read(bootstrap: str, topic: str, count: int, timeout_s: float = 60.0) -> list[bytes]:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"test-{uuid.uuid4().hex}",
            "auto.offset.reset": "earliest",
        }
    )
    consumer.subscribe([topic])
    values: list[bytes] = []
    try:
        deadline = time.monotonic() + timeout_s
        while len(values) < count and time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is not None and message.error() is None and (value := message.value()) is not None:
                values.append(value)
    finally:
        consumer.close()
    return values


@pytest.mark.kafka
@pytest.mark.slow
def test_a_killed_node_leaves_the_cluster_writing_and_reading(tmp_path: Path) -> None:
    cluster = local_broker.LocalCluster(
        tmp_path / "cluster", port=local_broker.free_port_block(local_broker.CLUSTER_SIZE)
    )
    cluster.start(echo=_quiet)
    try:
        topic = f"test.cluster.{uuid.uuid4().hex[:8]}"
        create_topics({"bootstrap.servers": cluster.bootstrap}, [TopicSpec(topic, 1, 3)])
        replicas = AdminClient({"bootstrap.servers": cluster.bootstrap}).list_topics(topic, timeout=10)
        assert len(replicas.topics[topic].partitions[0].replicas) == 3
        leader = cluster.leader_of(topic, 0)

        cluster.kill_node(leader)
        assert leader not in cluster.running()

        producer = Producer(
            {"bootstrap.servers": cluster.bootstrap, "acks": "all", "message.timeout.ms": 60000}
        )
        for index in range(10):
            producer.produce(topic, value=f"after kill {index}".encode())
        assert producer.flush(60) == 0
        assert cluster.leader_of(topic, 0) != leader
        assert sorted(_read(cluster.bootstrap, topic, 10)) == sorted(
            f"after kill {i}".encode() for i in range(10)
        )

        cluster.start_node(leader, echo=_quiet)
        assert cluster.running() == [1, 2, 3]
    finally:
        cluster.stop()
    assert cluster.running() == []


@pytest.mark.parametrize(
    ("transactional_id", "java_hash_code"),
    # String.hashCode as Java 17 prints it; the last one holds a character outside the BMP (a surrogate pair).
    [("my-txn", -1061187895), ("chaos-1a2b3c4d-007", 2095623703), ("é-tx😀", -1872439989)],
)
def test_the_coordinator_partition_is_javas_string_hash(transactional_id: str, java_hash_code: int) -> None:
    assert local_broker.transaction_state_partition(transactional_id) == abs(java_hash_code) % 50
