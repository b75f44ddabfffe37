"""Personal data end to end (issue #33), on the real broker with the embedded model: tickets of the generated
corpus (tools/pii_corpus.py: cards of several brands, IBANs of fourteen countries, international phone
numbers, e-mail variants, SSNs, and near-misses) go through the worker with every ticket sent to review and
a shadow model, at debug level; then reviewers' verdicts go to the feedback topic (some carrying the ticket's
text in clear, as another tool might send them) and `model train --feedback-topic` fine-tunes on them.

No identifier of the corpus may appear in clear on the output, review or shadow topics, in the worker's log,
in the shadow report, or in the files (or output) of the fine-tune; dead letters keep their record as taken
(the default, for replay) while their error message is redacted; each result's `pii` names the kinds its
ticket held, and near-misses reach the reviewer unchanged.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterable
from pathlib import Path

import confluent_kafka
import msgspec
import pytest

from tools import REPO
from tools.harness import TINY_MODEL, Topics, Worker, make_topics, read_topic, wait_until_committed
from tools.pii_corpus import CorpusTicket, corpus
from worker.kafka.clients import record_headers
from worker.messages import FeedbackEvent, ReviewRecord, ShadowResult, TicketEvent, TriageResult

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

TICKETS = 48
# Records that are no tickets, with identifiers in them: dead letters.
POISON = {
    "P-json": b'{"body": "no id here, card 4929 1234 5678 9016"',
    "P-field": b'{"ticket_id": "", "body": "IBAN GB82 WEST 1234 5698 7654 32, ssn 123-45-6789"}',
}
POISON_IDENTIFIERS = ["4929 1234 5678 9016", "GB82 WEST 1234 5698 7654 32", "123-45-6789"]


def _leaks(texts: Iterable[str], identifiers: list[str]) -> list[str]:
    found = []
    for text in texts:
        found += [identifier for identifier in identifiers if identifier in text]
    return found


def _values(bootstrap: str, topic: str) -> list[confluent_kafka.Message]:
    return list(read_topic(bootstrap, topic))


def _texts(messages: list[confluent_kafka.Message]) -> Iterable[str]:
    """Each record's value and header values, decoded (JSON escapes resolved where the value is JSON)."""
    for message in messages:
        value = message.value() or b""
        try:
            yield json.dumps(json.loads(value), ensure_ascii=False)
        except ValueError:
            yield value.decode("utf-8", errors="replace")
        for _name, header in record_headers(message) or []:
            yield (header or b"").decode("utf-8", errors="replace")


def _log_texts(path: Path) -> Iterable[str]:
    """The log's lines with JSON's \\u escapes resolved (structlog writes ASCII: "josé" is "jos\\u00e9")."""
    for line in path.read_text(errors="replace").splitlines():
        try:
            yield json.dumps(json.loads(line), ensure_ascii=False)
        except ValueError:
            yield line


def _publish(bootstrap: str, topic: str, tickets: list[CorpusTicket]) -> None:
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for ticket in tickets:
        event = TicketEvent(ticket_id=ticket.ticket_id, body=ticket.body, subject=ticket.subject)
        producer.produce(topic, key=ticket.ticket_id.encode(), value=msgspec.json.encode(event))
    for key, value in POISON.items():
        producer.produce(topic, key=key.encode(), value=value)
    assert producer.flush(60) == 0


@pytest.mark.timeout(1800)
def test_no_identifier_leaves_the_input_topic_in_clear(
    kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    topics: Topics = make_topics(unique_topic)
    review, shadow, feedback = (unique_topic(name, partitions=1) for name in ("review", "shadow", "feedback"))
    feedback_dead_letters = unique_topic("feedback-dlq", partitions=1)
    tickets = corpus(TICKETS, seed=3301)
    by_id = {ticket.ticket_id: ticket for ticket in tickets}
    identifiers = sorted({i for ticket in tickets for i in ticket.identifiers} | set(POISON_IDENTIFIERS))
    group = f"triage-privacy-{uuid.uuid4().hex[:8]}"
    settings = {
        "review.threshold": "1.0",  # every classified ticket goes to review
        "review.fallbacks": "true",  # and every fallback
        "topics.review": review,
        "topics.shadow": shadow,
        "inference.shadow_model": str(TINY_MODEL),
        "inference.pool_size": "1",
        "pipeline.deadline_ms": "60000",
        "log.level": "debug",
    }
    worker = Worker(kafka_bootstrap, topics, group, tmp_path, "privacy", settings=settings, model=None)
    try:
        worker.wait_for("partitions_assigned", timeout=300)
        _publish(kafka_bootstrap, topics.input, tickets)
        wait_until_committed(kafka_bootstrap, group, topics.input, timeout=600, worker=worker)
        assert worker.stop() == 0
    finally:
        worker.kill()

    # Routers learn the kinds from every result, and nothing else of them.
    outputs = _values(kafka_bootstrap, topics.output)
    results = [msgspec.json.decode(m.value() or b"", type=TriageResult) for m in outputs]
    assert sorted(r.ticket_id for r in results) == sorted(by_id)
    assert {r.ticket_id: r.pii for r in results} == {t.ticket_id: t.kinds for t in tickets}
    assert _leaks(_texts(outputs), identifiers) == []

    # Reviewers get every ticket, redacted, near-misses intact.
    reviews = _values(kafka_bootstrap, review)
    records = [msgspec.json.decode(m.value() or b"", type=ReviewRecord) for m in reviews]
    assert sorted(r.ticket_id for r in records) == sorted(by_id)
    assert _leaks(_texts(reviews), identifiers) == []
    for record in records:
        ticket = by_id[record.ticket_id]
        assert record.pii == ticket.kinds
        assert all(miss in record.body for miss in ticket.near_misses), record.body
        if any(kind == "card_number" for kind in ticket.kinds):
            assert "[card ••••" in record.body

    shadows = _values(kafka_bootstrap, shadow)
    assert shadows, "the shadow wrote nothing"
    assert all(
        msgspec.json.decode(m.value() or b"", type=ShadowResult).pii
        == by_id[msgspec.json.decode(m.value() or b"", type=ShadowResult).ticket_id].kinds
        for m in shadows
    )
    assert _leaks(_texts(shadows), identifiers) == []

    # Dead letters keep the record as taken (replay needs it); the worker's words about it are redacted.
    letters = _values(kafka_bootstrap, topics.dead_letter)
    assert sorted((m.key() or b"").decode() for m in letters) == sorted(POISON)
    assert {m.value() for m in letters} == set(POISON.values())
    headers = [(v or b"").decode() for m in letters for _, v in record_headers(m) or []]
    assert _leaks(headers, identifiers) == []

    # The worker's own log, at debug level.
    final = worker.events("metrics")[-1]
    assert final["pii_tickets"] == TICKETS
    assert set(final["pii_found"]) == {kind for ticket in tickets for kind in ticket.kinds}
    assert _leaks(_log_texts(worker.log_path), identifiers) == []

    report = subprocess.run(
        [sys.executable, "-m", "worker", "shadow", "report", "--bootstrap-servers", kafka_bootstrap,
         "--topic", shadow, "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert report.returncode == 0, report.stderr[-2000:]
    assert _leaks([report.stdout, report.stderr], identifiers) == []

    # Reviewers' verdicts: by source position (text from the review topic), and some with the text in clear.
    producer = confluent_kafka.Producer({"bootstrap.servers": kafka_bootstrap})
    for number, record in enumerate(records):
        ticket = by_id[record.ticket_id]
        with_text = number % 3 == 0  # the ticket's own text, identifiers and all
        text = f"{ticket.subject or ''}\n{ticket.body}" if with_text else None
        event = FeedbackEvent(
            ticket_id=record.ticket_id,
            # They confirm the model's answer; for a ticket it found out of scope, the intent it came nearest
            # (a verdict of "none of these" is no training example).
            intent=record.nearest_intent or record.intent,
            source=None if with_text else record.source,
            text=text,
            model_intent=record.intent,
            reviewer="script",
            reviewed_at="2026-11-02T10:00:00.000Z",
        )
        producer.produce(feedback, key=record.ticket_id.encode(), value=msgspec.json.encode(event))
    assert producer.flush(30) == 0
    tuned = tmp_path / "tuned"
    command = [
        sys.executable, "-m", "worker", "model", "train", "--feedback-topic", feedback,
        "--bootstrap-servers", kafka_bootstrap, "--out", str(tuned), "--replay-per-intent", "2",
        "--holdout", "0", "--test-limit", "50", "--set", f"topics.review={review}",
        "--set", f"topics.dead_letter={feedback_dead_letters}", "--set", f"pipeline.group_id={group}",
    ]  # fmt: skip
    trained = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert f"{len(records)} tickets with a verdict (0 records refused)" in trained.stderr
    assert _leaks([trained.stdout, trained.stderr], identifiers) == []
    written = [path for path in tuned.rglob("*") if path.is_file()]
    assert any(path.name == "training.json" for path in written)
    for path in written:
        content = path.read_bytes()
        assert [i for i in identifiers if i.encode() in content] == [], path
