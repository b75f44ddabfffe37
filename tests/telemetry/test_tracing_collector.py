"""Per-ticket traces received by a real OpenTelemetry Collector (issue #47): the worker's own tracer, as
`[tracing]` configures it, exports over OTLP (HTTP and gRPC) to a Collector built from its Go modules
(`tools/local_collector.py`), and the test reads back what the Collector wrote: one trace from the producer's
span through the worker's process span and its steps to the triage record's `traceparent`.

The last test is the acceptance of the issue end to end: a `triage-worker run` process against the real
broker, turned on by the standard `OTEL_*` variables alone, a ticket produced with the producer's
`traceparent`, and a reader of its triage record continuing the trace.

Skipped, with the reason, where the Collector cannot be built (no Go toolchain, no module proxy).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import confluent_kafka
import msgspec
import pytest
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic  # re-exported untyped by confluent_kafka.admin
from doubles import InstantClassifier, Running
from memory_kafka import MemoryKafka, as_client_factory

from tools.harness import Worker, headers_of, make_topics, read_topic, wait_until_committed
from tools.local_collector import CollectorUnavailable, LocalCollector, attributes, collector_binary
from worker.app.doors import TriageParts, group_pipeline
from worker.classification import Classification, ClassifyRequest, FallbackLabel
from worker.cli.cli import main
from worker.pipeline.triage.cascade import Cascade
from worker.settings import load_settings
from worker.telemetry.tracing import tracing_for

pytestmark = pytest.mark.slow

# The default topics (`topics.*`).
INPUT, OUTPUT, DEAD = "tickets.raw", "tickets.triaged", "tickets.dlq"
GROUP = "traced"
PRODUCER_TRACE = "0af7651916cd43dd8448eb211c80319c"
PRODUCER_SPAN = "b7ad6b7169203331"
SECRET = "jane.doe@example.com"
STEPS = ["decode", "dispatch queue", "classify instant@test", f"send {OUTPUT}", "settle"]


@pytest.fixture(scope="module")
def collector_built() -> Path:
    try:
        return collector_binary()
    except CollectorUnavailable as why:
        pytest.skip(str(why))


@pytest.fixture
def collector(collector_built: Path, tmp_path: Path) -> Iterator[LocalCollector]:
    with LocalCollector(collector_built, tmp_path) as running:
        yield running


def _run_one_ticket(endpoint: str, protocol: str) -> dict[str, bytes | None]:
    """One ticket with a producer's traceparent through group mode, traced to `endpoint`; the triage
    record's headers."""
    kafka = MemoryKafka()
    for topic in (INPUT, OUTPUT, DEAD):
        kafka.create_topic(topic, 1)
    value = msgspec.json.encode({"ticket_id": "T-1", "body": f"my card never came, write to {SECRET}"})
    kafka.append(
        INPUT,
        0,
        value,
        SECRET.encode(),
        [("traceparent", f"00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-01".encode())],
    )
    settings = load_settings(
        env={},
        overrides={
            "kafka.bootstrap.servers": "memory:9092",
            "pipeline.group_id": GROUP,
            "pipeline.commit_interval_ms": 20,
            "tracing.exporter": "otlp",
            "tracing.endpoint": endpoint,
            "tracing.protocol": protocol,
        },
    )
    tracing = tracing_for(settings.tracing, GROUP, {})
    parts = TriageParts(InstantClassifier(), FallbackLabel("unclassified", "Medium"), 8, tracing=tracing)
    running = Running(group_pipeline(settings, parts, clients=as_client_factory(kafka.clients(GROUP, None))))
    deadline = time.monotonic() + 15.0
    while kafka.committed[GROUP].get((INPUT, 0), 0) < 1:
        assert time.monotonic() < deadline, "the ticket was not committed"
        time.sleep(0.01)
    assert running.stop() == 0  # the run's end sends what is left
    [(_, record)] = kafka.read_committed(OUTPUT)
    return dict(record.headers or [])


def _received(collector: LocalCollector, count: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 15.0
    while len(spans := collector.spans()) < count:
        assert time.monotonic() < deadline, f"the Collector wrote {len(spans)} spans, expected {count}"
        time.sleep(0.05)
    return spans


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_the_collector_receives_one_trace_from_the_producer_to_the_triage_record(
    collector: LocalCollector, protocol: str
) -> None:
    endpoint = collector.grpc_endpoint if protocol == "grpc" else collector.http_endpoint
    headers = _run_one_ticket(endpoint, protocol)

    spans = _received(collector, 1 + len(STEPS))
    assert {span["traceId"] for span in spans} == {PRODUCER_TRACE}
    [process] = [span for span in spans if span["name"] == f"process {INPUT}"]
    assert process["parentSpanId"] == PRODUCER_SPAN
    assert process["kind"] == 5  # SPAN_KIND_CONSUMER
    assert attributes(process) == {
        "messaging.system": "kafka",
        "messaging.operation.type": "process",
        "messaging.operation.name": "process",
        "messaging.destination.name": INPUT,
        "messaging.destination.partition.id": "0",
        "messaging.kafka.offset": "0",  # OTLP JSON writes 64-bit integers as strings
        "messaging.consumer.group.name": GROUP,
    }
    children = sorted(
        (span for span in spans if span.get("parentSpanId") == process["spanId"]),
        key=lambda span: int(span["startTimeUnixNano"]),
    )
    assert [span["name"] for span in children] == STEPS
    assert attributes(children[2])["gen_ai.request.model"] == "instant@test"
    assert {"key": "service.name", "value": {"stringValue": "triage-worker"}} in process["resource"]
    # A consumer of the triage record continues the same trace from the worker's span.
    assert headers["traceparent"] is not None
    assert headers["traceparent"].decode().split("-")[1:3] == [PRODUCER_TRACE, process["spanId"]]
    assert SECRET not in collector.exported()


class _UnsureOfEscalations(InstantClassifier):
    """The first stage: unsure (0.5) of the tickets that ask for it, so a cascade escalates them."""

    def answer(self, request: ClassifyRequest) -> Classification:
        answer = super().answer(request)
        return msgspec.structs.replace(answer, confidence=0.5) if "unsure" in request.text else answer


class _Escalation(InstantClassifier):
    model_id = "escalation@test"


def test_exactly_once_escalated_late_and_aborted_tickets_each_reach_the_collector_as_their_own_story(
    collector: LocalCollector,
) -> None:
    """Exactly-once group mode with a cascade, traced over OTLP/HTTP to the Collector: an escalated ticket's
    trace has both model stages; a ticket whose deadline had passed on arrival is an error saying so, with no
    model step; the first delivery of a third ticket's record fails, so its transaction is aborted: that
    try's span ends given up, saying why, and the redo is a second process span of the same trace, settled
    by its transaction (as is every ticket of that transaction: a try given up, then the redo). The in-memory
    Kafka fails the delivery at will (the real broker refuses a record
    for its content before the transaction sees it)."""
    kafka = MemoryKafka()
    for topic in (INPUT, OUTPUT, DEAD):
        kafka.create_topic(topic, 1)
    escalated, late, aborted = (uuid.uuid4().hex for _ in range(3))
    tickets = [
        (escalated, {"ticket_id": "T-unsure", "body": "unsure: my card never came"}),
        (late, {"ticket_id": "T-late", "body": "hi", "metadata": {"deadline_at": "2020-01-01T00:00:00Z"}}),
        (aborted, {"ticket_id": "T-abort", "body": "where is my card"}),
    ]
    for trace, ticket in tickets:
        kafka.append(INPUT, 0, msgspec.json.encode(ticket), None, [("traceparent", _traceparent(trace))])
    failed: list[bytes] = []

    def fail_once(topic: str, value: bytes | None) -> confluent_kafka.KafkaError | None:
        if topic != OUTPUT or failed or b"T-abort" not in (value or b""):
            return None
        failed.append(value or b"")
        return confluent_kafka.KafkaError(confluent_kafka.KafkaError.REQUEST_TIMED_OUT, "request timed out")

    kafka.hooks.delivery = fail_once
    settings = load_settings(
        env={},
        overrides={
            "kafka.bootstrap.servers": "memory:9092",
            "pipeline.group_id": GROUP,
            "pipeline.guarantee": "exactly_once",
            "pipeline.commit_interval_ms": 20,
            "tracing.exporter": "otlp",
            "tracing.endpoint": collector.http_endpoint,
        },
    )
    tracing = tracing_for(settings.tracing, GROUP, {})
    cascade = Cascade(_Escalation(), 0.8, window=8, prior_latency_s=0.0, first_contexts=1)
    parts = TriageParts(
        _UnsureOfEscalations(), FallbackLabel("unclassified", "Medium"), 8, cascade=cascade, tracing=tracing
    )
    clients = as_client_factory(kafka.clients(GROUP, "collector-tid"))
    running = Running(group_pipeline(settings, parts, clients=clients))
    deadline = time.monotonic() + 15.0
    while kafka.committed[GROUP].get((INPUT, 0), 0) < len(tickets):
        assert time.monotonic() < deadline, "the tickets were not committed"
        time.sleep(0.01)
    assert running.stop() == 0  # the run's end sends what is left
    assert failed, "no delivery was failed"

    def process(trace: str) -> list[dict[str, Any]]:
        found = [s for s in collector.spans() if s["traceId"] == trace and s["name"] == f"process {INPUT}"]
        return sorted(found, key=lambda span: int(span["startTimeUnixNano"]))

    def children(parent: dict[str, Any]) -> list[dict[str, Any]]:
        found = [s for s in collector.spans() if s.get("parentSpanId") == parent["spanId"]]
        return sorted(found, key=lambda span: int(span["startTimeUnixNano"]))

    deadline = time.monotonic() + 15.0
    while not (process(escalated) and process(late) and len(process(aborted)) == 2):
        assert time.monotonic() < deadline, "the spans did not arrive"
        time.sleep(0.05)
    # The abort redoes every ticket of its transaction: each try but the last ends given up (after what
    # it did: the late ticket's wrote its fallback, in the aborted transaction).
    for trace in (escalated, late, aborted):
        for earlier in process(trace)[:-1]:
            assert _events(earlier)[-1][0] == "triage.given_up"
    both_stages = process(escalated)[-1]
    names = [span["name"] for span in children(both_stages)]
    assert names == [
        "decode",
        "dispatch queue",
        "classify instant@test",
        "classify escalation@test",
        f"send {OUTPUT}",
        "settle",
    ]
    expired = process(late)[-1]
    assert _events(expired) == [("triage.deadline_expired", {"triage.reason": "expired_on_arrival"})]
    assert expired["status"]["code"] == 2  # STATUS_CODE_ERROR
    assert [span["name"] for span in children(expired)] == ["decode", f"send {OUTPUT}", "settle"]
    given_up, redone = process(aborted)[-2:]
    assert given_up["status"].get("code", 0) == 0  # not the ticket's failure: it is redone
    why = "its delivery failed (REQUEST_TIMED_OUT): its transaction is aborted, it is redone"
    assert _events(given_up) == [("triage.given_up", {"triage.reason": why})]
    assert attributes(children(redone)[-1])["triage.settled_by"] == "transaction"
    assert len(kafka.read_committed(OUTPUT)) == len(tickets)


@pytest.mark.kafka
def test_a_running_worker_turned_on_by_the_otel_variables_sends_the_ticket_s_trace(
    collector: LocalCollector, kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    topics = make_topics(unique_topic, partitions=1)
    group = f"traced-{uuid.uuid4().hex[:8]}"
    environment = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.http_endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_SERVICE_NAME": "triage-e2e",
    }
    worker = Worker(kafka_bootstrap, topics, group, tmp_path, env=environment)
    producer = confluent_kafka.Producer({"bootstrap.servers": kafka_bootstrap})
    value = msgspec.json.encode({"ticket_id": "T-1", "body": f"where is my card? {SECRET}"})
    traceparent = f"00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-01".encode()
    producer.produce(topics.input, value, SECRET.encode(), headers=[("traceparent", traceparent)])
    # A ticket of its own trace, keyed by a customer number: no key is shown, not even one like this.
    producer.produce(topics.input, msgspec.json.encode({"ticket_id": "T-2", "body": "hi"}), b"C-1001")
    assert producer.flush(30) == 0
    wait_until_committed(kafka_bootstrap, group, topics.input, timeout=120, worker=worker)
    assert worker.stop() == 0  # the run's end sends what is left

    [record] = [r for r in read_topic(kafka_bootstrap, topics.output) if b'"T-1"' in (r.value() or b"")]
    everything = _received(collector, 2 * (1 + len(STEPS)))
    [keyed] = [s for s in everything if s["traceId"] != PRODUCER_TRACE and s["name"].startswith("process ")]
    assert "messaging.kafka.message.key" not in attributes(keyed)
    spans = [span for span in everything if span["traceId"] == PRODUCER_TRACE]
    [process] = [span for span in spans if span["name"] == f"process {topics.input}"]
    assert "messaging.kafka.message.key" not in attributes(process)  # an e-mail address as the key
    assert process["parentSpanId"] == PRODUCER_SPAN
    assert attributes(process)["messaging.consumer.group.name"] == group
    assert {"key": "service.name", "value": {"stringValue": "triage-e2e"}} in process["resource"]
    children = sorted(
        (span for span in spans if span.get("parentSpanId") == process["spanId"]),
        key=lambda span: int(span["startTimeUnixNano"]),
    )
    names = [span["name"] for span in children]
    assert names[:2] == ["decode", "dispatch queue"] and names[2].startswith("classify ")
    assert names[-2:] == [f"send {topics.output}", "settle"]
    # The router's side: the triage record's traceparent continues the trace from the worker's span.
    carried = headers_of(record)["traceparent"].split("-")
    assert carried[1:3] == [PRODUCER_TRACE, process["spanId"]]
    assert SECRET not in collector.exported()


def _traceparent(trace: str) -> bytes:
    return f"00-{trace}-{PRODUCER_SPAN}-01".encode()


def _events(span: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(event["name"], attributes(event)) for event in span.get("events", [])]


@pytest.mark.kafka
def test_exactly_once_dead_letters_and_their_replay_each_tell_their_story(
    collector: LocalCollector,
    kafka_bootstrap: str,
    unique_topic: Callable[..., str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real exactly-once worker and a real replay, both traced to the Collector by the `OTEL_*` variables.
    A ticket whose triage record its topic refuses (over the topic's 64 KB, with 100 KB of headers a team
    allowed) and an undecodable record are dead-lettered: each process span is an error with the dead
    letter's type; a plain ticket's is not. Replaying the dead letters starts a trace of its own per record,
    linked to the span that dead-lettered it, even where the dead letter was shrunk to fit its topic. (An
    aborted transaction's spans: tests/telemetry/test_tracing.py, where a delivery can be failed at will.)"""
    topics = make_topics(unique_topic, partitions=1)
    topics.output = f"triaged-64k-{uuid.uuid4().hex[:8]}"
    limited = NewTopic(
        topics.output, num_partitions=1, replication_factor=1, config={"max.message.bytes": "65536"}
    )
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    admin.create_topics([limited])[topics.output].result(30)
    refused_trace, poison_trace, plain_trace = (uuid.uuid4().hex for _ in range(3))
    producer = confluent_kafka.Producer(
        {"bootstrap.servers": kafka_bootstrap, "message.max.bytes": 4_000_000}
    )
    ticket = msgspec.json.encode({"ticket_id": "T-bomb", "body": f"my card was stolen, {SECRET}"})
    bomb = [(f"x-bomb-{index}", b"h" * 1000) for index in range(100)]
    producer.produce(topics.input, ticket, headers=[("traceparent", _traceparent(refused_trace)), *bomb])
    poison = b"{not json " + SECRET.encode()
    producer.produce(topics.input, poison, headers=[("traceparent", _traceparent(poison_trace))])
    plain = msgspec.json.encode({"ticket_id": "T-1", "body": "where is my card?"})
    producer.produce(topics.input, plain, headers=[("traceparent", _traceparent(plain_trace))])
    assert producer.flush(30) == 0
    environment = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.http_endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
    }
    group = f"traced-{uuid.uuid4().hex[:8]}"
    settings = {
        "pipeline.guarantee": "exactly_once",
        "pipeline.transactional_id": f"{group}-worker",
        "pipeline.max_header_bytes": "1048576",
    }
    worker = Worker(kafka_bootstrap, topics, group, tmp_path, settings=settings, env=environment)
    worker.run_to_completion(timeout=120)

    def process(trace: str) -> list[dict[str, Any]]:
        return [
            s for s in collector.spans() if s["traceId"] == trace and s["name"] == f"process {topics.input}"
        ]

    deadline = time.monotonic() + 15.0
    while not all(process(trace) for trace in (refused_trace, poison_trace, plain_trace)):
        assert time.monotonic() < deadline, "the worker's spans did not arrive"
        time.sleep(0.05)
    [refused], [poisoned], [classified] = (process(t) for t in (refused_trace, poison_trace, plain_trace))
    assert _events(refused) == [("triage.dead_letter", {"triage.reason": "result_refused"})]
    assert _events(poisoned) == [("triage.dead_letter", {"triage.reason": "invalid_json"})]
    assert refused["status"]["code"] == poisoned["status"]["code"] == 2  # STATUS_CODE_ERROR
    assert _events(classified) == [] and classified["status"].get("code", 0) == 0
    dead_lettering = {(refused_trace, refused["spanId"]), (poison_trace, poisoned["spanId"])}

    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    replay = ["replay", "--dlq", topics.dead_letter, "--set", f"kafka.bootstrap.servers={kafka_bootstrap}"]
    assert main([*replay, "--from-beginning", "--guarantee", "exactly_once", "--json"]) == 0
    capsys.readouterr()

    def replayed() -> list[dict[str, Any]]:
        return [s for s in collector.spans() if s["name"] == f"process {topics.dead_letter}"]

    deadline = time.monotonic() + 15.0
    while len(replayed()) < 2:
        assert time.monotonic() < deadline, "the replay's spans did not arrive"
        time.sleep(0.05)
    links = {(link["traceId"], link["spanId"]) for span in replayed() for link in span.get("links", [])}
    assert links == dead_lettering
    assert not {span["traceId"] for span in replayed()} & {refused_trace, poison_trace}  # traces of their own
    assert SECRET not in collector.exported()
