"""`triage-worker review`: a keyboard-only terminal reviewer for the review topic (works over SSH).

Each ticket on the review topic (`topics.review`: results under `review.threshold`, and fallbacks when
`review.fallbacks` is on) is shown with the model's answer and its top scores; the reviewer accepts it
(`a` or Enter), corrects it (`c`: a searchable list of the taxonomy's intents and its out-of-scope intent,
"none of these": type to filter, arrows to move, Enter to pick, Esc to go back), skips it (`s`) or quits
(`q`). A verdict is written to the feedback topic (`topics.feedback`) as a FeedbackEvent carrying the
ticket's text, and waits for the broker's acknowledgement before the next ticket is shown.

Where a reviewer got to is the committed offset of the review group (`<pipeline.group_id>.review`): a new
session goes on from there. `--from beginning|end|OFFSET|TIME` starts elsewhere (TIME: RFC 3339, e.g.
2024-05-01T12:00:00Z) and `--limit N` stops after N tickets: a slice of the topic. The session ends when the
topic holds no more tickets. Records that are not ReviewRecords are skipped (counted on screen), as is a
ticket already decided in this session (a redone ticket is written to the review topic again).
"""

from __future__ import annotations

import argparse
import datetime
import getpass
import os
import select
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import confluent_kafka
import msgspec
from rich.console import Console
from rich.markup import escape

from worker.classification import ticket_text
from worker.errors import UserError
from worker.inference.loading import resolve_taxonomy
from worker.kafka.admin import existing_topics
from worker.kafka.clients import (
    ClientErrorLog,
    create_consumer,
    create_producer,
    kafka_call,
    produce,
    producer_config,
)
from worker.messages import FeedbackEvent, ReviewRecord, utc_timestamp
from worker.settings import Settings, add_config_argument, settings_from_args

_DECODER = msgspec.json.Decoder(ReviewRecord)
_ENCODER = msgspec.json.Encoder()
_TIMEOUT_S = 10.0
_SHOWN = 10  # intents listed at once in the picker
_KEYS = {"\x1b[A": "up", "\x1bOA": "up", "\x1b[B": "down", "\x1bOB": "down", "\r": "enter", "\n": "enter"}


class Keyboard:
    """Keys from a terminal in cbreak mode: printable characters, or up, down, enter, esc, backspace."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._pending = ""

    def read(self) -> str:
        while not self._pending:
            ready, _, _ = select.select([self._fd], [], [], 0.5)
            if ready:
                chunk = os.read(self._fd, 64)
                if not chunk:
                    raise EOFError
                self._pending += chunk.decode("utf-8", errors="ignore")
        for sequence, name in _KEYS.items():
            if self._pending.startswith(sequence):
                self._pending = self._pending[len(sequence) :]
                return name
        key, self._pending = self._pending[0], self._pending[1:]
        if key == "\x1b":
            # A lone Esc; the rest of an unknown escape sequence is dropped.
            if self._pending.startswith(("[", "O")):
                self._pending = self._pending[2:]
            return "esc"
        return "backspace" if key in ("\x7f", "\x08") else key


def matches(labels: Sequence[str], query: str, first: Sequence[str] = ()) -> list[str]:
    """Labels containing every word of `query` (case-insensitive; `_` and spaces both separate words),
    `first` (the model's top candidates) ahead of the rest."""
    words = query.lower().replace("_", " ").split()
    ordered = [label for label in first if label in labels] + sorted(set(labels) - set(first))
    return [label for label in ordered if all(word in label.replace("_", " ") for word in words)]


@dataclass
class Picker:
    """The searchable intent list's state."""

    labels: Sequence[str]
    first: Sequence[str]
    query: str = ""
    selected: int = 0

    def shown(self) -> list[str]:
        return matches(self.labels, self.query, self.first)

    def press(self, key: str) -> str | None:
        """Apply a key; the picked label on Enter (when something matches), else None."""
        found = self.shown()
        if key == "enter" and found:
            return found[min(self.selected, len(found) - 1)]
        if key == "up":
            self.selected = max(0, self.selected - 1)
        elif key == "down":
            self.selected = min(max(0, len(found) - 1), self.selected + 1)
        elif key == "backspace":
            self.query, self.selected = self.query[:-1], 0
        elif len(key) == 1 and key.isprintable():
            self.query, self.selected = self.query + key, 0
        return None


@dataclass
class Session:
    decided: set[str] = field(default_factory=set)
    accepted: int = 0
    corrected: int = 0
    skipped: int = 0
    unreadable: int = 0


class Reviewer:
    """One review session: the consumer of the review topic, the feedback producer, the screen."""

    def __init__(self, settings: Settings, args: argparse.Namespace, console: Console, keys: Keyboard):
        self._settings = settings
        self._topics = settings.topics
        self._console = console
        self._keys = keys
        self._reviewer = args.reviewer or getpass.getuser()
        self._limit: int | None = args.limit
        # "None of these" is a verdict too: `model train --feedback` measures the out-of-scope detector on it.
        self._labels = resolve_taxonomy(settings.inference)[0].verdict_labels
        self.session = Session()
        group = args.group or f"{settings.pipeline.group_id}.review"
        overrides = {"group.id": group, "enable.partition.eof": "true"}
        self._consumer = kafka_call(
            "create a consumer",
            lambda: create_consumer(settings.kafka, settings.pipeline, overrides=overrides),
            settings.kafka,
        )
        self._producer = create_producer(settings.kafka, ClientErrorLog("review-feedback"))
        self._start(args.start)

    def close(self) -> None:
        self._consumer.close()
        self._producer.flush(_TIMEOUT_S)

    def _start(self, start: str | None) -> None:
        topic = self._topics.review
        metadata = kafka_call(
            "read topic metadata", lambda: self._consumer.list_topics(topic, timeout=_TIMEOUT_S), None
        )
        partitions = [
            confluent_kafka.TopicPartition(topic, p) for p in sorted(metadata.topics[topic].partitions)
        ]
        if start is None:
            positions = kafka_call(
                "read where the review group got to",
                lambda: self._consumer.committed(partitions, timeout=_TIMEOUT_S),
                self._settings.kafka,
            )
            positions = [
                confluent_kafka.TopicPartition(topic, tp.partition, tp.offset)
                if tp.offset >= 0
                else confluent_kafka.TopicPartition(topic, tp.partition, confluent_kafka.OFFSET_BEGINNING)
                for tp in positions
            ]
        elif start in ("beginning", "end"):
            offset = confluent_kafka.OFFSET_BEGINNING if start == "beginning" else confluent_kafka.OFFSET_END
            positions = [confluent_kafka.TopicPartition(topic, tp.partition, offset) for tp in partitions]
        elif start.isdigit():
            positions = [confluent_kafka.TopicPartition(topic, tp.partition, int(start)) for tp in partitions]
        else:
            millis = int(_parse_time(start).timestamp() * 1000)
            wanted = [confluent_kafka.TopicPartition(topic, tp.partition, millis) for tp in partitions]
            positions = kafka_call(
                "find offsets by time",
                lambda: self._consumer.offsets_for_times(wanted, timeout=_TIMEOUT_S),
                self._settings.kafka,
            )
        self._consumer.assign(positions)

    def records(self) -> Iterator[confluent_kafka.Message]:
        """Records of the review topic until every partition is at its end."""
        open_partitions = {tp.partition for tp in self._consumer.assignment()}
        while open_partitions:
            message = self._consumer.poll(1.0)
            if message is None:
                continue
            error = message.error()
            if error is not None:
                if error.code() == confluent_kafka.KafkaError._PARTITION_EOF:
                    open_partitions.discard(message.partition())
                elif error.fatal():
                    raise UserError(f"Kafka: consumer failed: {error.str()}")
                continue
            open_partitions.add(message.partition())
            yield message

    def run(self) -> int:
        shown = 0
        for message in self.records():
            try:
                record = _DECODER.decode(message.value() or b"")
            except msgspec.DecodeError:
                self.session.unreadable += 1
                self._done(message)
                continue
            if record.ticket_id in self.session.decided:
                self._done(message)
                continue
            shown += 1
            if not self._review(record, shown):
                return 0
            self._done(message)
            if self._limit is not None and shown >= self._limit:
                self._screen()
                self._console.print(f"[bold]Stopped after {shown} tickets (--limit).[/bold] {self._tally()}")
                return 0
        self._screen()
        self._console.print(f"[bold]No more tickets to review.[/bold] {self._tally()}")
        return 0

    def _review(self, record: ReviewRecord, number: int) -> bool:
        """Show one ticket until the reviewer decides; False when they quit."""
        note = ""
        while True:
            self._ticket(record, number, note)
            key = self._keys.read()
            if key == "q":
                self._console.print(f"Stopped. {self._tally()}")
                return False
            if key == "s":
                self.session.skipped += 1
                return True
            if key in ("a", "enter"):
                intent = record.intent
            elif key == "c":
                picked = self._pick(record)
                if picked is None:
                    continue
                intent = picked
            else:
                note = "keys: a accept, c correct, s skip, q quit"
                continue
            problem = self._send(record, intent)
            if problem is None:
                self.session.decided.add(record.ticket_id)
                if intent == record.intent:
                    self.session.accepted += 1
                else:
                    self.session.corrected += 1
                return True
            note = f"[red]not saved: {escape(problem)}[/red] (press a key to try again)"

    def _pick(self, record: ReviewRecord) -> str | None:
        picker = Picker(self._labels, list(record.scores))
        while True:
            self._screen()
            self._console.print(f"Correct [bold]{escape(record.ticket_id)}[/bold]: type to search, "
                                "up/down to move, Enter to pick, Esc to go back")  # fmt: skip
            self._console.print(f"Search: {escape(picker.query)}_")
            found = picker.shown()
            for index, label in enumerate(found[:_SHOWN]):
                marker = "[reverse]>" if index == picker.selected else " "
                end = "[/reverse]" if index == picker.selected else ""
                score = record.scores.get(label)
                extra = f"  ({score:.2f})" if score is not None else ""
                self._console.print(f"{marker} {label}{extra}{end}")
            if not found:
                self._console.print("  (no intent matches)")
            elif len(found) > _SHOWN:
                self._console.print(f"  ... {len(found) - _SHOWN} more: type to narrow")
            key = self._keys.read()
            if key == "esc":
                return None
            chosen = picker.press(key)
            if chosen is not None:
                return chosen
            picker.selected = min(picker.selected, _SHOWN - 1)

    def _send(self, record: ReviewRecord, intent: str) -> str | None:
        """Write the verdict and wait for the broker; the problem when it was not acknowledged."""
        event = FeedbackEvent(
            ticket_id=record.ticket_id,
            intent=intent,
            source=record.source,
            text=ticket_text(record.subject, record.body),
            model_intent=record.intent,
            reviewer=self._reviewer,
            reviewed_at=utc_timestamp(),
        )
        failures: list[str] = []

        def on_delivery(error: confluent_kafka.KafkaError | None, _message: Any) -> None:
            if error is not None:
                failures.append(error.str())

        try:
            produce(
                self._producer,
                self._topics.feedback,
                _ENCODER.encode(event),
                record.ticket_id.encode(),
                None,
                on_delivery,
            )
        except (BufferError, confluent_kafka.KafkaException) as error:
            return str(error)
        if self._producer.flush(_TIMEOUT_S):
            return f"not acknowledged within {_TIMEOUT_S:.0f}s"
        return failures[0] if failures else None

    def _done(self, message: confluent_kafka.Message) -> None:
        """The ticket is dealt with: the group's position moves past it."""
        topic, partition, offset = message.topic(), message.partition(), message.offset()
        if topic is None or partition is None or offset is None:
            return
        position = confluent_kafka.TopicPartition(topic, partition, offset + 1)
        try:
            # Retried while a young group's coordinator settles (NOT_COORDINATOR for a few seconds).
            kafka_call(
                "save the review position",
                lambda: self._consumer.commit(offsets=[position], asynchronous=False),
                self._settings.kafka,
            )
        except UserError as error:
            self._console.print(f"[yellow]{escape(str(error))}[/yellow]")

    def _screen(self) -> None:
        self._console.clear()

    def _tally(self) -> str:
        session = self.session
        text = f"accepted {session.accepted}, corrected {session.corrected}, skipped {session.skipped}"
        return text + (f", {session.unreadable} unreadable records skipped" if session.unreadable else "")

    def _ticket(self, record: ReviewRecord, number: int, note: str) -> None:
        self._screen()
        source = record.source
        reason = "fallback: " + (record.fallback_reason or "") if record.fallback else "low confidence"
        self._console.print(
            f"[bold]Ticket {number}[/bold]  {escape(record.ticket_id)}  "
            f"({source.topic}[{source.partition}]@{source.offset})  {reason}"
        )
        self._console.print(f"[dim]{self._tally()}[/dim]")
        if record.subject:
            self._console.print(f"[bold]Subject:[/bold] {escape(record.subject)}")
        self._console.print(escape(record.body[:2000]) or "(empty)")
        self._console.print(
            f"\nModel: [bold]{escape(record.intent)}[/bold] ({record.priority}), confidence "
            f"{record.confidence:.2f}, {escape(record.model)}"
        )
        scores = ", ".join(f"{escape(label)} {score:.2f}" for label, score in record.scores.items())
        if scores:
            self._console.print(f"Top: {scores}")
        self._console.print(
            "\n[bold]a[/bold] accept  [bold]c[/bold] correct  [bold]s[/bold] skip  [bold]q[/bold] quit"
        )
        if note:
            self._console.print(note)


def _parse_time(text: str) -> datetime.datetime:
    try:
        moment = datetime.datetime.fromisoformat(text.upper())
    except ValueError:
        raise UserError(f"--from {text!r}: expected beginning, end, an offset or an RFC 3339 time") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=datetime.UTC)


def register(subparsers: argparse._SubParsersAction[Any]) -> None:
    parser = subparsers.add_parser(
        "review",
        help="accept or correct the tickets on the review topic, keyboard only (writes feedback)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    add_config_argument(parser)
    parser.add_argument("--bootstrap-servers", metavar="SERVERS", help="Kafka bootstrap servers, host:port")
    parser.add_argument("--topic", help="review topic (default topics.review: tickets.review)")
    parser.add_argument("--feedback-topic", help="feedback topic (default topics.feedback: tickets.feedback)")
    parser.add_argument(
        "--from",
        dest="start",
        metavar="WHERE",
        help="beginning | end | OFFSET (each partition) | RFC 3339 time (default: where the group got to)",
    )
    parser.add_argument("--limit", type=int, metavar="N", help="stop after N tickets")
    parser.add_argument("--reviewer", help="your name in the feedback (default: the login name)")
    parser.add_argument("--group", help="consumer group that keeps your place (default <group_id>.review)")
    parser.add_argument("--taxonomy", metavar="FILE", help="intents to pick from (default: the model's)")
    parser.set_defaults(handler=_review)


def _review(args: argparse.Namespace) -> int:
    settings = settings_from_args(
        args,
        {
            "kafka.bootstrap.servers": args.bootstrap_servers,
            "topics.review": args.topic,
            "topics.feedback": args.feedback_topic,
            "inference.taxonomy": args.taxonomy,
        },
    )
    if args.limit is not None and args.limit < 1:
        raise UserError("--limit: expected a number >= 1")
    if args.start is not None and args.start not in ("beginning", "end") and not args.start.isdigit():
        _parse_time(args.start)
    if not sys.stdin.isatty():
        raise UserError("review needs a terminal to read keys from (over SSH: ssh -t)")
    existing = existing_topics(producer_config(settings.kafka))
    missing = [t for t in (settings.topics.review, settings.topics.feedback) if t not in existing]
    if missing:
        raise UserError(
            f"topic(s) {', '.join(missing)} do not exist on {settings.kafka.get('bootstrap.servers')}; "
            "create them with `triage-worker topics create` with review on"
        )
    import termios  # POSIX terminals only (Windows: run it over SSH from a POSIX host)
    import tty

    console = Console(highlight=False)
    fd = sys.stdin.fileno()
    saved = termios.tcgetattr(fd)
    reviewer = Reviewer(settings, args, console, Keyboard(fd))
    try:
        tty.setcbreak(fd)
        return reviewer.run()
    except EOFError:
        return 0
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)
        reviewer.close()
