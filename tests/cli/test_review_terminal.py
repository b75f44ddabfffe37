"""`triage-worker review` as a reviewer meets it: in a terminal (a pseudo-terminal here), keyboard only,
against the real broker. Accept, correct through the searchable intent list, skip, a key it does not know,
Esc out of the list, quit; a record that is not a ReviewRecord is skipped; the next session goes on where
the last one stopped, and `--limit` ends it. The verdicts are FeedbackEvents on the feedback topic, which
the trainer's reader takes as corrections, while bad feedback on the same topic (malformed, an unknown
intent, an unknown ticket) goes to the dead-letter topic with its reason."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import confluent_kafka
import msgspec
import pytest

from tools import REPO
from tools.harness import read_topic
from worker.inference.taxonomy import load_taxonomy
from worker.kafka import dead_letters
from worker.kafka.clients import record_headers
from worker.learning.feedback import read_feedback_topic
from worker.messages import FeedbackEvent, ReviewRecord, SourcePosition
from worker.settings import DEFAULT_MODEL_DIR, load_settings

pytestmark = [pytest.mark.kafka]

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b[()][A-Z0-9]|\x1b[=>]|\r")


class Terminal:
    """A command on a pseudo-terminal: `expect` waits for text on its screen, `type` presses keys."""

    def __init__(self, command: list[str]) -> None:
        self._master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "TRIAGE_"))}
        env.update(COLUMNS="120", LINES="40", TERM="xterm")
        self.process = subprocess.Popen(
            command, cwd=REPO, env=env, stdin=slave, stdout=slave, stderr=slave, close_fds=True
        )
        os.close(slave)
        self.screen = ""

    def expect(self, text: str, timeout: float = 90.0) -> str:
        """Everything shown up to and including `text` (consumed)."""
        deadline = time.monotonic() + timeout
        while text not in self.screen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{text!r} not shown within {timeout}s; screen:\n{self.screen[-3000:]}")
            ready, _, _ = select.select([self._master], [], [], min(left, 0.5))
            if ready:
                try:
                    chunk = os.read(self._master, 65536)
                except OSError:  # the command exited and closed the terminal
                    chunk = b""
                if not chunk and self.process.poll() is not None:
                    raise AssertionError(f"exited before showing {text!r}; screen:\n{self.screen[-3000:]}")
                self.screen += _ANSI.sub("", chunk.decode("utf-8", errors="replace"))
        shown, self.screen = self.screen.split(text, 1)
        return shown + text

    def type(self, keys: str) -> None:
        os.write(self._master, keys.encode())

    def close(self, timeout: float = 60.0) -> int:
        try:
            return self.process.wait(timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            os.close(self._master)


def _record(ticket_id: str, offset: int, intent: str, body: str) -> bytes:
    record = ReviewRecord(
        schema_version=1,
        ticket_id=ticket_id,
        intent=intent,
        priority="Medium",
        confidence=0.31,
        fallback=False,
        fallback_reason=None,
        scores={intent: 0.31, "card_delivery_estimate": 0.29},
        model="triage-mini",
        latency_ms=3.0,
        classified_at="2026-11-02T10:00:00.000Z",
        source=SourcePosition(topic="tickets.raw", partition=0, offset=offset),
        truncated=False,
        pii=[],
        review_reason="low_confidence",
        body=body,
        subject=None,
    )
    return msgspec.json.encode(record)


def _feedback(ticket_id: str, intent: str, text: str | None = None) -> bytes:
    event = FeedbackEvent(
        ticket_id=ticket_id, intent=intent, text=text, reviewer="bob", reviewed_at="2026-11-02T10:00:00Z"
    )
    return msgspec.json.encode(event)


def _review(bootstrap: str, review: str, feedback: str, group: str, *extra: str) -> Terminal:
    command = [sys.executable, "-m", "worker", "review", "--bootstrap-servers", bootstrap]
    command += ["--topic", review, "--feedback-topic", feedback, "--group", group, "--reviewer", "alice"]
    return Terminal([*command, *extra])


def test_a_reviewer_accepts_corrects_and_skips_from_the_keyboard(
    kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    review, feedback = unique_topic("review", partitions=1), unique_topic("feedback", partitions=1)
    producer = confluent_kafka.Producer({"bootstrap.servers": kafka_bootstrap})
    values = [
        _record("T-accept", 10, "card_arrival", "Has my card been sent yet?"),
        b'{"not": "a review record"}',
        _record("T-correct", 11, "card_arrival", "Someone took my card from my bag this morning"),
        _record("T-skip", 12, "card_arrival", "When do cards usually come?"),
        _record("T-last", 13, "card_arrival", "Card still missing after a week"),
    ]
    for value in values:
        producer.produce(review, value=value)
    assert producer.flush(30) == 0
    group = f"review-{uuid.uuid4().hex[:8]}"

    terminal = _review(kafka_bootstrap, review, feedback, group, "--from", "beginning")
    try:
        screen = terminal.expect("Has my card been sent yet?")
        assert "T-accept" in screen and "Ticket 1" in screen
        terminal.expect("q quit")
        terminal.type("a")
        screen = terminal.expect("Someone took my card from my bag this morning")
        assert "accepted 1, corrected 0" in screen and "1 unreadable records skipped" in screen
        terminal.expect("q quit")
        terminal.type("c")
        terminal.expect("Search:")
        terminal.type("stolen")
        screen = terminal.expect("> lost_or_stolen_card")
        terminal.type("\r")
        screen = terminal.expect("When do cards usually come?")
        assert "accepted 1, corrected 1" in screen
        terminal.expect("q quit")
        terminal.type("s")
        terminal.expect("Card still missing after a week")
        terminal.expect("q quit")
        terminal.type("x")
        terminal.expect("keys: a accept, c correct, s skip, q quit")
        terminal.type("c")
        terminal.expect("Search:")
        terminal.type("\x1b")  # Esc: back to the ticket, nothing written
        terminal.expect("Card still missing after a week")
        terminal.expect("q quit")
        terminal.type("q")
        terminal.expect("Stopped. accepted 1, corrected 1, skipped 1")
        assert terminal.close() == 0
    finally:
        if terminal.process.poll() is None:
            terminal.process.kill()

    # Bad feedback from elsewhere lands on the same topic between sessions: review only writes there, so
    # the next session is not disturbed; the trainer's reader dead-letters each with its reason (below).
    bad_feedback = [
        b'{"ticket_id": "T-accept", "intent": "card_arrival"',
        _feedback("T-skip", "no_such_intent", text="When do cards usually come?"),
        _feedback("T-nowhere", "card_arrival"),
    ]
    for value in bad_feedback:
        producer.produce(feedback, value=value)
    assert producer.flush(30) == 0

    # The next session goes on at the ticket the last one quit on; --limit 1 ends it after that one. The
    # reviewer finds it fits none of the intents: the taxonomy's out-of-scope intent is on the list (#46).
    terminal = _review(kafka_bootstrap, review, feedback, group, "--limit", "1")
    try:
        screen = terminal.expect("Card still missing after a week")
        assert "Ticket 1" in screen and "T-last" in screen
        terminal.expect("q quit")
        terminal.type("c")
        terminal.expect("Search:")
        terminal.type("unclass")
        terminal.expect("> unclassified")
        terminal.type("\r")
        terminal.expect("Stopped after 1 tickets (--limit). accepted 0, corrected 1, skipped 0")
        assert terminal.close() == 0
    finally:
        if terminal.process.poll() is None:
            terminal.process.kill()

    decoder = msgspec.json.Decoder(FeedbackEvent)
    written = [m.value() or b"" for m in read_topic(kafka_bootstrap, feedback)]
    events = [decoder.decode(value) for value in written if value not in bad_feedback]
    verdicts = [(e.ticket_id, e.model_intent, e.intent, e.reviewer) for e in events]
    assert verdicts == [
        ("T-accept", "card_arrival", "card_arrival", "alice"),
        ("T-correct", "card_arrival", "lost_or_stolen_card", "alice"),
        ("T-last", "card_arrival", "unclassified", "alice"),
    ]
    corrected = events[1]
    assert corrected.text == "Someone took my card from my bag this morning"
    assert corrected.source == SourcePosition(topic="tickets.raw", partition=0, offset=11)

    # What `model train --feedback-topic` reads (the taxonomy's intents and "none of these" are verdicts): the
    # reviewer's three verdicts are corrections, and each bad record is a dead letter naming its reason and
    # its place on the feedback topic.
    dead_letter_topic = unique_topic("feedback-dlq", partitions=1)
    settings = load_settings(
        env={},
        overrides={
            "kafka.bootstrap.servers": kafka_bootstrap,
            "topics.review": review,
            "topics.feedback": feedback,
            "topics.dead_letter": dead_letter_topic,
            "pipeline.group_id": group,
        },
    )
    labels = load_taxonomy(DEFAULT_MODEL_DIR / "taxonomy.toml").verdict_labels
    corrections, refused = read_feedback_topic(
        settings.kafka,
        settings.pipeline,
        settings.topics,
        settings.privacy,
        settings.dead_letter,
        labels,
        progress=False,
    )
    assert [(c.ticket_id, c.intent) for c in corrections] == [
        ("T-accept", "card_arrival"),
        ("T-correct", "lost_or_stolen_card"),
        ("T-last", "unclassified"),
    ]
    assert [r.error_type for r in refused] == ["invalid_feedback", "unknown_intent", "unknown_ticket"]
    dead = list(read_topic(kafka_bootstrap, dead_letter_topic))
    assert [m.value() for m in dead] == bad_feedback
    infos = [dead_letters.read_dead_letter(record_headers(m)) for m in dead]
    assert [(i.error_type, i.topic, i.offset) for i in infos] == [
        ("invalid_feedback", feedback, 2),
        ("unknown_intent", feedback, 3),
        ("unknown_ticket", feedback, 4),
    ]
    assert "no_such_intent" in infos[1].error_message and "T-nowhere" in infos[2].error_message


def test_review_without_a_terminal_says_so_in_one_line(kafka_bootstrap: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "worker", "review", "--bootstrap-servers", kafka_bootstrap],
        cwd=REPO,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "triage-worker: error: review needs a terminal to read keys from (over SSH: ssh -t)"
    )
