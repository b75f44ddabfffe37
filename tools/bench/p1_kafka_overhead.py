"""P1 Kafka overhead: the real loop (`group_pipeline`), built here with a classifier that answers at once,
vs a bare confluent-kafka loop (consume → JSON decode → produce a result-sized record → async commit), same
records."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import confluent_kafka
import msgspec

from tools.bench.measure import bracket, group_name, progress, rate_of
from tools.harness import Topics, settings_for
from tools.load import Offsets, Tickets, new_topics, produce_tickets
from worker.app.doors import TriageParts, group_pipeline
from worker.app.stages import dispatch_window
from worker.classification import Classification, ClassifyRequest
from worker.inference.loading import resolve_taxonomy
from worker.kafka.clients import KafkaClients, consumer_config, producer_config
from worker.logs import librdkafka_logger
from worker.settings import InferenceSettings, Settings

# P1's second pipeline run: a bound that never fills (each run still waits for its commits).
P1_LIFTED_BOUND = 4096


class InstantClassifier:
    """Answers every request at once with the taxonomy's first label: the pipeline without a model."""

    model_id = "bench-instant"

    def __init__(self, settings: InferenceSettings) -> None:
        taxonomy, _ = resolve_taxonomy(settings)
        intent = taxonomy.labels[0]
        self._answer = Classification(
            intent=intent,
            priority=taxonomy.policy_priority(intent),
            confidence=1.0,
            scores={intent: 1.0},
            model=self.model_id,
            latency_ms=0.0,
            truncated=False,
        )
        self._ready: list[tuple[int, Classification]] = []
        self.first_submit: float | None = None

    def submit(self, request: ClassifyRequest) -> None:
        if self.first_submit is None:
            self.first_submit = time.monotonic()
        self._ready.append((request.request_id, self._answer))

    def poll(self, timeout: float) -> list[tuple[int, Classification]]:
        ready, self._ready = self._ready, []
        return ready


def bare_loop(settings: Settings, stop: threading.Event, first: list[float]) -> None:
    """The floor for P1: the pipeline's own client options, no bookkeeping. Commits the consumed positions
    asynchronously every second, and once more as soon as a poll comes back empty, so the figure is not
    rounded up to the commit timer (the pipeline also commits early when done work piles up)."""
    consumer = confluent_kafka.Consumer(dict(consumer_config(settings.kafka, settings.pipeline)))
    producer = confluent_kafka.Producer(dict(producer_config(settings.kafka)))
    decode, encode = msgspec.json.decode, msgspec.json.Encoder().encode
    topic_in, topic_out = settings.topics.input, settings.topics.output
    consumer.subscribe([topic_in])
    positions: dict[int, int] = {}
    last_commit = time.monotonic()
    try:
        while not stop.is_set():
            messages = consumer.consume(500, 0.1)
            if messages and not first:
                first.append(time.monotonic())
            for message in messages:
                partition, offset, value = message.partition(), message.offset(), message.value()
                if message.error() is not None or partition is None or offset is None or value is None:
                    continue
                ticket = decode(value)
                record = encode(
                    {  # the shape and size of a TriageResult
                        "schema_version": 1,
                        "ticket_id": ticket["ticket_id"],
                        "intent": "card_arrival",
                        "priority": "Medium",
                        "confidence": 0.9731,
                        "fallback": False,
                        "fallback_reason": None,
                        "scores": {
                            "card_arrival": 0.9731,
                            "card_linking": 0.012,
                            "lost_or_stolen_card": 0.008,
                        },
                        "model": "triage-mini@0123456789ab",
                        "latency_ms": 3.21,
                        "classified_at": "2026-01-01T00:00:00.000Z",
                        "source": {"topic": topic_in, "partition": partition, "offset": offset},
                        "truncated": False,
                    }
                )
                while True:
                    try:
                        producer.produce(topic_out, value=record, key=message.key())
                        break
                    except BufferError:
                        producer.poll(0.01)
                positions[partition] = offset + 1
            producer.poll(0)
            now = time.monotonic()
            if positions and (not messages or now - last_commit >= 1.0):
                offsets = [confluent_kafka.TopicPartition(topic_in, p, o) for p, o in positions.items()]
                consumer.commit(offsets=offsets, asynchronous=True)
                positions.clear()
                last_commit = now
    finally:
        producer.flush(10)
        consumer.close()


def _timed_run(
    name: str,
    bootstrap: str,
    settings: Settings,
    ends: dict[int, int],
    body: Callable[[], object],
    stop: Callable[[], None],
    start: Callable[[], float | None],
    budget: float,
) -> dict[str, Any]:
    """Run `body` in a thread until the group has committed `ends` (or `budget` seconds), then `stop` it;
    rate = records committed / (the time `start` reports → that commit was seen)."""
    offsets = Offsets(bootstrap, settings.pipeline.group_id, settings.topics.input)
    errors: list[BaseException] = []

    def guarded() -> None:
        try:
            body()
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=guarded, name=name, daemon=True)

    def alive() -> None:
        if errors:
            raise RuntimeError(f"{name} failed") from errors[0]
        if not thread.is_alive():
            raise RuntimeError(f"{name} stopped before committing the input")

    thread.start()
    try:
        done = offsets.follow(ends, budget, alive)
    finally:
        offsets.close()
        stop()
        thread.join(30)
    first = start()
    if first is None:
        raise RuntimeError(f"{name} took no record in {budget:.0f} s")
    return rate_of(done, first)


def measure(bootstrap: str, tickets: Tickets, count: int, budget: float) -> dict[str, Any]:
    bare_topics, pipe_topics, lifted_topics = new_topics(bootstrap, "p1", outputs=3)
    progress(f"P1 producing {count} tickets to {bare_topics.input}")
    produce_tickets(bootstrap, bare_topics.input, tickets, 0, count)
    ends = Offsets(bootstrap, "unused", bare_topics.input)
    try:
        end_offsets = ends.ends()
    finally:
        ends.close()

    def run_bare(when: str) -> dict[str, Any]:
        progress(f"P1 bare confluent-kafka loop ({when})")
        settings = settings_for(bootstrap, bare_topics, **{"pipeline.group_id": group_name("p1-bare")})
        stop, first = threading.Event(), list[float]()
        return _timed_run(
            "bare loop",
            bootstrap,
            settings,
            end_offsets,
            lambda: bare_loop(settings, stop, first),
            stop.set,
            lambda: first[0] if first else None,
            budget,
        )

    bare_before = run_bare("before")

    def run_pipeline(topics: Topics, max_in_flight: int | None) -> dict[str, Any]:
        bound = "default bound" if max_in_flight is None else f"max_in_flight={max_in_flight}"
        progress(f"P1 Pipeline with an instant classifier ({bound})")
        group = group_name("p1-pipeline")
        settings = settings_for(bootstrap, topics, **{"pipeline.group_id": group})
        if max_in_flight is not None:
            settings = msgspec.structs.replace(
                settings,
                pipeline=msgspec.structs.replace(settings.pipeline, max_in_flight=max_in_flight),
            )
        classifier = InstantClassifier(settings.inference)
        taxonomy, _ = resolve_taxonomy(settings.inference)
        parts = TriageParts(classifier, taxonomy.fallback_label, dispatch_window(settings))
        pipeline = group_pipeline(
            settings, parts, clients=KafkaClients(settings.kafka, settings.pipeline, librdkafka_logger())
        )
        return _timed_run(
            "pipeline",
            bootstrap,
            settings,
            end_offsets,
            pipeline.run,
            pipeline.request_stop,
            lambda: classifier.first_submit,
            budget,
        )

    piped = run_pipeline(pipe_topics, None)
    # The default bound caps an instant classifier at about max_in_flight per produce-and-commit round
    # trip; a bound that never fills shows what the loop itself costs per record.
    lifted = run_pipeline(lifted_topics, P1_LIFTED_BOUND)
    bare = bracket(bare_before, run_bare("after"))
    return {
        "records": count,
        "bare": bare,
        "pipeline": piped,
        "ratio": round(piped["rate"] / bare["rate"], 3),
        "lifted": {**lifted, "max_in_flight": P1_LIFTED_BOUND},
        "lifted_ratio": round(lifted["rate"] / bare["rate"], 3),
        "start": "first record taken (bare: first non-empty poll; pipeline: first ticket to the classifier)",
        "end": "group's committed offsets == end offsets (checked every 20 ms)",
    }
