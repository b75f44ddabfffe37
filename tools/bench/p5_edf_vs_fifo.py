"""P5 EDF vs FIFO: two workers, `--scheduling fifo` and `edf`, at 100 and 150 % of P2's capacity with half
the tickets due 1 s after they are produced and half much later (`metadata.deadline_at`): deadline misses."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import msgspec

from tools.bench.measure import group_name, offer, progress
from tools.bench.report import epoch
from tools.harness import read_topic
from tools.load import AUDIT_TIMEOUT_S, BenchWorker, DueTickets, Offsets, audit, new_topics

P5_LOADS_PCT = (100, 150)
P5_TIGHT_S = 1.0  # even tickets are due this long after they are produced; odd ones two level lengths later
_DEADLINE_REASONS = ("overloaded", "deadline_exceeded")


def measure(bootstrap: str, capacity: float, seconds: float, logs: Path) -> dict[str, Any]:
    """A FIFO and an EDF worker, each level offered to one then the other (drained in between), so that both
    see the same machine. EDF reorders only what a worker holds: `max_in_flight` is sized to hold a level's
    whole backlog at 150 % (the default 64 is well under a second of work here)."""
    loose_s = 2 * seconds
    bound = max(64, math.ceil(capacity * seconds))
    flags = ("--max-in-flight", str(bound), "--deadline-ms", str(round(loose_s * 1000)))
    tickets = DueTickets(P5_TIGHT_S, loose_s)
    runs: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as cleanup:
        for mode in ("fifo", "edf"):
            (topics,) = new_topics(bootstrap, f"p5-{mode}")
            group = group_name(f"p5-{mode}")
            worker = BenchWorker(
                bootstrap, topics, group, logs / f"p5-{mode}.log", ("--scheduling", mode, *flags)
            )
            cleanup.callback(worker.stop)
            runs[mode] = {"topics": topics, "worker": worker, "group": group, "sent": 0, "levels": []}
        for run in runs.values():
            run["worker"].wait_assigned(timeout=180)
            # Once assigned: a client made right after the topic was created may see it without partitions.
            run["offsets"] = Offsets(bootstrap, run["group"], run["topics"].input)
            cleanup.callback(run["offsets"].close)
        for pct in P5_LOADS_PCT:
            for mode, run in runs.items():
                rate = capacity * pct / 100
                progress(
                    f"P5 {mode} {pct:3d} %: {rate:.1f} tickets/s for {seconds:.0f} s (max_in_flight {bound})"
                )
                before, ends, drained = offer(run, bootstrap, tickets, rate, seconds, capacity)
                run["levels"].append({"load_pct": pct, "range": (before, ends), "drained": drained})
        for run in runs.values():
            run["code"] = run["worker"].stop()
            run["committed"] = run["offsets"].committed()
    progress("P5 auditing the topics")
    figures: dict[str, Any] = {
        "capacity": capacity,
        "seconds_per_level": seconds,
        "max_in_flight": bound,
        "tight_s": P5_TIGHT_S,
        "loose_s": loose_s,
    }
    for mode, run in runs.items():
        report = audit(bootstrap, run["topics"], run["committed"])
        due: dict[tuple[int, int], tuple[float, bool]] = {}  # position → (deadline_at in ms, tight)
        for message in read_topic(bootstrap, run["topics"].input, AUDIT_TIMEOUT_S):
            ticket = msgspec.json.decode(message.value() or b"{}")
            due[(message.partition() or 0, message.offset() or 0)] = (
                epoch(ticket["metadata"]["deadline_at"]) * 1000,
                int(ticket["ticket_id"].rsplit("-", 1)[1]) % 2 == 0,
            )
        levels = []
        for level in run["levels"]:
            before, ends = level.pop("range")
            tally = {"tickets": 0, "in_time": 0, "missed_tight": 0, "missed_loose": 0, "late": 0, "other": 0}
            for partition, end in ends.items():
                for offset in range(before[partition], end):
                    position = (partition, offset)
                    tally["tickets"] += 1
                    results = report.results.get(position)
                    written_ms, reason = results[0] if results else (math.inf, "unanswered")
                    due_ms, tight = due[position]
                    missed = reason in (*_DEADLINE_REASONS, "unanswered") or written_ms > due_ms
                    if reason is None and not missed:
                        tally["in_time"] += 1
                    elif missed:
                        tally["missed_tight" if tight else "missed_loose"] += 1
                        tally["late"] += reason is None
                    else:
                        tally["other"] += 1  # model_error or invalid_output
            levels.append({**level, **tally, "missed": tally["missed_tight"] + tally["missed_loose"]})
        figures[mode] = {
            "levels": levels,
            "lost": report.lost,
            "duplicates": report.duplicates,
            "worker_exit_code": run["code"],
        }
    return figures
