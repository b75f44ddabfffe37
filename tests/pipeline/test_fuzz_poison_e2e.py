"""The fuzzer's poison records against the real worker and broker: each one is dead-lettered with its reason,
the worker keeps running, and the committed offsets reach the end of the input (issue 12's acceptance)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import confluent_kafka
import pytest

from tools.harness import Worker, audit, committed_offsets, end_offsets, make_topics
from worker.dev.samples import KIND_HEADER

pytestmark = pytest.mark.kafka

VALID = b'{"ticket_id": "T-%d", "body": "Where is my card?"}'
# (value, headers, the dead letter's error type; None: a ticket)
POISON: list[tuple[bytes | None, list[tuple[str, bytes | None]], str | None]] = [
    (b"[" * 100_000, [], "too_deeply_nested"),  # the 100 KB record that used to kill the worker
    (b'{"ticket_id": "T", "body": "b", "x": ' + b"[" * 70 + b"]" * 70 + b"}", [], "too_deeply_nested"),
    (b'{"ticket_id": "T"', [("triage.replay_count", b"9" * 5000)], "invalid_json"),  # int() refuses it
    (b'{"ticket_id": "T", "body": 1e999999}', [("", None), ("trace", b"")], "invalid_json"),
    (b'{"ticket_id": "T", "body": "\\ud800"}', [], "invalid_json"),
    (b'{"ticket_id": "T", "body": "b", "metadata": {"' + b"k" * 100_000 + b'": 1}}', [], "wrong_type"),
    (b'{"ticket_id": "T", "body": "b", "amount": ' + b"9" * 100_000 + b"}", [], None),
    (None, [], "null_value"),
]


def test_poison_records_are_dead_lettered_and_the_worker_reaches_the_end(
    kafka_bootstrap: str, unique_topic: Callable[..., str], tmp_path: Path
) -> None:
    topics = make_topics(unique_topic, partitions=1)
    producer = confluent_kafka.Producer({"bootstrap.servers": kafka_bootstrap})
    records = [(VALID % 0, [], None), *POISON, (VALID % 1, [], None)]
    for value, headers, error_type in records:
        kind = f"malformed:{error_type}" if error_type else "ticket"
        producer.produce(topics.input, value=value, headers=[*headers, (KIND_HEADER, kind.encode())])
    assert producer.flush(30) == 0
    group = f"triage-test-{uuid.uuid4().hex[:8]}"
    worker = Worker(kafka_bootstrap, topics, group, tmp_path, "poison")
    worker.run_to_completion(timeout=120)  # fails if the worker exits before the end is committed
    report = audit(kafka_bootstrap, topics)
    assert not report.lost and not report.misrouted, report.summary()
    assert [report.dead.get((0, offset), []) for offset in range(len(records))] == [
        [error_type] if error_type else [] for _, _, error_type in records
    ]
    assert committed_offsets(kafka_bootstrap, group, topics.input) == end_offsets(
        kafka_bootstrap, topics.input
    )
