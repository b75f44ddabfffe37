"""The detector's share of the worker's end-to-end throughput (issue #33): P2's worker measurement (`make
bench`, tools/bench/p2_inference_overhead.py) on one local broker, alternating the detector off
(`privacy.detect=[]`, `inference.redact_input=false`) and on (the defaults), same code, in ABBA order.

`python -m tools.bench_privacy_p2 [--tickets 2000] [--rounds 4]` writes results/privacy-p2.json: each run's
tickets/s and the worker tree's CPU ms per ticket, and the totals of each side.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from tools.bench.measure import group_name, progress, rate_of
from tools.load import BenchWorker, Offsets, Tickets, cpu_seconds, kafka, new_topics, produce_tickets
from worker.logs import configure_logging
from worker.settings import LogSettings, PrivacySettings

REPO = Path(__file__).resolve().parents[1]
MODES = {"off": ["--set", "privacy.detect=", "--set", "inference.redact_input=false"], "on": []}


def _run(
    bootstrap: str, tickets: Tickets, count: int, name: str, args: list[str], logs: Path
) -> dict[str, Any]:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench_privacy_p2", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--tickets", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", default=str(REPO / "results" / "privacy-p2.json"))
    args = parser.parse_args(argv)
    configure_logging(LogSettings(level="warning"), PrivacySettings())
    tickets = Tickets()
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp, kafka(progress) as bootstrap:
        for round_ in range(args.rounds):
            order = list(MODES) if round_ % 2 == 0 else list(reversed(MODES))
            for mode in order:
                run = _run(
                    bootstrap, tickets, args.tickets, f"privacy-{mode}-{round_}", MODES[mode], Path(tmp)
                )
                runs[mode].append(run)
                progress(f"{mode} round {round_}: {run['rate']}/s, {run['cpu_ms_per_ticket']} ms CPU/ticket")
    totals = {
        mode: {
            "rate": round(sum(r["records"] for r in done) / sum(r["seconds"] for r in done), 1),
            "cpu_ms_per_ticket": round(sum(r["cpu_ms_per_ticket"] for r in done) / len(done), 3),
        }
        for mode, done in runs.items()
    }
    result = {
        "command": "python -m tools.bench_privacy_p2 " + " ".join(sys.argv[1:] if argv is None else argv),
        "runs": runs,
        "totals": totals,
        "rate_on_over_off": round(totals["on"]["rate"] / totals["off"]["rate"], 3),
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
