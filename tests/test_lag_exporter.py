"""`triage-worker lag-exporter` against the real broker: the group's lag per partition with no worker up."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Callable

import confluent_kafka
import pytest
from prometheus_client import CollectorRegistry
from test_telemetry_e2e import scrape

from tools import REPO
from worker.errors import UserError
from worker.kafka.admin import GroupLagReader, TopicSpec, create_topics
from worker.kafka.clients import kafka_call
from worker.ops.lag_command import GroupLagCollector

pytestmark = pytest.mark.kafka


def _commit(bootstrap: str, group: str, offsets: dict[tuple[str, int], int]) -> None:
    consumer = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    positions = [confluent_kafka.TopicPartition(t, p, o) for (t, p), o in offsets.items()]
    try:
        # Retried while a new broker's group coordinator is still being elected (NOT_COORDINATOR).
        kafka_call("commit", lambda: consumer.commit(offsets=positions, asynchronous=False))
    finally:
        consumer.close()


def test_the_lag_is_end_minus_committed_per_partition_read_from_the_broker(
    kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    topic, group = unique_topic("lag"), f"lag-{uuid.uuid4().hex[:8]}"
    create_topics({"bootstrap.servers": kafka_bootstrap}, [TopicSpec(topic, 3, 1)])
    producer = confluent_kafka.Producer({"bootstrap.servers": kafka_bootstrap})
    for partition, count in enumerate((10, 4, 7)):
        for index in range(count):
            producer.produce(topic, value=f"{index}".encode(), partition=partition)
    assert producer.flush(30) == 0
    _commit(kafka_bootstrap, group, {(topic, 0): 6, (topic, 1): 4})  # partition 2: never committed

    reader = GroupLagReader({"bootstrap.servers": kafka_bootstrap})
    assert reader.read(group, topic) == {0: 4, 1: 0, 2: 7}

    command = [
        sys.executable, "-m", "worker", "lag-exporter", "--bootstrap-servers", kafka_bootstrap,
        "--group", group, "--topic", topic, "--port", "0", "--host", "127.0.0.1",
    ]  # fmt: skip
    exporter = subprocess.Popen(command, cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        assert exporter.stderr is not None
        line = exporter.stderr.readline()
        assert line.startswith(f"lag of group {group} on {topic}: http://127.0.0.1:"), line
        port = int(line.rsplit(":", 1)[1].split("/")[0])
        samples = scrape(port)
        assert {
            dict(labels)["partition"]: value
            for (name, labels), value in samples.items()
            if name == "triage_group_lag" and dict(labels)["group"] == group
        } == {"0": 4, "1": 0, "2": 7}
        assert samples[("triage_group_lag_read_ok", (("group", group), ("topic", topic)))] == 1
        _commit(kafka_bootstrap, group, {(topic, 2): 7})
        assert (
            scrape(port)[("triage_group_lag", (("group", group), ("partition", "2"), ("topic", topic)))] == 0
        )
        exporter.terminate()
        assert exporter.wait(30) == 0
    finally:
        exporter.kill()


def test_a_missing_topic_or_an_unreachable_broker_reads_as_not_ok(kafka_bootstrap: str) -> None:
    reader = GroupLagReader({"bootstrap.servers": kafka_bootstrap})
    with pytest.raises(UserError, match="topic 'no-such-topic-"):
        reader.read("g", f"no-such-topic-{uuid.uuid4().hex[:6]}")
    gone = GroupLagReader({"bootstrap.servers": "127.0.0.1:9"})
    registry = CollectorRegistry()
    registry.register(GroupLagCollector(lambda: gone.read("g", "t", timeout_s=1.0), "g", "t"))
    started = time.monotonic()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value for f in registry.collect() for s in f.samples
    }
    assert time.monotonic() - started < 5
    assert samples == {("triage_group_lag_read_ok", (("group", "g"), ("topic", "t"))): 0}
