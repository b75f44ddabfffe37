"""A ticket answered "none of these" (issue #46) as routers, reviewers and dashboards meet it: the triage
record says so explicitly, distinct from a fallback, with the nearest intent kept; every other record is
unchanged byte for byte; the review topic gets it with its own reason; `triage_out_of_scope_total` counts it.

The loop runs in process over the in-memory Kafka; the answers come from a classifier double that answers as
the encoder stage does for a ticket far from every training ticket (worker/inference/encoder.py `_scoped`),
whose detection itself `tests/inference/test_out_of_scope.py` proves with the real model.
"""

from __future__ import annotations

import json
import time

import jsonschema
import msgspec
from doubles import HealthyBroker, InstantClassifier, Running
from memory_kafka import MemoryKafka, as_client_factory
from prometheus_client import CollectorRegistry, generate_latest

from tools import REPO
from worker.app.doors import TriageParts, group_pipeline
from worker.classification import Classification, ClassifyRequest, FallbackLabel
from worker.messages import ReviewRecord, TriageResult
from worker.pipeline.side_topics.review import Review
from worker.settings import ReviewSettings, load_settings
from worker.telemetry.collectors import PipelineCollector
from worker.telemetry.probes import WorkerProbes

INPUT, OUTPUT, DEAD, REVIEW = "tickets.raw", "tickets.triaged", "tickets.dlq", "tickets.review"
GROUP = "scoped"


class ScopingClassifier(InstantClassifier):
    """Answers "none of these" for the tickets that mention the weather, as the encoder stage does; the
    others as `InstantClassifier`."""

    def answer(self, request: ClassifyRequest) -> Classification:
        answer = super().answer(request)
        if "weather" not in request.text:
            return answer
        return msgspec.structs.replace(
            answer,
            intent="none_of_these",
            priority="Medium",
            confidence=0.0,
            out_of_scope=True,
            out_of_scope_score=0.41,
            nearest_intent=answer.intent,
            nearest_confidence=answer.confidence,
        )


def _run(tickets: list[dict[str, str]]) -> tuple[MemoryKafka, Running]:
    kafka = MemoryKafka()
    for topic in (INPUT, OUTPUT, DEAD, REVIEW):
        kafka.create_topic(topic, 1)
    for ticket in tickets:
        kafka.append(INPUT, 0, msgspec.json.encode(ticket), None, [])
    settings = load_settings(
        env={},
        overrides={
            "kafka.bootstrap.servers": "memory:9092",
            "pipeline.group_id": GROUP,
            "pipeline.commit_interval_ms": 20,
            "review.threshold": 0.5,
        },
    )
    review_producer = kafka.clients(GROUP).producer(lambda error: None)
    review = Review(ReviewSettings(threshold=0.5), review_producer, REVIEW)  # type: ignore[arg-type]
    parts = TriageParts(ScopingClassifier(), FallbackLabel("unclassified", "Medium"), 8, review=review)
    running = Running(group_pipeline(settings, parts, clients=as_client_factory(kafka.clients(GROUP))))
    deadline = time.monotonic() + 15.0
    while kafka.committed[GROUP].get((INPUT, 0), 0) < len(tickets):
        assert time.monotonic() < deadline, "the tickets were not committed"
        time.sleep(0.01)
    assert running.stop() == 0
    review_producer.flush(5)
    return kafka, running


def test_a_ticket_that_fits_no_intent_is_said_to_fit_none_and_the_others_are_unchanged() -> None:
    kafka, running = _run(
        [
            {"ticket_id": "T-1", "body": "my card never arrived"},
            {"ticket_id": "T-2", "body": "what will the weather be tomorrow?"},
        ]
    )

    values = [record.value for _, record in kafka.read_committed(OUTPUT)]
    records = {r.ticket_id: r for r in (msgspec.json.decode(v, type=TriageResult) for v in values if v)}
    scoped = records["T-2"]
    assert scoped.out_of_scope is True and scoped.out_of_scope_reason == "no_similar_training_ticket"
    assert (scoped.intent, scoped.confidence, scoped.fallback) == ("none_of_these", 0.0, False)
    assert (scoped.nearest_intent, scoped.nearest_confidence) == ("card_arrival", 0.9)
    # A record of an in-scope ticket has none of the new fields: its bytes are what they were.
    plain = json.loads(next(v for v in values if v and b'"T-1"' in v))
    assert not {"out_of_scope", "out_of_scope_reason", "nearest_intent", "nearest_confidence"} & set(plain)
    schema = json.loads((REPO / "schemas" / "triage_result.schema.json").read_text(encoding="utf-8"))
    for value in values:
        assert value is not None
        jsonschema.validate(json.loads(value), schema)

    # Reviewers get it with its own reason, not as one more low-confidence ticket.
    reviewed = [
        msgspec.json.decode(r.value or b"", type=ReviewRecord) for _, r in kafka.read_committed(REVIEW)
    ]
    assert [(r.ticket_id, r.review_reason) for r in reviewed] == [("T-2", "out_of_scope")]

    # The dashboards count it.
    probes = WorkerProbes(60.0, HealthyBroker(), time.monotonic)  # type: ignore[arg-type]
    probes.metrics = running.pipeline.metrics
    registry = CollectorRegistry()
    registry.register(PipelineCollector(probes, {}))
    assert "triage_out_of_scope_total 1.0" in generate_latest(registry).decode()
