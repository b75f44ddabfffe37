"""The offline doors' settlement: each line's outcome handed over in input order, as soon as every earlier
line's is known — `classify` prints them, `model eval` collects them.

A triage record or a dead letter written for a line is held until the lines before it have theirs, then
`deliver(work, output)` gets it (the dead-letter topic's name tells one from the other). Nothing goes to
Kafka, so nothing is produced, awaited or committed: what is held is what is in flight, and the in-flight
bound is the memory bound of a stream. A record handed over, or one that needs no output (`done`), counts as
done in its partition's offsets, as an acknowledged one would.

A replay's dry run settles through it too (`worker/app/replay.py`): it publishes and commits nothing, and
each output it would publish is handed back at once as acknowledged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

from worker.kafka.commits import TopicPartitionKey
from worker.pipeline.settlements.without_offsets import WithoutOffsets
from worker.pipeline.work import Output, Work

Deliver = Callable[[Work, Output], None]


class InOrder(WithoutOffsets):
    """Outputs handed to `deliver` in the order their records were taken (see the module docstring)."""

    def __init__(self, deliver: Deliver) -> None:
        self._deliver = deliver
        # Taken and not yet delivered, in take order; None until its output is written.
        self._order: dict[Work, Output | None] = {}

    @property
    def held(self) -> int:
        return len(self._order)

    # -- seams.Settlement -----------------------------------------------------------------------------------

    def taken(self, work: Work) -> None:
        self._order[work] = None

    def write(self, work: Work, output: Output) -> None:
        self._order[work] = output
        self._hand_over()

    def done(self, work: Work) -> None:
        """A record that needs no output: the outputs held behind it are handed over."""
        del self._order[work]
        work.state.done(work.offset)
        work.trace.finish()
        self._hand_over()

    def _hand_over(self) -> None:
        """Deliver the outputs whose earlier records are all settled, in order."""
        while self._order:
            first, ready = next(iter(self._order.items()))
            if ready is None:
                return
            del self._order[first]
            first.state.done(first.offset)
            self._deliver(first, ready)
            first.trace.finish()

    def serve(self, wait_s: float) -> None:
        pass  # every write is delivered at once, or held for an earlier one: no report to wait for

    def wait(self, wait_s: float) -> None:
        time.sleep(wait_s)  # nothing to wait for here: the caller is only to not spin

    @property
    def outstanding(self) -> int:
        return 0

    @property
    def orphans(self) -> int:
        return 0

    def pending(self, keys: set[TopicPartitionKey]) -> int:
        return 0

    def give_up(self, keys: set[TopicPartitionKey]) -> None:
        pass

    def abandon(self, works: Collection[Work]) -> None:
        pass

    def stop(self, limit: float) -> int:
        """Lines whose outcome never came (a stop before the end): not delivered."""
        return len(self._order)

    def where(self) -> list[int]:
        return [0, len(self._order)]
