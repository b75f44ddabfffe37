"""Consumer and producer factories: the user's librdkafka options plus the few the pipeline relies on.

`settings.kafka` passes through untouched (SASL, SSL, timeouts, ...). On top of it:

- the consumer never commits by itself (`enable.auto.commit=false`, `enable.auto.offset.store=false`): only
  the pipeline knows which tickets are finished, and an automatic commit could pass an unfinished one;
- the group uses `cooperative-sticky` assignment unless configured otherwise, so a rebalance revokes only the
  partitions that move and the others keep flowing;
- a new group starts at the earliest offset unless configured otherwise: tickets published before the first
  worker started are still tickets;
- the producer is idempotent with `acks=all`: the client's own retries never duplicate or reorder a record,
  and an acknowledged record survives a broker failure.

The options the pipeline's correctness depends on cannot be overridden: a conflicting value is a UserError.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import confluent_kafka
import structlog

from worker.config import Settings, masked_kafka_config
from worker.errors import UserError

_log = structlog.get_logger("worker.kafka")

# Options whose value the pipeline relies on, with the reason shown when a user sets them otherwise.
_CONSUMER_REQUIRED = {
    "enable.auto.commit": ("false", "the worker commits only finished tickets itself"),
    "enable.auto.offset.store": ("false", "the worker commits only finished tickets itself"),
}
_PRODUCER_REQUIRED = {
    "enable.idempotence": ("true", "retries must not duplicate or reorder results"),
    "acks": ("all", "a result counts as delivered only once every in-sync replica has it"),
}
_CONSUMER_DEFAULTS = {
    "partition.assignment.strategy": "cooperative-sticky",
    "auto.offset.reset": "earliest",
}
_PRODUCER_DEFAULTS = {
    # A few ms of batching costs little latency next to a model call and cuts requests under load.
    "linger.ms": "5",
}
# librdkafka warns when a client gets the other client's options; the shared [kafka] table holds both.
_CONSUMER_ONLY_PREFIXES = (
    "group.",
    "session.timeout.ms",
    "heartbeat.interval.ms",
    "max.poll.interval.ms",
    "partition.assignment.strategy",
    "auto.offset.reset",
    "enable.auto.",
    "auto.commit.",
    "fetch.",
    "queued.",
    "isolation.level",
    "check.crcs",
    "enable.partition.eof",
    "consume.",
    "coordinator.query.interval.ms",
)
_PRODUCER_ONLY_PREFIXES = (
    "acks",
    "request.required.acks",
    "enable.idempotence",
    "linger.ms",
    "queue.buffering.",
    "batch.",
    "delivery.timeout.ms",
    "message.timeout.ms",
    "compression.",
    "retries",
    "message.send.max.retries",
    "transactional.id",
    "transaction.timeout.ms",
    "enable.gapless.guarantee",
    "sticky.partitioning.linger.ms",
    "partitioner",
    "request.timeout.ms",
)

ErrorCallback = Callable[[confluent_kafka.KafkaError], None]


def _check_required(kafka: Mapping[str, str], required: Mapping[str, tuple[str, str]]) -> None:
    for option, (value, reason) in required.items():
        given = kafka.get(option)
        if given is not None and given.strip().lower() != value:
            shown = masked_kafka_config({option: given})[option]
            raise UserError(f"config error: kafka.{option} must be {value} ({reason}), got {shown}")


def _without(kafka: Mapping[str, str], prefixes: tuple[str, ...]) -> dict[str, str]:
    return {key: value for key, value in kafka.items() if not key.startswith(prefixes)}


def consumer_config(settings: Settings) -> dict[str, str]:
    """librdkafka options for the pipeline's consumer (strings only, as the user would write them)."""
    _check_required(settings.kafka, _CONSUMER_REQUIRED)
    config = {**_CONSUMER_DEFAULTS, **_without(settings.kafka, _PRODUCER_ONLY_PREFIXES)}
    config.update({option: value for option, (value, _) in _CONSUMER_REQUIRED.items()})
    config["group.id"] = settings.pipeline.group_id
    return config


def producer_config(settings: Settings) -> dict[str, str]:
    """librdkafka options for the pipeline's producer (results and dead letters)."""
    _check_required(settings.kafka, _PRODUCER_REQUIRED)
    config = {**_PRODUCER_DEFAULTS, **_without(settings.kafka, _CONSUMER_ONLY_PREFIXES)}
    config.update({option: value for option, (value, _) in _PRODUCER_REQUIRED.items()})
    return config


class ClientErrorLog:
    """error_cb that logs each kind of client error at most once per `interval_s`, counting the rest.

    Broker-down and similar errors are retried by the client itself; during an outage librdkafka reports
    them every few milliseconds, which would bury everything else in the log.
    """

    def __init__(self, client: str, interval_s: float = 10.0) -> None:
        self._client = client
        self._interval_s = interval_s
        self._last: dict[int, tuple[float, int]] = {}

    def __call__(self, error: confluent_kafka.KafkaError) -> None:
        now = time.monotonic()
        logged_at, suppressed = self._last.get(error.code(), (-self._interval_s, 0))
        if now - logged_at < self._interval_s and not error.fatal():
            self._last[error.code()] = (logged_at, suppressed + 1)
            return
        self._last[error.code()] = (now, 0)
        _log.warning(
            "kafka_client_error",
            client=self._client,
            code=error.name(),
            reason=error.str(),
            fatal=error.fatal(),
            suppressed_since_last=suppressed,
        )


def create_consumer(
    settings: Settings,
    on_error: ErrorCallback | None = None,
    logger: logging.Logger | None = None,
) -> confluent_kafka.Consumer:
    """A consumer in the pipeline's group; subscribe it with the rebalance callbacks of the caller.

    `logger` receives librdkafka's own log lines (default: librdkafka prints them to stderr).
    """
    config: dict[str, Any] = consumer_config(settings)
    config["error_cb"] = on_error or ClientErrorLog("consumer")
    if logger is not None:
        config["logger"] = logger
    return confluent_kafka.Consumer(config)


def create_producer(
    settings: Settings,
    on_error: ErrorCallback | None = None,
    logger: logging.Logger | None = None,
) -> confluent_kafka.Producer:
    """An idempotent, acks=all producer for results and dead letters."""
    config: dict[str, Any] = producer_config(settings)
    config["error_cb"] = on_error or ClientErrorLog("producer")
    if logger is not None:
        config["logger"] = logger
    return confluent_kafka.Producer(config)


class ClientFactory(Protocol):
    """Builds the pipeline's consumer and producer, each reporting its errors to `on_error`."""

    def consumer(self, on_error: ErrorCallback) -> confluent_kafka.Consumer: ...

    def producer(self, on_error: ErrorCallback) -> confluent_kafka.Producer: ...


@dataclass(frozen=True)
class KafkaClients:
    """The pipeline's clients from settings (`create_consumer`, `create_producer`)."""

    settings: Settings
    logger: logging.Logger | None = None

    def consumer(self, on_error: ErrorCallback) -> confluent_kafka.Consumer:
        return create_consumer(self.settings, on_error=on_error, logger=self.logger)

    def producer(self, on_error: ErrorCallback) -> confluent_kafka.Producer:
        return create_producer(self.settings, on_error=on_error, logger=self.logger)
