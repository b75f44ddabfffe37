"""P7 the cascade: two workers, the first stage alone and with the escalation stage (`--escalation
triage-encoder`, default threshold): throughput of a burst of BANKING77 test tickets, and what each wrote
(intent accuracy against the tickets' labels, share escalated, escalations skipped by reason)."""

from __future__ import annotations

import collections
import contextlib
from pathlib import Path
from typing import Any

import msgspec

from tools.bench.measure import bracket, group_name, progress
from tools.harness import read_topic
from tools.load import BenchWorker, LabelledTickets, Offsets, new_topics, produce_tickets
from worker.messages import TriageResult

_RUNS: dict[str, list[str]] = {
    "first_stage": ["--escalation", "off"],
    "cascade": [],  # the default: the shipped escalation stage ("auto" with the embedded model's taxonomy)
}


def measure(bootstrap: str, count: int, budget: float, logs: Path) -> dict[str, Any]:
    """Two workers with default settings but the escalation stage, each on its own topics, the same BANKING77
    test tickets: `count` of them as fast as possible until the group committed them, the first stage alone
    before and after the cascade (`bracket`); then what each wrote, read back from its output."""
    tickets = LabelledTickets()
    runs: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as cleanup:
        for name, flags in _RUNS.items():
            (topics,) = new_topics(bootstrap, f"p7-{name}")
            group = group_name(f"p7-{name}")
            worker = BenchWorker(bootstrap, topics, group, logs / f"p7-{name}.log", flags)
            cleanup.callback(worker.stop)
            runs[name] = {"topics": topics, "worker": worker, "group": group, "sent": 0, "burst_end": 0}
        for run in runs.values():
            run["worker"].wait_assigned(timeout=240)
            run["offsets"] = Offsets(bootstrap, run["group"], run["topics"].input)
            cleanup.callback(run["offsets"].close)

        def throughput(name: str, when: str = "") -> dict[str, Any]:
            run, offsets = runs[name], runs[name]["offsets"]
            progress(f"P7 {name}{when}: {count} tickets as fast as possible")
            started = produce_tickets(bootstrap, run["topics"].input, tickets, run["sent"], count)
            run["sent"] += count
            done = offsets.follow(offsets.ends(), budget, run["worker"].alive, every=0.05)
            records, run["burst_end"] = done.records - run["burst_end"], done.records
            return {
                "records": records,
                "seconds": round(done.at - started, 3),
                "rate": round(records / (done.at - started), 1),
                "complete": done.complete,
            }

        before = throughput("first_stage", " (before)")
        cascade_rate = throughput("cascade")
        first_rate = bracket(before, throughput("first_stage", " (after)"))
        cascade_start = runs["cascade"]["worker"].events("cascade_started")
        for run in runs.values():
            run["code"] = run["worker"].stop()
    progress("P7 reading what each worker wrote")
    figures: dict[str, Any] = {"tickets": count, "texts": "BANKING77 test.csv, in file order, repeated"}
    for name, run in runs.items():
        figures[name] = {
            "throughput": first_rate if name == "first_stage" else cascade_rate,
            **_outputs(bootstrap, run["topics"].output, tickets),
            "worker_exit_code": run["code"],
        }
    figures["escalate_below"] = cascade_start[0]["escalate_below"] if cascade_start else None
    figures["ratio"] = round(cascade_rate["rate"] / first_rate["rate"], 3)
    return figures


def _outputs(bootstrap: str, topic: str, tickets: LabelledTickets) -> dict[str, Any]:
    """Intent accuracy of a worker's records against the tickets' labels, and the cascade's fields."""
    decode = msgspec.json.Decoder(TriageResult).decode
    correct = total = escalated = 0
    skipped: collections.Counter[str] = collections.Counter()
    fallbacks: collections.Counter[str] = collections.Counter()
    for message in read_topic(bootstrap, topic):
        value = message.value()
        assert isinstance(value, bytes)
        result = decode(value)
        total += 1
        correct += result.intent == tickets.label(int(result.ticket_id.removeprefix("bench-")))
        escalated += result.stage == "escalation"
        if result.escalation_skipped is not None:
            skipped[result.escalation_skipped] += 1
        if result.fallback_reason is not None:
            fallbacks[result.fallback_reason] += 1
    return {
        "records": total,
        "accuracy": round(correct / max(1, total), 4),
        "escalated_share": round(escalated / max(1, total), 4),
        "escalation_skipped": dict(skipped),
        "fallbacks": dict(fallbacks),
    }
