"""Queue mode's pure parts: the share consumer's options, the refusals at start and the lock arithmetic."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import confluent_kafka
import msgspec
import pytest

from tools import REPO
from tools.harness import TINY_MODEL
from worker.app.doors import lock_budget, refuse_exactly_once
from worker.errors import UserError
from worker.kafka.share_groups import (
    ShareGroup,
    broker_net,
    delivery_timeout_ms,
    queue_kafka_options,
    share_consumer_config,
)
from worker.pipeline.sources.lock_budget import MARGIN_S, LockBudget
from worker.pipeline.sources.share import FetchSize
from worker.settings import Settings, load_settings

# The options tests and chaos give every worker (tools/harness.py FAST_GROUP_OPTIONS) and a few more that a
# share consumer refuses at construction (measured: a ValueError each).
_GROUP_ONLY = {
    "kafka.session.timeout.ms": "6000",
    "kafka.heartbeat.interval.ms": "1000",
    "kafka.auto.offset.reset": "latest",
    "kafka.enable.auto.commit": "false",
    "kafka.group.protocol": "consumer",
    "kafka.group.instance.id": "pod-1",
    "kafka.isolation.level": "read_committed",
    "kafka.partition.assignment.strategy": "range",
}


def _settings(**overrides: object) -> Settings:
    return load_settings(
        env={}, overrides={"kafka.bootstrap.servers": "b:9092", "pipeline.consume": "queue", **overrides}
    )


def test_the_share_consumer_gets_the_users_options_without_the_group_and_producer_ones() -> None:
    settings = _settings(
        **_GROUP_ONLY,
        **{"kafka.max.poll.interval.ms": "10000", "kafka.linger.ms": "20", "kafka.client.id": "me"},
        **{"pipeline.group_id": "triage-q"},
    )
    config = share_consumer_config(settings.kafka, settings.pipeline)
    assert config == {
        "bootstrap.servers": "b:9092",
        "max.poll.interval.ms": "10000",
        "client.id": "me",
        "group.id": "triage-q",
        "share.acknowledgement.mode": "explicit",
        "max.poll.records": "64",  # max_in_flight: a batch's rest would wait locked while others could work
    }
    given = _settings(**{"kafka.max.poll.records": "500"})
    assert share_consumer_config(given.kafka, given.pipeline)["max.poll.records"] == "500"


def test_a_share_consumer_is_made_from_those_options() -> None:
    """confluent-kafka refuses a consumer-group option at construction: none may reach it."""
    settings = _settings(**_GROUP_ONLY)
    consumer = confluent_kafka.ShareConsumer(share_consumer_config(settings.kafka, settings.pipeline))
    consumer.close()


def test_acknowledgements_other_than_explicit_are_refused() -> None:
    """librdkafka takes an unknown mode silently and acknowledges implicitly: every ticket would be
    accepted before its record is written."""
    with pytest.raises(UserError, match=r"share\.acknowledgement\.mode must be explicit"):
        settings = _settings(**{"kafka.share.acknowledgement.mode": "implicit"})
        share_consumer_config(settings.kafka, settings.pipeline)


def test_exactly_once_is_refused_in_one_line() -> None:
    with pytest.raises(UserError) as refused:
        refuse_exactly_once(_settings(**{"pipeline.guarantee": "exactly_once"}))
    assert "share groups have no transactional acknowledgements" in str(refused.value)
    assert "\n" not in str(refused.value)
    refuse_exactly_once(_settings())  # at-least-once: fine


def test_the_producer_delivery_timeout_defaults_to_a_third_of_the_lock_unless_set() -> None:
    group = ShareGroup(lock_ms=30000)
    assert delivery_timeout_ms(queue_kafka_options(_settings().kafka, group)) == 10000
    given = _settings(**{"kafka.delivery.timeout.ms": "5000"})
    assert delivery_timeout_ms(queue_kafka_options(given.kafka, group)) == 5000
    # librdkafka's default without queue mode's fitting: longer than any lock.
    assert delivery_timeout_ms(_settings().kafka) == 300000


def test_the_defaults_fit_the_default_lock() -> None:
    group = ShareGroup()
    settings = _settings()
    settings = msgspec.structs.replace(settings, kafka=queue_kafka_options(settings.kafka, group))
    budget = lock_budget(settings, group)
    budget.check()
    assert budget.needed_s == 2.0 + 10.0 + MARGIN_S


def test_a_deadline_and_delivery_wait_that_could_outlive_the_lock_are_refused_in_one_line() -> None:
    group = ShareGroup(lock_ms=15000)
    settings = _settings(**{"pipeline.deadline_ms": "6000", "kafka.delivery.timeout.ms": "9000"})
    with pytest.raises(UserError) as refused:
        lock_budget(settings, group).check()
    line = str(refused.value)
    assert "\n" not in line
    assert "pipeline.deadline_ms (6000)" in line and "delivery.timeout.ms (9000)" in line
    assert "share.record.lock.duration.ms" in line and "15000" in line


def test_records_are_taken_only_while_they_can_finish_inside_the_lock() -> None:
    budget = LockBudget(lock_s=30.0, deadline_s=2.0, delivery_s=10.0)
    polled = 100.0
    # 13 s needed (2 + 10 + the 1 s margin): a record may be taken until 17 s into the lock.
    assert budget.may_take(polled, polled)
    assert budget.may_take(polled, polled + 16.9)
    assert not budget.may_take(polled, polled + 17.0)
    # What is still unsettled is released just before the lock ends, not after.
    assert budget.expires_at(polled) == polled + 30.0 - MARGIN_S


def test_the_delivery_count_limit_setting_is_bounded_like_the_brokers() -> None:
    assert _settings(**{"pipeline.delivery_count_limit": "3"}).pipeline.delivery_count_limit == 3
    for outside in ("1", "11"):  # 1 would dead-letter every record on its first delivery
        with pytest.raises(UserError):
            _settings(**{"pipeline.delivery_count_limit": outside})
    with pytest.raises(UserError):
        _settings(**{"pipeline.consume": "stream"})


def test_run_refuses_exactly_once_in_queue_mode_in_one_line_before_it_needs_a_broker() -> None:
    """The whole command: no broker answers on port 1, and none is asked."""
    command = [sys.executable, "-m", "worker", "run", "--bootstrap-servers", "127.0.0.1:1"]
    command += ["--consume", "queue", "--guarantee", "exactly_once", "--model", str(TINY_MODEL)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False, cwd=REPO)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        'triage-worker: error: config error: pipeline.guarantee = "exactly_once" cannot be used with '
        'pipeline.consume = "queue": share groups have no transactional acknowledgements'
    )


def test_a_poll_asks_for_what_one_deadline_finishes_at_the_measured_rate() -> None:
    """Queue mode's fetch size (issue #43 item 4): not more than the worker can finish, so that records it
    could not even try rarely cost a delivery. It starts at twice the model's window and moves only by half
    or double (each move makes the share consumer anew)."""
    size = FetchSize.starting(smallest=4, largest=64, deadline_s=2.0, given=None)
    assert size.current == 8
    assert size.wanted(finished=8, busy_s=0.1) == 64  # 80/s: more than the bound takes
    assert size.wanted(finished=8, busy_s=4.0) == 4  # 2/s: 4 in a deadline, the window
    assert size.wanted(finished=8, busy_s=1.6) == 10  # 5/s
    assert not size.moves(10) and not size.moves(15)
    assert size.moves(16) and size.moves(4)
    given = FetchSize.starting(smallest=4, largest=64, deadline_s=2.0, given=500)
    assert given.current == 500 and not given.moves(given.wanted(finished=1, busy_s=60.0))


def test_the_share_consumer_is_made_with_the_fetch_size_unless_the_user_set_one() -> None:
    defaults = _settings()
    assert (
        share_consumer_config(defaults.kafka, defaults.pipeline, max_poll_records=12)["max.poll.records"]
        == "12"
    )
    given = _settings(**{"kafka.max.poll.records": "500"})
    assert (
        share_consumer_config(given.kafka, given.pipeline, max_poll_records=12)["max.poll.records"] == "500"
    )


class _Entry:
    def __init__(self, value: str, is_default: bool = True) -> None:
        self.value, self.is_default = value, is_default


class _Done:
    def __init__(self, value: object = None, error: Exception | None = None) -> None:
        self.value, self.error = value, error

    def result(self, timeout: float | None = None) -> object:
        if self.error is not None:
            raise self.error
        return self.value


class _Admin:
    """The AdminClient calls `broker_net` makes, recorded; `refuse`: the call names that raise."""

    def __init__(self, refuse: dict[str, confluent_kafka.KafkaException] | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.refuse = refuse or {}

    def _answer(self, name: str, keys: list[object], value: object = None) -> dict[object, _Done]:
        return {key: _Done(value, self.refuse.get(name)) for key in keys}

    def list_topics(self, timeout: float) -> object:
        return type("Metadata", (), {"brokers": {1: object()}})()

    def describe_configs(self, resources: list[object]) -> dict[object, _Done]:
        self.calls.append(("describe", resources))
        return self._answer(
            "describe", resources, {"errors.deadletterqueue.topic.name.prefix": _Entry("dlq.")}
        )

    def create_topics(self, topics: list[object], request_timeout: float) -> dict[object, _Done]:
        self.calls.append(("create", topics))
        return self._answer("create", [topic.topic for topic in topics])  # type: ignore[attr-defined]

    def incremental_alter_configs(self, resources: list[object]) -> dict[object, _Done]:
        self.calls.append(("alter", resources))
        return self._answer("alter", resources)


def test_the_share_group_gets_the_brokers_own_dead_letter_topic_as_the_last_net() -> None:
    """Issue #55 item 4 (KIP-1191): where the broker knows the group config and nobody set it, the worker
    creates `dlq.<group>` (allowed as a dead-letter topic) and sets it on the group, with references only
    (no copy of the record: its personal data stays where it was)."""
    admin = _Admin()
    configs = {
        "errors.deadletterqueue.topic.name": _Entry(""),
        "errors.deadletterqueue.copy.record.enable": _Entry("false"),
    }
    topic, how = broker_net(admin, "triage", configs, {})  # type: ignore[arg-type]
    assert (topic, how) == ("dlq.triage", "set by the worker")
    created: list[Any] = next(call for name, call in admin.calls if name == "create")
    assert [(topic.topic, topic.config) for topic in created] == [
        ("dlq.triage", {"errors.deadletterqueue.group.enable": "true"})
    ]
    altered: list[Any] = [call for name, call in admin.calls if name == "alter"][-1]
    assert len(altered) == 1
    assert {(e.name, e.value) for e in altered[0].incremental_configs} == {
        ("errors.deadletterqueue.topic.name", "dlq.triage"),
        ("errors.deadletterqueue.copy.record.enable", "false"),
    }


def test_a_share_group_dead_letter_topic_someone_set_is_left_and_a_broker_without_one_is_no_error() -> None:
    set_by_operator = {"errors.deadletterqueue.topic.name": _Entry("dlq.ours", is_default=False)}
    admin = _Admin()
    assert broker_net(admin, "triage", set_by_operator, {}) == ("dlq.ours", "set on the group")  # type: ignore[arg-type]
    assert admin.calls == []
    topic, how = broker_net(admin, "triage", {}, {})  # type: ignore[arg-type]
    assert topic is None and how.startswith("none: the broker has no share-group dead-letter topics")
    denied = confluent_kafka.KafkaException(
        confluent_kafka.KafkaError(confluent_kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED, "not allowed")
    )
    refusing = _Admin(refuse={"create": denied})
    topic, how = broker_net(refusing, "triage", {"errors.deadletterqueue.topic.name": _Entry("")}, {})  # type: ignore[arg-type]
    assert topic is None and how.startswith("none: ") and "not allowed" in how
    assert not any(name == "alter" for name, _ in refusing.calls)
