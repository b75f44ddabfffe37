"""The replay's in-flight bound has one owner, the replay's own `Limits` (`worker/app/replay.py`): its loop
and its delivery guarantee take the same number, so the guarantee's early commit (done work filling half of
the bound) comes at half of the replay's 1,000, not at half of the worker's `pipeline.max_in_flight`."""

from __future__ import annotations

from typing import Any, cast

import confluent_kafka
import pytest
from memory_kafka import MemoryKafka, ReplayConsumer

from worker.app import replay as replay_door
from worker.kafka import dead_letters
from worker.pipeline.failure import Failure
from worker.replay.outcomes import ReplaySummary
from worker.replay.selection import ReplayOptions
from worker.settings import Settings, load_settings

INPUT, DEAD = "tickets.raw", "tickets.dlq"
# Fewer dead letters than the replay's bound (1,000) holds, far more than half of the worker's (64).
LETTERS = 600


class _CountingConsumer(ReplayConsumer):
    """The replay's consumer, each commit's positions kept in order."""

    def __init__(self, kafka: MemoryKafka, group: str) -> None:
        super().__init__(kafka, group)
        self.commits: list[int] = []

    def commit(self, offsets: list[Any], asynchronous: bool = True) -> list[Any]:
        self.commits.extend(tp.offset for tp in offsets if tp.offset >= 0)
        return super().commit(offsets, asynchronous)


def _settings() -> Settings:
    return load_settings(
        env={},
        overrides={
            "kafka.bootstrap.servers": "memory:9092",
            "topics.input": INPUT,
            "topics.dead_letter": DEAD,
            "pipeline.max_in_flight": 64,
        },
    )


def test_the_replay_commits_early_at_half_of_its_own_bound_not_of_the_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kafka = MemoryKafka()
    kafka.create_topic(INPUT, 1)
    kafka.create_topic(DEAD, 1)
    for index in range(LETTERS):
        headers = dead_letters.dead_letter_headers(None, "missing_field", "m", INPUT, 0, index)
        kafka.append(DEAD, 0, b'{"ticket_id": "T-%d", "body": "hi"}' % index, None, headers)
    monkeypatch.setattr(replay_door, "_ReplayClients", lambda _settings, group: kafka.clients(group))
    # No commit falls due by time during the run: any commit before its end is an early one.
    monkeypatch.setattr(replay_door, "COMMIT_INTERVAL_MS", 3_600_000)
    consumer = _CountingConsumer(kafka, "replay")
    summary = ReplaySummary(DEAD, "replay", False)
    engine = replay_door.replay_pipeline(
        _settings(),
        ReplayOptions(dlq_topic=DEAD, group="replay"),
        cast(confluent_kafka.Consumer, consumer),
        summary,
        None,
        Failure(),
    )

    assert engine.run() == 0
    assert len(kafka.read_committed(INPUT)) == LETTERS  # every dead letter republished once
    assert consumer.commits and consumer.commits[-1] == LETTERS
    # The first commit covers at least half of the replay's bound (or everything), never 32 records.
    assert consumer.commits[0] >= min(LETTERS, replay_door._IN_FLIGHT // 2)
