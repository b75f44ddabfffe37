"""The consumer-group protocol (`kafka.group.protocol`, KIP-848) without a broker: which consumer options each
protocol gets, the options the new protocol refuses (one line each, checked against the installed
librdkafka)."""

from __future__ import annotations

import confluent_kafka
import pytest

from tools.harness import FAST_GROUP_OPTIONS, fast_group_options
from worker.config import load_settings
from worker.errors import UserError
from worker.kafka.clients import (
    CLASSIC_ONLY,
    consumer_config,
    incremental_assignment,
    producer_config,
)

# A value librdkafka takes for each classic-only option, to show it refuses them under the new protocol.
CLASSIC_VALUES = {
    "partition.assignment.strategy": "cooperative-sticky",
    "session.timeout.ms": "6000",
    "heartbeat.interval.ms": "1000",
    "group.protocol.type": "consumer",
}


def test_the_classic_protocol_is_the_default_with_cooperative_sticky_assignment() -> None:
    config = consumer_config(load_settings(env={}))
    assert config["group.protocol"] == "classic"  # pinned: a librdkafka whose default moves does not move it
    assert config["partition.assignment.strategy"] == "cooperative-sticky"
    assert incremental_assignment(config)


def test_an_eager_assignor_under_the_classic_protocol_is_not_incremental() -> None:
    config = consumer_config(load_settings(env={"KAFKA_PARTITION_ASSIGNMENT_STRATEGY": "range"}))
    assert not incremental_assignment(config)


def test_the_consumer_protocol_sends_no_assignor_and_assigns_incrementally() -> None:
    settings = load_settings(
        env={"KAFKA_GROUP_PROTOCOL": "consumer", "KAFKA_GROUP_REMOTE_ASSIGNOR": "uniform"}
    )
    config = consumer_config(settings)
    assert config["group.protocol"] == "consumer"
    assert config["group.remote.assignor"] == "uniform"
    assert not set(config) & set(CLASSIC_ONLY)
    assert incremental_assignment(config)
    assert "group.protocol" not in producer_config(settings)  # a consumer option stays with the consumer
    # librdkafka takes the whole set (it refuses a consumer given any CLASSIC_ONLY option).
    confluent_kafka.Consumer(config).close()


@pytest.mark.parametrize("option", sorted(CLASSIC_ONLY))
def test_an_option_the_consumer_protocol_refuses_is_one_line_naming_it(option: str) -> None:
    variable = "KAFKA_" + option.upper().replace(".", "_")
    settings = load_settings(env={"KAFKA_GROUP_PROTOCOL": "consumer", variable: CLASSIC_VALUES[option]})
    with pytest.raises(UserError) as refused:
        consumer_config(settings)
    message = str(refused.value)
    assert "\n" not in message
    assert message.startswith(
        f"config error: kafka.{option} cannot be set with kafka.group.protocol = consumer"
    )
    # The same option under the classic protocol is the user's to choose.
    assert consumer_config(load_settings(env={variable: CLASSIC_VALUES[option]}))[option]


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
