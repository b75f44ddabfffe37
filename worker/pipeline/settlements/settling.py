"""Acknowledged records whose trace waits for a commit past their offset (group mode's `settle` step).

A record's output is acknowledged out of order, but it is settled only once a confirmed commit passes its
offset (at least once: the group's offsets; exactly once: the transaction). Only records whose trace records
are kept here, so with tracing off this holds nothing.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from worker.kafka.commits import TopicPartitionKey
from worker.pipeline.work import Work


class AwaitingCommit:
    """Traced records acknowledged and not yet covered by a confirmed commit, by partition. `settled_by`
    names how a commit settles them ("commit", "transaction") on their `settle` step."""

    def __init__(self, settled_by: str) -> None:
        self._settled_by = settled_by
        self._by_partition: dict[TopicPartitionKey, list[Work]] = {}

    def acknowledged(self, work: Work) -> None:
        if work.trace.recording:
            self._by_partition.setdefault(work.partition_key, []).append(work)

    def committed(self, positions: Mapping[TopicPartitionKey, int]) -> None:
        """A commit at `positions` was confirmed: the records below each position are settled."""
        for key, position in positions.items():
            waiting = self._by_partition.get(key)
            if not waiting:
                continue
            for work in waiting:
                if work.offset < position:
                    work.trace.end("settle", settled_by=self._settled_by)
                    work.trace.finish()
            self._by_partition[key] = [work for work in waiting if work.offset >= position]

    def forget(self, keys: Collection[TopicPartitionKey], why: str) -> None:
        """`keys` will not be committed by this worker (lost, given up, or redone): their traces end, saying
        `why`."""
        for key in [key for key in self._by_partition if key in keys]:
            for work in self._by_partition.pop(key):
                work.trace.outcome("given_up", why)
                work.trace.finish()
