"""Queue mode's promises end to end: a real Kafka 4.4.0 broker (share groups), the test model, workers as
processes (`triage-worker run --consume queue`), and the audit of the topics (tools/harness.py): each input
offset has a triage record or a dead letter, never neither; duplicates are counted and bounded."""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import confluent_kafka
import kafka_source
import pytest

from tools.harness import (
    Audit,
    Publisher,
    Topics,
    Worker,
    audit,
    publish,
    set_share_group_configs,
    settings_for,
    wait_until_served,
)
from worker.dev.local_broker import LocalBroker, configured_kafka_version, free_port
from worker.kafka.admin import TopicSpec, create_topics
from worker.kafka.dead_letters import DELIVERY_COUNT_EXCEEDED
from worker.kafka.share_groups import (
    DELIVERY_COUNT_LIMIT,
    LOCK_DURATION,
    NO_SHARE_GROUPS,
    create_share_consumer,
    prepare_share_group,
)

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

QUEUE = {"pipeline.consume": "queue"}
# A share group's members get records about 5 s after they subscribe (its heartbeat interval).
_STARTED_S = 120.0


def _topics(share_topic: Callable[..., str]) -> Topics:
    return Topics(share_topic("raw", 1), share_topic("triaged", 1), share_topic("dlq", 1))


def _report(name: str, text: str) -> None:
    print(f"\n[{name}] {text}")


def _all_answered(bootstrap: str, topics: Topics, sent: int, timeout_s: float) -> Audit:
    """The audit once every input has an output (or at `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        report = audit(bootstrap, topics, visible_within_s=5)
        if (len(report.inputs) >= sent and not report.lost) or time.monotonic() > deadline:
            return report
        time.sleep(2)


def _outputs(bootstrap: str, topics: Topics) -> int:
    report = audit(bootstrap, topics, visible_within_s=5)
    return sum(map(len, report.results.values())) + sum(map(len, report.dead.values()))


def _wait_for_outputs(bootstrap: str, topics: Topics, at_least: int, timeout_s: float = _STARTED_S) -> int:
    deadline = time.monotonic() + timeout_s
    while (found := _outputs(bootstrap, topics)) < at_least:
        assert time.monotonic() < deadline, f"{found} outputs, waited for {at_least}"
        time.sleep(1)
    return found


def _misrouted(report: Audit) -> list[tuple[int, int]]:
    """As `Audit.misrouted`, but a ticket dead-lettered over its delivery limit is where it belongs."""
    wrong = []
    for position in report.misrouted:
        dead = set(report.dead.get(position, []))
        if report.inputs[position] != "ticket" or dead - {DELIVERY_COUNT_EXCEEDED}:
            wrong.append(position)
    return wrong


def test_three_workers_on_one_partition_all_take_tickets_and_each_gets_one_output(
    share_group_bootstrap: str, share_topic: Callable[..., str], tmp_path: Path
) -> None:
    """More workers than partitions: each takes tickets (they arrive one producer batch each, as tickets
    do); every ticket gets exactly one record, every malformed record one dead letter."""
    bootstrap, topics = share_group_bootstrap, _topics(share_topic)
    group = f"triage-queue-{uuid.uuid4().hex[:8]}"
    workers = [Worker(bootstrap, topics, group, tmp_path, f"queue-{n}", QUEUE) for n in range(3)]
    try:
        for worker in workers:
            worker.wait_for("pipeline_started", timeout=_STARTED_S)
        publisher = Publisher(bootstrap, topics, 600, rate=40.0, seed=21)
        publisher.start()
        publisher.finish(120)
        started = time.monotonic()
        report = _all_answered(bootstrap, topics, publisher.sent, 180)
        took = time.monotonic() - started
        assert all(worker.stop() == 0 for worker in workers)
    finally:
        for worker in workers:
            worker.kill()

    report = audit(bootstrap, topics, visible_within_s=5)
    accepted = [worker.metrics()[-1]["queue"]["accepted"] for worker in workers]
    _report("queue, 3 workers", f"{report.summary()}; accepted per worker {accepted}; last {took:.1f}s")
    assert len(report.inputs) == publisher.sent == 600
    assert report.lost == []
    assert report.misrouted == []
    assert report.duplicates == 0  # no crash, no lock run out: nothing is redone
    assert all(count > 0 for count in accepted), accepted
    malformed = sum(1 for kind in report.inputs.values() if kind != "ticket")
    assert sum(map(len, report.dead.values())) == malformed > 0
    finals = [worker.metrics()[-1] for worker in workers]
    assert sum(final["queue"]["rejected"] for final in finals) == malformed
    assert sum(final["consumed"] for final in finals) == 600


def test_kill_9_five_times_with_three_workers_on_one_partition_loses_nothing(
    share_group_bootstrap: str, share_topic: Callable[..., str], tmp_path: Path
) -> None:
    """A killed worker's records are released at once (the broker sees its connection close) and handed to
    the others. Duplicates: at most what the killed worker had produced but not acknowledged, which is at
    most `max_in_flight` records per kill."""
    bootstrap, topics = share_group_bootstrap, _topics(share_topic)
    group = f"triage-queue-{uuid.uuid4().hex[:8]}"
    max_in_flight, crashes = 32, 5
    settings = {**QUEUE, "pipeline.max_in_flight": str(max_in_flight)}
    rng = random.Random(36)
    workers = [Worker(bootstrap, topics, group, tmp_path, f"queue-{n}", settings) for n in range(3)]
    publisher = Publisher(bootstrap, topics, 0, 25.0, seed=36)
    try:
        for worker in workers:
            worker.wait_for("pipeline_started", timeout=_STARTED_S)
        publisher.start()
        for crash in range(crashes):
            time.sleep(rng.uniform(3.0, 6.0))
            victim = rng.randrange(len(workers))
            assert workers[victim].process.poll() is None, workers[victim].tail()
            workers[victim].kill()
            workers[victim] = Worker(bootstrap, topics, group, tmp_path, f"queue-restarted-{crash}", settings)
            workers[victim].wait_for("pipeline_started", timeout=_STARTED_S)
        publisher.end()
        publisher.finish(120)
        report = _all_answered(bootstrap, topics, publisher.sent, 240)
        assert all(worker.stop() == 0 for worker in workers)
    finally:
        publisher.end()
        for worker in workers:
            worker.kill()

    report = audit(bootstrap, topics, visible_within_s=5)
    over_limit = sum(dead.count(DELIVERY_COUNT_EXCEEDED) for dead in report.dead.values())
    _report(
        "queue, kill -9",
        f"{report.summary()} after {crashes} kill -9 of 3 workers; {over_limit} over the delivery limit",
    )
    assert len(report.inputs) == publisher.sent > 0
    assert report.lost == []
    assert _misrouted(report) == []
    assert report.duplicates <= crashes * max_in_flight


@pytest.fixture
def broker_without_share_groups(
    kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A broker with no share groups: the session's when its release has none, else a local Kafka 4.1.1
    (its `share.version` is 0, as on an upgraded cluster)."""
    release = tuple(int(part) for part in configured_kafka_version().split(".")[:2])
    if release < (4, 2):
        yield kafka_bootstrap
        return
    if kafka_source.choose() != "local":
        pytest.skip("needs a broker without share groups: the session's has them and may not start another")
    broker = LocalBroker(tmp_path_factory.mktemp("kafka-4.1.1"), port=free_port(), kafka_version="4.1.1")
    broker.start(fresh=True, echo=lambda _line: None)
    try:
        yield broker.bootstrap
    finally:
        broker.stop()


def test_a_broker_without_share_groups_is_refused_in_one_line(
    broker_without_share_groups: str, tmp_path: Path
) -> None:
    """Queue mode on a broker without share groups: the worker stops with one line that names what it
    needs, exit 2."""
    bootstrap = broker_without_share_groups
    names = [f"test.no-share-groups.{name}.{uuid.uuid4().hex[:8]}" for name in ("raw", "triaged", "dlq")]
    create_topics({"bootstrap.servers": bootstrap}, [TopicSpec(name, 1, 1) for name in names])
    for name in names:
        wait_until_served(bootstrap, name, 1)
    topics = Topics(*names)
    worker = Worker(bootstrap, topics, f"triage-queue-{uuid.uuid4().hex[:8]}", tmp_path, "old", QUEUE)
    try:
        code = worker.process.wait(_STARTED_S)
    finally:
        worker.kill()
    assert code == 2, worker.tail()
    assert worker.tail(1) == f"triage-worker: error: queue mode: {NO_SHARE_GROUPS}"


def test_a_record_on_its_last_delivery_is_tried_first_and_never_released(
    share_group_bootstrap: str, share_topic: Callable[..., str], tmp_path: Path
) -> None:
    """A member that released the tickets once (as a worker whose lock ran out would) leaves them on their
    second delivery: with a limit of 2 that is their last, and the worker classifies them like any other —
    a delivery spent by someone else's pacing costs the ticket nothing (issue #43). Before, they were
    dead-lettered as `delivery_count_exceeded` without a try."""
    bootstrap, topics = share_group_bootstrap, _topics(share_topic)
    group = f"triage-queue-{uuid.uuid4().hex[:8]}"
    count = 3
    publish(bootstrap, topics, count, malformed_ratio=0.0, seed=5)
    settings = settings_for(bootstrap, topics, **{"pipeline.group_id": group, "pipeline.consume": "queue"})
    prepare_share_group(settings.kafka, settings.pipeline)  # the group starts at the earliest offset
    releasing = create_share_consumer(settings.kafka, settings.pipeline)
    try:
        releasing.subscribe([topics.input])
        released, deadline = 0, time.monotonic() + _STARTED_S
        while released < count and time.monotonic() < deadline:
            for message in releasing.poll(1.0):
                releasing.acknowledge(message, confluent_kafka.AcknowledgeType.RELEASE)
                released += 1
            releasing.commit_sync(10.0)
        assert released == count
    finally:
        releasing.close()
    worker = Worker(
        bootstrap, topics, group, tmp_path, "limit", {**QUEUE, "pipeline.delivery_count_limit": "2"}
    )
    try:
        worker.wait_for("pipeline_started", timeout=_STARTED_S)
        report = _all_answered(bootstrap, topics, count, 120)
        assert worker.stop() == 0
    finally:
        worker.kill()
    assert report.lost == [] and report.duplicates == 0 and report.dead == {}
    final = worker.metrics()[-1]["queue"]
    assert final["accepted"] == count
    assert final["released"] == final["rejected"] == final["delivery_count_exceeded"] == 0


def test_a_backlog_of_twenty_locks_is_triaged_once_without_spending_deliveries_on_pacing(
    share_group_bootstrap: str, share_topic: Callable[..., str], tmp_path: Path
) -> None:
    """Issue #43 item 4: a backlog far larger than one record lock holds, published in large producer batches
    (the broker hands out whole ones), with a slow model (0.25 s a ticket) and the shortest lock (15 s). A
    record is never released on its last delivery: every ticket ends with exactly one triage record (those
    the lock left no model time for on their last delivery with the `overloaded` fallback) and none is
    dead-lettered `delivery_count_exceeded`. Before, the tail of each batch was released untried, came back
    with the next, and was dead-lettered after five."""
    bootstrap, topics = share_group_bootstrap, _topics(share_topic)
    group = f"triage-queue-{uuid.uuid4().hex[:8]}"
    set_share_group_configs(bootstrap, group, {LOCK_DURATION: 15000})
    # What one lock holds here: 2 model processes at 4 tickets/s each, for the 7 s of the lock in which a
    # ticket may still be taken (15 s - 2 s deadline - 5 s delivery timeout - 1 s margin) = 56 tickets.
    per_lock = 56
    count = 20 * per_lock
    publish(bootstrap, topics, count, malformed_ratio=0.0, seed=43)
    worker = Worker(bootstrap, topics, group, tmp_path, "backlog", QUEUE, slow_model_s=0.25)
    try:
        worker.wait_for("pipeline_started", timeout=_STARTED_S)
        report = _all_answered(bootstrap, topics, count, 900)
        assert worker.stop() == 0
    finally:
        worker.kill()
    final = worker.metrics()[-1]
    queue = final["queue"]
    _report(
        "queue, backlog of 20 locks",
        f"{report.summary()}; accepted {queue['accepted']}, released untried {queue['released_untried']}, "
        f"fetch size {queue['fetch_size']}, fallbacks {final['fallback']}",
    )
    assert len(report.inputs) == count
    assert report.lost == [] and report.dead == {} and report.duplicates == 0
    assert queue["delivery_count_exceeded"] == 0 and queue["accepted"] == count
    # A record is released untried only on a delivery that is not its last (5 by default): the broker hands
    # out whole producer batches, which librdkafka 2.16 cannot ask to split (no strict record limit,
    # KIP-1206), so a bulk-produced backlog's tail does circle; on its last delivery it is answered.
    assert queue["released_untried"] <= count * 4


def test_a_rolling_restart_on_the_last_delivery_leaves_every_ticket_triaged_or_dead_lettered(
    share_group_bootstrap: str, share_topic: Callable[..., str], tmp_path: Path
) -> None:
    """Issue #55 as reported: delivery limit 2; a worker holding a batch is killed (kill -9), so its records
    come back with one delivery spent; its replacement takes them on their last delivery and is stopped with
    SIGTERM (a rolling deploy) while most are unfinished; a third worker finishes what is left. Every ticket
    ends with a triage record or a dead letter. Before, the replacement released what it had not finished
    (`records_released reason=stopping`) and the broker archived it: 1,405 of 1,500 with neither."""
    bootstrap, topics = share_group_bootstrap, _topics(share_topic)
    group = f"triage-queue-{uuid.uuid4().hex[:8]}"
    set_share_group_configs(bootstrap, group, {DELIVERY_COUNT_LIMIT: 2})
    count = 1500
    publish(bootstrap, topics, count, malformed_ratio=0.0, seed=55)
    crashing = Worker(bootstrap, topics, group, tmp_path, "crashing", QUEUE, slow_model_s=0.25)
    try:
        crashing.wait_for("pipeline_started", timeout=_STARTED_S)
        _wait_for_outputs(bootstrap, topics, 1)  # it holds a batch
    finally:
        crashing.kill()
    replacement = Worker(bootstrap, topics, group, tmp_path, "replacement", QUEUE, slow_model_s=0.25)
    finishing: Worker | None = None
    try:
        replacement.wait_for("pipeline_started", timeout=_STARTED_S)
        before = _outputs(bootstrap, topics)
        _wait_for_outputs(bootstrap, topics, before + 1)  # it holds the batch again, on its last delivery
        assert replacement.stop() == 0, replacement.tail()
        answered = sum(event["count"] for event in replacement.events("last_deliveries_answered"))
        released_last = replacement.events("last_deliveries_released")
        finishing = Worker(bootstrap, topics, group, tmp_path, "finishing", QUEUE)
        finishing.wait_for("pipeline_started", timeout=_STARTED_S)
        report = _all_answered(bootstrap, topics, count, 300)
        assert finishing.stop() == 0
    finally:
        replacement.kill()
        if finishing is not None:
            finishing.kill()
    report = audit(bootstrap, topics, visible_within_s=5)
    fallbacks = sum(1 for results in report.results.values() for r in results if r.fallback)
    _report(
        "queue, rolling restart on the last delivery",
        f"{report.summary()}; the replacement answered {answered} last deliveries at its shutdown; "
        f"{fallbacks} fallback records; released on their last delivery: {released_last}",
    )
    assert len(report.inputs) == count
    assert report.lost == []
    assert _misrouted(report) == []
    assert answered > 0  # the scenario happened: the replacement held last deliveries when it stopped


def test_the_share_group_gets_the_brokers_own_dead_letter_topic_as_its_last_net(
    share_group_bootstrap: str, share_topic: Callable[..., str]
) -> None:
    """Issue #55 item 4 (KIP-1191, Kafka 4.4): `prepare_share_group` gives a group nobody configured the
    broker's dead-letter topic `dlq.<group>`, references only; a record the group archives (here one a
    member rejects) then leaves a reference there: its topic, partition, offset, group and delivery count,
    no key and no value."""
    bootstrap, topics = share_group_bootstrap, _topics(share_topic)
    group = f"triage-queue-{uuid.uuid4().hex[:8]}"
    settings = settings_for(bootstrap, topics, **{"pipeline.group_id": group, "pipeline.consume": "queue"})
    shared = prepare_share_group(settings.kafka, settings.pipeline)
    assert (shared.dead_letter_topic, shared.dead_letter) == (f"dlq.{group}", "set by the worker")
    publish(bootstrap, topics, 1, malformed_ratio=0.0, seed=4)
    member = create_share_consumer(settings.kafka, settings.pipeline)
    try:
        member.subscribe([topics.input])
        taken: list[confluent_kafka.Message] = []
        deadline = time.monotonic() + _STARTED_S
        while not taken and time.monotonic() < deadline:
            taken = [message for message in member.poll(1.0) if message.error() is None]
        assert len(taken) == 1
        member.acknowledge(taken[0], confluent_kafka.AcknowledgeType.REJECT)
        member.commit_sync(10.0)
    finally:
        member.close()
    reader = confluent_kafka.Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"reader-{group}", "auto.offset.reset": "earliest"}
    )
    try:
        reader.subscribe([f"dlq.{group}"])
        found = None
        deadline = time.monotonic() + 60
        while found is None and time.monotonic() < deadline:
            message = reader.poll(1.0)
            if message is not None and message.error() is None:
                found = message
    finally:
        reader.close()
    assert found is not None, "no reference in the broker's dead-letter topic"
    headers = dict(found.headers() or [])
    assert (found.key(), found.value()) == (None, None)
    assert headers["__dlq.errors.topic"] == topics.input.encode()
    assert (headers["__dlq.errors.offset"], headers["__dlq.errors.group"]) == (b"0", group.encode())
