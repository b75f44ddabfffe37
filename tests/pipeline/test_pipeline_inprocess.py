"""The consumer loop constructed in this process against the real broker (no subprocess): its contracts seen
from the topics and the group's committed offsets."""

from __future__ import annotations

import datetime
import json
import time
import uuid
from collections.abc import Callable, Iterator, Mapping

import confluent_kafka
import msgspec
import pytest
import slow_model
from doubles import HoldingClassifier, InstantClassifier, RecordingClassifier, Running

from tools.harness import (
    TINY_MODEL,
    Topics,
    audit,
    committed_offsets,
    end_offsets,
    make_topics,
    publish,
    settings_for,
    wait_until_committed,
)
from worker.app.doors import TriageParts, group_pipeline
from worker.classification import Classifier, FallbackLabel
from worker.inference.loading import resolve_taxonomy
from worker.inference.pool import ClassifierPool, open_pool
from worker.kafka.clients import record_headers
from worker.messages import TriageResult
from worker.settings import InferenceSettings

pytestmark = pytest.mark.kafka

FALLBACK = FallbackLabel("unclassified", "Medium")
BOTH_GUARANTEES = pytest.mark.parametrize("guarantee", ["at_least_once", "exactly_once"])
# The test model in one thread: the pool these tests classify with.
_ONE_THREAD = InferenceSettings(model=str(TINY_MODEL), pool="thread", pool_size=1)


Start = Callable[..., Running]


@pytest.fixture
def start(kafka_bootstrap: str) -> Iterator[Start]:
    """`start(topics, classifier, dispatch_window=64, **settings)`: a pipeline in its own group, running."""
    started: list[Running] = []

    def run(topics: Topics, classifier: Classifier, dispatch_window: int = 64, **settings: str) -> Running:
        group = f"inprocess-{uuid.uuid4().hex[:8]}"
        config = settings_for(kafka_bootstrap, topics, **{"pipeline.group_id": group, **settings})
        parts = TriageParts(classifier, FALLBACK, dispatch_window)
        started.append(Running(group_pipeline(config, parts), group))
        return started[-1]

    yield run
    for each in started:
        each.stop()


@BOTH_GUARANTEES
def test_the_loop_in_process_gives_every_record_one_result_or_dead_letter(
    kafka_bootstrap: str, unique_topic: Callable[..., str], start: Start, guarantee: str
) -> None:
    topics = make_topics(unique_topic)
    count = 300
    publish(kafka_bootstrap, topics, count, malformed_ratio=0.1, seed=21)
    with open_pool(_ONE_THREAD, *resolve_taxonomy(_ONE_THREAD)) as pool:
        worker = start(topics, pool, dispatch_window=2, **{"pipeline.guarantee": guarantee})
        wait_until_committed(kafka_bootstrap, worker.group, topics.input, timeout=120)
        assert worker.stop() == 0

    report = audit(kafka_bootstrap, topics)
    assert len(report.inputs) == count
    assert report.lost == [] and report.duplicates == 0 and report.misrouted == []
    assert worker.pipeline.metrics.consumed == count
    assert worker.pipeline.metrics.dead_lettered == sum(len(d) for d in report.dead.values()) > 0


def _publish_tickets(bootstrap: str, topics: Topics, bodies: list[str]) -> None:
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap})
    for index, body in enumerate(bodies):
        value = json.dumps({"ticket_id": f"H-{index}", "body": body}).encode()
        producer.produce(topics.input, value=value, partition=0)
    assert producer.flush(30) == 0


def test_the_committed_offset_never_passes_an_unanswered_ticket(
    kafka_bootstrap: str, unique_topic: Callable[..., str], start: Start
) -> None:
    topics = make_topics(unique_topic, partitions=1)
    bodies = ["where is my card?"] * 40
    bodies[10] = "hold this one"
    _publish_tickets(kafka_bootstrap, topics, bodies)
    classifier = HoldingClassifier()
    worker = start(topics, classifier, **{"pipeline.commit_interval_ms": "100"})

    # Everything after the held ticket is answered and acknowledged, but the position stays at it.
    deadline = time.monotonic() + 60
    while worker.pipeline.metrics.produced < 39 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.pipeline.metrics.produced == 39
    time.sleep(0.5)  # several commit intervals
    assert committed_offsets(kafka_bootstrap, worker.group, topics.input) == {0: 10}

    classifier.release()
    wait_until_committed(kafka_bootstrap, worker.group, topics.input, timeout=60)
    assert worker.stop() == 0
    assert committed_offsets(kafka_bootstrap, worker.group, topics.input) == end_offsets(
        kafka_bootstrap, topics.input
    )
    report = audit(kafka_bootstrap, topics)
    assert report.lost == [] and report.duplicates == 0


def test_exactly_once_writes_a_partition_s_results_in_input_order_and_only_with_their_offsets(
    kafka_bootstrap: str, unique_topic: Callable[..., str], start: Start
) -> None:
    """A transaction holds only outputs whose offsets it commits: everything answered after a held ticket
    waits for it, so a read_committed reader never sees a result whose offset a crash would redo."""
    topics = make_topics(unique_topic, partitions=1)
    bodies = ["where is my card?"] * 40
    bodies[10] = "hold this one"
    _publish_tickets(kafka_bootstrap, topics, bodies)
    classifier = HoldingClassifier()
    worker = start(
        topics, classifier, **{"pipeline.commit_interval_ms": "100", "pipeline.guarantee": "exactly_once"}
    )
    deadline = time.monotonic() + 60
    while worker.pipeline.metrics.committed < 10 and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # several commit intervals
    assert committed_offsets(kafka_bootstrap, worker.group, topics.input) == {0: 10}
    assert sorted(audit(kafka_bootstrap, topics).results) == [(0, offset) for offset in range(10)]

    classifier.release()
    wait_until_committed(kafka_bootstrap, worker.group, topics.input, timeout=60)
    assert worker.stop() == 0
    report = audit(kafka_bootstrap, topics)
    assert report.lost == [] and report.duplicates == 0
    assert worker.pipeline.metrics.transactions > 0 and worker.pipeline.metrics.transactions_aborted == 0
    assert [result.ticket_id for result in _output_in_order(kafka_bootstrap, topics.output)] == [
        f"H-{index}" for index in range(40)
    ]


def _output_in_order(bootstrap: str, topic: str) -> list[TriageResult]:
    consumer = confluent_kafka.Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"read-{uuid.uuid4()}",
            "isolation.level": "read_committed",
        }
    )
    consumer.assign(
        [confluent_kafka.TopicPartition(topic, p, confluent_kafka.OFFSET_BEGINNING) for p in range(3)]
    )
    decoder = msgspec.json.Decoder(TriageResult)
    found: list[TriageResult] = []
    deadline = time.monotonic() + 30
    while len(found) < 40 and time.monotonic() < deadline:
        found.extend(decoder.decode(m.value() or b"") for m in consumer.consume(50, 1.0) if m.error() is None)
    consumer.close()
    # One key per ticket: results spread over the output's partitions; input order is per ticket key there.
    return sorted(found, key=lambda result: result.source.offset)


def test_the_pipeline_stays_under_its_bound_and_resumes_when_slots_free(
    kafka_bootstrap: str, unique_topic: Callable[..., str], start: Start
) -> None:
    """Held tickets fill the bound: the loop stops taking records (and pauses after a while) but keeps
    the member in the group; released, everything finishes."""
    topics = make_topics(unique_topic, partitions=1)
    _publish_tickets(kafka_bootstrap, topics, ["hold: my card is late"] * 30)
    classifier = HoldingClassifier()
    worker = start(topics, classifier, **{"pipeline.max_in_flight": "8"})

    deadline = time.monotonic() + 30
    while not worker.pipeline.metrics.paused and time.monotonic() < deadline:
        time.sleep(0.05)
    metrics = worker.pipeline.metrics
    assert metrics.paused and metrics.consumed == metrics.in_flight_max == 8
    classifier.release()
    while metrics.consumed < 30 and time.monotonic() < deadline:
        time.sleep(0.02)
        classifier.release()
    wait_until_committed(kafka_bootstrap, worker.group, topics.input, timeout=60)
    assert worker.stop() == 0
    assert metrics.in_flight_max == 8 and metrics.max_poll_exceeded == 0 and metrics.lost == 0


@BOTH_GUARANTEES
def test_records_too_large_for_the_dead_letter_topic_are_written_smaller_and_nothing_stops(
    kafka_bootstrap: str, unique_topic: Callable[..., str], start: Start, guarantee: str
) -> None:
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.cimpl import NewTopic  # re-exported untyped by confluent_kafka.admin

    topics = make_topics(unique_topic, partitions=1)
    topics.dead_letter = f"dlq-small-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    small = NewTopic(topics.dead_letter, 1, 1, config={"max.message.bytes": "2000"})
    admin.create_topics([small])[topics.dead_letter].result(30)
    producer = confluent_kafka.Producer({"bootstrap.servers": kafka_bootstrap, "message.max.bytes": 1048576})
    records = [
        (b"k-big-value", b"x" * 5000),  # invalid JSON: its dead letter is too large for the topic
        (b"K" * 5000, b'{"ticket_id": "T-1", "body": "x"}'),  # key_too_large, and too large with its key
        (b"k-huge", b"[" * 1_000_100),  # over the worker producer's message.max.bytes: refused at once
        (b"k-ok", b'{"ticket_id": "T-2", "body": "where is my card?"}'),
    ]
    for key, value in records:
        producer.produce(topics.input, key=key, value=value)
    assert producer.flush(30) == 0
    worker = start(topics, InstantClassifier(), dispatch_window=4, **{"pipeline.guarantee": guarantee})
    wait_until_committed(kafka_bootstrap, worker.group, topics.input, timeout=60)
    assert worker.stop() == 0

    report = audit(kafka_bootstrap, topics)
    assert report.lost == [] and report.duplicates == 0
    if guarantee == "exactly_once":  # the broker's refusals aborted transactions; their work was redone
        assert worker.pipeline.metrics.transactions_aborted > 0
    assert report.dead == {(0, 0): ["invalid_json"], (0, 1): ["key_too_large"], (0, 2): ["too_deeply_nested"]}
    assert list(report.results) == [(0, 3)]
    omitted = _omitted_headers(kafka_bootstrap, topics.dead_letter)
    # Left out: the value and the key (no record here had headers of its own).
    assert omitted == {offset: len(key) + len(value) for offset, (key, value) in enumerate(records[:3])}


def test_a_ticket_with_no_text_is_dead_lettered_as_empty_ticket_and_never_reaches_the_model(
    kafka_bootstrap: str, unique_topic: Callable[..., str], start: Start
) -> None:
    topics = make_topics(unique_topic, partitions=1)
    _publish_tickets(kafka_bootstrap, topics, ["", " \n\t", "where is my card?"])
    classifier = RecordingClassifier()
    worker = start(topics, classifier)
    wait_until_committed(kafka_bootstrap, worker.group, topics.input, timeout=60)
    assert worker.stop() == 0

    report = audit(kafka_bootstrap, topics)
    assert report.dead == {(0, 0): ["empty_ticket"], (0, 1): ["empty_ticket"]}
    assert list(report.results) == [(0, 2)]
    assert classifier.texts == ["where is my card?"]
    assert worker.pipeline.metrics.dead_lettered_by_type == {"empty_ticket": 2}


def _omitted_headers(bootstrap: str, topic: str) -> dict[int, int]:
    """Source offset → `triage.omitted.bytes` of each dead letter in `topic`."""
    consumer = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": f"read-{uuid.uuid4()}"})
    consumer.assign([confluent_kafka.TopicPartition(topic, 0, confluent_kafka.OFFSET_BEGINNING)])
    found: dict[int, int] = {}
    deadline = time.monotonic() + 30
    while len(found) < 3 and time.monotonic() < deadline:
        for message in consumer.consume(10, 1.0):
            headers = dict(record_headers(message) or [])
            offset, omitted = headers["triage.source.offset"], headers["triage.omitted.bytes"]
            assert offset is not None and omitted is not None
            found[int(offset)] = int(omitted)
    consumer.close()
    return found


def test_an_unexpected_exception_on_one_record_dead_letters_it_and_the_loop_goes_on(
    kafka_bootstrap: str,
    unique_topic: Callable[..., str],
    start: Start,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worker.pipeline.triage.deadlines import ticket_deadline as real_deadline

    def deadline_that_breaks(
        now: float, wall: float, deadline: float, metadata: Mapping[str, str] | None
    ) -> float:
        if metadata:  # stands for any library failing on one record's content
            raise ZeroDivisionError("a bug reached by one record")
        return real_deadline(now, wall, deadline, metadata)

    monkeypatch.setattr("worker.pipeline.triage.intake.ticket_deadline", deadline_that_breaks)
    topics = make_topics(unique_topic, partitions=1)
    bodies = ['{"ticket_id": "A", "body": "x"}', '{"ticket_id": "B", "body": "y", "metadata": {"k": "v"}}']
    producer = confluent_kafka.Producer({"bootstrap.servers": kafka_bootstrap})
    for body in (*bodies, bodies[0]):
        producer.produce(topics.input, value=body.encode())
    assert producer.flush(30) == 0
    worker = start(topics, InstantClassifier(), dispatch_window=4)
    wait_until_committed(kafka_bootstrap, worker.group, topics.input, timeout=60)
    assert worker.stop() == 0
    report = audit(kafka_bootstrap, topics)
    assert report.dead == {(0, 1): ["internal_error"]}
    assert sorted(report.results) == [(0, 0), (0, 2)] and report.lost == []


# -- scheduling: earliest deadline first, and `overloaded` before model time -------------------------------

SLOW_S = 0.5  # per ticket, one context: the tests' model is the tiny one slowed down (tests/slow_model.py)


@pytest.fixture
def slow_pool() -> Iterator[ClassifierPool]:
    undo = slow_model.install(SLOW_S)
    try:
        with open_pool(_ONE_THREAD, *resolve_taxonomy(_ONE_THREAD)) as pool:
            yield pool
    finally:
        undo()


def _publish_due(bootstrap: str, topics: Topics, tickets: list[tuple[str, float | None]]) -> float:
    """Tickets (id, seconds from now to its `deadline_at`, or None for none) to partition 0; returns when."""
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap})
    sent = time.time()
    for ticket_id, due_in_s in tickets:
        ticket: dict[str, object] = {"ticket_id": ticket_id, "body": "my card has not arrived yet"}
        if due_in_s is not None:
            due = datetime.datetime.fromtimestamp(sent + due_in_s, datetime.UTC)
            ticket["metadata"] = {"deadline_at": due.isoformat()}
        producer.produce(topics.input, value=json.dumps(ticket).encode(), partition=0)
    assert producer.flush(30) == 0
    return sent


def _answers_in_order(bootstrap: str, topic: str) -> list[tuple[TriageResult, float]]:
    """The results on partition 0 of `topic` in the order the worker wrote them, with their timestamps (s)."""
    consumer = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": f"read-{uuid.uuid4()}"})
    end = consumer.get_watermark_offsets(confluent_kafka.TopicPartition(topic, 0), timeout=10)[1]
    consumer.assign([confluent_kafka.TopicPartition(topic, 0, confluent_kafka.OFFSET_BEGINNING)])
    decode = msgspec.json.Decoder(TriageResult).decode
    found: list[tuple[TriageResult, float]] = []
    deadline = time.monotonic() + 30
    while len(found) < end and time.monotonic() < deadline:
        for message in consumer.consume(10, 1.0):
            if message.error() is None:
                found.append((decode(message.value() or b""), message.timestamp()[1] / 1000.0))
    consumer.close()
    return found


def _wait_produced(worker: Running, count: int) -> None:
    deadline = time.monotonic() + 60
    while worker.pipeline.metrics.produced < count and time.monotonic() < deadline:
        time.sleep(0.02)
    assert worker.pipeline.metrics.produced >= count


def test_a_ticket_due_earlier_but_published_later_is_answered_before_the_loose_ones(
    kafka_bootstrap: str, unique_topic: Callable[..., str], slow_pool: ClassifierPool, start: Start
) -> None:
    topics = make_topics(unique_topic, partitions=1)
    worker = start(topics, slow_pool, dispatch_window=1, **{"pipeline.deadline_ms": "60000"})
    _publish_due(kafka_bootstrap, topics, [("ready", None)])
    _wait_produced(worker, 1)  # assigned and running: the urgent ticket's deadline counts from now
    loose = [f"loose-{i}" for i in range(6)]
    _publish_due(kafka_bootstrap, topics, [*((ticket, None) for ticket in loose), ("urgent", 10.0)])
    wait_until_committed(kafka_bootstrap, worker.group, topics.input, timeout=60)
    assert worker.stop() == 0

    answers = [result for result, _ in _answers_in_order(kafka_bootstrap, topics.output)]
    order = [result.ticket_id for result in answers]
    assert sorted(order) == sorted(["ready", *loose, "urgent"]) and not any(r.fallback for r in answers)
    # In arrival order it would be answered last, after 6 x 0.5 s; only a loose ticket already at the model
    # (taken by an earlier poll) may go first.
    assert order.index("urgent") <= 2, order


def test_a_ticket_that_cannot_make_its_deadline_is_answered_overloaded_at_once_not_by_the_model(
    kafka_bootstrap: str, unique_topic: Callable[..., str], slow_pool: ClassifierPool, start: Start
) -> None:
    topics = make_topics(unique_topic, partitions=1)
    worker = start(topics, slow_pool, dispatch_window=3, **{"pipeline.deadline_ms": "60000"})
    _publish_due(kafka_bootstrap, topics, [(f"warm-{i}", None) for i in range(8)])
    _wait_produced(worker, 8)  # 8 answers: the pool's latency is now known (0.5 s)
    _publish_due(kafka_bootstrap, topics, [("loose-0", None), ("loose-1", None)])
    deadline = time.monotonic() + 30
    while worker.pipeline.metrics.consumed < 10 and time.monotonic() < deadline:
        time.sleep(0.005)  # both at the model: one running, one queued in the pool; a slot is free
    sent = _publish_due(kafka_bootstrap, topics, [("hopeless", 0.35)])  # due before 0.5 s of model time
    wait_until_committed(kafka_bootstrap, worker.group, topics.input, timeout=60)
    assert worker.stop() == 0

    answers = _answers_in_order(kafka_bootstrap, topics.output)
    order = [result.ticket_id for result, _ in answers]
    hopeless, written_at = next((r, at) for r, at in answers if r.ticket_id == "hopeless")
    assert hopeless.fallback and hopeless.fallback_reason == "overloaded"
    # Answered before its deadline, ahead of the loose ticket still queued for the model: it never waited
    # for a context (the model, reached in time or not, answers only after 0.5 s, past the deadline).
    assert written_at < sent + 0.35
    assert order.index("hopeless") < order.index("loose-1"), order
    assert all(not r.fallback for r, _ in answers if r.ticket_id != "hopeless")
