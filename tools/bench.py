"""End-to-end benchmark of the worker (`make bench`): every figure a ratio against a baseline of the same run.

    .venv/bin/python tools/bench.py [--quick] [--out results]

Against a real broker (a fresh local one on a free port, or KAFKA_BOOTSTRAP_SERVERS), with the same BANKING77
tickets `{"ticket_id", "body"}` everywhere and an input topic of 3 partitions:

- P1 Kafka overhead: the real `Pipeline`, built here with a classifier that answers at once, vs a bare
  confluent-kafka loop (consume → JSON decode → produce a result-sized record → async commit), same records;
- P2 inference overhead: `triage-worker run` with default settings vs the raw classifier pool;
- P3 beyond the seed design: the worker vs one ticket at a time, a new Generator with the whole prompt per
  ticket, schema-guided generation, batch 1, same model;
- P4 latency under load: 25..200 % of P2's capacity, each for a fixed time, against one worker;
- P5 EDF vs FIFO: two workers, `--scheduling fifo` and `edf`, at 100 and 150 % of P2's capacity with half
  the tickets due 1 s after they are produced and half much later (`metadata.deadline_at`): deadline misses;
- P6 exactly-once vs at-least-once: two workers, `--guarantee at_least_once` and `exactly_once`: throughput
  of a burst, and latency at 70 % of P2's capacity as a read_committed reader sees the results;
- P7 the cascade: two workers, the first stage alone and with the escalation stage (`--escalation
  triage-encoder`, default threshold): throughput of a burst of BANKING77 test tickets, and what each wrote
  (intent accuracy against the tickets' labels, share escalated, escalations skipped by reason);
- CPU cost: CPU-ms per ticket of the worker's process tree vs the pool's.

Writes bench.json, bench.md, bench-latency.png and bench-timeline.png into --out; `--only p7` runs P7 alone
and writes bench-p7.json and bench-p7.md.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import signal
import sys
import tempfile
import threading
import time
import types
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import bench_report
import confluent_kafka
import msgspec
import onnxruntime_genai as og
from bench_kafka import (
    BROKER_PID,
    DueTickets,
    LabelledTickets,
    Offsets,
    Progress,
    Tickets,
    Topics,
    Visible,
    Worker,
    audit,
    cpu_seconds,
    end_offsets,
    kafka,
    new_topics,
    produce_paced,
    produce_tickets,
    read_topic,
    rss_bytes,
)

from worker.classification import Classification, ClassifyRequest
from worker.config import InferenceSettings, LogSettings, Settings, load_settings
from worker.inference.engine import Engine, InvalidOutput
from worker.inference.loading import resolve_taxonomy
from worker.inference.pool import open_pool
from worker.kafka.clients import KafkaClients, consumer_config, producer_config
from worker.logs import configure_logging, librdkafka_logger
from worker.messages import TriageResult
from worker.ops.run_command import dispatch_window
from worker.pipeline.runner import Pipeline

LOADS_PCT = (25, 50, 70, 100, 150, 200)
POOL_QUEUE_PER_CONTEXT = 32
_STARTED = time.monotonic()


def progress(line: str) -> None:
    print(f"[{time.monotonic() - _STARTED:6.1f}s] {line}", file=sys.stderr, flush=True)


def _group(phase: str) -> str:
    return f"bench.{phase}.{uuid.uuid4().hex[:8]}"


def _settings(bootstrap: str, input_topic: str, output: str, dead_letter: str, group: str) -> Settings:
    return load_settings(
        env={},
        overrides={
            "kafka.bootstrap.servers": bootstrap,
            "topics.input": input_topic,
            "topics.output": output,
            "topics.dead_letter": dead_letter,
            "pipeline.group_id": group,
        },
    )


# -- P1 ---------------------------------------------------------------------------------------------------

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
    consumer = confluent_kafka.Consumer(dict(consumer_config(settings)))
    producer = confluent_kafka.Producer(dict(producer_config(settings)))
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
    return _rate(done, first)


def bracket(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """A baseline measured before and after the figure it is compared with, so that drift on a shared
    machine (other jobs starting or stopping) moves both halves; the ratio uses the mean."""
    figures = {key: value for key, value in before.items() if key != "seconds"}
    for key in ("rate", "cpu_ms_per_ticket"):
        if key in before:
            figures[key] = round((before[key] + after[key]) / 2, 3)
    figures["complete"] = before.get("complete", True) and after.get("complete", True)
    return {**figures, "before": before, "after": after}


def _rate(done: Progress, started: float) -> dict[str, Any]:
    seconds = done.at - started
    return {
        "records": done.records,
        "seconds": round(seconds, 3),
        "rate": round(done.records / seconds, 1),
        # False when the budget ran out first; the rate is then over what was committed by then.
        "complete": done.complete,
    }


def p1_kafka_overhead(bootstrap: str, tickets: Tickets, count: int, budget: float) -> dict[str, Any]:
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
        settings = _settings(
            bootstrap, bare_topics.input, bare_topics.output, bare_topics.dead_letter, _group("p1-bare")
        )
        stop, first = threading.Event(), []
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
        group = _group("p1-pipeline")
        settings = _settings(bootstrap, topics.input, topics.output, topics.dead_letter, group)
        if max_in_flight is not None:
            settings = msgspec.structs.replace(
                settings,
                pipeline=msgspec.structs.replace(settings.pipeline, max_in_flight=max_in_flight),
            )
        classifier = InstantClassifier(settings.inference)
        taxonomy, _ = resolve_taxonomy(settings.inference)
        pipeline = Pipeline(
            settings,
            classifier,
            taxonomy.fallback_label,
            dispatch_window=dispatch_window(settings),
            clients=KafkaClients(settings, librdkafka_logger()),
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


# -- P2 and CPU -------------------------------------------------------------------------------------------


def pool_baseline(tickets: Tickets, count: int) -> dict[str, Any]:
    """The raw pool with default inference settings: every text submitted with a generous deadline,
    drained with poll.

    At most POOL_QUEUE_PER_CONTEXT requests per context are outstanding: that already keeps every context
    busy, and a flood of thousands fills the pipes both ways, on which `pool.close()` blocks forever when a
    Ctrl-C stops the draining (the contexts wait to write answers, the parent to write the stop message).
    """
    progress("P2 baseline: opening the classifier pool (default inference settings)")
    fallbacks: dict[str, int] = {}
    with open_pool(InferenceSettings()) as pool:
        progress(f"P2 baseline: {count} texts through the pool ({pool.size} contexts)")
        window = POOL_QUEUE_PER_CONTEXT * pool.size
        cpu_before = cpu_seconds(os.getpid())
        started = time.monotonic()
        deadline = started + 3600
        submitted = answered = 0
        while answered < count:
            while submitted < min(count, answered + window):
                pool.submit(ClassifyRequest(submitted, tickets.text(submitted), deadline))
                submitted += 1
            for _, answer in pool.poll(0.05):
                answered += 1
                if answer.fallback:
                    reason = answer.fallback_reason or "unknown"
                    fallbacks[reason] = fallbacks.get(reason, 0) + 1
            if time.monotonic() - started > max(300.0, count / 5):
                raise TimeoutError(f"the pool answered {answered} of {count}")
        seconds = time.monotonic() - started
        cpu = cpu_seconds(os.getpid()) - cpu_before
        size = pool.size
    return {
        "tickets": count,
        "contexts": size,
        "seconds": round(seconds, 3),
        "rate": round(count / seconds, 1),
        "cpu_ms_per_ticket": round(cpu * 1000 / count, 3),
        "fallbacks": fallbacks,
    }


def _last_metrics(worker: Worker) -> dict[str, Any]:
    events = worker.events("metrics")
    return events[-1] if events else {}


def p2_worker(bootstrap: str, tickets: Tickets, count: int, budget: float, logs: Path) -> dict[str, Any]:
    (topics,) = new_topics(bootstrap, "p2")
    group = _group("p2")
    progress("P2 starting `triage-worker run` (default settings)")
    with contextlib.ExitStack() as cleanup:
        worker = Worker(bootstrap, topics, group, logs / "p2-worker.log")
        cleanup.callback(worker.stop)
        offsets = Offsets(bootstrap, group, topics.input)
        cleanup.callback(offsets.close)
        worker.wait_assigned(timeout=180)
        progress(f"P2 worker assigned; producing {count} tickets as fast as possible")
        broker = BROKER_PID.get(bootstrap)
        cpu_before = cpu_seconds(worker.pid)
        broker_before = cpu_seconds(broker) if broker else 0.0
        started = produce_tickets(bootstrap, topics.input, tickets, 0, count)
        done = offsets.follow(offsets.ends(), budget, worker.alive, every=0.05)
        cpu = cpu_seconds(worker.pid) - cpu_before
        broker_cpu = cpu_seconds(broker) - broker_before if broker else None
        time.sleep(1.2)  # one more metrics event, with the final counts
        metrics = _last_metrics(worker)
    return {
        **_rate(done, started),
        "cpu_ms_per_ticket": round(cpu * 1000 / max(1, done.records), 3),
        # The broker shares the cores with the worker here (its produce, fetch and commit handling).
        "broker_cpu_ms_per_ticket": None
        if broker_cpu is None
        else round(broker_cpu * 1000 / max(1, done.records), 3),
        "fallbacks": metrics.get("fallback", {}),
        "classified": metrics.get("classified"),
        "start": "first produce call, after the worker was assigned its partitions",
        "end": "group's committed offsets == end offsets (checked every 50 ms)",
    }


# -- P3 ---------------------------------------------------------------------------------------------------


def p3_seed_design(tickets: Tickets, count: int) -> dict[str, Any]:
    """One ticket at a time: a new Generator, the whole prompt, schema-guided generation, batch 1."""
    progress(f"P3 seed design: {count} tickets, a new Generator each, guided generation")
    engine = Engine(InferenceSettings(mode="generate"))

    def classify(text: str) -> bool:
        _, ids, _ = engine.prepare(text)
        prompt = engine.prefix_ids + ids
        generator = og.Generator(engine.model, engine.params(guided=True))
        generator.append_tokens(prompt)
        for _ in range(engine.max_answer_tokens + 1):
            if generator.is_done():
                break
            generator.generate_next_token()
        answer = [int(t) for t in generator.get_sequence(0)[len(prompt) :] if int(t) not in engine.eos_ids]
        try:
            engine.parse_answer(engine.decode(answer))
        except InvalidOutput:
            return False
        return True

    classify(tickets.text(0))  # compiles the grammar once, as a long-running seed process would have
    cpu_before = cpu_seconds(os.getpid())
    started = time.monotonic()
    invalid = sum(not classify(tickets.text(index)) for index in range(count))
    seconds = time.monotonic() - started
    cpu = cpu_seconds(os.getpid()) - cpu_before
    return {
        "tickets": count,
        "seconds": round(seconds, 3),
        "rate": round(count / seconds, 1),
        "cpu_ms_per_ticket": round(cpu * 1000 / count, 3),
        "invalid": invalid,
    }


# -- P4 ---------------------------------------------------------------------------------------------------


class Sampler(threading.Thread):
    """The worker tree's RSS every 0.5 s (wall-clock time, bytes)."""

    def __init__(self, pid: int) -> None:
        super().__init__(name="rss-sampler", daemon=True)
        self._pid = pid
        self._halt = threading.Event()
        self.samples: list[tuple[float, int]] = []

    def run(self) -> None:
        while not self._halt.wait(0.5):
            self.samples.append((time.time(), rss_bytes(self._pid)))

    def finish(self) -> None:
        self._halt.set()
        self.join(5)


def _percentile(values: Sequence[float], pct: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]  # nearest rank


def p4_latency(
    bootstrap: str, tickets: Tickets, capacity: float, seconds: float, logs: Path
) -> dict[str, Any]:
    (topics,) = new_topics(bootstrap, "p4")
    group = _group("p4")
    progress(f"P4 starting the worker; capacity from P2 = {capacity:.1f} tickets/s")
    levels: list[dict[str, Any]] = []
    with contextlib.ExitStack() as cleanup:
        worker = Worker(bootstrap, topics, group, logs / "p4-worker.log")
        cleanup.callback(worker.stop)
        offsets = Offsets(bootstrap, group, topics.input)
        cleanup.callback(offsets.close)
        sampler = Sampler(worker.pid)
        sampler.start()
        cleanup.callback(sampler.finish)
        worker.wait_assigned(timeout=180)
        sent = 0
        before = offsets.ends()
        for pct in LOADS_PCT:
            rate = capacity * pct / 100
            progress(f"P4 {pct:3d} %: {rate:.1f} tickets/s for {seconds:.0f} s")
            began = time.time()
            count = produce_paced(bootstrap, topics.input, tickets, sent, rate, seconds)
            produced_until = time.time()
            sent += count
            ends = offsets.ends()
            # Drain before the next level so that its latencies are its own (a backlog drains at capacity).
            drained = offsets.follow(ends, 30 + 3 * count / max(capacity, 1.0), worker.alive, every=0.1)
            levels.append(
                {
                    "load_pct": pct,
                    "offered_rate": round(rate, 1),
                    "produced": count,
                    "began": began,
                    "produced_until": produced_until,
                    "drained": time.time(),
                    "drained_completely": drained.complete,
                    "offsets": {str(p): [before[p], ends[p]] for p in ends},
                }
            )
            before = ends
        time.sleep(1.2)  # one more metrics event
        code = worker.stop()
        committed = offsets.committed()
    progress("P4 auditing the topics")
    report = audit(bootstrap, topics, committed)
    metrics = [
        {
            "t": bench_report.epoch(event["timestamp"]),
            "in_flight": event.get("in_flight", 0),
            "in_flight_max": event.get("in_flight_max", 0),
            "rss_bytes": event.get("rss_bytes") or 0,
        }
        for event in worker.events("metrics")
        if event.get("timestamp")
    ]
    for level in levels:
        latencies: list[float] = []
        reasons: dict[str, int] = {}
        for partition, (low, high) in level["offsets"].items():
            for offset in range(low, high):
                position = (int(partition), offset)
                results = report.results.get(position, [])
                if results:
                    latencies.append(results[0][0] - report.inputs[position])
                    if results[0][1] is not None:
                        reasons[results[0][1]] = reasons.get(results[0][1], 0) + 1
        window = [m for m in metrics if level["began"] <= m["t"] <= level["drained"]]
        rss_window = [r for t, r in sampler.samples if level["began"] <= t <= level["drained"]]
        level.update(
            {
                "results": len(latencies),
                "p50_ms": _percentile(latencies, 50),
                "p95_ms": _percentile(latencies, 95),
                "p99_ms": _percentile(latencies, 99),
                "fallbacks": reasons,
                "fallback_rate": round(sum(reasons.values()) / max(1, len(latencies)), 4),
                "in_flight_peak": max((m["in_flight"] for m in window), default=None),
                "rss_start_bytes": rss_window[0] if rss_window else None,
                "rss_max_bytes": max(rss_window, default=None),
            }
        )
    return {
        "seconds_per_level": seconds,
        "capacity": capacity,
        "levels": levels,
        "inputs": len(report.inputs),
        "lost": report.lost,
        "unprocessed": report.unprocessed,
        "duplicates": report.duplicates,
        "worker_exit_code": code,
        "in_flight_max": max((m["in_flight_max"] for m in metrics), default=None),
        "metrics": metrics,
        "rss_samples": sampler.samples,
        "latency": "output record CreateTime - input record CreateTime (producer clocks, same host)",
    }


# -- P5 ---------------------------------------------------------------------------------------------------

P5_LOADS_PCT = (100, 150)
P5_TIGHT_S = 1.0  # even tickets are due this long after they are produced; odd ones two level lengths later
_DEADLINE_REASONS = ("overloaded", "deadline_exceeded")


def p5_edf_vs_fifo(bootstrap: str, capacity: float, seconds: float, logs: Path) -> dict[str, Any]:
    """A FIFO and an EDF worker, each level offered to one then the other (drained in between), so that both
    see the same machine. EDF reorders only what a worker holds: `max_in_flight` is sized to hold a level's
    whole backlog at 150 % (the default 64 is well under a second of work here)."""
    loose_s = 2 * seconds
    bound = max(64, math.ceil(capacity * seconds))
    flags = ("--max-in-flight", str(bound), "--deadline-ms", str(round(loose_s * 1000)))
    tickets = DueTickets(P5_TIGHT_S, loose_s)
    runs: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as cleanup:
        for mode in ("fifo", "edf"):
            (topics,) = new_topics(bootstrap, f"p5-{mode}")
            group = _group(f"p5-{mode}")
            worker = Worker(bootstrap, topics, group, logs / f"p5-{mode}.log", ("--scheduling", mode, *flags))
            cleanup.callback(worker.stop)
            runs[mode] = {"topics": topics, "worker": worker, "group": group, "sent": 0, "levels": []}
        for run in runs.values():
            run["worker"].wait_assigned(timeout=180)
            # Once assigned: a client made right after the topic was created may see it without partitions.
            run["offsets"] = Offsets(bootstrap, run["group"], run["topics"].input)
            cleanup.callback(run["offsets"].close)
        for pct in P5_LOADS_PCT:
            for mode, run in runs.items():
                rate = capacity * pct / 100
                progress(
                    f"P5 {mode} {pct:3d} %: {rate:.1f} tickets/s for {seconds:.0f} s (max_in_flight {bound})"
                )
                before = run["offsets"].ends()
                count = produce_paced(bootstrap, run["topics"].input, tickets, run["sent"], rate, seconds)
                run["sent"] += count
                ends = run["offsets"].ends()
                budget = 30 + 3 * count / max(capacity, 1.0)
                drained = run["offsets"].follow(ends, budget, run["worker"].alive, every=0.1)
                run["levels"].append({"load_pct": pct, "range": (before, ends), "drained": drained.complete})
        for run in runs.values():
            run["code"] = run["worker"].stop()
            run["committed"] = run["offsets"].committed()
    progress("P5 auditing the topics")
    figures: dict[str, Any] = {
        "capacity": capacity,
        "seconds_per_level": seconds,
        "max_in_flight": bound,
        "tight_s": P5_TIGHT_S,
        "loose_s": loose_s,
    }
    for mode, run in runs.items():
        report = audit(bootstrap, run["topics"], run["committed"])
        due: dict[tuple[int, int], tuple[float, bool]] = {}  # position → (deadline_at in ms, tight)
        for message in read_topic(bootstrap, run["topics"].input):
            ticket = msgspec.json.decode(message.value() or b"{}")
            due[(message.partition() or 0, message.offset() or 0)] = (
                bench_report.epoch(ticket["metadata"]["deadline_at"]) * 1000,
                int(ticket["ticket_id"].rsplit("-", 1)[1]) % 2 == 0,
            )
        levels = []
        for level in run["levels"]:
            before, ends = level.pop("range")
            tally = {"tickets": 0, "in_time": 0, "missed_tight": 0, "missed_loose": 0, "late": 0, "other": 0}
            for partition, end in ends.items():
                for offset in range(before[partition], end):
                    position = (partition, offset)
                    tally["tickets"] += 1
                    results = report.results.get(position)
                    written_ms, reason = results[0] if results else (math.inf, "unanswered")
                    due_ms, tight = due[position]
                    missed = reason in (*_DEADLINE_REASONS, "unanswered") or written_ms > due_ms
                    if reason is None and not missed:
                        tally["in_time"] += 1
                    elif missed:
                        tally["missed_tight" if tight else "missed_loose"] += 1
                        tally["late"] += reason is None
                    else:
                        tally["other"] += 1  # model_error or invalid_output
            levels.append({**level, **tally, "missed": tally["missed_tight"] + tally["missed_loose"]})
        figures[mode] = {
            "levels": levels,
            "lost": report.lost,
            "duplicates": report.duplicates,
            "worker_exit_code": run["code"],
        }
    return figures


# -- P6 ---------------------------------------------------------------------------------------------------

P6_LOAD_PCT = 70
_GUARANTEES = ("at_least_once", "exactly_once")


def p6_exactly_once(
    bootstrap: str, tickets: Tickets, capacity: float, count: int, budget: float, seconds: float, logs: Path
) -> dict[str, Any]:
    """Two workers with default settings but `--guarantee` (the exactly-once one with a transactional id of
    its own), each on its own topics, same tickets. Throughput: `count` tickets as fast as possible until the
    group has committed them, at-least-once before and after exactly-once (`bracket`). Latency: P6_LOAD_PCT %
    of the capacity (P2's, or the at-least-once burst's if lower) for `seconds`, offered to one, drained, then
    to the other; a ticket's latency is its input CreateTime → its result visible to a read_committed reader
    (`Visible`)."""
    runs: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as cleanup:
        for mode in _GUARANTEES:
            (topics,) = new_topics(bootstrap, f"p6-{mode}")
            group = _group(f"p6-{mode}")
            flags = ["--guarantee", mode]
            if mode == "exactly_once":
                flags += ["--transactional-id", f"{group}.txn"]
            worker = Worker(bootstrap, topics, group, logs / f"p6-{mode}.log", flags)
            cleanup.callback(worker.stop)
            runs[mode] = {"topics": topics, "worker": worker, "group": group, "sent": 0, "burst_end": 0}
        for run in runs.values():
            run["worker"].wait_assigned(timeout=180)
            run["offsets"] = Offsets(bootstrap, run["group"], run["topics"].input)
            cleanup.callback(run["offsets"].close)

        def throughput(mode: str, when: str = "") -> dict[str, Any]:
            run, offsets = runs[mode], runs[mode]["offsets"]
            progress(f"P6 {mode}{when}: {count} tickets as fast as possible")
            started = produce_tickets(bootstrap, run["topics"].input, tickets, run["sent"], count)
            run["sent"] += count
            done = offsets.follow(offsets.ends(), budget, run["worker"].alive, every=0.05)
            # This burst's records: committed past where the group stood when the previous burst ended.
            records, run["burst_end"] = done.records - run["burst_end"], done.records
            return {
                "records": records,
                "seconds": round(done.at - started, 3),
                "rate": round(records / (done.at - started), 1),
                "complete": done.complete,
            }

        alo_before = throughput("at_least_once", " (before)")
        eos_rate = throughput("exactly_once")
        alo_rate = bracket(alo_before, throughput("at_least_once", " (after)"))

        visible = Visible(bootstrap, end_offsets(bootstrap, [run["topics"].output for run in runs.values()]))
        cleanup.callback(visible.close)
        # Relative to the lower of P2's capacity and the at-least-once burst just measured: the machine may be
        # busier than it was during P2 (other jobs), and a level over capacity would measure a queue instead.
        capacity = min(capacity, alo_rate["rate"])
        rate = capacity * P6_LOAD_PCT / 100
        for mode, run in runs.items():
            progress(f"P6 {mode} {P6_LOAD_PCT} %: {rate:.1f} tickets/s for {seconds:.0f} s")
            before = run["offsets"].ends()
            sent = produce_paced(bootstrap, run["topics"].input, tickets, run["sent"], rate, seconds)
            run["sent"] += sent
            ends = run["offsets"].ends()
            budget_s = 30 + 3 * sent / max(capacity, 1.0)
            drained = run["offsets"].follow(ends, budget_s, run["worker"].alive, every=0.1)
            run["range"], run["drained"] = (before, ends), drained.complete
        time.sleep(1.2)  # the reader's last fetch; one more metrics event
        visible.close()
        for run in runs.values():
            run["code"] = run["worker"].stop()
            run["committed"] = run["offsets"].committed()
    progress("P6 auditing the topics (read_committed)")
    decode = msgspec.json.Decoder(TriageResult).decode
    figures: dict[str, Any] = {
        "tickets": count,
        "capacity": capacity,  # the lower of P2's and the at-least-once burst's
        "load_pct": P6_LOAD_PCT,
        "offered_rate": round(rate, 1),
        "seconds": seconds,
    }
    for mode, run in runs.items():
        report = audit(bootstrap, run["topics"], run["committed"])
        shown: dict[tuple[int, int], float] = {}  # input position → first visible, epoch ms
        for topic, at, value in visible.seen:
            if topic == run["topics"].output:
                source = decode(value).source
                shown.setdefault((source.partition, source.offset), at)
        before, ends = run["range"]
        positions = [(p, offset) for p, end in ends.items() for offset in range(before[p], end)]
        latencies = [
            round(shown[position] - report.inputs[position], 1) for position in positions if position in shown
        ]
        metrics = _last_metrics(run["worker"])
        figures[mode] = {
            "throughput": alo_rate if mode == "at_least_once" else eos_rate,
            "latency": {
                "tickets": len(positions),
                "visible": len(latencies),
                "drained": run["drained"],
                "p50_ms": _percentile(latencies, 50),
                "p99_ms": _percentile(latencies, 99),
            },
            "inputs": len(report.inputs),
            "lost": report.lost,
            "duplicates": report.duplicates,
            "unprocessed": report.unprocessed,
            "transactions": metrics.get("transactions"),
            "transactions_aborted": metrics.get("transactions_aborted"),
            "worker_exit_code": run["code"],
        }
    alo, eos = figures["at_least_once"], figures["exactly_once"]
    figures["throughput_ratio"] = round(eos["throughput"]["rate"] / alo["throughput"]["rate"], 3)
    for key in ("p50_ms", "p99_ms"):
        eos_ms, alo_ms = eos["latency"][key], alo["latency"][key]
        figures[f"{key[:3]}_ratio"] = round(eos_ms / alo_ms, 2) if eos_ms is not None and alo_ms else None
    figures["latency"] = "input CreateTime → result seen by a read_committed reader (wall clock, same host)"
    return figures


# -- P7 ---------------------------------------------------------------------------------------------------

_CASCADE_RUNS = {
    # The first stage alone, whatever the default: no escalation stage.
    "first_stage": ["--set", "inference.escalation="],
    "cascade": ["--escalation", "triage-encoder"],
}


def p7_cascade(bootstrap: str, count: int, budget: float, logs: Path) -> dict[str, Any]:
    """Two workers with default settings but the escalation stage, each on its own topics, the same BANKING77
    test tickets: `count` of them as fast as possible until the group committed them, the first stage
    alone before and after the cascade (`bracket`); then what each wrote, read back from its output."""
    tickets = LabelledTickets()
    runs: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as cleanup:
        for name, flags in _CASCADE_RUNS.items():
            (topics,) = new_topics(bootstrap, f"p7-{name}")
            group = _group(f"p7-{name}")
            worker = Worker(bootstrap, topics, group, logs / f"p7-{name}.log", flags)
            cleanup.callback(worker.stop)
            runs[name] = {"topics": topics, "worker": worker, "group": group, "sent": 0, "burst_end": 0}
        for run in runs.values():
            run["worker"].wait_assigned(timeout=240)
            run["offsets"] = Offsets(bootstrap, run["group"], run["topics"].input)
            cleanup.callback(run["offsets"].close)

        def throughput(name: str, when: str = "") -> dict[str, Any]:
            run, offsets = runs[name], runs[name]["offsets"]
            progress(f"P7 {name}{when}: {count} tickets as fast as possible")
            started = produce_tickets(bootstrap, run["topics"].input, tickets, run["sent"], count)
            run["sent"] += count
            done = offsets.follow(offsets.ends(), budget, run["worker"].alive, every=0.05)
            records, run["burst_end"] = done.records - run["burst_end"], done.records
            return {
                "records": records,
                "seconds": round(done.at - started, 3),
                "rate": round(records / (done.at - started), 1),
                "complete": done.complete,
            }

        before = throughput("first_stage", " (before)")
        cascade_rate = throughput("cascade")
        first_rate = bracket(before, throughput("first_stage", " (after)"))
        cascade_start = runs["cascade"]["worker"].events("cascade_started")
        for run in runs.values():
            run["code"] = run["worker"].stop()
    progress("P7 reading what each worker wrote")
    figures: dict[str, Any] = {"tickets": count, "texts": "BANKING77 test.csv, in file order, repeated"}
    for name, run in runs.items():
        figures[name] = {
            "throughput": first_rate if name == "first_stage" else cascade_rate,
            **_cascade_outputs(bootstrap, run["topics"].output, tickets),
            "worker_exit_code": run["code"],
        }
    figures["escalate_below"] = cascade_start[0]["escalate_below"] if cascade_start else None
    figures["ratio"] = round(cascade_rate["rate"] / first_rate["rate"], 3)
    return figures


def _cascade_outputs(bootstrap: str, topic: str, tickets: LabelledTickets) -> dict[str, Any]:
    """Intent accuracy of a worker's records against the tickets' labels, and the cascade's fields."""
    decode = msgspec.json.Decoder(TriageResult).decode
    correct = total = escalated = 0
    skipped: dict[str, int] = {}
    fallbacks: dict[str, int] = {}
    for message in read_topic(bootstrap, topic):
        value = message.value()
        assert isinstance(value, bytes)
        result = decode(value)
        total += 1
        correct += result.intent == tickets.label(int(result.ticket_id.removeprefix("bench-")))
        escalated += result.stage == "escalation"
        if result.escalation_skipped is not None:
            skipped[result.escalation_skipped] = skipped.get(result.escalation_skipped, 0) + 1
        if result.fallback_reason is not None:
            fallbacks[result.fallback_reason] = fallbacks.get(result.fallback_reason, 0) + 1
    return {
        "records": total,
        "accuracy": round(correct / max(1, total), 4),
        "escalated_share": round(escalated / max(1, total), 4),
        "escalation_skipped": skipped,
        "fallbacks": fallbacks,
    }


# -- main -------------------------------------------------------------------------------------------------


def _p7(bootstrap: str, sizes: dict[str, int], logs: Path) -> dict[str, Any]:
    p7 = p7_cascade(bootstrap, sizes["p7"], sizes["p7_budget_s"], logs)
    progress(f"P7 ratio cascade/first stage {p7['ratio']}")
    return p7


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so every `finally` (broker, worker, pool) still runs."""

    def interrupt(_signum: int, _frame: types.FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="small counts and 8 s load levels (< 5 min)")
    parser.add_argument(
        "--out", type=Path, default=Path("results"), help="folder for bench.* (default results)"
    )
    parser.add_argument("--only", choices=["p7"], help="run one figure alone (writes bench-<figure>.*)")
    args = parser.parse_args()
    sizes = (
        {
            "p1": 100_000,
            "p1_budget_s": 20,
            "p2": 3_000,
            "p2_budget_s": 60,
            "p3": 300,
            "p4_level_s": 8,
            "p5_level_s": 6,
            "p6": 1_500,
            "p6_budget_s": 60,
            "p6_level_s": 8,
            "p7": 1_000,
            "p7_budget_s": 300,
        }
        if args.quick
        else {
            "p1": 500_000,
            "p1_budget_s": 120,
            "p2": 20_000,
            "p2_budget_s": 600,
            "p3": 1000,
            "p4_level_s": 60,
            "p5_level_s": 15,
            "p6": 10_000,
            "p6_budget_s": 300,
            "p6_level_s": 30,
            "p7": 6_000,
            "p7_budget_s": 900,
        }
    )
    # The bench's own process logs warnings only (the in-process Pipeline and pool); the workers log JSON.
    configure_logging(LogSettings(level="warning"))
    figures: dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "command": " ".join(["python", *sys.argv]),
        "machine": bench_report.machine(),
        "sizes": sizes,
        "broker": os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or "local broker started by the bench",
    }
    tickets = Tickets()
    with (
        _sigterm_as_interrupt(),
        tempfile.TemporaryDirectory(prefix="triage-bench-logs-") as tmp,
        kafka(progress) as bootstrap,
    ):
        logs = Path(tmp)
        try:
            if args.only == "p7":
                figures["p7"] = _p7(bootstrap, sizes, logs)
                bench_report.write_only(figures, args.out, "p7")
                print((args.out / "bench-p7.md").read_text())
                return 0
            figures["p1"] = p1_kafka_overhead(bootstrap, tickets, sizes["p1"], sizes["p1_budget_s"])
            progress(f"P1 ratio {figures['p1']['ratio']}")
            pool_before = pool_baseline(tickets, sizes["p2"])
            worker = p2_worker(bootstrap, tickets, sizes["p2"], sizes["p2_budget_s"], logs)
            p2 = figures["p2"] = {"pool": bracket(pool_before, pool_baseline(tickets, sizes["p2"]))}
            p2["worker"] = worker
            p2["ratio"] = round(p2["worker"]["rate"] / p2["pool"]["rate"], 3)
            progress(f"P2 ratio {p2['ratio']}")
            figures["p3"] = {"seed": p3_seed_design(tickets, sizes["p3"])}
            figures["p3"]["ratio"] = round(p2["worker"]["rate"] / figures["p3"]["seed"]["rate"], 2)
            progress(f"P3 ratio {figures['p3']['ratio']}")
            figures["p4"] = p4_latency(bootstrap, tickets, p2["worker"]["rate"], sizes["p4_level_s"], logs)
            figures["p5"] = p5_edf_vs_fifo(bootstrap, p2["worker"]["rate"], sizes["p5_level_s"], logs)
            figures["p6"] = p6 = p6_exactly_once(
                bootstrap,
                tickets,
                p2["worker"]["rate"],
                sizes["p6"],
                sizes["p6_budget_s"],
                sizes["p6_level_s"],
                logs,
            )
            ratios = (p6["throughput_ratio"], p6["p50_ratio"], p6["p99_ratio"])
            progress("P6 ratios EOS/ALO: throughput {}, p50 {}, p99 {}".format(*ratios))
            figures["p7"] = _p7(bootstrap, sizes, logs)
        except BaseException:
            for log in sorted(logs.glob("*.log")):
                print(
                    f"--- tail of {log.name}\n" + "\n".join(log.read_text().splitlines()[-15:]),
                    file=sys.stderr,
                )
            raise
    bench_report.write(figures, args.out)
    progress(f"wrote {args.out}/bench.md, bench.json, bench-latency.png, bench-timeline.png")
    print((args.out / "bench.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
