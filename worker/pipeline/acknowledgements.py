"""Queue mode's delivery guarantee: each record's output is produced, and its delivery report decides how
the record is acknowledged to the share group.

The same idea as `guarantees.py` (the loop decides *what* to write, this part *how* it reaches Kafka), for
a share group instead of a consumer group: there are no offsets to commit, each record is acknowledged on
its own. Its outcome is told to the loop (`settle(work, outcome)`), which acknowledges it:

- `ACCEPT`: the record's triage record was acknowledged by the broker;
- `REJECT`: its dead letter was acknowledged (the record is archived, never redelivered);
- `RELEASE`: its output could not be delivered (a producer error, the broker away past
  `delivery.timeout.ms`): the share group hands it out again, to this worker or another.

As in group mode, a result Kafka refuses for its content goes to the dead-letter topic instead
(`result_refused`), and a dead letter too large is written smaller, a few times (`guarantees.smaller`).

The contract, on the loop's thread: `write(work, output)`; `serve(wait_s)` serves delivery reports;
`outstanding` outputs wait for theirs; `abandon(works)`: records the loop released already (shutdown, the
lock running out), whose reports will be ignored; `stop(limit)` flushes, returns how many were not flushed.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Iterable
from typing import Any

import confluent_kafka
import structlog

from worker.config import Settings
from worker.kafka import errors
from worker.kafka.clients import ProducerFactory
from worker.kafka.dead_letters import RESULT_REFUSED
from worker.pipeline.deliveries import Deliveries
from worker.pipeline.guarantees import Failure, send, smaller
from worker.pipeline.metrics import PipelineMetrics
from worker.pipeline.records import DeadLetterRedaction, dead_letter
from worker.pipeline.work import Output, Work

_log = structlog.get_logger("worker.pipeline")

_TOO_LARGE = confluent_kafka.KafkaError.MSG_SIZE_TOO_LARGE
_SHRUNK_DEAD_LETTER_TRIES = 3


class Acknowledgement(enum.Enum):
    """How a record is acknowledged (the share consumer's `AcknowledgeType`)."""

    ACCEPT = confluent_kafka.AcknowledgeType.ACCEPT
    RELEASE = confluent_kafka.AcknowledgeType.RELEASE
    REJECT = confluent_kafka.AcknowledgeType.REJECT


class Acknowledging:
    """Produces outputs and tells `settle` each record's outcome once its report arrives."""

    def __init__(
        self,
        settings: Settings,
        clients: ProducerFactory,
        metrics: PipelineMetrics,
        clock: Callable[[], float],
        failure: Failure,
        settle: Callable[[Work, Acknowledgement], None],
        give_up_at: Callable[[], float | None],
    ) -> None:
        self._dead_letter_topic = settings.topics.dead_letter
        self._dead_letter_redaction = DeadLetterRedaction.configured(settings)
        self._metrics, self._clock, self._failure = metrics, clock, failure
        self._settle, self._give_up_at = settle, give_up_at
        self.deliveries = Deliveries()
        self._producer = clients.producer(self._on_producer_error)

    @property
    def outstanding(self) -> int:
        return len(self.deliveries)

    def write(self, work: Work, output: Output) -> None:
        delivery_id = self.deliveries.to_broker(work)
        send(
            self._producer,
            output,
            functools.partial(self._on_delivery, delivery_id, output),
            self._give_up_at(),
        )

    def serve(self, wait_s: float) -> None:
        try:
            self._producer.poll(wait_s)
        except confluent_kafka.KafkaException as problem:
            self._failure.set(errors.describe(problem))

    def abandon(self, works: Iterable[Work]) -> None:
        """The loop released these records: their reports, when they come, change nothing."""
        keys = {work.partition_key for work in works}
        if keys:
            self.deliveries.give_up(keys)

    def stop(self, limit: float) -> int:
        if self._failure.reason is not None:
            return len(self._producer)
        return int(self._producer.flush(max(0.0, limit - self._clock())))

    def _on_delivery(
        self,
        delivery_id: int,
        output: Output,
        error: confluent_kafka.KafkaError | None,
        _msg: Any,
        queued: bool = True,  # no transaction here: refused before or after queueing, the same
    ) -> None:
        work = self.deliveries.delivered(delivery_id)
        if work is None or work.orphan:
            return
        if error is None:
            self._metrics.produced += 1
            self._metrics.end_to_end.observe(self._clock() - work.polled_at)
            dead = output.topic == self._dead_letter_topic
            self._settle(work, Acknowledgement.REJECT if dead else Acknowledgement.ACCEPT)
            return
        if error.code() == _TOO_LARGE and output.topic == self._dead_letter_topic:
            if output.shrunk < _SHRUNK_DEAD_LETTER_TRIES:
                self.write(work, smaller(work, output, output.shrunk + 1))
                return
        elif output.topic != self._dead_letter_topic and error.code() in errors.REFUSED_CONTENT:
            self._metrics.dead_letter(RESULT_REFUSED)
            reason = f"the triage record was refused: {error.name()}: {error.str()}"
            topic, redaction = self._dead_letter_topic, self._dead_letter_redaction
            self.write(work, dead_letter(work, topic, RESULT_REFUSED, reason, redaction))
            return
        self._metrics.delivery_failed += 1
        _log.warning(
            "delivery_failed",
            topic=work.topic,
            partition=work.partition,
            offset=work.offset,
            code=error.name(),
            reason=error.str(),
            effect="the record is released: the share group hands it out again",
        )
        self._settle(work, Acknowledgement.RELEASE)

    def _on_producer_error(self, error: confluent_kafka.KafkaError) -> None:
        if error.fatal():
            self._failure.set(errors.describe(error))
            _log.error("kafka_fatal_error", reason=errors.describe(error))
        else:
            self._failure.client_error(error)
