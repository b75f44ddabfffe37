"""Which offsets may be committed: the highest *contiguous* finished offset + 1, per partition.

Tickets finish out of order (the model answers a short ticket before a long one, a dead letter is acknowledged
before a classification), but Kafka only stores one position per partition: everything below it counts as
processed. Committing past an unfinished ticket would lose it on a crash (the bug peers shipped), so each
partition keeps its offsets in consume order and the commit position only moves over a finished prefix.

An offset stays tracked until the broker has *confirmed* a commit past it. The pipeline's in-flight bound
counts tracked offsets, so a crash can re-deliver (duplicate) at most `max_in_flight` tickets.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator

from worker.kafka.commits import TopicPartitionKey


class PartitionOffsets:
    """Offsets of one assigned partition that were taken from Kafka and are not yet committed."""

    __slots__ = ("_done", "_expected", "_failed", "_last_tracked", "_ready", "_requested", "_waiting", "key")

    def __init__(self, key: TopicPartitionKey) -> None:
        self.key = key
        # Offsets in consume order whose predecessors are not all finished; the head is unfinished.
        self._waiting: deque[int] = deque()
        # Finished offsets still in `_waiting` (they wait for the head to finish).
        self._done: set[int] = set()
        # Offsets whose delivery failed for good: they never finish, so the position never passes them.
        self._failed: set[int] = set()
        # Finished, contiguous offsets waiting for a confirmed commit past them.
        self._ready: deque[int] = deque()
        self._last_tracked = -1
        # Position of the last commit sent and not failed (confirmed or still on its way).
        self._requested = -1
        # After a seek (exactly-once redo): the offset the partition starts at again; records before it
        # (there should be none: librdkafka drops records fetched before a seek) are skipped.
        self._expected: int | None = None

    def __len__(self) -> int:
        return len(self._waiting) + len(self._ready)

    def is_new(self, offset: int) -> bool:
        """Whether `track(offset)` would take it (False for a re-delivery to skip)."""
        return offset > self._last_tracked and (self._expected is None or offset >= self._expected)

    def track(self, offset: int) -> bool:
        """Start tracking `offset`; False when it is not newer than the last one (a re-delivery to skip)."""
        if not self.is_new(offset):
            return False
        self._last_tracked = offset
        self._waiting.append(offset)
        return True

    def done(self, offset: int) -> None:
        """Mark `offset` finished (its record or dead letter was acknowledged by the broker)."""
        if offset in self._failed or offset in self._done or offset > self._last_tracked:
            return
        self._done.add(offset)
        waiting, done = self._waiting, self._done
        while waiting and waiting[0] in done:
            head = waiting.popleft()
            done.discard(head)
            self._ready.append(head)

    def fail(self, offset: int) -> None:
        """Mark `offset` as never finishing: the partition's commit position stops below it for good."""
        if offset in self._waiting and offset not in self._done:
            self._failed.add(offset)

    @property
    def first_uncommitted(self) -> int | None:
        """The lowest offset taken and not covered by a confirmed commit: where a redo starts."""
        if self._ready:
            return self._ready[0]
        return self._waiting[0] if self._waiting else None

    @property
    def blocked_at(self) -> int | None:
        """The lowest offset whose delivery failed for good, if any."""
        return min(self._failed) if self._failed else None

    @property
    def position(self) -> int | None:
        """Highest contiguous finished offset + 1, or None when nothing has finished since the last commit."""
        return self._ready[-1] + 1 if self._ready else None

    def commit_position(self) -> int | None:
        """The position to commit now, or None when no commit past the last requested one is possible."""
        position = self.position
        if position is None or position <= self._requested:
            return None
        return position

    def commit_requested(self, position: int) -> None:
        self._requested = max(self._requested, position)

    def commit_failed(self, position: int) -> None:
        """A commit did not reach the broker: allow the same position to be committed again."""
        if self._requested == position:
            self._requested = -1

    def committed(self, position: int) -> int:
        """The broker confirmed a commit at `position`: stop tracking offsets below it; returns how many."""
        released = 0
        ready = self._ready
        while ready and ready[0] < position:
            ready.popleft()
            released += 1
        return released

    @property
    def uncommitted_done(self) -> int:
        """Finished offsets not yet covered by a confirmed commit."""
        return len(self._ready) + len(self._done)


class OffsetTracker:
    """Per-partition offset tracking for the partitions this worker currently owns."""

    def __init__(self) -> None:
        self._partitions: dict[TopicPartitionKey, PartitionOffsets] = {}

    def __len__(self) -> int:
        """Tracked (polled, not yet committed) offsets over all owned partitions."""
        return sum(len(state) for state in self._partitions.values())

    def __iter__(self) -> Iterator[PartitionOffsets]:
        return iter(list(self._partitions.values()))

    def assign(self, key: TopicPartitionKey) -> PartitionOffsets:
        """Start owning a partition (a fresh state: its earlier owner's leftovers never count)."""
        state = PartitionOffsets(key)
        self._partitions[key] = state
        return state

    def restart(self, key: TopicPartitionKey, at: int, blocked: bool = False) -> PartitionOffsets:
        """Forget a partition's offsets after the consumer was sought to `at`: a fresh state that takes
        records from `at` on (or none, `blocked` at `at`: a record there can never be written)."""
        state = self.assign(key)
        state._expected = at
        if blocked:
            state._failed.add(at)
        return state

    def get(self, key: TopicPartitionKey) -> PartitionOffsets | None:
        return self._partitions.get(key)

    def is_current(self, state: PartitionOffsets) -> bool:
        """Whether `state` still belongs to an owned partition (not revoked, lost or re-assigned since)."""
        return self._partitions.get(state.key) is state

    def revoke(self, keys: Iterable[TopicPartitionKey]) -> list[PartitionOffsets]:
        """Stop owning partitions; returns their states (for a last commit and for counting leftovers)."""
        return [state for key in keys if (state := self._partitions.pop(key, None)) is not None]

    def commit_positions(self) -> dict[TopicPartitionKey, int]:
        """Positions that can be committed now, over all owned partitions."""
        positions: dict[TopicPartitionKey, int] = {}
        for state in self._partitions.values():
            if (position := state.commit_position()) is not None:
                positions[state.key] = position
        return positions

    def uncommitted_done(self) -> int:
        return sum(state.uncommitted_done for state in self._partitions.values())

    def blocked(self) -> dict[TopicPartitionKey, int]:
        """Owned partitions stopped by a delivery that failed for good, with the offset they stop at."""
        return {key: at for key, state in self._partitions.items() if (at := state.blocked_at) is not None}
