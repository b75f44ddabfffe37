"""Where each record taken from Kafka is until the broker acknowledged what the pipeline wrote for it.

A record (`Work`) is *waiting* for the model, *at the model* under a request id, *escalated* (at the
cascade's second stage, worker/pipeline/cascade.py) under another request id, or *produced* and awaiting its
delivery report under a delivery id. Once acknowledged it leaves the ledger; the offset tracker holds its
offset until a commit passes it.

Waiting records go to the model earliest deadline first (`pipeline.scheduling = "edf"`; ties and `"fifo"`
in arrival order): under load a ticket whose producer asked for an early `deadline_at` is not stuck behind
ones that can wait. A revoked partition's records go before all others (see `first_to_model`).

In order (exactly-once mode), a record's output is *held* until every earlier record of its partition has
been produced: a transaction must only contain outputs of offsets it also commits (see `guarantees.py`).

When this worker stops owning a partition (revoke or loss), its waiting records are dropped (the next owner
reads them again) and its records at the model, escalated or at the producer become *orphans*: their answers
and reports still arrive, hold memory until then and count as in flight, but their results are not written.
"""

from __future__ import annotations

import collections
import heapq
import itertools
from collections.abc import Collection, Iterator
from dataclasses import dataclass

from worker.classification import Classification
from worker.config import Scheduling
from worker.kafka.commits import TopicPartitionKey
from worker.messages import SourcePosition, TicketEvent
from worker.pipeline.offsets import PartitionOffsets
from worker.privacy.redaction import TicketScan

Headers = list[tuple[str, bytes | None]]


@dataclass(frozen=True, slots=True)
class Output:
    """What the pipeline writes for a record, kept until its delivery report in case it must be written
    smaller (or, in order, until it may be produced)."""

    topic: str
    key: bytes | None
    value: bytes | None
    headers: Headers | None
    # For a dead letter written smaller: the bytes of the original left out, and how often it was sent so.
    omitted: int = 0
    shrunk: int = 0


# Heap entries of records no longer waiting are skipped when they surface; a heap is rebuilt without them
# once they outnumber the waiting records (plus this slack), which keeps every operation amortised O(log n).
_STALE_SLACK = 64


@dataclass(eq=False, slots=True)
class Work:
    """One record taken from Kafka, from poll until its offset is committed."""

    state: PartitionOffsets
    topic: str
    partition: int
    offset: int
    key: bytes | None
    headers: Headers | None
    polled_at: float
    deadline: float
    # The record's value as taken: a ticket whose result the broker refuses is dead-lettered with it.
    value: bytes | None = None
    event: TicketEvent | None = None
    # The ticket's personal data, found once when it was decoded (see worker/privacy/redaction.py).
    scan: TicketScan | None = None
    # Its partition was revoked or lost while it was at the model or at the producer.
    orphan: bool = False
    # In order: its output, held until the records before it are produced.
    output: Output | None = None
    # Escalated: the first stage's answer, which stands if the escalation stage gives none.
    first: Classification | None = None

    @property
    def partition_key(self) -> TopicPartitionKey:
        return (self.topic, self.partition)

    @property
    def source(self) -> SourcePosition:
        return SourcePosition(topic=self.topic, partition=self.partition, offset=self.offset)


class Ledger:
    """The records between poll and acknowledgement, by where they are."""

    def __init__(self, scheduling: Scheduling = "edf", in_order: bool = False) -> None:
        self._edf = scheduling == "edf"
        self._in_order = in_order
        # In order: each partition's records in consume order, up to the first one not yet produced.
        self._partition_order: dict[PartitionOffsets, collections.deque[Work]] = {}
        self._held = 0
        # Waiting records by arrival number; the heaps hold arrival numbers.
        self._waiting: dict[int, Work] = {}
        # Service order: (0 for a revoked partition's records else 1, deadline (0 for FIFO), arrival).
        self._order: list[tuple[int, float, int]] = []
        # Expiry order: (deadline, arrival).
        self._deadlines: list[tuple[float, int]] = []
        self._arrivals = itertools.count()
        self._at_model: dict[int, Work] = {}
        self._escalated: dict[int, Work] = {}
        self._produced: dict[int, Work] = {}
        self._ids = itertools.count()
        self.orphans = 0

    # -- in order (exactly-once) ---------------------------------------------------------------------------

    def taken(self, work: Work) -> None:
        """A record was taken (in order: it holds back the outputs of its partition's later records)."""
        if self._in_order:
            self._partition_order.setdefault(work.state, collections.deque()).append(work)

    def hold(self, work: Work, output: Output) -> None:
        """In order: keep `output` until `release` says it may be produced."""
        work.output = output
        self._held += 1

    def release(self, state: PartitionOffsets | None = None) -> list[Work]:
        """In order: the held records whose partition's earlier records are all produced, in offset order;
        the caller produces their `output` now. `state`: look at that partition only (after a hold there,
        no other partition can have become ready)."""
        ready: list[Work] = []
        queues = self._partition_order.values() if state is None else [self._partition_order.get(state)]
        for queue in queues:
            while queue and queue[0].output is not None:
                ready.append(queue.popleft())
        self._held -= len(ready)
        return ready

    @property
    def held(self) -> int:
        return self._held

    # -- waiting for the model ----------------------------------------------------------------------------

    def wait(self, work: Work) -> None:
        arrival = next(self._arrivals)
        self._waiting[arrival] = work
        heapq.heappush(self._order, (1, work.deadline if self._edf else 0.0, arrival))
        heapq.heappush(self._deadlines, (work.deadline, arrival))

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def next_waiting(self) -> Work | None:
        """The waiting record to serve next, taken out (None when none waits)."""
        while self._order:
            work = self._waiting.pop(heapq.heappop(self._order)[2], None)
            if work is not None:
                self._drop_stale()
                return work
        return None

    def expired(self, now: float) -> list[Work]:
        """Take out the waiting records whose deadline has passed, earliest deadline first."""
        late = []
        while self._deadlines and self._deadlines[0][0] <= now:
            work = self._waiting.pop(heapq.heappop(self._deadlines)[1], None)
            if work is not None:
                late.append(work)
        if late:
            self._drop_stale()
        return late

    def earliest_waiting_deadline(self) -> float | None:
        """The earliest deadline among the waiting records (None when none waits)."""
        while self._deadlines and self._deadlines[0][1] not in self._waiting:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def first_to_model(self, keys: Collection[TopicPartitionKey]) -> None:
        """Serve the waiting records of `keys` before all others (on revoke they must finish first)."""
        self._order = [
            (0 if self._waiting[arrival].partition_key in keys else rank, order, arrival)
            for rank, order, arrival in self._order
            if arrival in self._waiting
        ]
        heapq.heapify(self._order)

    # -- at the model -------------------------------------------------------------------------------------

    def to_model(self, work: Work) -> int:
        """Record that `work` was submitted; returns its request id."""
        request_id = next(self._ids)
        self._at_model[request_id] = work
        return request_id

    @property
    def at_model(self) -> int:
        return len(self._at_model)

    def answered(self, request_id: int) -> Work | None:
        """The record a model answer belongs to (None for an unknown id); an orphan leaves the count."""
        return self._release(self._at_model.pop(request_id, None))

    # -- at the escalation stage ----------------------------------------------------------------------------

    def to_escalation(self, work: Work, first: Classification) -> int:
        """Record that `work`, answered `first` by the first stage, went to the escalation stage; returns
        its request id there."""
        request_id = next(self._ids)
        work.first = first
        self._escalated[request_id] = work
        return request_id

    @property
    def at_escalation(self) -> int:
        return len(self._escalated)

    def escalation_answered(self, request_id: int) -> Work | None:
        """The record an escalation answer belongs to (None for an unknown id); an orphan leaves the count."""
        return self._release(self._escalated.pop(request_id, None))

    # -- at the producer ----------------------------------------------------------------------------------

    def to_broker(self, work: Work) -> int:
        """Record that a result or dead letter for `work` was produced; returns its delivery id."""
        delivery_id = next(self._ids)
        self._produced[delivery_id] = work
        return delivery_id

    def delivered(self, delivery_id: int) -> Work | None:
        """The record a delivery report belongs to (None for an unknown id); an orphan leaves the count."""
        return self._release(self._produced.pop(delivery_id, None))

    @property
    def at_producer(self) -> int:
        """Records produced and awaiting their delivery report."""
        return len(self._produced)

    def forget_produced(self) -> None:
        """The producer was replaced: reports for what it holds will never come (its records are orphans of
        an aborted transaction)."""
        self.orphans -= sum(1 for work in self._produced.values() if work.orphan)
        self._produced.clear()

    # -- ownership ----------------------------------------------------------------------------------------

    def pending(self, keys: Collection[TopicPartitionKey]) -> int:
        """Records of `keys` not yet acknowledged, held ones included (orphans excluded)."""
        return sum(1 for work in self._unacknowledged() if not work.orphan and work.partition_key in keys)

    def give_up(self, keys: Collection[TopicPartitionKey]) -> int:
        """This worker no longer owns `keys`: drop their waiting records, orphan the rest; returns how
        many were dropped."""
        before = len(self._waiting) + self._held
        self._waiting = {n: work for n, work in self._waiting.items() if work.partition_key not in keys}
        self._drop_stale()
        for state in [state for state in self._partition_order if state.key in keys]:
            self._held -= sum(1 for work in self._partition_order.pop(state) if work.output is not None)
        owned = itertools.chain(self._at_model.values(), self._escalated.values(), self._produced.values())
        for work in owned:
            if not work.orphan and work.partition_key in keys:
                work.orphan = True
                self.orphans += 1
        return before - len(self._waiting) - self._held

    def _drop_stale(self) -> None:
        limit = 2 * len(self._waiting) + _STALE_SLACK
        if len(self._order) > limit:
            self._order = [entry for entry in self._order if entry[2] in self._waiting]
            heapq.heapify(self._order)
        if len(self._deadlines) > limit:
            self._deadlines = [entry for entry in self._deadlines if entry[1] in self._waiting]
            heapq.heapify(self._deadlines)

    def is_empty(self) -> bool:
        return not (self._waiting or self._at_model or self._escalated or self._produced or self._held)

    def _unacknowledged(self) -> Iterator[Work]:
        held = (work for queue in self._partition_order.values() for work in queue if work.output is not None)
        return itertools.chain(
            self._waiting.values(),
            self._at_model.values(),
            self._escalated.values(),
            self._produced.values(),
            held,
        )

    def _release(self, work: Work | None) -> Work | None:
        # An orphan's answer is discarded and its report ends it: either way it leaves the ledger here.
        if work is not None and work.orphan:
            self.orphans -= 1
        return work
