"""Records in flight whose partition this worker no longer owns.

When a partition is revoked or lost (or, exactly-once, its work is redone), its records at the model, at
the escalation stage or at the producer become *orphans*: their answers and reports still arrive, hold
memory until then and count as in flight, but their results are not written. `requests.py` and
`deliveries.py` each keep their own orphans with this one rule.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from worker.kafka.commits import TopicPartitionKey
from worker.pipeline.work import Work


class Orphans:
    """How many records of partitions given up are still out, and the rule for when they come back."""

    def __init__(self) -> None:
        self.count = 0

    def adopt(self, out: Iterable[Work], keys: Collection[TopicPartitionKey]) -> None:
        """Mark the records of `keys` among `out` orphans."""
        for work in out:
            if not work.orphan and work.partition_key in keys:
                work.orphan = True
                self.count += 1
                work.trace.outcome("given_up", "its partition left this worker")
                work.trace.finish()

    def back(self, work: Work | None) -> Work | None:
        """A record came back (an answer or a report): an orphan leaves the count here."""
        if work is not None and work.orphan:
            self.count -= 1
        return work
