"""The worker's pipeline reading Avro, JSON Schema and Protobuf tickets through the real Schema Registry
(`LocalRegistry`: Apicurio) and the real session broker, with a producer's own field layout mapped by
`input.fields.*`: one triage record per ticket, a dead letter with its reason per bad record, and a registry
outage, a refusal of our credentials or an answer that is not the registry's that neither loses nor
dead-letters anything (docs/schema-registry.md).

The records are written by confluent-kafka's own serializers; the pipeline runs in this process (as in
tests/pipeline/test_pipeline_inprocess.py) with an instant classifier: the model is not what is tested
here."""

from __future__ import annotations

import base64
import contextlib
import http.client
import http.server
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastavro", reason="the avro extra of confluent-kafka is not installed")

import confluent_kafka
import helpdesk_proto
import msgspec
from confluent_kafka.schema_registry import SchemaRegistryClient, topic_record_subject_name_strategy
from confluent_kafka.schema_registry.avro import AvroDeserializer, AvroSerializer
from confluent_kafka.schema_registry.json_schema import JSONSerializer
from confluent_kafka.schema_registry.protobuf import ProtobufSerializer
from confluent_kafka.serialization import MessageField, SerializationContext
from doubles import InstantClassifier, Running

from tools.harness import (
    Topics,
    Worker,
    audit,
    committed_offsets,
    make_topics,
    read_topic,
    set_share_group_configs,
    settings_for,
    wait_until_committed,
)
from worker.app.doors import TriageParts, group_pipeline, queue_pipeline
from worker.classification import FallbackLabel
from worker.contracts.input import decoder_for
from worker.contracts.output import ResultEncoder, result_encoder_for
from worker.decoding import RegistryCause
from worker.dev import local_broker
from worker.dev.local_registry import CCOMPAT_PATH, LocalRegistry
from worker.dev.samples import KIND_HEADER
from worker.kafka.share_groups import LOCK_DURATION, prepare_share_group, queue_kafka_options
from worker.logs import configure_logging
from worker.settings import LogSettings, PrivacySettings, Settings
from worker.telemetry.collectors import PipelineCollector
from worker.telemetry.probes import WorkerProbes
from worker.telemetry.server import Check

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

FALLBACK = FallbackLabel("unclassified", "Medium")
# The producer's layout: the ticket's text under `description`, its customer under `requester.email`.
MAPPING = {"input.fields.ticket_id": "id", "input.fields.body": "description"}
MAPPING["input.fields.customer_id"] = "requester.email"

HELPDESK_AVRO = {
    "type": "record",
    "name": "HelpdeskTicket",
    "fields": [
        {"name": "id", "type": "string"},
        {"name": "description", "type": "string"},
        {
            "name": "requester",
            "type": {"type": "record", "name": "Requester", "fields": [{"name": "email", "type": "string"}]},
        },
    ],
}
# Another record type of the same producer, without the field `body` is mapped to.
NOTE_AVRO = {
    "type": "record",
    "name": "HelpdeskNote",
    "fields": [{"name": "id", "type": "string"}, {"name": "note", "type": "string"}],
}
HELPDESK_JSON = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "description": {"type": "string"},
        "requester": {"type": "object", "properties": {"email": {"type": "string"}}},
    },
    "required": ["id"],
}


@pytest.fixture(autouse=True)
def _worker_logging() -> None:
    """The log configuration `triage-worker run` starts with (info, redacted, on stderr): some tests here
    count the worker's lines, whatever an earlier test of the session configured (a replay sets warning)."""
    configure_logging(LogSettings(), PrivacySettings())


def _running(settings: Settings, result_encoder: ResultEncoder | None = None) -> Running:
    """The pipeline that `settings` describe (its decoder built as `triage-worker run` builds it), answering
    at once (these tests are about what reaches the model, not the model), run on a thread."""
    parts = TriageParts(
        InstantClassifier(),
        FALLBACK,
        64,
        decoder=decoder_for(settings.input, settings.schema_registry, settings.pipeline.max_value_bytes),
        result_encoder=result_encoder,
    )
    pipeline = group_pipeline(settings, parts)
    return Running(pipeline, settings.pipeline.group_id)


def _settings(bootstrap: str, topics: Topics, input_format: str, url: str, **more: str) -> Settings:
    return settings_for(
        bootstrap,
        topics,
        **{
            "pipeline.group_id": f"registry-pipeline-{uuid.uuid4().hex[:8]}",
            "input.format": input_format,
            "schema_registry.url": url,
            **MAPPING,
            **more,
        },
    )


def _produce(bootstrap: str, topic: str, records: list[tuple[bytes, str]]) -> None:
    """Each value with the sample-kind header the audit reads: "ticket", or "malformed:<reason>"."""
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap})
    for index, (value, kind) in enumerate(records):
        # Keyed by index, spread over the partitions: each partition holds tickets and bad records.
        producer.produce(topic, value, key=str(index).encode(), headers={KIND_HEADER: kind})
    assert producer.flush(30) == 0


def _helpdesk(n: int) -> dict[str, Any]:
    return {
        "id": f"HD-{n}",
        "description": f"my card payment was charged twice ({n})",
        "requester": {"email": f"customer{n}@example.com"},
    }


Serializers = tuple[Callable[[dict[str, Any], str], bytes], Callable[[str], bytes]]


def _serializers(input_format: str, client: Any) -> Serializers:
    """(a producer's ticket, a record of it that lacks the field `body` is mapped to), in `input_format`,
    by confluent-kafka's own serializers (which register their schema in the real registry)."""

    def ctx(topic: str) -> SerializationContext:
        return SerializationContext(topic, MessageField.VALUE)

    if input_format == "avro":
        ticket = AvroSerializer(client, json.dumps(HELPDESK_AVRO))
        # Its own subject (topic-record strategy): the topic's value subject keeps one record type.
        note = AvroSerializer(
            client, json.dumps(NOTE_AVRO), conf={"subject.name.strategy": topic_record_subject_name_strategy}
        )
        return (
            lambda record, topic: bytes(ticket(record, ctx(topic)) or b""),
            lambda topic: bytes(note({"id": "N-1", "note": "no description"}, ctx(topic)) or b""),
        )
    if input_format == "json_schema":
        json_ticket = JSONSerializer(json.dumps(HELPDESK_JSON), client)
        return (
            lambda record, topic: bytes(json_ticket(record, ctx(topic)) or b""),
            lambda topic: bytes(json_ticket({"id": "J-missing"}, ctx(topic)) or b""),
        )
    message = helpdesk_proto.HelpdeskTicket
    proto = ProtobufSerializer(message, client, {"use.deprecated.format": False})
    return (
        lambda record, topic: bytes(proto(message(**record), ctx(topic)) or b""),
        # proto3 cannot tell an absent string from an empty one: read as an empty body (`empty_ticket`).
        lambda topic: bytes(proto(message(id="P-missing"), ctx(topic)) or b""),
    )


def _without_body_reason(input_format: str) -> str:
    """The dead letter of the record `_serializers` makes without a description."""
    return "empty_ticket" if input_format == "protobuf" else "missing_field"


@pytest.mark.parametrize("input_format", ["avro", "json_schema", "protobuf"])
def test_registry_tickets_with_a_mapped_layout_get_one_result_each_and_bad_records_their_reason(
    schema_registry: LocalRegistry, kafka_bootstrap: str, unique_topic: Callable[..., str], input_format: str
) -> None:
    topics = make_topics(unique_topic)
    client: Any = SchemaRegistryClient({"url": schema_registry.url})
    ticket, missing_body = _serializers(input_format, client)
    count = 9
    good = [(ticket(_helpdesk(n), topics.input), "ticket") for n in range(count)]
    unknown_id = b"\x00" + (2**31 - 7).to_bytes(4, "big") + good[0][0][5:]
    without_body = _without_body_reason(input_format)
    bad = [
        (json.dumps({"id": "plain", "description": "plain JSON"}).encode(), "malformed:invalid_wire_format"),
        (unknown_id, "malformed:unknown_schema"),
        (missing_body(topics.input), f"malformed:{without_body}"),
    ]
    _produce(kafka_bootstrap, topics.input, good[:4] + bad + good[4:])
    extra = {"input.protobuf_message": "helpdesk_proto:HelpdeskTicket"} if input_format == "protobuf" else {}
    worker = _running(_settings(kafka_bootstrap, topics, input_format, schema_registry.url, **extra))
    try:
        wait_until_committed(kafka_bootstrap, worker.group, topics.input, timeout=90)
    finally:
        assert worker.stop() == 0

    report = audit(kafka_bootstrap, topics)
    assert len(report.inputs) == count + len(bad)
    assert report.lost == [] and report.duplicates == 0 and report.misrouted == [], report.summary()
    results = [result for results in report.results.values() for result in results]
    assert sorted(result.ticket_id for result in results) == sorted(f"HD-{n}" for n in range(count))
    assert sorted(reason for reasons in report.dead.values() for reason in reasons) == sorted(
        ["invalid_wire_format", without_body, "unknown_schema"]
    )
    assert worker.pipeline.metrics.dead_lettered_by_type[without_body] == 1


class _Link:
    """A TCP port in front of the registry that can be cut (connections refused) and restored: the outage
    the worker sees when the registry's host goes away. The registry keeps running, and with it the schema
    ids the records carry (its storage is in memory: a restarted registry would not know them)."""

    def __init__(self, target_port: int) -> None:
        self.port = local_broker.free_port()
        self._target = target_port
        self._listener: socket.socket | None = None
        # Connections through the link: a cut drops them too (the client keeps one open between requests).
        self._open: list[socket.socket] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{CCOMPAT_PATH}"

    def restore(self) -> None:
        listener = socket.create_server(("127.0.0.1", self.port), reuse_port=False)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        if self._listener is not None:
            # Closing alone does not wake a thread blocked in accept() on Linux: the port would still take
            # connections. Shutting the listening socket down does.
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        for connection in self._open:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        self._open.clear()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            upstream = socket.create_connection(("127.0.0.1", self._target))
            self._open += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pipe, args=(source, sink), daemon=True).start()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for end in (source, sink):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)


class _AnsweringBroker:
    state = Check(True, "metadata answered")


@pytest.mark.parametrize("guarantee", ["at_least_once", "exactly_once"])
def test_a_registry_outage_holds_records_back_until_it_answers_and_dead_letters_nothing(
    schema_registry: LocalRegistry,
    kafka_bootstrap: str,
    unique_topic: Callable[..., str],
    guarantee: str,
    capfd: pytest.CaptureFixture[str],
) -> None:
    topics = make_topics(unique_topic)
    producer_side: Any = SchemaRegistryClient({"url": schema_registry.url})
    ticket, _ = _serializers("avro", producer_side)
    count = 12
    _produce(
        kafka_bootstrap, topics.input, [(ticket(_helpdesk(n), topics.input), "ticket") for n in range(count)]
    )

    link = _Link(schema_registry.port)  # cut from the start: the worker has never seen the schema
    worker = _running(
        _settings(kafka_bootstrap, topics, "avro", link.url, **{"pipeline.guarantee": guarantee})
    )
    probes = WorkerProbes(60.0, _AnsweringBroker(), time.monotonic)  # type: ignore[arg-type]
    probes.metrics, probes.warm_contexts = worker.pipeline.metrics, 1
    try:
        state = worker.pipeline.metrics.registry
        assert state is not None
        deadline = time.monotonic() + 60
        while state.retries < 3 and time.monotonic() < deadline:  # three holds: of each partition, or retries
            time.sleep(0.2)
        assert state.retries >= 3 and state.outage is not None
        ready, body = probes.ready()
        assert not ready and not body["checks"]["schema_registry"]["ok"]
        assert "unavailable" in body["checks"]["schema_registry"]["detail"]
        info = {"version": "", "model": "", "mode": "", "provider": "", "pool": ""}
        exported = {family.name: family for family in PipelineCollector(probes, info).collect()}
        assert _retries_by_cause(exported)["outage"] >= 3
        # Nothing was answered, dead-lettered or committed past the records that wait.
        committed = committed_offsets(kafka_bootstrap, worker.group, topics.input)
        assert all(offset <= 0 for offset in committed.values()), committed
        assert worker.pipeline.metrics.dead_lettered == 0 and worker.pipeline.metrics.classified == 0

        link.restore()
        wait_until_committed(kafka_bootstrap, worker.group, topics.input, timeout=90)
        assert state.outage is None
        # Three partitions held over and over in a few seconds: one warning (the rest counted), one recovery.
        log = capfd.readouterr().err
        assert log.count("schema_registry_unavailable") == 1, log
        assert log.count("schema_registry_answering") == 1, log
        assert probes.ready()[1]["checks"]["schema_registry"] == {"ok": True, "detail": "answering"}
    finally:
        link.cut()
        assert worker.stop() == 0

    _assert_each_ticket_triaged_once(kafka_bootstrap, topics, count)


def test_queue_mode_holds_a_batch_through_a_registry_outage_longer_than_its_lock_and_loses_no_delivery(
    schema_registry: LocalRegistry, share_group_bootstrap: str, share_topic: Callable[..., str]
) -> None:
    """Issue #43 item 3, on a real share group: the registry away for 20 s, longer than the batch's 15 s lock
    (the broker's shortest). The worker holds the batch and probes the registry instead of releasing each
    record at once (which dead-lettered them all as `delivery_count_exceeded` within a second); readiness
    says so; once the lock is about to end the batch goes back to the group a single time, and no batch is
    polled again until the registry answers. Every ticket is then triaged once, and nothing is
    dead-lettered."""
    topics = Topics(share_topic("raw", 1), share_topic("triaged", 1), share_topic("dlq", 1))
    producer_side: Any = SchemaRegistryClient({"url": schema_registry.url})
    ticket, _ = _serializers("avro", producer_side)
    count = 12
    records = [(ticket(_helpdesk(n), topics.input), "ticket") for n in range(count)]
    _produce(share_group_bootstrap, topics.input, records)
    link = _Link(schema_registry.port)  # cut from the start: the worker has never seen the schema
    settings = _settings(share_group_bootstrap, topics, "avro", link.url, **{"pipeline.consume": "queue"})
    set_share_group_configs(share_group_bootstrap, settings.pipeline.group_id, {LOCK_DURATION: 15000})
    group = prepare_share_group(settings.kafka, settings.pipeline)
    assert group.lock_ms == 15000
    settings = msgspec.structs.replace(settings, kafka=queue_kafka_options(settings.kafka, group))
    parts = TriageParts(
        InstantClassifier(),
        FALLBACK,
        64,
        decoder=decoder_for(settings.input, settings.schema_registry, settings.pipeline.max_value_bytes),
    )
    worker = Running(queue_pipeline(settings, parts, group), settings.pipeline.group_id)
    metrics = worker.pipeline.metrics
    probes = WorkerProbes(60.0, _AnsweringBroker(), time.monotonic)  # type: ignore[arg-type]
    probes.metrics, probes.warm_contexts = metrics, 1
    try:
        state, queue = metrics.registry, metrics.queue
        assert state is not None and queue is not None
        _wait_until(lambda: state.outage is not None, 120.0)
        held_at = time.monotonic()
        assert not probes.ready()[0]
        time.sleep(max(0.0, held_at + 20.0 - time.monotonic()))  # past the lock of the batch at hand
        assert queue.batches == 1  # no new batch while the registry does not answer
        assert queue.released <= count and queue.accepted == 0 and metrics.dead_lettered == 0
        link.restore()
        _wait_until(lambda: queue.accepted == count, 120.0)
        assert state.outage is None and probes.ready()[0]
    finally:
        link.cut()
        assert worker.stop() == 0
    assert queue.delivery_count_exceeded == queue.rejected == 0
    _assert_each_ticket_triaged_once(share_group_bootstrap, topics, count)


def _assert_each_ticket_triaged_once(bootstrap: str, topics: Topics, count: int) -> None:
    """Every one of the `count` tickets has exactly one triage record, and nothing was dead-lettered."""
    report = audit(bootstrap, topics)
    assert len(report.inputs) == count
    assert report.lost == [] and report.duplicates == 0 and report.dead == {}, report.summary()
    assert sum(len(results) for results in report.results.values()) == count


def _retries_by_cause(exported: dict[str, Any]) -> dict[str, float]:
    """`triage_schema_registry_retries_total` as the collector exports it, by its `cause` label."""
    family = exported["triage_schema_registry_retries"]
    return {
        sample.labels["cause"]: sample.value for sample in family.samples if sample.name.endswith("_total")
    }


# Each answer a `_Gate` gives, as the decoder reads it: (its status, its cause, words of the reason).
REFUSALS: dict[str, tuple[int, RegistryCause, str]] = {
    "401": (401, "credentials", "refuses our credentials (401)"),
    "403": (403, "credentials", "denies our credentials access (403)"),
    "400": (400, "registry_error", "answered 400"),
    # A proxy's sign-in page where the registry's JSON should be.
    "proxy_page": (200, "registry_error", "an answer the client cannot read"),
}


class _Gate(http.server.ThreadingHTTPServer):
    """An HTTP proxy in front of the registry: until `open()` it answers every request itself with `status`
    (a registry's JSON error, or an HTML page for 200), echoing our Authorization header in the body as a
    debugging proxy might; after, it forwards each request to the registry and its answer back."""

    daemon_threads = True

    def __init__(self, target_port: int, status: int) -> None:
        super().__init__(("127.0.0.1", 0), _GateHandler)
        self.target_port = target_port
        self.status = status
        self.closed = True
        self.refused = 0
        self.authorizations: set[str] = set()  # the Authorization headers the worker sent
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{CCOMPAT_PATH}"

    def open(self) -> None:
        self.closed = False


class _GateHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the client expects
    server: _Gate

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self._answer()

    def do_PUT(self) -> None:
        self._answer()

    def do_DELETE(self) -> None:
        self._answer()

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet: the test reads the worker's log, not the gate's."""

    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.server.closed:
            self.server.refused += 1
            echoed = self.headers.get("Authorization", "")
            self.server.authorizations.add(echoed)
            if self.server.status == 200:
                self._send(200, "text/html", f"<html>Sign in to the proxy ({echoed})</html>".encode())
            else:
                error = {"error_code": self.server.status * 100 + 1, "message": f"refused: {echoed}"}
                self._send(self.server.status, "application/json", json.dumps(error).encode())
            return
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.target_port, timeout=30)
        try:
            headers = {name: value for name, value in self.headers.items() if name.lower() != "host"}
            upstream.request(self.command, self.path, body=body or None, headers=headers)
            answer = upstream.getresponse()
            self._send(answer.status, answer.getheader("Content-Type", "application/json"), answer.read())
        finally:
            upstream.close()

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.parametrize("refusal", list(REFUSALS))
def test_a_registry_refusing_our_credentials_or_answering_garbage_holds_records_until_it_answers(
    schema_registry: LocalRegistry,
    kafka_bootstrap: str,
    unique_topic: Callable[..., str],
    capfd: pytest.CaptureFixture[str],
    refusal: str,
) -> None:
    """Credentials rotated, an ACL changed, a bad request, a proxy's page: none of it is the record's fault.
    Every record waits (readiness down, the cause in its check, the log and the metrics), none is
    dead-lettered or committed past, and once the registry answers each has exactly one triage record. The
    credentials, which the gate echoes back in its refusals, are in no log line."""
    status, cause, reason = REFUSALS[refusal]
    topics = make_topics(unique_topic)
    ticket, _ = _serializers("avro", SchemaRegistryClient({"url": schema_registry.url}))
    count = 9
    _produce(
        kafka_bootstrap, topics.input, [(ticket(_helpdesk(n), topics.input), "ticket") for n in range(count)]
    )
    gate = _Gate(schema_registry.port, status)
    secret = "rotated-registry-password"
    credentials = {"schema_registry.basic_auth_user_info": f"triage:{secret}"}
    worker = _running(_settings(kafka_bootstrap, topics, "avro", gate.url, **credentials))
    probes = WorkerProbes(60.0, _AnsweringBroker(), time.monotonic)  # type: ignore[arg-type]
    probes.metrics, probes.warm_contexts = worker.pipeline.metrics, 1
    try:
        state = worker.pipeline.metrics.registry
        assert state is not None
        _wait_until(lambda: state.retries_by_cause[cause] >= 3, timeout_s=60)
        echoed = "Basic " + base64.b64encode(f"triage:{secret}".encode()).decode()
        assert gate.refused >= 3 and gate.authorizations == {echoed} and state.cause == cause
        ready, body = probes.ready()
        assert not ready and body["checks"]["schema_registry"]["detail"].startswith(f"unavailable ({cause})")
        assert reason in body["checks"]["schema_registry"]["detail"]
        info = {"version": "", "model": "", "mode": "", "provider": "", "pool": ""}
        retries = _retries_by_cause({f.name: f for f in PipelineCollector(probes, info).collect()})
        assert retries[cause] >= 3 and sum(retries.values()) == retries[cause], retries
        committed = committed_offsets(kafka_bootstrap, worker.group, topics.input)
        assert all(offset <= 0 for offset in committed.values()), committed
        assert worker.pipeline.metrics.dead_lettered == 0 and worker.pipeline.metrics.classified == 0

        gate.open()
        wait_until_committed(kafka_bootstrap, worker.group, topics.input, timeout=90)
        assert state.outage is None and state.cause is None
        log = capfd.readouterr().err
        assert log.count("schema_registry_unavailable") >= 1 and reason in log, log
        assert log.count("schema_registry_answering") == 1, log
        assert secret not in log and echoed.removeprefix("Basic ") not in log
    finally:
        gate.shutdown()
        gate.server_close()
        assert worker.stop() == 0

    _assert_each_ticket_triaged_once(kafka_bootstrap, topics, count)


def test_a_registry_cut_mid_stream_holds_back_only_what_needs_it_and_loses_nothing(
    schema_registry: LocalRegistry, kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    """The worker has the producer's first schema cached; the registry goes away; the producer moves to a
    new schema version (a new id the worker must fetch). Records of the new version wait, nothing is
    dead-lettered, and once the registry is back every ticket has exactly one triage record."""
    topics = make_topics(unique_topic)
    producer_side: Any = SchemaRegistryClient({"url": schema_registry.url})
    first, _ = _serializers("avro", producer_side)
    link = _Link(schema_registry.port)
    link.restore()
    worker = _running(_settings(kafka_bootstrap, topics, "avro", link.url))
    try:
        _produce(
            kafka_bootstrap, topics.input, [(first(_helpdesk(n), topics.input), "ticket") for n in range(6)]
        )
        # Not every partition gets one of these records: wait for the answers, not for commits on all.
        _wait_until(lambda: worker.pipeline.metrics.classified == 6)

        link.cut()
        second_version = {
            **HELPDESK_AVRO,
            "fields": [
                *HELPDESK_AVRO["fields"],
                {"name": "channel", "type": ["null", "string"], "default": None},
            ],
        }
        second = AvroSerializer(producer_side, json.dumps(second_version))
        ctx = SerializationContext(topics.input, MessageField.VALUE)
        later = [(second(_helpdesk(n) | {"channel": "email"}, ctx), "ticket") for n in range(6, 12)]
        _produce(kafka_bootstrap, topics.input, later)
        state = worker.pipeline.metrics.registry
        assert state is not None
        _wait_until(lambda: state.retries >= 2)  # held, retried after 1 s, held again
        assert state.outage is not None and worker.pipeline.metrics.classified == 6
        assert worker.pipeline.metrics.dead_lettered == 0

        link.restore()
        _wait_until(lambda: worker.pipeline.metrics.classified == 12)
    finally:
        link.cut()
        assert worker.stop() == 0

    report = audit(kafka_bootstrap, topics)
    assert len(report.inputs) == 12
    assert report.lost == [] and report.duplicates == 0 and report.dead == {}, report.summary()
    answered = sorted(r.ticket_id for results in report.results.values() for r in results)
    assert answered == sorted(f"HD-{n}" for n in range(12))


def _wait_until(condition: Callable[[], bool], timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not reached in {timeout_s}s"
        time.sleep(0.2)


def test_avro_output_is_registered_under_the_topic_subject_and_read_by_the_clients_deserializer(
    schema_registry: LocalRegistry, kafka_bootstrap: str, unique_topic: Callable[..., str]
) -> None:
    topics = make_topics(unique_topic)
    count = 9
    plain = [
        (json.dumps({"ticket_id": f"T-{n}", "body": f"card declined ({n})"}).encode(), "ticket")
        for n in range(count)
    ]
    _produce(kafka_bootstrap, topics.input, [*plain, (b"not json", "malformed:invalid_json")])
    settings = settings_for(
        kafka_bootstrap,
        topics,
        **{
            "pipeline.group_id": f"registry-pipeline-{uuid.uuid4().hex[:8]}",
            "output.format": "avro",
            "schema_registry.url": schema_registry.url,
        },
    )
    worker = _running(
        settings,
        result_encoder=result_encoder_for(settings.output, settings.schema_registry, settings.topics.output),
    )
    try:
        wait_until_committed(kafka_bootstrap, worker.group, topics.input, timeout=90)
    finally:
        assert worker.stop() == 0

    client: Any = SchemaRegistryClient({"url": schema_registry.url})
    assert f"{topics.output}-value" in client.get_subjects()
    deserialize = AvroDeserializer(client)
    ctx = SerializationContext(topics.output, MessageField.VALUE)
    results = [deserialize(message.value(), ctx) for message in read_topic(kafka_bootstrap, topics.output)]
    assert sorted(result["ticket_id"] for result in results) == sorted(f"T-{n}" for n in range(count))
    assert all(result["source"]["topic"] == topics.input and result["intent"] for result in results)
    # Dead letters keep the record as it came: not re-encoded.
    assert [message.value() for message in read_topic(kafka_bootstrap, topics.dead_letter)] == [b"not json"]


def test_triage_worker_run_reads_and_writes_avro_through_the_registry_and_never_logs_its_credentials(
    schema_registry: LocalRegistry, kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    """The command itself (`triage-worker run`, the test model), configured only by settings: the decoder
    and the result encoder are the ones `run` builds."""
    topics = make_topics(unique_topic, partitions=1)  # run_to_completion waits for a commit on each
    client: Any = SchemaRegistryClient({"url": schema_registry.url})
    ticket, _ = _serializers("avro", client)
    count = 6
    records = [(ticket(_helpdesk(n), topics.input), "ticket") for n in range(count)]
    _produce(kafka_bootstrap, topics.input, [*records, (b'{"id": "plain"}', "malformed:invalid_wire_format")])
    secret = "registry-secret-never-logged"
    worker = Worker(
        kafka_bootstrap,
        topics,
        f"registry-run-{uuid.uuid4().hex[:8]}",
        tmp_path,
        settings={"input.format": "avro", "output.format": "avro", **MAPPING},
        env={
            "TRIAGE_SCHEMA_REGISTRY__URL": schema_registry.url,
            # The local registry asks for no authentication and ignores it: here to show it is never logged.
            "TRIAGE_SCHEMA_REGISTRY__BASIC_AUTH_USER_INFO": f"triage:{secret}",
        },
    )
    worker.run_to_completion(timeout=120)

    deserialize = AvroDeserializer(client)
    ctx = SerializationContext(topics.output, MessageField.VALUE)
    results = [deserialize(message.value(), ctx) for message in read_topic(kafka_bootstrap, topics.output)]
    assert sorted(result["ticket_id"] for result in results) == sorted(f"HD-{n}" for n in range(count))
    dead = list(read_topic(kafka_bootstrap, topics.dead_letter))
    assert [dict(message.headers() or [])["triage.error.type"] for message in dead] == [
        b"invalid_wire_format"
    ]
    assert secret not in worker.log_path.read_text()
