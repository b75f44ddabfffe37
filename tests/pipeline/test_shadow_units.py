"""The shadow model's pure logic with fakes: settings, the drop rule, agreement counting, the report."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import pytest

from worker.classification import Classification, ClassifyRequest
from worker.cli.shadow_command import ShadowTally, render, summarize
from worker.kafka.admin import worker_topics
from worker.messages import ShadowResult, SourcePosition, TicketEvent
from worker.pipeline.side_topics.shadow import Shadow, shadow_record
from worker.settings import InferenceSettings, load_settings


def _answer(intent: str, fallback: bool = False, model: str = "shadow-model") -> Classification:
    return Classification(
        intent=intent,
        priority="Low",
        confidence=0.0 if fallback else 0.9,
        scores={} if fallback else {intent: 0.9},
        model=model,
        latency_ms=12.0,
        truncated=False,
        fallback=fallback,
        fallback_reason="deadline_exceeded" if fallback else None,
    )


class _Classifier:
    """Takes requests; `answer(id, classification)` makes one ready for the next poll."""

    model_id = "shadow-model"

    def __init__(self) -> None:
        self.submitted: list[ClassifyRequest] = []
        self.ready: list[tuple[int, Classification]] = []
        self.poll_timeouts: list[float] = []

    def submit(self, request: ClassifyRequest) -> None:
        self.submitted.append(request)

    def poll(self, timeout: float) -> Sequence[tuple[int, Classification]]:
        self.poll_timeouts.append(timeout)
        ready, self.ready = self.ready, []
        return ready


class _Producer:
    """Records what is produced; delivers it (or fails it) on the next poll."""

    def __init__(self, refuse: bool = False, fail: bool = False) -> None:
        self.records: list[dict[str, Any]] = []
        self._reports: list[Any] = []
        self._refuse, self._fail = refuse, fail

    def produce(self, topic: str, **record: Any) -> None:
        if self._refuse:
            raise BufferError("queue full")
        self.records.append({"topic": topic, **record})
        self._reports.append(record["on_delivery"])

    def poll(self, _timeout: float) -> int:
        reports, self._reports = self._reports, []
        for on_delivery in reports:
            on_delivery(_Failed() if self._fail else None, None)
        return len(reports)

    def flush(self, _timeout: float) -> int:
        return len(self._reports)


class _Failed:
    def name(self) -> str:
        return "_MSG_TIMED_OUT"

    def str(self) -> str:
        return "timed out"


def _offer(shadow: Shadow, ticket: str, primary_intent: str, offset: int) -> None:
    event = TicketEvent(ticket_id=ticket, body=f"text of {ticket}")
    source = SourcePosition(topic="in", partition=0, offset=offset)
    shadow.offer(event, source, ticket.encode(), [("trace", b"1")], _answer(primary_intent, model="primary"))


def test_no_shadow_unless_configured_and_unset_keys_are_the_primarys() -> None:
    assert InferenceSettings().shadow_settings() is None
    primary = InferenceSettings(model="m1", taxonomy="t1.toml", mode="generate", pool_size=4)
    other_model = msgspec.structs.replace(primary, shadow_model="m2").shadow_settings()
    assert other_model is not None
    # Another model brings its own taxonomy; the mode is the primary's; one context unless set.
    assert (other_model.model, other_model.taxonomy, other_model.mode, other_model.pool_size) == (
        "m2",
        None,
        "generate",
        1,
    )
    assert other_model.shadow_settings() is None  # the shadow has no shadow
    other_mode = msgspec.structs.replace(primary, shadow_mode="score", shadow_pool_size=2).shadow_settings()
    assert other_mode is not None
    assert (other_mode.model, other_mode.taxonomy, other_mode.mode, other_mode.pool_size) == (
        "m1",
        "t1.toml",
        "score",
        2,
    )


def test_the_side_topic_is_configurable_and_created_only_with_a_shadow() -> None:
    settings = load_settings(env={"TRIAGE_INFERENCE__SHADOW_MODEL": "other"})
    assert settings.topics.shadow == "tickets.triaged.shadow"
    assert [spec.name for spec in worker_topics(settings.topics)][-1] == "tickets.dlq"
    names = [spec.name for spec in worker_topics(settings.topics, shadow=True)]
    assert names == ["tickets.raw", "tickets.triaged", "tickets.dlq", "tickets.triaged.shadow"]


def test_at_most_a_window_outstanding_the_rest_dropped_and_counted() -> None:
    classifier, producer = _Classifier(), _Producer()
    shadow = Shadow(classifier, 2, producer, "side", budget_s=5.0, clock=lambda: 100.0)  # type: ignore[arg-type]
    for offset in range(3):
        _offer(shadow, f"T{offset}", "card_arrival", offset)
    assert [r.request_id for r in classifier.submitted] == [0, 1]
    assert classifier.submitted[0].deadline == 105.0  # the ticket's budget, from its offer
    assert shadow.metrics.offered == 3 and shadow.metrics.dropped == {"full": 1}
    assert shadow.metrics.outstanding == 2

    classifier.ready = [(0, _answer("card_arrival"))]
    shadow.serve()
    assert classifier.poll_timeouts == [0.0]  # the shadow never waits for its model
    assert shadow.metrics.outstanding == 1
    _offer(shadow, "T3", "pin_blocked", 3)  # room again
    assert len(classifier.submitted) == 3

    shadow.close(flush_s=1.0)
    assert shadow.metrics.dropped == {"full": 1, "shutdown": 2}
    assert shadow.metrics.outstanding == 0


def test_answers_are_compared_written_with_the_primary_alongside_and_delivery_counted() -> None:
    classifier, producer = _Classifier(), _Producer()
    shadow = Shadow(classifier, 8, producer, "side", budget_s=5.0)  # type: ignore[arg-type]
    for offset, intent in enumerate(["card_arrival", "card_arrival", "pin_blocked"]):
        _offer(shadow, f"T{offset}", intent, offset)
    classifier.ready = [
        (0, _answer("card_arrival")),
        (1, _answer("lost_or_stolen_card")),
        (2, _answer("unclassified", fallback=True)),
    ]
    shadow.serve()
    shadow.serve()  # delivery reports
    metrics = shadow.metrics
    assert metrics.agreed == 1 and metrics.disagreed == {("card_arrival", "lost_or_stolen_card"): 1}
    assert metrics.fallback == {"deadline_exceeded": 1}  # not compared
    assert metrics.produced == 3 and metrics.delivery_failed == 0
    assert metrics.latency.snapshot()[0][4] == 3  # 12 ms each, in the 0.025 s bucket
    assert metrics.snapshot()["agreement"] == 0.5
    records = [msgspec.json.decode(r["value"], type=ShadowResult) for r in producer.records]
    assert [(r.ticket_id, r.primary_intent, r.intent, r.fallback) for r in records] == [
        ("T0", "card_arrival", "card_arrival", False),
        ("T1", "card_arrival", "lost_or_stolen_card", False),
        ("T2", "pin_blocked", "unclassified", True),
    ]
    assert records[0].model == "shadow-model" and records[0].primary_model == "primary"
    assert records[0].source == SourcePosition(topic="in", partition=0, offset=0)
    # Same key and headers as the primary record, on the side topic.
    assert producer.records[0]["topic"] == "side" and producer.records[0]["key"] == b"T0"
    assert producer.records[0]["headers"] == [("trace", b"1")]


@pytest.mark.parametrize(
    "producer", [_Producer(refuse=True), _Producer(fail=True)], ids=["refused", "failed"]
)
def test_side_records_not_delivered_are_counted_never_retried_or_waited_for(producer: _Producer) -> None:
    classifier = _Classifier()
    shadow = Shadow(classifier, 8, producer, "side", budget_s=5.0)  # type: ignore[arg-type]
    _offer(shadow, "T0", "card_arrival", 0)
    classifier.ready = [(0, _answer("card_arrival"))]
    shadow.serve()
    shadow.serve()
    assert shadow.metrics.delivery_failed == 1 and shadow.metrics.produced == 0
    assert shadow.metrics.agreed == 1  # the comparison does not depend on the record


def _side_record(offset: int, primary: str, shadow: str, fallback: bool = False) -> bytes:
    event = TicketEvent(ticket_id=f"T{offset}", body="b")
    source = SourcePosition(topic="in", partition=offset % 2, offset=offset)
    record = shadow_record(event, _answer(shadow, fallback), source, _answer(primary, model="primary"))
    return msgspec.json.encode(record)


def test_report_counts_once_per_ticket_per_intent_and_the_pairs_that_disagree_most() -> None:
    tally = ShadowTally()
    pairs = [("a", "a")] * 3 + [("a", "b")] * 2 + [("a", "c")] + [("b", "b")] + [("b", "a")] * 2
    for offset, (primary, shadow) in enumerate(pairs):
        tally.add(_side_record(offset, primary, shadow))
    tally.add(_side_record(len(pairs), "b", "unclassified", fallback=True))
    tally.add(_side_record(0, "a", "a"))  # the same ticket again (redone after a rebalance)
    tally.add(b"not json")
    summary = summarize(tally, "side")
    assert (summary["records"], summary["tickets"], summary["duplicates"], summary["undecodable"]) == (
        11,
        10,
        1,
        1,
    )
    assert (summary["compared"], summary["agreed"], summary["agreement"]) == (9, 4, 0.4444)
    assert summary["shadow_fallbacks"] == {"deadline_exceeded": 1}
    assert summary["models"] == [{"primary": "primary", "shadow": "shadow-model", "tickets": 10}]
    assert summary["intents"] == [
        {
            "intent": "a",
            "compared": 6,
            "agreed": 3,
            "agreement": 0.5,
            "most_often_instead": {"intent": "b", "count": 2},
        },
        {
            "intent": "b",
            "compared": 3,
            "agreed": 1,
            "agreement": 0.3333,
            "most_often_instead": {"intent": "a", "count": 2},
        },
    ]
    assert summary["disagreements"] == [
        {"primary": "a", "shadow": "b", "count": 2},
        {"primary": "b", "shadow": "a", "count": 2},
        {"primary": "a", "shadow": "c", "count": 1},
    ]
    text = render(summary, top=2)
    assert "agreement: 4/9 = 44.4% (not compared, shadow fallbacks: deadline_exceeded 1)" in text
    assert "top 2 disagreements (primary -> shadow):" in text
    assert "  a -> b: 2 (33.3% of a)" in text and "a -> c" not in text
    assert text.splitlines()[5].split() == ["a", "6", "3", "50.0%", "b", "(2)"]


def test_an_empty_side_topic_reports_nothing_to_compare() -> None:
    summary = summarize(ShadowTally(), "side")
    assert summary["compared"] == 0 and summary["agreement"] is None and summary["intents"] == []
    assert "agreement: 0/0 = -" in render(summary, top=10)
