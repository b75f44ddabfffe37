"""End-to-end benchmark of the worker (`make bench`): every figure against a baseline of the same run.

    .venv/bin/python -m tools.bench [--quick] [--out results]

Against a real broker (a fresh local one on a free port, or KAFKA_BOOTSTRAP_SERVERS), with the same BANKING77
tickets `{"ticket_id", "body"}` everywhere and an input topic of 3 partitions:

- P1 Kafka overhead: the real `Pipeline`, built here with a classifier that answers at once, vs a bare
  confluent-kafka loop (consume → JSON decode → produce a result-sized record → async commit), same records;
- P2 inference overhead: `triage-worker run` with default settings vs the raw classifier pool; and the
  default path in absolute figures: `triage-worker classify --input` with default settings, tickets/s and
  CPU-ms per ticket of the whole command, beside the same from a pinned older commit (`--baseline-commit`,
  a git worktree in a temporary folder) in the same run, and whether their answers differ;
- P3 beyond the seed design: the worker vs one ticket at a time, a new Generator with the whole prompt per
  ticket, schema-guided generation, batch 1, same model;
- P4 latency under load: 25..200 % of P2's capacity, each for a fixed time, against one worker;
- P5 EDF vs FIFO: two workers, `--scheduling fifo` and `edf`, at 100 and 150 % of P2's capacity with half
  the tickets due 1 s after they are produced and half much later (`metadata.deadline_at`): deadline misses;
- P6 exactly-once vs at-least-once: two workers, `--guarantee at_least_once` and `exactly_once`: throughput
  of a burst, and latency at 70 % of P2's capacity as a read_committed reader sees the results;
- P7 the cascade: two workers, the first stage alone and with the escalation stage (`--escalation
  triage-encoder`, default threshold): throughput of a burst of BANKING77 test tickets, and what each wrote;
- CPU cost: CPU-ms per ticket of the worker's process tree vs the pool's.

Writes bench.json, bench.md, bench-latency.png and bench-timeline.png into --out; `--only p7` runs P7 alone
and writes bench-p7.json and bench-p7.md (`--only p2`: P2 alone, bench-p2.*).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tools.bench import (
    p1_kafka_overhead,
    p2_classify,
    p2_inference_overhead,
    p3_seed_design,
    p4_latency,
    p5_edf_vs_fifo,
    p6_exactly_once,
    p7_cascade,
    report,
)
from tools.bench.measure import bracket, progress
from tools.load import LabelledTickets, Tickets, kafka
from worker.logs import configure_logging
from worker.settings import LogSettings, PrivacySettings

# Issue #58: the code before the wave that slowed the default path (82-84 tickets/s, 24 ms CPU per ticket
# then, on 2 cores), the pin that P2's absolute figures are compared with unless --baseline-commit says other.
BASELINE_COMMIT = "b55fcb5"


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so every `finally` (broker, worker, pool) still runs."""

    def interrupt(_signum: int, _frame: types.FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _p2(
    bootstrap: str, tickets: Tickets, sizes: dict[str, int], logs: Path, baseline_commit: str | None
) -> dict[str, Any]:
    """The worker between two runs of the raw pool (the baseline is their mean); then default `classify`
    from this checkout and `baseline_commit`, in absolute figures."""
    pool_before = p2_inference_overhead.measure_pool(tickets, sizes["p2"])
    worker = p2_inference_overhead.measure_worker(bootstrap, tickets, sizes["p2"], sizes["p2_budget_s"], logs)
    pool = bracket(pool_before, p2_inference_overhead.measure_pool(tickets, sizes["p2"]))
    ratio = round(worker["rate"] / pool["rate"], 3)
    progress(f"P2 ratio {ratio}")
    classify = p2_classify.measure(
        LabelledTickets(), sizes["p2_classify"], sizes["p2_classify_rounds"], baseline_commit
    )
    progress(
        f"P2 classify: {classify['current']['rate']} tickets/s, {classify['current']['cpu_ms_per_ticket']} ms"
    )
    return {"pool": pool, "worker": worker, "ratio": ratio, "classify": classify}


def _p7(bootstrap: str, sizes: dict[str, int], logs: Path) -> dict[str, Any]:
    p7 = p7_cascade.measure(bootstrap, sizes["p7"], sizes["p7_budget_s"], logs)
    progress(f"P7 ratio cascade/first stage {p7['ratio']}")
    return p7


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="small counts and 8 s load levels (< 5 min)")
    parser.add_argument(
        "--out", type=Path, default=Path("results"), help="folder for bench.* (default results)"
    )
    parser.add_argument("--only", choices=["p2", "p7"], help="run one figure alone (writes bench-<figure>.*)")
    parser.add_argument(
        "--baseline-commit",
        default=BASELINE_COMMIT,
        help="the commit P2's default `classify` is compared with in the same run (default "
        f"{BASELINE_COMMIT}, the code before the wave that slowed it); 'none': this checkout alone",
    )
    args = parser.parse_args()
    baseline_commit = None if args.baseline_commit == "none" else args.baseline_commit
    sizes = (
        {
            "p1": 100_000,
            "p1_budget_s": 20,
            "p2": 3_000,
            "p2_budget_s": 60,
            "p2_classify": 500,
            "p2_classify_rounds": 1,
            "p3": 300,
            "p4_level_s": 8,
            "p5_level_s": 6,
            "p6": 1_500,
            "p6_budget_s": 60,
            "p6_level_s": 8,
            "p7": 1_000,
            "p7_budget_s": 300,
        }
        if args.quick
        else {
            "p1": 500_000,
            "p1_budget_s": 120,
            "p2": 20_000,
            "p2_budget_s": 600,
            "p2_classify": 2_000,
            "p2_classify_rounds": 2,
            "p3": 1000,
            "p4_level_s": 60,
            "p5_level_s": 15,
            "p6": 10_000,
            "p6_budget_s": 300,
            "p6_level_s": 30,
            "p7": 6_000,
            "p7_budget_s": 900,
        }
    )
    # The bench's own process logs warnings only (the in-process Pipeline and pool); the workers log JSON.
    configure_logging(LogSettings(level="warning"), PrivacySettings())
    figures: dict[str, Any] = {
        "mode": "quick" if args.quick else "full",
        "command": " ".join(["python", "-m", "tools.bench", *sys.argv[1:]]),
        "machine": report.machine(),
        "sizes": sizes,
        "broker": os.environ.get("KAFKA_BOOTSTRAP_SERVERS") or "local broker started by the bench",
    }
    tickets = Tickets()
    with (
        _sigterm_as_interrupt(),
        tempfile.TemporaryDirectory(prefix="triage-bench-logs-") as tmp,
        kafka(progress) as bootstrap,
    ):
        logs = Path(tmp)
        try:
            if args.only is not None:
                figures[args.only] = (
                    _p2(bootstrap, tickets, sizes, logs, baseline_commit)
                    if args.only == "p2"
                    else _p7(bootstrap, sizes, logs)
                )
                report.write_only(figures, args.out, args.only)
                print((args.out / f"bench-{args.only}.md").read_text())
                return 0
            figures["p1"] = p1_kafka_overhead.measure(bootstrap, tickets, sizes["p1"], sizes["p1_budget_s"])
            progress(f"P1 ratio {figures['p1']['ratio']}")
            p2 = figures["p2"] = _p2(bootstrap, tickets, sizes, logs, baseline_commit)
            figures["p3"] = {"seed": p3_seed_design.measure(tickets, sizes["p3"])}
            figures["p3"]["ratio"] = round(p2["worker"]["rate"] / figures["p3"]["seed"]["rate"], 2)
            progress(f"P3 ratio {figures['p3']['ratio']}")
            figures["p4"] = p4_latency.measure(
                bootstrap, tickets, p2["worker"]["rate"], sizes["p4_level_s"], logs
            )
            figures["p5"] = p5_edf_vs_fifo.measure(bootstrap, p2["worker"]["rate"], sizes["p5_level_s"], logs)
            figures["p6"] = p6 = p6_exactly_once.measure(
                bootstrap,
                tickets,
                p2["worker"]["rate"],
                sizes["p6"],
                sizes["p6_budget_s"],
                sizes["p6_level_s"],
                logs,
            )
            ratios = (p6["throughput_ratio"], p6["p50_ratio"], p6["p99_ratio"])
            progress("P6 ratios EOS/ALO: throughput {}, p50 {}, p99 {}".format(*ratios))
            figures["p7"] = _p7(bootstrap, sizes, logs)
        except BaseException:
            for log in sorted(logs.glob("*.log")):
                print(
                    f"--- tail of {log.name}\n" + "\n".join(log.read_text().splitlines()[-15:]),
                    file=sys.stderr,
                )
            raise
    report.write(figures, args.out)
    progress(f"wrote {args.out}/bench.md, bench.json, bench-latency.png, bench-timeline.png")
    print((args.out / "bench.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
