"""Queue mode's settlement: each record's output is produced, and its delivery report decides how the record
is acknowledged to the share group (`sources/share.py` acknowledges it).

The same idea as `guarantees.py` (the loop decides *what* to write, this part *how* it reaches Kafka), for a
share group instead of a consumer group: there are no offsets to commit, each record is settled on its own:

- `ACCEPT`: the record's triage record was acknowledged by the broker;
- `REJECT`: its dead letter was acknowledged (the record is archived, never redelivered);
- `RELEASE`: its output could not be delivered (a producer error, the broker away past
  `delivery.timeout.ms`): the share group hands it out again, to this worker or another. Not on the
  record's last delivery (the broker would archive it without a trace): a triage record that failed is
  replaced by the ticket's dead letter (`delivery_count_exceeded`, with why); only a dead letter that fails
  too releases it, to the broker's own net (its dead-letter topic, where one is configured).

A refused output first goes through the same delivery-error rules as in group mode
(`delivery.DeliveryRules`: a dead letter too large is written smaller, a result refused for its content is
replaced by the ticket's dead letter). There is no transaction, nothing to commit: the group-only steps
are `without_offsets.WithoutOffsets`'.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import confluent_kafka
import structlog

from worker.kafka import errors
from worker.kafka.clients import ProducerFactory
from worker.kafka.commits import TopicPartitionKey
from worker.kafka.dead_letters import DELIVERY_COUNT_EXCEEDED
from worker.pipeline.failure import Failure
from worker.pipeline.settlements.deliveries import Deliveries
from worker.pipeline.settlements.delivery import DeliveryRules, send_tracked
from worker.pipeline.settlements.without_offsets import WithoutOffsets
from worker.pipeline.sources.share import Acknowledgement
from worker.pipeline.work import Output, Work

_log = structlog.get_logger("worker.pipeline")

Acknowledge = Callable[[Work, Acknowledgement], None]


class Acknowledging(WithoutOffsets):
    """Produces outputs and acknowledges each record through `acknowledge` once its report arrives."""

    def __init__(
        self,
        clients: ProducerFactory,
        rules: DeliveryRules,
        failure: Failure,
        acknowledge: Acknowledge,
        give_up_at: Callable[[], float | None],
        clock: Callable[[], float],
        last_delivery: Callable[[Work], bool] = lambda work: False,
    ) -> None:
        """`last_delivery(work)`: whether the record is on its last delivery (the source's)."""
        self._rules, self._failure = rules, failure
        self._last_delivery = last_delivery
        self._acknowledge, self._give_up_at = acknowledge, give_up_at
        self._clock = clock
        self.deliveries = Deliveries()
        self._producer = clients.producer(self._on_producer_error)

    # -- seams.Settlement -----------------------------------------------------------------------------------

    def taken(self, work: Work) -> None:
        pass  # no order to keep: each record is settled on its own

    def write(self, work: Work, output: Output) -> None:
        send_tracked(self._producer, self.deliveries, work, output, self._on_delivery, self._give_up_at())

    def done(self, work: Work) -> None:
        """A record that needs no output is accepted: settled, never handed out again."""
        self._acknowledge(work, Acknowledgement.ACCEPT)

    def serve(self, wait_s: float) -> None:
        try:
            self._producer.poll(wait_s)
        except confluent_kafka.KafkaException as problem:
            self._failure.set(errors.describe(problem))

    def wait(self, wait_s: float) -> None:
        self.serve(wait_s)

    @property
    def outstanding(self) -> int:
        return len(self.deliveries)

    @property
    def orphans(self) -> int:
        return self.deliveries.orphans

    def pending(self, keys: set[TopicPartitionKey]) -> int:
        return self.deliveries.pending(keys)

    def give_up(self, keys: set[TopicPartitionKey]) -> None:
        self.deliveries.give_up(keys)

    def abandon(self, works: Collection[Work]) -> None:
        """The source released these records: their reports, when they come, change nothing."""
        keys = {work.partition_key for work in works}
        if keys:
            self.deliveries.give_up(keys)

    def stop(self, limit: float) -> int:
        if self._failure.reason is not None:
            return len(self._producer)
        return int(self._producer.flush(max(0.0, limit - self._clock())))

    def where(self) -> list[int]:
        return [self.deliveries.at_producer, 0]

    # -- delivery reports -----------------------------------------------------------------------------------

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
            self._rules.delivered(work)
            dead = output.topic == self._rules.dead_letter_topic
            acknowledgement = Acknowledgement.REJECT if dead else Acknowledgement.ACCEPT
            self._acknowledge(work, acknowledgement)
            work.trace.end("settle", settled_by=f"acknowledgement {acknowledgement.name}")
            work.trace.finish()
            return
        instead = self._rules.instead(work, output, error)
        if instead is not None:
            self.write(work, instead)
            return
        dead_letter_topic = self._rules.dead_letter_topic
        if output.topic != dead_letter_topic and dead_letter_topic is not None and self._last_delivery(work):
            self._rules.failed(
                work, error, "its last delivery: the ticket is dead-lettered instead", severe=False
            )
            self.write(work, self._rules.undelivered_letter(work, error, DELIVERY_COUNT_EXCEEDED))
            return
        if self._last_delivery(work):
            self._rules.failed(
                work, error, "its last delivery: released to the broker's own net (its dead-letter topic)"
            )
            self._acknowledge(work, Acknowledgement.RELEASE)
            return
        self._rules.failed(
            work, error, "the record is released: the share group hands it out again", severe=False
        )
        self._acknowledge(work, Acknowledgement.RELEASE)

    def _on_producer_error(self, error: confluent_kafka.KafkaError) -> None:
        if error.fatal():
            self._failure.set(errors.describe(error))
            _log.error("kafka_fatal_error", reason=errors.describe(error))
        else:
            self._failure.client_error(error)
