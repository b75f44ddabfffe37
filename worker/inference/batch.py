"""Static batches for the `batch` pool: guided generation of up to `batch_size` tickets in one Generator.

On a GPU a batch-1 step is launch-bound, so B rows cost little more than one (measured on an H200: batch 32
generate 9.5x the requests/s of batch 1). Rows are the full prompt (prefix + ticket), right-padded with the
pad token, from which ORT GenAI derives the attention mask; every row matched its single run (measured).
A batch has no prefix reuse: ORT GenAI only rewinds a batch to length 0.

`score` requests are served one by one by the runner's prefix context (see pool.py for why).
"""

from __future__ import annotations

import math
import time

import numpy as np
import structlog

from worker.classification import Classification, ClassifyRequest
from worker.inference.engine import Engine, InvalidOutput, log_softmax
from worker.inference.genai import og
from worker.messages import FallbackReason

log = structlog.get_logger(__name__)


class BatchRunner:
    """Runs a list of requests as one static batch (generate mode) or through one context (score mode)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.context = engine.new_context()
        self.context.classify(ClassifyRequest(-1, "Warm-up: where is my card?", time.monotonic() + 60.0))
        if engine.settings.mode == "generate":  # warm the batched path too
            self.classify_batch([ClassifyRequest(-1, "warm-up", time.monotonic() + 60.0)] * 2)

    def classify_batch(self, requests: list[ClassifyRequest]) -> list[Classification]:
        """One result per request, in order; never raises."""
        if self.engine.settings.mode == "score" or len(requests) == 1:
            return [self.context.classify(request) for request in requests]
        started = time.monotonic()
        results: list[Classification | None] = [None] * len(requests)
        live = []
        for index, request in enumerate(requests):
            if started >= request.deadline:
                results[index] = self.engine.fallback("overloaded", started)
            else:
                live.append(index)
        if live:
            try:
                for index, result in zip(
                    live, self._generate([requests[i] for i in live], started), strict=True
                ):
                    results[index] = result
            except Exception:
                log.exception("model error in a batch", size=len(live))
                for index in live:
                    results[index] = self.engine.fallback("model_error", started)
        return [r if r is not None else self.engine.fallback("model_error", started) for r in results]

    def _generate(self, requests: list[ClassifyRequest], started: float) -> list[Classification]:
        engine = self.engine
        prepared = [engine.prepare(request.text) for request in requests]
        rows = [engine.prefix_ids + generate_ids for _, generate_ids, _ in prepared]
        width = max(len(row) for row in rows)
        pad = int(engine.tokenizer.pad_token_id)
        batch = np.full((len(rows), width), pad, dtype=np.int32)
        for index, row in enumerate(rows):
            batch[index, : len(row)] = row
        generator = og.Generator(engine.model, engine.params(guided=True, batch_size=len(rows)))
        generator.append_tokens(batch)
        count = len(rows)
        finished_at: list[float | None] = [None] * count
        expired = [False] * count
        probs: list[list[float]] = [[] for _ in range(count)]
        steps = 0
        while steps <= engine.max_answer_tokens and not generator.is_done():
            now = time.monotonic()
            for index, request in enumerate(requests):
                if finished_at[index] is None and now >= request.deadline:
                    expired[index] = True
            if all(finished_at[i] is not None or expired[i] for i in range(count)):
                break
            logits = log_softmax(generator.get_logits()[:, -1])
            generator.generate_next_token()
            chosen = generator.get_next_tokens()
            steps += 1
            for index in range(count):
                if finished_at[index] is None and not expired[index]:
                    probs[index].append(math.exp(float(logits[index, int(chosen[index])])))
                    if self._answer_text(generator, index, width).endswith("}"):
                        finished_at[index] = time.monotonic()
        results = []
        for index in range(len(requests)):
            _, _, truncated = prepared[index]
            text = self._answer_text(generator, index, width)
            reason: FallbackReason | None = "deadline_exceeded" if expired[index] else None
            if reason is None:
                try:
                    intent, priority = engine.parse_answer(text)
                except InvalidOutput:
                    reason = "invalid_output"
            if reason is not None:
                results.append(engine.fallback(reason, started, truncated))
                continue
            tokens = self._answer_tokens(generator, index, width)
            confidence = engine.label_confidence(tokens, probs[index], intent)
            end = finished_at[index] or time.monotonic()
            results.append(
                Classification(
                    intent=intent,
                    priority=priority,
                    confidence=confidence,
                    scores={intent: confidence},
                    model=engine.model_id,
                    latency_ms=(end - started) * 1000.0,
                    truncated=truncated,
                    taxonomy=engine.taxonomy_mark,
                )
            )
        return results

    def _answer_tokens(self, generator: og.Generator, index: int, width: int) -> list[int]:
        stop = self.engine.eos_ids | {int(self.engine.tokenizer.pad_token_id)}
        tokens = []
        for token in generator.get_sequence(index)[width:]:
            if int(token) in stop:
                break
            tokens.append(int(token))
        return tokens

    def _answer_text(self, generator: og.Generator, index: int, width: int) -> str:
        return self.engine.decode(self._answer_tokens(generator, index, width))
