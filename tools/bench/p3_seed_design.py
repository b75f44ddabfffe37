"""P3 beyond the seed design: the worker (P2's rate) vs one ticket at a time, a new Generator with the whole
prompt per ticket, schema-guided generation, batch 1, same model."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import msgspec

from tools.bench.measure import progress
from tools.load import Tickets, cpu_seconds
from worker.inference.engine import RANDOM_SEED, GenAIEngine
from worker.inference.genai import og  # with its telemetry off (worker/inference/__init__.py)
from worker.inference.loading import resolve_taxonomy
from worker.inference.prompt import INTENT_OPENING
from worker.settings import InferenceSettings

# Enough steps for the longest answer of any taxonomy met here, one character a token.
_ANSWER_STEPS = 160


def measure(tickets: Tickets, count: int) -> dict[str, Any]:
    """One ticket at a time: a new Generator, the whole prompt, schema-guided generation, batch 1."""
    progress(f"P3 seed design: {count} tickets, a new Generator each, guided generation")
    settings = InferenceSettings(mode="generate")
    engine = GenAIEngine(settings, *resolve_taxonomy(settings))

    schema = json.dumps(engine.taxonomy.json_schema())

    def classify(text: str) -> bool:
        """The seed's way: the model writes the whole JSON answer under the runtime's schema guidance."""
        ids, _ = engine.prepare(text)
        prompt = engine.prefix_ids + ids[: len(ids) - len(engine.encode(INTENT_OPENING))]
        params = og.GeneratorParams(engine.model)
        params.set_search_options(max_length=engine.max_length, random_seed=RANDOM_SEED)
        params.set_guidance("json_schema", schema, enable_ff_tokens=False)
        generator = og.Generator(engine.model, params)
        generator.append_tokens(prompt)
        for _ in range(_ANSWER_STEPS):
            if generator.is_done():
                break
            generator.generate_next_token()
        answer = [int(t) for t in generator.get_sequence(0)[len(prompt) :] if int(t) not in engine.eos_ids]
        try:
            decoded = msgspec.json.decode(engine.tokenizer.decode(answer))
        except msgspec.DecodeError:
            return False
        return isinstance(decoded, dict) and decoded.get("intent") in engine.labels

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
