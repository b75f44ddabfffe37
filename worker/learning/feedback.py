"""Reviewers' feedback: FeedbackEvents read from the feedback topic or a JSON-lines file, each checked, the
latest verdict per ticket kept: the corrections a fine-tune learns from (worker/learning/fine_tune.py).

A record is rejected, with a reason, when it is not a FeedbackEvent (`invalid_feedback`), names an intent
outside the labels it is given (`unknown_intent`; `model train` gives the taxonomy's intents and its
out-of-scope intent, "none of these"), or names a ticket whose text cannot be found (`unknown_ticket`: no
`text`, and no record on the review topic at its `source` position or with its `ticket_id`). On the topic,
rejected records go to the dead-letter topic once: a consumer group (`<pipeline.group_id>.feedback`) marks
how far the topic has been checked, and only records past that mark are dead-lettered; every later read
still skips them. A later verdict on the same ticket wins (latest `reviewed_at`; on a tie, the later record).
"""

from __future__ import annotations

import datetime
import sys
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import confluent_kafka
import msgspec

from worker.classification import ticket_text
from worker.errors import UserError
from worker.kafka.admin import existing_topics
from worker.kafka.clients import (
    ClientErrorLog,
    create_consumer,
    create_producer,
    kafka_call,
    produce,
    producer_config,
    record_headers,
)
from worker.kafka.side_topics import read_side_topic
from worker.messages import FeedbackEvent, ReviewRecord, SourcePosition
from worker.pipeline.triage.records import DeadLetterRedaction
from worker.privacy.redaction import Redactor
from worker.settings import DeadLetterSettings, PipelineSettings, PrivacySettings, TopicSettings

# `triage.error.type` of the feedback records `model train --feedback-topic` refuses (schemas/dead_letter.md).
FEEDBACK_ERROR_DOCS: tuple[tuple[str, str], ...] = (
    ("invalid_feedback", "not a FeedbackEvent (not JSON, a field missing or of the wrong type)"),
    ("unknown_intent", "the intent is none of the taxonomy's intents, nor its out-of-scope intent"),
    ("unknown_ticket", "no `text`, and no review record at its `source` or with its `ticket_id`"),
)

_FEEDBACK = msgspec.json.Decoder(FeedbackEvent)
_REVIEW = msgspec.json.Decoder(ReviewRecord)
_FLUSH_S = 30.0
_METADATA_TIMEOUT_S = 10.0

Position = tuple[str, int, int]


@dataclass(frozen=True)
class Correction:
    """One ticket's latest verdict, with the text the model saw."""

    ticket_id: str
    text: str
    intent: str
    model_intent: str | None
    reviewer: str
    reviewed_at: str


@dataclass(frozen=True)
class Rejection:
    where: str  # "line 3", "tickets.feedback[0]@12"
    error_type: str
    message: str


def training_redactor(privacy: PrivacySettings) -> Redactor:
    """What masks the corrections' texts: every kind `privacy.detect` names, `privacy.keep` or not (that
    setting is for reviewers' eyes; a training file is a copy on disk)."""
    return privacy.copy_redactor()


@dataclass
class ReviewIndex:
    """Ticket texts from the review topic, by source position and by ticket id (the last record wins)."""

    by_position: dict[Position, str] = field(default_factory=dict)
    by_ticket: dict[str, str] = field(default_factory=dict)

    def add(self, value: bytes | None) -> None:
        try:
            record = _REVIEW.decode(value or b"")
        except msgspec.DecodeError:
            return  # not ours to judge here: `review` skips it too
        text = ticket_text(record.subject, record.body)
        source = record.source
        self.by_position[(source.topic, source.partition, source.offset)] = text
        self.by_ticket[record.ticket_id] = text

    def text_of(self, event: FeedbackEvent) -> str | None:
        if event.text is not None:
            return event.text
        if event.source is not None:
            source = event.source
            found = self.by_position.get((source.topic, source.partition, source.offset))
            if found is not None:
                return found
        return self.by_ticket.get(event.ticket_id)


class FeedbackBook:
    """Checks feedback records one at a time against the taxonomy's `labels` and the review index, keeping
    the latest verdict per ticket. Each correction's text, and each rejection's message, has its personal
    data redacted by `redactor` (default: every kind): a feedback event's `text` is whatever its producer
    sent, and the corrections end up in training files (docs/privacy.md)."""

    def __init__(
        self, labels: Collection[str], index: ReviewIndex | None = None, redactor: Redactor | None = None
    ) -> None:
        self._labels = frozenset(labels)
        self._index = index or ReviewIndex()
        self._redactor = redactor or Redactor()
        self._latest: dict[str, tuple[tuple[datetime.datetime, int], Correction]] = {}
        self._order = 0
        self.records = 0
        self.replaced = 0

    def add(self, value: bytes | None, where: str) -> Rejection | None:
        """Check one record; its Rejection when it is refused."""
        rejection = self._add(value, where)
        if rejection is None:
            return None
        return Rejection(rejection.where, rejection.error_type, self._redactor.redact(rejection.message))

    def _add(self, value: bytes | None, where: str) -> Rejection | None:
        self.records += 1
        self._order += 1
        try:
            event = _FEEDBACK.decode(value or b"")
        except msgspec.DecodeError as error:
            return Rejection(where, "invalid_feedback", f"not a FeedbackEvent: {error}")
        if event.intent not in self._labels:
            return Rejection(
                where, "unknown_intent", f"intent {event.intent[:80]!r} of ticket {event.ticket_id!r} is "
                "not in the taxonomy",
            )  # fmt: skip
        text = self._index.text_of(event)
        if text is None:
            return Rejection(
                where,
                "unknown_ticket",
                f"ticket {event.ticket_id!r}: no text, and no review record at its source or with its id",
            )
        correction = Correction(
            event.ticket_id,
            self._redactor.redact(text),
            event.intent,
            event.model_intent,
            event.reviewer,
            event.reviewed_at,
        )
        rank = (_moment(event.reviewed_at), self._order)
        previous = self._latest.get(event.ticket_id)
        if previous is not None:
            self.replaced += 1
            if previous[0] > rank:
                return None
        self._latest[event.ticket_id] = (rank, correction)
        return None

    def corrections(self) -> list[Correction]:
        """The latest verdict of each ticket, in the order tickets were first seen."""
        return [correction for _, correction in self._latest.values()]


def _moment(stamp: str) -> datetime.datetime:
    try:
        return datetime.datetime.fromisoformat(stamp.upper())
    except ValueError:
        return datetime.datetime.min.replace(tzinfo=datetime.UTC)  # the schema's pattern, an impossible date


def read_feedback_file(
    path: Path, labels: Collection[str], redactor: Redactor | None = None
) -> tuple[list[Correction], list[Rejection]]:
    """FeedbackEvents, one JSON object a line (blank lines skipped); texts must be in the events."""
    book = FeedbackBook(labels, redactor=redactor)
    rejections = []
    try:
        lines = path.read_bytes().splitlines()
    except OSError as error:
        raise UserError(f"cannot read {path}: {error.strerror or error}") from None
    for number, line in enumerate(lines, 1):
        if line.strip():
            rejection = book.add(line, f"{path.name} line {number}")
            if rejection is not None:
                rejections.append(rejection)
    return book.corrections(), rejections


def read_feedback_topic(
    kafka: Mapping[str, str],
    pipeline: PipelineSettings,
    topics: TopicSettings,
    privacy: PrivacySettings,
    dead_letter: DeadLetterSettings,
    labels: Collection[str],
    progress: bool = True,
) -> tuple[list[Correction], list[Rejection]]:
    """Every FeedbackEvent on `topics.feedback` up to its end as of now, the review topic read for tickets
    without text; rejections past the checked mark are dead-lettered to `topics.dead_letter`, then the mark
    moves to the end. `kafka`: the `[kafka]` options; the readers' groups are named after
    `pipeline.group_id`; texts are masked as `training_redactor(privacy)`, dead letters as `privacy` and
    `dead_letter` say."""

    def report(read: int, total: int) -> None:
        if progress:
            print(f"read {read} of at most {total} records", file=sys.stderr, flush=True)

    messages: list[confluent_kafka.Message] = []
    read_side_topic(
        kafka,
        pipeline,
        topics.feedback,
        messages.append,
        report,
        "feedback topic",
        "set it with topics.feedback",
    )
    index = ReviewIndex()
    needs_review = any(_lacks_text(message.value()) for message in messages)
    if needs_review and topics.review in existing_topics(producer_config(kafka)):
        read_side_topic(
            kafka, pipeline, topics.review, lambda m: index.add(m.value()), report, "review topic"
        )
    book = FeedbackBook(labels, index, training_redactor(privacy))
    checked = _CheckedMark(kafka, pipeline, topics.feedback)
    rejections = []
    new_rejections: list[tuple[confluent_kafka.Message, Rejection]] = []
    for message in messages:
        partition, offset = message.partition() or 0, message.offset() or 0
        rejection = book.add(message.value(), f"{topics.feedback}[{partition}]@{offset}")
        if rejection is not None:
            rejections.append(rejection)
            if offset >= checked.position(partition):
                new_rejections.append((message, rejection))
    _dead_letter(kafka, topics, DeadLetterRedaction.configured(privacy, dead_letter), new_rejections)
    checked.advance(messages)
    return book.corrections(), rejections


def _lacks_text(value: bytes | None) -> bool:
    try:
        return _FEEDBACK.decode(value or b"").text is None
    except msgspec.DecodeError:
        return False


def _dead_letter(
    kafka: Mapping[str, str],
    topics: TopicSettings,
    redaction: DeadLetterRedaction,
    rejected: Iterable[tuple[confluent_kafka.Message, Rejection]],
) -> None:
    """Write each rejected record to `topics.dead_letter` with its reason, redacted as `redaction` says; waits
    for every acknowledgement (the mark moves only after)."""
    rejected = list(rejected)
    if not rejected:
        return
    producer = create_producer(kafka, ClientErrorLog("feedback-dead-letters"))
    failures: list[str] = []

    def on_delivery(error: confluent_kafka.KafkaError | None, _message: confluent_kafka.Message) -> None:
        if error is not None:
            failures.append(error.str())

    for message, rejection in rejected:
        source = SourcePosition(
            topic=message.topic() or topics.feedback,
            partition=message.partition() or 0,
            offset=message.offset() or 0,
        )
        key, value, headers = redaction.letter(
            message.key(),
            message.value(),
            record_headers(message),
            rejection.error_type,
            rejection.message,
            source,
        )
        produce(producer, topics.dead_letter, value, key, headers, on_delivery)
    left: int = producer.flush(_FLUSH_S)
    if left or failures:
        reason = failures[0] if failures else f"{left} not acknowledged in {_FLUSH_S:.0f}s"
        raise UserError(f"Kafka: cannot dead-letter rejected feedback to {topics.dead_letter}: {reason}")


class _CheckedMark:
    """How far the feedback topic `topic` has been checked: the committed offsets of its own consumer group
    (named after `pipeline.group_id`)."""

    def __init__(self, kafka: Mapping[str, str], pipeline: PipelineSettings, topic: str) -> None:
        self._kafka = kafka
        self._topic = topic
        overrides = {"group.id": f"{pipeline.group_id}.feedback"}
        self._consumer = kafka_call(
            "create a consumer", lambda: create_consumer(kafka, pipeline, overrides=overrides), kafka
        )
        metadata = kafka_call(
            "read topic metadata",
            lambda: self._consumer.list_topics(self._topic, timeout=_METADATA_TIMEOUT_S),
            kafka,
        )
        wanted = [
            confluent_kafka.TopicPartition(self._topic, p) for p in metadata.topics[self._topic].partitions
        ]
        committed = kafka_call(
            "read the feedback topic's checked offsets",
            lambda: self._consumer.committed(wanted, timeout=_METADATA_TIMEOUT_S),
            kafka,
        )
        self._positions: dict[int, int] = {tp.partition: max(tp.offset, 0) for tp in committed}

    def position(self, partition: int) -> int:
        return self._positions.get(partition, 0)

    def advance(self, messages: Iterable[confluent_kafka.Message]) -> None:
        ends = dict(self._positions)
        for message in messages:
            partition, offset = message.partition(), message.offset()
            if partition is not None and offset is not None:
                ends[partition] = max(ends.get(partition, 0), offset + 1)
        try:
            if ends != self._positions:
                offsets = [confluent_kafka.TopicPartition(self._topic, p, o) for p, o in sorted(ends.items())]
                kafka_call(
                    "mark the feedback topic checked",
                    lambda: self._consumer.commit(offsets=offsets, asynchronous=False),
                    self._kafka,
                )
        finally:
            self._consumer.close()


def summarize(corrections: list[Correction]) -> Iterator[str]:
    """One line per (model intent -> corrected intent) pair, most frequent first."""
    pairs: dict[tuple[str, str], int] = {}
    for correction in corrections:
        pair = (correction.model_intent or "?", correction.intent)
        pairs[pair] = pairs.get(pair, 0) + 1
    for (before, after), count in sorted(pairs.items(), key=lambda item: -item[1]):
        verdict = f"{before} (accepted)" if before == after else f"{before} -> {after}"
        yield f"  {count:>5}  {verdict}"
