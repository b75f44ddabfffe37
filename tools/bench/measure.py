"""What the figures share: the progress line, unique group names, rates, baselines bracketing a figure, the
worker's last metrics event and percentiles."""

from __future__ import annotations

import math
import sys
import time
import uuid
from collections.abc import Sequence
from typing import Any

from tools.load import BenchWorker, Progress, Tickets, produce_paced

_STARTED = time.monotonic()


def progress(line: str) -> None:
    print(f"[{time.monotonic() - _STARTED:6.1f}s] {line}", file=sys.stderr, flush=True)


def group_name(phase: str) -> str:
    return f"bench.{phase}.{uuid.uuid4().hex[:8]}"


def bracket(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """A baseline measured before and after the figure it is compared with, so that drift on a shared
    machine (other jobs starting or stopping) moves both halves; the ratio uses the mean."""
    figures = {key: value for key, value in before.items() if key != "seconds"}
    for key in ("rate", "cpu_ms_per_ticket"):
        if key in before:
            figures[key] = round((before[key] + after[key]) / 2, 3)
    figures["complete"] = before.get("complete", True) and after.get("complete", True)
    return {**figures, "before": before, "after": after}


def rate_of(done: Progress, started: float) -> dict[str, Any]:
    seconds = done.at - started
    return {
        "records": done.records,
        "seconds": round(seconds, 3),
        "rate": round(done.records / seconds, 1),
        # False when the budget ran out first; the rate is then over what was committed by then.
        "complete": done.complete,
    }


def offer(
    run: dict[str, Any], bootstrap: str, tickets: Tickets, rate: float, seconds: float, capacity: float
) -> tuple[dict[int, int], dict[int, int], bool]:
    """Offers `rate` tickets/s for `seconds` to one worker's input (`run`: its topics, offsets watcher, worker
    and tickets sent so far), then waits until its group has committed them, for at most 30 s plus three
    times what they take at `capacity`. Returns the input's end offsets before and after, and whether the
    worker drained them all."""
    before = run["offsets"].ends()
    sent = produce_paced(bootstrap, run["topics"].input, tickets, run["sent"], rate, seconds)
    run["sent"] += sent
    ends = run["offsets"].ends()
    budget = 30 + 3 * sent / max(capacity, 1.0)
    drained = run["offsets"].follow(ends, budget, run["worker"].alive, every=0.1)
    return before, ends, drained.complete


def last_metrics(worker: BenchWorker) -> dict[str, Any]:
    events = worker.events("metrics")
    return events[-1] if events else {}


def percentile(values: Sequence[float], pct: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]  # nearest rank
