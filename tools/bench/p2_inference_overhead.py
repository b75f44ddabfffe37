"""P2 inference overhead: `triage-worker run` with default settings vs the raw classifier pool (its own
baseline, measured before and after); and each one's CPU cost per ticket."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

from tools.bench.measure import group_name, last_metrics, progress, rate_of
from tools.load import BROKER_PID, BenchWorker, Offsets, Tickets, cpu_seconds, new_topics, produce_tickets
from worker.classification import ClassifyRequest
from worker.inference.loading import resolve_taxonomy
from worker.inference.pool import open_pool
from worker.settings import InferenceSettings

POOL_QUEUE_PER_CONTEXT = 32


def measure_pool(tickets: Tickets, count: int) -> dict[str, Any]:
    """The raw pool with default inference settings: every text submitted with a generous deadline,
    drained with poll.

    At most POOL_QUEUE_PER_CONTEXT requests per context are outstanding: that already keeps every context
    busy, and a flood of thousands fills the pipes both ways, on which `pool.close()` blocks forever when a
    Ctrl-C stops the draining (the contexts wait to write answers, the parent to write the stop message).
    """
    progress("P2 baseline: opening the classifier pool (default inference settings)")
    fallbacks: dict[str, int] = {}
    settings = InferenceSettings()
    with open_pool(settings, *resolve_taxonomy(settings)) as pool:
        progress(f"P2 baseline: {count} texts through the pool ({pool.size} contexts)")
        window = POOL_QUEUE_PER_CONTEXT * pool.size
        cpu_before = cpu_seconds(os.getpid())
        started = time.monotonic()
        deadline = started + 3600
        submitted = answered = 0
        while answered < count:
            while submitted < min(count, answered + window):
                pool.submit(ClassifyRequest(submitted, tickets.text(submitted), deadline))
                submitted += 1
            for _, answer in pool.poll(0.05):
                answered += 1
                if answer.fallback:
                    reason = answer.fallback_reason or "unknown"
                    fallbacks[reason] = fallbacks.get(reason, 0) + 1
            if time.monotonic() - started > max(300.0, count / 5):
                raise TimeoutError(f"the pool answered {answered} of {count}")
        seconds = time.monotonic() - started
        cpu = cpu_seconds(os.getpid()) - cpu_before
        size = pool.size
    return {
        "tickets": count,
        "contexts": size,
        "seconds": round(seconds, 3),
        "rate": round(count / seconds, 1),
        "cpu_ms_per_ticket": round(cpu * 1000 / count, 3),
        "fallbacks": fallbacks,
    }


def measure_worker(bootstrap: str, tickets: Tickets, count: int, budget: float, logs: Path) -> dict[str, Any]:
    (topics,) = new_topics(bootstrap, "p2")
    group = group_name("p2")
    progress("P2 starting `triage-worker run` (default settings, the first stage alone)")
    with contextlib.ExitStack() as cleanup:
        # Against the first stage's own pool: the cascade's share is P7's to measure.
        worker = BenchWorker(bootstrap, topics, group, logs / "p2-worker.log", ["--escalation", "off"])
        cleanup.callback(worker.stop)
        offsets = Offsets(bootstrap, group, topics.input)
        cleanup.callback(offsets.close)
        worker.wait_assigned(timeout=180)
        progress(f"P2 worker assigned; producing {count} tickets as fast as possible")
        broker = BROKER_PID.get(bootstrap)
        cpu_before = cpu_seconds(worker.pid)
        broker_before = cpu_seconds(broker) if broker else 0.0
        started = produce_tickets(bootstrap, topics.input, tickets, 0, count)
        done = offsets.follow(offsets.ends(), budget, worker.alive, every=0.05)
        cpu = cpu_seconds(worker.pid) - cpu_before
        broker_cpu = cpu_seconds(broker) - broker_before if broker else None
        time.sleep(1.2)  # one more metrics event, with the final counts
        metrics = last_metrics(worker)
    return {
        **rate_of(done, started),
        "cpu_ms_per_ticket": round(cpu * 1000 / max(1, done.records), 3),
        # The broker shares the cores with the worker here (its produce, fetch and commit handling).
        "broker_cpu_ms_per_ticket": None
        if broker_cpu is None
        else round(broker_cpu * 1000 / max(1, done.records), 3),
        "fallbacks": metrics.get("fallback", {}),
        "classified": metrics.get("classified"),
        "start": "first produce call, after the worker was assigned its partitions",
        "end": "group's committed offsets == end offsets (checked every 50 ms)",
    }
