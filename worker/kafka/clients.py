"""Consumer and producer factories: the user's librdkafka options plus the few the pipeline relies on.

The `[kafka]` options (`Settings.kafka`) pass through untouched (SASL, SSL, timeouts, ...). On top of it:

- the consumer never commits by itself (`enable.auto.commit=false`, `enable.auto.offset.store=false`): only
  the pipeline knows which tickets are finished, and an automatic commit could pass an unfinished one;
- the group uses the classic protocol (`group.protocol`, pinned here so that a librdkafka whose default
  changes does not change the worker's) with `cooperative-sticky` assignment unless configured otherwise, so
  a rebalance revokes only the partitions that move and the others keep flowing. With
  `group.protocol=consumer` (KIP-848) the broker assigns partitions, always incrementally, and sets the
  session and heartbeat timings: the classic-only options (`CLASSIC_ONLY`) are refused with one line;
- a new group starts at the earliest offset unless configured otherwise: tickets published before the first
  worker started are still tickets;
- the producer is idempotent with `acks=all`: the client's own retries never duplicate or reorder a record,
  and an acknowledged record survives a broker failure;
- with `pipeline.guarantee = "exactly_once"` the producer is transactional (`transactional.id` from
  `pipeline.transactional_id`, `transaction.timeout.ms` 10 s unless configured) and the consumer reads only
  committed records (`isolation.level=read_committed`).

The options the pipeline's correctness depends on cannot be overridden: a conflicting value is a UserError.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

import confluent_kafka
import structlog

from worker.errors import UserError
from worker.kafka import errors
from worker.logs import REPEAT_INTERVAL_S, Throttle
from worker.settings import PipelineSettings, mask_secrets, masked_kafka_config

_log = structlog.get_logger("worker.kafka")
# How long `kafka_call` retries passing errors.
RETRY_FOR_S = 10.0

# Options whose value the pipeline relies on, with the reason shown when a user sets them otherwise.
_CONSUMER_REQUIRED = {
    "enable.auto.commit": ("false", "the worker commits only finished tickets itself"),
    "enable.auto.offset.store": ("false", "the worker commits only finished tickets itself"),
}
_PRODUCER_REQUIRED = {
    "enable.idempotence": ("true", "retries must not duplicate or reorder results"),
    "acks": ("all", "a result counts as delivered only once every in-sync replica has it"),
}
# Set through pipeline.transactional_id, which also decides whether the producer is transactional at all.
_MANAGED = {"transactional.id": 'pipeline.transactional_id (with pipeline.guarantee = "exactly_once")'}
_CONSUMER_DEFAULTS = {
    "group.protocol": "classic",
    "auto.offset.reset": "earliest",
}
CONSUMER_PROTOCOL = "consumer"
# Under the classic protocol only: the client picks the assignor (cooperative: a rebalance moves only the
# partitions that change owner).
_CLASSIC_DEFAULTS = {"partition.assignment.strategy": "cooperative-sticky"}
# What librdkafka refuses under `group.protocol=consumer` (2.16: "... is not supported for
# `group.protocol=consumer`" from the consumer's constructor), with where the setting lives instead.
CLASSIC_ONLY = {
    "partition.assignment.strategy": "the broker assigns partitions; its assignor is group.remote.assignor",
    "session.timeout.ms": "the broker's group.consumer.session.timeout.ms (or the group's) sets it",
    "heartbeat.interval.ms": "the broker's group.consumer.heartbeat.interval.ms (or the group's) sets it",
    "group.protocol.type": "it names the classic protocol's group type",
}
_PRODUCER_DEFAULTS = {
    # A few ms of batching costs little latency next to a model call and cuts requests under load.
    "linger.ms": "5",
}
_TRANSACTIONAL_DEFAULTS = {
    # After a crash under a new transactional id (a new pod name), the dead instance's open transaction holds
    # back read_committed readers and the group's offsets until the broker aborts it at this timeout; the
    # worker's own transactions last about a commit interval. Kafka Streams uses the same 10 s.
    "transaction.timeout.ms": "10000",
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
    # The largest record the producer sends (and its batches): `producer_record_limit` may lower it to
    # what the written topics accept; a consumer's fetches are bounded by their own options.
    "message.max.bytes",
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


def _check_managed(kafka: Mapping[str, str]) -> None:
    for option, instead in _MANAGED.items():
        if option in kafka:
            raise UserError(f"config error: kafka.{option} is not set directly; use {instead}")


def exactly_once(pipeline: PipelineSettings) -> bool:
    """Whether `pipeline.guarantee` writes outputs and input offsets in Kafka transactions."""
    return pipeline.guarantee == "exactly_once"


def transaction_timeout_ms(kafka: Mapping[str, str]) -> int:
    """The transactional producer's transaction.timeout.ms: the `[kafka]` option, else the worker's 10 s."""
    return int(kafka.get("transaction.timeout.ms", _TRANSACTIONAL_DEFAULTS["transaction.timeout.ms"]))


def group_protocol(kafka: Mapping[str, str]) -> str:
    """The consumer-group protocol `kafka` options choose: "classic" or "consumer" (KIP-848)."""
    return kafka.get("group.protocol", _CONSUMER_DEFAULTS["group.protocol"]).strip().lower()


def incremental_assignment(consumer_options: Mapping[str, str]) -> bool:
    """Whether rebalances hand partitions over one by one (`incremental_assign`), as a consumer with
    `consumer_options` must: always under the consumer protocol, with a cooperative assignor under the
    classic one (else a rebalance takes every partition back and hands out a whole new assignment)."""
    if group_protocol(consumer_options) == CONSUMER_PROTOCOL:
        return True
    return "cooperative" in consumer_options.get("partition.assignment.strategy", "")


def _check_group_protocol(kafka: Mapping[str, str]) -> None:
    if group_protocol(kafka) != CONSUMER_PROTOCOL:
        return
    for option, instead in CLASSIC_ONLY.items():
        if option in kafka:
            raise UserError(
                f"config error: kafka.{option} cannot be set with kafka.group.protocol = consumer ({instead})"
            )


def consumer_config(kafka: Mapping[str, str], pipeline: PipelineSettings) -> dict[str, str]:
    """librdkafka options for the pipeline's consumer (strings only, as the user would write them): the
    `[kafka]` options, the ones the pipeline relies on, and `pipeline`'s group and guarantee."""
    _check_required(kafka, _CONSUMER_REQUIRED)
    _check_group_protocol(kafka)
    if exactly_once(pipeline):
        # Input written in transactions that were later aborted is not input.
        _check_required(
            kafka, {"isolation.level": ("read_committed", "exactly_once reads committed input only")}
        )
    protocol_defaults = _CLASSIC_DEFAULTS if group_protocol(kafka) != CONSUMER_PROTOCOL else {}
    config = {**_CONSUMER_DEFAULTS, **protocol_defaults, **_without(kafka, _PRODUCER_ONLY_PREFIXES)}
    config.update({option: value for option, (value, _) in _CONSUMER_REQUIRED.items()})
    if exactly_once(pipeline):
        config["isolation.level"] = "read_committed"
    config["group.id"] = pipeline.group_id
    return config


def consumer_options(kafka: Mapping[str, str]) -> dict[str, str]:
    """The user's [kafka] options a consumer takes: all but the producer's (a share consumer's start)."""
    return _without(kafka, _PRODUCER_ONLY_PREFIXES)


def producer_config(kafka: Mapping[str, str]) -> dict[str, str]:
    """librdkafka options for the pipeline's producer (results and dead letters) from the `[kafka]` options;
    never transactional."""
    _check_required(kafka, _PRODUCER_REQUIRED)
    _check_managed(kafka)
    config = {**_PRODUCER_DEFAULTS, **_without(kafka, _CONSUMER_ONLY_PREFIXES)}
    config.update({option: value for option, (value, _) in _PRODUCER_REQUIRED.items()})
    return config


# librdkafka's default message.max.bytes, and the least it takes.
_LIBRDKAFKA_MESSAGE_MAX_BYTES = 1_000_000
_LIBRDKAFKA_MESSAGE_MAX_BYTES_MIN = 1000


def producer_record_limit(kafka: Mapping[str, str], topic_limits: Mapping[str, int]) -> dict[str, str]:
    """The `[kafka]` options `kafka` with the producer's `message.max.bytes` lowered to the smallest
    `max.message.bytes` of the topics it writes (`topic_limits`), when that is smaller. librdkafka caps each
    record and each batch at it, so a record no topic would take is refused before it is queued (its ticket
    is dead-lettered, see worker/pipeline/settlements/delivery.py), and a batch never exceeds a topic's
    limit: the broker refuses a whole batch for one record over it, with the other tickets in that batch."""
    configured = int(kafka.get("message.max.bytes", _LIBRDKAFKA_MESSAGE_MAX_BYTES))
    smallest = max(min(topic_limits.values(), default=configured), _LIBRDKAFKA_MESSAGE_MAX_BYTES_MIN)
    if smallest >= configured:
        return dict(kafka)
    _log.info(
        "producer_record_limit",
        message_max_bytes=smallest,
        reason=f"the smallest max.message.bytes of {sorted(topic_limits)} is below {configured}",
    )
    return {**kafka, "message.max.bytes": str(smallest)}


def transactional_id(pipeline: PipelineSettings) -> str:
    """The worker's transactional id: `pipeline.transactional_id`, by default "<group>-<host name>" (a pod's
    name on Kubernetes)."""
    return pipeline.transactional_id_or_default(socket.gethostname())


def transactional_producer_config(kafka: Mapping[str, str], transactional: str) -> dict[str, str]:
    """`producer_config` plus a `transactional.id`: every produce must then be inside a transaction."""
    return {**_TRANSACTIONAL_DEFAULTS, **producer_config(kafka), "transactional.id": transactional}


class ClientErrorLog:
    """error_cb that logs each kind of client error at most once per `interval_s`, counting the rest.

    Broker-down and similar errors are retried by the client itself; during an outage librdkafka reports
    them every few milliseconds, which would bury everything else in the log. Fatal errors always show.
    """

    def __init__(self, client: str, interval_s: float = REPEAT_INTERVAL_S) -> None:
        self._client = client
        self._throttle = Throttle(interval_s)

    def __call__(self, error: confluent_kafka.KafkaError) -> None:
        suppressed = self._throttle.admit(error.code(), force=error.fatal())
        if suppressed is None:
            return
        _log.warning(
            "kafka_client_error",
            client=self._client,
            code=error.name(),
            reason=error.str(),
            fatal=error.fatal(),
            suppressed_since_last=suppressed,
        )


def create_consumer(
    kafka: Mapping[str, str],
    pipeline: PipelineSettings,
    on_error: ErrorCallback | None = None,
    logger: logging.Logger | None = None,
    overrides: Mapping[str, str] | None = None,
) -> confluent_kafka.Consumer:
    """A consumer in `pipeline`'s group with the `[kafka]` options `kafka` (`consumer_config`); subscribe it
    with the rebalance callbacks of the caller.

    `logger` receives librdkafka's own log lines (default: librdkafka prints them to stderr). `overrides`
    adapts it to another use (a replay's own group, a viewer) without touching the options every client
    shares (SASL, TLS, timeouts) or the ones the pipeline relies on.
    """
    forbidden = sorted(set(overrides or ()) & set(_CONSUMER_REQUIRED))
    if forbidden:
        raise ValueError(f"create_consumer cannot override {', '.join(forbidden)}")
    config: dict[str, Any] = {**consumer_config(kafka, pipeline), **(overrides or {})}
    config["error_cb"] = on_error or ClientErrorLog("consumer")
    if logger is not None:
        config["logger"] = logger
    return confluent_kafka.Consumer(config)


def create_producer(
    kafka: Mapping[str, str],
    on_error: ErrorCallback | None = None,
    logger: logging.Logger | None = None,
    transactional: str | None = None,
) -> confluent_kafka.Producer:
    """An idempotent, acks=all producer for results and dead letters with the `[kafka]` options `kafka`;
    transactional under the id `transactional` when given (the caller runs `init_transactions`)."""
    config: dict[str, Any] = (
        producer_config(kafka)
        if transactional is None
        else transactional_producer_config(kafka, transactional)
    )
    config["error_cb"] = on_error or ClientErrorLog("producer")
    if logger is not None:
        config["logger"] = logger
    return confluent_kafka.Producer(config)


DeliveryCallback = Callable[[confluent_kafka.KafkaError | None, confluent_kafka.Message], None]


def produce(
    producer: confluent_kafka.Producer,
    topic: str,
    value: bytes | None,
    key: bytes | None = None,
    headers: Sequence[tuple[str, bytes | None]] | None = None,
    on_delivery: DeliveryCallback | None = None,
    give_up_at: float | None = None,
    wait_s: float = 0.01,
) -> None:
    """`producer.produce`, waiting while the client's local queue is full (BufferError: the broker is slow or
    away) and serving delivery reports meanwhile. Raises BufferError when the queue is still full at
    `give_up_at` (a `time.monotonic()` instant; None waits as long as it takes), and KafkaException for a
    record the client refuses outright (e.g. over `message.max.bytes`)."""
    # The client takes str/bytes/None header values; ours are bytes/None (and list is invariant).
    record_headers = cast(
        "list[tuple[str, str | bytes | None]] | None", None if headers is None else list(headers)
    )
    while True:
        try:
            producer.produce(topic, value=value, key=key, headers=record_headers, on_delivery=on_delivery)
            return
        except BufferError:
            if give_up_at is not None and time.monotonic() >= give_up_at:
                raise
            producer.poll(wait_s)


def record_headers(message: confluent_kafka.Message) -> list[tuple[str, bytes | None]] | None:
    """A consumed record's headers as a list (a consumer gives bytes values; None for a null header)."""
    raw = message.headers()
    if raw is None:
        return None
    pairs = raw.items() if isinstance(raw, dict) else raw
    return [(name, value.encode("utf-8") if isinstance(value, str) else value) for name, value in pairs]


def partitions_of(keys: Sequence[tuple[str, int]]) -> list[confluent_kafka.TopicPartition]:
    """Partitions to pause or resume (the offset is not used)."""
    return [confluent_kafka.TopicPartition(t, p, confluent_kafka.OFFSET_INVALID) for t, p in keys]


def kafka_call(what: str, call: Callable[[], Any], kafka_config: Mapping[str, str] | None = None) -> Any:
    """Run a client call, retrying passing errors for a while; a Kafka error becomes one line, with any
    secret config value blanked out of it."""
    deadline = time.monotonic() + RETRY_FOR_S
    while True:
        try:
            return call()
        except confluent_kafka.KafkaException as error:
            kafka_error = errors.kafka_error(error)
            if errors.passing(error) and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            text = kafka_error.str() if kafka_error is not None else str(error)
            raise UserError(f"Kafka: cannot {what}: {mask_secrets(text, kafka_config or {})}") from None


class ProducerFactory(Protocol):
    """Builds a producer reporting its errors to `on_error`: all a delivery guarantee needs (it makes a new
    one when a fatal error ends the old), so that a replay, which reads on its own, gives only this."""

    def producer(self, on_error: ErrorCallback) -> confluent_kafka.Producer: ...


class ClientFactory(ProducerFactory, Protocol):
    """Builds the pipeline's consumer and producer, each reporting its errors to `on_error`."""

    def consumer(self, on_error: ErrorCallback) -> confluent_kafka.Consumer: ...


@dataclass(frozen=True)
class KafkaClients:
    """The pipeline's clients from the `[kafka]` options and the pipeline's section (`create_consumer`,
    `create_producer`)."""

    kafka: Mapping[str, str]
    pipeline: PipelineSettings
    logger: logging.Logger | None = None

    def consumer(self, on_error: ErrorCallback) -> confluent_kafka.Consumer:
        return create_consumer(self.kafka, self.pipeline, on_error=on_error, logger=self.logger)

    def producer(self, on_error: ErrorCallback) -> confluent_kafka.Producer:
        """Transactional in exactly_once mode (see `transactional_id`)."""
        transactional = transactional_id(self.pipeline) if exactly_once(self.pipeline) else None
        return create_producer(self.kafka, on_error=on_error, logger=self.logger, transactional=transactional)
