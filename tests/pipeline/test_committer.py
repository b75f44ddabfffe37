"""The committer against the real broker: outcomes report what the broker confirmed, one commit at a time."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import confluent_kafka
import pytest

from worker.kafka.commits import consumer_commit
from worker.pipeline.settlements.committer import Committer

pytestmark = pytest.mark.kafka


@pytest.fixture
def consumer(kafka_bootstrap: str) -> Iterator[confluent_kafka.Consumer]:
    client = confluent_kafka.Consumer(
        {"bootstrap.servers": kafka_bootstrap, "group.id": f"committer-{uuid.uuid4().hex[:8]}"}
    )
    yield client
    client.close()


def test_a_confirmed_commit_is_reported_and_stored_by_the_group(
    consumer: confluent_kafka.Consumer, unique_topic: Callable[..., str]
) -> None:
    topic = unique_topic("committed", partitions=2)
    committer = Committer(consumer_commit(consumer))
    try:
        for _ in range(20):  # a young broker's group coordinator may still be loading or moving
            committer.submit({(topic, 0): 5, (topic, 1): 7})
            assert committer.wait_idle(30)
            [outcome] = committer.results()
            if "COORDINATOR" not in (outcome.error or ""):
                break
            time.sleep(0.5)
    finally:
        committer.close()
    assert outcome.confirmed == {(topic, 0): 5, (topic, 1): 7}, outcome
    assert outcome.failed == {}
    stored = consumer.committed([confluent_kafka.TopicPartition(topic, p) for p in (0, 1)], timeout=10)
    assert [tp.offset for tp in stored] == [5, 7]
    assert committer.results() == []  # an outcome is handed over once


def test_a_refused_commit_is_reported_as_failed_with_the_reason(consumer: confluent_kafka.Consumer) -> None:
    committer = Committer(consumer_commit(consumer))
    missing = f"no-such-topic-{uuid.uuid4().hex[:8]}"
    try:
        committer.submit({(missing, 0): 3})
        assert committer.wait_idle(30)
        [outcome] = committer.results()
    finally:
        committer.close()
    assert outcome.confirmed == {}
    assert outcome.failed == {(missing, 0): 3}


def test_only_one_commit_is_outstanding(
    consumer: confluent_kafka.Consumer, unique_topic: Callable[..., str]
) -> None:
    topic = unique_topic("single", partitions=1)
    committer = Committer(consumer_commit(consumer))
    try:
        committer.submit({(topic, 0): 1})
        if committer.busy:  # the broker may already have answered
            with pytest.raises(RuntimeError, match="already outstanding"):
                committer.submit({(topic, 0): 2})
        assert committer.wait_idle(30)
        assert not committer.busy
    finally:
        committer.close()
