"""The loop against the in-memory Kafka (tests/memory_kafka.py): failure paths made deterministic.

Each test drives the real `Pipeline` with a classifier that answers at once; the in-memory consumer and
producer follow librdkafka's semantics for queues, rebalance callbacks and transactions. The real-broker
end-to-end and chaos tests cover the same promises under real timing; these pin down exact interleavings.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence

import msgspec
import pytest
from memory_kafka import MemoryConsumer, MemoryKafka

from worker.classification import Classification, ClassifyRequest, FallbackLabel
from worker.config import load_settings
from worker.kafka import dead_letters
from worker.messages import TriageResult
from worker.ops.samples import SampleFactory
from worker.pipeline.runner import Pipeline

FALLBACK = FallbackLabel("unclassified", "Medium")
INPUT, OUTPUT, DEAD = "tickets", "triaged", "dead"


class InstantClassifier:
    """Answers every ticket at its next poll."""

    model_id = "instant@test"

    def __init__(self) -> None:
        self._asked: list[ClassifyRequest] = []
        self._lock = threading.Lock()

    def submit(self, request: ClassifyRequest) -> None:
        with self._lock:
            self._asked.append(request)

    def poll(self, timeout: float) -> Sequence[tuple[int, Classification]]:
        with self._lock:
            asked, self._asked = self._asked, []
        answer = Classification(
            intent="card_lost", priority="High", confidence=0.9, scores={}, model=self.model_id,
            latency_ms=0.1, truncated=False,
        )  # fmt: skip
        return [(request.request_id, answer) for request in asked]


class Running:
    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline
        self.code: int | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.code = self.pipeline.run()

    def stop(self) -> int | None:
        self.pipeline.request_stop()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the pipeline did not stop"
        return self.code


def fill(kafka: MemoryKafka, partition: int, count: int, seed: int) -> None:
    factory = SampleFactory(seed=seed, malformed_ratio=0.2, prefix=f"P{partition}")
    for index in range(count):
        sample = factory.make(index)
        kafka.append(INPUT, partition, sample.value, sample.key, list(sample.headers))


def outputs_by_source(kafka: MemoryKafka) -> dict[tuple[int, int], int]:
    """How many visible results and dead letters each input position has."""
    found: dict[tuple[int, int], int] = {}
    decoder = msgspec.json.Decoder(TriageResult)
    for _, record in kafka.read_committed(OUTPUT):
        assert record.value is not None
        source = decoder.decode(record.value).source
        found[(source.partition, source.offset)] = found.get((source.partition, source.offset), 0) + 1
    for _, record in kafka.read_committed(DEAD):
        headers = dict(record.headers or [])
        partition = headers[dead_letters.SOURCE_PARTITION]
        offset = headers[dead_letters.SOURCE_OFFSET]
        assert partition is not None and offset is not None
        position = (int(partition), int(offset))
        found[position] = found.get(position, 0) + 1
    return found


def assert_exactly_once(kafka: MemoryKafka, group: str) -> None:
    """Every input offset below the group's committed position has exactly one visible output; none above."""
    outputs = outputs_by_source(kafka)
    committed = kafka.committed[group]
    lost = [
        (p, o) for (topic, p), position in committed.items() if topic == INPUT for o in range(position)
        if outputs.get((p, o), 0) == 0
    ]  # fmt: skip
    assert lost == [], f"committed past {len(lost)} inputs with no output: {lost[:10]}"
    duplicated = sorted(position for position, count in outputs.items() if count > 1)
    assert duplicated == [], f"{len(duplicated)} inputs with more than one output: {duplicated[:10]}"
    beyond = sorted((p, o) for (p, o) in outputs if o >= committed.get((INPUT, p), 0))
    assert beyond == [], f"outputs visible for uncommitted inputs: {beyond[:10]}"


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture
def kafka() -> Iterator[MemoryKafka]:
    memory = MemoryKafka(prefetch=2)
    memory.create_topic(INPUT, 4)
    memory.create_topic(OUTPUT, 4)
    memory.create_topic(DEAD, 1)
    yield memory


def pipeline(kafka: MemoryKafka, guarantee: str, **settings: object) -> Pipeline:
    """A pipeline in group "memory-group" that commits only when its in-flight bound is half full, on
    revoke and at shutdown (a commit interval of an hour), so that a test decides what is uncommitted."""
    group = "memory-group"
    config = load_settings(
        env={},
        overrides={
            "kafka.bootstrap.servers": "memory:9092",
            "topics.input": INPUT,
            "topics.output": OUTPUT,
            "topics.dead_letter": DEAD,
            "pipeline.group_id": group,
            "pipeline.guarantee": guarantee,
            "pipeline.commit_interval_ms": 3_600_000,
            **settings,
        },
    )
    clients = kafka.clients(group, "memory-tid" if guarantee == "exactly_once" else None)
    return Pipeline(config, InstantClassifier(), FALLBACK, dispatch_window=64, clients=clients)


def _events_in_one_poll(kafka: MemoryKafka, events: str) -> Callable[[MemoryConsumer], None]:
    """A consumer hook: once partition 0 has records fetched (queued) beyond offset 10 and partitions 1 and
    2 are read to their end, the group's `events` arrive together, followed by new records of partition 3
    that fill the poll's batch up (so librdkafka's barrier after a seek in a callback is not reached)."""

    def hook(consumer: MemoryConsumer) -> None:
        queued = [item for item in consumer.queue if item[0] == "record" and item[1][0] == (INPUT, 0)]
        read_elsewhere = all(consumer.app_at.get((INPUT, p)) == 5 for p in (1, 2))
        if kafka.generation > 1 or not read_elsewhere or len(queued) < 2 or consumer.app_at[(INPUT, 0)] < 10:
            return
        if events == "lost 1, revoked 2":
            kafka.lose(consumer, [(INPUT, 1)])
            kafka.revoke(consumer, [(INPUT, 2)])
        else:
            kafka.lose(consumer, [(INPUT, 0)])
            kafka.assign(consumer, [(INPUT, 0)])
        fill(kafka, 3, 10, seed=4)

    return hook


@pytest.mark.parametrize("events", ["lost 1, revoked 2", "lost 0, assigned 0 again"])
def test_records_fetched_before_a_rebalance_callback_never_start_a_partition_over(
    kafka: MemoryKafka, events: str
) -> None:
    """The chaos run's loss (issue #25), step by step. Two rebalance events arrive in one poll while records
    of partition 0 fetched before them are already in the poll's batch:
    - partition 1 lost and 2 revoked: the revoke commits the open transaction, which must abort (it holds
      the lost partition's outputs), so every owned partition is redone from its last commit; partition 0
      is sought back inside the callback;
    - partition 0 lost and assigned again: a fresh offset state, fetching from the committed offset.
    Either way a record fetched before the event must not start the partition's new state, or the records
    between its start and that record, fetched again, are skipped and the next commit passes them without
    an output."""
    fill(kafka, 0, 30, seed=1)
    fill(kafka, 1, 5, seed=2)
    fill(kafka, 2, 5, seed=3)
    worker = pipeline(
        kafka, "exactly_once", **{"pipeline.poll_batch_size": 4, "pipeline.max_in_flight": 1000}
    )
    kafka.hooks.consumer_call = _events_in_one_poll(kafka, events)
    running = Running(worker)
    wait_until(lambda: kafka.generation > 1, "the rebalance events")
    consumer = kafka.members[0]
    ends = kafka.end_offsets(INPUT)
    wait_until(lambda: all(consumer.app_at[(INPUT, p)] == ends[p] for p in (0, 3)), "partitions 0 and 3 read")
    assert running.stop() == 0
    assert {p: kafka.committed["memory-group"].get((INPUT, p)) for p in (0, 3)} == {0: ends[0], 3: ends[3]}
    assert_exactly_once(kafka, "memory-group")
    assert worker.metrics.transactions_aborted >= 1
    assert worker.metrics.redelivered == 0
