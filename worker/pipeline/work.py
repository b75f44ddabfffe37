"""One record taken from Kafka (`Work`) and what the pipeline writes for it (`Output`).

A `Work` lives from poll until the broker acknowledged its output; on its way it is waiting for the model
(`dispatch_queue.py`), at the model or the escalation stage (`requests.py`), and at the producer
(`deliveries.py`, the guarantee's). Its offset stays in the offset tracker until a commit passes it.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.classification import Classification
from worker.kafka.commits import TopicPartitionKey
from worker.messages import SourcePosition, TicketEvent
from worker.pipeline.settlements.offsets import PartitionOffsets
from worker.pipeline.tracing import NO_TRACE, TicketTrace
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
    # Its trace (`tracing.py`): set when it is taken, ended when it is settled.
    trace: TicketTrace = NO_TRACE

    @property
    def partition_key(self) -> TopicPartitionKey:
        return (self.topic, self.partition)

    @property
    def source(self) -> SourcePosition:
        return SourcePosition(topic=self.topic, partition=self.partition, offset=self.offset)
