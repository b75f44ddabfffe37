"""P2's worker measurement in several modes of the same code, one local broker: what a setting costs end to
end. Each round runs every mode once, in turn, the order reversed every other round (ABBA for two modes), so
that a drift of the machine's load over the run falls on every mode alike.

Used by `tools.bench_privacy_p2` (the personal-data detector off vs on) and `tools.bench_tracing_p2`
(tracing off, sampling 1 %, sampling 100 %).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from tools.bench.measure import group_name, progress, rate_of
from tools.load import BenchWorker, Offsets, Tickets, cpu_seconds, new_topics, produce_tickets


def run_mode(
    bootstrap: str, tickets: Tickets, count: int, name: str, args: list[str], logs: Path
) -> dict[str, Any]:
    """One `triage-worker run` (the first stage alone, as P2) with `args`: `count` tickets produced as fast
    as possible once it is assigned, until its group committed them all; its tickets/s and CPU per ticket."""
    (topics,) = new_topics(bootstrap, name)
    group = group_name(name)
    with contextlib.ExitStack() as cleanup:
        worker = BenchWorker(bootstrap, topics, group, logs / f"{name}.log", ["--escalation", "off", *args])
        cleanup.callback(worker.stop)
        offsets = Offsets(bootstrap, group, topics.input)
        cleanup.callback(offsets.close)
        worker.wait_assigned(timeout=180)
        cpu_before = cpu_seconds(worker.pid)
        started = produce_tickets(bootstrap, topics.input, tickets, 0, count)
        done = offsets.follow(offsets.ends(), 600, worker.alive, every=0.05)
        cpu = cpu_seconds(worker.pid) - cpu_before
    return {**rate_of(done, started), "cpu_ms_per_ticket": round(cpu * 1000 / max(1, done.records), 3)}


def compare(
    bootstrap: str,
    tickets: Tickets,
    count: int,
    rounds: int,
    modes: dict[str, list[str]],
    logs: Path,
    prefix: str,
) -> dict[str, Any]:
    """Every mode (name -> the worker's extra arguments) `rounds` times: each run, and each mode's totals
    (tickets/s over all its runs; mean CPU ms per ticket)."""
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in modes}
    for round_ in range(rounds):
        order = list(modes) if round_ % 2 == 0 else list(reversed(modes))
        for mode in order:
            run = run_mode(bootstrap, tickets, count, f"{prefix}-{mode}-{round_}", modes[mode], logs)
            runs[mode].append(run)
            progress(f"{mode} round {round_}: {run['rate']}/s, {run['cpu_ms_per_ticket']} ms CPU/ticket")
    totals = {
        mode: {
            "rate": round(sum(r["records"] for r in done) / sum(r["seconds"] for r in done), 1),
            "cpu_ms_per_ticket": round(sum(r["cpu_ms_per_ticket"] for r in done) / len(done), 3),
        }
        for mode, done in runs.items()
    }
    return {"runs": runs, "totals": totals}
