"""P6 exactly-once vs at-least-once: two workers, `--guarantee at_least_once` and `exactly_once`: throughput
of a burst, and latency at 70 % of P2's capacity as a read_committed reader sees the results."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import msgspec

from tools.bench.measure import bracket, group_name, last_metrics, offer, percentile, progress
from tools.harness import end_offsets
from tools.load import (
    BenchWorker,
    Offsets,
    Tickets,
    Visible,
    audit,
    new_topics,
    produce_tickets,
)
from worker.messages import TriageResult

P6_LOAD_PCT = 70
_GUARANTEES = ("at_least_once", "exactly_once")


def measure(
    bootstrap: str, tickets: Tickets, capacity: float, count: int, budget: float, seconds: float, logs: Path
) -> dict[str, Any]:
    """Two workers with default settings but `--guarantee` (the exactly-once one with a transactional id of
    its own), each on its own topics, same tickets. Throughput: `count` tickets as fast as possible until the
    group has committed them, at-least-once before and after exactly-once (`bracket`). Latency: P6_LOAD_PCT %
    of the capacity (P2's, or the at-least-once burst's if lower) for `seconds`, offered to one, drained, then
    to the other; a ticket's latency is its input CreateTime → its result visible to a read_committed reader
    (`Visible`)."""
    runs: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as cleanup:
        for mode in _GUARANTEES:
            (topics,) = new_topics(bootstrap, f"p6-{mode}")
            group = group_name(f"p6-{mode}")
            flags = ["--guarantee", mode]
            if mode == "exactly_once":
                flags += ["--transactional-id", f"{group}.txn"]
            worker = BenchWorker(bootstrap, topics, group, logs / f"p6-{mode}.log", flags)
            cleanup.callback(worker.stop)
            runs[mode] = {"topics": topics, "worker": worker, "group": group, "sent": 0, "burst_end": 0}
        for run in runs.values():
            run["worker"].wait_assigned(timeout=180)
            run["offsets"] = Offsets(bootstrap, run["group"], run["topics"].input)
            cleanup.callback(run["offsets"].close)

        def throughput(mode: str, when: str = "") -> dict[str, Any]:
            run, offsets = runs[mode], runs[mode]["offsets"]
            progress(f"P6 {mode}{when}: {count} tickets as fast as possible")
            started = produce_tickets(bootstrap, run["topics"].input, tickets, run["sent"], count)
            run["sent"] += count
            done = offsets.follow(offsets.ends(), budget, run["worker"].alive, every=0.05)
            # This burst's records: committed past where the group stood when the previous burst ended.
            records, run["burst_end"] = done.records - run["burst_end"], done.records
            return {
                "records": records,
                "seconds": round(done.at - started, 3),
                "rate": round(records / (done.at - started), 1),
                "complete": done.complete,
            }

        alo_before = throughput("at_least_once", " (before)")
        eos_rate = throughput("exactly_once")
        alo_rate = bracket(alo_before, throughput("at_least_once", " (after)"))

        outputs = [run["topics"].output for run in runs.values()]
        visible = Visible(bootstrap, {topic: end_offsets(bootstrap, topic) for topic in outputs})
        cleanup.callback(visible.close)
        # Relative to the lower of P2's capacity and the at-least-once burst just measured: the machine may be
        # busier than it was during P2 (other jobs), and a level over capacity would measure a queue instead.
        capacity = min(capacity, alo_rate["rate"])
        rate = capacity * P6_LOAD_PCT / 100
        for mode, run in runs.items():
            progress(f"P6 {mode} {P6_LOAD_PCT} %: {rate:.1f} tickets/s for {seconds:.0f} s")
            before, ends, run["drained"] = offer(run, bootstrap, tickets, rate, seconds, capacity)
            run["range"] = (before, ends)
        time.sleep(1.2)  # the reader's last fetch; one more metrics event
        visible.close()
        for run in runs.values():
            run["code"] = run["worker"].stop()
            run["committed"] = run["offsets"].committed()
    progress("P6 auditing the topics (read_committed)")
    decode = msgspec.json.Decoder(TriageResult).decode
    figures: dict[str, Any] = {
        "tickets": count,
        "capacity": capacity,  # the lower of P2's and the at-least-once burst's
        "load_pct": P6_LOAD_PCT,
        "offered_rate": round(rate, 1),
        "seconds": seconds,
    }
    for mode, run in runs.items():
        report = audit(bootstrap, run["topics"], run["committed"])
        shown: dict[tuple[int, int], float] = {}  # input position → first visible, epoch ms
        for topic, at, value in visible.seen:
            if topic == run["topics"].output:
                source = decode(value).source
                shown.setdefault((source.partition, source.offset), at)
        before, ends = run["range"]
        positions = [(p, offset) for p, end in ends.items() for offset in range(before[p], end)]
        latencies = [
            round(shown[position] - report.inputs[position], 1) for position in positions if position in shown
        ]
        metrics = last_metrics(run["worker"])
        figures[mode] = {
            "throughput": alo_rate if mode == "at_least_once" else eos_rate,
            "latency": {
                "tickets": len(positions),
                "visible": len(latencies),
                "drained": run["drained"],
                "p50_ms": percentile(latencies, 50),
                "p99_ms": percentile(latencies, 99),
            },
            "inputs": len(report.inputs),
            "lost": report.lost,
            "duplicates": report.duplicates,
            "unprocessed": report.unprocessed,
            "transactions": metrics.get("transactions"),
            "transactions_aborted": metrics.get("transactions_aborted"),
            "worker_exit_code": run["code"],
        }
    alo, eos = figures["at_least_once"], figures["exactly_once"]
    figures["throughput_ratio"] = round(eos["throughput"]["rate"] / alo["throughput"]["rate"], 3)
    for key in ("p50_ms", "p99_ms"):
        eos_ms, alo_ms = eos["latency"][key], alo["latency"][key]
        figures[f"{key[:3]}_ratio"] = round(eos_ms / alo_ms, 2) if eos_ms is not None and alo_ms else None
    figures["latency"] = "input CreateTime → result seen by a read_committed reader (wall clock, same host)"
    return figures
