"""The consumer-group protocol (`kafka.group.protocol`, KIP-848) without a broker: which consumer options each
protocol gets, the options the new protocol refuses (one line each, checked against the installed
librdkafka), and how group commits meet the new protocol's errors."""

from __future__ import annotations

import types
from typing import Any

import confluent_kafka
import pytest

from tools.harness import FAST_GROUP_OPTIONS, fast_group_options
from worker.errors import UserError
from worker.kafka import errors
from worker.kafka.clients import (
    CLASSIC_ONLY,
    consumer_config,
    incremental_assignment,
    producer_config,
)
from worker.kafka.commits import consumer_commit
from worker.pipeline.failure import Failure
from worker.settings import load_settings

KafkaError = confluent_kafka.KafkaError
TOPIC = "tickets.raw"
# A value librdkafka takes for each classic-only option, to show it refuses them under the new protocol.
CLASSIC_VALUES = {
    "partition.assignment.strategy": "cooperative-sticky",
    "session.timeout.ms": "6000",
    "heartbeat.interval.ms": "1000",
    "group.protocol.type": "consumer",
}


def test_the_classic_protocol_is_the_default_with_cooperative_sticky_assignment() -> None:
    settings = load_settings(env={})
    config = consumer_config(settings.kafka, settings.pipeline)
    assert config["group.protocol"] == "classic"  # pinned: a librdkafka whose default moves does not move it
    assert config["partition.assignment.strategy"] == "cooperative-sticky"
    assert incremental_assignment(config)


def test_an_eager_assignor_under_the_classic_protocol_is_not_incremental() -> None:
    settings = load_settings(env={"KAFKA_PARTITION_ASSIGNMENT_STRATEGY": "range"})
    config = consumer_config(settings.kafka, settings.pipeline)
    assert not incremental_assignment(config)


def test_the_consumer_protocol_sends_no_assignor_and_assigns_incrementally() -> None:
    settings = load_settings(
        env={"KAFKA_GROUP_PROTOCOL": "consumer", "KAFKA_GROUP_REMOTE_ASSIGNOR": "uniform"}
    )
    config = consumer_config(settings.kafka, settings.pipeline)
    assert config["group.protocol"] == "consumer"
    assert config["group.remote.assignor"] == "uniform"
    assert not set(config) & set(CLASSIC_ONLY)
    assert incremental_assignment(config)
    assert "group.protocol" not in producer_config(settings.kafka)  # a consumer option stays with it
    # librdkafka takes the whole set (it refuses a consumer given any CLASSIC_ONLY option).
    confluent_kafka.Consumer(config).close()


@pytest.mark.parametrize("option", sorted(CLASSIC_ONLY))
def test_an_option_the_consumer_protocol_refuses_is_one_line_naming_it(option: str) -> None:
    variable = "KAFKA_" + option.upper().replace(".", "_")
    settings = load_settings(env={"KAFKA_GROUP_PROTOCOL": "consumer", variable: CLASSIC_VALUES[option]})
    with pytest.raises(UserError) as refused:
        consumer_config(settings.kafka, settings.pipeline)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        f"config error: kafka.{option} cannot be set with kafka.group.protocol = consumer"
    )
    # The same option under the classic protocol is the user's to choose.
    classic = load_settings(env={variable: CLASSIC_VALUES[option]})
    assert consumer_config(classic.kafka, classic.pipeline)[option]


@pytest.mark.parametrize("option", sorted(CLASSIC_ONLY))
def test_librdkafka_refuses_each_classic_only_option_under_the_consumer_protocol(option: str) -> None:
    """Keeps CLASSIC_ONLY true to the installed librdkafka: each one fails the consumer's constructor."""
    with pytest.raises(confluent_kafka.KafkaException, match=r"not supported for `group\.protocol=consumer`"):
        confluent_kafka.Consumer(
            {"group.id": "g", "group.protocol": "consumer", option: CLASSIC_VALUES[option]}
        )


def test_the_test_harness_leaves_the_classic_timings_out_under_the_consumer_protocol() -> None:
    assert fast_group_options({}) == FAST_GROUP_OPTIONS
    assert fast_group_options({"kafka.group.protocol": "consumer"}) == {"kafka.max.poll.interval.ms": "10000"}


# -- commits -----------------------------------------------------------------------------------------------


class ScriptedConsumer:
    """A consumer whose commits answer from a script: a KafkaError raised, or per-partition errors."""

    def __init__(self, *answers: KafkaError | dict[int, KafkaError | None]) -> None:
        self._answers = list(answers)
        self.calls: list[list[int]] = []

    def commit(self, offsets: list[Any], asynchronous: bool = True) -> list[Any]:
        assert not asynchronous
        self.calls.append([tp.partition for tp in offsets])
        answer = self._answers.pop(0)
        if isinstance(answer, KafkaError):
            raise confluent_kafka.KafkaException(answer)
        # The client's TopicPartition has a read-only `error`: an answer with the same fields.
        return [
            types.SimpleNamespace(
                topic=tp.topic, partition=tp.partition, offset=tp.offset, error=answer.get(tp.partition)
            )
            for tp in offsets
        ]


def _commit(consumer: ScriptedConsumer, retry_for_s: float = 5.0) -> Any:
    call = consumer_commit(consumer, retry_for_s=retry_for_s, sleep=lambda _s: None)  # type: ignore[arg-type]
    return call({(TOPIC, 0): 10, (TOPIC, 1): 20})


def test_a_stale_member_epoch_is_committed_again() -> None:
    consumer = ScriptedConsumer(KafkaError(KafkaError.STALE_MEMBER_EPOCH), {})
    outcome = _commit(consumer)
    assert outcome.confirmed == {(TOPIC, 0): 10, (TOPIC, 1): 20}
    assert outcome.failed == {}
    assert len(consumer.calls) == 2


def test_only_the_partitions_refused_with_a_passing_error_are_sent_again() -> None:
    consumer = ScriptedConsumer({1: KafkaError(KafkaError.STALE_MEMBER_EPOCH)}, {})
    outcome = _commit(consumer)
    assert outcome.confirmed == {(TOPIC, 0): 10, (TOPIC, 1): 20}
    assert consumer.calls == [[0, 1], [1]]


@pytest.mark.parametrize(
    "code", [KafkaError.UNKNOWN_MEMBER_ID, KafkaError.FENCED_MEMBER_EPOCH, KafkaError.ILLEGAL_GENERATION]
)
def test_a_member_the_group_left_behind_is_not_committed_again(code: int) -> None:
    consumer = ScriptedConsumer(KafkaError(code))
    outcome = _commit(consumer)
    assert outcome.confirmed == {}
    assert outcome.failed == {(TOPIC, 0): 10, (TOPIC, 1): 20}
    assert outcome.left_group
    assert outcome.error.startswith(KafkaError(code).name())
    assert len(consumer.calls) == 1


def test_a_passing_error_is_given_up_on_after_the_retry_time() -> None:
    consumer = ScriptedConsumer(*[KafkaError(KafkaError.STALE_MEMBER_EPOCH)] * 3)
    outcome = _commit(consumer, retry_for_s=0.0)
    assert outcome.failed == {(TOPIC, 0): 10, (TOPIC, 1): 20}
    assert not outcome.left_group
    assert len(consumer.calls) == 1


def test_the_error_table_classes_the_new_protocols_commit_errors() -> None:
    assert errors.passing(KafkaError(KafkaError.STALE_MEMBER_EPOCH))
    assert not errors.left_group(KafkaError(KafkaError.STALE_MEMBER_EPOCH))
    for code in (KafkaError.UNKNOWN_MEMBER_ID, KafkaError.FENCED_MEMBER_EPOCH):
        assert errors.left_group(KafkaError(code)) and not errors.passing(KafkaError(code))


def test_a_broker_without_the_consumer_protocol_ends_the_run_with_what_to_do() -> None:
    """librdkafka 2.16 hands this fatal error to `poll()` as a `_FATAL` record error with its fatal flag
    unset; a worker that took it for a passing one idled for ever outside its group (seen against a broker
    with group.coordinator.rebalance.protocols=classic)."""
    error = KafkaError(
        KafkaError._FATAL,
        "Fatal error: Broker: API version not supported: ConsumerGroupHeartbeat fatal error",
    )
    assert not error.fatal() and errors.consumer_fatal(error)
    failure = Failure()
    failure.client_error(error)
    assert failure.reason is not None
    assert failure.reason.startswith("_FATAL: Fatal error: Broker: API version not supported")
    assert failure.reason.endswith(
        "does not serve kafka.group.protocol = consumer (Kafka 4.0+ does): use classic"
    )
