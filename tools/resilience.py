"""Soak and chaos at scale against a real local broker; figures in results/soak.* and results/chaos.*.

    .venv/bin/python tools/resilience.py soak  [--quick] [--out results]   # make soak
    .venv/bin/python tools/resilience.py chaos [--quick] [--out results]   # make chaos

soak: one worker with default settings and the embedded model. Its capacity is measured first (a backlog
drained as fast as it goes), then tickets arrive at 2x that capacity for 10 minutes. Promises: RSS of the
worker's process tree flat (tolerance in RSS_SPREAD / RSS_TREND), never evicted from the group (no lost
partitions, no max.poll.interval overrun, one assignment only), nothing lost (every offset the group committed
past has its record or dead letter; the rest is still in Kafka, counted as backlog).

chaos: 100,000 sample tickets (10 % malformed) paced in the background while 2-3 workers of one group (the
tiny test model, fast group timeouts) go through a seeded schedule of 50 kill -9 (each replaced at once),
3 broker stop/starts on the same data and 10 graceful joins/leaves; then a fresh worker drains the rest.
Promises: 0 lost, committed == end offsets, no misrouted record, duplicates <= the bound computed from what
happened (docs/guarantees.md): max_in_flight per kill and per lost partition set, plus every ticket a
revoke left unfinished.

Both print a progress line to stderr and exit 1 when a promise is broken.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import confluent_kafka

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

import bench_kafka as bk  # noqa: E402
import pipeline_harness as ph  # noqa: E402

from worker.kafka.admin import TopicSpec, create_topics  # noqa: E402
from worker.kafka.local_broker import LocalBroker, free_port  # noqa: E402

MiB = 1024 * 1024
# RSS tolerance after warm-up (the first fifth of the soak): spread (max - min) at most 10 % of the median,
# and the least-squares trend over the window at most 5 % of the median (a leak shows as a trend).
RSS_SPREAD = 0.10
RSS_TREND = 0.05


def progress(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def quiet_clients(name: str) -> Path:
    """Sends what librdkafka writes to fd 2 (hundreds of "Connection refused" lines per broker outage, from
    this process's producer and offset watcher) to a file, keeping progress and tracebacks on the terminal."""
    path = Path(tempfile.gettempdir()) / f"triage-{name}-clients-{os.getpid()}.log"
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    sink = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(sink, 2)
    os.close(sink)
    sys.stderr = terminal
    return path


def machine() -> str:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown CPU",
    )
    system = f"{platform.system()} {platform.release()}, Python {platform.python_version()}"
    return f"{os.cpu_count()} CPUs ({model}), {system}"


def header(name: str, args: argparse.Namespace) -> dict[str, Any]:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=False
    ).stdout.strip()
    return {
        "name": name,
        "command": "python tools/resilience.py " + shlex.join(sys.argv[1:]),
        "quick": args.quick,
        "commit": commit or "unknown",
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def write(out: Path, name: str, figures: dict[str, Any], table: list[tuple[str, str]]) -> bool:
    """results/<name>.json and .md; True when every promise holds."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    promises: dict[str, dict[str, Any]] = figures["promises"]
    lines = [
        f"# {name}{' (--quick)' if figures['quick'] else ''}",
        "",
        f"`{figures['command']}` at {figures['commit']}, {figures['when']}, on {figures['machine']} "
        f"(load average at start {figures['load_average_at_start']}).",
        "",
        "| promise | figure | bound | holds |",
        "|---|---|---|---|",
        *(
            f"| {k} | {v['figure']} | {v['bound']} | {'yes' if v['ok'] else '**NO**'} |"
            for k, v in promises.items()
        ),
        "",
        "| figure | value |",
        "|---|---|",
        *(f"| {k} | {v} |" for k, v in table),
        "",
    ]
    (out / f"{name}.md").write_text("\n".join(lines), encoding="utf-8")
    ok = all(p["ok"] for p in promises.values())
    progress(f"{name}: {'all promises hold' if ok else 'PROMISE BROKEN'}; {out / name}.md")
    return ok


def promise(figure: object, bound: str, ok: bool) -> dict[str, Any]:
    return {"figure": figure, "bound": bound, "ok": bool(ok)}


# -- soak -------------------------------------------------------------------------------------------------


def _trend(samples: list[tuple[float, int]]) -> float:
    """Least-squares slope of RSS over time times the window: the growth a straight line explains."""
    n = len(samples)
    mean_t = sum(t for t, _ in samples) / n
    mean_r = sum(r for _, r in samples) / n
    var = sum((t - mean_t) ** 2 for t, _ in samples)
    if not var:
        return 0.0
    slope = sum((t - mean_t) * (r - mean_r) for t, r in samples) / var
    return slope * (samples[-1][0] - samples[0][0])


def _capacity(offsets: bk.Offsets, worker: bk.Worker, backlog: int) -> float:
    """Tickets/s while the worker drains a backlog, over its middle 80 % (start-up and the tail left out)."""
    ends = offsets.ends()
    curve: list[tuple[float, int]] = []
    deadline = time.monotonic() + 600
    while (now := offsets.follow(ends, 0.0, worker.alive)).records < backlog and now.at < deadline:
        curve.append((now.at, now.records))
        time.sleep(0.2)
    curve.append((now.at, now.records))
    low = next(p for p in curve if p[1] >= 0.1 * backlog)
    high = next(p for p in curve if p[1] >= 0.9 * backlog)
    return (high[1] - low[1]) / (high[0] - low[0])


def soak(args: argparse.Namespace) -> bool:
    figures = header("soak", args)
    backlog, seconds, drain_s = (3000, 90.0, 30.0) if args.quick else (12000, 600.0, 120.0)
    seconds = args.seconds or seconds
    tickets = bk.Tickets()
    with contextlib.ExitStack() as cleanup, tempfile.TemporaryDirectory(prefix="triage-soak-") as logs:
        bootstrap = cleanup.enter_context(bk.kafka(progress))
        (topics,) = bk.new_topics(bootstrap, "soak")
        group = f"soak-{uuid.uuid4().hex[:8]}"
        worker = bk.Worker(bootstrap, topics, group, Path(logs) / "soak-worker.log")
        cleanup.callback(worker.stop)
        offsets = bk.Offsets(bootstrap, group, topics.input)
        cleanup.callback(offsets.close)
        worker.wait_assigned(timeout=240)

        progress(f"soak: measuring capacity on a backlog of {backlog} tickets (default settings)")
        bk.produce_tickets(bootstrap, topics.input, tickets, 0, backlog)
        capacity = _capacity(offsets, worker, backlog)
        rate = 2 * capacity
        progress(f"soak: capacity {capacity:.1f} tickets/s; {rate:.1f}/s for {seconds:.0f}s")

        sent: list[int] = []
        producer = threading.Thread(
            target=lambda: sent.append(
                bk.produce_paced(bootstrap, topics.input, tickets, backlog, rate, seconds)
            ),
            daemon=True,
        )
        soak_start = time.monotonic()
        producer.start()
        rss: list[tuple[float, int]] = []  # (s since soak start, tree RSS)
        while producer.is_alive() or time.monotonic() - soak_start < seconds + drain_s:
            worker.alive()
            now = time.monotonic() - soak_start
            rss.append((now, bk.rss_bytes(worker.pid)))
            if len(rss) % 6 == 1:
                committed = sum(max(0, o) for o in offsets.committed().values())
                progress(
                    f"soak: t={now:.0f}s rss={rss[-1][1] / MiB:.0f} MiB committed={committed} "
                    f"end={sum(offsets.ends().values())}"
                )
            time.sleep(5)
        producer.join()
        committed = offsets.committed()
        code = worker.stop(timeout=60)
        report = bk.audit(bootstrap, topics, committed)
        metrics = worker.events("metrics")
        final = metrics[-1]
        evictions = len(worker.events("max_poll_interval_exceeded")) + len(worker.events("partitions_lost"))
        assignments = len(worker.events("partitions_assigned"))

    window = [(t, r) for t, r in rss if t >= seconds / 5 and t <= seconds]
    median = sorted(r for _, r in window)[len(window) // 2]
    spread = max(r for _, r in window) - min(r for _, r in window)
    trend = _trend(window)
    in_flight_max = max(m["in_flight"] for m in metrics)
    figures.update(
        capacity_tickets_per_s=round(capacity, 1),
        capacity_backlog=backlog,
        rate_tickets_per_s=round(rate, 1),
        soak_s=seconds,
        drain_s=drain_s,
        produced=backlog + sent[0],
        committed=sum(max(0, o) for o in committed.values()),
        processed_during_soak_per_s=round(
            (sum(max(0, o) for o in committed.values()) - backlog) / (seconds + drain_s), 1
        ),
        backlog_left_in_kafka=report.unprocessed,
        duplicates=report.duplicates,
        rss_samples_mib=[(round(t), round(r / MiB, 1)) for t, r in rss],
        rss_median_mib=round(median / MiB, 1),
        rss_spread_mib=round(spread / MiB, 1),
        rss_trend_mib=round(trend / MiB, 1),
        worker_rss_bytes_first_last=[metrics[0].get("rss_bytes"), final.get("rss_bytes")],
        in_flight_max=in_flight_max,
        paused_seen=any(m.get("paused") for m in metrics),
        fallbacks=final.get("fallback", {}),
        exit_code=code,
    )
    figures["promises"] = {
        "RSS flat: spread after warm-up": promise(
            f"{spread / MiB:.1f} MiB",
            f"<= {RSS_SPREAD:.0%} of median {median / MiB:.0f} MiB",
            spread <= RSS_SPREAD * median,
        ),
        "RSS flat: trend over the window": promise(
            f"{trend / MiB:+.1f} MiB", f"<= {RSS_TREND:.0%} of median", trend <= RSS_TREND * median
        ),
        "never evicted (lost partitions + max.poll overruns)": promise(evictions, "0", evictions == 0),
        "one assignment for the whole run": promise(assignments, "1", assignments == 1),
        "lost (committed past without a record or dead letter)": promise(report.lost, "0", report.lost == 0),
        "duplicates (no crash, no rebalance)": promise(report.duplicates, "0", report.duplicates == 0),
        "graceful stop under backlog exits 0": promise(code, "0", code == 0),
    }
    table = [
        (
            f"capacity (middle 80 % of draining a backlog of {backlog}, default settings)",
            f"{capacity:.1f} tickets/s",
        ),
        (
            "offered load",
            f"{rate:.1f} tickets/s (2x) for {seconds:.0f} s, then {drain_s:.0f} s without input",
        ),
        (
            "produced / committed / left in Kafka",
            f"{figures['produced']} / {figures['committed']} / {report.unprocessed}",
        ),
        ("processed during soak", f"{figures['processed_during_soak_per_s']} tickets/s"),
        (
            "tree RSS median / spread / trend",
            f"{median / MiB:.0f} / {spread / MiB:.1f} / {trend / MiB:+.1f} MiB",
        ),
        ("in flight max (bound 64), paused seen", f"{in_flight_max}, {figures['paused_seen']}"),
        ("fallbacks", json.dumps(figures["fallbacks"])),
    ]
    return write(args.out, "soak", figures, table)


# -- chaos ------------------------------------------------------------------------------------------------

MAX_IN_FLIGHT = 64  # the default, stated so that the bound does not depend on it silently


class Chaos:
    """The group under test: live workers, every worker ever started, and what was done to them."""

    def __init__(
        self, bootstrap: str, topics: ph.Topics, logs: Path, rng: random.Random, guarantee: str
    ) -> None:
        self.bootstrap, self.topics, self.logs, self.rng = bootstrap, topics, logs, rng
        self.guarantee = guarantee
        self.group = f"chaos-{uuid.uuid4().hex[:8]}"
        self.live: list[ph.Worker] = []
        self.all: list[ph.Worker] = []
        self.died: list[str] = []  # workers that exited without being killed or stopped: a finding
        self.refused_at_start: list[str] = []
        self.bad_exits: list[str] = []
        self.serial = 0

    def start(self, role: str) -> ph.Worker:
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
        worker = ph.Worker(
            self.bootstrap, self.topics, self.group, self.logs, f"{self.serial:03d}-{role}", settings
        )
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

    def working(self, timeout: float = 30.0) -> list[ph.Worker]:
        """Live workers that own partitions (have been assigned some), waiting up to `timeout` for one."""
        deadline = time.monotonic() + timeout
        while True:
            busy = [w for w in self.live if w.events("partitions_assigned")]
            if busy or time.monotonic() > deadline:
                return busy or list(self.live)
            time.sleep(0.5)

    def kill(self) -> str:
        victim = self.rng.choice(self.working())
        self.live.remove(victim)
        victim.kill()
        self.start("restart")
        return victim.log_path.name

    def rebalance(self) -> str:
        if len(self.live) >= 3:
            leaver = self.rng.choice(self.working())
            self.live.remove(leaver)
            if (code := leaver.stop(90)) != 0:
                self.bad_exits.append(f"{leaver.log_path.name} left with {code}:\n{leaver.tail(8)}")
            return f"leave {leaver.log_path.name}"
        joiner = self.start("join")
        return f"join {joiner.log_path.name}"

    def stop_all(self) -> None:
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
            return {
                "partition": partition,
                "offset": offset,
                "kind": kind,
                "first_committed_past_by": passed[0] if passed else None,
                "skipped_by": skipped_by.get(position, []),
                "last_owner": (owners.get(partition) or [None])[-1],
            }

        return explain

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


def chaos(args: argparse.Namespace) -> bool:
    figures = header("chaos", args)
    if args.quick:
        count, kills, brokers, rebalances, rate = 6000, 8, 1, 2, 50.0
    else:
        count, kills, brokers, rebalances, rate = 100_000, 50, 3, 10, 150.0
    rng = random.Random(args.seed)
    plan = ["kill"] * kills + ["broker"] * brokers + ["rebalance"] * rebalances
    rng.shuffle(plan)
    produce_s = count / rate
    tag = f"chaos.{uuid.uuid4().hex[:8]}"
    topics = ph.Topics(f"{tag}.raw", f"{tag}.out", f"{tag}.dlq")
    done: dict[str, int] = {"kill": 0, "broker": 0, "rebalance": 0}
    outages: list[tuple[str, float]] = []  # (UTC time the broker came back, seconds down)
    with contextlib.ExitStack() as cleanup:
        state = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="triage-chaos-")))
        broker = LocalBroker(state / "broker", port=free_port())
        broker.start(fresh=True, echo=progress)
        cleanup.callback(broker.stop)
        bootstrap = broker.bootstrap
        create_topics(
            {"bootstrap.servers": bootstrap},
            [
                TopicSpec(topics.input, 6, 1),
                TopicSpec(topics.output, 6, 1),
                TopicSpec(topics.dead_letter, 1, 1),
            ],
        )
        (state / "logs").mkdir()
        group = Chaos(bootstrap, topics, state / "logs", rng, args.guarantee)
        cleanup.callback(lambda: [w.kill() for w in group.all])
        for _ in range(2):
            group.start("first")
        group.working(90)
        offsets = bk.Offsets(bootstrap, group.group, topics.input)
        cleanup.callback(offsets.close)
        progress(f"chaos: {count} tickets at {rate:.0f}/s; plan {len(plan)} events over ~{produce_s:.0f}s")
        publisher = ph.Publisher(bootstrap, topics, count, rate, seed=args.seed)
        started = time.monotonic()
        publisher.start()
        for index, action in enumerate(plan):
            due = started + (index + 1) * produce_s / (len(plan) + 1) + rng.uniform(-1.0, 1.0)
            while (left := due - time.monotonic()) > 0:
                time.sleep(min(left, 1.0))
                group.check()
            group.check()
            if action == "kill":
                what = f"kill -9 {group.kill()}"
            elif action == "rebalance":
                what = group.rebalance()
            else:
                outage = rng.choice([3.0, 12.0, 20.0])  # below and above session.timeout.ms (6 s)
                broker.stop()
                time.sleep(outage)
                broker.start(fresh=False, echo=lambda _line: None)
                outages.append((datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), outage))
                what = f"broker down {outage:.0f}s"
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
        ends = offsets.ends()
        while not (now := offsets.follow(ends, 10, lambda: None)).complete:
            if final.process.poll() is not None or now.at - drain_started > args.drain_timeout:
                break
            progress(f"chaos: draining, committed {now.records}/{count}")
        drain_s = time.monotonic() - drain_started
        group.stop_all()
        report = ph.audit(bootstrap, topics)
        ends = ph.end_offsets(bootstrap, topics.input)
        committed = ph.committed_offsets(bootstrap, group.group, topics.input)
        lost_events = group.events("partitions_lost")
        unfinished = sum(int(e.get("unfinished") or 0) for e in group.events("partitions_revoked"))
        revoked = len(group.events("partitions_revoked"))
        overruns = group.events("max_poll_interval_exceeded")
        evictions = len(overruns)
        workers_started = len(group.all)
        overrun_lead_up = group.lead_up("max_poll_interval_exceeded")
        explain = group.explainer(topics.input)
        lost_positions = [explain(position, report.inputs[position]) for position in report.lost]
        if report.lost:
            kept = args.out / f"{'chaos-exactly-once' if args.guarantee == 'exactly_once' else 'chaos'}-logs"
            shutil.rmtree(kept, ignore_errors=True)
            shutil.copytree(state / "logs", kept)
            progress(f"chaos: tickets lost; the workers' logs are kept in {kept}")

    bound = MAX_IN_FLIGHT * (done["kill"] + len(lost_events)) + unfinished
    exactly_once = args.guarantee == "exactly_once"
    lost = len(report.lost)
    figures.update(
        seed=args.seed,
        model="tests/models/tiny (the test model; chaos checks accounting, not answers)",
        settings={
            "pipeline.max_in_flight": MAX_IN_FLIGHT,
            "pipeline.guarantee": args.guarantee,
            **ph.FAST_GROUP_OPTIONS,
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
        lost=lost,
        lost_positions=lost_positions,
        duplicates=report.duplicates,
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
        ("workers started", str(workers_started)),
        (
            "partitions lost events / revoked events / unfinished at revoke",
            f"{len(lost_events)} / {revoked} / {unfinished}",
        ),
        ("max.poll.interval overruns", str(evictions)),
        ("final drain", f"{drain_s:.0f} s"),
        ("model, settings", f"{figures['model']}; {json.dumps(figures['settings'])}"),
    ]
    return write(args.out, "chaos" if not exactly_once else "chaos-exactly-once", figures, table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = parser.add_subparsers(dest="command", required=True)
    runs: dict[str, Callable[[argparse.Namespace], bool]] = {"soak": soak, "chaos": chaos}
    for name in runs:
        sub = commands.add_parser(name)
        sub.add_argument("--quick", action="store_true", help="a 2-3 minute version")
        sub.add_argument("--out", type=Path, default=REPO / "results")
        sub.add_argument("--seed", type=int, default=5)
        if name == "soak":
            sub.add_argument("--seconds", type=float, default=0.0, help="soak length (default 600, quick 90)")
        else:
            sub.add_argument("--drain-timeout", type=float, default=1200.0, help="final drain limit, s")
            sub.add_argument(
                "--guarantee",
                choices=("at_least_once", "exactly_once"),
                default="at_least_once",
                help="the workers' pipeline.guarantee (exactly_once writes results/chaos-exactly-once.*)",
            )
    args = parser.parse_args(argv)
    progress(f"{args.command}: Kafka client logs of this process go to {quiet_clients(args.command)}")
    return 0 if runs[args.command](args) else 1


if __name__ == "__main__":
    sys.exit(main())
