"""Queue-mode chaos against a real local broker (`make queue-chaos`); figures in results/queue-chaos.json and
queue-chaos.md.

    .venv/bin/python -m tools.queue_chaos [--quick] [--seed 5] [--out results]

Sample tickets (10 % malformed) paced in the background to a share group of three workers (`run --consume
queue`, the test model) whose records have a delivery limit of 2, the harshest a share group allows: every
record a killed worker held comes back on its last delivery. A seeded schedule of kill -9 (each replaced at
once), rolling restarts (SIGTERM, then a replacement: issue 55's loss was a SIGTERM on last deliveries) and
broker stop/starts on the same data; then the chaos workers get SIGTERM and a fresh worker answers what is
left. Promises: every input ends with a triage record or a dead letter — the worker's, or at the very least
a reference in the broker's own dead-letter topic (`dlq.<group>`, KIP-1191), which the audit counts apart —;
no misrouted record; duplicates only from crashes and broker restarts, at most `max_in_flight` per kill and
per worker a broker restart interrupted; no worker died unasked, graceful stops exit 0.

Prints a progress line to stderr and exits 1 when a promise is broken.
"""

from __future__ import annotations

import argparse
import contextlib
import random
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import confluent_kafka

from tools import harness, promises
from tools.promises import progress, promise
from worker.dev.local_broker import LocalBroker, free_port
from worker.kafka.admin import TopicSpec, create_topics
from worker.kafka.dead_letters import DELIVERY_COUNT_EXCEEDED
from worker.kafka.share_groups import DELIVERY_COUNT_LIMIT

MAX_IN_FLIGHT = 64  # the default, stated so that the bound does not depend on it silently
DELIVERY_LIMIT = 2
WORKERS = 3
# A share group's member gets records a few seconds after it subscribes (its heartbeat interval).
STARTED_S = 120.0
# KIP-1191's references to archived records carry where the record was.
BROKER_DLQ_PARTITION, BROKER_DLQ_OFFSET = "__dlq.errors.partition", "__dlq.errors.offset"


class Queue:
    """The share group under test: live workers, every worker ever started, and what happened to them."""

    def __init__(self, bootstrap: str, topics: harness.Topics, logs: Path, rng: random.Random) -> None:
        self.bootstrap, self.topics, self.logs, self.rng = bootstrap, topics, logs, rng
        self.group = f"queue-chaos-{uuid.uuid4().hex[:8]}"
        self.live: list[harness.Worker] = []
        self.all: list[harness.Worker] = []
        self.died: list[str] = []  # exited without being killed or stopped: a finding
        self.bad_exits: list[str] = []
        self.serial = 0

    def start(self, role: str) -> harness.Worker:
        self.serial += 1
        settings = {"pipeline.consume": "queue", "pipeline.max_in_flight": str(MAX_IN_FLIGHT)}
        worker = harness.Worker(
            self.bootstrap, self.topics, self.group, self.logs, f"{self.serial:03d}-{role}", settings
        )
        self.live.append(worker)
        self.all.append(worker)
        return worker

    def check(self) -> None:
        """A worker that ended by itself is a finding (the start-up check ends one started while the broker
        is away, by design: a supervisor starts it again, as here)."""
        for worker in list(self.live):
            if worker.process.poll() is None:
                continue
            self.live.remove(worker)
            if worker.events("pipeline_started") or "cannot reach Kafka" not in worker.tail(2):
                self.died.append(
                    f"{worker.log_path.name} exited {worker.process.returncode}:\n{worker.tail(8)}"
                )
            worker.kill()
            self.start("replaces-dead")

    def started(self, timeout: float = STARTED_S) -> list[harness.Worker]:
        """Live workers past their start (signal handlers installed, subscribed), waiting up to `timeout`
        for one: a SIGTERM before that ends a process by the signal's default, as for any program, with
        nothing taken yet (on a loaded machine a start takes tens of seconds)."""
        return harness.those_with(self.live, "pipeline_started", timeout)

    def kill(self) -> str:
        victim = self.rng.choice(self.started())
        self.live.remove(victim)
        victim.kill()
        self.start("restart")
        return f"kill -9 {victim.log_path.name}"

    def roll(self) -> str:
        """A rolling restart's step: one worker gets SIGTERM and must exit 0; its replacement starts."""
        leaver = self.rng.choice(self.started())
        self.live.remove(leaver)
        if (code := leaver.stop(90)) != 0:
            self.bad_exits.append(f"{leaver.log_path.name} stopped with {code}:\n{leaver.tail(8)}")
        self.start("rolled")
        return f"SIGTERM {leaver.log_path.name}"

    def stop_all(self) -> None:
        harness.wait_started(self.live, STARTED_S)
        for worker in self.live:
            if (code := worker.stop(90)) != 0:
                self.bad_exits.append(f"{worker.log_path.name} stopped with {code}:\n{worker.tail(8)}")
        self.live.clear()

    def kill_all(self) -> None:
        for worker in self.all:
            worker.kill()

    def count(self, event: str, field: str = "count") -> int:
        return sum(int(e.get(field) or 0) for w in self.all for e in w.events(event))


def archived_positions(bootstrap: str, group: str) -> dict[tuple[int, int], int]:
    """The broker's references (`dlq.<group>`) to records it archived: input position → how many."""
    found: dict[tuple[int, int], int] = {}
    topic = f"dlq.{group}"
    if not harness.end_offsets(bootstrap, topic):
        return found
    for message in harness.read_topic(bootstrap, topic):
        headers = harness.headers_of(message)
        position = (int(headers[BROKER_DLQ_PARTITION]), int(headers[BROKER_DLQ_OFFSET]))
        found[position] = found.get(position, 0) + 1
    return found


def outputs_written(bootstrap: str, topics: harness.Topics) -> str:
    """Records in the output and dead-letter topics (high watermarks: cheap, for progress lines)."""
    try:
        ends = [harness.end_offsets(bootstrap, topic) for topic in (topics.output, topics.dead_letter)]
    except confluent_kafka.KafkaException as error:  # a broker just back: leaders still moving
        return f"not readable yet ({error.args[0].name() if error.args else error})"
    return str(sum(sum(each.values()) for each in ends))


def queue_chaos(args: argparse.Namespace) -> bool:
    figures = promises.header("queue_chaos", args)
    if args.quick:
        count, kills, rolls, brokers, rate = 3000, 5, 3, 1, 30.0
    else:
        count, kills, rolls, brokers, rate = 30_000, 30, 15, 2, 75.0
    rng = random.Random(args.seed)
    plan = ["kill"] * kills + ["roll"] * rolls + ["broker"] * brokers
    rng.shuffle(plan)
    produce_s = count / rate
    tag = f"queue-chaos.{uuid.uuid4().hex[:8]}"
    topics = harness.Topics(f"{tag}.raw", f"{tag}.out", f"{tag}.dlq")
    done = {"kill": 0, "roll": 0, "broker": 0}
    outages: list[float] = []
    interrupted = 0  # workers live at each broker restart: each may see its acknowledgements lost
    with contextlib.ExitStack() as cleanup:
        state = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="triage-queue-chaos-")))
        broker = LocalBroker(state / "broker", port=free_port())
        broker.start(fresh=True, echo=progress)
        cleanup.callback(broker.stop)
        bootstrap = broker.bootstrap
        create_topics(
            {"bootstrap.servers": bootstrap},
            [
                TopicSpec(topics.input, 3, 1),
                TopicSpec(topics.output, 3, 1),
                TopicSpec(topics.dead_letter, 1, 1),
            ],
        )
        (state / "logs").mkdir()
        queue = Queue(bootstrap, topics, state / "logs", rng)
        cleanup.callback(queue.kill_all)
        harness.set_share_group_configs(bootstrap, queue.group, {DELIVERY_COUNT_LIMIT: DELIVERY_LIMIT})
        for _ in range(WORKERS):
            queue.start("first")
        for worker in queue.live:
            worker.wait_for("pipeline_started", timeout=STARTED_S)
        progress(
            f"queue chaos: {count} tickets at {rate:.0f}/s; plan {len(plan)} events over ~{produce_s:.0f}s"
        )
        publisher = harness.Publisher(bootstrap, topics, count, rate, seed=args.seed)
        started = time.monotonic()
        publisher.start()
        for index, action in harness.paced(plan, produce_s, rng, queue.check):
            if action == "kill":
                what = queue.kill()
            elif action == "roll":
                what = queue.roll()
            else:
                outage = rng.choice([3.0, 12.0])
                interrupted += len(queue.live)
                broker.stop()
                time.sleep(outage)
                broker.start(fresh=False, echo=lambda _line: None)
                outages.append(outage)
                what = f"broker down {outage:.0f}s"
            done[action] += 1
            progress(
                f"queue chaos: t={time.monotonic() - started:.0f}s event {index + 1}/{len(plan)} {what}; "
                f"live={len(queue.live)} outputs={outputs_written(bootstrap, topics)}"
            )
        publisher.finish(produce_s + 300)
        produced_s = time.monotonic() - started
        queue.check()
        queue.stop_all()
        progress("queue chaos: schedule done, chaos workers stopped; a fresh worker answers the rest")
        final = queue.start("final")
        drain_started = time.monotonic()
        final.wait_for("pipeline_started", timeout=STARTED_S)
        while time.monotonic() - drain_started < args.drain_timeout and final.process.poll() is None:
            # A record the broker archived (its delivery limit spent under workers that died) has its
            # reference as its only outcome: nothing more will come of it.
            archived = archived_positions(bootstrap, queue.group)
            waiting = [
                p for p in harness.audit(bootstrap, topics, visible_within_s=5).lost if p not in archived
            ]
            if not waiting:
                break
            progress(f"queue chaos: draining, {len(waiting)} inputs without an outcome yet")
            time.sleep(10)
        drain_s = time.monotonic() - drain_started
        queue.stop_all()
        report = harness.audit(bootstrap, topics)
        archived = archived_positions(bootstrap, queue.group)
        answered_last = queue.count("last_deliveries_answered")
        if any(position not in archived for position in report.lost):
            kept = args.out / "queue-chaos-logs"
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(state / "logs", kept)
            progress(f"queue chaos: tickets lost; the workers' logs are kept in {kept}")

    lost = [position for position in report.lost if position not in archived]
    # A ticket dead-lettered over its delivery limit is where it belongs (its model process died under it
    # on its last delivery: here, a kill -9 of a worker that held it).
    misrouted = [
        position
        for position in report.misrouted
        if report.inputs[position] != "ticket"
        or set(report.dead.get(position, [])) - {DELIVERY_COUNT_EXCEEDED}
    ]
    bound = MAX_IN_FLIGHT * (done["kill"] + interrupted)
    over_limit = sum(dead.count(DELIVERY_COUNT_EXCEEDED) for dead in report.dead.values())
    figures.update(
        seed=args.seed,
        model="tests/models/tiny (the test model; chaos checks accounting, not answers)",
        settings={
            "pipeline.consume": "queue",
            "pipeline.max_in_flight": MAX_IN_FLIGHT,
            DELIVERY_COUNT_LIMIT: DELIVERY_LIMIT,
            "kafka": broker.kafka_version,
        },
        tickets=count,
        inputs=len(report.inputs),
        results=sum(map(len, report.results.values())),
        dead_letters=sum(map(len, report.dead.values())),
        dead_letters_over_delivery_limit=over_limit,
        archived_by_broker=sum(archived.values()),
        archived_without_an_outcome=sum(1 for p in report.lost if p in archived),
        last_deliveries_answered=answered_last,
        kills=done["kill"],
        rolling_restarts=done["roll"],
        broker_restarts=done["broker"],
        broker_outages_s=outages,
        workers_started=len(queue.all),
        produce_s=round(produced_s, 1),
        final_drain_s=round(drain_s, 1),
        lost=len(lost),
        lost_positions=lost[:50],
        duplicates=report.duplicates,
        duplicate_bound=bound,
        misrouted=len(misrouted),
        workers_died_unasked=queue.died,
        bad_exits=queue.bad_exits,
    )
    figures["promises"] = {
        "inputs accounted": promise(len(report.inputs), f"== {count}", len(report.inputs) == count),
        "lost (no triage record, no dead letter, no broker reference)": promise(len(lost), "0", not lost),
        "duplicates": promise(
            report.duplicates,
            f"<= {bound} = {MAX_IN_FLIGHT} x ({done['kill']} kills + {interrupted} workers a broker restart"
            " interrupted)",
            report.duplicates <= bound,
        ),
        "misrouted (ticket dead-lettered but over its delivery limit, or malformed classified)": promise(
            len(misrouted), "0", not misrouted
        ),
        "no worker died unasked, graceful stops exit 0": promise(
            len(queue.died) + len(queue.bad_exits), "0", not queue.died and not queue.bad_exits
        ),
    }
    table = [
        ("tickets (10 % malformed, seeded)", f"{count} at {rate:.0f}/s, produced in {produced_s:.0f} s"),
        (
            "results / dead letters (over the delivery limit) / broker references (rejected or archived)",
            f"{figures['results']} / {figures['dead_letters']} ({over_limit})"
            f" / {figures['archived_by_broker']}",
        ),
        (
            "of which archived by the broker with no other outcome (its reference their only trace)",
            str(figures["archived_without_an_outcome"]),
        ),
        ("last deliveries answered at a stop or a lock's end", str(figures["last_deliveries_answered"])),
        (
            "kill -9 / rolling restarts / broker restarts (outage s)",
            f"{done['kill']} / {done['roll']} / {done['broker']} {outages}",
        ),
        ("workers started", str(len(queue.all))),
        ("final drain", f"{drain_s:.0f} s"),
        ("model, settings", f"{figures['model']}; {figures['settings']}"),
    ]
    return promises.write(args.out, "queue-chaos", figures, table)


def main(argv: list[str] | None = None) -> int:
    parser = promises.arguments(__doc__)
    parser.add_argument("--drain-timeout", type=float, default=900.0, help="final drain limit, s")
    return promises.main("queue-chaos", queue_chaos, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
