"""The consumer loop constructed in this process against the real broker (no subprocess): its contracts seen
from the topics and the group's committed offsets."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence

import confluent_kafka
import pytest
from pipeline_harness import (
    TINY_MODEL,
    Topics,
    audit,
    committed_offsets,
    end_offsets,
    make_topics,
    publish,
    settings_for,
    wait_until_committed,
)

from worker.classification import Classification, ClassifyRequest, FallbackLabel
from worker.config import InferenceSettings
from worker.inference.pool import open_pool
from worker.pipeline.runner import Pipeline

pytestmark = pytest.mark.kafka

FALLBACK = FallbackLabel("unclassified", "Medium")


class _Running:
    """`pipeline.run()` on a thread; `stop()` asks for the graceful shutdown and returns its exit code."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.code: int | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.code = self.pipeline.run()

    def stop(self, timeout: float = 60.0) -> int | None:
        self.pipeline.request_stop()
        self._thread.join(timeout)
        return self.code


@pytest.fixture
def running() -> Iterator[Callable[[Pipeline], _Running]]:
    started: list[_Running] = []

    def start(pipeline: Pipeline) -> _Running:
        started.append(_Running(pipeline))
        return started[-1]

    yield start
    for each in started:
        each.stop()


def test_the_loop_in_process_gives_every_record_one_result_or_dead_letter(
    kafka_bootstrap: str, unique_topic: Callable[..., str], running: Callable[[Pipeline], _Running]
) -> None:
    topics = make_topics(unique_topic)
    count = 300
    publish(kafka_bootstrap, topics, count, malformed_ratio=0.1, seed=21)
    group = f"inprocess-{uuid.uuid4().hex[:8]}"
    settings = settings_for(kafka_bootstrap, topics, **{"pipeline.group_id": group})
    with open_pool(InferenceSettings(model=str(TINY_MODEL), pool="thread", pool_size=1)) as pool:
        worker = running(Pipeline(settings, pool, FALLBACK, dispatch_window=2))
        wait_until_committed(kafka_bootstrap, group, topics.input, timeout=120)
        assert worker.stop() == 0

    report = audit(kafka_bootstrap, topics)
    assert len(report.inputs) == count
    assert report.lost == [] and report.duplicates == 0 and report.misrouted == []
    assert worker.pipeline.metrics.consumed == count
    assert worker.pipeline.metrics.dead_lettered == sum(len(d) for d in report.dead.values()) > 0


class _HoldingClassifier:
    """Answers at once, except the tickets whose text contains "hold": those wait until `release()`."""

    model_id = "holding@test"

    def __init__(self) -> None:
        self._ready: list[ClassifyRequest] = []
        self._held: list[ClassifyRequest] = []
        self._lock = threading.Lock()

    def submit(self, request: ClassifyRequest) -> None:
        with self._lock:
            (self._held if "hold" in request.text else self._ready).append(request)

    def release(self) -> None:
        with self._lock:
            self._ready.extend(self._held)
            self._held.clear()

    def poll(self, timeout: float) -> Sequence[tuple[int, Classification]]:
        with self._lock:
            ready, self._ready = self._ready, []
        if not ready:
            time.sleep(min(timeout, 0.005))
        return [(request.request_id, _answer()) for request in ready]


def _answer() -> Classification:
    return Classification(
        intent="card_arrival",
        priority="Low",
        confidence=0.9,
        scores={"card_arrival": 0.9},
        model="holding@test",
        latency_ms=1.0,
        truncated=False,
    )


def _publish_tickets(bootstrap: str, topics: Topics, bodies: list[str]) -> None:
    producer = confluent_kafka.Producer({"bootstrap.servers": bootstrap})
    for index, body in enumerate(bodies):
        value = json.dumps({"ticket_id": f"H-{index}", "body": body}).encode()
        producer.produce(topics.input, value=value, partition=0)
    assert producer.flush(30) == 0


def test_the_committed_offset_never_passes_an_unanswered_ticket(
    kafka_bootstrap: str, unique_topic: Callable[..., str], running: Callable[[Pipeline], _Running]
) -> None:
    topics = make_topics(unique_topic, partitions=1)
    bodies = ["where is my card?"] * 40
    bodies[10] = "hold this one"
    _publish_tickets(kafka_bootstrap, topics, bodies)
    group = f"holding-{uuid.uuid4().hex[:8]}"
    settings = settings_for(
        kafka_bootstrap, topics, **{"pipeline.group_id": group, "pipeline.commit_interval_ms": "100"}
    )
    classifier = _HoldingClassifier()
    worker = running(Pipeline(settings, classifier, FALLBACK, dispatch_window=64))

    # Everything after the held ticket is answered and acknowledged, but the position stays at it.
    deadline = time.monotonic() + 60
    while worker.pipeline.metrics.produced < 39 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.pipeline.metrics.produced == 39
    time.sleep(0.5)  # several commit intervals
    assert committed_offsets(kafka_bootstrap, group, topics.input) == {0: 10}

    classifier.release()
    wait_until_committed(kafka_bootstrap, group, topics.input, timeout=60)
    assert worker.stop() == 0
    assert committed_offsets(kafka_bootstrap, group, topics.input) == end_offsets(
        kafka_bootstrap, topics.input
    )
    report = audit(kafka_bootstrap, topics)
    assert report.lost == [] and report.duplicates == 0


def test_the_pipeline_stays_under_its_bound_and_resumes_when_slots_free(
    kafka_bootstrap: str, unique_topic: Callable[..., str], running: Callable[[Pipeline], _Running]
) -> None:
    """Held tickets fill the bound: the loop stops taking records (and pauses after a while) but keeps
    the member in the group; released, everything finishes."""
    topics = make_topics(unique_topic, partitions=1)
    _publish_tickets(kafka_bootstrap, topics, ["hold: my card is late"] * 30)
    group = f"bound-{uuid.uuid4().hex[:8]}"
    settings = settings_for(
        kafka_bootstrap, topics, **{"pipeline.group_id": group, "pipeline.max_in_flight": "8"}
    )
    classifier = _HoldingClassifier()
    worker = running(Pipeline(settings, classifier, FALLBACK, dispatch_window=64))

    deadline = time.monotonic() + 30
    while not worker.pipeline.metrics.paused and time.monotonic() < deadline:
        time.sleep(0.05)
    metrics = worker.pipeline.metrics
    assert metrics.paused and metrics.consumed == metrics.in_flight_max == 8
    classifier.release()
    while metrics.consumed < 30 and time.monotonic() < deadline:
        time.sleep(0.02)
        classifier.release()
    wait_until_committed(kafka_bootstrap, group, topics.input, timeout=60)
    assert worker.stop() == 0
    assert metrics.in_flight_max == 8 and metrics.max_poll_exceeded == 0 and metrics.lost == 0
