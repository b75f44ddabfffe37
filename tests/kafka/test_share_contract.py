"""One share-group contract, two backends: tests/memory_kafka.py's `MemoryShareGroup` against a real Kafka 4.4
share group.

Queue mode (worker/pipeline/sources/share.py, settlements/acknowledgements.py) is shaped by what a share group
does with a record: who may hold it, for how long, what each acknowledgement does to it, what a delivery
costs. Its memory tests trust the fake to do the same. Each test here runs the same steps through a
`ShareClientFactory` from a `backend`: `MemoryShareGroup.clients()` for the fake, the worker's own
`ShareClients` (settings → librdkafka options, `prepare_share_group`) on the session's share-group broker for
the real one, so a divergence fails here rather than hiding in a green memory test.

Time on the broker: a group's first member waits about 5 s for its assignment (its heartbeat interval), so
each test pays that once; one test waits out the broker's shortest lock (15 s).
"""

from __future__ import annotations

import contextlib
import gc
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import pytest
from confluent_kafka import AcknowledgeType, IllegalStateException, KafkaError
from memory_kafka import MemoryKafka, MemoryShareGroup

from tools.harness import set_share_group_configs
from worker.kafka.clients import produce
from worker.kafka.share_groups import (
    DELIVERY_COUNT_LIMIT,
    LOCK_DURATION,
    ShareClientFactory,
    ShareClients,
    prepare_share_group,
    queue_kafka_options,
)
from worker.settings import load_settings

ACCEPT, RELEASE, REJECT = AcknowledgeType.ACCEPT, AcknowledgeType.RELEASE, AcknowledgeType.REJECT
# The broker's shortest lock (group.share.min.record.lock.duration.ms).
SHORTEST_LOCK_MS = 15000


class Backend(Protocol):
    name: str
    # How long to wait for records that should come, and to watch for records that should not.
    patience_s: float
    quiet_s: float

    def topic(self, name: str) -> str: ...

    def group(
        self, lock_ms: int | None = None, delivery_count_limit: int | None = None
    ) -> ShareClientFactory:
        """A new share group (starting at the earliest offset) with these configs, and its clients."""
        ...

    def lock_passes(self, seconds: float) -> None:
        """`seconds` pass for the group's locks before the next `take` ends."""
        ...


class MemoryBackend:
    name = "memory"
    patience_s = 1.0
    quiet_s = 0.0

    def __init__(self) -> None:
        self.kafka = MemoryKafka()
        self.now = 1000.0

    def topic(self, name: str) -> str:
        topic = f"{name}.{uuid.uuid4().hex[:8]}"
        self.kafka.create_topic(topic, 1)
        return topic

    def group(
        self, lock_ms: int | None = None, delivery_count_limit: int | None = None
    ) -> ShareClientFactory:
        group = MemoryShareGroup(
            self.kafka, f"group-{uuid.uuid4().hex[:8]}", lock_ms or 30000, delivery_count_limit or 5,
            clock=lambda: self.now,
        )  # fmt: skip
        return group.clients()

    def lock_passes(self, seconds: float) -> None:
        self.now += seconds


class KafkaBackend:
    """The worker's `ShareClients` on the session's share-group broker, the group prepared as `run` does."""

    name = "kafka"
    patience_s = 30.0
    quiet_s = 1.0

    def __init__(self, bootstrap: str, share_topic: Callable[..., str]) -> None:
        self.bootstrap, self._share_topic = bootstrap, share_topic

    def topic(self, name: str) -> str:
        return self._share_topic(name, 1)

    def group(
        self, lock_ms: int | None = None, delivery_count_limit: int | None = None
    ) -> ShareClientFactory:
        group = f"group-{uuid.uuid4().hex[:8]}"
        set_share_group_configs(  # as an operator sets them, before the group exists
            self.bootstrap, group, {LOCK_DURATION: lock_ms, DELIVERY_COUNT_LIMIT: delivery_count_limit}
        )
        settings = load_settings(
            env={},
            overrides={
                "kafka.bootstrap.servers": self.bootstrap,
                "pipeline.group_id": group,
                "pipeline.consume": "queue",
            },
        )
        group_settings = prepare_share_group(settings.kafka, settings.pipeline)
        return ShareClients(queue_kafka_options(settings.kafka, group_settings), settings.pipeline)

    def lock_passes(self, seconds: float) -> None:
        """The broker's clock runs on its own: the next `take` waits for it (its patience outlasts a lock)."""


@pytest.fixture(params=["memory", pytest.param("kafka", marks=pytest.mark.kafka)])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    if request.param == "memory":
        yield MemoryBackend()
        return
    yield KafkaBackend(
        request.getfixturevalue("share_group_bootstrap"), request.getfixturevalue("share_topic")
    )
    gc.collect()  # the test's producers (librdkafka's go with their last reference, cycles included)


def _no_error(error: KafkaError) -> None:
    if error.fatal():
        raise AssertionError(f"fatal client error: {error}")


class Member:
    """A share consumer as the tests drive it: `take` a batch, `acknowledge` it record by record."""

    def __init__(self, consumer: Any, patience_s: float, quiet_s: float) -> None:
        self.consumer, self.patience_s, self.quiet_s = consumer, patience_s, quiet_s
        self.batch: list[Any] = []

    def take(self) -> list[tuple[int, int, bytes]]:
        """Poll until a batch comes (or the patience ran out), as (offset, delivery count, value)."""
        deadline = time.monotonic() + self.patience_s
        while time.monotonic() < deadline:
            batch = [message for message in self.consumer.poll(0.2) or [] if message.error() is None]
            if batch:
                self.batch = batch
                return [(m.offset(), m.delivery_count(), m.value()) for m in batch]
        return []

    def acknowledge(self, *outcomes: AcknowledgeType) -> None:
        """Acknowledge the batch at hand, record by record, and send the acknowledgements."""
        for message, outcome in zip(self.batch, outcomes, strict=True):
            self.consumer.acknowledge(message, outcome)
        self.consumer.commit_sync(10)

    def nothing_comes(self) -> bool:
        """No record for the backend's quiet time."""
        deadline = time.monotonic() + self.quiet_s
        while True:
            if self.consumer.poll(0.2):
                return False
            if time.monotonic() >= deadline:
                return True


@pytest.fixture
def members(backend: Backend) -> Iterator[Callable[..., Member]]:
    """Factory: a member of `clients`' group asking for `max_poll_records`, subscribed to `topic`; closed at
    the end."""
    made: list[Any] = []

    def make(clients: ShareClientFactory, topic: str, max_poll_records: int = 500) -> Member:
        consumer = clients.share_consumer(_no_error, max_poll_records)
        consumer.subscribe([topic])
        made.append(consumer)
        return Member(consumer, backend.patience_s, backend.quiet_s)

    yield make
    for consumer in made:
        with contextlib.suppress(RuntimeError):  # closed by the test already
            consumer.close()


def send(clients: ShareClientFactory, topic: str, values: list[bytes], one_batch: bool = True) -> None:
    """Produce `values` through the worker's `produce`: in one producer batch, or each in its own."""
    producer = clients.producer(_no_error)
    for value in values:
        produce(producer, topic, value, b"k")
        if not one_batch:
            producer.flush(30)
    producer.flush(30)


# -- acknowledgements ----------------------------------------------------------------------------------------


def test_accept_settles_a_record_release_hands_it_out_again_counted_and_reject_archives_it(
    backend: Backend, members: Callable[..., Member]
) -> None:
    """What a record's outcome does (acknowledgements.py): a written triage record is never redone, a
    released ticket gets another try on its next delivery, a dead-lettered one never comes back."""
    topic, clients = backend.topic("outcomes"), backend.group()
    send(clients, topic, [b"accepted", b"released", b"rejected"])
    member = members(clients, topic)
    assert member.take() == [
        (0, 1, b"accepted"),
        (1, 1, b"released"),
        (2, 1, b"rejected"),
    ]

    member.acknowledge(ACCEPT, RELEASE, REJECT)
    assert member.take() == [(1, 2, b"released")]
    member.acknowledge(ACCEPT)
    assert member.nothing_comes()


def test_a_released_record_at_the_delivery_count_limit_is_archived_not_handed_out_again(
    backend: Backend, members: Callable[..., Member]
) -> None:
    """Why queue mode never releases a record on its last delivery (share.py): the group drops it without a
    trace."""
    topic, clients = backend.topic("limit"), backend.group(delivery_count_limit=2)
    send(clients, topic, [b"ticket"])
    member = members(clients, topic)
    assert member.take() == [(0, 1, b"ticket")]
    member.acknowledge(RELEASE)
    assert member.take() == [(0, 2, b"ticket")]
    member.acknowledge(RELEASE)
    assert member.nothing_comes()


def test_a_poll_with_a_record_of_the_last_one_unacknowledged_raises(
    backend: Backend, members: Callable[..., Member]
) -> None:
    """The explicit-acknowledgement rule that makes queue mode batch-synchronous: every record of a poll is
    acknowledged before the next poll, and a record of an earlier poll cannot be acknowledged after it."""
    topic, clients = backend.topic("explicit"), backend.group()
    send(clients, topic, [b"first", b"second"])
    member = members(clients, topic)
    assert len(member.take()) == 2
    first, second = member.batch
    member.consumer.acknowledge(first, ACCEPT)
    with pytest.raises(
        IllegalStateException, match=r"^1 records from previous poll have not been acknowledged$"
    ):
        member.consumer.poll(0.2)

    member.consumer.acknowledge(second, ACCEPT)
    assert member.nothing_comes()  # the poll goes now
    with pytest.raises(IllegalStateException, match="Failed to acknowledge message"):
        member.consumer.acknowledge(second, ACCEPT)


# -- members and locks ---------------------------------------------------------------------------------------


def test_a_record_is_held_by_one_member_until_its_release_is_sent_or_the_member_closes(
    backend: Backend, members: Callable[..., Member]
) -> None:
    """Many workers on one partition never work on the same ticket at once. An acknowledgement takes effect
    once sent (a commit, the next poll, close), which is why queue mode sends them as soon as its batch is
    settled (`commit_async`); a worker that stops (or is killed) gives the rest to the others at once, each on
    its next delivery."""
    topic, clients = backend.topic("members"), backend.group()
    send(clients, topic, [b"a", b"b"])
    holder = members(clients, topic)
    assert holder.take() == [(0, 1, b"a"), (1, 1, b"b")]
    send(clients, topic, [b"c"])
    other = members(clients, topic)
    assert other.take() == [(2, 1, b"c")]  # it takes records, only not those held
    other.acknowledge(ACCEPT)

    holder.consumer.acknowledge(holder.batch[0], RELEASE)
    assert other.nothing_comes()  # not sent yet
    holder.consumer.commit_async()
    assert other.take() == [(0, 2, b"a")]
    other.acknowledge(ACCEPT)
    holder.consumer.close()
    assert other.take() == [(1, 2, b"b")]


def test_a_lock_that_ends_hands_the_record_to_another_member_and_refuses_the_late_acknowledgement(
    backend: Backend, members: Callable[..., Member]
) -> None:
    """Why queue mode releases what is unsettled before the lock ends (lock_budget.py): after it, the record
    is another member's, with its delivery spent, and the first member's acknowledgement is refused."""
    topic, clients = backend.topic("lock"), backend.group(lock_ms=SHORTEST_LOCK_MS)
    send(clients, topic, [b"slow"])
    holder = members(clients, topic)
    assert holder.take() == [(0, 1, b"slow")]
    send(clients, topic, [b"quick"])
    other = members(clients, topic)
    assert other.take() == [(1, 1, b"quick")]  # the locked record is not handed out
    other.acknowledge(ACCEPT)

    backend.lock_passes(SHORTEST_LOCK_MS / 1000)
    assert other.take() == [(0, 2, b"slow")]
    holder.consumer.acknowledge(holder.batch[0], ACCEPT)
    [(partition, refused)] = holder.consumer.commit_sync(10).items()
    assert (partition.topic, partition.partition) == (topic, 0)
    assert refused is not None and refused.args[0].code() == KafkaError.INVALID_RECORD_STATE
    other.acknowledge(ACCEPT)
    assert other.nothing_comes()


# -- batches -------------------------------------------------------------------------------------------------


def test_a_poll_asks_for_max_poll_records_but_gets_whole_producer_batches(
    backend: Backend, members: Callable[..., Member]
) -> None:
    """Why queue mode sizes each poll (FetchSize) and still expects a batch larger than it asked for: the
    group honours `max.poll.records` only at producer-batch granularity."""
    topic, clients = backend.topic("batches"), backend.group()
    send(clients, topic, [b"bulk-%d" % n for n in range(6)], one_batch=True)
    send(clients, topic, [b"single-%d" % n for n in range(4)], one_batch=False)
    member = members(clients, topic, max_poll_records=2)
    polls = []
    for _ in range(3):
        polls.append([offset for offset, _count, _value in member.take()])
        member.acknowledge(*[ACCEPT] * len(member.batch))
    assert polls == [[0, 1, 2, 3, 4, 5], [6, 7], [8, 9]]
