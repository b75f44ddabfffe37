"""One contract, two backends: the in-memory Kafka (tests/memory_kafka.py) against a real broker.

The loop's memory tests (tests/pipeline/: test_pipeline_memory.py, test_cascade_memory.py) trust the fake to
behave like librdkafka for the calls the pipeline makes. Each test here runs the same steps through a
`ClientFactory` from a `backend`: `MemoryKafka.clients` for the fake, the worker's own `KafkaClients`
(settings → librdkafka options) on the session broker for the real one, so a divergence fails here rather
than hiding in a green memory test. Where the two differ on something the pipeline does not rely on, the
variant is skipped with the reason.
"""

from __future__ import annotations

import contextlib
import gc
import time
import uuid
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import confluent_kafka
import pytest
from confluent_kafka import KafkaError, KafkaException, TopicPartition
from memory_kafka import MemoryKafka, as_client_factory

from worker.kafka.clients import ClientFactory, KafkaClients, produce
from worker.settings import load_settings

Key = tuple[str, int]


class Backend(Protocol):
    name: str
    # How long to wait for records that should come (the fake answers at once, a broker takes a moment).
    patience_s: float

    def topic(self, name: str, partitions: int = 2) -> str: ...

    def clients(self, group: str, transactional_id: str | None = None) -> ClientFactory: ...


class MemoryBackend:
    name = "memory"
    patience_s = 1.0

    def __init__(self) -> None:
        self.kafka = MemoryKafka(prefetch=2)

    def topic(self, name: str, partitions: int = 2) -> str:
        topic = f"{name}.{uuid.uuid4().hex[:8]}"
        self.kafka.create_topic(topic, partitions)
        return topic

    def clients(self, group: str, transactional_id: str | None = None) -> ClientFactory:
        return as_client_factory(self.kafka.clients(group, transactional_id))


class KafkaBackend:
    """The worker's `KafkaClients` on the session broker: exactly_once (transactional producer,
    read_committed consumer) when given a transactional id, at_least_once otherwise."""

    name = "kafka"
    patience_s = 30.0

    def __init__(self, bootstrap: str, unique_topic: Callable[..., str]) -> None:
        self.bootstrap, self._unique_topic = bootstrap, unique_topic

    def topic(self, name: str, partitions: int = 2) -> str:
        return self._unique_topic(name, partitions=partitions)

    def clients(self, group: str, transactional_id: str | None = None) -> ClientFactory:
        overrides: dict[str, object] = {
            "kafka.bootstrap.servers": self.bootstrap,
            "pipeline.group_id": group,
            "pipeline.guarantee": "at_least_once" if transactional_id is None else "exactly_once",
        }
        if transactional_id is not None:
            overrides["pipeline.transactional_id"] = transactional_id
        settings = load_settings(env={}, overrides=overrides)
        return KafkaClients(settings.kafka, settings.pipeline)


@pytest.fixture(params=["memory", pytest.param("kafka", marks=pytest.mark.kafka)])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "memory":
        yield MemoryBackend()
        return
    yield KafkaBackend(request.getfixturevalue("kafka_bootstrap"), request.getfixturevalue("unique_topic"))
    gc.collect()  # the test's producers (librdkafka's go with their last reference, cycles included)


def _no_error(error: KafkaError) -> None:
    if error.fatal():
        raise AssertionError(f"fatal client error: {error}")


@dataclass
class Rebalances:
    """Rebalance callbacks as the pipeline passes them, recording what each was given."""

    assigned: list[Key] = field(default_factory=list)
    revoked: list[Key] = field(default_factory=list)
    lost: list[Key] = field(default_factory=list)
    then: Callable[[Any, list[TopicPartition]], None] = lambda _consumer, _partitions: None

    def on_assign(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        self.assigned += [(tp.topic, tp.partition) for tp in partitions]
        self.then(consumer, partitions)

    def on_revoke(self, _consumer: Any, partitions: list[TopicPartition]) -> None:
        self.revoked += [(tp.topic, tp.partition) for tp in partitions]

    def on_lost(self, _consumer: Any, partitions: list[TopicPartition]) -> None:
        self.lost += [(tp.topic, tp.partition) for tp in partitions]


@pytest.fixture
def consumers() -> Iterator[Callable[..., Any]]:
    """Factory: a consumer from `clients`, subscribed to `topics` with `rebalances`; closed at the end."""
    made: list[Any] = []

    def make(clients: ClientFactory, topics: list[str], rebalances: Rebalances | None = None) -> Any:
        consumer = clients.consumer(_no_error)
        callbacks = rebalances or Rebalances()
        consumer.subscribe(
            topics, on_assign=callbacks.on_assign, on_revoke=callbacks.on_revoke, on_lost=callbacks.on_lost
        )
        made.append(consumer)
        return consumer

    yield make
    for consumer in made:
        with contextlib.suppress(RuntimeError):  # closed by the test already
            consumer.close()


def take(consumer: Any, count: int, patience_s: float) -> list[Any]:
    """Poll until `count` records came (or `patience_s` passed); fails on an error message."""
    records: list[Any] = []
    deadline = time.monotonic() + patience_s
    while len(records) < count and time.monotonic() < deadline:
        message = consumer.poll(0.1)
        if message is None:
            continue
        assert message.error() is None, message.error()
        records.append(message)
    return records


def until_assigned(consumer: Any, rebalances: Rebalances, patience_s: float) -> None:
    deadline = time.monotonic() + patience_s
    while not rebalances.assigned:
        assert time.monotonic() < deadline, "no assignment"
        assert consumer.poll(0.1) is None, "a record before the test wanted one"


def key_for(partition: int, partitions: int) -> bytes:
    """A key that both backends put on `partition`: librdkafka's default partitioner (consistent_random) is
    CRC32 of the key modulo the partition count, as the fake's."""
    return next(
        key
        for key in (f"key-{index}".encode() for index in range(1000))
        if zlib.crc32(key) % partitions == partition
    )


def send(producer: Any, topic: str, records: list[tuple[bytes, bytes]], headers: Any = None) -> list[Any]:
    """Produce (key, value) records through the worker's `produce`, flush, and return the delivery reports
    as (error, topic, partition, offset)."""
    reports: list[Any] = []

    def delivered(error: KafkaError | None, message: Any) -> None:
        reports.append((error, message.topic(), message.partition(), message.offset()))

    for key, value in records:
        produce(producer, topic, value, key, headers, delivered)
    producer.flush(30)
    return reports


# -- records -----------------------------------------------------------------------------------------------


def test_a_record_comes_back_with_its_key_value_headers_and_offset(
    backend: Backend, consumers: Callable[..., Any]
) -> None:
    topic = backend.topic("round-trip", partitions=2)
    clients = backend.clients(f"group-{uuid.uuid4().hex[:8]}")
    producer = clients.producer(_no_error)
    key = key_for(1, 2)
    headers = [("kind", b"ticket"), ("empty", None)]
    reports = send(producer, topic, [(key, b"a"), (key, b"b")], headers)
    reports += send(producer, topic, [(key, b"c")])
    assert reports == [(None, topic, 1, 0), (None, topic, 1, 1), (None, topic, 1, 2)]

    records = take(consumers(clients, [topic]), 3, backend.patience_s)
    got = [(r.topic(), r.partition(), r.offset(), r.key(), r.value(), r.headers()) for r in records]
    assert got == [
        (topic, 1, 0, key, b"a", headers),
        (topic, 1, 1, key, b"b", headers),
        (topic, 1, 2, key, b"c", None),
    ]


def test_poll_gives_none_when_nothing_comes_within_its_timeout(
    backend: Backend, consumers: Callable[..., Any]
) -> None:
    topic = backend.topic("quiet", partitions=1)
    rebalances = Rebalances()
    consumer = consumers(backend.clients(f"group-{uuid.uuid4().hex[:8]}"), [topic], rebalances)
    until_assigned(consumer, rebalances, backend.patience_s)
    assert consumer.poll(0.2) is None
    assert consumer.consume(10, 0.2) == []


def test_consume_takes_a_batch_and_position_and_watermarks_follow_it(
    backend: Backend, consumers: Callable[..., Any]
) -> None:
    """What the lag gauge (worker/pipeline/metrics.py) and the side-topic reader (consume) rely on."""
    topic = backend.topic("batch", partitions=1)
    clients = backend.clients(f"group-{uuid.uuid4().hex[:8]}")
    send(clients.producer(_no_error), topic, [(b"k", b"%d" % n) for n in range(4)])
    consumer = consumers(clients, [topic])
    partition = TopicPartition(topic, 0)
    deadline = time.monotonic() + backend.patience_s
    batch: list[Any] = []
    while len(batch) < 4 and time.monotonic() < deadline:
        batch += consumer.consume(num_messages=4 - len(batch), timeout=0.1)
    assert [(r.offset(), r.value()) for r in batch] == [(0, b"0"), (1, b"1"), (2, b"2"), (3, b"3")]
    assert [tp.offset for tp in consumer.position([partition])] == [4]
    assert consumer.get_watermark_offsets(partition, timeout=10) == (0, 4)


def test_the_position_is_unknown_before_the_first_record(
    backend: Backend, consumers: Callable[..., Any]
) -> None:
    # Differs, relied on by nobody: the fake knows the start offset at assignment; the lag gauge skips both.
    if backend.name == "memory":
        pytest.skip("the fake's position is the start offset from the assignment on (only a gauge reads it)")
    topic = backend.topic("position", partitions=1)
    rebalances = Rebalances()
    consumer = consumers(backend.clients(f"group-{uuid.uuid4().hex[:8]}"), [topic], rebalances)
    until_assigned(consumer, rebalances, backend.patience_s)
    assert consumer.poll(0.5) is None
    assert [tp.offset for tp in consumer.position([TopicPartition(topic, 0)])] == [
        confluent_kafka.OFFSET_INVALID
    ]


# -- the group ---------------------------------------------------------------------------------------------


def test_subscribe_assigns_through_on_assign_and_close_revokes(
    backend: Backend, consumers: Callable[..., Any]
) -> None:
    topic = backend.topic("rebalance", partitions=3)
    rebalances = Rebalances()
    consumer = consumers(backend.clients(f"group-{uuid.uuid4().hex[:8]}"), [topic], rebalances)
    until_assigned(consumer, rebalances, backend.patience_s)
    everything = [(topic, 0), (topic, 1), (topic, 2)]
    assert sorted(rebalances.assigned) == everything
    assert rebalances.revoked == []

    consumer.close()
    assert sorted(rebalances.revoked) == everything
    assert rebalances.lost == []


def test_seek_moves_the_next_poll_to_that_offset(backend: Backend, consumers: Callable[..., Any]) -> None:
    topic = backend.topic("seek", partitions=1)
    clients = backend.clients(f"group-{uuid.uuid4().hex[:8]}")
    send(clients.producer(_no_error), topic, [(b"k", str(n).encode()) for n in range(5)])
    consumer = consumers(clients, [topic])
    assert [r.offset() for r in take(consumer, 5, backend.patience_s)] == [0, 1, 2, 3, 4]

    consumer.seek(TopicPartition(topic, 0, 2))
    assert [r.offset() for r in take(consumer, 3, backend.patience_s)] == [2, 3, 4]


def test_a_paused_partition_gives_nothing_until_resumed(
    backend: Backend, consumers: Callable[..., Any]
) -> None:
    topic = backend.topic("pause", partitions=2)
    clients = backend.clients(f"group-{uuid.uuid4().hex[:8]}")
    producer = clients.producer(_no_error)
    send(producer, topic, [(key_for(0, 2), b"zero-%d" % n) for n in range(3)])
    send(producer, topic, [(key_for(1, 2), b"one-%d" % n) for n in range(3)])

    def pause_partition_0(consumer: Any, partitions: list[TopicPartition]) -> None:
        # As the pipeline's on_assign does: assign, then pause before the first fetch.
        consumer.incremental_assign(partitions)
        consumer.pause([TopicPartition(topic, 0)])

    consumer = consumers(clients, [topic], Rebalances(then=pause_partition_0))
    first = take(consumer, 3, backend.patience_s)
    assert [(r.partition(), r.offset()) for r in first] == [(1, 0), (1, 1), (1, 2)]
    assert take(consumer, 1, 1.0) == []  # partition 0 has records, but is paused

    consumer.resume([TopicPartition(topic, 0)])
    assert [(r.partition(), r.offset()) for r in take(consumer, 3, backend.patience_s)] == [
        (0, 0),
        (0, 1),
        (0, 2),
    ]


def test_committed_offsets_are_returned_and_where_the_next_member_starts(
    backend: Backend, consumers: Callable[..., Any]
) -> None:
    topic = backend.topic("commit", partitions=2)
    clients = backend.clients(f"group-{uuid.uuid4().hex[:8]}")
    send(clients.producer(_no_error), topic, [(key_for(0, 2), b"%d" % n) for n in range(5)])
    first = consumers(clients, [topic])
    assert len(take(first, 5, backend.patience_s)) == 5

    first.commit(offsets=[TopicPartition(topic, 0, 3)], asynchronous=False)
    stored = first.committed([TopicPartition(topic, 0), TopicPartition(topic, 1)], timeout=10)
    assert [(tp.partition, tp.offset) for tp in stored] == [(0, 3), (1, confluent_kafka.OFFSET_INVALID)]
    first.close()

    second = consumers(clients, [topic])
    assert [(r.partition(), r.offset()) for r in take(second, 2, backend.patience_s)] == [(0, 3), (0, 4)]


# -- transactions ------------------------------------------------------------------------------------------


def _tid() -> str:
    return f"contract-{uuid.uuid4().hex[:8]}"


def test_a_committed_transaction_shows_its_records_and_commits_the_group_offsets(
    backend: Backend, consumers: Callable[..., Any]
) -> None:
    source, sink = backend.topic("txn-in", partitions=1), backend.topic("txn-out", partitions=1)
    group = f"group-{uuid.uuid4().hex[:8]}"
    clients = backend.clients(group, _tid())
    plain = backend.clients(group)
    send(plain.producer(_no_error), source, [(b"k", b"in-%d" % n) for n in range(3)])
    consumer = consumers(clients, [source])
    assert len(take(consumer, 3, backend.patience_s)) == 3

    producer = clients.producer(_no_error)
    producer.init_transactions(30)
    producer.begin_transaction()
    for n in range(2):
        produce(producer, sink, b"out-%d" % n, b"k")
    producer.send_offsets_to_transaction(
        [TopicPartition(source, 0, 3)], consumer.consumer_group_metadata(), 30
    )
    producer.commit_transaction(30)

    assert [tp.offset for tp in consumer.committed([TopicPartition(source, 0)], timeout=10)] == [3]
    consumer.close()  # the fake models one group at a time: its members leave before a reader joins
    reader = consumers(backend.clients(f"reader-{uuid.uuid4().hex[:8]}", _tid()), [sink])
    assert [r.value() for r in take(reader, 2, backend.patience_s)] == [b"out-0", b"out-1"]


def test_an_aborted_transaction_hides_its_records_from_a_read_committed_reader(
    backend: Backend, consumers: Callable[..., Any]
) -> None:
    sink = backend.topic("txn-abort", partitions=1)
    clients = backend.clients(f"group-{uuid.uuid4().hex[:8]}", _tid())
    producer = clients.producer(_no_error)
    producer.init_transactions(30)
    producer.begin_transaction()
    produce(producer, sink, b"aborted-0", b"k")
    produce(producer, sink, b"aborted-1", b"k")
    producer.flush(30)  # written to the log, then aborted
    producer.abort_transaction(30)
    producer.begin_transaction()
    produce(producer, sink, b"kept", b"k")
    producer.commit_transaction(30)

    reader = consumers(backend.clients(f"reader-{uuid.uuid4().hex[:8]}", _tid()), [sink])
    assert [r.value() for r in take(reader, 1, backend.patience_s)] == [b"kept"]
    assert take(reader, 1, 1.0) == []  # nothing else, aborted records included
    # Offsets after a transaction are not compared: a broker writes control records (commit and abort
    # markers) that take offsets, the fake does not (its docstring says so); the pipeline never counts them.


def test_a_transactional_producer_refuses_a_record_outside_a_transaction(backend: Backend) -> None:
    topic = backend.topic("no-txn", partitions=1)
    producer = backend.clients(f"group-{uuid.uuid4().hex[:8]}", _tid()).producer(_no_error)
    producer.init_transactions(30)
    with pytest.raises(KafkaException) as refused:
        produce(producer, topic, b"loose", b"k")
    assert refused.value.args[0].code() == KafkaError._STATE


def test_a_newer_producer_with_the_same_transactional_id_fences_the_older(backend: Backend) -> None:
    topic = backend.topic("fenced", partitions=1)
    tid = _tid()
    older = backend.clients(f"group-{uuid.uuid4().hex[:8]}", tid).producer(lambda _error: None)
    older.init_transactions(30)
    newer = backend.clients(f"group-{uuid.uuid4().hex[:8]}", tid).producer(_no_error)
    newer.init_transactions(30)
    with pytest.raises(KafkaException) as fenced:
        older.begin_transaction()
        produce(older, topic, b"zombie", b"k")
        older.commit_transaction(30)
    assert fenced.value.args[0].fatal()


# -- refused records ---------------------------------------------------------------------------------------


def test_a_record_over_the_size_limit_is_refused_before_it_is_queued(backend: Backend) -> None:
    """The pipeline dead-letters such a ticket (worker/pipeline/settlements/delivery.py) on this very
    exception."""
    topic = backend.topic("too-large", partitions=1)
    producer = backend.clients(f"group-{uuid.uuid4().hex[:8]}").producer(_no_error)
    with pytest.raises(KafkaException) as refused:
        produce(producer, topic, b"x" * 1_100_000, b"k")  # librdkafka's default message.max.bytes: 1 000 000
    assert refused.value.args[0].code() == KafkaError.MSG_SIZE_TOO_LARGE
    assert len(producer) == 0


def test_a_record_for_an_unknown_topic_is_not_delivered(backend: Backend) -> None:
    # Differs, relied on by nobody: the broker auto-creates the topic; the worker checks its topics at start.
    if backend.name == "kafka":
        pytest.skip("the session broker auto-creates topics (auto.create.topics.enable)")
    producer = backend.clients(f"group-{uuid.uuid4().hex[:8]}").producer(_no_error)
    [(error, _topic, _partition, offset)] = send(producer, f"missing.{uuid.uuid4().hex[:8]}", [(b"k", b"v")])
    assert error is not None and error.code() == KafkaError._UNKNOWN_TOPIC
    assert offset is None
