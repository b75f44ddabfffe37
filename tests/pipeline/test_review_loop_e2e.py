"""The review loop end to end (issue #24), on the real broker with the real embedded model, at small scale:

1. tickets of a pair of intents the embedded model confuses go through the worker; those under
   `review.threshold` also go to the review topic, with their text;
2. scripted corrections (what a reviewer would say: BANKING77's own labels) go to the feedback topic, with
   one bad record of each kind, which are dead-lettered with their reason;
3. a quick fine-tune (`model train --feedback-topic`) writes a new model folder with its model card;
4. the worker restarts with it as the shadow; the corrected tickets are sent again (new ids) and the shadow
   agrees more with the corrections than the primary does (`shadow report` shows the two models);
5. the new model is promoted with a reload (SIGHUP), and the same tickets sent once more are classified as
   corrected (as the shadow classified them).
Small scale on purpose (half the pair's test tickets, 8 original tickets per intent mixed in): how much a
fine-tune generalises to *new* tickets is measured at full scale in docs/review-loop.md, not here.
Through all of it, every ticket has exactly one record on the primary output: no loss, no duplicate.
"""

from __future__ import annotations

import csv
import json
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import confluent_kafka
import msgspec
import pytest

from tools import REPO
from tools.harness import Topics, Worker, audit, make_topics, read_topic, wait_until_committed
from worker.inference.taxonomy import load_taxonomy
from worker.kafka import dead_letters
from worker.kafka.clients import record_headers
from worker.learning.feedback import read_feedback_topic
from worker.messages import FeedbackEvent, ReviewRecord, ShadowResult, TicketEvent, TriageResult
from worker.settings import DEFAULT_MODEL_DIR, load_settings

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

# The embedded model's most confused pair on BANKING77 test.csv (measured: see docs/review-loop.md).
PAIR = ("exchange_via_app", "fiat_currency_support")
THRESHOLD = 0.99
TUNED = "tuned"  # the fine-tuned folder's name: its model id


def _pair_tickets() -> list[tuple[str, str]]:
    with (REPO / "data" / "banking77" / "test.csv").open(encoding="utf-8", newline="") as handle:
        rows = [(row["text"], row["category"].lower().rstrip("?")) for row in csv.DictReader(handle)]
    return [row for row in rows if row[1] in PAIR]


def _publish(bootstrap: str, topic: str, tickets: list[tuple[str, str]]) -> None:
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True})
    for ticket_id, text in tickets:
        value = msgspec.json.encode(TicketEvent(ticket_id=ticket_id, body=text))
        producer.produce(topic, key=ticket_id.encode(), value=value)
    assert producer.flush(60) == 0


def _configure(config: Path, topics: dict[str, str], model: Path, shadow: Path | None = None) -> None:
    lines = ["[inference]", f"model = {json.dumps(str(model))}", "pool_size = 1"]
    if shadow is not None:
        lines.append(f"shadow_model = {json.dumps(str(shadow))}")
    lines += [
        "",
        "[pipeline]",
        "deadline_ms = 60000",
        "",
        "[review]",
        f"threshold = {THRESHOLD}",
        "",
        "[topics]",
    ]
    lines += [f"{name} = {json.dumps(topic)}" for name, topic in topics.items()]
    config.write_text("\n".join(lines) + "\n")


def _decode_all(bootstrap: str, topic: str, kind: type[msgspec.Struct]) -> list[object]:
    decoder = msgspec.json.Decoder(kind)
    return [decoder.decode(message.value() or b"") for message in read_topic(bootstrap, topic)]


def _publish_shadowed(bootstrap: str, topic: str, tickets: list[tuple[str, str]], worker: Worker) -> None:
    """Two tickets at a time, each pair once the shadow answered the ones before: the shadow's drop rule
    (at most two outstanding with one context) must not leave a ticket out of the comparison."""
    for start in range(0, len(tickets), 2):
        _publish(bootstrap, topic, tickets[start : start + 2])
        sent = min(start + 2, len(tickets))
        deadline = time.monotonic() + 300
        while True:
            metrics = worker.metrics()
            shadow = metrics[-1].get("shadow") if metrics else None
            if shadow and shadow["produced"] + sum(shadow["dropped"].values()) >= sent:
                assert shadow["dropped"] == {}, shadow
                break
            assert time.monotonic() < deadline, f"the shadow did not answer {sent} tickets:\n{worker.tail()}"
            time.sleep(0.3)


def _accuracy(intents: dict[str, str], truth: dict[str, str]) -> float:
    return sum(intents[t] == truth[t] for t in intents) / len(intents)


# Two worker starts, a fine-tune and a reload: over 15 minutes on the shared 2-core machine at a load
# average of 15 (measured), past the suite's default 900 s.
@pytest.mark.timeout(2400)
def test_the_review_loop_from_low_confidence_tickets_to_a_promoted_model(
    kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    topics: Topics = make_topics(unique_topic)
    side = {
        "input": topics.input,
        "output": topics.output,
        "dead_letter": topics.dead_letter,
        "review": unique_topic("review", partitions=1),
        "feedback": unique_topic("feedback", partitions=1),
        "shadow": unique_topic("shadow", partitions=1),
    }
    feedback_dead_letters = unique_topic("feedback-dlq", partitions=1)
    tickets = _pair_tickets()
    assert {intent for _, intent in tickets} == set(PAIR)
    seen = tickets[0::2]  # half of the pair's test tickets: a small scale that fits the suite's time
    truth = {f"S-{i}": intent for i, (_, intent) in enumerate(seen)}
    config = tmp_path / "worker.toml"
    _configure(config, side, DEFAULT_MODEL_DIR)
    group = f"triage-loop-{uuid.uuid4().hex[:8]}"
    tuned = tmp_path / TUNED

    # 1. The embedded model; what it is unsure of goes to review.
    worker = Worker(
        kafka_bootstrap, topics, group, tmp_path, "primary", model=None, args=("--config", str(config))
    )
    try:
        _publish(kafka_bootstrap, topics.input, [(f"S-{i}", text) for i, (text, _) in enumerate(seen)])
        wait_until_committed(kafka_bootstrap, group, topics.input, timeout=600, worker=worker)
        assert worker.stop() == 0
    finally:
        worker.kill()
    to_review = [
        r for r in _decode_all(kafka_bootstrap, side["review"], ReviewRecord) if isinstance(r, ReviewRecord)
    ]
    assert to_review, "nothing went to review"
    assert all(r.confidence < THRESHOLD and r.review_reason == "low_confidence" for r in to_review)
    assert {r.ticket_id for r in to_review} <= set(truth)
    wrong_before = sum(r.intent != truth[r.ticket_id] for r in to_review)
    assert wrong_before > 0, "the pair is not confused on these tickets"

    # 2. A reviewer's verdicts (by source position: the trainer finds the text on the review topic), and
    # one bad record of each kind.
    producer = confluent_kafka.Producer({"bootstrap.servers": kafka_bootstrap})
    for record in to_review:
        event = FeedbackEvent(
            ticket_id=record.ticket_id,
            intent=truth[record.ticket_id],
            source=record.source,
            model_intent=record.intent,
            reviewer="script",
            reviewed_at="2026-11-02T10:00:00.000Z",
        )
        producer.produce(side["feedback"], key=record.ticket_id.encode(), value=msgspec.json.encode(event))
    bad = [
        FeedbackEvent(
            ticket_id="S-0",
            intent="no_such_intent",
            text="x",
            reviewer="r",
            reviewed_at="2026-11-02T10:00:00Z",
        ),
        FeedbackEvent(ticket_id="nobody", intent=PAIR[0], reviewer="r", reviewed_at="2026-11-02T10:00:00Z"),
    ]
    for event in bad:
        producer.produce(side["feedback"], value=msgspec.json.encode(event))
    producer.produce(side["feedback"], value=b'{"ticket_id": "S-1"')
    assert producer.flush(30) == 0

    # 3. A quick fine-tune (a small replay sample and test slice, to fit the suite's time).
    command = [
        sys.executable, "-m", "worker", "model", "train", "--feedback-topic", side["feedback"],
        "--bootstrap-servers", kafka_bootstrap, "--out", str(tuned), "--replay-per-intent", "4",
        "--holdout", "0", "--test-limit", "100", "--set", f"topics.review={side['review']}",
        "--set", f"topics.dead_letter={feedback_dead_letters}", "--set", f"pipeline.group_id={group}",
    ]  # fmt: skip
    trained = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900, check=False)
    assert trained.returncode == 0, trained.stderr[-3000:]
    print(f"\n[review loop] fine-tune:\n{trained.stdout}")
    assert f"{len(to_review)} tickets with a verdict (3 records refused)" in trained.stderr
    card = (tuned / "README.md").read_text()
    assert "| BANKING77 test |" in card and "| held-out feedback |" in card
    assert json.loads((tuned / "training.json").read_text())["outcome"]["corrections"] == len(to_review)
    refused = {}
    for message in read_topic(kafka_bootstrap, feedback_dead_letters):
        info = dead_letters.read_dead_letter(record_headers(message))
        refused[info.error_type] = info
    assert sorted(refused) == ["invalid_feedback", "unknown_intent", "unknown_ticket"]
    assert {info.topic for info in refused.values()} == {side["feedback"]}
    assert "no_such_intent" in refused["unknown_intent"].error_message
    # Read again (as the next fine-tune does): the refused records are skipped, not dead-lettered twice.
    settings = load_settings(
        env={},
        overrides={
            "kafka.bootstrap.servers": kafka_bootstrap,
            "topics.feedback": side["feedback"],
            "topics.review": side["review"],
            "topics.dead_letter": feedback_dead_letters,
            "pipeline.group_id": group,
        },
    )
    corrections, rejections = read_feedback_topic(
        settings.kafka,
        settings.pipeline,
        settings.topics,
        settings.privacy,
        settings.dead_letter,
        load_taxonomy(tuned / "taxonomy.toml").labels,
        False,
    )
    assert (len(corrections), len(rejections)) == (len(to_review), 3)
    assert len(list(read_topic(kafka_bootstrap, feedback_dead_letters))) == 3

    # 4. The fine-tuned model as the shadow, on new tickets of the same kind.
    _configure(config, side, DEFAULT_MODEL_DIR, shadow=tuned)
    worker = Worker(
        kafka_bootstrap, topics, group, tmp_path, "shadowed", model=None, args=("--config", str(config))
    )
    try:
        worker.wait_for("partitions_assigned", timeout=300)
        # The corrected tickets once more (new ids): whose answers agree with the reviewers'?
        corrected = {r.ticket_id: r for r in to_review}
        again = [(f"C1-{n}", corrected[t].body) for n, t in enumerate(sorted(corrected))]
        truth |= {f"C{batch}-{n}": truth[t] for batch in (1, 2) for n, t in enumerate(sorted(corrected))}
        first = again
        _publish_shadowed(kafka_bootstrap, topics.input, first, worker)
        wait_until_committed(kafka_bootstrap, group, topics.input, timeout=600, worker=worker)
        shadowed = {
            r.ticket_id: r
            for r in _decode_all(kafka_bootstrap, side["shadow"], ShadowResult)
            if isinstance(r, ShadowResult)
        }
        assert set(shadowed) == {ticket for ticket, _ in again}
        primary = {t: r.primary_intent for t, r in shadowed.items()}
        shadow = {t: r.intent for t, r in shadowed.items()}
        primary_right, shadow_right = _accuracy(primary, truth), _accuracy(shadow, truth)
        print(
            f"[review loop] {len(again)} corrected tickets again: primary {primary_right:.2%} and shadow "
            f"{shadow_right:.2%} agree with the reviewers"
        )
        assert shadow_right > primary_right and shadow_right >= 0.9
        report = subprocess.run(
            [sys.executable, "-m", "worker", "shadow", "report", "--bootstrap-servers", kafka_bootstrap,
             "--topic", side["shadow"], "--json"],
            cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert report.returncode == 0, report.stderr
        summary = json.loads(report.stdout)
        # The primary's records come from either stage of the default cascade.
        models = summary["models"]
        assert {m["primary"] for m in models} <= {"triage-mini", "triage-encoder"}
        assert {m["shadow"] for m in models} == {TUNED} and sum(m["tickets"] for m in models) == len(again)
        assert summary["compared"] - summary["agreed"] > 0

        # 5. Promote: the fine-tuned model becomes the primary without a restart.
        _configure(config, side, tuned, shadow=tuned)
        worker.process.send_signal(signal.SIGHUP)
        # Loaded, warmed and staged: the next ticket goes to it (the loop switches on its next hand-over).
        assert worker.wait_for("reload_succeeded", timeout=300)["model"] == TUNED
        _publish(kafka_bootstrap, topics.input, [(t.replace("C1-", "C2-"), text) for t, text in again])
        wait_until_committed(kafka_bootstrap, group, topics.input, timeout=600, worker=worker)
        switched = worker.events("model_switched")
        assert [(e["previous"], e["model"]) for e in switched] == [("triage-mini", TUNED)]
        assert worker.stop() == 0
    finally:
        worker.kill()

    outputs = [
        r for r in _decode_all(kafka_bootstrap, topics.output, TriageResult) if isinstance(r, TriageResult)
    ]
    promoted = {r.ticket_id.replace("C2-", "C1-"): r for r in outputs if r.ticket_id.startswith("C2-")}
    # The promoted model is the cascade's first stage now: its answer is the record's, or the record's
    # `first_intent` where the escalation stage answered.
    assert {r.model for r in promoted.values() if r.stage != "escalation"} == {TUNED}
    firsts = {t: r.first_intent if r.stage == "escalation" else r.intent for t, r in promoted.items()}
    assert firsts == shadow  # as the shadow classified the same texts
    assert all(not r.fallback for r in outputs)
    report_all = audit(kafka_bootstrap, topics)
    assert len(report_all.inputs) == len(seen) + 2 * len(again)
    assert report_all.lost == [] and report_all.duplicates == 0
