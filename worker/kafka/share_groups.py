"""Queue mode's Kafka side: the share consumer's options, the share group's settings, its producer's timeout.

A share group (KIP-932, Kafka >= 4.2) hands records out one by one under a lock and takes an acknowledgement
per record. Measured with confluent-kafka 2.16.1 against Kafka 4.4.0 (docs/design.md#queue-mode):

- the share consumer refuses the consumer-group options (`session.timeout.ms`, `auto.offset.reset`,
  `enable.auto.commit`, ...) with a ValueError, so `share_consumer_config` builds its options from the
  user's [kafka] table without them; acknowledgements are always explicit (an unknown
  `share.acknowledgement.mode` value silently acts as implicit, so no other value is taken), and a poll
  asks for at most `max_in_flight` records unless `max.poll.records` is set;
- where a new group starts, how long a record's lock lasts and after how many deliveries the broker archives
  a record are *group* configs (`share.auto.offset.reset`, `share.record.lock.duration.ms`,
  `share.delivery.count.limit`), read and set with the AdminClient before the group exists.
  `prepare_share_group` sets the start to earliest unless someone set it (as group mode: tickets published
  before the first worker started are still tickets) and reads the other two (`ShareGroup`);
- where the broker has share groups' own dead-letter topics (KIP-1191, Kafka 4.4: the group config
  `errors.deadletterqueue.topic.name`), `prepare_share_group` gives the group one as the last net, unless
  someone set it: `dlq.<group>` (the broker's `errors.deadletterqueue.topic.name.prefix`, "dlq." by
  default), created with `errors.deadletterqueue.group.enable=true`, and `errors.deadletterqueue.
  copy.record.enable` left false, so that the broker writes a reference to each record it archives
  (`__dlq.errors.topic`/`partition`/`offset`/`group`/`delivery.count`/`message` headers, no key, no value:
  the ticket's personal data stays where it was). The worker itself never releases a record on its last
  delivery; what it could not write at all (the broker away through the lock) is what this net is for.
  It also receives a reference for each record the worker REJECTs after its own dead letter. A broker
  without the config, or one that refuses it (ACLs), leaves the group without a net: said in the start
  line, never fatal;
- the producer's `delivery.timeout.ms` bounds how long a record's output may wait for the broker: in queue
  mode it defaults to a third of the lock (`queue_kafka_options`), so that a ticket's deadline plus its
  delivery fit inside the lock (`worker/pipeline/sources/lock_budget.py` refuses settings where they do not).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import confluent_kafka
import structlog
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._config import (  # re-exported untyped by confluent_kafka.admin
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
)
from confluent_kafka.admin._resource import ResourceType  # re-exported untyped by confluent_kafka.admin
from confluent_kafka.cimpl import NewTopic  # re-exported untyped by confluent_kafka.admin

from worker.errors import UserError
from worker.kafka.clients import (
    ClientErrorLog,
    ErrorCallback,
    ProducerFactory,
    consumer_options,
    create_producer,
    kafka_call,
    producer_config,
)
from worker.settings import PipelineSettings

_log = structlog.get_logger("worker.kafka")
_TOPIC_EXISTS = confluent_kafka.KafkaError.TOPIC_ALREADY_EXISTS

# Kafka's defaults for the group configs (a broker may set others: `group.share.*`).
DEFAULT_LOCK_MS = 30000
DEFAULT_DELIVERY_COUNT_LIMIT = 5
AUTO_OFFSET_RESET = "share.auto.offset.reset"
LOCK_DURATION = "share.record.lock.duration.ms"
DELIVERY_COUNT_LIMIT = "share.delivery.count.limit"
# KIP-1191 (Kafka 4.4): the group's dead-letter topic, whether the broker copies the record into it, the
# broker's prefix for such topics, and the topic config that lets a topic be one.
DEAD_LETTER_TOPIC = "errors.deadletterqueue.topic.name"
DEAD_LETTER_COPY = "errors.deadletterqueue.copy.record.enable"
DEAD_LETTER_PREFIX = "errors.deadletterqueue.topic.name.prefix"
DEAD_LETTER_ENABLE = "errors.deadletterqueue.group.enable"
_DEFAULT_DEAD_LETTER_PREFIX = "dlq."
# Consumer-group options a share consumer refuses at construction (measured), and the producer's.
_REFUSED_BY_SHARE_CONSUMER = (
    "session.timeout.ms",
    "heartbeat.interval.ms",
    "enable.auto.commit",
    "enable.auto.offset.store",
    "auto.commit.",
    "auto.offset.reset",
    "group.protocol",
    "group.instance.id",
    "group.remote.assignor",
    "isolation.level",
    "partition.assignment.strategy",
)
_ACKNOWLEDGEMENT_MODE = "share.acknowledgement.mode"
_MAX_POLL_RECORDS = "max.poll.records"
_DELIVERY_TIMEOUT = "delivery.timeout.ms"
_DELIVERY_TIMEOUT_ALIAS = "message.timeout.ms"
# librdkafka's default delivery.timeout.ms.
_LIBRDKAFKA_DELIVERY_TIMEOUT_MS = 300000

NO_SHARE_GROUPS = (
    "the broker has no share groups (queue mode needs Kafka >= 4.2 with the feature share.version >= 1; "
    "turn it on with `kafka-features.sh upgrade --feature share.version=1`), or use pipeline.consume = group"
)


def share_consumer_config(
    kafka: Mapping[str, str], pipeline: PipelineSettings, max_poll_records: int | None = None
) -> dict[str, str]:
    """librdkafka options for queue mode's share consumer in `pipeline`'s group, from the `[kafka]` options
    `kafka`; `max_poll_records`: what a poll asks for, unless the user set `max.poll.records` (None:
    `max_in_flight`)."""
    given = kafka.get(_ACKNOWLEDGEMENT_MODE, "explicit").strip().lower()
    if given != "explicit":
        raise UserError(
            f"config error: kafka.{_ACKNOWLEDGEMENT_MODE} must be explicit in queue mode (a ticket is "
            f"acknowledged only once its record is written), got {given}"
        )
    options = {
        key: value
        for key, value in consumer_options(kafka).items()
        if not key.startswith(_REFUSED_BY_SHARE_CONSUMER)
    }
    options["group.id"] = pipeline.group_id
    options[_ACKNOWLEDGEMENT_MODE] = "explicit"
    # A batch larger than what the worker can do holds its rest locked and idle while other members could
    # take it (worker/pipeline/sources/share.py sizes it). Only a hint: the broker hands out whole producer
    # batches.
    options.setdefault(_MAX_POLL_RECORDS, str(max_poll_records or pipeline.max_in_flight))
    return options


def create_share_consumer(
    kafka: Mapping[str, str],
    pipeline: PipelineSettings,
    on_error: ErrorCallback | None = None,
    logger: logging.Logger | None = None,
    max_poll_records: int | None = None,
) -> confluent_kafka.ShareConsumer:
    config: dict[str, Any] = share_consumer_config(kafka, pipeline, max_poll_records)
    config["error_cb"] = on_error or ClientErrorLog("consumer")
    if logger is not None:
        config["logger"] = logger
    return confluent_kafka.ShareConsumer(config)


def delivery_timeout_ms(kafka: Mapping[str, str]) -> int:
    """The producer's delivery.timeout.ms as the `[kafka]` options `kafka` set it (librdkafka's default when
    they do not)."""
    given = kafka.get(_DELIVERY_TIMEOUT, kafka.get(_DELIVERY_TIMEOUT_ALIAS))
    return int(given) if given is not None else _LIBRDKAFKA_DELIVERY_TIMEOUT_MS


@dataclass(frozen=True)
class ShareGroup:
    """The share group's configs the worker works by: each record's lock, and the delivery at which a record
    is dead-lettered instead of tried again (the setting, else the group's limit)."""

    lock_ms: int = DEFAULT_LOCK_MS
    delivery_count_limit: int = DEFAULT_DELIVERY_COUNT_LIMIT
    # The broker's own net (KIP-1191): the group's dead-letter topic (None: none), and how it came to be
    # (or why there is none), for the start line.
    dead_letter_topic: str | None = None
    dead_letter: str = "not asked"


def queue_kafka_options(kafka: Mapping[str, str], group: ShareGroup) -> dict[str, str]:
    """The `[kafka]` options `kafka` with the producer's delivery.timeout.ms at a third of the lock, unless
    the user set it: a record's output must be acknowledged (or given up) while the record is still locked."""
    if _DELIVERY_TIMEOUT in kafka or _DELIVERY_TIMEOUT_ALIAS in kafka:
        return dict(kafka)
    return {**kafka, _DELIVERY_TIMEOUT: str(group.lock_ms // 3)}


def prepare_share_group(kafka: Mapping[str, str], pipeline: PipelineSettings) -> ShareGroup:
    """Read the lock and delivery limit of `pipeline`'s share group (the limit capped by
    `pipeline.delivery_count_limit`), and start a group nobody configured at the earliest offset; `kafka`:
    the `[kafka]` options.

    Works before the group exists. A broker without group configs (before Kafka 4.0) is refused later, at
    the first poll: Kafka's defaults stand meanwhile.
    """
    group_id = pipeline.group_id
    admin = AdminClient({**producer_config(kafka)})
    resource = ConfigResource(ResourceType.GROUP, group_id)
    try:
        configs: dict[str, Any] = kafka_call(
            f"describe the configs of share group {group_id}",
            lambda: admin.describe_configs([resource])[resource].result(),
            kafka,
        )
    except UserError:
        configs = {}
    start = configs.get(AUTO_OFFSET_RESET)
    if start is not None and start.is_default:
        entry = ConfigEntry(AUTO_OFFSET_RESET, "earliest", incremental_operation=AlterConfigOpType.SET)
        earliest = ConfigResource(ResourceType.GROUP, group_id, incremental_configs=[entry])
        kafka_call(
            f"set {AUTO_OFFSET_RESET}=earliest on share group {group_id}",
            lambda: admin.incremental_alter_configs([earliest])[earliest].result(),
            kafka,
        )
    lock = configs.get(LOCK_DURATION)
    limit = configs.get(DELIVERY_COUNT_LIMIT)
    group_limit = int(limit.value) if limit is not None else DEFAULT_DELIVERY_COUNT_LIMIT
    configured = pipeline.delivery_count_limit
    dead_letter_topic, dead_letter = broker_net(admin, group_id, configs, kafka)
    return ShareGroup(
        lock_ms=int(lock.value) if lock is not None else DEFAULT_LOCK_MS,
        delivery_count_limit=min(configured, group_limit) if configured is not None else group_limit,
        dead_letter_topic=dead_letter_topic,
        dead_letter=dead_letter,
    )


def broker_net(
    admin: AdminClient, group_id: str, configs: Mapping[str, Any], kafka: Mapping[str, str]
) -> tuple[str | None, str]:
    """The share group's own dead-letter topic (KIP-1191) as the last net, and how it came to be: left as
    someone set it; else `<prefix><group>` created (topic config `errors.deadletterqueue.group.enable`) and
    set on the group, records not copied into it (references only) unless someone asked for copies.
    Never fatal: a broker without the config, or one that refuses a step, leaves the group without one
    (logged, and said in the start line). `configs`: the group's configs as described."""
    entry = configs.get(DEAD_LETTER_TOPIC)
    if entry is None:
        return None, "none: the broker has no share-group dead-letter topics (Kafka >= 4.4, KIP-1191)"
    if entry.value:
        return str(entry.value), "set on the group"
    try:
        topic = _dead_letter_prefix(admin, kafka) + group_id
        _dead_letter_topic_ready(admin, topic, kafka)
        entries = [ConfigEntry(DEAD_LETTER_TOPIC, topic, incremental_operation=AlterConfigOpType.SET)]
        copy = configs.get(DEAD_LETTER_COPY)
        if copy is None or copy.is_default:  # references only: the ticket's personal data stays put
            entries.append(
                ConfigEntry(DEAD_LETTER_COPY, "false", incremental_operation=AlterConfigOpType.SET)
            )
        resource = ConfigResource(ResourceType.GROUP, group_id, incremental_configs=entries)
        kafka_call(
            f"set {DEAD_LETTER_TOPIC}={topic} on share group {group_id}",
            lambda: admin.incremental_alter_configs([resource])[resource].result(),
            kafka,
        )
    except (UserError, confluent_kafka.KafkaException) as problem:
        reason = str(problem).splitlines()[0] if str(problem) else type(problem).__name__
        _log.warning("share_group_dead_letter_topic_not_set", group=group_id, reason=reason)
        return None, f"none: {reason}"
    return topic, "set by the worker"


def _dead_letter_prefix(admin: AdminClient, kafka: Mapping[str, str]) -> str:
    """The broker's prefix for dead-letter topic names ("dlq." by default), as one broker describes it."""
    brokers = kafka_call("list the brokers", lambda: admin.list_topics(timeout=10).brokers, kafka)
    if not brokers:
        return _DEFAULT_DEAD_LETTER_PREFIX
    resource = ConfigResource(ResourceType.BROKER, str(next(iter(brokers))))
    configs: dict[str, Any] = kafka_call(
        "describe a broker's configs", lambda: admin.describe_configs([resource])[resource].result(), kafka
    )
    prefix = configs.get(DEAD_LETTER_PREFIX)
    return (
        str(prefix.value) if prefix is not None and prefix.value is not None else _DEFAULT_DEAD_LETTER_PREFIX
    )


def _dead_letter_topic_ready(admin: AdminClient, topic: str, kafka: Mapping[str, str]) -> None:
    """`topic` exists and may be a group's dead-letter topic: created so (one partition, the cluster's
    replication), or, where it exists, given the topic config that allows it."""
    new = NewTopic(topic, 1, -1, config={DEAD_LETTER_ENABLE: "true"})
    try:
        admin.create_topics([new], request_timeout=10.0)[topic].result()
        return
    except confluent_kafka.KafkaException as problem:
        error = problem.args[0] if problem.args else None
        if not (isinstance(error, confluent_kafka.KafkaError) and error.code() == _TOPIC_EXISTS):
            raise
    entry = ConfigEntry(DEAD_LETTER_ENABLE, "true", incremental_operation=AlterConfigOpType.SET)
    resource = ConfigResource(ResourceType.TOPIC, topic, incremental_configs=[entry])
    kafka_call(
        f"set {DEAD_LETTER_ENABLE}=true on {topic}",
        lambda: admin.incremental_alter_configs([resource])[resource].result(),
        kafka,
    )


class ShareClientFactory(ProducerFactory, Protocol):
    """Builds queue mode's share consumer and producer, each reporting its errors to `on_error`."""

    def share_consumer(
        self, on_error: ErrorCallback, max_poll_records: int
    ) -> confluent_kafka.ShareConsumer: ...


@dataclass(frozen=True)
class ShareClients:
    """Queue mode's clients from the `[kafka]` options (as `queue_kafka_options` fitted them) and the
    pipeline's section: the share consumer, and the producer."""

    kafka: Mapping[str, str]
    pipeline: PipelineSettings
    logger: logging.Logger | None = None

    def share_consumer(self, on_error: ErrorCallback, max_poll_records: int) -> confluent_kafka.ShareConsumer:
        return create_share_consumer(self.kafka, self.pipeline, on_error, self.logger, max_poll_records)

    def producer(self, on_error: ErrorCallback) -> confluent_kafka.Producer:
        return create_producer(self.kafka, on_error=on_error, logger=self.logger)
