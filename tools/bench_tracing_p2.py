"""What tracing costs the worker end to end (issue #47): P2's worker measurement (`make bench`,
tools/bench/p2_inference_overhead.py) on one local broker, same code, with tracing off (the default), on with
parent-based 1 % sampling, and on with every ticket sampled, each exporting over OTLP/HTTP to a real
OpenTelemetry Collector (tools/local_collector.py; built with Go once). The modes alternate each round, the
order reversed every other round (tools/bench/worker_modes.py).

`python -m tools.bench_tracing_p2 [--tickets 2000] [--rounds 4]` writes results/tracing-p2.json and .md:
each run's tickets/s and the worker tree's CPU ms per ticket, each mode's totals, their ratios to off, and
how many tickets' process spans the Collector received. End-to-end runs this short vary by 10-15 % from one
to the next on a shared machine; so the tracer's own work on the loop's thread is measured too, alone (every
step of 20,000 tickets begun and ended, the outputs' headers written, spans to memory in batches), in
microseconds per ticket and as a share of the worker's CPU per ticket with tracing off.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from tools.bench.measure import progress
from tools.bench.worker_modes import compare
from tools.load import Tickets, kafka
from tools.local_collector import LocalCollector, collector_binary
from worker.logs import configure_logging
from worker.pipeline.tracing import Step
from worker.settings import LogSettings, PrivacySettings

REPO = Path(__file__).resolve().parents[1]


STEPS: tuple[Step, ...] = ("decode", "queue", "model", "produce", "settle")
# Each mode's sample ratio (None: tracing off).
RATIOS: dict[str, float | None] = {"off": None, "sampled_1pct": 0.01, "sampled_100pct": 1.0}


def _modes(endpoint: str) -> dict[str, list[str]]:
    def sampled(ratio: str) -> list[str]:
        return [
            *("--set", "tracing.exporter=otlp", "--set", f"tracing.endpoint={endpoint}"),
            *("--set", "tracing.protocol=http/protobuf", "--set", f"tracing.sample_ratio={ratio}"),
        ]

    return {mode: [] if ratio is None else sampled(str(ratio)) for mode, ratio in RATIOS.items()}


def _tracer_us_per_ticket(ratio: float | None, tickets: int = 20_000) -> float:
    """The loop thread's tracing work per ticket (None: tracing off), as `OtelTracing` does it for a
    ticket whose steps all run: its spans begun and ended, an output's headers written."""
    from opentelemetry.sdk.trace import TracerProvider, sampling
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from worker.pipeline.tracing import NO_TRACING, Tracing
    from worker.pipeline.work import Headers, Work
    from worker.telemetry.spans import OtelTracing

    provider = None
    tracing: Tracing = NO_TRACING
    if ratio is not None:
        provider = TracerProvider(sampler=sampling.ParentBasedTraceIdRatio(ratio))
        provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
        tracing = OtelTracing(provider, "bench")
    # No trace context, as the bench's tickets: each ticket's sampling is the ratio's decision.
    headers: Headers = [("source", b"bench")]
    started = time.perf_counter()
    for offset in range(tickets):
        work = Work(None, "bench.raw", 0, offset, None, headers, 0.0, 0.0)  # type: ignore[arg-type]
        trace = tracing.ticket(work)
        for step in STEPS:
            trace.begin(step)
            trace.end(step)
        trace.headers(headers)
        trace.finish()
    spent = time.perf_counter() - started
    if provider is not None:
        provider.shutdown()
    return round(spent / tickets * 1e6, 1)


def _markdown(result: dict[str, object]) -> str:
    totals = result["totals"]
    assert isinstance(totals, dict)
    lines = [
        "# Tracing's cost end to end (P2's worker measurement)",
        "",
        f"`{result['command']}` ({result['rounds']} rounds of {result['tickets']} tickets per mode, the "
        "modes alternating; spans exported over OTLP/HTTP to a local OpenTelemetry Collector).",
        "",
        "| mode | tickets/s (all rounds) | ratio to off | worker CPU ms per ticket | process spans received "
        "|",
        "|---|---|---|---|---|",
    ]
    off = totals["off"]["rate"]
    spans = result["spans_received"]
    assert isinstance(spans, dict)
    for mode, total in totals.items():
        lines.append(
            f"| {mode} | {total['rate']} | {total['rate'] / off:.3f} | {total['cpu_ms_per_ticket']} | "
            f"{spans.get(mode, 0)} |"
        )
    tracer = result["tracer_us_per_ticket"]
    assert isinstance(tracer, dict)
    off_cpu_us = totals["off"]["cpu_ms_per_ticket"] * 1000
    lines += [
        "",
        "The tracer's own work on the loop's thread, alone, per ticket (its share of the worker's CPU per "
        "ticket with tracing off):",
        "",
        "| mode | µs per ticket | share |",
        "|---|---|---|",
        *(f"| {mode} | {us} | {us / off_cpu_us:.2%} |" for mode, us in tracer.items()),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench_tracing_p2", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--tickets", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=REPO / "results", help="folder for tracing-p2.*")
    args = parser.parse_args(argv)
    configure_logging(LogSettings(level="warning"), PrivacySettings())
    tickets = Tickets()
    binary = collector_binary()
    with (
        tempfile.TemporaryDirectory() as tmp,
        LocalCollector(binary, Path(tmp)) as collector,
        kafka(progress) as bootstrap,
    ):
        modes = _modes(collector.http_endpoint)
        measured = compare(bootstrap, tickets, args.tickets, args.rounds, modes, Path(tmp), "tracing")
        # One `process <input topic>` span per sampled ticket; each run has its own input topic, named
        # after its mode (tools.load.new_topics: bench.tracing-<mode>-<round>.<tag>.raw).
        received: dict[str, int] = {}
        for span in collector.spans():
            if span["name"].startswith("process "):
                mode = next((m for m in modes if f"-{m}-" in span["name"]), "unknown")
                received[mode] = received.get(mode, 0) + 1
    totals = measured["totals"]
    tracer = {mode: _tracer_us_per_ticket(ratio) for mode, ratio in RATIOS.items()}
    result: dict[str, object] = {
        "command": "python -m tools.bench_tracing_p2 " + " ".join(sys.argv[1:] if argv is None else argv),
        "tickets": args.tickets,
        "rounds": args.rounds,
        **measured,
        "ratio_to_off": {mode: round(t["rate"] / totals["off"]["rate"], 3) for mode, t in totals.items()},
        "spans_received": received,
        "tracer_us_per_ticket": tracer,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tracing-p2.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (args.out / "tracing-p2.md").write_text(_markdown(result), encoding="utf-8")
    print(_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
