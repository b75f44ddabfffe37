"""The review loop's pure logic: which results go to review, what a review record holds, how feedback is
checked (and refused), which verdict wins, the intent search, and the output layer's round trip."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest

from tools import REPO
from worker.classification import Classification
from worker.cli.review_command import Picker, matches
from worker.errors import UserError
from worker.kafka.admin import worker_topics
from worker.learning.feedback import FeedbackBook, ReviewIndex, read_feedback_file
from worker.learning.fine_tune import OutputLayer, Recipe, _quantize_int4, fit_rows, split_holdout
from worker.messages import FeedbackEvent, ReviewRecord, SourcePosition, TicketEvent
from worker.pipeline.side_topics.review import Review, review_reason
from worker.privacy.redaction import Redactor
from worker.settings import ReviewSettings, load_settings

LABELS = ("card_arrival", "card_delivery_estimate", "lost_or_stolen_card")
SOURCE = SourcePosition(topic="tickets.raw", partition=1, offset=7)


def _answer(confidence: float, fallback: bool = False) -> Classification:
    return Classification(
        intent="card_arrival",
        priority="Medium",
        confidence=confidence,
        scores={} if fallback else {"card_arrival": confidence},
        model="m",
        latency_ms=2.0,
        truncated=False,
        fallback=fallback,
        fallback_reason="deadline_exceeded" if fallback else None,
    )


def test_review_takes_results_under_the_threshold_and_fallbacks_only_when_asked() -> None:
    settings = ReviewSettings(threshold=0.6)
    assert review_reason(settings, _answer(0.59)) == "low_confidence"
    assert review_reason(settings, _answer(0.6)) is None
    assert review_reason(settings, _answer(0.0, fallback=True)) is None
    both = ReviewSettings(threshold=0.6, fallbacks=True)
    assert review_reason(both, _answer(0.0, fallback=True)) == "fallback"
    assert review_reason(ReviewSettings(fallbacks=True), _answer(0.01)) is None
    assert not ReviewSettings().enabled and both.enabled


def test_review_settings_and_topics_come_from_config() -> None:
    settings = load_settings(env={"TRIAGE_REVIEW__THRESHOLD": "0.5", "TRIAGE_REVIEW__FALLBACKS": "true"})
    assert settings.review == ReviewSettings(threshold=0.5, fallbacks=True)
    names = [spec.name for spec in worker_topics(settings.topics, review=True)]
    assert names[-2:] == ["tickets.review", "tickets.feedback"]
    with pytest.raises(UserError, match=r"review.threshold: expected float <= 1.0, got 2"):
        load_settings(env={"TRIAGE_REVIEW__THRESHOLD": "2"})


class _Producer:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def produce(self, topic: str, **record: Any) -> None:
        self.records.append({"topic": topic, **record})
        record["on_delivery"](None, None)

    def poll(self, _timeout: float) -> int:
        return 0

    def flush(self, _timeout: float) -> int:
        return 0


def test_a_review_record_is_the_triage_result_plus_the_redacted_ticket_text_and_counted_by_intent() -> None:
    producer = _Producer()
    review = Review(ReviewSettings(threshold=0.5), producer, "tickets.review")  # type: ignore[arg-type]
    event = TicketEvent(ticket_id="T-1", body="my card 4111 1111 1111 1111?", subject="Card, a@b.example")
    scan = Redactor().scan(event.subject, event.body)
    review.consider(event, scan, _answer(0.4), SOURCE, b"T-1", [("trace", b"1")], "2026-11-02T10:00:00.000Z")
    review.consider(event, scan, _answer(0.9), SOURCE, b"T-1", None)
    assert len(producer.records) == 1
    sent = producer.records[0]
    assert (sent["topic"], sent["key"], sent["headers"]) == ("tickets.review", b"T-1", [("trace", b"1")])
    record = msgspec.json.decode(sent["value"], type=ReviewRecord)
    assert (record.ticket_id, record.intent, record.confidence) == ("T-1", "card_arrival", 0.4)
    assert (record.subject, record.body, record.review_reason, record.source, record.pii) == (
        "Card, [email]",
        "my card [card ••••1111]?",
        "low_confidence",
        SOURCE,
        ["email", "card_number"],
    )
    assert review.metrics.snapshot() == {
        "sent": 1,
        "top_intents": {"card_arrival": 1},
        "produced": 1,
        "delivery_failed": 0,
    }


def _event(ticket: str, intent: str, at: str, **fields: Any) -> bytes:
    return msgspec.json.encode(
        FeedbackEvent(ticket_id=ticket, intent=intent, reviewer="bo", reviewed_at=at, **fields)
    )


def test_feedback_is_checked_and_the_latest_verdict_of_a_ticket_wins() -> None:
    index = ReviewIndex()
    review = {
        "schema_version": 1, "ticket_id": "T-9", "intent": "card_arrival", "priority": "Low",
        "confidence": 0.2, "fallback": False, "fallback_reason": None, "scores": {}, "model": "m",
        "latency_ms": 1.0, "classified_at": "2026-11-02T10:00:00Z", "source": SOURCE, "truncated": False,
        "pii": [],
        "review_reason": "low_confidence", "body": "lost it", "subject": "Help",
    }  # fmt: skip
    index.add(msgspec.json.encode(msgspec.convert(review, ReviewRecord, from_attributes=True)))
    index.add(b"not a review record")  # ignored
    book = FeedbackBook(LABELS, index)
    early, late = "2026-11-02T10:00:00.000Z", "2026-11-02T11:00:00.000Z"
    assert book.add(_event("T-1", "card_arrival", late, text="where is it"), "1") is None
    assert book.add(_event("T-1", "lost_or_stolen_card", early, text="where is it"), "2") is None  # older
    assert book.add(_event("T-9", "lost_or_stolen_card", early, source=SOURCE), "3") is None  # from review
    refused = [
        book.add(b"{not json", "4"),
        book.add(_event("T-2", "pizza_order", early, text="x"), "5"),
        book.add(_event("T-3", "card_arrival", early), "6"),
        book.add(b'{"ticket_id": "T-4", "intent": "card_arrival"}', "7"),
    ]
    assert [(r.where, r.error_type) for r in refused if r is not None] == [
        ("4", "invalid_feedback"),
        ("5", "unknown_intent"),
        ("6", "unknown_ticket"),
        ("7", "invalid_feedback"),
    ]
    assert "'pizza_order' of ticket 'T-2' is not in the taxonomy" in refused[1].message  # type: ignore[union-attr]
    assert "missing required field `reviewer`" in refused[3].message  # type: ignore[union-attr]
    assert [(c.ticket_id, c.intent, c.text) for c in book.corrections()] == [
        ("T-1", "card_arrival", "where is it"),
        ("T-9", "lost_or_stolen_card", "Help\nlost it"),
    ]
    # On a tie of reviewed_at, the later record wins.
    book.add(_event("T-1", "card_delivery_estimate", late, text="where is it"), "8")
    assert book.corrections()[0].intent == "card_delivery_estimate"


def test_a_feedback_file_reports_each_refused_line(tmp_path: Path) -> None:
    path = tmp_path / "feedback.jsonl"
    good = _event("T-1", "card_arrival", "2026-11-02T10:00:00Z", text="hi").decode()
    path.write_text(f"{good}\n\nnot json\n")
    corrections, refused = read_feedback_file(path, LABELS)
    assert [c.ticket_id for c in corrections] == ["T-1"]
    assert [(r.where, r.error_type) for r in refused] == [("feedback.jsonl line 3", "invalid_feedback")]
    with pytest.raises(UserError, match="cannot read"):
        read_feedback_file(tmp_path / "missing.jsonl", LABELS)


def test_the_intent_search_matches_every_word_and_lists_the_models_candidates_first() -> None:
    labels = ["card_arrival", "lost_or_stolen_card", "card_delivery_estimate", "top_up_failed"]
    assert matches(labels, "") == [
        "card_arrival",
        "card_delivery_estimate",
        "lost_or_stolen_card",
        "top_up_failed",
    ]
    assert matches(labels, "", first=["top_up_failed"])[0] == "top_up_failed"
    assert matches(labels, "CARD est") == ["card_delivery_estimate"]
    assert matches(labels, "stolen card") == ["lost_or_stolen_card"]
    picker = Picker(labels, ["card_arrival"])
    for key in "card":
        assert picker.press(key) is None
    assert picker.press("down") is None and picker.press("down") is None and picker.press("down") is None
    assert picker.press("backspace") is None and picker.query == "car" and picker.selected == 0
    assert picker.press("down") is None
    assert picker.press("enter") == "card_delivery_estimate"
    assert Picker(labels, [], query="zzz").press("enter") is None


def test_requantizing_the_shipped_output_layer_gives_back_its_exact_bytes() -> None:
    layer = OutputLayer(REPO / "models" / "triage-mini")
    assert (layer.kind, layer.weights.shape) == ("int4", (3077, 384))
    packed, scales = _quantize_int4(layer.weights, layer.block)
    on_disk = (REPO / "models" / "triage-mini" / "model.onnx.data").read_bytes()
    assert packed.tobytes() in on_disk and scales.tobytes() in on_disk


def test_the_fit_moves_a_confused_pair_apart_and_keeps_the_rest() -> None:
    rng = np.random.default_rng(5)
    centres = rng.normal(size=(3, 8))
    centres[1] = centres[0] + 0.05  # intents 0 and 1 nearly the same
    start = centres.copy()
    start[1] = 0.5 * centres[0]  # the model sends intent 1 tickets to intent 0
    states = np.concatenate([centres[i] + 0.1 * rng.normal(size=(40, 8)) for i in range(3)])
    labels = np.repeat(np.arange(3), 40)
    corrections = (states[40:80], labels[40:80])
    before = (states @ start.T).argmax(1)
    rows = fit_rows(start, (states, labels), corrections, Recipe(steps=300))
    after = (states @ rows.T).argmax(1)
    assert (before[40:80] == 1).mean() < 0.2 and (after[40:80] == 1).mean() > 0.8
    assert (after[80:] == 2).all()


def test_held_out_corrections_are_a_share_of_each_intent() -> None:
    from worker.learning.feedback import Correction

    made = [Correction(f"T{i}", f"t{i}", LABELS[i % 2], None, "r", "x") for i in range(20)]
    made.append(Correction("single", "s", LABELS[2], None, "r", "x"))
    trained, held = split_holdout(made, 0.25, seed=1)
    assert len(held) == 4 and {c.intent for c in held} == set(LABELS[:2])
    assert "single" in {c.ticket_id for c in trained}
    assert split_holdout(made, 0.25, seed=1) == (trained, held)


def test_what_went_to_review_is_exported_by_intent_and_reason() -> None:
    from worker.pipeline.metrics import ReviewMetrics
    from worker.telemetry.collectors import _review_families

    metrics = ReviewMetrics()
    metrics.sent[("card_arrival", "low_confidence")] += 3
    metrics.sent[("unknown", "fallback")] += 1
    metrics.produced = 4
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in _review_families(metrics)
        for sample in family.samples
    }
    assert (
        samples[("triage_review_sent_total", (("intent", "card_arrival"), ("reason", "low_confidence")))] == 3
    )
    assert samples[("triage_review_sent_total", (("intent", "unknown"), ("reason", "fallback")))] == 1
    assert samples[("triage_review_produced_total", ())] == 4
