"""Topic administration: check the connection at start, create the worker's topics idempotently, and read
a consumer group's lag from the broker.

Brokers in production usually disable topic auto-creation, and an auto-created topic gets the broker's
default partition count, which caps how many workers can share the load. So the topics are created
explicitly, with the partitions and replication factor from the settings.
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from confluent_kafka import (
    ConsumerGroupTopicPartitions,
    IsolationLevel,
    KafkaError,
    KafkaException,
    TopicPartition,
)
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._config import ConfigResource  # re-exported untyped by confluent_kafka.admin
from confluent_kafka.admin._listoffsets import OffsetSpec  # re-exported untyped by confluent_kafka.admin
from confluent_kafka.admin._resource import ResourceType  # re-exported untyped by confluent_kafka.admin
from confluent_kafka.cimpl import NewTopic  # re-exported untyped by confluent_kafka.admin

from worker.errors import UserError
from worker.settings import TopicSettings, mask_secrets

TopicOutcome = Literal["created", "exists"]
# Told what the command waits for once the cluster has not answered for this long, so a wrong address is
# never a silent wait of the whole timeout.
WAIT_NOTICE_AFTER_S = 0.5
Notice = Callable[[str], None]

# An admin client is a producer to librdkafka, and a producer's metadata request for a missing topic asks
# the broker to create it (allow.auto.create.topics defaults to true there): looking must never create.
METADATA_ONLY = {"allow.auto.create.topics": "false"}


def print_notice(line: str) -> None:
    """The default for start-up checks of commands: stderr, so that stdout stays the command's output."""
    print(line, file=sys.stderr, flush=True)


class _LastClientError(logging.Handler):
    """Keeps librdkafka's last complaint, for the error message when no error callback explained more (SASL
    options without a SASL security.protocol only ever show up here).

    Without a logger librdkafka prints every reconnect attempt to stderr; the one line that matters is
    reported in the UserError instead.
    """

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.message: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        # "CONFWARN [rdkafka#producer-1] [thrd:app]: Configuration ..." → "Configuration ..."
        self.message = _strip(re.sub(r"^\w+ \[[^]]*\] \[[^]]*\]: ", "", record.getMessage()))


def _strip(text: str) -> str:
    """librdkafka's text without the broker prefix and timing suffix it adds ("sasl_ssl://h:p/bootstrap: ...
    (after 301ms in state AUTH_REQ)"): the line names the address itself."""
    text = re.sub(r"^\S+://\S+: |^\S+/bootstrap: ", "", text)
    return re.sub(r" \(after \d+ms in state \w+\)$", "", text)


def _refusal(kafka_config: Mapping[str, str], error: KafkaError) -> str | None:
    """The line for an error no retry can cure (wrong credentials, an untrusted certificate), else None."""
    bootstrap = kafka_config.get("bootstrap.servers", "?")
    reason = _strip(error.str())
    if error.code() == KafkaError._AUTHENTICATION:
        user = kafka_config.get("sasl.username", "?")
        mechanism = kafka_config.get("sasl.mechanisms", kafka_config.get("sasl.mechanism", "GSSAPI"))
        return f"authentication failed for user {user!r} (SASL/{mechanism}) at {bootstrap}: {reason}"
    if error.code() == KafkaError._SSL or "certificate verify failed" in error.str():
        trusted = kafka_config.get("ssl.ca.location", "the system's CA certificates")
        return f"TLS handshake with {bootstrap} failed (trusting {trusted}): {reason}"
    return None


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    replication_factor: int


def worker_topics(topics: TopicSettings, shadow: bool = False, review: bool = False) -> list[TopicSpec]:
    """The input, output and dead-letter topics (with `shadow`, the shadow's side topic; with `review`, the
    review side topic and the feedback topic), all with the configured layout."""
    names = (
        topics.input,
        topics.output,
        topics.dead_letter,
        *((topics.shadow,) if shadow else ()),
        *((topics.review, topics.feedback) if review else ()),
    )
    return [TopicSpec(name, topics.partitions, topics.replication_factor) for name in dict.fromkeys(names)]


def create_topics(
    kafka_config: Mapping[str, str],
    specs: Iterable[TopicSpec],
    timeout_s: float = 30.0,
    on_wait: Notice = print_notice,
) -> dict[str, TopicOutcome]:
    """Create each topic unless it exists; returns what happened to each, in order.

    An existing topic is left as it is (its partition count is not changed): growing partitions reshuffles
    keys across partitions, which is an operator's decision, not a side effect of a setup command.
    """
    specs = list(specs)
    if not specs:
        return {}
    bootstrap = kafka_config.get("bootstrap.servers", "?")
    with _reachable_admin(kafka_config, min(timeout_s, 10.0), on_wait) as (admin, _):
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


def existing_topics(
    kafka_config: Mapping[str, str], timeout_s: float = 15.0, on_wait: Notice = print_notice
) -> set[str]:
    """The cluster's topic names; UserError with librdkafka's reason when the cluster cannot be reached."""
    with _reachable_admin(kafka_config, timeout_s, on_wait) as (_, metadata):
        return set(metadata.topics)


def record_size_limits(
    kafka_config: Mapping[str, str], topics: Iterable[str], timeout_s: float = 10.0
) -> dict[str, int]:
    """Each topic's `max.message.bytes` (the largest record batch its broker accepts), where the broker
    answers: describing configs needs the DescribeConfigs permission, which a worker may not have, so the
    topics it could not learn are left out rather than failing the caller (so are those whose broker gave no
    answer in `timeout_s`: a cluster node down while a worker starts)."""
    admin = AdminClient({**kafka_config, **METADATA_ONLY})
    resources = [ConfigResource(ResourceType.TOPIC, topic) for topic in dict.fromkeys(topics)]
    limits: dict[str, int] = {}
    for resource, future in admin.describe_configs(resources, request_timeout=timeout_s).items():
        with contextlib.suppress(KafkaException, ValueError, TimeoutError):
            entry = future.result(timeout_s).get("max.message.bytes")
            if entry is not None and entry.value is not None:
                limits[resource.name] = int(entry.value)
    return limits


def check_cluster(
    kafka_config: Mapping[str, str], timeout_s: float = 15.0, on_wait: Notice = print_notice
) -> None:
    """A command's start-up check: returns once `kafka_config` reaches the cluster, else one-line UserError
    (unreachable, login refused, certificate not trusted), at once when no retry can help."""
    with _reachable_admin(kafka_config, timeout_s, on_wait):
        pass


@contextlib.contextmanager
def _reachable_admin(
    kafka_config: Mapping[str, str], timeout_s: float, on_wait: Notice
) -> Iterator[tuple[AdminClient, Any]]:
    """An admin client that has reached the cluster (and its metadata), or UserError saying why not.

    librdkafka retries a refused login or an untrusted certificate forever, reporting it only to the error
    callback, so the metadata is requested in short slices and the callback's errors are checked between.
    After `WAIT_NOTICE_AFTER_S` without an answer, `on_wait` is told once what is awaited and for how long.
    """
    bootstrap = kafka_config.get("bootstrap.servers", "?")
    errors: list[KafkaError] = []
    last_error = _LastClientError()
    client_log = logging.getLogger("worker.kafka.admin.librdkafka")
    client_log.propagate = False
    client_log.addHandler(last_error)
    try:
        # The stubs omit `logger`.
        options: dict[str, Any] = {
            "logger": client_log,
            **kafka_config,
            **METADATA_ONLY,
            "error_cb": errors.append,
        }
        try:
            admin = AdminClient(options)
        except KafkaException as exception:  # an option librdkafka rejects (unknown name, bad value)
            problem = f"Kafka client configuration: {exception.args[0].str()}"
            raise UserError(mask_secrets(problem, kafka_config)) from None
        deadline = time.monotonic() + timeout_s
        noticed = False
        while True:
            slice_s = 1.0 if noticed else WAIT_NOTICE_AFTER_S
            try:
                metadata = admin.list_topics(timeout=min(slice_s, max(0.1, deadline - time.monotonic())))
                break
            except KafkaException:
                admin.poll(0)  # serves the error callback and the queued client logs
            if not noticed:
                noticed = True
                on_wait(f"waiting for Kafka at {bootstrap} (gives up after {timeout_s:.0f} s) ...")
            for error in errors:
                refusal = _refusal(kafka_config, error)
                if refusal is not None:
                    raise UserError(mask_secrets(refusal, kafka_config))
            if time.monotonic() >= deadline:
                reasons = [_strip(e.str()) for e in errors if e.code() != KafkaError._ALL_BROKERS_DOWN]
                reason = (reasons or [last_error.message or f"no answer in {timeout_s:.0f}s"])[-1]
                raise UserError(mask_secrets(f"cannot reach Kafka at {bootstrap}: {reason}", kafka_config))
        yield admin, metadata
    finally:
        client_log.removeHandler(last_error)


class GroupLagReader:
    """A consumer group's lag on a topic, read from the broker: per partition, the log end offset minus the
    group's committed offset, as KEDA's Kafka scaler computes it (a partition the group never committed
    counts from its earliest offset, `offsetResetPolicy: earliest`). Needs no worker: it is what tells an
    operator the backlog when every worker is down. One admin client, reused for every read."""

    def __init__(
        self,
        kafka_config: Mapping[str, str],
        logger: logging.Logger | None = None,
        on_error: Callable[[KafkaError], None] | None = None,
    ) -> None:
        """`logger` and `on_error` receive the client's lines and errors (default: librdkafka prints them
        to stderr) when `serve` is called."""
        # The stubs omit `logger`.
        options: dict[str, Any] = {**kafka_config, **METADATA_ONLY}
        if logger is not None:
            options["logger"] = logger
        if on_error is not None:
            options["error_cb"] = on_error
        try:
            self._admin = AdminClient(options)
        except KafkaException as exception:
            problem = f"Kafka client configuration: {exception.args[0].str()}"
            raise UserError(mask_secrets(problem, kafka_config)) from None
        self._kafka_config = kafka_config

    def read(self, group: str, topic: str, timeout_s: float = 5.0) -> dict[int, int]:
        """Partition → lag; UserError (one line) when the broker does not answer or the topic is missing."""
        try:
            metadata = self._admin.list_topics(topic=topic, timeout=timeout_s).topics.get(topic)
            if metadata is None or metadata.error is not None or not metadata.partitions:
                raise UserError(f"topic {topic!r} does not exist")
            partitions = [TopicPartition(topic, p) for p in sorted(metadata.partitions)]
            request = [ConsumerGroupTopicPartitions(group, partitions)]
            answer = self._admin.list_consumer_group_offsets(request, request_timeout=timeout_s)[group]
            committed = {tp.partition: tp.offset for tp in answer.result(timeout_s).topic_partitions}
            ends = self._offsets(partitions, OffsetSpec.latest(), timeout_s)  # type: ignore[no-untyped-call]
            uncommitted = [tp for tp in partitions if committed.get(tp.partition, -1) < 0]
            earliest = OffsetSpec.earliest()  # type: ignore[no-untyped-call]
            starts = self._offsets(uncommitted, earliest, timeout_s) if uncommitted else {}
        except KafkaException as exception:
            reason = _strip(exception.args[0].str()) if exception.args else str(exception)
            problem = f"cannot read the lag of group {group!r}: {reason}"
            raise UserError(mask_secrets(problem, self._kafka_config)) from None
        except TimeoutError:
            raise UserError(f"cannot read the lag of group {group!r}: no answer in {timeout_s:g}s") from None
        return {
            partition: max(0, end - (starts[partition] if partition in starts else committed[partition]))
            for partition, end in ends.items()
        }

    def serve(self) -> None:
        """Hand the client's queued lines and errors to `logger` and `on_error`: an admin client keeps them
        until asked, and a broker that is away adds some every few milliseconds."""
        self._admin.poll(0)

    def _offsets(
        self, partitions: list[TopicPartition], spec: OffsetSpec, timeout_s: float
    ) -> dict[int, int]:
        # read_committed: the end a consumer of the group can reach (open transactions excluded).
        futures = self._admin.list_offsets(
            {tp: spec for tp in partitions},
            isolation_level=IsolationLevel.READ_COMMITTED,
            request_timeout=timeout_s,
        )
        return {tp.partition: future.result(timeout_s).offset for tp, future in futures.items()}
