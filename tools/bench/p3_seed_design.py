"""P3 beyond the seed design: the worker (P2's rate) vs one ticket at a time, a new Generator with the whole
prompt per ticket, schema-guided generation, batch 1, same model."""

from __future__ import annotations

import os
import time
from typing import Any

from tools.bench.measure import progress
from tools.load import Tickets, cpu_seconds
from worker.inference.engine import Engine, InvalidOutput
from worker.inference.genai import og  # with its telemetry off (worker/inference/__init__.py)
from worker.inference.loading import resolve_taxonomy
from worker.settings import InferenceSettings


def measure(tickets: Tickets, count: int) -> dict[str, Any]:
    """One ticket at a time: a new Generator, the whole prompt, schema-guided generation, batch 1."""
    progress(f"P3 seed design: {count} tickets, a new Generator each, guided generation")
    settings = InferenceSettings(mode="generate")
    engine = Engine(settings, *resolve_taxonomy(settings))

    def classify(text: str) -> bool:
        _, ids, _ = engine.prepare(text)
        prompt = engine.prefix_ids + ids
        generator = og.Generator(engine.model, engine.params(guided=True))
        generator.append_tokens(prompt)
        for _ in range(engine.max_answer_tokens + 1):
            if generator.is_done():
                break
            generator.generate_next_token()
        answer = [int(t) for t in generator.get_sequence(0)[len(prompt) :] if int(t) not in engine.eos_ids]
        try:
            engine.parse_answer(engine.decode(answer))
        except InvalidOutput:
            return False
        return True

    classify(tickets.text(0))  # compiles the grammar once, as a long-running seed process would have
    cpu_before = cpu_seconds(os.getpid())
    started = time.monotonic()
    invalid = sum(not classify(tickets.text(index)) for index in range(count))
    seconds = time.monotonic() - started
    cpu = cpu_seconds(os.getpid()) - cpu_before
    return {
        "tickets": count,
        "seconds": round(seconds, 3),
        "rate": round(count / seconds, 1),
        "cpu_ms_per_ticket": round(cpu * 1000 / count, 3),
        "invalid": invalid,
    }
