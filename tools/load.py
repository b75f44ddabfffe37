"""What the benchmarks and the soak need around the code they measure: a broker, topics, tickets, offsets,
the worker as a subprocess with default settings, the CPU and memory of a process tree, and an audit of what
came out against what the group committed.

Every helper owns what it starts and stops it in a `finally` (or a context manager), so an error or Ctrl-C
in the middle of a phase leaves no broker, worker or pool process behind.
"""

from __future__ import annotations

import contextlib
import csv
import datetime
import os
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import confluent_kafka
import msgspec

from tools import REPO
from tools.harness import Position, Topics, WorkerProcess, headers_of, read_topic, worker_command
from worker.dev.local_broker import LocalBroker, free_port
from worker.kafka import dead_letters
from worker.kafka.admin import TopicSpec, create_topics
from worker.learning.evaluation import canonical_label
from worker.messages import TriageResult

BANKING77 = REPO / "data" / "banking77"
INPUT_PARTITIONS = 3
# A phase's topics hold up to a few hundred thousand records; reading one back may take this long.
AUDIT_TIMEOUT_S = 120.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")

Echo = Callable[[str], None]


# -- broker and topics ------------------------------------------------------------------------------------


# bootstrap → pid of a broker this process started: its CPU is part of what a worker costs on this machine.
BROKER_PID: dict[str, int | None] = {}


@contextlib.contextmanager
def kafka(echo: Echo) -> Iterator[str]:
    """The broker named by KAFKA_BOOTSTRAP_SERVERS, else a fresh local one on a free port in a temp dir."""
    named = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if named:
        echo(f"using the broker at {named} (KAFKA_BOOTSTRAP_SERVERS)")
        yield named
        return
    with tempfile.TemporaryDirectory(prefix="triage-bench-") as state:
        broker = LocalBroker(Path(state), port=free_port())
        try:
            status = broker.start(fresh=True, echo=echo)
            assert status.bootstrap is not None
            BROKER_PID[status.bootstrap] = status.pid
            yield status.bootstrap
        finally:
            broker.stop()


def new_topics(bootstrap: str, phase: str, outputs: int = 1) -> list[Topics]:
    """Unique topics for one phase (a shared broker may hold earlier runs): one input with
    INPUT_PARTITIONS partitions and `outputs` output/dead-letter pairs, all reading that input."""
    tag = f"bench.{phase}.{uuid.uuid4().hex[:8]}"
    sets = [Topics(f"{tag}.raw", f"{tag}.out{i}", f"{tag}.dlq{i}") for i in range(outputs)]
    specs = [TopicSpec(sets[0].input, INPUT_PARTITIONS, 1)]
    for topics in sets:
        specs += [TopicSpec(topics.output, INPUT_PARTITIONS, 1), TopicSpec(topics.dead_letter, 1, 1)]
    create_topics({"bootstrap.servers": bootstrap}, specs)
    return sets


# -- tickets ----------------------------------------------------------------------------------------------


def banking77_texts() -> list[str]:
    """Every BANKING77 query (train then test), the texts all phases use in the same order."""
    texts: list[str] = []
    for name in ("train.csv", "test.csv"):
        with (BANKING77 / name).open(newline="", encoding="utf-8") as handle:
            texts += [row["text"] for row in csv.DictReader(handle) if row["text"].strip()]
    return texts


class Tickets:
    """Ticket i is `{"ticket_id": "bench-<i>", "body": texts[i % len(texts)]}`, keyed by its id."""

    def __init__(self) -> None:
        self.texts = banking77_texts()
        self._encode = msgspec.json.Encoder().encode

    def text(self, index: int) -> str:
        return self.texts[index % len(self.texts)]

    def record(self, index: int) -> tuple[bytes, bytes]:
        ticket_id = f"bench-{index}"
        return ticket_id.encode(), self._encode({"ticket_id": ticket_id, "body": self.text(index)})


class LabelledTickets(Tickets):
    """BANKING77's test tickets only (in file order, repeated), with the intent each one is labelled with."""

    def __init__(self) -> None:
        super().__init__()
        with (BANKING77 / "test.csv").open(newline="", encoding="utf-8") as handle:
            rows = [(row["text"], canonical_label(row["category"])) for row in csv.DictReader(handle)]
        self.texts = [text for text, _ in rows]
        self._labels = [label for _, label in rows]

    def label(self, index: int) -> str:
        return self._labels[index % len(self._labels)]


class DueTickets(Tickets):
    """Tickets with a `metadata.deadline_at` set when `record` is called (i.e. when it is produced): even
    ones due `tight_s` later, odd ones `loose_s` later."""

    def __init__(self, tight_s: float, loose_s: float) -> None:
        super().__init__()
        self.budgets = (tight_s, loose_s)

    def record(self, index: int) -> tuple[bytes, bytes]:
        ticket_id = f"bench-{index}"
        due = datetime.datetime.fromtimestamp(time.time() + self.budgets[index % 2], datetime.UTC)
        metadata = {"deadline_at": due.isoformat()}
        ticket = {"ticket_id": ticket_id, "body": self.text(index), "metadata": metadata}
        return ticket_id.encode(), self._encode(ticket)


def loader(bootstrap: str) -> confluent_kafka.Producer:
    """A producer for feeding the input topic (large local queue; CreateTime set at `produce`)."""
    return confluent_kafka.Producer(
        {
            "bootstrap.servers": bootstrap,
            "linger.ms": 5,
            "queue.buffering.max.messages": 1_000_000,
            "queue.buffering.max.kbytes": 1_048_576,
        }
    )


def send(producer: confluent_kafka.Producer, topic: str, key: bytes, value: bytes) -> None:
    while True:
        try:
            producer.produce(topic, value=value, key=key)
            return
        except BufferError:
            producer.poll(0.01)


def produce_tickets(bootstrap: str, topic: str, tickets: Tickets, first: int, count: int) -> float:
    """Produce tickets first..first+count-1 as fast as the client takes them and wait for every ack;
    returns the monotonic time of the first `produce` call."""
    producer = loader(bootstrap)
    started = time.monotonic()
    for index in range(first, first + count):
        send(producer, topic, *tickets.record(index))
        if index % 1000 == 0:
            producer.poll(0)
    left = producer.flush(120)
    if left:
        raise RuntimeError(f"{left} tickets not acknowledged by the broker within 120 s")
    return started


def produce_paced(
    bootstrap: str, topic: str, tickets: Tickets, first: int, rate: float, seconds: float
) -> int:
    """Produce at `rate` tickets/s for `seconds` (2 ms schedule), wait for the acks; returns the count."""
    producer = loader(bootstrap)
    started = time.monotonic()
    sent = 0
    while (elapsed := time.monotonic() - started) < seconds:
        due = int(elapsed * rate)
        while sent < due:
            send(producer, topic, *tickets.record(first + sent))
            sent += 1
        producer.poll(0)
        time.sleep(0.002)
    left = producer.flush(120)
    if left:
        raise RuntimeError(f"{left} tickets not acknowledged by the broker within 120 s")
    return sent


# -- offsets ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Progress:
    """What a watched group had committed at monotonic time `at`; `complete` when all of the input."""

    at: float
    committed: dict[int, int]
    complete: bool

    @property
    def records(self) -> int:
        """Records committed, for a topic whose offsets start at 0 (the bench's topics are new)."""
        return sum(max(0, offset) for offset in self.committed.values())


class Offsets:
    """End offsets of a topic and a group's committed offsets on it, through one long-lived client that
    never joins the group (so watching does not disturb the consumer under test)."""

    def __init__(self, bootstrap: str, group: str, topic: str) -> None:
        self._consumer = confluent_kafka.Consumer(
            {"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False}
        )
        self._topic = topic
        partitions = self._consumer.list_topics(topic, timeout=10).topics[topic].partitions
        self._partitions = sorted(partitions)

    def ends(self) -> dict[int, int]:
        return {
            p: self._consumer.get_watermark_offsets(
                confluent_kafka.TopicPartition(self._topic, p), timeout=10, cached=False
            )[1]
            for p in self._partitions
        }

    def committed(self) -> dict[int, int]:
        wanted = [confluent_kafka.TopicPartition(self._topic, p) for p in self._partitions]
        try:
            return {tp.partition: tp.offset for tp in self._consumer.committed(wanted, timeout=10)}
        except confluent_kafka.KafkaException:
            return {}  # coordinator still loading; asked again on the next turn

    def follow(
        self, ends: dict[int, int], budget: float, alive: Callable[[], None], every: float = 0.02
    ) -> Progress:
        """Watch the group until its committed offsets equal `ends` or `budget` seconds have passed;
        `alive` raises when the consumer under test has died."""
        deadline = time.monotonic() + budget
        while True:
            committed = self.committed()
            now = time.monotonic()
            if committed == ends or now >= deadline:
                return Progress(now, committed, committed == ends)
            alive()
            time.sleep(every)

    def close(self) -> None:
        self._consumer.close()


# -- process trees ----------------------------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # fields from the 3rd (state) on; comm may hold spaces


def tree(pid: int) -> list[int]:
    """`pid` and all its live descendants (the worker and its pool processes)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo += children.get(current, [])
    return found


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of the live tree under `pid`."""
    ticks = 0
    for member in tree(pid):
        if (fields := _stat(member)) is not None:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / _CLK_TCK


def rss_bytes(pid: int) -> int:
    """Resident memory of the live tree under `pid` (pages shared between processes count once each)."""
    total = 0
    for member in tree(pid):
        if (fields := _stat(member)) is not None:
            total += int(fields[21]) * _PAGE
    return total


# -- the worker -------------------------------------------------------------------------------------------


class BenchWorker(WorkerProcess):
    """`triage-worker run` with default settings (only bootstrap, topics, group and `args` set), JSON logs in
    a file.

    It runs in its own session, so a Ctrl-C of the bench does not reach it and `stop` can end its whole
    process group (pool processes included) whatever state it is in.
    """

    def __init__(
        self, bootstrap: str, topics: Topics, group: str, log_path: Path, args: Sequence[str] = ()
    ) -> None:
        super().__init__(worker_command(bootstrap, topics, group, args), log_path, own_session=True)

    def alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"the worker exited with code {self.process.returncode}:\n{self.tail()}")

    def wait_assigned(self, timeout: float) -> None:
        """Until the worker owns all input partitions (model loaded, group joined)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            owned = {p for event in self.events("partitions_assigned") for p in event.get("partitions", [])}
            if len(owned) >= INPUT_PARTITIONS:
                return
            self.alive()
            time.sleep(0.1)
        raise TimeoutError(
            f"the worker was not assigned its partitions within {timeout:.0f}s:\n{self.tail()}"
        )

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (graceful: finish, commit, leave), then SIGKILL of the whole group after `timeout`."""
        try:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(timeout)
            return self.process.returncode
        finally:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
            self.process.wait()
            self._log.close()


# -- audit ------------------------------------------------------------------------------------------------


@dataclass
class Audit:
    """Input records (position → CreateTime ms) and what the worker wrote for each."""

    inputs: dict[Position, int] = field(default_factory=dict)
    results: dict[Position, list[tuple[int, str | None]]] = field(default_factory=dict)  # (ms, fallback)
    dead: dict[Position, int] = field(default_factory=dict)
    committed: dict[int, int] = field(default_factory=dict)

    def outcomes(self, position: Position) -> int:
        return len(self.results.get(position, [])) + self.dead.get(position, 0)

    @property
    def lost(self) -> int:
        """Inputs the group committed past without a result or dead letter."""
        return sum(
            1
            for (partition, offset) in self.inputs
            if offset < self.committed.get(partition, -1) and self.outcomes((partition, offset)) == 0
        )

    @property
    def unprocessed(self) -> int:
        """Inputs at or past the committed offset (still to do when the worker stopped)."""
        return sum(1 for (partition, offset) in self.inputs if offset >= self.committed.get(partition, -1))

    @property
    def duplicates(self) -> int:
        return sum(max(0, self.outcomes(position) - 1) for position in self.inputs)


def audit(bootstrap: str, topics: Topics, committed: dict[int, int]) -> Audit:
    report = Audit(committed=committed)
    for message in read_topic(bootstrap, topics.input, AUDIT_TIMEOUT_S):
        report.inputs[(message.partition() or 0, message.offset() or 0)] = message.timestamp()[1]
    decode = msgspec.json.Decoder(TriageResult).decode
    for message in read_topic(bootstrap, topics.output, AUDIT_TIMEOUT_S):
        value = message.value()
        assert isinstance(value, bytes)
        result = decode(value)
        position = (result.source.partition, result.source.offset)
        report.results.setdefault(position, []).append((message.timestamp()[1], result.fallback_reason))
    for message in read_topic(bootstrap, topics.dead_letter, AUDIT_TIMEOUT_S):
        headers = headers_of(message)
        position = (int(headers[dead_letters.SOURCE_PARTITION]), int(headers[dead_letters.SOURCE_OFFSET]))
        report.dead[position] = report.dead.get(position, 0) + 1
    return report


class Visible:
    """A read_committed reader of output topics, as a downstream consumer of the worker would be: when (wall
    clock, ms) each record became visible to it, from the given start offsets on.

    It polls on a thread of its own and keeps the raw values (decoded after the run, not while it measures).
    """

    def __init__(self, bootstrap: str, starts: dict[str, dict[int, int]]) -> None:
        self._consumer = confluent_kafka.Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"bench-visible-{uuid.uuid4().hex}",
                "enable.auto.commit": False,
                "isolation.level": "read_committed",
            }
        )
        self._consumer.assign(
            [
                confluent_kafka.TopicPartition(topic, partition, offset)
                for topic, offsets in starts.items()
                for partition, offset in offsets.items()
            ]
        )
        self.seen: list[tuple[str, float, bytes]] = []  # (topic, visible at in epoch ms, value)
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="visible-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._halt.is_set():
            # One record per call: `consume(n, timeout)` would wait for n records or the timeout.
            message = self._consumer.poll(0.1)
            if message is None or message.error() is not None:
                continue
            topic, value = message.topic(), message.value()
            if topic is not None and value is not None:
                self.seen.append((topic, time.time() * 1000, value))

    def close(self) -> None:
        """Stops the reader; once (later calls do nothing)."""
        if self._halt.is_set():
            return
        self._halt.set()
        self._thread.join(10)
        self._consumer.close()
