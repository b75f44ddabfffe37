"""P4 latency under load: 25..200 % of P2's capacity, each for a fixed time, against one worker; its tree's
RSS and in-flight tickets over time."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

from tools.bench.measure import group_name, percentile, progress
from tools.bench.report import epoch
from tools.load import BenchWorker, Offsets, Tickets, audit, new_topics, produce_paced, rss_bytes

LOADS_PCT = (25, 50, 70, 100, 150, 200)


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


def measure(bootstrap: str, tickets: Tickets, capacity: float, seconds: float, logs: Path) -> dict[str, Any]:
    (topics,) = new_topics(bootstrap, "p4")
    group = group_name("p4")
    progress(f"P4 starting the worker; capacity from P2 = {capacity:.1f} tickets/s")
    levels: list[dict[str, Any]] = []
    with contextlib.ExitStack() as cleanup:
        worker = BenchWorker(bootstrap, topics, group, logs / "p4-worker.log")
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
            "t": epoch(event["timestamp"]),
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
                "p50_ms": percentile(latencies, 50),
                "p95_ms": percentile(latencies, 95),
                "p99_ms": percentile(latencies, 99),
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
