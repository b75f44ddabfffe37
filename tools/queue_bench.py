"""Queue mode against group mode on one partition, in one run: tickets/s with 1 and with 3 workers.

    .venv/bin/python -m tools.queue_bench [--count 1200] [--rounds 2] [--bootstrap HOST:PORT] [--out results]

Needs a broker with share groups (Kafka >= 4.2): by default a local Kafka 4.4.0 broker on a free port, stopped
at the end. For each row a fresh 1-partition topic gets `count` tickets, each its own producer batch
(`linger.ms=0`, `batch.num.messages=1`: tickets arrive one by one; a backlog produced in one burst is handed
to a share group in whole batches, see docs/operations.md#queue-mode), then the workers (the test model,
tests/models/tiny, one model process each) start in a fresh group and run until every ticket has a record.
Throughput counts from the first record to the last (`classified_at`), so the workers' start-up is left out.
The four rows run `rounds` times, interleaved, so that the noise of a shared machine shows. Writes
results/queue-mode.md and queue-mode.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from tools import REPO
from tools.harness import Topics, Worker, audit, settings_for
from worker.dev.local_broker import LocalBroker, free_port
from worker.dev.samples import SampleFactory, produce_samples
from worker.kafka.admin import TopicSpec, create_topics

SHARE_GROUP_KAFKA_VERSION = "4.4.0"
# One record per producer batch: tickets that arrive one by one.
_ONE_BY_ONE = {"kafka.linger.ms": "0", "kafka.batch.num.messages": "1"}
# One model process per worker: 3 workers are 3 processes, 1 worker is 1, on the same cores.
_WORKER = {"inference.pool_size": "1"}


@dataclass
class Row:
    round: int
    mode: str
    workers: int
    tickets: int
    seconds: float
    per_s: float
    # Records written by each worker (its final metrics: produced).
    per_worker: list[int]
    lost: int
    duplicates: int


def _parse_time(stamp: str) -> float:
    return datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def run_row(bootstrap: str, round_: int, mode: str, workers: int, count: int, logs: Path) -> Row:
    tag = uuid.uuid4().hex[:8]
    topics = Topics(f"bench.q.raw.{tag}", f"bench.q.out.{tag}", f"bench.q.dlq.{tag}")
    create_topics({"bootstrap.servers": bootstrap}, [TopicSpec(t, 1, 1) for t in vars(topics).values()])
    factory = SampleFactory(seed=36, malformed_ratio=0.0, prefix=f"Q{tag}")
    stats = produce_samples(settings_for(bootstrap, topics, **_ONE_BY_ONE), topics.input, count, 0.0, factory)
    assert stats.sent == count and stats.failed == 0, stats
    settings = {**_WORKER, "pipeline.consume": mode}
    running = [
        Worker(bootstrap, topics, f"bench-{mode}-{tag}", logs, f"{mode}-{n}", settings)
        for n in range(workers)
    ]
    try:
        deadline = time.monotonic() + 600
        while True:
            report = audit(bootstrap, topics, visible_within_s=5)
            if not report.lost or time.monotonic() > deadline:
                break
            time.sleep(3)
        for worker in running:
            worker.stop()
    finally:
        for worker in running:
            worker.kill()
    stamps = sorted(_parse_time(r.classified_at) for records in report.results.values() for r in records)
    seconds = stamps[-1] - stamps[0] if len(stamps) > 1 else 0.0
    per_worker = [worker.metrics()[-1]["produced"] if worker.metrics() else 0 for worker in running]
    per_s = round(count / seconds, 1) if seconds else 0.0
    return Row(
        round_,
        mode,
        workers,
        count,
        round(seconds, 1),
        per_s,
        per_worker,
        len(report.lost),
        report.duplicates,
    )


def write(rows: list[Row], out: Path, command: str, broker: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "queue-mode.json").write_text(json.dumps([asdict(row) for row in rows], indent=2) + "\n")
    lines = [
        "# Queue mode against group mode: one partition, 1 and 3 workers",
        "",
        f"`{command}`, {datetime.date.today().isoformat()}, {broker}, {os.cpu_count()} cores (shared with "
        f"other jobs; load average {os.getloadavg()[0]:.1f} at the end). The test model (tests/models/tiny), "
        "one model process per worker; each ticket its own producer batch; throughput from the first record "
        "to the last.",
        "",
        "| round | mode | workers | tickets | seconds | tickets/s | records per worker | lost | duplicates |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.round} | {row.mode} | {row.workers} | {row.tickets} | {row.seconds} | {row.per_s} | "
            f"{', '.join(map(str, row.per_worker))} | {row.lost} | {row.duplicates} |"
        )
    (out / "queue-mode.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bootstrap", help="a broker with share groups (default: start a local 4.4.0)")
    parser.add_argument("--out", type=Path, default=REPO / "results")
    args = parser.parse_args()
    command = f"python -m tools.queue_bench --count {args.count} --rounds {args.rounds}"
    command += f" --bootstrap {args.bootstrap}" if args.bootstrap else ""
    broker = None
    bootstrap = args.bootstrap
    if bootstrap is None:
        state = Path(tempfile.mkdtemp(prefix="queue-bench-"))
        broker = LocalBroker(state, free_port(), kafka_version=SHARE_GROUP_KAFKA_VERSION)
        broker.start(fresh=True)
        bootstrap = broker.bootstrap
    logs = Path(tempfile.mkdtemp(prefix="queue-bench-logs-"))
    rows = []
    try:
        for round_ in range(1, args.rounds + 1):
            for mode, workers in (("group", 1), ("queue", 1), ("group", 3), ("queue", 3)):
                rows.append(run_row(bootstrap, round_, mode, workers, args.count, logs))
                print(asdict(rows[-1]), flush=True)
    finally:
        if broker is not None:
            broker.stop()
    write(rows, args.out, command, f"Kafka {SHARE_GROUP_KAFKA_VERSION} (local broker)")
    print(f"wrote {args.out / 'queue-mode.md'} (worker logs in {logs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
