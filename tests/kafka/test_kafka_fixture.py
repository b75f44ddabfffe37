"""The session broker works end to end: records round-trip intact and topic creation is idempotent."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable

import pytest
from confluent_kafka import Consumer, Message, Producer

from tools.harness import wait_until_served
from worker.cli.cli import main
from worker.errors import UserError
from worker.kafka.admin import TopicSpec, create_topics

pytestmark = pytest.mark.kafka


def _consume_one(kafka_config: dict[str, str], topic: str, timeout_s: float = 30.0) -> Message:
    consumer = Consumer(
        {**kafka_config, "group.id": f"test-{uuid.uuid4().hex}", "auto.offset.reset": "earliest"}
    )
    consumer.subscribe([topic])
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            message = consumer.poll(0.5)
            if message is None:
                continue
            assert message.error() is None, message.error()
            return message
        raise AssertionError(f"no record arrived on {topic} within {timeout_s:.0f}s")
    finally:
        consumer.close()


def test_round_trip_keeps_key_value_and_headers(
    kafka_config: dict[str, str], unique_topic: Callable[..., str]
) -> None:
    topic = unique_topic("round-trip", partitions=1)
    producer = Producer(kafka_config)
    value = b'{"ticket_id": "t-1", "body": "my card was charged twice"}'
    producer.produce(topic, key=b"t-1", value=value, headers=[("source", b"web"), ("empty", b"")])
    assert producer.flush(15) == 0

    message = _consume_one(kafka_config, topic)

    assert message.key() == b"t-1"
    assert message.value() == value
    assert message.headers() == [("source", b"web"), ("empty", b"")]
    assert (message.topic(), message.partition(), message.offset()) == (topic, 0, 0)


def test_unique_topic_creates_the_requested_partitions(
    kafka_config: dict[str, str], unique_topic: Callable[..., str]
) -> None:
    first, second = unique_topic("same"), unique_topic("same", partitions=2)

    assert first != second
    wait_until_served(kafka_config["bootstrap.servers"], first, 3)
    wait_until_served(kafka_config["bootstrap.servers"], second, 2)


def test_create_topics_twice_reports_existing_topics_and_keeps_them(kafka_config: dict[str, str]) -> None:
    name = f"test.idempotent.{uuid.uuid4().hex[:8]}"

    assert create_topics(kafka_config, [TopicSpec(name, 2, 1)]) == {name: "created"}
    assert create_topics(kafka_config, [TopicSpec(name, 5, 1)]) == {name: "exists"}
    wait_until_served(kafka_config["bootstrap.servers"], name, 2)


def test_topics_create_command_uses_configured_names_and_layout(
    kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run = uuid.uuid4().hex[:8]
    names = {
        "input": f"test.cli.{run}.in",
        "output": f"test.cli.{run}.out",
        "dead_letter": f"test.cli.{run}.dlq",
    }
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_bootstrap)
    monkeypatch.setenv("TRIAGE_TOPICS__PARTITIONS", "4")
    argv = [
        "topics",
        "create",
        *(arg for key, name in names.items() for arg in ("--set", f"topics.{key}={name}")),
    ]

    assert main(argv) == 0
    first = capsys.readouterr().out
    assert main(argv) == 0
    second = capsys.readouterr().out

    for name in names.values():
        assert f"{name}: created (partitions=4, replication_factor=1)" in first
        assert f"{name}: already exists" in second
        wait_until_served(kafka_bootstrap, name, 4)


def test_unreachable_cluster_gives_one_line_naming_the_address_and_reason() -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{sock.getsockname()[1]}"

    with pytest.raises(UserError, match=f"cannot reach Kafka at {address}: .*Connection refused"):
        create_topics({"bootstrap.servers": address}, [TopicSpec("never.created", 1, 1)], timeout_s=2)
