"""The cascade in the loop, against the in-memory Kafka (see test_pipeline_memory.py): what each record says,
the gate's decisions, and the accounting when escalated tickets meet a revoke, in both guarantees.

Both stages here are classifiers that answer on the loop's next poll (or when a test releases them), so each
interleaving is exact; tests/pipeline/test_cascade_e2e.py runs the real models against a real broker.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence

import confluent_kafka
import msgspec
import pytest
from doubles import Running
from memory_kafka import MemoryKafka, Record, ScriptedShareConsumer, ShareMessage, share_clients
from test_pipeline_memory import (
    FALLBACK,
    INPUT,
    OUTPUT,
    assert_exactly_once,
    fill_texts,
    kafka,
    pipeline,
    wait_until,
)

from worker.app.doors import TriageParts, queue_pipeline
from worker.classification import Classification, ClassifyRequest, fallback_answer
from worker.kafka.share_groups import ShareGroup
from worker.messages import TriageResult
from worker.pipeline.engine import Engine
from worker.pipeline.triage.cascade import Cascade, StageLatency
from worker.settings import load_settings

__all__ = ["kafka"]  # the fixture, used by name

BOTH_GUARANTEES = pytest.mark.parametrize("guarantee", ["at_least_once", "exactly_once"])
LABELS = ("card_lost", "card_arrival")


def answer(intent: str, confidence: float, model: str, latency_ms: float) -> Classification:
    return Classification(
        intent=intent, priority="High", confidence=confidence, scores={intent: confidence}, model=model,
        latency_ms=latency_ms, truncated=False,
    )  # fmt: skip


class Stage:
    """A classifier that answers on its next poll: `card_lost` (0.3 if "unsure" is in the text, else 0.95)
    as the first stage; `card_arrival` (0.9) as the escalation stage, a `model_error` fallback for texts
    with "fail", a `deadline_exceeded` one after 800 ms of model time for texts with "late", and nothing for
    texts with "hold" until `release()`."""

    def __init__(self, model_id: str, escalation: bool = False) -> None:
        self.model_id = model_id
        self._escalation = escalation
        self._asked: list[ClassifyRequest] = []
        self.held: list[ClassifyRequest] = []
        self.holding = True
        self.submitted = 0
        self._lock = threading.Lock()

    def submit(self, request: ClassifyRequest) -> None:
        with self._lock:
            self.submitted += 1
            held = self._escalation and self.holding and "hold" in request.text
            (self.held if held else self._asked).append(request)

    def release(self) -> None:
        with self._lock:
            self.holding = False
            self._asked.extend(self.held)
            self.held.clear()

    def poll(self, timeout: float) -> Sequence[tuple[int, Classification]]:
        with self._lock:
            asked, self._asked = self._asked, []
        return [(request.request_id, self._answer(request.text)) for request in asked]

    def _answer(self, text: str) -> Classification:
        if not self._escalation:
            return answer("card_lost", 0.3 if "unsure" in text else 0.95, self.model_id, 2.0)
        if "fail" in text:
            return fallback_answer("model_error", FALLBACK, self.model_id, 1.0)
        if "late" in text:
            return fallback_answer("deadline_exceeded", FALLBACK, self.model_id, 800.0)
        return answer("card_arrival", 0.9, self.model_id, 5.0)


def cascade_pipeline(
    kafka: MemoryKafka,
    guarantee: str,
    stage: Stage,
    window: int = 8,
    prior_s: float = 0.0,
    settings: Mapping[str, object] | None = None,
) -> tuple[Engine, Cascade]:
    cascade = Cascade(stage, 0.5, window, prior_s, first_contexts=1, labels=LABELS)
    return pipeline(
        kafka, guarantee, classifier=Stage("first@test"), cascade=cascade, settings=settings
    ), cascade


def records(kafka: MemoryKafka) -> dict[tuple[int, int], TriageResult]:
    decoder = msgspec.json.Decoder(TriageResult)
    found = {}
    for _, record in kafka.read_committed(OUTPUT):
        assert record.value is not None
        result = decoder.decode(record.value)
        found[(result.source.partition, result.source.offset)] = result
    return found


@BOTH_GUARANTEES
def test_unsure_tickets_are_answered_by_the_escalation_stage_and_say_so(
    kafka: MemoryKafka, guarantee: str
) -> None:
    fill_texts(kafka, 0, ["where is my card", "unsure: card or transfer?"] * 5)
    stage = Stage("encoder@test", escalation=True)
    worker, _ = cascade_pipeline(kafka, guarantee, stage)
    running = Running(worker)
    wait_until(lambda: worker.metrics.produced == 10, "every record")
    assert running.stop() == 0
    assert_exactly_once(kafka, "memory-group")
    found = records(kafka)
    confident = [found[(0, offset)] for offset in range(0, 10, 2)]
    escalated = [found[(0, offset)] for offset in range(1, 10, 2)]
    assert {(r.stage, r.model, r.intent, r.first_intent, r.escalation_skipped) for r in confident} == {
        ("first", "first@test", "card_lost", None, None)
    }
    assert {
        (r.stage, r.model, r.intent, r.confidence, r.first_intent, r.first_confidence, r.latency_ms)
        for r in escalated
    } == {("escalation", "encoder@test", "card_arrival", 0.9, "card_lost", 0.3, 7.0)}
    assert stage.submitted == 5
    snapshot = worker.metrics.snapshot()["escalation"]
    assert snapshot["escalated"] == {"changed": 5, "confirmed": 0, "failed": 0}
    assert snapshot["skipped"] == {"deadline": 0, "overloaded": 0}


def test_a_record_without_a_cascade_has_none_of_the_cascade_fields(kafka: MemoryKafka) -> None:
    """The cascade's fields are optional and left out when unset: readers of the old contract see nothing
    new (and records of workers without a cascade do not grow)."""
    fill_texts(kafka, 0, ["unsure: card or transfer?"])
    worker = pipeline(kafka, "at_least_once", classifier=Stage("first@test"))
    running = Running(worker)
    wait_until(lambda: worker.metrics.produced == 1, "the record")
    assert running.stop() == 0
    (_, record), *_ = kafka.read_committed(OUTPUT)
    assert record.value is not None
    fields = msgspec.json.decode(record.value)
    assert not {"stage", "first_intent", "first_confidence", "escalation_skipped"} & set(fields)


def test_the_stage_s_bound_sheds_escalations_as_overloaded_and_each_ticket_still_gets_one_record(
    kafka: MemoryKafka,
) -> None:
    fill_texts(kafka, 0, ["unsure, hold"] * 6)
    stage = Stage("encoder@test", escalation=True)
    worker, cascade = cascade_pipeline(kafka, "at_least_once", stage, window=2)
    running = Running(worker)
    wait_until(lambda: worker.metrics.produced == 4, "the shed tickets' records")
    assert cascade.outstanding == 2 and len(stage.held) == 2
    stage.release()
    wait_until(lambda: worker.metrics.produced == 6, "the escalated tickets' records")
    assert running.stop() == 0
    found = records(kafka)
    assert (
        sorted((r.stage, r.escalation_skipped, r.intent) for r in found.values())
        == [("escalation", None, "card_arrival")] * 2 + [("first", "overloaded", "card_lost")] * 4
    )
    assert worker.metrics.snapshot()["escalation"]["skipped"] == {"deadline": 0, "overloaded": 4}


def test_no_ticket_is_escalated_when_its_time_left_is_under_the_stage_s_p95(kafka: MemoryKafka) -> None:
    """The stage's warm-up turnaround (5 s) is more than the ticket's deadline (2 s): nothing waits for it."""
    fill_texts(kafka, 0, ["unsure: card or transfer?"] * 3)
    stage = Stage("encoder@test", escalation=True)
    worker, _ = cascade_pipeline(kafka, "at_least_once", stage, prior_s=5.0)
    running = Running(worker)
    wait_until(lambda: worker.metrics.produced == 3, "every record")
    assert running.stop() == 0
    assert stage.submitted == 0
    assert {(r.stage, r.escalation_skipped) for r in records(kafka).values()} == {("first", "deadline")}


def test_a_failed_escalation_leaves_the_first_answer_standing(kafka: MemoryKafka) -> None:
    fill_texts(kafka, 0, ["unsure and fail"])
    stage = Stage("encoder@test", escalation=True)
    worker, _ = cascade_pipeline(kafka, "at_least_once", stage)
    running = Running(worker)
    wait_until(lambda: worker.metrics.produced == 1, "the record")
    assert running.stop() == 0
    (result,) = records(kafka).values()
    assert (result.stage, result.model, result.intent, result.fallback) == (
        "first",
        "first@test",
        "card_lost",
        False,
    )
    assert result.escalation_skipped == "error"
    assert worker.metrics.snapshot()["escalation"]["escalated"]["failed"] == 1


def test_a_stage_that_ran_out_of_time_leaves_the_first_answer_with_the_stage_s_time_in_its_latency(
    kafka: MemoryKafka,
) -> None:
    """The first answer stands (its model, `escalation_skipped = "deadline"`), and its `latency_ms` says
    what the ticket spent: the first stage's 2 ms and the 800 ms the stage tried for."""
    fill_texts(kafka, 0, ["unsure and late"])
    worker, _ = cascade_pipeline(kafka, "at_least_once", Stage("llm@test", escalation=True))
    running = Running(worker)
    wait_until(lambda: worker.metrics.produced == 1, "the record")
    assert running.stop() == 0
    (result,) = records(kafka).values()
    assert (result.stage, result.model, result.intent, result.escalation_skipped) == (
        "first",
        "first@test",
        "card_lost",
        "deadline",
    )
    assert result.latency_ms == 802.0


@BOTH_GUARANTEES
def test_a_revoke_waits_for_the_partition_s_escalated_tickets_then_commits_them(
    kafka: MemoryKafka, guarantee: str
) -> None:
    fill_texts(kafka, 0, ["where is my card"] * 4)
    fill_texts(kafka, 1, ["where is my card"] * 3 + ["unsure, hold"] * 3)
    stage = Stage("encoder@test", escalation=True)
    worker, _ = cascade_pipeline(kafka, guarantee, stage)
    running = Running(worker)
    wait_until(lambda: len(stage.held) == 3, "the escalated tickets at the stage")
    consumer = kafka.members[0]
    kafka.revoke(consumer, [(INPUT, 1)])
    threading.Timer(0.3, stage.release).start()  # answers arrive while the revoke waits
    wait_until(lambda: (INPUT, 1) not in consumer.assigned, "the revoke")
    assert kafka.committed["memory-group"].get((INPUT, 1)) == 6  # the new owner starts after them
    assert running.stop() == 0
    assert_exactly_once(kafka, "memory-group")
    assert worker.metrics.discarded_after_revoke == 0
    assert {r.stage for r in records(kafka).values() if r.source.partition == 1} == {"first", "escalation"}


@BOTH_GUARANTEES
def test_escalation_answers_after_the_revoke_timeout_are_discarded_not_written(
    kafka: MemoryKafka, guarantee: str
) -> None:
    fill_texts(kafka, 1, ["where is my card"] * 2 + ["unsure, hold"] + ["where is my card"] * 2)
    stage = Stage("encoder@test", escalation=True)
    worker, _ = cascade_pipeline(kafka, guarantee, stage, settings={"pipeline.revoke_timeout_ms": 200})
    running = Running(worker)
    wait_until(lambda: len(stage.held) == 1 and worker.metrics.consumed == 5, "the held ticket")
    consumer = kafka.members[0]
    kafka.revoke(consumer, [(INPUT, 1)])
    wait_until(lambda: (INPUT, 1) not in consumer.assigned, "the revoke")
    assert kafka.committed["memory-group"].get((INPUT, 1)) == 2
    stage.release()
    wait_until(lambda: worker.metrics.discarded_after_revoke == 1, "the late answer")
    assert running.stop() == 0
    assert (1, 2) not in records(kafka)  # the new owner writes it


# -- the p95 the gate reads ------------------------------------------------------------------------------


def test_stage_latency_is_the_prior_until_enough_samples_then_their_p95() -> None:
    latency = StageLatency(prior_s=0.5, min_samples=8)
    for index in range(7):
        latency.observe(float(index), 0.01)
    assert latency.p95(7.0) == 0.5
    latency.observe(7.0, 0.01)
    assert latency.p95(7.0) == 0.01
    for index in range(12):
        latency.observe(8.0 + index, 0.01 * (index + 1))
    # 20 samples: eight of 0.01, then 0.01 .. 0.12: the p95 is the 19th smallest.
    assert latency.p95(20.0) == pytest.approx(0.11)


def test_stage_latency_forgets_slow_samples_so_a_stage_that_was_slow_once_is_tried_again() -> None:
    """Skipped tickets give no samples: without ageing, one slow spell would stop every escalation."""
    latency = StageLatency(prior_s=0.02, max_age_s=30.0, min_samples=8)
    for index in range(10):
        latency.observe(float(index), 5.0)
    assert latency.p95(10.0) == 5.0
    assert latency.p95(45.0) == 0.02  # all aged out: the warm-up figure again


def test_the_gate_prefers_deadline_then_overload() -> None:
    cascade = Cascade(Stage("s", escalation=True), 0.5, window=1, prior_latency_s=0.1, first_contexts=2)
    clock: Callable[[], float] = time.monotonic
    assert cascade.gate(0.05, clock(), first_stage_pressed=False) == "deadline"
    assert cascade.gate(0.0, clock(), first_stage_pressed=True) == "deadline"
    assert cascade.gate(1.0, clock(), first_stage_pressed=True) == "overloaded"
    assert cascade.gate(1.0, clock(), first_stage_pressed=False) is None
    cascade.submit(ClassifyRequest(1, "x", clock() + 1.0), clock())
    assert cascade.gate(1.0, clock(), first_stage_pressed=False) == "overloaded"  # at its bound of 1
    assert cascade.unsure(answer("a", 0.49, "m", 1.0)) and not cascade.unsure(answer("a", 0.5, "m", 1.0))
    assert not cascade.unsure(fallback_answer("model_error", FALLBACK, "m", 1.0))


def test_a_last_delivery_at_the_escalation_stage_keeps_its_first_answer_when_the_shutdown_cannot_wait() -> (
    None
):
    """Queue mode (issue #55): a ticket on its last delivery that is at the escalation stage when the
    shutdown's time for an answer runs out is written with its first answer (`escalation_skipped:
    deadline`) rather than released, which would have the broker archive it without a trace."""
    memory = MemoryKafka()
    for topic in (INPUT, OUTPUT, "tickets.dlq"):
        memory.create_topic(topic, 1)
    value = msgspec.json.encode({"ticket_id": "T-0", "body": "unsure hold: card or transfer?"})
    record = Record(0, b"customer-0", value, [])
    memory.logs[INPUT][0].append(record)
    consumer = ScriptedShareConsumer([[ShareMessage(INPUT, 0, record, 5)]])
    stage = Stage("encoder@test", escalation=True)
    cascade = Cascade(stage, 0.5, 8, 0.0, first_contexts=1, labels=LABELS)
    settings = load_settings(
        env={},
        overrides={
            "kafka.bootstrap.servers": "memory:9092", "kafka.delivery.timeout.ms": "5000",
            "pipeline.consume": "queue", "pipeline.deadline_ms": "2000",
            "pipeline.shutdown_timeout_ms": "300",
            "topics.input": INPUT, "topics.output": OUTPUT, "topics.dead_letter": "tickets.dlq",
        },
    )  # fmt: skip
    worker = queue_pipeline(
        settings, TriageParts(Stage("first@test"), FALLBACK, 4, cascade=cascade),
        ShareGroup(lock_ms=15000, delivery_count_limit=5), clients=share_clients(memory, consumer),
    )  # fmt: skip
    running = Running(worker)
    wait_until(lambda: len(stage.held) == 1, "the ticket at the escalation stage")
    assert running.stop() == 0
    (written,) = [msgspec.json.decode(r.value or b"", type=TriageResult) for r in memory.logs[OUTPUT][0]]
    assert (written.stage, written.intent, written.confidence, written.escalation_skipped) == (
        "first",
        "card_lost",
        0.3,
        "deadline",
    )
    assert consumer.outcomes == {0: confluent_kafka.AcknowledgeType.ACCEPT}
