"""Queue mode's loop against an in-memory share consumer, beyond the failure catalogue
(test_failure_catalogue.py, which settles each record of a batch through every failure): which records go to
the model first, what the lock's budget leaves untried, the registry's probes; and that every record of a
batch is acknowledged before the next poll (the share consumer raises otherwise).

Most tests script the batches (`ScriptedShareConsumer`: a delivery count is whatever the test says); the
last two run against the in-memory share group (`MemoryShareGroup`, held to a real one by
tests/kafka/test_share_contract.py), where what a release costs and who gets the record next is the
group's doing."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence

import confluent_kafka
import msgspec
from doubles import DyingClassifier, FlakyRegistry, HoldingClassifier, InstantClassifier
from memory_kafka import (
    MemoryKafka,
    MemoryShareGroup,
    Message,
    Record,
    ScriptedShareConsumer,
    ShareMessage,
    share_clients,
)

from worker.app.doors import TriageParts, queue_pipeline
from worker.classification import ClassifyRequest, FallbackLabel
from worker.dev.samples import SampleFactory
from worker.kafka.share_groups import ShareGroup
from worker.messages import TriageResult
from worker.pipeline.engine import Engine
from worker.settings import Settings, load_settings

FALLBACK = FallbackLabel("unclassified", "Medium")
ACCEPT, RELEASE = confluent_kafka.AcknowledgeType.ACCEPT, confluent_kafka.AcknowledgeType.RELEASE
REJECT = confluent_kafka.AcknowledgeType.REJECT
# A 15 s lock (the broker's minimum) with a 2 s deadline and 5 s delivery timeout: a record may be taken
# until 7 s into the lock, and what is unsettled is released at 14 s.
LOCK = ShareGroup(lock_ms=15000, delivery_count_limit=5)


def _settings(**overrides: object) -> Settings:
    given = {
        "kafka.bootstrap.servers": "memory:9092",
        "kafka.delivery.timeout.ms": "5000",
        "pipeline.consume": "queue",
        "pipeline.deadline_ms": "2000",
    }
    return load_settings(env={}, overrides={**given, **overrides})


def _batch(kafka: MemoryKafka, subjects: list[str], deliveries: Sequence[int] = ()) -> list[Message]:
    """A batch of tickets whose bodies start with `subjects` (what the classifier doubles look for), each on
    its `deliveries[i]`-th delivery (default: its first)."""
    factory = SampleFactory(seed=1)
    batch: list[Message] = []
    first = len(kafka.logs["tickets.raw"][0])
    for index, subject in enumerate(subjects):
        sample = factory.make(first + index)
        ticket = json.loads(sample.value or b"{}")
        ticket["body"] = f"{subject}: {ticket['body']}"
        record = Record(first + index, sample.key, json.dumps(ticket).encode(), [])
        kafka.logs["tickets.raw"][0].append(record)
        count = deliveries[index] if index < len(deliveries) else 1
        batch.append(ShareMessage("tickets.raw", 0, record, count))
    return batch


def _kafka() -> MemoryKafka:
    kafka = MemoryKafka()
    for topic in ("tickets.raw", "tickets.triaged", "tickets.dlq"):
        kafka.create_topic(topic, 1)
    return kafka


def _run(pipeline: Engine) -> tuple[threading.Thread, list[int]]:
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(pipeline.run()), daemon=True)
    thread.start()
    return thread, codes


def _wait(condition: Callable[[], bool], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_what_cannot_finish_inside_the_lock_is_released_and_the_next_poll_comes_after() -> None:
    """Records a full in-flight bound left in the backlog are released once too late to take (7 s into the
    lock here); tickets still at the model are released 1 s before the lock ends, not left to expire."""
    kafka = _kafka()
    consumer = ScriptedShareConsumer([_batch(kafka, ["hold", "hold", "ok"])])
    now = [1000.0]
    classifier = HoldingClassifier()
    pipeline = queue_pipeline(
        _settings(**{"pipeline.max_in_flight": "2"}), TriageParts(classifier, FALLBACK, 4), LOCK,
        clients=share_clients(kafka, consumer), clock=lambda: now[0],
    )  # fmt: skip
    thread, codes = _run(pipeline)
    _wait(lambda: len(classifier.held) == 2)  # the bound: the third record waits in the backlog
    now[0] += 7.5
    _wait(lambda: consumer.outcomes == {2: RELEASE})
    now[0] += 6.6
    _wait(lambda: len(consumer.outcomes) == 3)
    _wait(lambda: consumer.polls_after_all > 0)  # the next poll did not raise: everything acknowledged
    pipeline.request_stop()
    thread.join(20)
    assert codes == [0]
    assert consumer.outcomes == {0: RELEASE, 1: RELEASE, 2: RELEASE}
    classifier.release()  # a late answer for a released ticket writes nothing
    assert kafka.logs["tickets.triaged"][0] == []


def test_a_record_on_its_last_delivery_is_tried_first_and_its_model_death_dead_letters_it() -> None:
    """On its last delivery a record is never released (the broker would archive it without a trace): it is
    taken before the others, and when the model process dies under it, it is dead-lettered with why; the same
    death on an earlier delivery releases it for another try."""
    kafka = _kafka()
    subjects = ["first ok", "first die", "last die", "last ok"]
    consumer = ScriptedShareConsumer([_batch(kafka, subjects, deliveries=[1, 1, 5, 5])])
    order = _OrderRecordingClassifier()
    pipeline = queue_pipeline(
        _settings(), TriageParts(order, FALLBACK, 1), LOCK, clients=share_clients(kafka, consumer)
    )
    thread, codes = _run(pipeline)
    _wait(lambda: len(consumer.outcomes) == 4)
    pipeline.request_stop()
    thread.join(20)
    assert codes == [0]
    assert order.last[:2] == [True, True] and order.last[2:] == [False, False]  # last deliveries first
    assert consumer.outcomes == {0: ACCEPT, 1: RELEASE, 2: REJECT, 3: ACCEPT}
    (letter,) = kafka.logs["tickets.dlq"][0]
    headers = dict(letter.headers or [])
    assert headers["triage.error.type"] == b"delivery_count_exceeded"
    assert b"the model process died under it on its last delivery" in (headers["triage.error.message"] or b"")


def _backlog_behind_a_full_bound() -> tuple[
    MemoryKafka, ScriptedShareConsumer, list[float], HoldingClassifier, Engine
]:
    """A batch of three on an in-flight bound of one: the first (on its last delivery, 5) held at the model,
    the second (last delivery too) and the third (first delivery) waiting in the backlog; the clock is
    the returned list's one value, moved by the test."""
    kafka = _kafka()
    consumer = ScriptedShareConsumer([_batch(kafka, ["hold", "ok", "ok"], deliveries=[5, 5, 1])])
    now = [1000.0]
    classifier = HoldingClassifier()
    pipeline = queue_pipeline(
        _settings(**{"pipeline.max_in_flight": "1"}), TriageParts(classifier, FALLBACK, 4), LOCK,
        clients=share_clients(kafka, consumer), clock=lambda: now[0],
    )  # fmt: skip
    return kafka, consumer, now, classifier, pipeline


def test_a_last_delivery_the_lock_leaves_no_model_time_for_is_answered_overloaded_not_released() -> None:
    """Once the lock allows no more model time, records on their last delivery are answered at once with the
    `overloaded` fallback (as group mode answers a ticket that waited past its deadline); the others are
    released untried."""
    kafka, consumer, now, classifier, pipeline = _backlog_behind_a_full_bound()
    thread, codes = _run(pipeline)
    _wait(lambda: len(classifier.held) == 1)  # the bound: the other two wait in the backlog
    now[0] += 7.5  # past the last instant a record may still go to the model (7 s into the 15 s lock)
    classifier.release()
    _wait(lambda: len(consumer.outcomes) == 3)
    pipeline.request_stop()
    thread.join(20)
    assert codes == [0]
    assert consumer.outcomes == {0: ACCEPT, 1: ACCEPT, 2: RELEASE}
    answered = [
        msgspec.json.decode(r.value or b"", type=TriageResult) for r in kafka.logs["tickets.triaged"][0]
    ]
    assert [(r.source.offset, r.fallback_reason) for r in answered] == [(0, None), (1, "overloaded")]
    assert pipeline.metrics.queue is not None and pipeline.metrics.queue.released_untried == 1


def test_a_registry_that_cannot_answer_holds_the_batch_and_probes_it_instead_of_releasing_it() -> None:
    """Issue #43 item 3: a Schema Registry outage must not spend deliveries. The records stay in the batch,
    the registry is probed with one of them on a backoff, readiness hears of it, no new batch is polled; once
    it answers, every record is triaged on its first delivery."""
    kafka = _kafka()
    consumer = ScriptedShareConsumer([_batch(kafka, ["ok", "ok", "ok"]), _batch(kafka, [])])
    decoder = FlakyRegistry()
    now = [1000.0]
    pipeline = queue_pipeline(
        _settings(), TriageParts(InstantClassifier(), FALLBACK, 4, decoder=decoder),
        ShareGroup(lock_ms=30000, delivery_count_limit=5), clients=share_clients(kafka, consumer),
        clock=lambda: now[0],
    )  # fmt: skip
    thread, codes = _run(pipeline)
    state = pipeline.metrics.registry
    assert state is not None
    _wait(lambda: state.outage is not None)
    for delay in (1.0, 2.0, 4.0):  # the probes' backoff: each fails, well within the 30 s lock
        tried = decoder.tries
        now[0] += delay
        _wait(lambda tried=tried: decoder.tries > tried)  # type: ignore[misc]
    assert consumer.outcomes == {} and len(consumer.batches) == 1  # nothing released, no new poll
    decoder.answering = True
    now[0] += 8.0
    _wait(lambda: len(consumer.outcomes) == 3)
    pipeline.request_stop()
    thread.join(20)
    assert codes == [0]
    assert consumer.outcomes == {0: ACCEPT, 1: ACCEPT, 2: ACCEPT}
    assert state.outage is None and state.retries_by_cause["outage"] >= 4


class _OrderRecordingClassifier(DyingClassifier):
    """`DyingClassifier`, noting for each ticket, in the order sent, whether its text says "last"."""

    def __init__(self) -> None:
        super().__init__()
        self.last: list[bool] = []

    def submit(self, request: ClassifyRequest) -> None:
        self.last.append("last" in request.text)
        super().submit(request)


def test_a_ticket_whose_model_process_always_dies_is_retried_on_each_delivery_then_dead_lettered() -> None:
    """Against the in-memory share group (held to a real one by tests/kafka/test_share_contract.py): a
    released record comes back with its delivery count raised, so a poison ticket is tried once per delivery
    and, on the group's last, dead-lettered with why instead of archived by the group without a trace; the
    tickets beside it are triaged once."""
    kafka = _kafka()
    _batch(kafka, ["ok", "die", "ok"])
    group = MemoryShareGroup(kafka, "triage", lock_ms=15000, delivery_count_limit=5)
    pipeline = queue_pipeline(
        _settings(), TriageParts(DyingClassifier(), FALLBACK, 4), LOCK, clients=group.clients()
    )
    thread, codes = _run(pipeline)
    poison = group.delivery("tickets.raw", 0, 1)
    _wait(lambda: poison.state == "archived")  # rejected (or, released on its last delivery, dropped)
    pipeline.request_stop()
    thread.join(20)
    assert codes == [0]
    assert poison.count == 5
    assert [group.delivery("tickets.raw", 0, n).state for n in (0, 2)] == ["acknowledged", "acknowledged"]
    assert len(kafka.logs["tickets.triaged"][0]) == 2
    (letter,) = kafka.logs["tickets.dlq"][0]
    assert dict(letter.headers or [])["triage.error.type"] == b"delivery_count_exceeded"
    assert pipeline.metrics.queue is not None
    assert (pipeline.metrics.queue.released, pipeline.metrics.queue.rejected) == (4, 1)


def test_a_stopping_worker_hands_its_unfinished_tickets_to_the_next_each_triaged_once() -> None:
    """Against the in-memory share group: what a worker could not finish before its shutdown time goes back
    to the group (released, its delivery spent) and the next worker of the group triages it; every ticket
    ends with exactly one triage record."""
    kafka = _kafka()
    _batch(kafka, ["ok", "hold", "hold"])
    group = MemoryShareGroup(kafka, "triage", lock_ms=15000, delivery_count_limit=5)
    settled = [group.delivery("tickets.raw", 0, n) for n in range(3)]
    holding = HoldingClassifier()
    first = queue_pipeline(
        _settings(**{"pipeline.shutdown_timeout_ms": "300"}), TriageParts(holding, FALLBACK, 4), LOCK,
        clients=group.clients(),
    )  # fmt: skip
    thread, codes = _run(first)
    _wait(lambda: len(kafka.logs["tickets.triaged"][0]) == 1 and len(holding.held) == 2)
    first.request_stop()
    thread.join(20)
    assert [(d.state, d.count) for d in settled] == [("acknowledged", 1), ("available", 1), ("available", 1)]

    second = queue_pipeline(
        _settings(), TriageParts(InstantClassifier(), FALLBACK, 4), LOCK, clients=group.clients()
    )
    thread, more_codes = _run(second)
    _wait(lambda: all(d.state == "acknowledged" for d in settled))
    second.request_stop()
    thread.join(20)
    assert codes == more_codes == [0]
    assert [d.count for d in settled] == [1, 2, 2]
    answered = [
        msgspec.json.decode(r.value or b"", type=TriageResult) for r in kafka.logs["tickets.triaged"][0]
    ]
    assert sorted(r.source.offset for r in answered) == [0, 1, 2]


def _crashed_member(group: MemoryShareGroup) -> None:
    """A member takes every available record and dies (kill -9): the broker sees its connection close and
    makes its records available again, each with one delivery spent."""
    member = group.clients().share_consumer(lambda error: None, 1000)
    member.subscribe(["tickets.raw"])
    assert member.poll(0)
    member.close()


def test_a_rolling_restart_on_the_last_delivery_answers_every_ticket_instead_of_releasing_it() -> None:
    """Issue #55, as reported: delivery limit 2; a worker holding a batch is killed (its records come back
    with one delivery spent); the replacement takes the batch, its last delivery, and is stopped (SIGTERM)
    with two tickets at the model and four in its backlog. Released, the broker would archive all six
    without a trace: each is answered instead (`overloaded`: the shutdown left it no model time)."""
    kafka = _kafka()
    _batch(kafka, ["hold"] * 6)
    group = MemoryShareGroup(kafka, "triage", lock_ms=15000, delivery_count_limit=2)
    _crashed_member(group)
    deliveries = [group.delivery("tickets.raw", 0, n) for n in range(6)]
    assert [(d.state, d.count) for d in deliveries] == [("available", 1)] * 6
    holding = HoldingClassifier()
    settings = _settings(**{
        "pipeline.max_in_flight": "2", "pipeline.shutdown_timeout_ms": "400", "kafka.max.poll.records": "100",
    })  # fmt: skip
    pipeline = queue_pipeline(
        settings, TriageParts(holding, FALLBACK, 4), ShareGroup(lock_ms=15000, delivery_count_limit=2),
        clients=group.clients(),
    )  # fmt: skip
    thread, codes = _run(pipeline)
    _wait(lambda: len(holding.held) == 2)  # the bound: four wait in the backlog
    pipeline.request_stop()
    thread.join(20)
    assert codes == [0]
    assert [(d.state, d.count) for d in deliveries] == [("acknowledged", 2)] * 6
    answered = [
        msgspec.json.decode(r.value or b"", type=TriageResult) for r in kafka.logs["tickets.triaged"][0]
    ]
    assert sorted((r.source.offset, r.fallback_reason) for r in answered) == [
        (n, "overloaded") for n in range(6)
    ]
    assert kafka.logs["tickets.dlq"][0] == []


def test_a_last_delivery_the_loop_reaches_past_its_answer_window_is_answered_late_not_released() -> None:
    """Issue #55: a record on its last delivery left in the backlog by a full in-flight bound, which the loop
    reaches only once the window to deliver an answer inside the lock has closed (9 s into the 15 s lock
    here: a slow turn), is answered (`overloaded`, it needs no model time) rather than released: the broker
    archives it at its lock's end whatever becomes of it, so a late answer can only add its outcome. The
    others are released at the lock's end as before."""
    kafka, consumer, now, classifier, pipeline = _backlog_behind_a_full_bound()
    thread, codes = _run(pipeline)
    _wait(lambda: len(classifier.held) == 1)  # the bound is full: the other two wait in the backlog
    now[0] += 9.5
    _wait(lambda: consumer.outcomes.get(1) == ACCEPT)
    now[0] += 4.6  # the lock's end: the rest is released
    _wait(lambda: len(consumer.outcomes) == 3)
    pipeline.request_stop()
    thread.join(20)
    assert codes == [0]
    assert consumer.outcomes == {0: ACCEPT, 1: ACCEPT, 2: RELEASE}
    answered = [
        msgspec.json.decode(r.value or b"", type=TriageResult) for r in kafka.logs["tickets.triaged"][0]
    ]
    assert sorted((r.source.offset, r.fallback_reason) for r in answered) == [
        (0, "overloaded"),
        (1, "overloaded"),
    ]


def test_a_last_delivery_held_for_the_registry_is_dead_lettered_before_its_lock_closes() -> None:
    """Issue #55: records held back for a Schema Registry that does not answer go back to the group at the
    lock's end, except the one on its last delivery: it gets its dead letter (with why) once the lock allows
    no more model time, instead of being archived by the broker without a trace."""
    kafka = _kafka()
    consumer = ScriptedShareConsumer([_batch(kafka, ["ok", "ok"], deliveries=[5, 1])])
    now = [1000.0]
    pipeline = queue_pipeline(
        _settings(), TriageParts(InstantClassifier(), FALLBACK, 4, decoder=FlakyRegistry()), LOCK,
        clients=share_clients(kafka, consumer), clock=lambda: now[0],
    )  # fmt: skip
    thread, codes = _run(pipeline)
    state = pipeline.metrics.registry
    assert state is not None
    _wait(lambda: state.outage is not None)
    now[0] += 7.5
    _wait(lambda: consumer.outcomes.get(0) == REJECT)
    now[0] += 6.6
    _wait(lambda: len(consumer.outcomes) == 2)
    pipeline.request_stop()
    thread.join(20)
    assert codes == [0]
    assert consumer.outcomes == {0: REJECT, 1: RELEASE}
    (letter,) = kafka.logs["tickets.dlq"][0]
    headers = dict(letter.headers or [])
    assert headers["triage.error.type"] == b"delivery_count_exceeded"
    assert b"Schema Registry" in (headers["triage.error.message"] or b"")
    assert kafka.logs["tickets.triaged"][0] == []


def test_acknowledgements_are_sent_while_the_batch_is_still_at_work() -> None:
    """A batch's acknowledgements reach the group within about half a second, not only once the whole batch
    is settled: a worker killed (kill -9) mid-batch then has every ticket it finished more than that ago
    acknowledged, and another worker writes again only the rest. Before, a kill -9 of a worker holding a
    1,500-record batch wrote 76 tickets twice on the real broker (more than `max_in_flight`, 32)."""
    kafka = _kafka()
    _batch(kafka, ["ok", "ok", "hold", "hold"])
    group = MemoryShareGroup(kafka, "triage", lock_ms=15000, delivery_count_limit=5)
    holding = HoldingClassifier()
    pipeline = queue_pipeline(
        _settings(**{"kafka.max.poll.records": "10"}), TriageParts(holding, FALLBACK, 4), LOCK,
        clients=group.clients(),
    )  # fmt: skip
    thread, codes = _run(pipeline)
    deliveries = [group.delivery("tickets.raw", 0, n) for n in range(4)]
    _wait(lambda: len(kafka.logs["tickets.triaged"][0]) == 2 and len(holding.held) == 2)
    _wait(lambda: [d.state for d in deliveries] == ["acknowledged"] * 2 + ["acquired"] * 2, timeout_s=3.0)
    holding.release()
    pipeline.request_stop()
    thread.join(20)
    assert codes == [0]
    assert [d.state for d in deliveries] == ["acknowledged"] * 4
