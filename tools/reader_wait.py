"""How long a read_committed reader waits after an exactly-once worker is killed (`make reader-wait`); figures
in results/reader-wait.json and .md.

    .venv/bin/python -m tools.reader_wait [--quick] [--out results]

A killed worker's open transaction holds back the last stable offset of every output partition it wrote to,
so a read_committed reader sees nothing past it, the other workers' committed records included, until the
transaction ends. Who ends it depends on the transactional id of the replacement:

- a new id (a Deployment's replacement pod, `<group>-<new pod name>`): the broker, once the transaction is
  older than `transaction.timeout.ms` (the worker's 10 s) and its scan for such transactions comes by (every
  `transaction.abort.timed.out.transaction.cleanup.interval.ms`, 10 s by default);
- the same id (a StatefulSet's pod, or a container restarted inside its pod): the replacement's
  `init_transactions`, at once.

Two measurements per case, each repeated:

1. **bare**: a transactional producer writes into an open transaction and is killed; another producer then
   commits a record to the same partition; the time from the kill until a read_committed reader sees it;
2. **workers**: two exactly-once workers (the test model, default settings but fast group timeouts:
   `session.timeout.ms` 6 s) share a steady stream of 50 tickets/s, results on 4 partitions from tickets on 6;
   one is killed -9 and replaced. For the survivor's tickets (input partitions it owned from before the kill
   to the end), the worst wait from `classified_at` to visible for a read_committed reader, before and after
   the kill; for the killed worker's partitions, how long after the kill the last of them shows a new result.

The promise: in every run every input ends as exactly one result or dead letter for a read_committed reader.
The waits are figures, not promises: a kill that lands between two transactions leaves none open, and then
nothing waits for the broker (the new id's minimum shows it).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import confluent_kafka
import msgspec

from tools import harness, load, promises
from tools.promises import progress, promise
from worker.dev.local_broker import LocalBroker, free_port
from worker.kafka.admin import TopicSpec, create_topics
from worker.messages import TriageResult

# The worker's transaction.timeout.ms (worker/kafka/clients.py), so both halves measure the same broker wait.
TRANSACTION_TIMEOUT_MS = "10000"
OUTPUT_PARTITIONS = 4

_OPEN_TRANSACTION = """
import sys, time, confluent_kafka
producer = confluent_kafka.Producer({"bootstrap.servers": sys.argv[1], "transactional.id": sys.argv[2],
                                     "transaction.timeout.ms": sys.argv[4]})
producer.init_transactions(30)
producer.begin_transaction()
producer.produce(sys.argv[3], b"left open", partition=0)
producer.flush(30)
print("open", flush=True)
time.sleep(3600)
"""


def _new_topic(bootstrap: str, name: str, partitions: int) -> str:
    topic = f"reader-wait.{uuid.uuid4().hex[:8]}.{name}"
    create_topics({"bootstrap.servers": bootstrap}, [TopicSpec(topic, partitions, 1)])
    harness.wait_until_served(bootstrap, topic, partitions)
    return topic


def bare(bootstrap: str, same_id: bool) -> float:
    """Seconds from the kill of a producer inside an open transaction until a read_committed reader sees a
    record another producer committed to the same partition after it."""
    topic = _new_topic(bootstrap, "bare", 1)
    dead_id = f"reader-wait-{uuid.uuid4().hex[:8]}"
    child = subprocess.Popen(
        [sys.executable, "-c", _OPEN_TRANSACTION, bootstrap, dead_id, topic, TRANSACTION_TIMEOUT_MS],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "open"
    child.kill()
    child.wait()
    killed = time.monotonic()
    producer = confluent_kafka.Producer(
        {
            "bootstrap.servers": bootstrap,
            "transactional.id": dead_id if same_id else f"{dead_id}-replacement",
            "transaction.timeout.ms": TRANSACTION_TIMEOUT_MS,
        }
    )
    producer.init_transactions(60)
    producer.begin_transaction()
    producer.produce(topic, b"committed after the kill", partition=0)
    producer.commit_transaction(60)
    seen = harness.visibility(bootstrap, topic, within_s=120)
    assert not seen.hidden, seen.describe()
    return time.monotonic() - killed


def workers(bootstrap: str, logs: Path, same_id: bool, rate: float, after_kill_s: float) -> dict[str, Any]:
    """One of two workers killed -9 and replaced: the survivor's worst `classified_at` → visible wait before
    and after the kill, and how long after the kill each of the killed worker's partitions shows its first
    new result to a read_committed reader (the slowest one)."""
    # Outputs on 4 partitions, inputs on 6: a result lands on another partition than its ticket's, as it does
    # whenever the partition counts differ or the tickets' producer hashes keys otherwise than librdkafka
    # (the Java client's murmur2). So a transaction holds records of every output partition.
    topics = harness.Topics(
        _new_topic(bootstrap, "raw", 6),
        _new_topic(bootstrap, "out", OUTPUT_PARTITIONS),
        _new_topic(bootstrap, "dlq", 1),
    )
    group = f"reader-wait-{uuid.uuid4().hex[:8]}"

    def start(name: str, transactional_id: str) -> harness.Worker:
        settings = {"pipeline.guarantee": "exactly_once", "pipeline.transactional_id": transactional_id}
        return harness.Worker(bootstrap, topics, group, logs, name, settings)

    reader = load.Visible(bootstrap, {topics.output: dict.fromkeys(range(OUTPUT_PARTITIONS), 0)})
    publisher = harness.Publisher(bootstrap, topics, 0, rate, seed=7)
    started: list[harness.Worker] = []
    try:
        survivor, victim = start("survivor", f"{group}-a"), start("victim", f"{group}-b")
        started += [survivor, victim]
        for worker in started:
            worker.wait_for("pipeline_started", timeout=120)
        publisher.start()
        # Both own partitions, and the stream has flowed through a few commits.
        deadline = time.monotonic() + 90
        while not all(_owned(worker) for worker in started):
            assert time.monotonic() < deadline, "the two workers did not share the partitions in 90 s"
            time.sleep(0.5)
        time.sleep(5)
        kept, orphaned = _owned(survivor), _owned(victim)
        victim.kill()
        killed_at = time.time()
        replacement = start("replacement", f"{group}-b" if same_id else f"{group}-c")
        started.append(replacement)
        time.sleep(after_kill_s)
        kept &= _owned(survivor)  # the partitions it kept through every rebalance since the kill
        publisher.end()
        publisher.finish(60)
        for worker in (survivor, replacement):
            worker.run_to_completion(180)
        report = harness.audit(bootstrap, topics)
        time.sleep(1)  # the reader's last poll
    finally:
        reader.close()
        for worker in started:
            worker.kill()
    before: list[float] = []
    after: list[float] = []
    resumed: dict[int, float] = {}  # killed worker's partition → first visible new result, s after the kill
    decode = msgspec.json.Decoder(TriageResult).decode
    for _topic, visible_ms, value in reader.seen:
        result = decode(value)
        made, visible = _epoch(result.classified_at), visible_ms / 1000
        partition = result.source.partition
        if partition in kept:
            (after if made >= killed_at - 2.0 else before).append(visible - made)
        elif partition in orphaned and made > killed_at and partition not in resumed:
            resumed[partition] = visible - killed_at
    return {
        "same_id": same_id,
        "survivor_partitions": sorted(kept),
        "killed_workers_partitions": sorted(orphaned),
        "records_before": len(before),
        "records_after": len(after),
        "worst_wait_before_s": round(max(before, default=0.0), 2),
        "worst_wait_after_s": round(max(after, default=0.0), 2),
        "killed_partitions_resumed_after_s": round(max(resumed.values(), default=0.0), 2),
        "lost": len(report.lost),
        "duplicates": report.duplicates,
        "hidden": report.hidden,
    }


def _owned(worker: harness.Worker) -> set[int]:
    """Input partitions `worker` owns now, by its assignment events (cooperative: each adds or takes some)."""
    owned: set[int] = set()
    for event in worker.events():
        names = event.get("partitions") or []
        partitions = {int(name.rsplit("[", 1)[1].rstrip("]")) for name in names}
        if event.get("event") == "partitions_assigned":
            owned |= partitions
        elif event.get("event") in ("partitions_revoked", "partitions_lost"):
            owned -= partitions
    return owned


def _epoch(rfc3339: str) -> float:
    return datetime.datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def reader_wait(args: argparse.Namespace) -> bool:
    figures = promises.header("reader_wait", args)
    repeats, after_kill_s = (1, 25.0) if args.quick else (5, 40.0)
    runs: dict[str, list[Any]] = {"bare_new_id_s": [], "bare_same_id_s": [], "workers": []}
    with contextlib.ExitStack() as cleanup:
        state = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="triage-reader-wait-")))
        broker = LocalBroker(state / "broker", port=free_port())
        broker.start(fresh=True, echo=progress)
        cleanup.callback(broker.stop)
        (state / "logs").mkdir()
        for round_ in range(repeats):
            for same_id in (False, True):
                name = "same id" if same_id else "new id"
                seconds = bare(broker.bootstrap, same_id)
                runs["bare_same_id_s" if same_id else "bare_new_id_s"].append(round(seconds, 2))
                progress(f"reader-wait: round {round_ + 1}/{repeats} bare, {name}: {seconds:.1f} s")
                run = workers(broker.bootstrap, state / "logs", same_id, 50.0, after_kill_s)
                runs["workers"].append(run)
                progress(f"reader-wait: round {round_ + 1}/{repeats} workers, {name}: {run}")
    new = [r["worst_wait_after_s"] for r in runs["workers"] if not r["same_id"]]
    same = [r["worst_wait_after_s"] for r in runs["workers"] if r["same_id"]]
    before = [r["worst_wait_before_s"] for r in runs["workers"]]
    resumed_new = [r["killed_partitions_resumed_after_s"] for r in runs["workers"] if not r["same_id"]]
    resumed_same = [r["killed_partitions_resumed_after_s"] for r in runs["workers"] if r["same_id"]]
    figures.update(runs, transaction_timeout_ms=int(TRANSACTION_TIMEOUT_MS))
    accounted = all(not (r["lost"] or r["duplicates"] or r["hidden"]) for r in runs["workers"])
    figures["promises"] = {
        "every input one result or dead letter, read_committed (each run)": promise(
            sum(r["lost"] + r["duplicates"] + r["hidden"] for r in runs["workers"]),
            "0 lost, duplicated or hidden",
            accounted,
        ),
    }

    def spread(values: list[float]) -> str:
        return f"median {statistics.median(values):.1f} s (min {min(values):.1f}, max {max(values):.1f})"

    table = [
        ("bare, new transactional id: kill → visible", spread(runs["bare_new_id_s"])),
        ("bare, same transactional id: kill → visible", spread(runs["bare_same_id_s"])),
        ("workers, survivor's worst wait before the kill", spread(before)),
        ("workers, new id: survivor's worst wait after the kill", spread(new)),
        ("workers, same id: survivor's worst wait after the kill", spread(same)),
        ("workers, new id: the killed worker's partitions flow again after", spread(resumed_new)),
        ("workers, same id: the killed worker's partitions flow again after", spread(resumed_same)),
        (
            "runs",
            f"{repeats} of each; transaction.timeout.ms {TRANSACTION_TIMEOUT_MS}, session.timeout.ms 6000; "
            "broker defaults",
        ),
    ]
    return promises.write(args.out, "reader-wait", figures, table)


def main(argv: list[str] | None = None) -> int:
    return promises.main("reader_wait", reader_wait, promises.arguments(__doc__).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
