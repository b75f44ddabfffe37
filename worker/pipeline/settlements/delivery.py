"""Producing an output, and what becomes of one the broker did not take: the same for every settlement.

`send(producer, output, report, give_up_at)` produces one output with its delivery report; a full client
queue is waited out until `give_up_at`, and a record refused before it was queued is reported at once.

`DeliveryRules` holds the delivery-error rules every Kafka settlement follows (they were written twice
before, issue #44):

- a **dead letter refused as too large** is written smaller, with its `triage.*` headers only (they point at
  the original in the source topic) and the size left out, a few times: the broker refuses a whole batch for
  one large record;
- a **triage record refused for its content** (its size, its form: another record to the topic would go
  through) is replaced by the ticket's dead letter (`result_refused`), so that no single ticket can stop
  its partition;
- an **output refused for its content with no dead-letter topic to turn to** (a replay's: each record it
  reads is a dead letter already) is *left out*: its record is settled without it, and stays where it was,
  for the same reason;
- anything else **failed for good**: the settlement decides what that means (group mode stops the partition
  at it, queue mode releases the record for another try, exactly-once redoes the transaction).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Protocol

import confluent_kafka
import structlog

from worker.kafka import errors
from worker.kafka.clients import produce
from worker.kafka.dead_letters import OMITTED_BYTES, RESULT_REFUSED
from worker.pipeline.metrics import PipelineMetrics
from worker.pipeline.settlements.deliveries import Deliveries
from worker.pipeline.tracing import TRACE_HEADERS
from worker.pipeline.triage.records import DeadLetterRedaction, dead_letter
from worker.pipeline.work import Output, Work

_log = structlog.get_logger("worker.pipeline")

_QUEUE_FULL = confluent_kafka.KafkaError._QUEUE_FULL
_INVALID_ARG = confluent_kafka.KafkaError._INVALID_ARG
TOO_LARGE = confluent_kafka.KafkaError.MSG_SIZE_TOO_LARGE
# How often a dead letter written smaller is sent before its record fails for good.
_SHRUNK_DEAD_LETTER_TRIES = 3


class DeliveryReport(Protocol):
    """What `send` reports an output's fate to: librdkafka's delivery callback `(error, message)`, or, for a
    record refused before it was queued, the same with `queued=False`."""

    def __call__(
        self, error: confluent_kafka.KafkaError | None, message: Any, queued: bool = True
    ) -> None: ...


def send(
    producer: confluent_kafka.Producer, output: Output, report: DeliveryReport, give_up_at: float | None
) -> None:
    """Produce `output` with `report` as its delivery callback. A full local queue (a slow or absent broker)
    is waited out until `give_up_at` (a `time.monotonic()` instant; None: as long as it takes), then reported
    as `_QUEUE_FULL`; a record refused before queueing (over `message.max.bytes`, a topic name with a NUL
    byte from a replay's targets) is reported at once, `queued=False`: a transaction never saw it."""
    try:
        produce(producer, output.topic, output.value, output.key, output.headers, report, give_up_at)
    except BufferError:
        report(confluent_kafka.KafkaError(_QUEUE_FULL), None)
    except confluent_kafka.KafkaException as refused:
        report(refused.args[0], None, queued=False)
    except (TypeError, ValueError) as refused:
        report(
            confluent_kafka.KafkaError(_INVALID_ARG, f"{type(refused).__name__}: {refused}"),
            None,
            queued=False,
        )


def send_tracked(
    producer: confluent_kafka.Producer,
    deliveries: Deliveries,
    work: Work,
    output: Output,
    on_delivery: Callable[[int, Output, confluent_kafka.KafkaError | None, Any, bool], None],
    give_up_at: float | None,
) -> None:
    """`send` `work`'s `output`, tracked in `deliveries` until its report reaches `on_delivery(delivery id,
    output, error, message, queued)`."""
    delivery_id = deliveries.to_broker(work)
    send(producer, output, functools.partial(on_delivery, delivery_id, output), give_up_at)


def smaller(work: Work, output: Output, shrunk: int) -> Output:
    """A dead letter too large for its topic (it carries the original value, key and headers) with its
    `triage.*` headers only, which point at the original in the source topic, and the size left out; and its
    trace context, a few dozen bytes that link a replay of it to the ticket's trace."""
    headers = output.headers or []
    kept = [(n, v) for n, v in headers if _kept_when_shrunk(n) and n != OMITTED_BYTES]
    omitted = output.omitted or (
        len(output.value or b"")
        + len(output.key or b"")
        + sum(len(n) + len(v or b"") for n, v in headers if not _kept_when_shrunk(n))
    )
    kept.append((OMITTED_BYTES, str(omitted).encode("ascii")))
    _log.warning("dead_letter_shrunk", partition=work.partition, offset=work.offset, omitted_bytes=omitted)
    return Output(output.topic, None, None, kept, omitted, shrunk)


def _kept_when_shrunk(header: str) -> bool:
    return header.startswith("triage.") or header in TRACE_HEADERS


class DeliveryRules:
    """The delivery-error rules (see the module docstring). `dead_letter_topic` None: outputs have no
    dead-letter topic (a replay's go back where they came from), so none is written smaller and one refused
    for its content is left out; `redaction` masks a refused result's dead letter as any other's."""

    def __init__(
        self,
        dead_letter_topic: str | None,
        redaction: DeadLetterRedaction,
        metrics: PipelineMetrics,
        clock: Callable[[], float],
    ) -> None:
        self.dead_letter_topic = dead_letter_topic
        self._redaction = redaction
        self._metrics = metrics
        self._clock = clock

    def redact_as(self, redaction: DeadLetterRedaction) -> None:
        """Mask the dead letters made from now on with `redaction` (a hot reload's, from its thread)."""
        self._redaction = redaction

    def delivered(self, work: Work) -> None:
        """An output was acknowledged: counted, with the record's time from poll to acknowledgement."""
        self._metrics.produced += 1
        self._metrics.end_to_end.observe(self._clock() - work.polled_at, work.trace.trace_ids)
        work.trace.end("produce")
        work.trace.begin("settle")

    def instead(self, work: Work, output: Output, error: confluent_kafka.KafkaError) -> Output | None:
        """The output to write instead of one the broker refused, or None: it failed for good. An orphan's
        refused result is not replaced: its partition's new owner writes it."""
        if error.code() == TOO_LARGE and self.shrinkable(output):
            return smaller(work, output, output.shrunk + 1)
        if not work.orphan and self.dead_letter_topic is not None and self.refused_for_content(output, error):
            return self.refused_result(work, error)
        return None

    def shrinkable(self, output: Output) -> bool:
        """A dead letter refused as too large is written smaller, a few times."""
        return output.topic == self.dead_letter_topic and output.shrunk < _SHRUNK_DEAD_LETTER_TRIES

    def refused_for_content(self, output: Output, error: confluent_kafka.KafkaError) -> bool:
        """Whether the broker refused an output that is not a dead letter for its content: another record to
        its topic would go through, so its record must not stop its partition. Its ticket goes to the
        dead-letter topic instead (`refused_result`), or, without one, the output is left out (`left_out`)."""
        return output.topic != self.dead_letter_topic and error.code() in errors.REFUSED_CONTENT

    def left_out(self, output: Output, error: confluent_kafka.KafkaError) -> bool:
        """Whether a refused output is left out: refused for its content with no dead-letter topic to turn to
        (a replay's outputs: the record read is a dead letter already, which stays where it is). Its record
        is settled without it, as one that needs no output (`leaving_out`)."""
        return self.dead_letter_topic is None and self.refused_for_content(output, error)

    def leaving_out(self, work: Work, output: Output, error: confluent_kafka.KafkaError) -> None:
        """An output is left out (`left_out`): logged with why, as a delivery that failed is."""
        _log.warning(
            "output_left_out",
            topic=work.topic,
            partition=work.partition,
            offset=work.offset,
            target=output.topic,
            code=error.name(),
            reason=error.str(),
            effect="settled without it: the record stays where it was",
        )

    def refused_result(self, work: Work, error: confluent_kafka.KafkaError) -> Output:
        """The dead letter that replaces a triage record the broker refused for its content."""
        assert self.dead_letter_topic is not None  # `refused_for_content` said so
        self._metrics.dead_letter(RESULT_REFUSED)
        _log.warning(
            "result_refused",
            topic=work.topic,
            partition=work.partition,
            offset=work.offset,
            code=error.name(),
            effect="the ticket is dead-lettered",
        )
        reason = f"the triage record was refused: {error.name()}: {error.str()}"
        work.trace.outcome("dead_letter", RESULT_REFUSED)
        letter = dead_letter(work, self.dead_letter_topic, RESULT_REFUSED, reason, self._redaction)
        return dataclasses.replace(letter, headers=work.trace.headers(letter.headers))

    def undelivered_letter(self, work: Work, error: confluent_kafka.KafkaError, error_type: str) -> Output:
        """The dead letter (`error_type`) of a record whose triage record failed for good where the record
        cannot be tried again (queue mode: its last delivery)."""
        assert self.dead_letter_topic is not None
        self._metrics.dead_letter(error_type)
        if self._metrics.queue is not None:
            self._metrics.queue.delivery_count_exceeded += 1
        reason = f"its triage record could not be delivered ({error.name()}: {error.str()})"
        work.trace.outcome("dead_letter", error_type)
        letter = dead_letter(work, self.dead_letter_topic, error_type, reason, self._redaction)
        return dataclasses.replace(letter, headers=work.trace.headers(letter.headers))

    def failed(self, work: Work, error: confluent_kafka.KafkaError, effect: str, severe: bool = True) -> None:
        """A delivery failed for good: counted and logged with what the settlement does about it."""
        self._metrics.delivery_failed += 1
        work.trace.outcome("delivery_failed", error.name())
        work.trace.finish()
        log = _log.error if severe else _log.warning
        log(
            "delivery_failed",
            topic=work.topic,
            partition=work.partition,
            offset=work.offset,
            code=error.name(),
            reason=error.str(),
            effect=effect,
        )
