"""`triage-worker lag-exporter` against the real broker: the group's lag per partition with no worker up, and
a few lines, not one per reconnect attempt, while no broker answers."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import confluent_kafka
import pytest
from prometheus_client import CollectorRegistry
from test_telemetry_e2e import scrape

from tools import REPO
from worker.cli.lag_command import GroupLagCollector
from worker.dev.local_broker import free_port
from worker.errors import UserError
from worker.kafka.admin import GroupLagReader, TopicSpec, create_topics
from worker.kafka.clients import kafka_call

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


def test_an_unreachable_broker_is_a_few_structured_lines_not_one_per_attempt(tmp_path: Path) -> None:
    """Before: 678 raw `%3|...|FAIL|` lines in 40 s (one per attempt, every ~50 ms) beside one structured
    line. Now each cause is one JSON line per interval, saying how many it stands for."""
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens there
    log = tmp_path / "lag-exporter.log"
    port = free_port()
    command = [
        sys.executable, "-m", "worker", "lag-exporter", "--bootstrap-servers", nowhere, "--port", str(port),
        "--host", "127.0.0.1", "--set", "log.format=json",
    ]  # fmt: skip
    with log.open("wb") as output:
        exporter = subprocess.Popen(command, cwd=REPO, stdout=output, stderr=subprocess.STDOUT)
    try:
        started = time.monotonic()
        while time.monotonic() - started < 12.0:  # scraped every second: each read tries the broker
            time.sleep(1.0)
            with contextlib.suppress(OSError):  # not listening yet
                scrape(port)
        exporter.terminate()
        assert exporter.wait(30) == 0
    finally:
        exporter.kill()
    lines = log.read_text().splitlines()
    # Two intervals of 10 s at most: the refused connection, as librdkafka logs it and as its error
    # (transport failure, all brokers down), once each per interval; one lag_read_failed; where to scrape.
    assert len(lines) <= 8, f"{len(lines)} lines in 12 s, e.g. {lines[:3]}"
    plain = [line for line in lines if not line.startswith("{")]
    assert len(plain) == 1 and plain[0].startswith("lag of group "), plain
    events = [json.loads(line) for line in lines if line.startswith("{")]
    client = [event for event in events if event["event"] in ("librdkafka", "kafka_client_error")]
    assert client and all("suppressed_since_last" in event for event in client), events
    assert [event["event"] for event in events if event not in client] == ["lag_read_failed"]
