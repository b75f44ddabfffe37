"""Soak against a real local broker (`make soak`); figures in results/soak.json and soak.md.

    .venv/bin/python -m tools.soak [--quick] [--seconds S] [--out results]

One worker with default settings and the embedded model. Its capacity is measured first (a backlog drained as
fast as it goes), then tickets arrive at 2x that capacity for 10 minutes. Promises: RSS of the worker's
process tree flat (tolerance in RSS_SPREAD / RSS_TREND), never evicted from the group (no lost partitions, no
max.poll.interval overrun, one assignment only), nothing lost (every offset the group committed past has its
record or dead letter; the rest is still in Kafka, counted as backlog).

Prints a progress line to stderr and exits 1 when a promise is broken.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from tools import load, promises
from tools.promises import progress, promise

MiB = 1024 * 1024
# RSS tolerance after warm-up (the first fifth of the soak): spread (max - min) at most 10 % of the median,
# and the least-squares trend over the window at most 5 % of the median (a leak shows as a trend).
RSS_SPREAD = 0.10
RSS_TREND = 0.05


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


def _capacity(offsets: load.Offsets, worker: load.BenchWorker, backlog: int) -> float:
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
    figures = promises.header("soak", args)
    backlog, seconds, drain_s = (3000, 90.0, 30.0) if args.quick else (12000, 600.0, 120.0)
    seconds = args.seconds or seconds
    tickets = load.Tickets()
    with contextlib.ExitStack() as cleanup, tempfile.TemporaryDirectory(prefix="triage-soak-") as logs:
        bootstrap = cleanup.enter_context(load.kafka(progress))
        (topics,) = load.new_topics(bootstrap, "soak")
        group = f"soak-{uuid.uuid4().hex[:8]}"
        worker = load.BenchWorker(bootstrap, topics, group, Path(logs) / "soak-worker.log")
        cleanup.callback(worker.stop)
        offsets = load.Offsets(bootstrap, group, topics.input)
        cleanup.callback(offsets.close)
        worker.wait_assigned(timeout=240)

        progress(f"soak: measuring capacity on a backlog of {backlog} tickets (default settings)")
        load.produce_tickets(bootstrap, topics.input, tickets, 0, backlog)
        capacity = _capacity(offsets, worker, backlog)
        rate = 2 * capacity
        progress(f"soak: capacity {capacity:.1f} tickets/s; {rate:.1f}/s for {seconds:.0f}s")

        sent: list[int] = []
        producer = threading.Thread(
            target=lambda: sent.append(
                load.produce_paced(bootstrap, topics.input, tickets, backlog, rate, seconds)
            ),
            daemon=True,
        )
        soak_start = time.monotonic()
        producer.start()
        rss: list[tuple[float, int]] = []  # (s since soak start, tree RSS)
        while producer.is_alive() or time.monotonic() - soak_start < seconds + drain_s:
            worker.alive()
            now = time.monotonic() - soak_start
            rss.append((now, load.rss_bytes(worker.pid)))
            if len(rss) % 6 == 1:
                done = sum(max(0, o) for o in offsets.committed().values())
                progress(
                    f"soak: t={now:.0f}s rss={rss[-1][1] / MiB:.0f} MiB committed={done} "
                    f"end={sum(offsets.ends().values())}"
                )
            time.sleep(5)
        producer.join()
        committed = offsets.committed()
        code = worker.stop(timeout=60)
        report = load.audit(bootstrap, topics, committed)
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
    return promises.write(args.out, "soak", figures, table)


def main(argv: list[str] | None = None) -> int:
    parser = promises.arguments(__doc__)
    parser.add_argument("--seconds", type=float, default=0.0, help="soak length (default 600, quick 90)")
    return promises.main("soak", soak, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
