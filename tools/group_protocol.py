"""How long the group's output pauses while a worker joins or leaves mid-stream, with each consumer-group
protocol, in one run against one local broker (#36); figures in results/group-protocol.md and .json.

    .venv/bin/python -m tools.group_protocol [--quick] [--events 6] [--rate 40] [--out results]

For each protocol in turn (`classic`, cooperative-sticky, then `consumer`, KIP-848), on topics and a group of
its own: a steady stream of sample tickets at `--rate` per second on 6 partitions, two workers (the tiny test
model), and `--events` membership changes `--dwell` seconds apart, alternating: a third worker joins (the
event starts when its process starts), then it leaves (SIGTERM, a graceful leave). Each protocol runs with its
own defaults for liveness, as a deployment gets them: the classic one librdkafka's (session.timeout.ms 45 s,
heartbeat.interval.ms 3 s), the consumer one the broker's (group.consumer.heartbeat.interval.ms 5 s).

Per event, from its start to the next event's: the longest gap between two consecutive output records of the
group (the group's pause), and the longest wait of a ticket published in that stretch (its output record's
timestamp minus its input record's: a partition without an owner shows here). The steady stretch before the
first event is the baseline. After the last event the stream stops, the two workers finish, and the audit
promises 0 lost.

Exits 1 when a ticket was lost or a worker failed.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from tools import harness, promises
from tools.promises import progress
from worker.dev.local_broker import LocalBroker, free_port
from worker.kafka.admin import TopicSpec, create_topics
from worker.messages import TriageResult

PROTOCOLS = ("classic", "consumer")
PARTITIONS = 6
# librdkafka's own defaults for the classic protocol's liveness (the test harness's are faster, for kill -9
# tests), and the poll interval of both.
CLASSIC_DEFAULTS = {"kafka.session.timeout.ms": "45000", "kafka.heartbeat.interval.ms": "3000"}
MAX_POLL_DEFAULT = {"kafka.max.poll.interval.ms": "300000"}


@dataclass
class Event:
    """One membership change: what happened, and when its stretch began and ended (wall clock, ms)."""

    action: str
    start_ms: int
    end_ms: int = 0
    longest_gap_ms: int = 0
    longest_wait_ms: int = 0
    outputs: int = 0


@dataclass
class ProtocolRun:
    protocol: str
    group_type: str = "?"
    baseline: Event = field(default_factory=lambda: Event("steady", 0))
    events: list[Event] = field(default_factory=list)
    summary: str = ""
    lost: int = 0
    failures: list[str] = field(default_factory=list)


def _now_ms() -> int:
    return int(time.time() * 1000)


def _timestamps(
    bootstrap: str, topics: harness.Topics
) -> tuple[dict[tuple[int, int], int], list[tuple[int, int]]]:
    """Input positions' timestamps, and (output timestamp, input timestamp) per ticket's first output."""
    published = {
        (message.partition() or 0, message.offset() or 0): message.timestamp()[1]
        for message in harness.read_topic(bootstrap, topics.input)
    }
    decoder = msgspec.json.Decoder(TriageResult)
    first: dict[tuple[int, int], int] = {}
    for message in harness.read_topic(bootstrap, topics.output):
        value = message.value()
        assert isinstance(value, bytes)
        source = decoder.decode(value).source
        position = (source.partition, source.offset)
        written = message.timestamp()[1]
        first[position] = min(written, first.get(position, written))
    pairs = sorted((written, published[position]) for position, written in first.items())
    return published, pairs


def _measure(stretch: Event, pairs: list[tuple[int, int]]) -> None:
    """The longest output gap and the longest ticket wait within `stretch`."""
    written = [w for w, _ in pairs if stretch.start_ms <= w < stretch.end_ms]
    stretch.outputs = len(written)
    edges = [stretch.start_ms, *written, stretch.end_ms]
    stretch.longest_gap_ms = max(b - a for a, b in itertools.pairwise(edges))
    waits = [w - p for w, p in pairs if stretch.start_ms <= p < stretch.end_ms]
    stretch.longest_wait_ms = max(waits, default=0)


def run_protocol(bootstrap: str, protocol: str, args: argparse.Namespace, logs: Path) -> ProtocolRun:
    outcome = ProtocolRun(protocol)
    tag = f"gp.{protocol}.{uuid.uuid4().hex[:6]}"
    topics = harness.Topics(f"{tag}.raw", f"{tag}.out", f"{tag}.dlq")
    specs = [TopicSpec(topics.input, PARTITIONS, 1), TopicSpec(topics.output, PARTITIONS, 1)]
    create_topics({"bootstrap.servers": bootstrap}, [*specs, TopicSpec(topics.dead_letter, 1, 1)])
    group = f"gp-{protocol}-{uuid.uuid4().hex[:6]}"
    settings = {"kafka.group.protocol": protocol, "inference.pool_size": "1", **MAX_POLL_DEFAULT}
    if protocol == "classic":
        settings.update(CLASSIC_DEFAULTS)

    def worker(name: str) -> harness.Worker:
        return harness.Worker(bootstrap, topics, group, logs, f"{protocol}-{name}", settings)

    workers = [worker("first"), worker("second")]
    joiner: harness.Worker | None = None
    publisher = harness.Publisher(bootstrap, topics, 0, args.rate, seed=args.seed)
    try:
        for member in workers:
            member.wait_for("partitions_assigned", timeout=120)
        publisher.start()
        time.sleep(args.dwell / 2)  # the stream settles before the baseline stretch
        outcome.baseline.start_ms = _now_ms()
        time.sleep(args.dwell)
        for index in range(args.events):
            if index % 2 == 0:
                event = Event("join", _now_ms())
                joiner = worker(f"joiner-{index // 2 + 1}")
                joiner.wait_for("partitions_assigned", timeout=120)
            else:
                assert joiner is not None
                event = Event("leave", _now_ms())
                if (code := joiner.stop(90)) != 0:
                    outcome.failures.append(f"{joiner.log_path.name} left with {code}:\n{joiner.tail(8)}")
                joiner = None
            outcome.events.append(event)
            progress(f"group-protocol: {protocol} event {index + 1}/{args.events} {event.action}")
            time.sleep(args.dwell)
        outcome.group_type = harness.group_protocol_type(bootstrap, group)
        publisher.end()
        publisher.finish(60)
        ends = _now_ms()
        stretches = [outcome.baseline, *outcome.events]
        for stretch, following in zip(stretches, [*stretches[1:], None], strict=True):
            stretch.end_ms = following.start_ms if following is not None else ends
        for member in workers:
            if member.process.poll() is not None:
                outcome.failures.append(f"{member.log_path.name} exited:\n{member.tail(8)}")
        harness.wait_until_committed(bootstrap, group, topics.input, timeout=180, worker=workers[0])
        for member in workers:
            if (code := member.stop(90)) != 0:
                outcome.failures.append(f"{member.log_path.name} stopped with {code}:\n{member.tail(8)}")
    finally:
        for member in [*workers, *([joiner] if joiner is not None else [])]:
            member.kill()
        publisher.end()
    report = harness.audit(bootstrap, topics)
    outcome.summary, outcome.lost = report.summary(), len(report.lost)
    _published, pairs = _timestamps(bootstrap, topics)
    for stretch in [outcome.baseline, *outcome.events]:
        _measure(stretch, pairs)
    progress(f"group-protocol: {protocol}: {outcome.summary}")
    return outcome


def _median(values: list[int]) -> int:
    return int(statistics.median(values)) if values else 0


def _write(out: Path, figures: dict[str, Any], runs: list[ProtocolRun]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    figures["runs"] = [
        {
            "protocol": run.protocol,
            "group_type": run.group_type,
            "baseline": vars(run.baseline),
            "events": [vars(event) for event in run.events],
            "audit": run.summary,
            "failures": run.failures,
        }
        for run in runs
    ]
    (out / "group-protocol.json").write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    by_protocol = {run.protocol: run for run in runs}
    names = [run.protocol for run in runs]
    header = " | ".join(f"{name}: longest gap / longest wait (ms)" for name in names)
    lines = [
        "# Group protocols: the group's pause while a worker joins and leaves",
        "",
        f"`{figures['command']}` at {figures['commit']}, {figures['when']}, on {figures['machine']} "
        f"(load average at start {figures['load_average_at_start']}); {figures['settings']}.",
        "",
        "*Longest gap*: between two consecutive output records of the group, from the event's start to the "
        "next event's. *Longest wait*: of a ticket published in that stretch, from its input record to its "
        "output record.",
        "",
        f"| # | event | {header} |",
        "|---|---|" + "---|" * len(names),
    ]
    rows: list[tuple[str, str, list[Event]]] = [("-", "steady (baseline)", [r.baseline for r in runs])]
    rows += [
        (str(index + 1), runs[0].events[index].action, [r.events[index] for r in runs])
        for index in range(min(len(r.events) for r in runs))
    ]
    for number, action, events in rows:
        cells = " | ".join(f"{e.longest_gap_ms} / {e.longest_wait_ms}" for e in events)
        lines.append(f"| {number} | {action} | {cells} |")
    lines += [
        "",
        "| protocol | group type (broker) | median gap, joins / leaves (ms) | worst gap (ms) | "
        "worst wait (ms) | audit |",
        "|---|---|---|---|---|---|",
    ]
    for name in names:
        run = by_protocol[name]
        joins = [e.longest_gap_ms for e in run.events if e.action == "join"]
        leaves = [e.longest_gap_ms for e in run.events if e.action == "leave"]
        lines.append(
            f"| {name} | {run.group_type} | {_median(joins)} / {_median(leaves)} | "
            f"{max(joins + leaves, default=0)} | {max((e.longest_wait_ms for e in run.events), default=0)} | "
            f"{run.summary} |"
        )
    lines.append("")
    (out / "group-protocol.md").write_text("\n".join(lines), encoding="utf-8")
    progress(f"group-protocol: {out / 'group-protocol.md'}")


def group_protocol(args: argparse.Namespace) -> bool:
    figures = promises.header("group_protocol", args)
    if args.quick:
        args.events, args.dwell = 2, 10.0
    figures["settings"] = (
        f"{PARTITIONS} partitions, {args.rate:g} tickets/s, 2 workers + 1 joining and leaving, "
        f"{args.events} events {args.dwell:g} s apart, tests/models/tiny, inference.pool_size 1; classic: "
        "cooperative-sticky, session.timeout.ms 45 s, heartbeat.interval.ms 3 s (librdkafka's defaults); "
        "consumer: the broker's defaults (heartbeat 5 s)"
    )
    runs: list[ProtocolRun] = []
    with contextlib.ExitStack() as cleanup:
        state = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="triage-group-protocol-")))
        broker = LocalBroker(state / "broker", port=free_port())
        broker.start(fresh=True, echo=progress)
        cleanup.callback(broker.stop)
        (state / "logs").mkdir()
        for protocol in PROTOCOLS:
            progress(f"group-protocol: {protocol}")
            runs.append(run_protocol(broker.bootstrap, protocol, args, state / "logs"))
    _write(args.out, figures, runs)
    for run in runs:
        for failure in run.failures:
            progress(f"group-protocol: {run.protocol}: {failure}")
    return all(run.lost == 0 and not run.failures for run in runs)


def main(argv: list[str] | None = None) -> int:
    parser = promises.arguments(__doc__)
    parser.add_argument("--events", type=int, default=6, help="joins and leaves, alternating (default 6)")
    parser.add_argument("--rate", type=float, default=40.0, help="tickets per second (default 40)")
    parser.add_argument("--dwell", type=float, default=15.0, help="seconds between events (default 15)")
    return promises.main("group-protocol", group_protocol, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
