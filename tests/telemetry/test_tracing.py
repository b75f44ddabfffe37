"""Per-ticket traces (issue #47) over the in-memory Kafka: the span tree each ticket gets, right when tickets
finish out of order, with no ticket text or personal data in it; and tracing off imports nothing.

The doors are assembled as the app does (`doors.group_pipeline`, `doors.queue_pipeline`,
`offline.lines_pipeline`) with the SDK's `InMemorySpanExporter` behind the worker's own `OtelTracing`.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, cast

import confluent_kafka
import msgspec
import pytest
from doubles import HealthyBroker, HoldingClassifier, InstantClassifier, Running, instant_answer
from memory_kafka import (
    MemoryKafka,
    Message,
    Record,
    ReplayConsumer,
    ScriptedShareConsumer,
    ShareMessage,
    as_client_factory,
    share_clients,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families as text_families
from prometheus_client.samples import Exemplar

from worker.app import replay as replay_door
from worker.app.doors import TriageParts, group_pipeline, queue_pipeline
from worker.app.offline import Offline, classify_texts
from worker.classification import Classification, Classifier, ClassifyRequest, FallbackLabel, fallback_answer
from worker.errors import UserError
from worker.kafka import dead_letters
from worker.kafka.share_groups import ShareGroup
from worker.pipeline.failure import Failure
from worker.pipeline.metrics import PipelineMetrics
from worker.pipeline.tracing import NO_TRACING, Tracing
from worker.pipeline.triage.cascade import Cascade
from worker.replay.outcomes import ReplaySummary
from worker.replay.selection import ReplayOptions
from worker.settings import MetricsSettings, Settings, TracingSettings, load_settings
from worker.telemetry.collectors import PipelineCollector
from worker.telemetry.probes import WorkerProbes
from worker.telemetry.server import TelemetryServer, new_registry
from worker.telemetry.spans import OtelTracing
from worker.telemetry.tracing import tracing_for

# The default topics (`topics.*`).
INPUT, OUTPUT, DEAD = "tickets.raw", "tickets.triaged", "tickets.dlq"
GROUP = "tracing"
FALLBACK = FallbackLabel("unclassified", "Medium")
# A producer's span context (W3C): trace 4bf9..., span 00f0...
PRODUCER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PRODUCER_SPAN = "00f067aa0ba902b7"
TRACEPARENT = f"00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-01".encode()
STEPS = ["decode", "dispatch queue", "classify instant@test", f"send {OUTPUT}", "settle"]


def _settings(overrides: Mapping[str, object] | None = None) -> Settings:
    return load_settings(
        env={},
        overrides={
            "kafka.bootstrap.servers": "memory:9092",
            "pipeline.group_id": GROUP,
            "pipeline.commit_interval_ms": 20,
            **(overrides or {}),
        },
    )


class Traced:
    """Group mode over the in-memory Kafka with spans exported to memory as they end."""

    def __init__(self, partitions: int = 1) -> None:
        self.kafka = MemoryKafka()
        self.kafka.create_topic(INPUT, partitions)
        self.kafka.create_topic(OUTPUT, 1)
        self.kafka.create_topic(DEAD, 1)
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.tracing: Tracing = OtelTracing(provider, GROUP)
        self.positions: list[tuple[int, int]] = []

    def add(
        self,
        body: bytes,
        key: bytes | None = None,
        headers: list[tuple[str, bytes | None]] | None = None,
        partition: int = 0,
    ) -> None:
        self.positions.append((partition, self.kafka.append(INPUT, partition, body, key, headers)))

    def start(
        self,
        classifier: Classifier,
        *,
        cascade: Cascade | None = None,
        settings: Settings | None = None,
        transactional_id: str | None = None,
    ) -> Running:
        parts = TriageParts(classifier, FALLBACK, 64, cascade=cascade, tracing=self.tracing)
        clients = as_client_factory(self.kafka.clients(GROUP, transactional_id))
        return Running(group_pipeline(settings or _settings(), parts, clients=clients))

    def committed(self) -> bool:
        """Every input committed past."""
        positions = self.kafka.committed[GROUP]
        return all(offset < positions.get((INPUT, part), 0) for part, offset in self.positions)

    def run(self, classifier: Classifier, **options: Any) -> None:
        """Runs the door until every input is committed past, then stops it (which flushes the spans)."""
        running = self.start(classifier, **options)
        wait_until(self.committed, "inputs committed")
        assert running.stop() == 0

    def spans(self) -> list[ReadableSpan]:
        return list(self.exporter.get_finished_spans())

    def processes(self) -> list[ReadableSpan]:
        return sorted(
            (span for span in self.spans() if span.kind is SpanKind.CONSUMER),
            key=lambda span: int(span.attributes["messaging.kafka.offset"]),  # type: ignore[arg-type,index]
        )

    def children(self, process: ReadableSpan) -> list[ReadableSpan]:
        """The spans under `process`, in the order they started."""
        own = process.context.span_id
        found = [span for span in self.spans() if span.parent is not None and span.parent.span_id == own]
        return sorted(found, key=lambda span: span.start_time or 0)

    def output_headers(self, topic: str) -> list[dict[str, bytes | None]]:
        return [dict(record.headers or []) for _, record in self.kafka.read_committed(topic)]


def wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 15.0
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def ticket(ticket_id: str, body: str = "where is my card", subject: str = "") -> bytes:
    return msgspec.json.encode({"ticket_id": ticket_id, "subject": subject, "body": body})


def traceparent_of(span: ReadableSpan) -> bytes:
    context = span.context
    assert context is not None
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}".encode()


def test_a_classified_ticket_is_one_trace_from_the_producer_s_span_to_the_triage_record() -> None:
    traced = Traced()
    traced.add(ticket("T-1"), b"customer-1", [("traceparent", TRACEPARENT), ("kind", b"x")])
    traced.run(InstantClassifier())

    [process] = traced.processes()
    assert process.name == f"process {INPUT}"
    assert process.parent is not None and f"{process.parent.span_id:016x}" == PRODUCER_SPAN
    assert f"{process.context.trace_id:032x}" == PRODUCER_TRACE
    assert dict(process.attributes or {}) == {
        "messaging.system": "kafka",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": INPUT,
        "messaging.destination.partition.id": "0",
        "messaging.kafka.offset": 0,
        "messaging.consumer.group.name": GROUP,
    }  # never the key, not even one without personal data in it
    assert process.status.status_code is StatusCode.UNSET
    children = traced.children(process)
    assert [span.name for span in children] == STEPS
    model = children[2]
    assert model.attributes is not None
    assert model.attributes["gen_ai.operation.name"] == "classify"
    assert model.attributes["gen_ai.request.model"] == "instant@test"
    assert model.attributes["gen_ai.provider.name"] == "onnxruntime"
    assert model.attributes["triage.stage"] == "first"
    assert model.attributes["triage.confidence_bucket"] == "0.9-1.0"
    assert model.attributes["triage.escalated"] is False
    assert children[3].kind is SpanKind.PRODUCER
    assert (children[4].attributes or {})["triage.settled_by"] == "commit"
    # Each step ends before the next begins, and all within the process span.
    for before, after in itertools.pairwise(children):
        assert before.end_time is not None and after.start_time is not None
        assert before.end_time <= after.start_time
    assert process.end_time is not None and children[-1].end_time is not None
    assert children[-1].end_time <= process.end_time
    # The triage record continues the trace from the worker's span; other headers are carried as before.
    [headers] = traced.output_headers(OUTPUT)
    assert headers["traceparent"] == traceparent_of(process)
    assert headers["kind"] == b"x"


class _FallbackClassifier(InstantClassifier):
    """Answers every ticket with an `invalid_output` fallback (the model said nothing usable)."""

    def poll(self, timeout: float) -> Sequence[tuple[int, Classification]]:
        answers = super().poll(timeout)
        return [(rid, fallback_answer("invalid_output", FALLBACK, self.model_id, 1.0)) for rid, _ in answers]


def test_a_fallback_marks_the_ticket_s_span_with_its_reason() -> None:
    traced = Traced()
    traced.add(ticket("T-1"))
    traced.run(_FallbackClassifier())

    [process] = traced.processes()
    assert process.status.status_code is StatusCode.ERROR
    assert process.status.description == "fallback: invalid_output"
    assert [(event.name, dict(event.attributes or {})) for event in process.events] == [
        ("triage.fallback", {"triage.reason": "invalid_output"})
    ]
    model = traced.children(process)[2]
    assert (model.attributes or {})["triage.fallback"] == "invalid_output"
    assert "triage.confidence_bucket" not in (model.attributes or {})


def test_a_ticket_whose_deadline_passed_says_so() -> None:
    traced = Traced()
    past = "2020-01-01T00:00:00+00:00"
    traced.add(msgspec.json.encode({"ticket_id": "T-1", "body": "hi", "metadata": {"deadline_at": past}}))
    traced.run(InstantClassifier())

    [process] = traced.processes()
    assert process.status.status_code is StatusCode.ERROR
    assert [event.name for event in process.events] == ["triage.deadline_expired"]
    assert dict(process.events[0].attributes or {}) == {"triage.reason": "expired_on_arrival"}
    # No model time: decoded, then straight to the producer.
    assert [span.name for span in traced.children(process)] == ["decode", f"send {OUTPUT}", "settle"]


def test_a_dead_letter_marks_the_span_and_carries_the_trace_on() -> None:
    traced = Traced()
    traced.add(b"{not json", headers=[("traceparent", TRACEPARENT)])
    traced.run(InstantClassifier())

    [process] = traced.processes()
    assert f"{process.context.trace_id:032x}" == PRODUCER_TRACE
    assert process.status.status_code is StatusCode.ERROR
    assert process.status.description == "dead_letter: invalid_json"
    assert [(event.name, dict(event.attributes or {})) for event in process.events] == [
        ("triage.dead_letter", {"triage.reason": "invalid_json"})
    ]
    assert [span.name for span in traced.children(process)] == ["decode", f"send {DEAD}", "settle"]
    [headers] = traced.output_headers(DEAD)
    assert headers["traceparent"] == traceparent_of(process)


class _Unsure(InstantClassifier):
    """The first stage: every answer at confidence 0.5 (a cascade with `escalate_below` 0.8 escalates it)."""

    def poll(self, timeout: float) -> Sequence[tuple[int, Classification]]:
        return [(rid, msgspec.structs.replace(a, confidence=0.5)) for rid, a in super().poll(timeout)]


class _Escalation(InstantClassifier):
    model_id = "escalation@test"


def test_an_escalated_ticket_has_both_stages_in_its_trace() -> None:
    traced = Traced()
    traced.add(ticket("T-1"))
    cascade = Cascade(_Escalation(), 0.8, window=8, prior_latency_s=0.0, first_contexts=1)
    traced.run(_Unsure(), cascade=cascade)

    [process] = traced.processes()
    children = traced.children(process)
    assert [span.name for span in children] == [
        "decode",
        "dispatch queue",
        "classify instant@test",
        "classify escalation@test",
        f"send {OUTPUT}",
        "settle",
    ]
    first, escalation = children[2], children[3]
    assert (first.attributes or {})["triage.escalated"] is True
    assert (first.attributes or {})["triage.confidence_bucket"] == "0.5-0.6"
    assert (escalation.attributes or {})["triage.stage"] == "escalation"
    assert (escalation.attributes or {})["gen_ai.request.model"] == "escalation@test"
    assert (escalation.attributes or {})["gen_ai.response.model"] == "escalation@test"
    assert (escalation.attributes or {})["triage.confidence_bucket"] == "0.9-1.0"


class _EncoderStands(InstantClassifier):
    """An escalation stage whose LLM gives no answer in time: its encoder's answer stands."""

    model_id = "llm@test"

    def answer(self, request: ClassifyRequest) -> Classification:
        return instant_answer("encoder@test")


def test_an_escalation_span_says_which_model_answered() -> None:
    """The stage's pool is the LLM's (`gen_ai.request.model`); its encoder answered, as the record's `model`
    says (`gen_ai.response.model`)."""
    traced = Traced()
    traced.add(ticket("T-1"))
    cascade = Cascade(_EncoderStands(), 0.8, window=8, prior_latency_s=0.0, first_contexts=1)
    traced.run(_Unsure(), cascade=cascade)

    [process] = traced.processes()
    first, escalation = traced.children(process)[2:4]
    assert (first.attributes or {})["gen_ai.response.model"] == "instant@test"
    attributes = escalation.attributes or {}
    assert (attributes["gen_ai.request.model"], attributes["gen_ai.response.model"]) == (
        "llm@test",
        "encoder@test",
    )


def test_exactly_once_a_ticket_is_settled_by_its_transaction() -> None:
    traced = Traced()
    traced.add(ticket("T-1"))
    traced.run(
        InstantClassifier(),
        settings=_settings({"pipeline.guarantee": "exactly_once"}),
        transactional_id="tracing-tid",
    )

    [process] = traced.processes()
    children = traced.children(process)
    assert [span.name for span in children] == STEPS
    assert (children[-1].attributes or {})["triage.settled_by"] == "transaction"


def test_exactly_once_an_aborted_transaction_ends_its_tries_given_up_and_the_redo_is_traced_anew() -> None:
    """The first delivery of T-1's record fails: its transaction is aborted and redone. The aborted try's
    span ends given up, saying why, with no error (the ticket is not failed: it is redone); the redo is a
    second process span of the same offset, in the same trace, settled by its transaction."""
    traced = Traced()
    traced.add(ticket("T-1"), headers=[("traceparent", TRACEPARENT)])
    failed: list[str] = []

    def fail_first(topic: str, value: bytes | None) -> confluent_kafka.KafkaError | None:
        if topic != OUTPUT or failed:
            return None
        failed.append(topic)
        return confluent_kafka.KafkaError(confluent_kafka.KafkaError.REQUEST_TIMED_OUT, "request timed out")

    traced.kafka.hooks.delivery = fail_first
    traced.run(
        InstantClassifier(),
        settings=_settings({"pipeline.guarantee": "exactly_once"}),
        transactional_id="aborted-tid",
    )

    aborted, redone = traced.processes()
    assert {f"{span.context.trace_id:032x}" for span in (aborted, redone)} == {PRODUCER_TRACE}
    [(name, said)] = [(event.name, dict(event.attributes or {})) for event in aborted.events]
    assert name == "triage.given_up"
    assert (
        said["triage.reason"]
        == "its delivery failed (REQUEST_TIMED_OUT): its transaction is aborted, it is redone"
    )
    assert aborted.status.status_code is StatusCode.UNSET
    assert [span.name for span in traced.children(redone)] == STEPS
    assert (traced.children(redone)[-1].attributes or {})["triage.settled_by"] == "transaction"
    assert len(traced.kafka.read_committed(OUTPUT)) == 1


def test_a_revoked_partition_s_tickets_are_settled_by_the_revoke_s_commit() -> None:
    """Acknowledged, not committed yet (a long commit interval), then revoked: the revoke commits them, and
    their traces end settled by that commit, not given up."""
    traced = Traced()
    for index in range(3):
        traced.add(ticket(f"T-{index}"))
    running = traced.start(InstantClassifier(), settings=_settings({"pipeline.commit_interval_ms": 60000}))
    wait_until(lambda: len(traced.kafka.read_committed(OUTPUT)) == 3, "three triage records")
    consumer = traced.kafka.members[0]
    traced.kafka.revoke(consumer, [(INPUT, 0)])
    wait_until(traced.committed, "the revoke's commit")
    assert running.stop() == 0

    processes = traced.processes()
    assert len(processes) == 3
    for process in processes:
        assert [event.name for event in process.events] == []
        assert [span.name for span in traced.children(process)] == STEPS


def test_a_lost_partition_s_tickets_end_given_up() -> None:
    """Acknowledged, then the partition is lost before a commit passes them: each trace ends, saying so,
    without an error (its next owner traces it anew)."""
    traced = Traced()
    traced.add(ticket("T-1"))
    running = traced.start(InstantClassifier(), settings=_settings({"pipeline.commit_interval_ms": 60000}))
    wait_until(lambda: len(traced.kafka.read_committed(OUTPUT)) == 1, "the triage record")
    traced.kafka.lose(traced.kafka.members[0], [(INPUT, 0)])
    wait_until(lambda: len(traced.processes()) == 1, "the ticket's trace to end")
    assert running.stop() == 0

    [process] = traced.processes()
    assert process.status.status_code is StatusCode.UNSET
    assert [(event.name, dict(event.attributes or {})) for event in process.events] == [
        ("triage.given_up", {"triage.reason": "its partition was lost before a commit passed it"})
    ]


def test_exactly_once_tickets_of_a_lost_partition_end_given_up_at_the_model_and_held() -> None:
    """In input order one ticket waits at the model while the next one's output is held behind it; the
    partition is lost: both traces end `given_up` (the held one was never produced, the other's answer is
    discarded)."""
    traced = Traced()
    traced.add(ticket("T-0", body="hold: card stolen"))
    traced.add(ticket("T-1"))
    classifier = HoldingClassifier()
    running = traced.start(
        classifier, settings=_settings({"pipeline.guarantee": "exactly_once"}), transactional_id="lost-tid"
    )
    wait_until(lambda: len(classifier.held) == 1, "the first ticket at the model")
    answered = lambda: any(span.name == "classify instant@test" for span in traced.spans())  # noqa: E731
    wait_until(answered, "the second ticket answered (its output held behind the first)")
    traced.kafka.lose(traced.kafka.members[0], [(INPUT, 0)])
    wait_until(lambda: len(traced.processes()) == 2, "both traces to end")
    classifier.release()
    assert running.stop() == 0

    for process in traced.processes():
        assert [event.name for event in process.events] == ["triage.given_up"]
        assert process.status.status_code is StatusCode.UNSET


def test_queue_mode_settles_each_ticket_by_its_acknowledgement() -> None:
    kafka = MemoryKafka()
    for topic in (INPUT, OUTPUT, DEAD):
        kafka.create_topic(topic, 1)
    log = kafka.logs[INPUT][0]
    batch: list[Message] = []
    for value in [ticket("T-0"), b"{not json"]:
        record = Record(len(log), None, value, [("traceparent", TRACEPARENT)])
        log.append(record)
        batch.append(ShareMessage(INPUT, 0, record, 1))
    consumer = ScriptedShareConsumer([batch])
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    parts = TriageParts(InstantClassifier(), FALLBACK, 64, tracing=OtelTracing(provider, GROUP))
    settings = _settings({"pipeline.consume": "queue", "kafka.delivery.timeout.ms": "5000"})
    lock = ShareGroup(lock_ms=15000, delivery_count_limit=5)
    running = Running(queue_pipeline(settings, parts, lock, clients=share_clients(kafka, consumer)))
    wait_until(lambda: len(consumer.outcomes) == 2, "both acknowledged")
    assert running.stop() == 0

    spans = exporter.get_finished_spans()
    processes = sorted(
        (span for span in spans if span.kind is SpanKind.CONSUMER),
        key=lambda span: (span.attributes or {})["messaging.kafka.offset"],  # type: ignore[arg-type,return-value]
    )
    settles = {
        span.parent.span_id: (span.attributes or {})["triage.settled_by"]
        for span in spans
        if span.name == "settle" and span.parent is not None
    }
    assert [settles[process.context.span_id] for process in processes] == [
        "acknowledgement ACCEPT",
        "acknowledgement REJECT",
    ]
    assert all(f"{process.context.trace_id:032x}" == PRODUCER_TRACE for process in processes)


class _Reversing(InstantClassifier):
    """Holds every ticket until `count` are at the model, then answers them last first, one poll each."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self._count = count
        self._held: list[ClassifyRequest] = []

    def submit(self, request: ClassifyRequest) -> None:
        with self._lock:
            self._held.append(request)

    def poll(self, timeout: float) -> Sequence[tuple[int, Classification]]:
        with self._lock:
            if len(self._held) < self._count:
                answer = []
            else:
                answer = [self._held.pop()]
                self._count = 0  # every later ticket is answered at once
        if not answer:
            time.sleep(min(timeout, 0.002))
        return [(request.request_id, instant_answer(self.model_id)) for request in answer]


def test_sixty_four_tickets_in_flight_finishing_out_of_order_each_keep_their_own_spans() -> None:
    traced = Traced(partitions=2)
    for index in range(64):
        traced.add(ticket(f"T-{index}"), partition=index % 2)
    traced.run(_Reversing(64), settings=_settings({"pipeline.max_in_flight": 64}))

    processes = traced.processes()
    assert len(processes) == 64
    assert len({span.context.trace_id for span in processes}) == 64
    model_ends = {}
    for process in processes:
        children = traced.children(process)
        assert [span.name for span in children] == STEPS, process.attributes
        assert all(span.context.trace_id == process.context.trace_id for span in children)
        key = (
            (process.attributes or {})["messaging.destination.partition.id"],
            (process.attributes or {})["messaging.kafka.offset"],
        )
        model_ends[key] = children[2].end_time
    # They did finish out of order: the last taken was answered first.
    order = sorted(model_ends, key=lambda key: model_ends[key] or 0)
    assert order != sorted(order, key=lambda key: (key[1], key[0]))
    # Every triage record carries its own ticket's span.
    by_span = {traceparent_of(process) for process in processes}
    assert {headers["traceparent"] for headers in traced.output_headers(OUTPUT)} == by_span


PERSONAL = ["jane.doe@example.com", "+44 20 7946 0958", "4111 1111 1111 1111", "GB82WEST12345698765432"]


def _every_string(spans: Sequence[ReadableSpan]) -> Iterator[str]:
    for span in spans:
        yield span.name
        yield span.status.description or ""
        for attributes in [span.attributes, span.resource.attributes, *(e.attributes for e in span.events)]:
            for name, value in (attributes or {}).items():
                yield name + "=" + str(value)
        yield from (event.name for event in span.events)


def test_no_ticket_text_and_no_personal_data_in_any_span() -> None:
    traced = Traced()
    text = "my card " + " and ".join(PERSONAL) + " was charged twice"
    # Personal data in the key, the subject, the body and a header; one ticket classified, one dead-lettered.
    headers: list[tuple[str, bytes | None]] = [
        ("traceparent", TRACEPARENT),
        ("customer", PERSONAL[0].encode()),
    ]
    traced.add(ticket("T-1", body=text, subject=PERSONAL[1]), PERSONAL[0].encode(), headers)
    traced.add(b'{"ticket_id": "T-2", "body": "' + PERSONAL[0].encode() + b'"', PERSONAL[0].encode(), headers)
    traced.run(InstantClassifier())

    assert len(traced.processes()) == 2
    seen = " | ".join(_every_string(traced.spans()))
    for value in [*PERSONAL, "charged twice", "customer"]:
        assert value not in seen


def test_a_key_is_never_in_a_span() -> None:
    """The conventions' `messaging.kafka.message.key` is left out: not a customer number, an e-mail
    address, a phone number nor bytes that are not text (a key is found by no detector's verdict)."""
    traced = Traced()
    keys = [b"C-1001", PERSONAL[0].encode(), b"call +44 20 7946 0958", b"\xff\xfe"]
    for index, key in enumerate(keys):
        traced.add(ticket(f"T-{index}"), key)
    traced.run(InstantClassifier())

    shown = [(p.attributes or {}).get("messaging.kafka.message.key") for p in traced.processes()]
    assert shown == [None] * len(keys)
    seen = " | ".join(_every_string(traced.spans()))
    assert not any(key.decode(errors="replace") in seen for key in keys)


class _Lines(Offline):
    def __init__(self) -> None:
        self.pool = InstantClassifier()  # type: ignore[assignment]
        self.fallback = FALLBACK
        self.cascade = None


def test_classify_traces_each_line_the_same_way(monkeypatch: pytest.MonkeyPatch) -> None:
    exporter = InMemorySpanExporter()

    def tracing_for_offline(settings: TracingSettings, group: str | None) -> OtelTracing:
        assert group is None  # no consumer group: no messaging.system
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return OtelTracing(provider, group)

    monkeypatch.setattr("worker.app.offline.tracing_for", tracing_for_offline)
    results = classify_texts(_settings(), _Lines(), ["where is my card", "it never came"])
    assert len(results) == 2
    spans = exporter.get_finished_spans()
    processes = [span for span in spans if span.kind is SpanKind.CONSUMER]
    assert len(processes) == 2
    assert all("messaging.system" not in (span.attributes or {}) for span in processes)
    names = {span.name for span in spans if span.kind is not SpanKind.CONSUMER}
    assert {"decode", "dispatch queue", "classify instant@test"} <= names


def test_a_replayed_dead_letter_s_span_is_linked_to_the_original_ticket_s_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dead letter carries the span that dead-lettered it; the replay's span is a trace of its own with
    a link to it, settled by the replay's commit."""
    kafka = MemoryKafka()
    kafka.create_topic(INPUT, 1)
    kafka.create_topic(DEAD, 1)
    headers = dead_letters.dead_letter_headers(
        [("traceparent", TRACEPARENT)], "missing_field", "m", INPUT, 0, 0
    )
    kafka.append(DEAD, 0, ticket("T-1"), None, headers)
    exporter = _replayed(kafka, _settings(), monkeypatch)

    [process] = [span for span in exporter.get_finished_spans() if span.kind is SpanKind.CONSUMER]
    assert process.name == f"process {DEAD}"
    assert process.parent is None
    assert f"{process.context.trace_id:032x}" != PRODUCER_TRACE
    [link] = process.links
    assert (f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}") == (
        PRODUCER_TRACE,
        PRODUCER_SPAN,
    )
    [settle] = [span for span in exporter.get_finished_spans() if span.name == "settle"]
    assert (settle.attributes or {})["triage.settled_by"] == "commit"


def test_a_key_is_in_no_span_whatever_privacy_detect_looks_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """With `privacy.detect` narrowed to cards, the detector passes an e-mail address: the door's spans
    still never hold the key (they did, where a key the detector passed was shown)."""
    kafka = MemoryKafka()
    kafka.create_topic(INPUT, 1)
    kafka.create_topic(DEAD, 1)
    headers = dead_letters.dead_letter_headers(None, "missing_field", "m", INPUT, 0, 0)
    kafka.append(DEAD, 0, ticket("T-1"), PERSONAL[0].encode(), headers)
    kafka.append(DEAD, 0, ticket("T-2"), b"C-1001", headers)
    exporter = _replayed(kafka, _settings({"privacy.detect": "card_number"}), monkeypatch)

    spans = list(exporter.get_finished_spans())
    assert len([span for span in spans if span.kind is SpanKind.CONSUMER]) == 2
    seen = " | ".join(_every_string(spans))
    assert PERSONAL[0] not in seen and "C-1001" not in seen


def _replayed(
    kafka: MemoryKafka, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> InMemorySpanExporter:
    """The replay door over `kafka`'s dead letters, as it assembles its tracer, with spans exported to
    memory as they end; run to its end."""
    exporter = InMemorySpanExporter()

    def tracing_for_replay(settings: TracingSettings, group: str | None, **options: Any) -> OtelTracing:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return OtelTracing(provider, group, **options)

    monkeypatch.setattr(replay_door, "tracing_for", tracing_for_replay)
    monkeypatch.setattr(replay_door, "_ReplayClients", lambda settings, group: kafka.clients(group, None))
    consumer = cast(confluent_kafka.Consumer, ReplayConsumer(kafka, "replay"))
    options = ReplayOptions(dlq_topic=DEAD, group="replay")
    engine = replay_door.replay_pipeline(
        settings, options, consumer, ReplaySummary(DEAD, "replay", False), None, Failure()
    )
    assert engine.run() == 0
    return exporter


# -- exemplars ----------------------------------------------------------------------------------------------

# The latency histograms whose observations of a sampled ticket carry its trace (with a cascade configured).
LATENCIES = (
    "triage_end_to_end_latency_seconds",
    "triage_queue_wait_seconds",
    "triage_model_latency_seconds",
    "triage_escalation_latency_seconds",
    "triage_escalation_model_latency_seconds",
)
# What Prometheus 3 asks a target for (its default scrape protocols, less the protobuf one).
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.5,"
    "application/openmetrics-text;version=0.0.1;q=0.4,text/plain;version=1.0.0;escaping=allow-utf-8;q=0.3,"
    "text/plain;version=0.0.4;q=0.2,*/*;q=0.1"
)


def _run_escalated(traced: Traced, headers: list[tuple[str, bytes | None]]) -> PipelineMetrics:
    """One ticket through the first stage and the escalation stage; the run's metrics once it is stopped."""
    traced.add(ticket("T-1", body="card stolen, jane.doe@example.com"), b"jane.doe@example.com", headers)
    cascade = Cascade(_Escalation(), 0.8, window=8, prior_latency_s=0.0, first_contexts=1)
    running = traced.start(_Unsure(), cascade=cascade)
    wait_until(traced.committed, "inputs committed")
    assert running.stop() == 0
    return running.pipeline.metrics


def _scrape(metrics: PipelineMetrics, accept: str | None) -> tuple[str, str]:
    """The worker's /metrics over HTTP, asked with `accept` (None: no Accept header, as curl): its content
    type and page."""
    probes = WorkerProbes(60.0, HealthyBroker(), time.monotonic)  # type: ignore[arg-type]
    probes.metrics = metrics
    registry = new_registry()
    registry.register(PipelineCollector(probes, {"version": "0", "model": "instant@test"}))
    with TelemetryServer(MetricsSettings(port=0, host="127.0.0.1"), registry, probes) as server:
        request = urllib.request.Request(f"http://127.0.0.1:{server.port}/metrics")
        if accept is not None:
            request.add_header("Accept", accept)
        with urllib.request.urlopen(request, timeout=5) as response:
            return str(response.headers["Content-Type"]), response.read().decode()


def _openmetrics(page: str) -> list[Metric]:
    """An OpenMetrics page parsed by the client library's strict parser (an invalid page raises; the
    library leaves this parser without type hints)."""
    return list(openmetrics_families(page))  # type: ignore[no-untyped-call]


def _exemplars(page: str) -> dict[str, list[tuple[float, Exemplar]]]:
    """Each latency histogram's exemplars in an OpenMetrics page, with the bound of the bucket each is on."""
    families = {family.name: family for family in _openmetrics(page)}
    return {
        name: [
            (float(sample.labels["le"]), sample.exemplar)
            for sample in families[name].samples
            if sample.exemplar is not None
        ]
        for name in LATENCIES
    }


def _observed(families: Iterable[Metric]) -> dict[str, float]:
    """How many observations each latency histogram holds, on a parsed page."""
    counts = {sample.name: sample.value for family in families for sample in family.samples}
    return {name: counts[f"{name}_count"] for name in LATENCIES}


def test_a_sampled_ticket_s_latencies_carry_its_trace_as_exemplars() -> None:
    """Scraped as Prometheus scrapes (OpenMetrics), the bucket each latency of the sampled ticket fell in
    carries its trace id and its process span's id, and nothing else: the way from a latency spike on the
    dashboard to the ticket's trace. The plain text format, for every other scraper, stays as it was."""
    traced = Traced()
    metrics = _run_escalated(traced, [("traceparent", TRACEPARENT)])

    [process] = traced.processes()
    ids = {"trace_id": f"{process.context.trace_id:032x}", "span_id": f"{process.context.span_id:016x}"}
    assert ids["trace_id"] == PRODUCER_TRACE
    content_type, page = _scrape(metrics, PROMETHEUS_ACCEPT)
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    for name, exemplars in _exemplars(page).items():
        [(bound, exemplar)] = exemplars  # one ticket: one bucket
        assert exemplar.labels == ids, name
        assert 0.0 <= exemplar.value <= bound, name
        assert exemplar.timestamp is not None, name  # stored once by Prometheus, not again at each scrape
    assert "jane.doe" not in page

    content_type, text = _scrape(metrics, None)
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    assert _observed(text_families(text)) == dict.fromkeys(LATENCIES, 1)
    assert "trace_id" not in text


@pytest.mark.parametrize("tracing", ["on, the ticket not sampled", "off"])
def test_no_exemplar_without_a_sampled_ticket(tracing: str) -> None:
    traced = Traced()
    if tracing == "off":
        traced.tracing = NO_TRACING
    unsampled = f"00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-00".encode()  # the producer's span was not sampled
    metrics = _run_escalated(traced, [("traceparent", unsampled)])

    assert traced.spans() == []
    _, page = _scrape(metrics, PROMETHEUS_ACCEPT)
    assert _observed(_openmetrics(page)) == dict.fromkeys(LATENCIES, 1)
    assert _exemplars(page) == {name: [] for name in LATENCIES}
    assert "# {" not in page


# -- on and off ---------------------------------------------------------------------------------------------


def test_tracing_is_off_unless_configured() -> None:
    assert tracing_for(TracingSettings(), GROUP, {}) is NO_TRACING
    assert tracing_for(TracingSettings(), GROUP, {"OTEL_TRACES_EXPORTER": "none"}) is NO_TRACING
    on = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}
    assert tracing_for(TracingSettings(), GROUP, on) is NO_TRACING


def _closed(tracing: object) -> None:
    assert isinstance(tracing, OtelTracing)
    tracing.close(0.1)


def test_the_standard_variables_or_the_settings_section_turn_it_on() -> None:
    endpoint = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}
    _closed(tracing_for(TracingSettings(), GROUP, {"OTEL_TRACES_EXPORTER": "otlp", **endpoint}))
    grpc = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", **endpoint}
    _closed(tracing_for(TracingSettings(), GROUP, grpc))
    configured = _settings({"tracing.exporter": "otlp", "tracing.endpoint": "http://127.0.0.1:9"})
    _closed(tracing_for(configured.tracing, GROUP, {}))


def test_a_protocol_the_worker_does_not_send_is_one_line() -> None:
    environ = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}
    with pytest.raises(UserError, match="OTLP protocol 'http/json': the worker sends http/protobuf or grpc"):
        tracing_for(TracingSettings(), GROUP, environ)


def test_tracing_on_without_the_otel_extra_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)  # as if not installed
    with pytest.raises(
        UserError, match=r"tracing is on \(OTEL_TRACES_EXPORTER=otlp\) but OpenTelemetry is not"
    ):
        tracing_for(TracingSettings(), GROUP, {"OTEL_TRACES_EXPORTER": "otlp"})


def test_off_imports_nothing_of_opentelemetry() -> None:
    """The worker's doors imported and tracing off, in a fresh interpreter: no opentelemetry module loaded."""
    program = "\n".join(
        [
            "import sys",
            "import worker.app.application, worker.app.offline, worker.cli.cli",
            "from worker.settings import TracingSettings",
            "from worker.telemetry.tracing import tracing_for",
            "tracing_for(TracingSettings(), 'group', {})",
            "print(sorted(name for name in sys.modules if name.startswith('opentelemetry')))",
        ]
    )
    found = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=True)
    assert found.stdout.strip() == "[]"


def test_the_loop_never_waits_for_the_collector() -> None:
    """Spans go to an endpoint where nothing listens: the tickets are not slowed (the batch processor
    exports on its own thread), and the run ends within its shutdown time (the SDK's flush alone waited
    6.7 s for the exporter's retries)."""
    kafka = MemoryKafka()
    for topic in (INPUT, OUTPUT, DEAD):
        kafka.create_topic(topic, 1)
    for index in range(50):
        kafka.append(INPUT, 0, ticket(f"T-{index}"))
    settings = _settings(
        {
            "tracing.exporter": "otlp",
            "tracing.endpoint": "http://127.0.0.1:9",
            "pipeline.shutdown_timeout_ms": 2000,
        }
    )
    tracing = tracing_for(settings.tracing, GROUP, {})
    parts = TriageParts(InstantClassifier(), FALLBACK, 64, tracing=tracing)
    clients = as_client_factory(kafka.clients(GROUP, None))
    started = time.monotonic()
    running = Running(group_pipeline(settings, parts, clients=clients))
    done: Callable[[], bool] = lambda: kafka.committed[GROUP].get((INPUT, 0), 0) == 50  # noqa: E731
    while not done():
        assert time.monotonic() - started < 10.0, "tickets slowed by the exporter"
        time.sleep(0.005)
    # Nor does its shutdown, which ends within its limit (spans not sent by then are lost).
    stopping = time.monotonic()
    assert running.stop() == 0
    assert time.monotonic() - stopping < 3.0
