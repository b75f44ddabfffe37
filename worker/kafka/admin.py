"""Topic administration: create the worker's topics, idempotently.

Brokers in production usually disable topic auto-creation, and an auto-created topic gets the broker's
default partition count, which caps how many workers can share the load. So the topics are created
explicitly, with the partitions and replication factor from the settings.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic  # re-exported untyped by confluent_kafka.admin

from worker.config import TopicSettings
from worker.errors import UserError

TopicOutcome = Literal["created", "exists"]


class _LastClientError(logging.Handler):
    """Keeps librdkafka's last complaint (e.g. "Connection refused") for the error message.

    Without a logger librdkafka prints every reconnect attempt to stderr; the one line that matters is
    reported in the UserError instead.
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.message: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        self.message = record.getMessage()


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    replication_factor: int


def worker_topics(topics: TopicSettings) -> list[TopicSpec]:
    """The input, output and dead-letter topics, all with the configured layout."""
    return [
        TopicSpec(name, topics.partitions, topics.replication_factor)
        for name in dict.fromkeys((topics.input, topics.output, topics.dead_letter))
    ]


def create_topics(
    kafka_config: Mapping[str, str], specs: Iterable[TopicSpec], timeout_s: float = 30.0
) -> dict[str, TopicOutcome]:
    """Create each topic unless it exists; returns what happened to each, in order.

    An existing topic is left as it is (its partition count is not changed): growing partitions reshuffles
    keys across partitions, which is an operator's decision, not a side effect of a setup command.
    """
    specs = list(specs)
    if not specs:
        return {}
    bootstrap = kafka_config.get("bootstrap.servers", "?")
    with _reachable_admin(kafka_config, min(timeout_s, 10.0)) as (admin, _):
        futures = admin.create_topics(
            [
                NewTopic(s.name, num_partitions=s.partitions, replication_factor=s.replication_factor)
                for s in specs
            ],
            request_timeout=timeout_s,
            operation_timeout=timeout_s,
        )
        outcomes: dict[str, TopicOutcome] = {}
        for spec in specs:
            try:
                futures[spec.name].result(timeout=timeout_s + 5)
                outcomes[spec.name] = "created"
            except KafkaException as exception:
                error = exception.args[0] if exception.args else None
                if isinstance(error, KafkaError) and error.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    outcomes[spec.name] = "exists"
                    continue
                raise UserError(f"cannot create topic {spec.name!r} on {bootstrap}: {exception}") from None
            except TimeoutError:
                waited = f"{timeout_s:.0f}s"
                raise UserError(
                    f"cannot create topic {spec.name!r}: {bootstrap} gave no answer in {waited}"
                ) from None
        return outcomes


def existing_topics(kafka_config: Mapping[str, str], timeout_s: float = 15.0) -> set[str]:
    """The cluster's topic names; UserError with librdkafka's reason when the cluster cannot be reached."""
    with _reachable_admin(kafka_config, timeout_s) as (_, metadata):
        return set(metadata.topics)


@contextlib.contextmanager
def _reachable_admin(kafka_config: Mapping[str, str], timeout_s: float) -> Iterator[tuple[AdminClient, Any]]:
    """An admin client that has reached the cluster (and its metadata), or UserError saying why not."""
    bootstrap = kafka_config.get("bootstrap.servers", "?")
    last_error = _LastClientError()
    client_log = logging.getLogger("worker.kafka.admin.librdkafka")
    client_log.propagate = False
    client_log.addHandler(last_error)
    try:
        options: dict[str, Any] = {"logger": client_log, **kafka_config}  # the stubs omit `logger`
        admin = AdminClient(options)
        try:
            metadata = admin.list_topics(timeout=timeout_s)
        except KafkaException as exception:
            admin.poll(0)  # serves the queued client logs to `last_error`
            reason = last_error.message or str(exception)
            raise UserError(f"cannot reach Kafka at {bootstrap}: {reason}") from None
        yield admin, metadata
    finally:
        client_log.removeHandler(last_error)
