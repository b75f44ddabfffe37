"""An in-memory Kafka for unit tests of the loop: a `ClientFactory` whose consumer and producer behave like
librdkafka's for the calls the pipeline makes, deterministically and without a broker.

What it models, because the pipeline's correctness depends on it:

- **One queue per consumer** holding fetched records and rebalance events in arrival order, as librdkafka's
  consumer queue does. Records are prefetched (`prefetch` per partition) at the start and end of every
  `consume`/`poll` call, so records fetched before a rebalance event sit in front of it.
- **Versions and barriers**: `seek`, `pause`, `resume`, assignment changes bump a partition's version and put
  a barrier at the tail of the queue; a queued record of an older version is dropped when it is dequeued.
  `consume(n)` follows librdkafka's `rd_kafka_q_serve_rkmessages`: records already placed in the batch are
  purged only when the barrier is dequeued *in the same call*; a batch that fills up first returns them.
  `poll()` returns one record, dequeued (and version-checked) after any callback served before it.
- **Rebalance callbacks** run inside `consume`/`poll`/`close`, on the caller's thread; the test decides when
  partitions are assigned, revoked or lost (`MemoryKafka.revoke`, `.lose`, `.assign`), each a new generation.
  A consumer's member id is the test's to clear (librdkafka clears it when the session times out), and
  `MemoryKafka.answering` says whether metadata requests (`list_topics`) are answered.
- **Transactions**: records written in a transaction are visible to read_committed readers only once it
  commits; `send_offsets_to_transaction` checks the consumer's generation (a zombie cannot commit offsets);
  `init_transactions` under the same id fences the older producer and aborts its open transaction. A failed
  delivery makes the transaction abortable. `hooks` let a test fail deliveries or hold a commit.
- **Start offsets**: `incremental_assign` starts a partition at the offset it is given (absolute, beginning or
  end); without one, at the group's committed offset, as librdkafka looks it up. While an open transaction
  holds offsets of the group for the partition (UNSTABLE_OFFSET_COMMIT) `committed()` times out and such a
  lookup waits; if the assignment changes meanwhile, the partition starts at the beginning
  (`auto.offset.reset=earliest`), as librdkafka 2.16 does (see worker/kafka/starts.py).

- **A share group** (`MemoryShareGroup`, queue mode's): records acquired by one member at a time under a
  lock on the test's clock, with delivery counts, acknowledgements and whole producer batches (its
  docstring); tests/kafka/test_share_contract.py holds it to a real Kafka 4.4 share group.

Not modelled: several brokers, leaders, compaction, control records' offsets, timing of the network.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import confluent_kafka

from worker.kafka.clients import ClientFactory
from worker.kafka.share_groups import ShareClientFactory

Key = tuple[str, int]
Headers = list[tuple[str, bytes | None]] | None
KafkaError = confluent_kafka.KafkaError
KafkaException = confluent_kafka.KafkaException


@dataclass
class Transaction:
    transactional_id: str
    state: str = "open"  # open → committed | aborted
    offsets: dict[str, dict[Key, int]] = field(default_factory=dict)  # group → positions
    failed: KafkaError | None = None


@dataclass
class Record:
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Headers
    transaction: Transaction | None = None
    # The producer batch it was written in (a share group hands out whole ones); None: a batch of its own.
    batch: int | None = None

    @property
    def visible(self) -> bool:
        """Read by a read_committed reader: not transactional, or its transaction committed."""
        return self.transaction is None or self.transaction.state == "committed"

    @property
    def settled(self) -> bool:
        return self.transaction is None or self.transaction.state != "open"


class Message:
    """What `consume`/`poll` return and delivery reports carry (the accessors the project calls)."""

    def __init__(self, topic: str, partition: int, record: Record | None, error: KafkaError | None = None):
        self._topic, self._partition, self._record, self._error = topic, partition, record, error

    def error(self) -> KafkaError | None:
        return self._error

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int | None:
        return self._record.offset if self._record else None

    def key(self) -> bytes | None:
        return self._record.key if self._record else None

    def value(self) -> bytes | None:
        return self._record.value if self._record else None

    def headers(self) -> Headers:
        return self._record.headers if self._record else None


@dataclass(frozen=True)
class GroupMetadata:
    group: str
    generation: int
    member: str


@dataclass
class Hooks:
    """Test hooks. `delivery(topic, value)` may return an error for a record; `commit(producer)` runs at
    the start of `commit_transaction` (block there to hold a commit, raise to fail it), `init(producer)` at
    the start of `init_transactions` (raise to fail it); `consumer_call` runs at the start of every
    consume/poll with the consumer (to inject rebalance events at a moment)."""

    delivery: Callable[[str, bytes | None], KafkaError | None] = lambda _topic, _value: None
    commit: Callable[[MemoryProducer], None] = lambda _producer: None
    init: Callable[[MemoryProducer], None] = lambda _producer: None
    consumer_call: Callable[[MemoryConsumer], None] = lambda _consumer: None


def _short_sleep(timeout: float) -> None:
    time.sleep(min(timeout, 0.002))


class MemoryKafka:
    """Topics, one consumer group and transactional ids, shared by the clients it makes (thread-safe)."""

    def __init__(self, prefetch: int = 2, message_max_bytes: int = 1_000_000) -> None:
        self.lock = threading.RLock()
        self.prefetch = prefetch
        # librdkafka's `message.max.bytes` (its default): a larger record is refused by `produce` itself.
        self.message_max_bytes = message_max_bytes
        self.logs: dict[str, list[list[Record]]] = {}
        self.committed: dict[str, dict[Key, int]] = collections.defaultdict(dict)
        self.generation = 0
        self.members: list[MemoryConsumer] = []
        # False: the broker is away, metadata requests time out.
        self.answering = True
        self.hooks = Hooks()
        self._epochs: dict[str, MemoryProducer] = {}
        self._open: dict[str, Transaction] = {}
        self.batches = itertools.count()
        # What a client's call does while it waits for nothing (`timeout` seconds at most): a short real
        # sleep; the fault simulator (tests/simulation) advances its virtual clock instead.
        self.idle: Callable[[float], None] = _short_sleep

    # -- topics -------------------------------------------------------------------------------------------

    def create_topic(self, topic: str, partitions: int) -> None:
        self.logs[topic] = [[] for _ in range(partitions)]

    def append(
        self,
        topic: str,
        partition: int,
        value: bytes | None,
        key: bytes | None = None,
        headers: Headers = None,
    ) -> int:
        with self.lock:
            log = self.logs[topic][partition]
            log.append(Record(len(log), key, value, headers))
            return len(log) - 1

    def read_committed(self, topic: str) -> list[tuple[int, Record]]:
        """Every record a read_committed reader sees, as (partition, record): as on a real broker, nothing
        past a partition's last stable offset (its first record of a transaction still open)."""
        with self.lock:
            seen = []
            for p, log in enumerate(self.logs[topic]):
                for record in itertools.takewhile(lambda r: r.settled, log):
                    if record.visible:
                        seen.append((p, record))
            return seen

    def end_offsets(self, topic: str) -> dict[int, int]:
        return {p: len(log) for p, log in enumerate(self.logs[topic])}

    def unstable(self, group: str, key: Key) -> bool:
        """An open transaction holds offsets of `group` for `key` (UNSTABLE_OFFSET_COMMIT from the broker)."""
        with self.lock:
            return any(key in txn.offsets.get(group, {}) for txn in self._open.values())

    # -- clients ------------------------------------------------------------------------------------------

    def clients(self, group: str, transactional_id: str | None = None) -> MemoryClients:
        return MemoryClients(self, group, transactional_id)

    # -- the group ----------------------------------------------------------------------------------------

    def assign(self, consumer: MemoryConsumer, partitions: list[Key]) -> None:
        """A rebalance that gives `consumer` these partitions (queued: its callback runs in its next call)."""
        with self.lock:
            self.generation += 1
            consumer.events.append(("assign", partitions))

    def revoke(self, consumer: MemoryConsumer, partitions: list[Key]) -> None:
        with self.lock:
            self.generation += 1
            consumer.events.append(("revoke", partitions))

    def lose(self, consumer: MemoryConsumer, partitions: list[Key]) -> None:
        with self.lock:
            self.generation += 1
            consumer.events.append(("lost", partitions))

    # -- transactions -------------------------------------------------------------------------------------

    def _init(self, producer: MemoryProducer) -> None:
        tid = producer.transactional_id
        assert tid is not None
        with self.lock:
            older = self._epochs.get(tid)
            if older is not None and older is not producer:
                older.fenced = True
            self._epochs[tid] = producer
            if (open_txn := self._open.pop(tid, None)) is not None:
                open_txn.state = "aborted"

    def _current(self, producer: MemoryProducer) -> bool:
        return self._epochs.get(producer.transactional_id or "") is producer


class MemoryConsumer:
    """The calls the pipeline makes on a confluent_kafka.Consumer."""

    def __init__(self, kafka: MemoryKafka, group: str, on_error: Callable[[KafkaError], None]) -> None:
        self.kafka, self.group, self._on_error = kafka, group, on_error
        self.member = f"member-{id(self):x}"
        self.queue: collections.deque[tuple[str, Any]] = collections.deque()
        # Rebalance events the group decided, moved into the queue at the consumer's next call.
        self.events: list[tuple[str, list[Key]]] = []
        self.assigned: set[Key] = set()
        self.paused: set[Key] = set()
        self.version: dict[Key, int] = collections.defaultdict(int)
        self.fetch_at: dict[Key, int] = {}
        self.app_at: dict[Key, int] = {}
        # Assigned without a start offset while the group's committed one is unstable: not fetching yet.
        self.looking_up: set[Key] = set()
        self.callbacks: dict[str, Callable[..., None]] = {}
        self.closed = False

    # -- subscription and assignment -------------------------------------------------------------------

    def subscribe(self, topics: list[str], on_assign: Any, on_revoke: Any, on_lost: Any) -> None:
        """Joins the group; the first member gets every partition of `topics`."""
        self.callbacks = {"assign": on_assign, "revoke": on_revoke, "lost": on_lost}
        with self.kafka.lock:
            self.kafka.members.append(self)
            if len(self.kafka.members) == 1:
                keys = [(t, p) for t in topics for p in range(len(self.kafka.logs[t]))]
                self.kafka.assign(self, keys)

    def incremental_assign(self, partitions: list[Any]) -> None:
        for tp in partitions:
            key = (tp.topic, tp.partition)
            self.assigned.add(key)
            self._bump(key)
            if tp.offset >= 0 or tp.offset in (confluent_kafka.OFFSET_BEGINNING, confluent_kafka.OFFSET_END):
                self._start(key, self._absolute(key, tp.offset))
            elif self.kafka.unstable(self.group, key):
                self.looking_up.add(key)
            else:
                self._start(key, self.kafka.committed[self.group].get(key, 0))

    def _absolute(self, key: Key, offset: int) -> int:
        if offset == confluent_kafka.OFFSET_BEGINNING:
            return 0
        if offset == confluent_kafka.OFFSET_END:
            return len(self.kafka.logs[key[0]][key[1]])
        return offset

    def _start(self, key: Key, offset: int) -> None:
        self.looking_up.discard(key)
        self.fetch_at[key] = self.app_at[key] = offset

    def _serve_lookups(self, changed: set[Key]) -> None:
        """librdkafka's committed-offset lookups: answered once stable; those in `changed` (in flight when
        the assignment changed) start at the beginning: their answer is dropped, auto.offset.reset applies."""
        for key in sorted(self.looking_up):
            if not self.kafka.unstable(self.group, key):
                self._start(key, self.kafka.committed[self.group].get(key, 0))
            elif key in changed:
                self._start(key, 0)

    assign = incremental_assign

    def _unassign(self, keys: list[Key]) -> None:
        for key in keys:
            if key in self.assigned:
                self.assigned.discard(key)
                self.paused.discard(key)
                self.looking_up.discard(key)
                self._bump(key)

    def memberid(self) -> str:
        return self.member

    def list_topics(self, topic: str, timeout: float = -1) -> Any:
        if not self.kafka.answering:
            away = confluent_kafka.KafkaError(confluent_kafka.KafkaError._TRANSPORT)
            raise confluent_kafka.KafkaException(away)
        partitions = {p: None for p in range(len(self.kafka.logs[topic]))}
        return SimpleNamespace(topics={topic: SimpleNamespace(partitions=partitions, error=None)})

    def consumer_group_metadata(self) -> GroupMetadata:
        return GroupMetadata(self.group, self.kafka.generation, self.member)

    # -- fetch position --------------------------------------------------------------------------------

    def seek(self, tp: Any) -> None:
        key = (tp.topic, tp.partition)
        if key not in self.assigned or key in self.looking_up:
            raise KafkaException(KafkaError(KafkaError._STATE, f"{key} is not fetching"))
        self._bump(key)
        # librdkafka forgets the application's position on a seek: a resume then fetches from the seek's.
        self.fetch_at[key] = self.app_at[key] = self._absolute(key, tp.offset)

    def pause(self, partitions: list[Any]) -> None:
        for tp in partitions:
            key = (tp.topic, tp.partition)
            if key in self.assigned:
                self.paused.add(key)
                self._bump(key)

    def resume(self, partitions: list[Any]) -> None:
        for tp in partitions:
            key = (tp.topic, tp.partition)
            if key in self.assigned:
                self.paused.discard(key)
                self._bump(key)
                if key not in self.looking_up:  # librdkafka refetches from the app position
                    self.fetch_at[key] = self.app_at[key]

    def _bump(self, key: Key) -> None:
        self.version[key] += 1
        self.queue.append(("barrier", (key, self.version[key])))

    # -- taking records --------------------------------------------------------------------------------

    def _prefetch(self) -> None:
        """Fill the queue up to `prefetch` records per fetching partition (read_committed: up to the first
        record of an open transaction; aborted records are skipped)."""
        queued = collections.Counter(item[1][0] for item in self.queue if item[0] == "record")
        for key in sorted(self.assigned - self.paused - self.looking_up):
            log = self.kafka.logs[key[0]][key[1]]
            while queued[key] < self.kafka.prefetch and self.fetch_at[key] < len(log):
                record = log[self.fetch_at[key]]
                if not record.settled:
                    break
                self.fetch_at[key] += 1
                if record.visible:
                    self.queue.append(("record", (key, self.version[key], record)))
                    queued[key] += 1

    def _next(self) -> tuple[str, Any] | None:
        """Dequeue one item, serving rebalance events (their callbacks) on the way; None when empty."""
        while self.queue:
            kind, item = self.queue.popleft()
            if kind in ("assign", "revoke", "lost"):
                self._rebalance(kind, item)
                continue
            if kind == "record" and item[1] != self.version[item[0]]:
                continue  # outdated: fetched before a seek, pause or reassignment
            return kind, item
        return None

    def _rebalance(self, kind: str, keys: list[Key]) -> None:
        tps = [confluent_kafka.TopicPartition(t, p) for t, p in keys]
        waiting = set(self.looking_up)
        self.callbacks[kind](self, tps)
        if kind == "assign":
            if not set(keys) <= self.assigned:
                self.incremental_assign(tps)
        else:
            self._unassign(keys)
        self._serve_lookups(changed=waiting)

    def _start_call(self) -> None:
        with self.kafka.lock:
            self.kafka.hooks.consumer_call(self)
            self.queue.extend(self.events)
            self.events.clear()
            self._serve_lookups(changed=set())
            self._prefetch()

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Message]:
        """librdkafka's batch semantics, see the module docstring."""
        self._start_call()
        batch: list[Message] = []
        versions: list[int] = []
        while len(batch) < num_messages:
            got = self._next()
            if got is None:
                break
            kind, item = got
            if kind == "barrier":
                key, version = item
                kept = [
                    (m, v)
                    for m, v in zip(batch, versions, strict=True)
                    if (m.topic(), m.partition()) != key or v >= version
                ]
                batch, versions = [m for m, _ in kept], [v for _, v in kept]
                continue
            key, version, record = item
            batch.append(Message(key[0], key[1], record))
            versions.append(version)
        self._taken(batch)
        if not batch and timeout:
            self.kafka.idle(timeout)
        return batch

    def poll(self, timeout: float = -1) -> Message | None:
        self._start_call()
        while (got := self._next()) is not None:
            kind, item = got
            if kind == "record":
                key, _version, record = item
                message = Message(key[0], key[1], record)
                self._taken([message])
                return message
        if timeout:
            self.kafka.idle(timeout)
        return None

    def _taken(self, messages: list[Message]) -> None:
        for message in messages:
            key = (message.topic(), message.partition())
            self.app_at[key] = max(self.app_at.get(key, 0), (message.offset() or 0) + 1)
        with self.kafka.lock:
            self._prefetch()

    # -- offsets ---------------------------------------------------------------------------------------

    def committed(self, partitions: list[Any], timeout: float = -1) -> list[Any]:
        if any(self.kafka.unstable(self.group, (tp.topic, tp.partition)) for tp in partitions):
            # librdkafka retries UNSTABLE_OFFSET_COMMIT until the call's timeout.
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "Failed to get committed offsets"))
        offsets = self.kafka.committed[self.group]
        return [
            confluent_kafka.TopicPartition(
                tp.topic, tp.partition, offsets.get((tp.topic, tp.partition), confluent_kafka.OFFSET_INVALID)
            )
            for tp in partitions
        ]

    def commit(self, offsets: list[Any], asynchronous: bool = True) -> list[Any]:
        with self.kafka.lock:
            for tp in offsets:
                self.kafka.committed[self.group][(tp.topic, tp.partition)] = tp.offset
        return offsets

    def position(self, partitions: list[Any]) -> list[Any]:
        return [
            confluent_kafka.TopicPartition(
                tp.topic, tp.partition, self.app_at.get((tp.topic, tp.partition), -1)
            )
            for tp in partitions
        ]

    def get_watermark_offsets(self, tp: Any, timeout: float = -1, cached: bool = False) -> tuple[int, int]:
        return 0, len(self.kafka.logs[tp.topic][tp.partition])

    def close(self) -> None:
        """Leaves the group: the revoke callback runs for what is still assigned, as librdkafka's does."""
        if self.assigned:
            self._rebalance("revoke", sorted(self.assigned))
        with self.kafka.lock:
            if self in self.kafka.members:
                self.kafka.members.remove(self)
        self.closed = True


class ReplayConsumer(MemoryConsumer):
    """The calls a replay makes on its own consumer (assigned partitions, end-of-partition events, topic
    metadata) over the in-memory Kafka."""

    def __init__(self, kafka: MemoryKafka, group: str) -> None:
        super().__init__(kafka, group, lambda _error: None)
        self._at_end: set[tuple[str, int]] = set()

    def poll(self, timeout: float = -1) -> Message | None:
        message = super().poll(0)
        if message is not None:
            return message
        for key in sorted(self.assigned - self._at_end):
            if self.app_at.get(key, 0) >= len(self.kafka.logs[key[0]][key[1]]):
                self._at_end.add(key)
                eof = confluent_kafka.KafkaError(confluent_kafka.KafkaError._PARTITION_EOF)
                return Message(key[0], key[1], None, eof)
        self.kafka.idle(timeout)
        return None

    def close(self) -> None:
        self.closed = True  # assigned, never subscribed: nothing to revoke


class MemoryProducer:
    """The calls the pipeline makes on a confluent_kafka.Producer; records reach the log on `poll`."""

    def __init__(
        self, kafka: MemoryKafka, transactional_id: str | None, on_error: Callable[[KafkaError], None]
    ) -> None:
        self.kafka, self.transactional_id, self._on_error = kafka, transactional_id, on_error
        self._queue: list[tuple[str, bytes | None, bytes | None, Headers, Any]] = []
        self._transaction: Transaction | None = None
        self.fenced = False

    def __len__(self) -> int:
        return len(self._queue)

    def _check(self) -> None:
        if self.fenced:
            raise KafkaException(KafkaError(KafkaError._FENCED, "producer fenced", fatal=True))

    def produce(
        self,
        topic: str,
        value: bytes | None = None,
        key: bytes | None = None,
        headers: Headers = None,
        on_delivery: Any = None,
    ) -> None:
        self._check()
        if self.transactional_id is not None and self._transaction is None:
            raise KafkaException(KafkaError(KafkaError._STATE, "no transaction open"))
        size = len(value or b"") + len(key or b"") + sum(len(n) + len(v or b"") for n, v in headers or [])
        if size > self.kafka.message_max_bytes:
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "Message size too large"))
        self._queue.append((topic, value, key, headers, on_delivery or (lambda _error, _message: None)))

    def poll(self, timeout: float = 0) -> int:
        """Writes the queued records and serves their delivery reports."""
        queue, self._queue = self._queue, []
        batch = next(self.kafka.batches)  # what one call writes is one producer batch per partition
        for topic, value, key, headers, on_delivery in queue:
            if topic not in self.kafka.logs:  # as librdkafka reports it where the broker creates no topic
                unknown = KafkaError(KafkaError._UNKNOWN_TOPIC, f"Local: Unknown topic {topic}")
                on_delivery(unknown, Message(topic, -1, None, unknown))
                continue
            partitions = self.kafka.logs[topic]
            partition = zlib.crc32(key or b"") % len(partitions)
            error = self.kafka.hooks.delivery(topic, value)
            if error is None:
                with self.kafka.lock:
                    record = Record(len(partitions[partition]), key, value, headers, self._transaction, batch)
                    partitions[partition].append(record)
                on_delivery(None, Message(topic, partition, record))
            else:
                if self._transaction is not None:
                    self._transaction.failed = error
                on_delivery(error, Message(topic, partition, None, error))
        if not queue and timeout:
            self.kafka.idle(timeout)
        return len(queue)

    def flush(self, timeout: float = -1) -> int:
        self.poll(0)
        return 0

    # -- transactions ----------------------------------------------------------------------------------

    def init_transactions(self, timeout: float = -1) -> None:
        self.kafka.hooks.init(self)
        self.kafka._init(self)

    def begin_transaction(self) -> None:
        self._check()
        if self._transaction is not None:
            raise KafkaException(KafkaError(KafkaError._STATE, "a transaction is already open"))
        assert self.transactional_id is not None
        self._transaction = Transaction(self.transactional_id)
        with self.kafka.lock:
            self.kafka._open[self.transactional_id] = self._transaction

    def send_offsets_to_transaction(
        self, offsets: list[Any], metadata: GroupMetadata, timeout: float = -1
    ) -> None:
        self._check()
        assert self._transaction is not None
        with self.kafka.lock:
            if metadata.generation != self.kafka.generation:
                error = KafkaError(KafkaError.ILLEGAL_GENERATION, "stale generation", txn_requires_abort=True)
                self._transaction.failed = error
                raise KafkaException(error)
            positions = self._transaction.offsets.setdefault(metadata.group, {})
            positions.update({(tp.topic, tp.partition): tp.offset for tp in offsets})

    def commit_transaction(self, timeout: float = -1) -> None:
        self._check()
        self.kafka.hooks.commit(self)
        self.poll(0)
        transaction = self._transaction
        assert transaction is not None
        if transaction.failed is not None:
            failed = transaction.failed
            raise KafkaException(KafkaError(failed.code(), failed.str(), txn_requires_abort=True))
        with self.kafka.lock:
            if not self.kafka._current(self) or transaction.state != "open":
                raise KafkaException(KafkaError(KafkaError._FENCED, "producer fenced", fatal=True))
            transaction.state = "committed"
            for group, positions in transaction.offsets.items():
                self.kafka.committed[group].update(positions)
            self.kafka._open.pop(transaction.transactional_id, None)
        self._transaction = None

    def abort_transaction(self, timeout: float = -1) -> None:
        self._check()
        queue, self._queue = self._queue, []
        for topic, _value, _key, _headers, on_delivery in queue:
            error = KafkaError(KafkaError._PURGE_QUEUE, "purged by the abort")
            on_delivery(error, Message(topic, 0, None, error))
        if self._transaction is not None:
            with self.kafka.lock:
                self._transaction.state = "aborted"
                self.kafka._open.pop(self._transaction.transactional_id, None)
        self._transaction = None


@dataclass(frozen=True)
class MemoryClients:
    """A `ClientFactory` over a MemoryKafka: one group, transactional when given an id."""

    kafka: MemoryKafka
    group: str
    transactional_id: str | None = None

    def consumer(self, on_error: Callable[[KafkaError], None]) -> MemoryConsumer:
        return MemoryConsumer(self.kafka, self.group, on_error)

    def producer(self, on_error: Callable[[KafkaError], None]) -> MemoryProducer:
        return MemoryProducer(self.kafka, self.transactional_id, on_error)


def as_client_factory(clients: MemoryClients) -> ClientFactory:
    """`clients` where the pipeline takes a `ClientFactory`. The seam names confluent-kafka's classes, which
    the fake does not subclass; it answers the calls the pipeline makes as they do, which
    tests/kafka/test_kafka_contract.py checks against a real broker."""
    return cast(ClientFactory, clients)


class ScriptedShareConsumer:
    """The share consumer's calls the loop makes, scripted: `poll` hands out `batches` one by one,
    `acknowledge` records each outcome, and a poll with records of the previous batch unacknowledged raises,
    as librdkafka's does."""

    def __init__(self, batches: list[list[Message]]) -> None:
        self.batches = batches
        self.outcomes: dict[int, confluent_kafka.AcknowledgeType] = {}
        self._handed: list[Message] = []
        self.polls_after_all = 0
        self.closed = False

    def subscribe(self, topics: list[str]) -> None:
        pass

    def poll(self, timeout: float) -> list[Message]:
        unacknowledged = [m for m in self._handed if m.offset() not in self.outcomes]
        if unacknowledged:
            raise confluent_kafka.IllegalStateException(
                f"{len(unacknowledged)} records from previous poll have not been acknowledged"
            )
        if not self.batches:
            self.polls_after_all += 1
            time.sleep(min(timeout, 0.01))
            return []
        self._handed = self.batches.pop(0)
        return self._handed

    def acknowledge(self, message: Message, outcome: confluent_kafka.AcknowledgeType) -> None:
        offset = message.offset()
        assert offset is not None
        self.outcomes[offset] = outcome

    def commit_async(self) -> None:
        pass

    def commit_sync(self, timeout: float) -> dict[object, object]:
        return {}

    def close(self) -> None:
        self.closed = True


class ShareMessage(Message):
    """A share group's record: its delivery count (1: its first delivery)."""

    def __init__(self, topic: str, partition: int, record: Record, deliveries: int = 1) -> None:
        super().__init__(topic, partition, record)
        self.deliveries = deliveries

    def delivery_count(self) -> int:
        return self.deliveries


class _ShareClients:
    def __init__(self, kafka: MemoryKafka, consumer: ScriptedShareConsumer) -> None:
        self.kafka, self.consumer = kafka, consumer

    def share_consumer(
        self, on_error: Callable[[confluent_kafka.KafkaError], None], max_poll_records: int
    ) -> ScriptedShareConsumer:
        return self.consumer

    def producer(self, on_error: Callable[[confluent_kafka.KafkaError], None]) -> MemoryProducer:
        return MemoryProducer(self.kafka, None, on_error)


def share_clients(kafka: MemoryKafka, consumer: ScriptedShareConsumer) -> ShareClientFactory:
    """The fakes where the loop takes a `ShareClientFactory`: they answer the calls it makes, without
    subclassing confluent-kafka's classes (as memory_kafka.as_client_factory)."""
    return cast("ShareClientFactory", _ShareClients(kafka, consumer))


@dataclass
class _Delivery:
    """A record's state in a share group: available, acquired (by `holder` until `locked_until`),
    acknowledged or archived; `count`: how often it was acquired."""

    state: str = "available"
    count: int = 0
    holder: MemoryShareConsumer | None = None
    locked_until: float = 0.0


class MemoryShareGroup:
    """A share group over a MemoryKafka's topics (KIP-932 as Kafka 4.4 and librdkafka 2.16 behave, for the
    calls queue mode makes; tests/kafka/test_share_contract.py checks it against a real share group).

    - Members acquire records of their subscribed topics from the earliest offset (the worker sets
      `share.auto.offset.reset=earliest`), one member at a time; each acquisition adds one to the record's
      delivery count and locks it for `lock_ms` on `clock`.
    - A poll takes available records up to the consumer's `max.poll.records`, but never part of a producer
      batch: a batch larger than that comes whole (measured on the broker).
    - Acknowledgements are applied when the client sends them (the next poll, a commit, close): ACCEPT
      settles the record, RELEASE makes it available again, REJECT archives it. A lock that ends, a RELEASE,
      and close (for what the member holds) make a record available again, or archive it once its delivery
      count reached `delivery_count_limit`.
    - Explicit acknowledgement: a poll while a record of the previous one is unacknowledged raises
      `IllegalStateException`, and so does acknowledging a record that is not the member's to acknowledge.

    Not modelled: the first member's wait for its assignment (about 5 s on a broker), partitions'
    leaders, the archive's broker-side dead-letter topic.
    """

    def __init__(
        self,
        kafka: MemoryKafka,
        group: str,
        lock_ms: int = 30000,
        delivery_count_limit: int = 5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kafka, self.group = kafka, group
        self.lock_ms, self.delivery_count_limit = lock_ms, delivery_count_limit
        self.clock = clock
        self.deliveries: dict[tuple[str, int, int], _Delivery] = {}

    def clients(self) -> ShareClientFactory:
        """The share consumers of this group and a producer, where queue mode takes a `ShareClientFactory`."""
        return cast("ShareClientFactory", _ShareGroupClients(self))

    def delivery(self, topic: str, partition: int, offset: int) -> _Delivery:
        with self.kafka.lock:
            return self.deliveries.setdefault((topic, partition, offset), _Delivery())

    def _acquire(self, member: MemoryShareConsumer, topics: list[str], limit: int) -> list[ShareMessage]:
        with self.kafka.lock:
            self._expire()
            taken: list[ShareMessage] = []
            for topic in topics:
                for partition, log in enumerate(self.kafka.logs[topic]):
                    previous: int | None = None
                    for record in log:
                        whole = record.batch is not None and record.batch == previous
                        if len(taken) >= limit and not whole:
                            return taken
                        delivery = self.delivery(topic, partition, record.offset)
                        if record.visible and delivery.state == "available":
                            delivery.state, delivery.holder = "acquired", member
                            delivery.count += 1
                            delivery.locked_until = self.clock() + self.lock_ms / 1000.0
                            taken.append(ShareMessage(topic, partition, record, delivery.count))
                            previous = record.batch
                        elif not whole:
                            previous = None
            return taken

    def _settle(
        self, member: MemoryShareConsumer, key: tuple[str, int, int], outcome: confluent_kafka.AcknowledgeType
    ) -> bool:
        """Apply `member`'s acknowledgement of a record; False where the record is no longer its own."""
        with self.kafka.lock:
            self._expire()
            delivery = self.delivery(*key)
            if delivery.holder is not member or delivery.state != "acquired":
                return False
            if outcome == confluent_kafka.AcknowledgeType.ACCEPT:
                delivery.state, delivery.holder = "acknowledged", None
            elif outcome == confluent_kafka.AcknowledgeType.REJECT:
                delivery.state, delivery.holder = "archived", None
            else:
                self._give_back(delivery)
            return True

    def _leave(self, member: MemoryShareConsumer) -> None:
        with self.kafka.lock:
            for delivery in self.deliveries.values():
                if delivery.holder is member and delivery.state == "acquired":
                    self._give_back(delivery)

    def _expire(self) -> None:
        now = self.clock()
        for delivery in self.deliveries.values():
            if delivery.state == "acquired" and delivery.locked_until <= now:
                self._give_back(delivery)

    def _give_back(self, delivery: _Delivery) -> None:
        delivery.holder = None
        delivery.state = "archived" if delivery.count >= self.delivery_count_limit else "available"


class MemoryShareConsumer:
    """The calls queue mode makes on a confluent_kafka.ShareConsumer in explicit-acknowledgement mode."""

    def __init__(self, group: MemoryShareGroup, max_poll_records: int) -> None:
        self.group, self.max_poll_records = group, max_poll_records
        self.topics: list[str] = []
        self._handed: dict[tuple[str, int, int], ShareMessage] = {}
        self._acknowledged: dict[tuple[str, int, int], confluent_kafka.AcknowledgeType] = {}
        self._unsent: dict[tuple[str, int, int], confluent_kafka.AcknowledgeType] = {}
        self.closed = False

    def subscribe(self, topics: list[str]) -> None:
        self.topics = list(topics)

    def poll(self, timeout: float) -> list[ShareMessage]:
        unacknowledged = len(self._handed) - len(self._acknowledged)
        if unacknowledged:
            raise confluent_kafka.IllegalStateException(
                f"{unacknowledged} records from previous poll have not been acknowledged"
            )
        self._send()
        batch = self.group._acquire(self, self.topics, self.max_poll_records)
        self._handed = {_share_key(message): message for message in batch}
        self._acknowledged = {}
        if not batch and timeout:
            self.group.kafka.idle(timeout)
        return batch

    def acknowledge(self, message: ShareMessage, outcome: confluent_kafka.AcknowledgeType) -> None:
        key = _share_key(message)
        if key not in self._handed or key in self._acknowledged:
            raise confluent_kafka.IllegalStateException(
                "Failed to acknowledge message: Local: Erroneous state"
            )
        self._acknowledged[key] = self._unsent[key] = outcome

    def commit_async(self) -> None:
        self._send()

    def commit_sync(self, timeout: float) -> dict[confluent_kafka.TopicPartition, KafkaException | None]:
        """The acknowledgements sent, by partition: None, or the error of one the broker refused (its lock
        ended, and the record went on)."""
        return self._send()

    def _send(self) -> dict[confluent_kafka.TopicPartition, KafkaException | None]:
        results: dict[Key, KafkaException | None] = {}
        unsent, self._unsent = self._unsent, {}
        for key, outcome in unsent.items():
            refused = not self.group._settle(self, key, outcome)
            if refused:
                error = KafkaError(KafkaError.INVALID_RECORD_STATE, "Broker: The record state is invalid")
                results[key[:2]] = KafkaException(error)
            else:
                results.setdefault(key[:2], None)
        return {confluent_kafka.TopicPartition(topic, p): result for (topic, p), result in results.items()}

    def close(self) -> None:
        """Sends the acknowledgements made, and releases every other record this member holds."""
        if not self.closed:
            self._send()
            self.group._leave(self)
            self.closed = True


def _share_key(message: Message) -> tuple[str, int, int]:
    offset = message.offset()
    assert offset is not None
    return message.topic(), message.partition(), offset


class _ShareGroupClients:
    def __init__(self, group: MemoryShareGroup) -> None:
        self.group = group

    def share_consumer(
        self, on_error: Callable[[confluent_kafka.KafkaError], None], max_poll_records: int
    ) -> MemoryShareConsumer:
        return MemoryShareConsumer(self.group, max_poll_records)

    def producer(self, on_error: Callable[[confluent_kafka.KafkaError], None]) -> MemoryProducer:
        return MemoryProducer(self.group.kafka, None, on_error)
