"""The worker under test as a real subprocess (`python -m worker run`), and an audit of its topics: shared by
the tests (`from tools.harness import ...`), the benchmarks, soak and chaos.

`worker_command` is the one place the launch command is written. The audit reads every input record, every
output record and every dead letter and maps each input offset to what the worker wrote for it (by `source`
in a result, by `triage.source.*` headers in a dead letter). That is the whole promise of the pipeline in one
table: nothing lost, duplicates counted.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import confluent_kafka
import msgspec
from confluent_kafka.admin import AdminClient
from confluent_kafka.admin._config import (  # re-exported untyped by confluent_kafka.admin
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
)
from confluent_kafka.admin._resource import ResourceType  # re-exported untyped by confluent_kafka.admin

from tools import REPO
from worker.cli.launch import run_command
from worker.dev.samples import KIND_HEADER, SampleFactory, produce_samples
from worker.kafka import dead_letters
from worker.kafka.admin import METADATA_ONLY
from worker.kafka.clients import CLASSIC_ONLY, CONSUMER_PROTOCOL, group_protocol
from worker.messages import TriageResult
from worker.settings import Settings, load_settings

TINY_MODEL = REPO / "tests" / "models" / "tiny"
SLOW_MODEL_SCRIPT = REPO / "tests" / "slow_model.py"
# The broker's minimum; a killed worker's partitions move on after this long.
FAST_GROUP_OPTIONS = {
    "kafka.session.timeout.ms": "6000",
    "kafka.heartbeat.interval.ms": "1000",
    "kafka.max.poll.interval.ms": "10000",
}


def fast_group_options(settings: Mapping[str, str]) -> dict[str, str]:
    """FAST_GROUP_OPTIONS a worker with `settings` (dotted keys) may take: under the consumer-group protocol
    the broker sets the session and heartbeat timings, and the worker refuses them (CLASSIC_ONLY)."""
    kafka = {key.removeprefix("kafka."): value for key, value in settings.items() if key.startswith("kafka.")}
    if group_protocol(kafka) != CONSUMER_PROTOCOL:
        return dict(FAST_GROUP_OPTIONS)
    options = FAST_GROUP_OPTIONS.items()
    return {key: value for key, value in options if key.removeprefix("kafka.") not in CLASSIC_ONLY}


Position = tuple[int, int]


@dataclass
class Topics:
    input: str
    output: str
    dead_letter: str


def make_topics(unique_topic: Callable[..., str], partitions: int = 3) -> Topics:
    return Topics(
        unique_topic("raw", partitions=partitions),
        unique_topic("triaged", partitions=partitions),
        unique_topic("dlq", partitions=1),
    )


def settings_for(bootstrap: str, topics: Topics, **overrides: object) -> Settings:
    return load_settings(
        env={},
        overrides={
            "kafka.bootstrap.servers": bootstrap,
            "topics.input": topics.input,
            "topics.output": topics.output,
            "topics.dead_letter": topics.dead_letter,
            **overrides,
        },
    )


def publish(
    bootstrap: str,
    topics: Topics,
    count: int,
    rate: float = 0.0,
    malformed_ratio: float = 0.1,
    seed: int = 1,
    until: threading.Event | None = None,
) -> int:
    """Publish `count` tickets (0: until `until` is set) at `rate` per second; returns how many."""
    factory = SampleFactory(seed=seed, malformed_ratio=malformed_ratio, prefix=f"T{seed}")
    stats = produce_samples(settings_for(bootstrap, topics), topics.input, count, rate, factory, until)
    assert (count == 0 or stats.sent == count) and stats.failed == 0, stats
    return stats.sent


class Publisher(threading.Thread):
    """`publish` in the background, for streams that run while the test disturbs the worker or broker.

    `count` 0: the stream flows until `end()`, so it lasts as long as the disturbance however slowly the
    workers start on a loaded machine; `sent` says how many it published."""

    def __init__(self, bootstrap: str, topics: Topics, count: int, rate: float, seed: int) -> None:
        super().__init__(daemon=True)
        self._ended = threading.Event()
        self._args = (bootstrap, topics, count, rate, 0.1, seed, self._ended)
        self.sent = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.sent = publish(*self._args)
        except BaseException as error:
            self.error = error

    def end(self) -> None:
        """Stop publishing (a stream of `count` 0), then `finish`."""
        self._ended.set()

    def finish(self, timeout: float) -> None:
        self.join(timeout)
        assert not self.is_alive(), "publisher did not finish"
        if self.error is not None:
            raise self.error


def worker_command(
    bootstrap: str,
    topics: Topics,
    group: str,
    options: Sequence[str] = (),
    entry: Sequence[str] = ("-m", "worker"),
) -> list[str]:
    """`triage-worker run` on `topics` in `group` with JSON logs and a metrics event every second, then
    `options`. `entry` replaces `-m worker` with a script that runs the same CLI (tests/slow_model.py)."""
    topic_options = ["--input-topic", topics.input, "--output-topic", topics.output]
    topic_options += [
        "--dead-letter-topic",
        topics.dead_letter,
        "--group-id",
        group,
        "--metrics-interval",
        "1",
    ]
    return run_command(bootstrap, [*topic_options, *options], entry)


class WorkerProcess:
    """A `worker_command` subprocess with its output (JSON log lines) in a file.

    No `TRIAGE_*` or `KAFKA_*` variable of the caller's shell reaches it: its settings are the command's (and
    `env`'s, added on top).
    """

    def __init__(
        self,
        command: Sequence[str],
        log_path: Path,
        own_session: bool = False,
        env: dict[str, str] | None = None,
        tracer: Sequence[str] = (),
    ) -> None:
        """`own_session`: a Ctrl-C of the caller does not reach the worker (the caller stops it).
        `tracer`: a command the worker runs under (`strace ... --`); `process` is then the tracer's and `pid`
        the worker's."""
        self.log_path = log_path
        clean = {k: v for k, v in os.environ.items() if not k.startswith(("KAFKA_", "TRIAGE_"))}
        self._log = log_path.open("wb")
        self._traced = bool(tracer)
        self.process = subprocess.Popen(
            [*tracer, *command],
            cwd=REPO,
            env={**clean, **(env or {})},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=own_session,
        )

    @property
    def pid(self) -> int:
        """The worker's process id: under a tracer, the tracer's child (the tracer's own once it is gone)."""
        if not self._traced:
            return self.process.pid
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and self.process.poll() is None:
            with contextlib.suppress(OSError):  # the tracer exited meanwhile
                started = children.read_text().split()
                if started:
                    return int(started[0])
            time.sleep(0.05)
        return self.process.pid

    def send_signal(self, signum: int) -> None:
        """Send `signum` to the worker, unless its process (or its tracer) has ended."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.kill(self.pid, signum)

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        found = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            if not line.startswith("{"):
                continue
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if name is None or event.get("event") == name:
                found.append(event)
        return found

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


class Worker(WorkerProcess):
    """The worker as the tests and chaos run it: the test model and fast group timeouts unless told
    otherwise, logs in `log_dir`."""

    def __init__(
        self,
        bootstrap: str,
        topics: Topics,
        group: str,
        log_dir: Path,
        name: str = "worker",
        settings: dict[str, str] | None = None,
        args: tuple[str, ...] = (),
        slow_model_s: float = 0.0,
        model: Path | None = TINY_MODEL,
        env: dict[str, str] | None = None,
        tracer: Sequence[str] = (),
    ) -> None:
        """`model=None` leaves the model to the settings (e.g. a `--config` file in `args`); `env` is added
        to the worker's environment; `tracer` as for `WorkerProcess`."""
        self._bootstrap, self._group, self._input_topic = bootstrap, group, topics.input
        sets = {**fast_group_options(settings or {}), **(settings or {})}
        options = [
            *(["--model", str(model)] if model is not None else []),
            *(f"--set={key}={value}" for key, value in sets.items()),
            *args,
        ]
        # A slowed model runs the same CLI through tests/slow_model.py.
        entry = ["-m", "worker"] if not slow_model_s else [str(SLOW_MODEL_SCRIPT), str(slow_model_s)]
        command = worker_command(bootstrap, topics, group, options, entry)
        super().__init__(command, log_dir / f"{name}-{uuid.uuid4().hex[:6]}.log", env=env, tracer=tracer)

    def wait_for(self, event: str, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.events(event)
            if found:
                return found[-1]
            if self.process.poll() is not None:
                raise AssertionError(
                    f"worker exited ({self.process.returncode}) before {event}:\n{self.tail()}"
                )
            time.sleep(0.1)
        raise AssertionError(f"no {event} within {timeout}s:\n{self.tail()}")

    def metrics(self) -> list[dict[str, Any]]:
        return self.events("metrics")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait: the graceful path."""
        self.send_signal(signal.SIGTERM)
        try:
            code = self.process.wait(timeout)
        finally:
            self.kill()
        return code

    def run_to_completion(self, timeout: float) -> None:
        """Until the group has committed the whole input topic, then a graceful stop that must exit 0;
        the process is killed whatever happens."""
        try:
            self.wait_for("pipeline_started", timeout=90)  # a stop before its signal handlers is a kill
            wait_until_committed(self._bootstrap, self._group, self._input_topic, timeout, worker=self)
            assert self.stop() == 0
        finally:
            self.kill()

    def kill(self) -> None:
        """SIGKILL: the crash path (no flush, no commit, no leaving the group)."""
        if self.process.poll() is None:
            self.send_signal(signal.SIGKILL)
            self.process.wait(30)
        # The pool's worker processes notice the closed pipe and exit by themselves.
        self._log.close()


def paced(
    plan: Sequence[str], span_s: float, rng: random.Random, between: Callable[[], None]
) -> Iterator[tuple[int, str]]:
    """A chaos schedule's events, each at its instant: `plan` spread evenly over `span_s` from now, each a
    second or so early or late (drawn from `rng`); `between` runs about every second while it waits and
    once before each event (the group's own checks)."""
    started = time.monotonic()
    for index, action in enumerate(plan):
        due = started + (index + 1) * span_s / (len(plan) + 1) + rng.uniform(-1.0, 1.0)
        while (left := due - time.monotonic()) > 0:
            time.sleep(min(left, 1.0))
            between()
        between()
        yield index, action


def those_with(workers: Sequence[Worker], event: str, timeout: float) -> list[Worker]:
    """The workers of `workers` that logged `event`, waiting up to `timeout` for one; all of them if none did
    by then (a chaos schedule goes on either way)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [w for w in workers if w.events(event)]
        if found or time.monotonic() > deadline:
            return found or list(workers)
        time.sleep(0.5)


def wait_started(workers: Sequence[Worker], timeout: float = 120.0) -> None:
    """Until every one of `workers` is past its start (`pipeline_started`: signal handlers installed) or
    `timeout` passed: a SIGTERM before that ends the process by the signal's default (exit -15), as for any
    program, with nothing taken yet; on a loaded machine a start takes tens of seconds."""
    deadline = time.monotonic() + timeout
    while any(w.process.poll() is None and not w.events("pipeline_started") for w in workers):
        if time.monotonic() > deadline:
            return
        time.sleep(0.5)


# A read_committed reader sees a partition only up to its last stable offset (LSO): the first offset of the
# oldest transaction still open on it. A killed exactly-once worker's open transaction holds the LSO back
# until the broker aborts it (its transaction.timeout.ms, 10 s here, then the broker's scan for timed-out
# transactions, every 10 s by default; measured 14-17 s: docs/guarantees.md), and every later record of that
# partition, committed or not, stays out of sight until then. So an audit waits, bounded, until the LSO has
# reached the high watermark: a promise is judged on what a downstream reader will actually see, not on how
# early it looked.
VISIBLE_WITHIN_S = 90.0


@dataclass(frozen=True)
class Visibility:
    """What a read_committed reader could see of `topic`: its high watermarks when the audit began (`ends`),
    its last stable offsets when the wait for them ended (`stable`), and how long that wait took."""

    topic: str
    ends: dict[int, int]
    stable: dict[int, int]
    waited_s: float

    @property
    def hidden(self) -> int:
        """Records (and transaction markers) written but not visible to a read_committed reader."""
        return sum(end - self.stable.get(p, 0) for p, end in self.ends.items())

    def describe(self) -> str:
        if not self.hidden:
            return f"{self.topic}: visible to read_committed after {self.waited_s:.1f} s"
        behind = {p: self.ends[p] - self.stable[p] for p in self.ends if self.ends[p] > self.stable[p]}
        return (
            f"{self.topic}: {self.hidden} offsets still hidden from read_committed after "
            f"{self.waited_s:.1f} s (open transactions hold back partitions {behind})"
        )


def _watermarks(bootstrap: str, topic: str, isolation: str) -> dict[int, int]:
    consumer = confluent_kafka.Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"audit-{uuid.uuid4().hex}",
            "isolation.level": isolation,
        }
    )
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        # cached=False asks the broker; under read_committed the "high" offset it answers is the LSO.
        return {
            p: consumer.get_watermark_offsets(confluent_kafka.TopicPartition(topic, p), timeout=10)[1]
            for p in partitions
        }
    finally:
        consumer.close()


def visibility(bootstrap: str, topic: str, within_s: float = VISIBLE_WITHIN_S) -> Visibility:
    """Waits up to `within_s` until a read_committed reader sees `topic` up to its current high watermarks."""
    ends = end_offsets(bootstrap, topic)
    started = time.monotonic()
    while True:
        stable = _watermarks(bootstrap, topic, "read_committed")
        waited = time.monotonic() - started
        if all(stable.get(p, 0) >= end for p, end in ends.items()) or waited >= within_s:
            return Visibility(topic, ends, {p: min(stable.get(p, 0), end) for p, end in ends.items()}, waited)
        time.sleep(0.5)


def read_topic(
    bootstrap: str, topic: str, timeout: float = 60.0, seen: Visibility | None = None
) -> Iterator[confluent_kafka.Message]:
    """Every record of `topic` a downstream reader of exactly-once output sees (read_committed: records of
    aborted transactions are skipped), up to the high watermark once the last stable offset has caught up with
    it (`visibility`, bounded; pass `seen` to read up to a visibility already waited for)."""
    ends = (seen or visibility(bootstrap, topic)).stable
    consumer = confluent_kafka.Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"audit-{uuid.uuid4().hex}",
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            # A transaction's last offset is its commit marker, never handed out: the end shows as an event.
            "enable.partition.eof": True,
        }
    )
    try:
        todo = {p for p, end in ends.items() if end > 0}
        consumer.assign(
            [confluent_kafka.TopicPartition(topic, p, confluent_kafka.OFFSET_BEGINNING) for p in todo]
        )
        deadline = time.monotonic() + timeout
        while todo:
            if time.monotonic() > deadline:
                raise TimeoutError(f"could not read {topic} to its end offsets {ends}")
            for message in consumer.consume(1000, 0.5):
                partition, offset, error = message.partition(), message.offset(), message.error()
                if partition is None or offset is None:
                    continue
                if error is not None:
                    at_end = error.code() == confluent_kafka.KafkaError._PARTITION_EOF
                    if at_end and offset >= ends[partition]:
                        todo.discard(partition)
                    continue
                if offset < ends[partition]:
                    yield message
                if offset >= ends[partition] - 1:
                    todo.discard(partition)
    finally:
        consumer.close()


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    """High watermarks: everything written, visible or not (librdkafka's default isolation, read_committed,
    would answer last stable offsets)."""
    return _watermarks(bootstrap, topic, "read_uncommitted")


def set_share_group_configs(bootstrap: str, group: str, configs: Mapping[str, object]) -> None:
    """Share-group configs (e.g. `share.record.lock.duration.ms`) set before the group exists, as an operator
    would with kafka-configs.sh; None values are left alone."""
    entries = [
        ConfigEntry(name, str(value), incremental_operation=AlterConfigOpType.SET)
        for name, value in configs.items()
        if value is not None
    ]
    if entries:
        admin = AdminClient({"bootstrap.servers": bootstrap})
        resource = ConfigResource(ResourceType.GROUP, group, incremental_configs=entries)
        admin.incremental_alter_configs([resource])[resource].result()


def wait_until_served(bootstrap: str, topic: str, partitions: int, timeout_s: float = 30.0) -> None:
    """The controller has created the topic when create_topics returns; the broker's metadata catches up a
    moment later (seconds on a loaded machine), and until then it answers UNKNOWN_TOPIC_OR_PART or lists no
    partitions. AssertionError unless it serves `partitions` partitions, each led, in `timeout_s`."""
    admin = AdminClient({"bootstrap.servers": bootstrap, **METADATA_ONLY})
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = admin.list_topics(topic, timeout=10).topics.get(topic)
        if (
            found is not None
            and found.error is None
            and len(found.partitions) == partitions
            and all(partition.leader >= 0 for partition in found.partitions.values())
        ):
            return
        time.sleep(0.2)
    raise AssertionError(f"topic {topic} not served with {partitions} partitions within {timeout_s:.0f}s")


def group_protocol_type(bootstrap: str, group: str) -> str:
    """The protocol of a live group as the broker sees it: "CONSUMER" (KIP-848) or "CLASSIC"."""
    admin = AdminClient({"bootstrap.servers": bootstrap, **METADATA_ONLY})
    described = admin.describe_consumer_groups([group])[group].result(timeout=30)
    return str(described.type.name)


def committed_offsets(bootstrap: str, group: str, topic: str) -> dict[int, int]:
    """The group's committed offsets (-1001 where none), retrying while the coordinator settles."""
    consumer = confluent_kafka.Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        wanted = [confluent_kafka.TopicPartition(topic, p) for p in partitions]
        deadline = time.monotonic() + 30
        while True:
            try:
                return {tp.partition: tp.offset for tp in consumer.committed(wanted, timeout=10)}
            except confluent_kafka.KafkaException:
                # NOT_COORDINATOR / COORDINATOR_LOAD_IN_PROGRESS on a young broker or after a restart.
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    finally:
        consumer.close()


def wait_until_committed(
    bootstrap: str, group: str, topic: str, timeout: float, worker: Worker | None = None
) -> None:
    """Until the group's committed offsets reach the input's end offsets (all work done)."""
    ends = end_offsets(bootstrap, topic)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if committed_offsets(bootstrap, group, topic) == ends:
            return
        if worker is not None and worker.process.poll() is not None:
            raise AssertionError(f"worker exited ({worker.process.returncode}):\n{worker.tail()}")
        time.sleep(0.5)
    raise AssertionError(
        f"committed {committed_offsets(bootstrap, group, topic)} != end offsets {ends} after {timeout}s"
    )


@dataclass
class Audit:
    inputs: dict[Position, str] = field(default_factory=dict)  # position → sample kind
    results: dict[Position, list[TriageResult]] = field(default_factory=lambda: collections.defaultdict(list))
    dead: dict[Position, list[str]] = field(default_factory=lambda: collections.defaultdict(list))
    headers_kept: int = 0
    # Where each output of an input position sits ("out[3]@120"): the evidence for a duplicate.
    copies: dict[Position, list[str]] = field(default_factory=lambda: collections.defaultdict(list))
    # Per topic read: how long the wait for read_committed to see it whole took, and what stayed hidden.
    visibility: list[Visibility] = field(default_factory=list)

    @property
    def hidden(self) -> int:
        """Offsets of output topics a read_committed reader could still not see when the audit read them."""
        return sum(seen.hidden for seen in self.visibility)

    @property
    def lost(self) -> list[Position]:
        return sorted(p for p in self.inputs if not self.results.get(p) and not self.dead.get(p))

    @property
    def duplicated(self) -> list[Position]:
        """Input positions with more than one output."""
        return sorted(p for p in self.inputs if len(self.results.get(p, [])) + len(self.dead.get(p, [])) > 1)

    @property
    def duplicates(self) -> int:
        # One pass: asking `p not in self.lost` per input was quadratic (hours for chaos's 100,000 inputs).
        return sum(max(0, len(self.results.get(p, [])) + len(self.dead.get(p, [])) - 1) for p in self.inputs)

    @property
    def misrouted(self) -> list[Position]:
        """Tickets dead-lettered or malformed records classified, or both for one offset."""
        wrong = []
        for position, kind in self.inputs.items():
            results, dead = self.results.get(position, []), self.dead.get(position, [])
            expected_dead = [kind.removeprefix("malformed:")] if kind != "ticket" else []
            # A ticket must only have results; a malformed record only dead letters of its own error type.
            if (kind == "ticket" and dead) or (
                kind != "ticket" and (results or set(dead) - set(expected_dead))
            ):
                wrong.append(position)
        return wrong

    @property
    def escalated(self) -> int:
        """Results the cascade's escalation stage answered."""
        return sum(r.stage == "escalation" for records in self.results.values() for r in records)

    @property
    def fallback_reasons(self) -> collections.Counter[str | None]:
        return collections.Counter(
            r.fallback_reason for records in self.results.values() for r in records if r.fallback
        )

    def summary(self) -> str:
        return (
            f"inputs={len(self.inputs)} results={sum(map(len, self.results.values()))} "
            f"dead_letters={sum(map(len, self.dead.values()))} lost={len(self.lost)} "
            f"duplicates={self.duplicates}"
        )


def headers_of(message: confluent_kafka.Message) -> dict[str, str]:
    raw = message.headers() or []
    pairs = raw.items() if isinstance(raw, dict) else raw
    return {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in pairs}


def audit(bootstrap: str, topics: Topics, visible_within_s: float = VISIBLE_WITHIN_S) -> Audit:
    """Every input offset mapped to its outputs, as a read_committed reader sees the outputs once every open
    transaction has ended (waiting up to `visible_within_s` per topic, said in `visibility`)."""
    report = Audit()

    def read(topic: str) -> Iterator[confluent_kafka.Message]:
        seen = visibility(bootstrap, topic, visible_within_s)
        report.visibility.append(seen)
        return read_topic(bootstrap, topic, seen=seen)

    for message in read(topics.input):
        kind = headers_of(message).get(KIND_HEADER, "?")
        report.inputs[(message.partition() or 0, message.offset() or 0)] = kind
    decoder = msgspec.json.Decoder(TriageResult)
    for message in read(topics.output):
        value = message.value()
        assert isinstance(value, bytes)
        result = decoder.decode(value)
        assert result.source.topic == topics.input
        report.results[(result.source.partition, result.source.offset)].append(result)
        report.copies[(result.source.partition, result.source.offset)].append(
            f"out[{message.partition()}]@{message.offset()} {result.classified_at}"
        )
        if KIND_HEADER in headers_of(message):
            report.headers_kept += 1
    for message in read(topics.dead_letter):
        headers = headers_of(message)
        position = (int(headers[dead_letters.SOURCE_PARTITION]), int(headers[dead_letters.SOURCE_OFFSET]))
        report.dead[position].append(headers[dead_letters.ERROR_TYPE])
        report.copies[position].append(f"dlq[{message.partition()}]@{message.offset()}")
    return report
