"""The outputs a delivery guarantee has produced and awaits reports for, and, in order, the ones it holds.

A produced output is tracked under a delivery id until its report arrives (`delivered`). In order
(exactly-once mode), a record's output is *held* until every earlier record of its partition has been
produced: a transaction must only contain outputs of offsets it also commits (see `guarantees.py`). The
guarantee owns this; the pipeline only tells it which records were taken (`taken`), in consume order.
Outputs of a partition given up become orphans (`orphans.py`); held ones are dropped with it.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Collection

from worker.kafka.commits import TopicPartitionKey
from worker.pipeline.settlements.offsets import PartitionOffsets
from worker.pipeline.settlements.orphans import Orphans
from worker.pipeline.work import Output, Work


class Deliveries:
    """Outputs produced and awaiting their report, and (in order) outputs held back."""

    def __init__(self, in_order: bool = False) -> None:
        self._in_order = in_order
        # In order: each partition's records in consume order, up to the first one not yet produced.
        self._partition_order: dict[PartitionOffsets, collections.deque[Work]] = {}
        self._held = 0
        self._produced: dict[int, Work] = {}
        self._ids = itertools.count()
        self._orphans = Orphans()

    @property
    def at_producer(self) -> int:
        """Outputs produced and awaiting their delivery report."""
        return len(self._produced)

    @property
    def held(self) -> int:
        return self._held

    @property
    def orphans(self) -> int:
        return self._orphans.count

    def taken(self, work: Work) -> None:
        """A record was taken (in order: it holds back the outputs of its partition's later records)."""
        if self._in_order:
            self._partition_order.setdefault(work.state, collections.deque()).append(work)

    def without_output(self, work: Work) -> None:
        """In order: `work` needs no output, so its partition's later outputs no longer wait for it (`release`
        may produce them)."""
        if self._in_order and (queue := self._partition_order.get(work.state)) is not None:
            queue.remove(work)

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

    def to_broker(self, work: Work) -> int:
        """Record that an output for `work` was produced; returns its delivery id."""
        delivery_id = next(self._ids)
        self._produced[delivery_id] = work
        return delivery_id

    def delivered(self, delivery_id: int) -> Work | None:
        """The record a delivery report belongs to (None for an unknown id); an orphan leaves the count."""
        return self._orphans.back(self._produced.pop(delivery_id, None))

    def forget_produced(self) -> None:
        """The producer was replaced: reports for what it holds will never come (its records are orphans of
        an aborted transaction)."""
        self._orphans.count -= sum(1 for work in self._produced.values() if work.orphan)
        self._produced.clear()

    def pending(self, keys: Collection[TopicPartitionKey]) -> int:
        """Records of `keys` produced or held and not yet acknowledged (orphans excluded)."""
        held = (work for queue in self._partition_order.values() for work in queue if work.output is not None)
        out = itertools.chain(self._produced.values(), held)
        return sum(1 for work in out if not work.orphan and work.partition_key in keys)

    def give_up(self, keys: Collection[TopicPartitionKey]) -> int:
        """This worker no longer owns `keys`: drop their held outputs (the next owner redoes them), orphan
        the produced ones; returns how many held outputs were dropped."""
        before = self._held
        for state in [state for state in self._partition_order if state.key in keys]:
            held = [work for work in self._partition_order.pop(state) if work.output is not None]
            self._held -= len(held)
            for work in held:  # its next owner (or the redo) traces it anew
                work.trace.outcome("given_up", "its partition left this worker while its output was held")
                work.trace.finish()
        self._orphans.adopt(self._produced.values(), keys)
        return before - self._held

    def __len__(self) -> int:
        """Records produced or held, not yet acknowledged."""
        return len(self._produced) + self._held
