"""The in-memory Kafka, share group, committer and line reader, on virtual time and watched.

Subclasses of `tests/memory_kafka.py`'s fakes (held to the real broker by the contract tests), changed only
in what a simulation needs:

- their waits move the virtual clock (`MemoryKafka.idle`), so nothing sleeps;
- every commit is reported as it lands (`SimKafka.on_commit`: the checker looks at that instant whether
  any record below the committed offset still has no outcome);
- a share consumer's RELEASE of a record on its last delivery records which code path sent it (a RELEASE
  then archives the record: the checker names the path when nothing was written for it), and the records
  a killed member held are remembered;
- the committer runs each commit on the loop's own thread, `lag` turns after it was submitted, instead of
  on a thread of its own (`GuaranteeWiring.committer`);
- the line reader hands out lines on the loop's thread instead of a reading thread.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import confluent_kafka
from memory_kafka import (
    MemoryConsumer,
    MemoryKafka,
    MemoryProducer,
    MemoryShareConsumer,
    MemoryShareGroup,
    ReplayConsumer,
    ShareMessage,
)

from worker.kafka.commits import CommitCall, CommitOutcome, TopicPartitionKey
from worker.pipeline.sources.lines import Line, LineReader

from .clock import VirtualClock

Positions = dict[tuple[str, int], int]
CommitWatch = Callable[[str, Positions, bool], None]


class SimKafka(MemoryKafka):
    """A MemoryKafka whose clients wait on `clock`; `on_commit(group, positions, transactional)` hears of
    every commit once it landed."""

    def __init__(self, clock: VirtualClock, message_max_bytes: int) -> None:
        super().__init__(prefetch=2, message_max_bytes=message_max_bytes)
        self.idle = clock.wait
        self.on_commit: CommitWatch = lambda _group, _positions, _transactional: None


class _Watched:
    """A consumer whose commits are reported to its SimKafka."""

    kafka: MemoryKafka
    group: str

    def commit(self, offsets: list[Any], asynchronous: bool = True) -> list[Any]:
        done = MemoryConsumer.commit(self, offsets, asynchronous)  # type: ignore[arg-type]
        assert isinstance(self.kafka, SimKafka)
        self.kafka.on_commit(self.group, {(tp.topic, tp.partition): tp.offset for tp in offsets}, False)
        return done


class SimConsumer(_Watched, MemoryConsumer):
    pass


class SimReplayConsumer(_Watched, ReplayConsumer):
    pass


class SimProducer(MemoryProducer):
    """A MemoryProducer whose transaction commits are reported, and which refuses to abort outside a
    transaction as librdkafka does (`Operation not valid in state Ready`; the fake lets it pass)."""

    def abort_transaction(self, timeout: float = -1) -> None:
        if self.transactional_id is not None and self._transaction is None and not self.fenced:
            raise confluent_kafka.KafkaException(
                confluent_kafka.KafkaError(
                    confluent_kafka.KafkaError._STATE, "Operation not valid in state Ready"
                )
            )
        super().abort_transaction(timeout)

    def commit_transaction(self, timeout: float = -1) -> None:
        transaction = self._transaction
        super().commit_transaction(timeout)
        assert isinstance(self.kafka, SimKafka) and transaction is not None
        for group, positions in transaction.offsets.items():
            self.kafka.on_commit(group, dict(positions), True)


class SimClients:
    """A `ClientFactory` over a SimKafka; `consumers` are the consumers made, the last one current."""

    def __init__(self, kafka: SimKafka, group: str, transactional_id: str | None) -> None:
        self.kafka, self.group, self.transactional_id = kafka, group, transactional_id
        self.consumers: list[SimConsumer] = []

    def consumer(self, on_error: Callable[[confluent_kafka.KafkaError], None]) -> SimConsumer:
        consumer = SimConsumer(self.kafka, self.group, on_error)
        self.consumers.append(consumer)
        return consumer

    def producer(self, on_error: Callable[[confluent_kafka.KafkaError], None]) -> SimProducer:
        return SimProducer(self.kafka, self.transactional_id, on_error)


class SimShareGroup(MemoryShareGroup):
    """A share group on the virtual clock that remembers, for each record released on its last delivery,
    which code path released it (`release_paths`), and the records killed members held (`crashed`: the
    delivery count they had then)."""

    def __init__(self, kafka: SimKafka, clock: VirtualClock, lock_ms: int, limit: int) -> None:
        super().__init__(kafka, "sim-share", lock_ms, limit, clock=clock.peek)
        self.release_paths: dict[tuple[str, int, int], str] = {}
        self.crashed: dict[tuple[str, int, int], int] = {}
        self.consumers: list[SimShareConsumer] = []

    def killed(self, member: MemoryShareConsumer) -> None:
        for key, delivery in self.deliveries.items():
            if delivery.holder is member and delivery.state == "acquired":
                self.crashed[key] = delivery.count

    def clients(self) -> Any:
        return _SimShareClients(self)


class SimShareConsumer(MemoryShareConsumer):
    def acknowledge(self, message: ShareMessage, outcome: confluent_kafka.AcknowledgeType) -> None:
        super().acknowledge(message, outcome)
        group = self.group
        assert isinstance(group, SimShareGroup)
        last = message.delivery_count() >= group.delivery_count_limit
        if outcome == confluent_kafka.AcknowledgeType.RELEASE and last:
            offset = message.offset()
            assert offset is not None
            group.release_paths[(message.topic(), message.partition(), offset)] = code_path()


class _SimShareClients:
    def __init__(self, group: SimShareGroup) -> None:
        self.group = group

    def share_consumer(
        self, on_error: Callable[[confluent_kafka.KafkaError], None], max_poll_records: int
    ) -> SimShareConsumer:
        consumer = SimShareConsumer(self.group, max_poll_records)
        self.group.consumers.append(consumer)
        return consumer

    def producer(self, on_error: Callable[[confluent_kafka.KafkaError], None]) -> SimProducer:
        kafka = self.group.kafka
        assert isinstance(kafka, SimKafka)
        return SimProducer(kafka, None, on_error)


def code_path() -> str:
    """The worker's frames that led here, outermost first, below the loop's own (`Engine`)."""
    names: list[str] = []
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if "/worker/" in code.co_filename:
            name = code.co_qualname
            if name.startswith("Engine."):
                names.append(name)
                break
            names.append(name)
        frame = frame.f_back  # type: ignore[assignment]
    return " > ".join(reversed(names))


class LoopCommitter:
    """A `committer.Committing` that runs each commit on the loop's thread: at the `lag`-th `results()`
    after its `submit` (0: at once), or when it is waited for. Deterministic, unlike a thread."""

    def __init__(self, commit: CommitCall, lag: int) -> None:
        self._commit, self._lag = commit, lag
        self._pending: dict[TopicPartitionKey, int] | None = None
        self._turns = 0
        self._outcomes: list[CommitOutcome] = []

    @property
    def busy(self) -> bool:
        return self._pending is not None

    def submit(self, positions: dict[TopicPartitionKey, int]) -> None:
        if self.busy:
            raise RuntimeError("a commit is already outstanding")
        self._pending, self._turns = positions, self._lag
        if self._lag == 0:
            self._run()

    def _run(self) -> None:
        positions, self._pending = self._pending, None
        if positions is not None:
            self._outcomes.append(self._commit(positions))

    def results(self) -> list[CommitOutcome]:
        if self._pending is not None:
            if self._turns <= 0:
                self._run()
            self._turns -= 1
        outcomes, self._outcomes = self._outcomes, []
        return outcomes

    def wait_idle(self, timeout: float) -> bool:
        self._run()
        return True

    def close(self, timeout: float = 5.0) -> None:
        self._run()


def loop_committer(lag: int) -> Callable[[CommitCall], LoopCommitter]:
    return lambda commit: LoopCommitter(commit, lag)


class SimLineReader(LineReader):
    """`LineReader` without its thread: every line is there from the start, handed out on the loop's
    thread."""

    def __init__(self, lines: list[Line], name: str) -> None:  # no reading thread
        self.name = name
        self._lines = deque(lines)
        self._peeked: list[Line] = []
        self._closed = threading.Event()
        self.ended = False

    def _next(self, timeout: float | None) -> Line | None:
        if self._lines and not self._closed.is_set():
            return self._lines.popleft()
        self.ended = True
        return None
