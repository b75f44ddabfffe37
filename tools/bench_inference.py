"""Measure the inference engine's design choices; every figure is a ratio against a baseline of the same run.

    .venv/bin/python -m tools.bench_inference [--model tests/models/tiny] [--requests 200] [--json OUT]

1. prefix reuse: one prefix-prefilled context (`rewind_to`) vs a new Generator per ticket (full prefill),
   in score and generate mode;
2. pools: 1 context in this process (baseline) vs the thread pool vs the process pool, N = cores; plus the
   largest gap a 1 ms ticker thread of this process sees meanwhile (what a Kafka poll loop would suffer);
3. static batches of 1 / 8 / 32 in generate mode (batch 1 = baseline).
Absolute req/s depend on the machine and its load; the ratios are what docs/design.md quotes.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import msgspec

from tools import REPO
from worker.classification import ClassifyRequest
from worker.inference.batch import BatchRunner
from worker.inference.engine import GenAIEngine
from worker.inference.genai import og  # with its telemetry off (worker/inference/__init__.py)
from worker.inference.loading import resolve_taxonomy
from worker.inference.pool import open_pool
from worker.settings import InferenceSettings

TICKETS = [
    "I am still waiting on my card, it has been two weeks. What should I do?",
    "My transfer has not reached my friend yet, can you check it?",
    "Why was I charged a fee for my card payment abroad?",
    "I lost my card yesterday and I think someone is using it.",
]


def _ticket(index: int) -> str:
    return TICKETS[index % len(TICKETS)] + f" (ref {index})"


def _rate(count: int, seconds: float) -> float:
    return round(count / seconds, 1)


def _engine(settings: InferenceSettings) -> GenAIEngine:
    """The engine as a pool assembles it: its taxonomy resolved, then the model loaded."""
    return GenAIEngine(settings, *resolve_taxonomy(settings))


def prefix_reuse(settings: InferenceSettings, requests: int) -> dict[str, float]:
    figures: dict[str, float] = {}
    for mode in ("score", "generate"):
        engine = _engine(msgspec.structs.replace(settings, mode=mode))
        context = engine.new_context()
        started = time.perf_counter()
        for index in range(requests):
            context.classify(ClassifyRequest(index, _ticket(index), time.monotonic() + 60))
        reused = _rate(requests, time.perf_counter() - started)
        started = time.perf_counter()
        for index in range(requests):
            # What a context-less engine does: a new Generator and the whole prompt for every ticket.
            ids, _ = engine.prepare(_ticket(index))
            generator = og.Generator(engine.model, engine.params())
            generator.append_tokens(engine.prefix_ids)
            context._generator = generator
            if mode == "score":
                context._label_probs(ids, time.monotonic() + 60)
            else:
                context._walk(ids, time.monotonic() + 60)
        scratch = _rate(requests, time.perf_counter() - started)
        figures[f"{mode}_reuse_req_s"] = reused
        figures[f"{mode}_scratch_req_s"] = scratch
        figures[f"{mode}_reuse_speedup"] = round(reused / scratch, 2)
    figures["prefix_tokens"] = len(engine.prefix_ids)
    return figures


def pools(settings: InferenceSettings, requests: int) -> dict[str, float]:
    size = os.cpu_count() or 1
    engine = _engine(settings)
    context = engine.new_context()
    started = time.perf_counter()
    for index in range(requests):
        context.classify(ClassifyRequest(index, _ticket(index), time.monotonic() + 60))
    baseline = _rate(requests, time.perf_counter() - started)
    figures: dict[str, float] = {"pool_size": size, "one_context_req_s": baseline}
    for kind in ("thread", "process"):
        pool_settings = msgspec.structs.replace(settings, pool=kind, pool_size=size)
        with open_pool(pool_settings, *resolve_taxonomy(pool_settings)) as pool:
            gaps: list[float] = []
            stop = threading.Event()

            def tick(stop: threading.Event = stop, gaps: list[float] = gaps) -> None:
                last = time.perf_counter()
                while not stop.is_set():
                    time.sleep(0.001)
                    now = time.perf_counter()
                    gaps.append(now - last)
                    last = now

            ticker = threading.Thread(target=tick)
            ticker.start()
            started = time.perf_counter()
            for index in range(requests):
                pool.submit(ClassifyRequest(index, _ticket(index), time.monotonic() + 60))
            done = 0
            while done < requests:
                done += len(pool.poll(0.05))
            elapsed = time.perf_counter() - started
            stop.set()
            ticker.join()
        figures[f"{kind}_pool_req_s"] = _rate(requests, elapsed)
        figures[f"{kind}_pool_vs_one_context"] = round(requests / elapsed / baseline, 2)
        figures[f"{kind}_pool_max_ticker_gap_ms"] = round(max(gaps) * 1000, 1)
    return figures


def batches(settings: InferenceSettings, requests: int) -> dict[str, float]:
    engine = _engine(msgspec.structs.replace(settings, mode="generate"))
    runner = BatchRunner(engine)
    figures: dict[str, float] = {}
    baseline = 0.0
    for size in (1, 8, 32):
        started = time.perf_counter()
        for first in range(0, requests, size):
            chunk = [
                ClassifyRequest(i, _ticket(i), time.monotonic() + 60)
                for i in range(first, min(first + size, requests))
            ]
            runner.classify_batch(chunk) if size > 1 else runner._generate(chunk, time.monotonic())
        rate = requests / (time.perf_counter() - started)
        baseline = baseline or rate
        figures[f"batch_{size}_generate_req_s"] = round(rate, 1)
        figures[f"batch_{size}_vs_batch_1"] = round(rate / baseline, 2)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(REPO / "tests" / "models" / "tiny"))
    parser.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--only", choices=["prefix", "pools", "batches"], action="append")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    settings = InferenceSettings(model=args.model, provider=args.provider)
    figures: dict[str, object] = {"model": args.model, "provider": args.provider, "cores": os.cpu_count()}
    sections = {"prefix": prefix_reuse, "pools": pools, "batches": batches}
    for name in args.only or list(sections):
        figures[name] = sections[name](settings, args.requests)
        print(json.dumps({name: figures[name]}), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
