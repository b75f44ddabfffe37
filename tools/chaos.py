"""Chaos against a real local broker (`make chaos`); figures in results/chaos.json and chaos.md (or
chaos-exactly-once.* with `--guarantee exactly_once`).

    .venv/bin/python -m tools.chaos [--quick] [--guarantee exactly_once] [--out results]

100,000 sample tickets (10 % malformed) paced in the background while 2-3 workers of one group (the tiny test
model, fast group timeouts) go through a seeded schedule of 50 kill -9 (each replaced at once), 3 broker
stop/starts on the same data and 10 graceful joins/leaves; then a fresh worker drains the rest. Promises:
0 lost, committed == end offsets, no misrouted record, duplicates <= the bound computed from what happened
(docs/guarantees.md): max_in_flight per kill and per lost partition set, plus every ticket a revoke left
unfinished.

In exactly-once mode the broker runs Kafka 4.1.1, the release docs/deployment.md recommends for it
(`$TRIAGE_KAFKA_VERSION` chooses another, `$TRIAGE_KAFKA_TRANSACTION_VERSION` its transaction.version); the
report's settings name the release and the level.

With `--brokers 3` the broker is a local three-node cluster (replication factor 3, min.insync.replicas 2)
and its faults are a cluster's: a rolling restart, a node's kill -9, the transaction coordinator's node
killed -9 and a whole-cluster restart, once each (`CLUSTER_FAULTS`). `--keep-logs` keeps the workers' and
brokers' logs; `TRIAGE_KAFKA_DEBUG_TRANSACTIONS=1` has the brokers log their transactions at DEBUG.

Prints a progress line to stderr and exits 1 when a promise is broken.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import confluent_kafka

from tools import harness, load, promises
from tools.promises import progress, promise
from worker.dev.local_broker import (
    CLUSTER_SIZE,
    DEBUG_TRANSACTIONS_ENV,
    KAFKA_VERSION_ENV,
    LocalBroker,
    LocalCluster,
    configured_kafka_version,
    free_port,
    free_port_block,
)
from worker.kafka.admin import TopicSpec, create_topics

MAX_IN_FLIGHT = 64  # the default, stated so that the bound does not depend on it silently


class Chaos:
    """The group under test: live workers, every worker ever started, and what was done to them."""

    def __init__(
        self, bootstrap: str, topics: harness.Topics, logs: Path, rng: random.Random, guarantee: str
    ) -> None:
        self.bootstrap, self.topics, self.logs, self.rng = bootstrap, topics, logs, rng
        self.guarantee = guarantee
        self.group = f"chaos-{uuid.uuid4().hex[:8]}"
        self.live: list[harness.Worker] = []
        self.all: list[harness.Worker] = []
        self.died: list[str] = []  # workers that exited without being killed or stopped: a finding
        self.refused_at_start: list[str] = []
        self.bad_exits: list[str] = []
        self.serial = 0
        self.killed: list[tuple[str, str]] = []  # (UTC timestamp, worker log name) of each kill -9
        self.transactional_ids: dict[str, str] = {}  # worker log name → its transactional id

    def start(self, role: str) -> harness.Worker:
        self.serial += 1
        settings = {
            "pipeline.max_in_flight": str(MAX_IN_FLIGHT),
            "pipeline.guarantee": self.guarantee,
            # Every commit's positions (debug), so that a lost ticket names the commit that passed it.
            "log.level": "debug",
        }
        if self.guarantee == "exactly_once":
            # A new id per worker, as pods of a Deployment get: a killed worker's open transaction then
            # holds its partitions back until the broker aborts it (transaction.timeout.ms).
            settings["pipeline.transactional_id"] = f"{self.group}-{self.serial:03d}"
        worker = harness.Worker(
            self.bootstrap, self.topics, self.group, self.logs, f"{self.serial:03d}-{role}", settings
        )
        if "pipeline.transactional_id" in settings:
            self.transactional_ids[worker.log_path.name] = settings["pipeline.transactional_id"]
        self.live.append(worker)
        self.all.append(worker)
        return worker

    def check(self) -> None:
        for worker in list(self.live):
            if worker.process.poll() is not None:
                what = f"{worker.log_path.name} exited {worker.process.returncode}:\n{worker.tail(8)}"
                # The start-up checks end a worker started while the broker (or its transaction coordinator)
                # is away, by design (a supervisor restarts it, as here); any other exit is a finding.
                tail = worker.tail(2)
                refused = not worker.events("pipeline_started") and (
                    "cannot reach Kafka" in tail or "cannot start transactions" in tail
                )
                (self.refused_at_start if refused else self.died).append(what)
                self.live.remove(worker)
                worker.kill()
                self.start("replaces-dead")

    def working(self, timeout: float = 30.0) -> list[harness.Worker]:
        """Live workers that own partitions (have been assigned some), waiting up to `timeout` for one."""
        return harness.those_with(self.live, "partitions_assigned", timeout)

    def kill(self) -> str:
        victim = self.rng.choice(self.working())
        self.live.remove(victim)
        victim.kill()
        self.killed.append(
            (datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"), victim.log_path.name)
        )
        self.start("restart")
        return victim.log_path.name

    def rebalance(self) -> str:
        if len(self.live) >= 3:
            harness.wait_started(self.live)
            leaver = self.rng.choice(self.working())
            self.live.remove(leaver)
            if (code := leaver.stop(90)) != 0:
                self.bad_exits.append(f"{leaver.log_path.name} left with {code}:\n{leaver.tail(8)}")
            return f"leave {leaver.log_path.name}"
        joiner = self.start("join")
        return f"join {joiner.log_path.name}"

    def kill_all(self) -> None:
        """SIGKILL every worker ever started: the cleanup, whatever happened."""
        for worker in self.all:
            worker.kill()

    def stop_all(self) -> None:
        harness.wait_started(self.live)
        for worker in self.live:
            if (code := worker.stop(90)) != 0:
                self.bad_exits.append(f"{worker.log_path.name} stopped with {code}:\n{worker.tail(8)}")
        self.live.clear()

    def events(self, name: str) -> list[dict[str, Any]]:
        return [{**event, "worker": w.log_path.name} for w in self.all for event in w.events(name)]

    def explainer(self, topic: str) -> Callable[[tuple[int, int], str], dict[str, Any]]:
        """Explains a lost input position with the evidence the logs hold (the workers log at debug level):
        which worker's commit first passed it and when, which workers skipped its record (had taken a later
        offset of the partition first), and the last worker started that owned its partition."""
        skipped_by: dict[tuple[int, int], list[str]] = {}
        owners: dict[int, list[str]] = {}
        commits: dict[int, list[tuple[str, int, str]]] = {}  # partition → (timestamp, position, worker)
        for w in self.all:
            for e in w.events("commit_confirmed") + w.events("committed"):
                for name, position in (e.get("positions") or {}).items():
                    if name.startswith(f"{topic}["):
                        entry = (e["timestamp"], position, w.log_path.name)
                        commits.setdefault(int(name[len(topic) + 1 : -1]), []).append(entry)
            for e in w.events("record_skipped"):
                skipped_by.setdefault((e["partition"], e["offset"]), []).append(w.log_path.name)
            owned = {name for e in w.events("partitions_assigned") for name in e.get("partitions") or []}
            for name in owned:
                if name.startswith(f"{topic}["):
                    owners.setdefault(int(name[len(topic) + 1 : -1]), []).append(w.log_path.name)

        for entries in commits.values():
            entries.sort()

        def explain(position: tuple[int, int], kind: str) -> dict[str, Any]:
            partition, offset = position
            passed = [(at, worker) for at, end, worker in commits.get(partition, []) if end > offset]
            owned_by = owners.get(partition)
            return {
                "partition": partition,
                "offset": offset,
                "kind": kind,
                "first_committed_past_by": passed[0] if passed else None,
                "skipped_by": skipped_by.get(position, []),
                "last_owner": owned_by[-1] if owned_by else None,
            }

        return explain

    def ownership(self, topic: str, partition: int) -> list[tuple[str, str, str]]:
        """Who took and gave up `partition` when: (timestamp, worker, event), in time order; with the copies'
        `classified_at`, it names the workers that wrote a duplicate."""
        name = f"{topic}[{partition}]"
        found = [
            (e["timestamp"], w.log_path.name, str(e["event"]))
            for w in self.all
            for kind in ("partitions_assigned", "partitions_revoked", "partitions_lost")
            for e in w.events(kind)
            if name in (e.get("partitions") or [])
        ]
        kills = [(at, victim, "killed") for at, victim in self.killed if victim in {w for _, w, _ in found}]
        return sorted(found + kills)

    def lead_up(self, name: str, lines: int = 6) -> list[list[str]]:
        """For each `name` event, the worker's log lines up to it (metrics left out): the evidence."""
        found = []
        for worker in self.all:
            log = [
                line[:300]
                for line in worker.log_path.read_text(errors="replace").splitlines()
                if '"event": "metrics"' not in line and '"event": "committed"' not in line
            ]
            found += [
                log[max(0, i - lines) : i + 1] for i, line in enumerate(log) if f'"event": "{name}"' in line
            ]
        return found


# The cluster faults of `--brokers 3`, each once per run in a seeded order: one node at a time cleanly
# stopped and started again (each waits until every partition is fully replicated, as an operator's rolling
# restart does), one node killed -9 (back after an outage), the node that is transaction coordinator for a
# working worker's transactional id killed -9 (in at-least-once mode the leader of the input's partition 0),
# and the whole cluster stopped and started again (the single broker's only fault).
CLUSTER_FAULTS = ("rolling", "kill-node", "kill-coordinator", "restart-all")
OUTAGES_S = (3.0, 12.0, 20.0)  # below and above session.timeout.ms (6 s)


def settled_ends(offsets: load.Offsets, within_s: float = 60.0) -> dict[int, int]:
    """The input's end offsets, asked again while leaders still move after a node fault (the client's
    metadata names a node that led a partition before: NOT_LEADER_FOR_PARTITION until it refreshes)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return offsets.ends()
        except confluent_kafka.KafkaException:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)


def _quiet(_line: str) -> None:
    """Drops a node's ready line: three per fault would drown the progress lines."""


def single_broker_fault(broker: LocalBroker, rng: random.Random) -> tuple[str, float]:
    """The single broker stopped for a seeded outage and started on its data: a whole-cluster outage."""
    outage = rng.choice(OUTAGES_S)
    broker.stop()
    time.sleep(outage)
    broker.start(fresh=False, echo=lambda _line: None)
    return f"broker down {outage:.0f}s", outage


def cluster_fault(cluster: LocalCluster, kind: str, rng: random.Random, group: Chaos) -> tuple[str, float]:
    """One of `CLUSTER_FAULTS` on the cluster; what was done (naming the node) and the outage it caused
    (the longest time a node was away; 0 for a rolling restart's clean steps)."""
    if kind == "rolling":
        for node in cluster.nodes:
            cluster.stop_node(node.node_id)
            cluster.start_node(node.node_id, echo=_quiet)
            cluster.wait_fully_replicated()
        return f"rolling restart of nodes 1-{CLUSTER_SIZE}", 0.0
    outage = rng.choice(OUTAGES_S)
    if kind == "restart-all":
        cluster.restart_all(outage, echo=_quiet)
        return f"whole cluster down {outage:.0f}s", outage
    if kind == "kill-coordinator":
        target, whom = _coordinator_target(cluster, group)
    else:
        target, whom = rng.choice(cluster.running()), "a node"
    cluster.kill_node(target)
    time.sleep(outage)
    cluster.start_node(target, echo=_quiet)
    return f"kill -9 node {target} ({whom}), back after {outage:.0f}s", outage


def _coordinator_target(cluster: LocalCluster, group: Chaos) -> tuple[int, str]:
    """The node to hit for "kill-coordinator": the transaction coordinator of a working worker's
    transactional id (exactly-once), else the leader of the input's partition 0."""
    working = [w for w in group.working() if w.log_path.name in group.transactional_ids]
    if working:
        transactional_id = group.transactional_ids[working[0].log_path.name]
        return cluster.coordinator_of(transactional_id), f"coordinator of {transactional_id}"
    return cluster.leader_of(group.topics.input, 0), "leader of the input's partition 0"


def chaos(args: argparse.Namespace) -> bool:
    figures = promises.header("chaos", args)
    if args.quick:
        count, kills, brokers, rebalances, rate = 6000, 8, 1, 2, 50.0
    else:
        count, kills, brokers, rebalances, rate = 100_000, 50, 3, 10, 150.0
    rng = random.Random(args.seed)
    clustered = args.brokers > 1
    faults = [f"broker:{kind}" for kind in CLUSTER_FAULTS] if clustered else ["broker"] * brokers
    plan = ["kill"] * kills + faults + ["rebalance"] * rebalances
    rng.shuffle(plan)
    replicas = CLUSTER_SIZE if clustered else 1
    produce_s = count / rate
    tag = f"chaos.{uuid.uuid4().hex[:8]}"
    topics = harness.Topics(f"{tag}.raw", f"{tag}.out", f"{tag}.dlq")
    done: dict[str, int] = {"kill": 0, "broker": 0, "rebalance": 0}
    faults_done: list[str] = []  # what each broker fault did, in order
    outages: list[tuple[str, float]] = []  # (UTC time the broker came back, seconds down)
    with contextlib.ExitStack() as cleanup:
        state = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="triage-chaos-")))
        release = broker_release(args.guarantee)
        broker: LocalBroker | LocalCluster = (
            LocalCluster(state / "cluster", port=free_port_block(CLUSTER_SIZE), kafka_version=release)
            if clustered
            else LocalBroker(state / "broker", port=free_port(), kafka_version=release)
        )
        broker.start(fresh=True, echo=progress)
        cleanup.callback(broker.stop)
        if args.keep_logs:
            cleanup.callback(keep_logs, state, args.out)
        bootstrap = broker.bootstrap
        create_topics(
            {"bootstrap.servers": bootstrap},
            [
                TopicSpec(topics.input, 6, replicas),
                TopicSpec(topics.output, 6, replicas),
                TopicSpec(topics.dead_letter, 1, replicas),
            ],
        )
        (state / "logs").mkdir()
        group = Chaos(bootstrap, topics, state / "logs", rng, args.guarantee)
        cleanup.callback(group.kill_all)
        for _ in range(2):
            group.start("first")
        group.working(90)
        offsets = load.Offsets(bootstrap, group.group, topics.input)
        cleanup.callback(offsets.close)
        progress(f"chaos: {count} tickets at {rate:.0f}/s; plan {len(plan)} events over ~{produce_s:.0f}s")
        publisher = harness.Publisher(bootstrap, topics, count, rate, seed=args.seed)
        started = time.monotonic()
        publisher.start()
        for index, action in harness.paced(plan, produce_s, rng, group.check):
            if action == "kill":
                what = f"kill -9 {group.kill()}"
            elif action == "rebalance":
                what = group.rebalance()
            else:
                if isinstance(broker, LocalCluster):
                    what, outage = cluster_fault(broker, action.partition(":")[2], rng, group)
                else:
                    what, outage = single_broker_fault(broker, rng)
                outages.append((datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), outage))
                faults_done.append(what)
                action = "broker"
            done[action] += 1
            try:
                committed = offsets.committed()
                position = (
                    f"committed={sum(max(0, o) for o in committed.values())} "
                    f"end={sum(offsets.ends().values())}/{count}"
                )
            except confluent_kafka.KafkaException as error:  # a broker just back: leaders still moving
                position = f"offsets not readable yet ({error.args[0].name() if error.args else error})"
            progress(
                f"chaos: t={time.monotonic() - started:.0f}s event {index + 1}/{len(plan)} {what}; "
                f"live={len(group.live)} {position}"
            )
        still_producing = publisher.is_alive()
        publisher.finish(produce_s + 300)
        produced_s = time.monotonic() - started
        group.check()
        group.stop_all()
        progress("chaos: schedule done, chaos workers stopped; a fresh worker drains the rest")
        final = group.start("final")
        drain_started = time.monotonic()
        final.wait_for("pipeline_started", timeout=90)
        ends = settled_ends(offsets)
        while not (now := offsets.follow(ends, 10, lambda: None)).complete:
            if final.process.poll() is not None or now.at - drain_started > args.drain_timeout:
                break
            progress(f"chaos: draining, committed {now.records}/{count}")
        drain_s = time.monotonic() - drain_started
        group.stop_all()
        progress("chaos: auditing (read_committed, once every open transaction has ended)")
        report = harness.audit(bootstrap, topics)
        for seen in report.visibility:
            progress(f"chaos: {seen.describe()}")
        ends = harness.end_offsets(bootstrap, topics.input)
        committed = harness.committed_offsets(bootstrap, group.group, topics.input)
        lost_events = group.events("partitions_lost")
        unfinished = sum(int(e.get("unfinished") or 0) for e in group.events("partitions_revoked"))
        revoked = len(group.events("partitions_revoked"))
        overruns = group.events("max_poll_interval_exceeded")
        evictions = len(overruns)
        workers_started = len(group.all)
        overrun_lead_up = group.lead_up("max_poll_interval_exceeded")
        explain = group.explainer(topics.input)
        lost_positions = [explain(position, report.inputs[position]) for position in report.lost]
        # Exactly-once promises no duplicate: each one with where its copies are and which commits passed it.
        duplicated = report.duplicated if args.guarantee == "exactly_once" else []
        duplicate_positions = [
            {
                **explain(position, report.inputs[position]),
                "copies": report.copies[position],
                "ownership": group.ownership(topics.input, position[0]),
            }
            for position in duplicated[:20]
        ]
        if report.lost or duplicated:
            kept = args.out / f"{'chaos-exactly-once' if args.guarantee == 'exactly_once' else 'chaos'}-logs"
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(state / "logs", kept)
            progress(f"chaos: tickets lost or duplicated; the workers' logs are kept in {kept}")

    bound = MAX_IN_FLIGHT * (done["kill"] + len(lost_events)) + unfinished
    exactly_once = args.guarantee == "exactly_once"
    lost = len(report.lost)
    figures.update(
        seed=args.seed,
        model="tests/models/tiny (the test model; chaos checks accounting, not answers)",
        settings={
            "pipeline.max_in_flight": MAX_IN_FLIGHT,
            "pipeline.guarantee": args.guarantee,
            **harness.FAST_GROUP_OPTIONS,
            "kafka": f"{broker.kafka_version}, transaction.version "
            f"{broker.transaction_version or 'the release default'}",
            "brokers": args.brokers,
            "replication_factor": replicas,
        },
        tickets=count,
        rate_tickets_per_s=rate,
        inputs=len(report.inputs),
        malformed=sum(1 for kind in report.inputs.values() if kind != "ticket"),
        results=sum(map(len, report.results.values())),
        dead_letters=sum(map(len, report.dead.values())),
        kills=done["kill"],
        broker_restarts=done["broker"],
        broker_outages_s=outages,
        broker_faults=faults_done,
        rebalances=done["rebalance"],
        workers_started=workers_started,
        producer_still_running_at_last_event=still_producing,
        produce_s=round(produced_s, 1),
        final_drain_s=round(drain_s, 1),
        partitions_lost_events=len(lost_events),
        partitions_revoked_events=revoked,
        revoke_unfinished=unfinished,
        max_poll_exceeded_events=evictions,
        # Evidence for docs/guarantees.md and for findings: which worker, when, and what librdkafka said.
        lost_and_overrun_events=[
            {k: e.get(k) for k in ("timestamp", "worker", "event", "partitions", "reason")}
            for e in lost_events + overruns
        ],
        max_poll_overrun_lead_up=overrun_lead_up,
        visibility=[
            {"topic": seen.topic, "waited_s": round(seen.waited_s, 1), "hidden": seen.hidden}
            for seen in report.visibility
        ],
        lost=lost,
        lost_positions=lost_positions,
        duplicates=report.duplicates,
        duplicate_positions=duplicate_positions,
        duplicate_bound=bound,
        misrouted=len(report.misrouted),
        committed=committed,
        end_offsets=ends,
        workers_died_unasked=group.died,
        workers_refused_at_start_broker_down=group.refused_at_start,
        bad_exits=group.bad_exits,
    )
    figures["promises"] = {
        "inputs accounted": promise(len(report.inputs), f"== {count}", len(report.inputs) == count),
        "lost": promise(lost, "0", lost == 0),
        f"outputs visible to read_committed within {harness.VISIBLE_WITHIN_S:.0f} s": promise(
            report.hidden, "0 offsets hidden", report.hidden == 0
        ),
        "duplicates": promise(
            report.duplicates,
            "0 (exactly_once, read_committed)"
            if exactly_once
            else f"<= {bound} = {MAX_IN_FLIGHT} x ({done['kill']} kills + {len(lost_events)} lost partition"
            f" sets) + {unfinished} unfinished at revoke",
            report.duplicates == 0 if exactly_once else report.duplicates <= bound,
        ),
        "misrouted (ticket dead-lettered or malformed classified)": promise(
            len(report.misrouted), "0", not report.misrouted
        ),
        "committed == end offsets": promise(
            sum(committed.values()), f"== {sum(ends.values())}", committed == ends
        ),
        "no worker died unasked, graceful stops exit 0": promise(
            len(group.died) + len(group.bad_exits), "0", not group.died and not group.bad_exits
        ),
    }
    table = [
        ("tickets (10 % malformed, seeded)", f"{count} at {rate:.0f}/s, produced in {produced_s:.0f} s"),
        ("results / dead letters", f"{figures['results']} / {figures['dead_letters']}"),
        (
            "kill -9 / broker restarts (outage s) / rebalances",
            f"{done['kill']} / {done['broker']} {[s for _, s in outages]} / {done['rebalance']}",
        ),
        ("brokers, broker faults", f"{args.brokers}: {'; '.join(faults_done) or 'none'}"),
        ("workers started", str(workers_started)),
        (
            "partitions lost events / revoked events / unfinished at revoke",
            f"{len(lost_events)} / {revoked} / {unfinished}",
        ),
        ("max.poll.interval overruns", str(evictions)),
        ("final drain", f"{drain_s:.0f} s"),
        (
            "wait until read_committed saw each topic whole",
            ", ".join(f"{seen.topic.rsplit('.', 1)[-1]} {seen.waited_s:.1f} s" for seen in report.visibility),
        ),
        ("model, settings", f"{figures['model']}; {json.dumps(figures['settings'])}"),
    ]
    return promises.write(args.out, "chaos" if not exactly_once else "chaos-exactly-once", figures, table)


# The release exactly-once chaos runs (`broker_release`).
EXACTLY_ONCE_KAFKA_VERSION = "4.1.1"


def broker_release(guarantee: str) -> str:
    """The Kafka release the chaos broker runs: `$TRIAGE_KAFKA_VERSION` when set; in exactly-once mode
    otherwise `EXACTLY_ONCE_KAFKA_VERSION`, the release docs/deployment.md recommends for it (Kafka 4.4.0 left
    a transaction open after a broker restart in 2 of 6 full runs at its default transaction.version 2 and in
    a quick run at level 1; 4.1.1 in none of 13), else the local broker's default."""
    if os.environ.get(KAFKA_VERSION_ENV, "").strip() or guarantee != "exactly_once":
        return configured_kafka_version()
    return EXACTLY_ONCE_KAFKA_VERSION


def keep_logs(state: Path, out: Path) -> None:
    """Copies the workers' and the brokers' logs (server.log of each node) to `out`/chaos-kept-logs/."""
    kept = out / "chaos-kept-logs"
    shutil.rmtree(kept, ignore_errors=True)
    for log_dir in [state / "logs", *state.glob("*/logs"), *state.glob("cluster/node-*/logs")]:
        if log_dir.is_dir():
            shutil.copytree(log_dir, kept / log_dir.relative_to(state))
    progress(f"chaos: the workers' and brokers' logs are kept in {kept}")


def main(argv: list[str] | None = None) -> int:
    parser = promises.arguments(__doc__)
    parser.add_argument("--drain-timeout", type=float, default=1200.0, help="final drain limit, s")
    parser.add_argument(
        "--brokers",
        type=int,
        choices=(1, CLUSTER_SIZE),
        default=1,
        help=(
            "1: one broker, whose restart is a whole-cluster outage; 3: a local three-node cluster "
            "(replication factor 3, min.insync.replicas 2) with a rolling restart, a node's kill -9, the "
            "coordinator's node killed -9 and a whole-cluster restart, once each"
        ),
    )
    parser.add_argument(
        "--keep-logs",
        action="store_true",
        help="keep the workers' and brokers' logs in OUT/chaos-kept-logs/ whatever the outcome "
        f"(with {DEBUG_TRANSACTIONS_ENV}=1 the brokers log their transactions at DEBUG)",
    )
    parser.add_argument(
        "--guarantee",
        choices=("at_least_once", "exactly_once"),
        default="at_least_once",
        help="the workers' pipeline.guarantee (exactly_once writes results/chaos-exactly-once.*)",
    )
    return promises.main("chaos", chaos, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
