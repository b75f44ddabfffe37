"""The tickets waiting for the model, in the order the pipeline hands them to it.

Waiting tickets go to the model earliest deadline first (`pipeline.scheduling = "edf"`; ties and `"fifo"`
in arrival order): under load a ticket whose producer asked for an early `deadline_at` is not stuck behind
ones that can wait. A revoked partition's tickets go before all others (see `first_to_model`). A ticket
whose deadline passes while it waits is taken out by `expired`, to be answered without the model.

The queue is the pipeline's scheduling policy, not the delivery guarantee's: the guarantee only ever sees
outputs (see `guarantees.py`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Collection

from worker.kafka.commits import TopicPartitionKey
from worker.pipeline.work import Work
from worker.settings import Scheduling

# Heap entries of tickets no longer waiting are skipped when they surface; a heap is rebuilt without them
# once they outnumber the waiting tickets (plus this slack), which keeps every operation amortised O(log n).
_STALE_SLACK = 64


class DispatchQueue:
    """Tickets waiting for the model, by arrival number; the two heaps hold arrival numbers."""

    def __init__(self, scheduling: Scheduling = "edf") -> None:
        self._edf = scheduling == "edf"
        self._waiting: dict[int, Work] = {}
        # Service order: (0 for a revoked partition's tickets else 1, deadline (0 for FIFO), arrival).
        self._order: list[tuple[int, float, int]] = []
        # Expiry order: (deadline, arrival).
        self._deadlines: list[tuple[float, int]] = []
        self._arrivals = itertools.count()

    def __len__(self) -> int:
        return len(self._waiting)

    def wait(self, work: Work) -> None:
        arrival = next(self._arrivals)
        self._waiting[arrival] = work
        work.trace.begin("queue")
        heapq.heappush(self._order, (1, work.deadline if self._edf else 0.0, arrival))
        heapq.heappush(self._deadlines, (work.deadline, arrival))

    def next(self) -> Work | None:
        """The ticket to serve next, taken out (None when none waits)."""
        while self._order:
            work = self._waiting.pop(heapq.heappop(self._order)[2], None)
            if work is not None:
                self._drop_stale()
                work.trace.end("queue")
                return work
        return None

    def expired(self, now: float) -> list[Work]:
        """Take out the tickets whose deadline has passed, earliest deadline first."""
        late = []
        while self._deadlines and self._deadlines[0][0] <= now:
            work = self._waiting.pop(heapq.heappop(self._deadlines)[1], None)
            if work is not None:
                work.trace.end("queue")
                late.append(work)
        if late:
            self._drop_stale()
        return late

    def earliest_deadline(self) -> float | None:
        """The earliest deadline among the waiting tickets (None when none waits)."""
        while self._deadlines and self._deadlines[0][1] not in self._waiting:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else None

    def first_to_model(self, keys: Collection[TopicPartitionKey]) -> None:
        """Serve the tickets of `keys` before all others (on revoke they must finish first)."""
        self._order = [
            (0 if self._waiting[arrival].partition_key in keys else rank, order, arrival)
            for rank, order, arrival in self._order
            if arrival in self._waiting
        ]
        heapq.heapify(self._order)

    def take_out(self, works: Collection[Work]) -> list[Work]:
        """Take `works` out of the queue (those of them waiting), to be answered without the model."""
        found = [(arrival, work) for arrival, work in self._waiting.items() if work in works]
        for arrival, work in found:
            del self._waiting[arrival]
            work.trace.end("queue")
        if found:
            self._drop_stale()
        return [work for _, work in found]

    def pending(self, keys: Collection[TopicPartitionKey]) -> int:
        return sum(1 for work in self._waiting.values() if work.partition_key in keys)

    def give_up(self, keys: Collection[TopicPartitionKey]) -> int:
        """This worker no longer owns `keys`: drop their tickets (the next owner reads them again); returns
        how many were dropped."""
        before = len(self._waiting)
        for work in self._waiting.values():
            if work.partition_key in keys:  # its next owner traces it anew
                work.trace.outcome("given_up", "its partition left this worker while it waited")
                work.trace.finish()
        self._waiting = {n: work for n, work in self._waiting.items() if work.partition_key not in keys}
        self._drop_stale()
        return before - len(self._waiting)

    def _drop_stale(self) -> None:
        limit = 2 * len(self._waiting) + _STALE_SLACK
        if len(self._order) > limit:
            self._order = [entry for entry in self._order if entry[2] in self._waiting]
            heapq.heapify(self._order)
        if len(self._deadlines) > limit:
            self._deadlines = [entry for entry in self._deadlines if entry[1] in self._waiting]
            heapq.heapify(self._deadlines)
